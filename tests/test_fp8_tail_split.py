"""The fp8 full-mask forward's tail split (fourteenth session; GluonBackend.variant fp8_tail_split, off by default;
[Note] fp8 tail split in fagen/templates/gluon/fp8_host.py.j2): the render, the rule, and the host path (the two
launches' views, the combine kernel on Triton's interpreter) with the kernel replaced by a float64 attention, so the
test sees exactly what the split adds. The kernel itself against float64 runs in scripts/gpu_fp8full_s14.py on an
H100."""

import pytest
import torch

import fagen
from fagen.runtime.loader import load_source
from fagen.spec.kernel import KernelSpec
from _env import ON_GPU
from test_fp8_wgs import full_128, variant


@pytest.fixture(autouse=True)
def _full_128():  # the 128-key full-mask loop ([Note] fp8 full-mask 192-key steps: FP8_FULL_N192 off here)
    yield from full_128()

E4M3 = torch.float8_e4m3fn


def spec(**fields):
    return KernelSpec(**{"backend": "gluon", "head_dim": 128, "dtype": "fp8_e4m3", "mask": "none", **fields})


def split_module(c, **fields):
    with variant(fp8_tail_split=c):
        sp = spec(**fields)
        return load_source(fagen.generate(sp), f"{sp.name}_test_tail_split{c}")


def test_the_split_renders_only_under_its_switch_and_only_for_the_plain_full_mask():
    """Off (the default) no split code; on, the fp8 full-mask forward without the window (d128, GQA, d64) gets it,
    and causal fp8, the window and bf16 render as before, byte for byte."""
    cases = [dict(), dict(gqa=4), dict(head_dim=64), dict(mask="causal"), dict(window=True), dict(dtype="bf16")]
    with variant(fp8_tail_split=0):
        before = [fagen.generate(spec(**c)) for c in cases]
    assert not any("_split_forward" in s for s in before)
    with variant(fp8_tail_split=8):
        for c, old in zip(cases, before):
            src = fagen.generate(spec(**c))
            if c.get("mask", "none") == "none" and not c.get("window") and c.get("dtype") != "bf16":
                assert "_TAIL_C = 8" in src and src.count("_split_forward(") == 2, c
            else:
                assert src == old, c


def test_the_rule():
    """B1 H16 s16k d128 on 132 SMs: blocks 0..122 of every head in the first launch (1968 tiles, 15 rounds), the
    other 5 over 8 chunks (640 tiles of 1/8: 5 rounds, 0.625 of one); no split where the rounds are whole, for B > 1,
    with seqlens or a tree, keys not a multiple of C blocks, fewer tiles than SMs, or no gain."""
    m = split_module(8)
    assert m._tail_split(1, 16, 128, 16384, 132, True) == (123, 8)
    assert m._tail_split(1, 33, 128, 16384, 132, True) is None  # 4224 tiles: 32 whole rounds
    assert m._tail_split(2, 16, 128, 16384, 132, True) is None
    assert m._tail_split(1, 16, 128, 16384, 132, False) is None
    assert m._tail_split(1, 16, 128, 16384 - 128, 132, True) is None
    assert m._tail_split(1, 1, 100, 16384, 132, True) is None
    assert m._tail_split(1, 16, 8, 16384, 132, True) is None  # 128 tiles < 132
    assert m._tail_split(1, 16, 9, 16384, 132, True) == (8, 8)  # 144 tiles: 2 rounds; split 1 + 1/8
    assert m._tail_split(1, 16, 16, 16384, 132, True) is None  # 256 tiles: 2 rounds; split 1 + 1: no gain


def _perm(cols):
    """Vt's column -> key within each 32 ([Note] fp8 P permutation; transpose_v's PERM)."""
    return (cols & ~31) | (cols & 17) | (((cols >> 1) & 1) << 3) | (((cols >> 2) & 1) << 1) | (((cols >> 3) & 1) << 2)


