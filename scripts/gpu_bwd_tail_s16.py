"""What the d128 full backward's last wave costs (issue 28; docs/hopper.md, "The d128 full backward's last wave
(sixteenth session)", next step 2): the product's backward, both modes, and cuDNN's at B1 H16 d128 full over
S = 16384 (2048 tiles of 128 keys on 132 SMs: 15.5 waves, the last half empty) and S = 16896 (2112 tiles: 16 full
waves), timed in rotated passes in one process. If the tail costs what the lock-step model says (~3%), fagen's TF/s
rise by about that much from 16384 to 16896 where cuDNN's (another schedule) need not.

    PYTHONPATH=$PWD python3 scripts/gpu_bwd_tail_s16.py [--passes 5]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bwd_timing as bt  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=5)
    args = ap.parse_args()
    import torch
    import triton
    import fagen
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    rows, fns = [], {}
    for s in (16384, 16896):
        q, k, v, do = bt.inputs(128, 1, 16, 16, s, s, seed=s)
        flops = 2.5 * 4 * 16 * s * s * 128
        for name in ("det", "nondet", "cudnn"):
            if name == "cudnn":
                fn = bt.cudnn_backward(q, k, v, do, False)
            else:
                qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
                out = fagen.attention(qq, kk, vv, deterministic=(name == "det"))

                def fn(out=out, qq=qq, kk=kk, vv=vv, do=do):
                    return torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)
            fn()
            torch.cuda.synchronize()
            label = f"{name} S{s}"
            rows.append(label)
            fns[label] = (fn, flops)
    tfs = {r: [] for r in rows}
    for _, label in bt.rotated(rows, args.passes):
        fn, flops = fns[label]
        ms = triton.testing.do_bench(fn, warmup=25, rep=100)
        tfs[label].append(flops / ms / 1e9)
    print("| row | passes TF/s | median |")
    print("|---|---|---:|")
    med = {}
    for r in rows:
        med[r] = bt.median(tfs[r])
        print(f"| {r} | {' / '.join(f'{x:.0f}' for x in tfs[r])} | {med[r]:.0f} |")
    for name in ("det", "nondet", "cudnn"):
        a, b = med[f"{name} S16384"], med[f"{name} S16896"]
        per = [y / x for x, y in zip(tfs[f"{name} S16384"], tfs[f"{name} S16896"])]
        print(f"{name}: S16896 / S16384 TF/s = {b / a:.3f} (per pass median {bt.median(per):.3f}, "
              f"range {min(per):.3f}-{max(per):.3f})")


if __name__ == "__main__":
    main()
