"""Why the mods suite's "softcap as score_mod" row reads its backward 5-6% slower than the softcap switch although
the mod lowers to that switch (issue 26; H100 1.055x, H200 1.064x), while the same mod with lowering off runs
faster than the switch (H200: bwd 3.46 against 3.78 ms). One process, the suite's shape (B1 H16 S8192 d128 bf16, no
mask): for the switch (softcap=30.0), the mod lowered, and the mod with lowering off, the modules fagen.attention
loads, the kernels of one backward by torch.profiler, and the backward (autograd.grad on a kept graph, as the suite
times it) in interleaved rounds, medians and per-round ratios to the switch.

    PYTHONPATH=$PWD python3 scripts/gpu_softcap_mod_s18.py      # ~30 s on an H100/H200
"""
from __future__ import annotations

import statistics
import sys

import torch

import fagen
from fagen.bench.gym_mods import generate_tanh_softcap
from fagen.mods import lower
from fagen.runtime import loader


def main() -> int:
    dev = "cuda"
    torch.manual_seed(0)
    shape = (1, 16, 8192, 128)
    q, k, v = (torch.randn(shape, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    sides = {"switch": (True, dict(softcap=30.0)), "mod": (True, dict(score_mod=generate_tanh_softcap(30.0))),
             "mod-nolower": (False, dict(score_mod=generate_tanh_softcap(30.0)))}
    seen, orig = [], loader.load

    def spy(spec, *a, **kw):
        seen.append(getattr(spec, "name", str(spec)))
        return orig(spec, *a, **kw)

    loader.load = spy
    graphs, grads = {}, {}
    for name, (lowering, kw) in sides.items():
        lower.ENABLED = lowering
        seen.clear()
        out = fagen.attention(q, k, v, **kw)
        g = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        torch.cuda.synchronize()
        graphs[name], grads[name] = out, g
        print(f"{name}: loads {seen}; out {out.shape}", flush=True)
    lower.ENABLED = True
    for name in ("mod", "mod-nolower"):
        d = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads[name], grads["switch"]))
        print(f"grads {name} vs switch: max |diff| {d:.2e}")

    def bwd(name):
        return lambda: torch.autograd.grad(graphs[name], (q, k, v), do, retain_graph=True)

    from torch.profiler import ProfilerActivity, profile
    for name in sides:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                bwd(name)()
            torch.cuda.synchronize()
        ks = sorted(((e.key, e.device_time_total / 3 / 1000) for e in prof.key_averages() if e.device_time_total > 0),
                    key=lambda x: -x[1])
        print(f"KERNELS {name}: sum {sum(t for _, t in ks):.3f} ms: " +
              "; ".join(f"{n[:48]} {t:.3f}" for n, t in ks[:6]), flush=True)
    times = {n: [] for n in sides}
    order = list(sides)
    for r in range(9):
        for name in order[r % 3:] + order[:r % 3]:
            f = bwd(name)
            for _ in range(2):
                f()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(10):
                f()
            e.record()
            torch.cuda.synchronize()
            times[name].append(s.elapsed_time(e) / 10)
    for name in sides:
        ratios = [t / b for t, b in zip(times[name], times["switch"])]
        print(f"{name:12s} bwd {statistics.median(times[name]):.4f} ms; / switch per round median "
              f"{statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
