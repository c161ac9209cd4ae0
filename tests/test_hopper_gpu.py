"""The Gluon forward on an H100/H200 against the float64 reference: every mask x gqa, and the score switches.
Skipped elsewhere (Gluon kernels do not run in Triton's interpreter); `fagen verify --backend gluon --device cuda`
runs the property suite on the same machine."""

import pytest
import torch

import fagen
from fagen.spec.kernel import KernelSpec

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def gluon(**fields) -> KernelSpec:
    return KernelSpec(backend="gluon", **{"head_dim": 128, "dtype": "bf16", **fields})


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="runs on an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("head_dim", [128, 64])  # d64 MHA: S a step ahead ([Note] The d64 forward's levers)
def test_matches_the_reference_on_hopper(mask, gqa, head_dim):
    from fagen.spec.axes import DType
    from fagen.verify import reference
    from fagen.verify import tolerances as verify
    mod = fagen.load(gluon(mask=mask, gqa=gqa, head_dim=head_dim))
    g = torch.Generator(device="cuda").manual_seed(7)
    for sq, sk in [(97, 97), (200, 333), (333, 200)]:
        q = torch.randn((2, 2 * gqa, sq, head_dim), generator=g, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn((2, 2, sk, head_dim), generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        out, lse = mod.forward(q, k, v)
        ref_out, ref_lse = reference.attention(q, k, v, mask=mask)
        verify.compare("out", out, ref_out, **verify.TOLERANCE[DType.BF16])
        verify.compare("lse", lse, ref_lse, **verify.LSE_TOLERANCE)
        # fagen.attention without gradients is served by the same kernel
        got = fagen.attention(q, k, v, mask=mask)
        if head_dim == 128:
            assert torch.equal(got, out)
        else:  # d64: below hopper.MIN_WORK pairs fagen.attention keeps the Triton forward (not bit for bit)
            verify.compare("fagen.attention out", got, ref_out, **verify.TOLERANCE[DType.BF16])


# Score switches on the GPU: (switches, [(batch, q heads, kv heads, Sq, Sk, window)]). Ragged lengths, Sq != Sk both
# ways (Sq > Sk: the first rows see no key), windows with a bounded and an unbounded side, a window narrower than a
# block, many tiles per persistent program.
SWITCH_CASES = [
    (("softcap", ), [(2, 4, 2, 97, 97, None), (1, 2, 2, 200, 333, None), (2, 2, 2, 333, 200, None),
                     (16, 4, 4, 1000, 1000, None)]),
    (("window", ), [(2, 4, 2, 97, 97, (10, 0)), (1, 2, 2, 200, 333, (50, 3)), (2, 2, 2, 333, 200, (37, 0)),
                    (1, 2, 2, 1000, 1000, (None, 0)), (16, 4, 4, 1000, 1000, (300, None)),
                    (1, 2, 2, 700, 700, (0, 0))]),
    (("window", "softcap"), [(1, 2, 2, 200, 333, (129, 0)), (2, 2, 2, 333, 200, (37, 0)),
                             (16, 4, 4, 1000, 1000, (256, 0))]),
]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="runs on an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("switches,shapes", SWITCH_CASES)
def test_score_switches_match_the_reference_on_hopper(switches, shapes):
    from fagen.spec.axes import DType
    from fagen.verify import reference
    from fagen.verify import tolerances as verify
    g = torch.Generator(device="cuda").manual_seed(15)
    for b, hq, hkv, sq, sk, window in shapes:
        mod = fagen.load(gluon(mask="causal", gqa=hq // hkv, **{name: True for name in switches}))
        q = torch.randn((b, hq, sq, 128), generator=g, device="cuda", dtype=torch.bfloat16) * 4
        k, v = (torch.randn((b, hkv, sk, 128), generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        kw = dict(window=window) if "window" in switches else {}
        if "softcap" in switches:
            kw["softcap"] = 5.0  # scale * q.k ~ N(0, 16): well into tanh's bend
        out, lse = mod.forward(q, k, v, **kw)
        ref_out, ref_lse = reference.attention(q, k, v, mask="causal", **kw)
        verify.compare("out", out, ref_out, **verify.TOLERANCE[DType.BF16])
        verify.compare("lse", lse, ref_lse, **verify.LSE_TOLERANCE)
        if sq > sk:  # rows before Sq - Sk see no key: out 0, lse -inf
            assert torch.isinf(lse[:, :, :sq - sk]).all() and (out[:, :, :sq - sk] == 0).all()
