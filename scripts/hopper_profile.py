"""A few launches of one kernel for Nsight Compute: `ncu ... python scripts/hopper_profile.py --impl hopper`.

--impl hopper (the Gluon forward, config from --config JSON) or cudnn (SDPA's cuDNN backend), on the d128 bf16
case given by --mask (none: s16k; causal: s16k), B1 H16. The backward: --impl gluon-bwd (fagen's Gluon backward),
triton-bwd (fagen's Triton backward, the default) or cudnn-bwd (SDPA's cuDNN backward), same case; the forward
that feeds it runs once, before the timed launches.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["hopper", "cudnn", "gluon-bwd", "triton-bwd", "cudnn-bwd"],
                        default="hopper")
    parser.add_argument("--mask", choices=["none", "causal"], default="causal")
    parser.add_argument("--config", default="{}", help="HopperConfig overrides as JSON")
    parser.add_argument("--launches", type=int, default=4)
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn((1, 16, 16384, 128), device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if args.impl in ("gluon-bwd", "triton-bwd"):
        import fagen
        mod = fagen.load(fagen.KernelSpec(head_dim=128, mask=args.mask, dtype="bf16", direction="bwd",
                                          **({"backend": "gluon"} if args.impl == "gluon-bwd" else {})))
        do = torch.randn_like(q)
        out, lse = mod.forward(q, k, v)
        fn = lambda: mod.backward(do, q, k, v, out, lse, scale=128 ** -0.5)
    elif args.impl == "cudnn-bwd":
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        do = torch.randn_like(q)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=args.mask == "causal")
        fn = lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)
    elif args.impl == "hopper":
        import hopper_render
        mod = hopper_render.load(**dict(json.loads(args.config), head_dim=128, mask=args.mask))
        fn = lambda: mod.forward(q, k, v)
    else:
        def fn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=args.mask == "causal")
    for _ in range(args.launches):
        fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
