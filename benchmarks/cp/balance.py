"""The balance of fagen.distributed's document plans on long-tailed length mixes (host only, no GPU):

    python benchmarks/cp/balance.py > benchmarks/cp/balance.md

For each length distribution (lengths between 128 and 128k tokens, drawn until the packed sequence is full; the last
document is cut to fit), total length and balance, over 8 ranks and 10 seeds: the worst seed's ratio of the ideal
(total visible causal pairs / 8) to the busiest rank's pairs, the same against a ring that waits for its slowest rank
at every step, the same with pairs counted in whole 128 x 128 kernel tiles, and the busiest rank's tokens / the mean.
"""

import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fagen.distributed.packing import BALANCES, plan_documents  # noqa: E402

DISTS = {
    "log-uniform": lambda rng: math.exp(rng.uniform(math.log(128), math.log(131072))),
    "log-normal (median 2k, sigma 1.5)": lambda rng: rng.lognormvariate(math.log(2048), 1.5),
    "Pareto (alpha 0.5, from 128)": lambda rng: 128 * (1 - rng.random()) ** -2,
}


def lengths(total, rng, draw):
    out = []
    while sum(out) < total:
        out.append(min(max(128, min(131072, int(draw(rng)))), total - sum(out)))
    return out


def main(world=8, seeds=10):
    print("| lengths | tokens | docs (mean) | balance | pairs ratio | ring-step ratio | 128-tile ratio "
          "| tokens max/mean | chunks (mean) |\n|---|---|---:|---|---:|---:|---:|---:|---:|")
    for name, draw in DISTS.items():
        for total in (1 << 17, 1 << 19, 1 << 20):
            docs = [lengths(total, random.Random(seed), draw) for seed in range(seeds)]
            for balance in BALANCES:
                stats = []
                for ls in docs:
                    cu = [0]
                    for n in ls:
                        cu.append(cu[-1] + n)
                    stats.append(plan_documents(cu, world, balance=balance, mask="causal").balance_stats())
                worst = {k: min(s[k] for s in stats) for k in ("ratio", "ring_ratio", "tile_ratio")}
                print(f"| {name} | {total // 1024}k | {sum(map(len, docs)) / seeds:.0f} | {balance} | "
                      f"{100 * worst['ratio']:.1f}% | {100 * worst['ring_ratio']:.1f}% | "
                      f"{100 * worst['tile_ratio']:.1f}% "
                      f"| {max(s['tokens'] for s in stats):.3f} | {sum(s['chunks'] for s in stats) / seeds:.0f} |")


if __name__ == "__main__":
    main()
