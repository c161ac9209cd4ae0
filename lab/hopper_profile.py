"""A few launches of one kernel for Nsight Compute: `bash lab/ncu_bwd.sh` (or `ncu --profile-from-start off ...
python lab/hopper_profile.py --impl gluon`).

A lab script (not part of the product: nothing in fagen/ or tests/ imports lab/). Implementations, on the d128
bf16 case given by --mask (s16k, B1 H16): gluon (fagen's Gluon forward), cudnn (SDPA's cuDNN forward),
triton-bwd (fagen's Triton backward) or cudnn-bwd (SDPA's cuDNN backward); the forward that feeds a backward
runs once, before the launches. Run from the repository root.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["gluon", "cudnn", "triton-bwd", "cudnn-bwd"], default="gluon")
    parser.add_argument("--mask", choices=["none", "causal"], default="causal")
    parser.add_argument("--launches", type=int, default=4)
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fagen

    q, k, v = (torch.randn((1, 16, 16384, 128), device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if args.impl == "triton-bwd":
        mod = fagen.load(fagen.KernelSpec(head_dim=128, mask=args.mask, dtype="bf16", direction="bwd"))
        do = torch.randn_like(q)
        out, lse = mod.forward(q, k, v)
        fn = lambda: mod.backward(do, q, k, v, out, lse, scale=128 ** -0.5)  # noqa: E731
    elif args.impl == "cudnn-bwd":
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        do = torch.randn_like(q)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=args.mask == "causal")
        fn = lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)  # noqa: E731
    elif args.impl == "gluon":
        mod = fagen.load(fagen.KernelSpec(head_dim=128, mask=args.mask, dtype="bf16", backend="gluon"))
        fn = lambda: mod.forward(q, k, v)  # noqa: E731
    else:
        def fn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=args.mask == "causal")
    fn()  # warm-up: compiles and autotuning stay outside the profiled range
    torch.cuda.synchronize()
    # ncu --profile-from-start off profiles these only. Not an NVTX range: NVTX ranges are per thread, and autograd
    # launches cuDNN's backward from its own device thread (the range saw none of its kernels: ncu exit 6).
    torch.cuda.cudart().cudaProfilerStart()
    for _ in range(args.launches):
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
