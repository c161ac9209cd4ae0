"""Why the mods suite's sliding-window row read fagen's backward at 0.85-1.23 ms in some rounds and 0.53 in others
(benchmarks/s16/mods.json): the document row and the window row run as the suite runs them (fagen.bench.mods.mod_rows, 5 rounds), twice, with every
timed part followed by three profiled calls: its median (as the suite reads it), the kernels' device time a call and
the wall time a call (synchronized), so a slow round shows as kernels or as host.

    PYTHONPATH=$PWD python3 scripts/gpu_window_flaky_s16.py
"""

from __future__ import annotations

import time

import torch

import fagen.bench.mods as mods

_orig = mods._time
N = [0]


def _time(fn, device, rep_ms, memo=None, rounds=1):
    ms = _orig(fn, device, rep_ms, memo, rounds)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 3 * 1e3
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    dev = sum(e.device_time for e in ev) / 3 / 1e3
    top = sorted(((e.device_time / 3 / 1e3, e.name[:28]) for e in ev), reverse=True)
    names = {}
    for t, n in top:
        names[n] = names.get(n, 0) + t
    tops = ", ".join(f"{n} {t:.3f}" for n, t in sorted(names.items(), key=lambda x: -x[1])[:4])
    print(f"part {N[0]:3d}: median {ms:.3f} ms | profiled: kernels {dev:.3f} ms, wall {wall:.3f} ms a call | {tops}",
          flush=True)
    N[0] += 1
    return ms


mods._time = _time


def main():
    print(torch.cuda.get_device_name(), flush=True)
    shape = mods.ModsShape() if hasattr(mods, "ModsShape") else None
    for run in range(2):
        print(f"-- run {run}", flush=True)
        rows = mods.mod_rows("cuda", shape, only={"document+causal", "sliding-window+causal"}, rounds=5)
        for r in rows:
            print(r["case"], "fagen bwd rounds", r.get("fagen", {}).get("bwd_rounds_ms"), "flex",
                  r.get("flex", {}).get("bwd_rounds_ms"), r.get("error", ""), flush=True)


if __name__ == "__main__":
    main()
