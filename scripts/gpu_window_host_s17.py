"""Where the window row's host time goes, call by call (issue 26's sliding-window row; docs/mods.md "The window
row's host path (seventeenth session)"): fagen.attention with the window mask_mod (lowered to causal+window(1024,
0)), B1 H16 S8192 d128 bf16, as the mods suite calls it. The GPU is kept busy by torch.cuda._sleep first, so every
number is the host's alone (the script checks the GPU was still busy at the end). For the forward (no grad) and the
backward (torch.autograd.grad of a kept graph) it prints the host time a call, then each instrumented function's
inclusive time a call (wrappers on the module globals: a wrapper adds well under a microsecond), and baselines:
torch.empty / zero_ / a view / a cached 68 MB new_empty.

    PYTHONPATH=$PWD python3 scripts/gpu_window_host_s17.py [--n 200]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import torch

import fagen

TIMES: dict = collections.defaultdict(int)
COUNTS: dict = collections.defaultdict(int)


def wrap(owner, name, label=None):
    fn = getattr(owner, name, None)
    if fn is None or getattr(fn, "_timed", False):
        return
    label = label or f"{getattr(owner, '__name__', type(owner).__name__).rpartition('.')[2][:18]}.{name}"

    def timed(*a, **kw):
        t0 = time.perf_counter_ns()
        try:
            return fn(*a, **kw)
        finally:
            TIMES[label] += time.perf_counter_ns() - t0
            COUNTS[label] += 1

    timed._timed = True
    setattr(owner, name, timed)


def busy(n_calls_ms: float):
    """Queue GPU work long enough that the host never waits on the device."""
    torch.cuda._sleep(int(2.0e6 * max(n_calls_ms, 1.0) * 3))  # ~cycles at ~2 GHz, 3x the host's estimate


def host_per_call(fn, n):
    torch.cuda.synchronize()
    busy(n * 1.0)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e3
    e = torch.cuda.Event()
    e.record()
    still_busy = not e.query()
    torch.cuda.synchronize()
    return host, still_busy


def report(title, n):
    rows = sorted(TIMES.items(), key=lambda kv: -kv[1])
    print(f"  {title}: inclusive us a call (calls a call)")
    for label, ns in rows:
        print(f"    {label:<44} {ns / n / 1e3:8.1f}  ({COUNTS[label] / n:.0f})")
    TIMES.clear()
    COUNTS.clear()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--ab", action="store_true", help="A/B of the kept workspace (_BWD_WS_KEEP) instead")
    opts = ap.parse_args()
    n = opts.n
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, 16, 8192, 128, generator=g, device="cuda").bfloat16() for _ in range(4))

    def mask_mod(b, h, qi, ki):
        return (qi >= ki) & (qi - ki <= 1024)

    with torch.no_grad():
        fagen.attention(q, k, v, mask_mod=mask_mod)
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fagen.attention(ql, kl, vl, mask_mod=mask_mod)
    from fagen.runtime import modded

    print("lowered to", modded.LOWERED[0] if modded.LOWERED else None, flush=True)

    def fwd():
        with torch.no_grad():
            return fagen.attention(q, k, v, mask_mod=mask_mod)

    def bwd():
        return torch.autograd.grad(out, (ql, kl, vl), do, retain_graph=True)

    for f in (fwd, bwd):
        for _ in range(10):
            f()
    torch.cuda.synchronize()
    mods = [m for name, m in sys.modules.items() if "_win_" in name and "gluon" in name]
    print("modules:", ", ".join(sorted(m.__name__.rpartition(".")[2][:60] for m in mods)), flush=True)

    for title, f in (("forward (no grad)", fwd), ("backward (autograd.grad)", bwd)):
        host, ok = host_per_call(f, n)
        print(f"{title}: host {host * 1e3:.1f} us a call (GPU still busy at the end: {ok})", flush=True)
    if opts.ab:
        return ab(mods, bwd, n)

    # instrumented
    import fagen.runtime.api as api

    for name in ("_as_switches", "_modded", "resolve"):
        wrap(api, name)
    for m in mods:
        for name in ("attention", "forward", "_launch_forward", "_call", "backward", "_launch_backward", "_bwd_host",
                     "_run_backward_fast", "_bwd_workspace", "_bwd_views", "_gluon_run", "_launch_entry", "_expand",
                     "_dense", "_score_launch", "_check_qkv", "_check_scores", "_check_mask_inputs"):
            wrap(m, name)
        if hasattr(m, "_Attention"):
            wrap(m._Attention, "backward", "_Attention.backward")
            wrap(m._Attention, "forward", "_Attention.forward")
    wrap(torch.autograd, "grad", "torch.autograd.grad")
    for title, f in (("forward (no grad)", fwd), ("backward (autograd.grad)", bwd)):
        host, ok = host_per_call(f, n)
        print(f"{title}, instrumented: host {host * 1e3:.1f} us a call (busy: {ok})", flush=True)
        report(title, n)

    host, ok = host_per_call(lambda: torch.empty((1, 16, 8192, 128), dtype=torch.bfloat16, device="cuda"), n)
    print(f"baseline torch.empty (32 MB): {host * 1e3:.1f} us", flush=True)
    buf = torch.empty(1 << 20, device="cuda")
    host, ok = host_per_call(lambda: buf.zero_(), n)
    print(f"baseline zero_: {host * 1e3:.1f} us", flush=True)
    host, ok = host_per_call(lambda: buf[:4096].view(64, 64), n)
    print(f"baseline slice + view: {host * 1e3:.1f} us", flush=True)
    big = torch.empty((1 << 24,), device="cuda")
    del big
    host, ok = host_per_call(lambda: q.new_empty(17 << 20, dtype=torch.float32), n)
    print(f"baseline new_empty 68 MB (cached): {host * 1e3:.1f} us", flush=True)


def ab(mods, bwd, n):
    """The backward's host time a call and the bench's timed part (timed_calls: the L2 flush before each call,
    CUDA events around it) with the workspace allocated per call (1 << 25, the old default) and kept (1 << 28),
    alternating over 6 passes."""
    import statistics

    from fagen.bench.timing import _zero_flush, timed_calls

    (m, ) = [m for m in mods if hasattr(m, "_BWD_WS_KEEP")]
    res = collections.defaultdict(list)
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    for p in range(6):
        for label, keep in (("per call", 1 << 25), ("kept", 1 << 28))[::1 if p % 2 == 0 else -1]:
            m._BWD_WS_KEEP = keep
            bwd()
            res[label + " host us"].append(host_per_call(bwd, n)[0] * 1e3)
            ms = timed_calls(bwd, _zero_flush(torch.device("cuda")), 25, 100, ev, torch.cuda.synchronize)
            res[label + " bench ms"].append(statistics.median(ms))
    for label, vals in res.items():
        print(f"  {label:<18} median {statistics.median(vals):8.3f}  passes " + " ".join(f"{x:.3f}" for x in vals))


if __name__ == "__main__":
    main()
