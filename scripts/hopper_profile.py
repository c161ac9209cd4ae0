"""A few launches of one forward for Nsight Compute: `ncu ... python scripts/hopper_profile.py --impl hopper`.

--impl hopper (the Gluon kernel, config from --config JSON) or cudnn (SDPA's cuDNN backend), on the
d128 bf16 case given by --mask (none: s16k; causal: s16k), B1 H16.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["hopper", "cudnn"], default="hopper")
    parser.add_argument("--mask", choices=["none", "causal"], default="causal")
    parser.add_argument("--config", default="{}", help="HopperConfig overrides as JSON")
    parser.add_argument("--launches", type=int, default=4)
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn((1, 16, 16384, 128), device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if args.impl == "hopper":
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
