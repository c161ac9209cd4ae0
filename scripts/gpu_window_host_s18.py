"""The window row's backward with and without the launch memo, in one process (issue 26; docs/mods.md "The window
row's host path (eighteenth session)", [Note] Launch memo in fagen/templates/host/gluon_bwd_launch.py). The mods
suite's sliding-window+causal row: fagen.attention with the window mask_mod (lowered to causal + window (1024, 0)),
B1 H16 S8192 d128 bf16, its backward as torch.autograd.grad of a kept graph. Six alternating passes of the memo on
and off (the module's _BWD_MEMO), each pass:
  - HOST: the host time a backward call with the GPU kept busy (torch.cuda._sleep first; as gpu_window_host_s17.py,
    which checks the GPU was still busy at the end);
  - BENCH: the suite's timed call (fagen.bench.timing.timed_calls: the 256 MB zero flush, events around each call,
    calls queued without a sync), median ms;
then the gradients of both paths compared bitwise (the memo replays the same launches: they must be equal).

    PYTHONPATH=$PWD python3 scripts/gpu_window_host_s18.py [--n 200] [--passes 6]
    PYTHONPATH=$PWD:$PWD/tests python3 scripts/gpu_window_host_s18.py --dry-run   # CPU: the harness's A/B instead
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--passes", type=int, default=6)
    ap.add_argument("--dry-run", action="store_true", help="no GPU: run the CPU harness's A/B (faked launches)")
    a = ap.parse_args()
    if a.dry_run:
        print("dry run: scripts/window_host_cpu_s18.py --ab 2 --n 200 (faked launches, CPU)", flush=True)
        return subprocess.call([sys.executable, os.path.join(HERE, "window_host_cpu_s18.py"), "--ab", "2", "--n",
                                "200"])
    import fagen
    from fagen.bench.timing import _zero_flush, timed_calls
    from gpu_window_host_s17 import host_per_call

    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, 16, 8192, 128, generator=g, device="cuda").bfloat16() for _ in range(4))

    def mask_mod(b, h, qi, ki):
        return (qi >= ki) & (qi - ki <= 1024)

    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fagen.attention(ql, kl, vl, mask_mod=mask_mod)

    def bwd():
        return torch.autograd.grad(out, (ql, kl, vl), do, retain_graph=True)

    for _ in range(10):
        bwd()
    torch.cuda.synchronize()
    mods = [m for name, m in list(sys.modules.items()) if "_win_" in name and hasattr(m, "_BWD_MEMO")]
    (m, ) = mods
    print("module", m.__name__.rpartition(".")[2][:70], "memo", m._BWD_MEMO, flush=True)
    grads = {}
    res = collections.defaultdict(list)
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    for p in range(a.passes):
        for label, on in (("memo off", False), ("memo on", True))[::1 if p % 2 == 0 else -1]:
            m._BWD_MEMO = on
            grads[label] = [t.clone() for t in bwd()]
            host, busy = host_per_call(bwd, a.n)
            res[label + " host us"].append(host * 1e3)
            res[label + " busy"].append(busy)
            ms = timed_calls(bwd, _zero_flush(torch.device("cuda")), 25, 100, ev, torch.cuda.synchronize)
            res[label + " bench ms"].append(statistics.median(ms))
    m._BWD_MEMO = True
    for label, vals in res.items():
        if label.endswith("busy"):
            print(f"  {label:<18} all {all(vals)}")
            continue
        print(f"  {label:<18} median {statistics.median(vals):8.3f}  passes " + " ".join(f"{x:.3f}" for x in vals))
    same = all(torch.equal(x, y) for x, y in zip(grads["memo on"], grads["memo off"]))
    print(f"BITWISE memo on == off: {same}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