def _exact_kernel(mod):
    """A stand-in for mod._kernel: float64 attention over (q, k, vt) as the kernel reads them (vt's keys permuted
    within each 32 when the module permutes), writing o and lse (natural log) in place."""
    def kernel(q, k, vt, o, lse, scale, descales, sms, tiles=None):
        (qd, qdh), (kd, kdh), (vd, vdh) = descales
        b, hq, sq, d = q.shape
        if tiles is not None:  # the first `tiles` of the order (heads fastest): whole query blocks of every head here
            assert b == 1 and tiles % hq == 0
            rows = tiles // hq * 128
            kernel(q[:, :, :rows], k, vt, o[:, :, :rows], lse[:, :, :rows], scale, descales, sms)
            return
        hkv, sk = k.shape[1], k.shape[2]
        heads = torch.arange(hq)
        kvh = heads // (hq // hkv)
        qs = qd.double()[heads * (qdh > 0)].view(1, hq, 1, 1)
        ks = kd.double()[kvh * (kdh > 0)].view(1, hq, 1, 1)
        vs = vd.double()[kvh * (vdh > 0)].view(1, hq, 1, 1)
        cols = torch.arange(sk)
        keys = _perm(cols) if mod._P_PERM else cols
        s = (q.double() * qs) @ (k.double()[:, kvh] * ks).transpose(-1, -2) * scale
        p = torch.softmax(s, -1)
        o.copy_((p[..., keys] @ (vt.double()[:, kvh] * vs).transpose(-1, -2)).to(o.dtype))
        lse.copy_(torch.logsumexp(s, -1))
    return kernel


@pytest.mark.skipif(ON_GPU, reason="CPU tensors on the interpreter (the combine kernel is launched on them); "
                                   "the GPU script runs the kernels")
@pytest.mark.parametrize("gqa,per_head", [(1, False), (2, True)])
def test_the_split_forward_is_the_unsplit_one(gqa, per_head):
    """_launch_forward with the split (4 chunks, a 5-SM grid: 18 or 36 tiles, the first launch 5 blocks of every head,
    the last 60 rows over the chunks) against float64 attention on the dequantized inputs: out within bf16's rounding,
    lse to 1e-5 (a unit or two of bf16 on out: the chunks' outputs are rounded before the combine); rows before the split are the stand-in kernel's own (exact), rows after it the combine's."""
    torch.manual_seed(0)
    m = split_module(4, gqa=gqa)
    hkv, sq, sk, d = 3, 700, 1024, 128
    hq = hkv * gqa
    m._kernel = _exact_kernel(m)
    m._NUM_SMS[-1] = 5  # a CPU tensor's get_device()
    assert m._tail_split(1, hq, -(-sq // 128), sk, 5, True) == (5, 4)
    q = (torch.randn(1, hq, sq, d) * 3).to(E4M3)
    k, v = (torch.randn(1, hkv, sk, d).to(E4M3) for _ in range(2))
    scales = [(0.5 + torch.rand(h if per_head else 1)).float() for h in (hq, hkv, hkv)]
    descales = tuple((t, 1 if per_head else 0) for t in scales)
    out, lse = m._launch_forward(q, k, v, d ** -0.5, descales, torch.bfloat16, None, None, None)
    kvh = torch.arange(hq) // gqa
    qd = q.double() * scales[0].double().view(1, -1, 1, 1)
    kd = (k.double() * scales[1].double().view(1, -1, 1, 1))[:, kvh]
    vd = (v.double() * scales[2].double().view(1, -1, 1, 1))[:, kvh]
    s = qd @ kd.transpose(-1, -2) * d ** -0.5
    ref = torch.softmax(s, -1) @ vd
    err = out.double() - ref  # bf16's rounding of the chunks' outputs and of the combined one: a unit or two
    assert err.abs().max().item() <= 2 ** -7 * ref.abs().max().item()
    assert err.pow(2).mean().sqrt().item() <= 2 ** -8 * ref.pow(2).mean().sqrt().item()
    assert (lse.double() - torch.logsumexp(s, -1)).abs().max().item() < 1e-5
