"""The fp8 tail split on the product's full mask (twenty-fourth session; GluonBackend.variant fp8_tail_split, off;
[Note] fp8 tail split in fagen/templates/gluon/fp8_host.py.j2): with FP8_FULL_N192 the full mask's steps are 192 keys,
and the rule's old condition (Sk a multiple of C x BLOCK_N) never held at s16k (16384 is no multiple of 384, 768,
1536, 3072); a chunk now needs C x 128 keys (whole 32-key groups of the P permutation, 16-byte TMA strides), and a
chunk's last 192-key step is a ragged one. The render, the rule, the kernel unchanged (the split is host code), and
the host path on the 192-key module with the kernel replaced by float64 attention (tests/test_fp8_tail_split.py's
stand-in), at chunks that are no multiple of 192."""

import re

import pytest
import torch

import fagen
from fagen.backends import GLUON
from fagen.runtime.loader import load_source
from _env import ON_GPU
from test_fp8_tail_split import E4M3, _exact_kernel, spec
from test_fp8_wgs import full_switch, variant


@pytest.fixture(autouse=True)
def _product():  # the product's switch as committed (FP8_FULL_N192 on), FP8_N256 empty
    with full_switch(True):
        yield


def split_module(c, **fields):
    with variant(fp8_tail_split=c):
        sp = spec(**fields)
        return load_source(fagen.generate(sp), f"{sp.name}_test_tail_split_n192_{c}")


def test_the_split_renders_on_the_192_key_module_only_under_its_switch():
    """On, the full render is the 192-key module (BLOCK_N 192, turns 4) with the split; causal is byte for byte the
    product's; off (the default) there is no split code."""
    assert GLUON.variant["fp8_tail_split"] == 0
    assert "_split_forward" not in fagen.generate(spec())
    causal = fagen.generate(spec(mask="causal"))
    with variant(fp8_tail_split=8):
        src = fagen.generate(spec())
        assert GLUON.fp8_n192(spec()) and re.search(r"^BLOCK_N = 192$", src, re.M)
        assert "_TAIL_C = 8" in src and "_TAIL_KEYS = 128" in src and src.count("_split_forward(") == 2
        assert fagen.generate(spec(mask="causal")) == causal


def test_the_kernel_is_the_products():
    """The split is host code: the rendered kernel functions (every @gluon.jit one) are the product's, text for
    text, so the GPU's compiled kernel is the product's own."""
    def kernels(src):
        return [b for b in re.split(r"\n(?=@)", src) if b.startswith("@gluon.jit")]
    base = kernels(fagen.generate(spec()))
    with variant(fp8_tail_split=8):
        assert kernels(fagen.generate(spec())) == base and len(base) > 5


@pytest.mark.parametrize("c", [4, 8, 16])
def test_the_rule_at_192_key_steps(c):
    """B1 H16 s16k on 132 SMs: blocks 0..122 of every head in the first launch, the other 5 over C chunks of 16384 / C
    keys (no multiple of 192); with the old condition (Sk a multiple of C x BLOCK_N) no split at all."""
    m = split_module(c)
    assert m.BLOCK_N == 192 and m._TAIL_KEYS == 128
    assert m._tail_split(1, 16, 128, 16384, 132, True) == (123, c)
    assert m._tail_split(1, 16, 128, 16384 - 64, 132, True) is None  # keys not a multiple of C x 128
    assert m._tail_split(2, 16, 128, 16384, 132, True) is None
    m._TAIL_KEYS = m.BLOCK_N  # the rule before this session (the module is the loader's: restored after)
    try:
        assert m._tail_split(1, 16, 128, 16384, 132, True) is None
    finally:
        m._TAIL_KEYS = 128


@pytest.mark.skipif(ON_GPU, reason="CPU tensors on the interpreter (the combine kernel is launched on them); "
                                   "the GPU script runs the kernels")
@pytest.mark.parametrize("gqa,per_head", [(1, False), (2, True)])
def test_the_split_forward_on_the_192_key_module(gqa, per_head):
    """_launch_forward of the 192-key module with the split (4 chunks of 256 keys, a 5-SM grid) against float64
    attention on the dequantized inputs: out within bf16's rounding, lse to 1e-5 (the Q copy in 8-byte words feeds
    every chunk the tail's rows)."""
    torch.manual_seed(1)
    m = split_module(4, gqa=gqa)
    hkv, sq, sk, d = 3, 700, 1024, 128
    hq = hkv * gqa
    m._kernel = _exact_kernel(m)
    m._NUM_SMS[-1] = 5  # a CPU tensor's get_device()
    assert m._tail_split(1, hq, -(-sq // 128), sk, 5, True) == (5, 4) and (sk // 4) % 192
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
    err = out.double() - ref
    assert err.abs().max().item() <= 2 ** -7 * ref.abs().max().item()
    assert err.pow(2).mean().sqrt().item() <= 2 ** -8 * ref.pow(2).mean().sqrt().item()
    assert (lse.double() - torch.logsumexp(s, -1)).abs().max().item() < 1e-5
