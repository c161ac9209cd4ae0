"""The fp8 KV decode's tiles on the H200 (issue 27, eighteenth session): the serving suite's three fp8 rows (dense
b32 kv8k, dense b8 kv32k, paged16 b32 kv8k) with their default spec and with other block_n / num_warps / num_stages,
each checked against float64 and timed by the suite's own path (`fagen.bench.runner.run`: the copy reference beside
it, the "loop" timing of the copy-relative rows, interleaved rounds), in one process. The H100's run read these rows
at 0.98 / 0.97 / 0.92 of copy; the H200's first run of this session at 0.78 / 0.77 / 0.66.

    PYTHONPATH=$PWD python3 scripts/gpu_fp8kv_s18.py [--rows dense,kv32k,paged] [--grid default,n64,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GRID = {  # tag: spec overrides (the default spec has none)
    "default": (),
    "n64": (("block_n", 64),),
    "n256": (("block_n", 256),),
    "s2": (("num_stages", 2),),
    "s4": (("num_stages", 4),),
    "s5": (("num_stages", 5),),
    "w8": (("num_warps", 8),),
    "n64s4": (("block_n", 64), ("num_stages", 4)),
    "n256s4": (("block_n", 256), ("num_stages", 4)),
    "w8s4": (("num_warps", 8), ("num_stages", 4)),
    "n256w8": (("block_n", 256), ("num_warps", 8)),
    # round B: two warps a program (the paged row's helper read n64 w2 s3 at 0.81 of copy against the default's 0.65)
    "w2": (("num_warps", 2),),
    "n64w2": (("block_n", 64), ("num_warps", 2)),
    "n256w2": (("block_n", 256), ("num_warps", 2)),
    "w2s2": (("num_warps", 2), ("num_stages", 2)),
    "w2s4": (("num_warps", 2), ("num_stages", 4)),
    "n64w2s4": (("block_n", 64), ("num_warps", 2), ("num_stages", 4)),
    "n32w2s4": (("block_n", 32), ("num_warps", 2), ("num_stages", 4)),
    "n32w1s4": (("block_n", 32), ("num_warps", 1), ("num_stages", 4)),
    "n64w1s3": (("block_n", 64), ("num_warps", 1), ("num_stages", 3)),
}
ROWS = {"dense": "decode-d128-kv8k-b32-fp8", "kv32k": "decode-d128-kv32k-b8-fp8",
        "paged": "decode-d128-kv8k-b32-fp8-paged16", "bf16": "decode-d128-kv8k-b32"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="dense,kv32k,paged")
    ap.add_argument("--grid", default=",".join(GRID))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=150.0)
    ap.add_argument("--quick", action="store_true", help="the CPU interpreter at the suites' quick shapes")
    a = ap.parse_args()
    import torch

    from fagen.bench import workloads
    from fagen.bench.cases import BenchOptions
    from fagen.bench.runner import run
    from fagen.bench.serving import serving_rows
    from fagen.bench.workloads import standard_suite

    dev = "cpu" if a.quick else "cuda"
    by = {c.name: c for c in serving_rows(a.quick) + standard_suite(a.quick)}
    cases = []
    for tag in a.grid.split(","):
        for r in a.rows.split(","):
            base = by[ROWS[r]]
            c = dataclasses.replace(base, name=f"{base.name}@{tag}", overrides=GRID[tag])
            if workloads.copy_relative(base):
                workloads.RELATIVE_TARGETS[c.name] = workloads.RELATIVE_TARGETS[base.name]
            cases.append(c)
    opts = BenchOptions(device=dev, impls=("fagen", "copy"), rounds=a.rounds, rep_ms=60.0, warmup_ms=10.0)
    print(torch.cuda.get_device_name() if not a.quick else "cpu (interpreter)", flush=True)
    _, records = run(cases, opts, isolate=False, time_limit=a.time_limit, log=lambda s: None)
    got = {}
    for rec in records:
        got.setdefault(rec["case"], {})[rec["impl"]] = rec
    print(f"{'case@tiles':44s} {'spec':28s} {'fagen GB/s':>10s} {'copy':>7s} {'x copy':>7s}  status")
    bad = 0
    for c in cases:
        f, cp = got.get(c.name, {}).get("fagen", {}), got.get(c.name, {}).get("copy", {})
        g, cg = f.get("gbs"), cp.get("gbs")
        try:
            s = c.spec(dev)[0]
            spec = f"n{s.block_n} w{s.num_warps} s{s.num_stages}"
        except Exception as e:  # noqa: BLE001
            spec = f"({type(e).__name__})"
        x = f"{g / cg:.3f}" if g and cg else "-"
        st = f.get("status", "missing")
        bad += st not in ("ok", "skipped", "unsupported")
        print(f"{c.name:44s} {spec:28s} {g or 0:10.0f} {cg or 0:7.0f} {x:>7s}  {st} {(f.get('note') or '')[:60]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
