"""The fixed-point dQ's two-limb FMA rounding ([Note] Two-limb FMA rounding in fagen/templates/gluon/backward.py.j2,
variant bwd_fixed_fma 3): the render's own _fma_rni, run as plain Python on float32 values (every float32 operation
correctly rounded to nearest even, the FMA with a single rounding of the exact result), equals cvt.rni.s32.f32 of
x * qmul (round half to even) for |x qmul| < 2^30, ties and the limbs' edges included; and the qmul rows by TMA
([Note] qmul rows by TMA, bwd_fixed_tma) change where the compute warpgroups read qmul, nothing else."""

import random
import struct
import types
from fractions import Fraction

import pytest

import fagen
from fagen import backends
from fagen.codegen import render
from fagen.runtime.loader import load_source
from fagen.spec.kernel import KernelSpec


def _rn32(x: Fraction) -> float:
    """The float32 nearest to the exact x (ties to even), as a Python float (normal range only)."""
    if x == 0:
        return 0.0
    sign, a = (-1, -x) if x < 0 else (1, x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    ulp = Fraction(2) ** (e - 23)  # a in [2^e, 2^(e + 1)): 24 significant bits
    q, r = divmod(a, ulp)
    q = int(q) + (1 if r > ulp / 2 or (r == ulp / 2 and int(q) % 2) else 0)
    return sign * float(q * ulp)


class F32:
    """A float32 scalar: +, -, * rounded once to float32; .to(gl.int32, bitcast=True) its bits."""

    def __init__(self, v):
        self.v = _rn32(Fraction(v))

    def _o(self, o):
        return Fraction(o.v if isinstance(o, F32) else o)

    def __mul__(self, o):
        return F32(Fraction(self.v) * self._o(o))

    def __add__(self, o):
        return F32(Fraction(self.v) + self._o(o))

    def __sub__(self, o):
        return F32(Fraction(self.v) - self._o(o))

    __rmul__, __radd__ = __mul__, __add__

    def to(self, dtype, bitcast=False):
        assert dtype == "int32" and bitcast
        return I32(struct.unpack("<i", struct.pack("<f", self.v))[0])


class I32:
    """An int32 scalar with two's complement wrap."""

    def __init__(self, v):
        self.v = (v + 2 ** 31) % 2 ** 32 - 2 ** 31

    def __lshift__(self, n):
        return I32(self.v << n)

    def __add__(self, o):
        return I32(self.v + (o.v if isinstance(o, I32) else o))

    def __sub__(self, o):
        return I32(self.v - (o.v if isinstance(o, I32) else o))


def _fma(a, b, c):
    return F32(Fraction(a.v) * Fraction(b.v if isinstance(b, F32) else b) + Fraction(c.v if isinstance(c, F32) else c))


def _render(**variant):
    saved = dict(backends.GLUON.variant)
    backends.GLUON.variant.update(variant)
    render.render.cache_clear()
    try:
        spec = KernelSpec(backend="gluon", direction="bwd", head_dim=128, mask="causal", dtype="bf16")
        source = fagen.generate(spec)
    finally:
        backends.GLUON.variant.clear()
        backends.GLUON.variant.update(saved)
        render.render.cache_clear()
    return spec, source


@pytest.fixture(scope="module")
def rni():
    """The render's _fma_rni (bwd_fixed 1, bwd_fixed_fma 3) on F32 scalars."""
    spec, source = _render(bwd_fixed=1, bwd_fixed_tma=1, bwd_fixed_fma=3)
    mod = load_source(source, f"{spec.name}_fma3_round")
    mod.gl = types.SimpleNamespace(fma=_fma, int32="int32")
    return lambda x, qm: mod._fma_rni.fn(F32(x), F32(qm)).v


def _round_even(y: Fraction) -> int:
    f = y.numerator // y.denominator
    r = y - f
    return f + (1 if r > Fraction(1, 2) or (r == Fraction(1, 2) and f % 2) else 0)


def _f32(v):
    return struct.unpack("<f", struct.pack("<f", v))[0]


def test_two_limbs_equal_cvt_rni(rni):
    rng = random.Random(0)
    cases = []
    for _ in range(1500):
        e = rng.randint(-30, 29)  # |y| from 2^-30 to 2^30
        qm = 2.0 ** rng.randint(-20, 20)
        cases.append((_f32(rng.uniform(-1, 1) * 2.0 ** e / qm), qm))
    # ties at either limb (y = k + 1/2, y = 2^8 k + 2^7 (+- 1/2)), the edges of 2^29, 2^30, zero, tiny values
    for y in (0.5, 1.5, 2.5, -0.5, -1.5, 128.0, 127.5, 128.5, -128.5, 384.0, 640.5, 2.0 ** 29 - 64, -(2.0 ** 29),
              2.0 ** 30 - 128, -(2.0 ** 30 - 128), 2.0 ** 29 + 0.5 * 2 ** 6, 0.0, 1e-30, -3e-20, 255.5, 256.5):
        for qm in (1.0, 2.0 ** -7, 2.0 ** 9):
            cases.append((_f32(y / qm), qm))
    for x, qm in cases:
        y = Fraction(x) * Fraction(qm)
        assert abs(y) < 2 ** 30
        assert rni(x, qm) == _round_even(y), (x, qm)


def test_qmul_rows_by_tma_move_the_read_only():
    """bwd_fixed_tma: the producer loads the qmul rows (d_desc's rows B * Hq on) into m_smem beside lse2, delta; the
    compute warpgroups read them at the step's end; the global load of the rows is gone; modes 0, 1 unchanged."""
    _, plain = _render(bwd_d128={}, bwd_fixed=1)
    _, tma = _render(bwd_d128={}, bwd_fixed=1, bwd_fixed_tma=1)
    assert "qm = gl.load(Sem + qrow" in plain and "qm = gl.load(Sem" not in tma
    assert "m_smem" not in plain
    assert "tma.async_copy_global_to_shared(d_desc, [num_bh * GQA + off_b * num_heads + h0 + g, m0]" in tma
    assert "qm = m_smem.index(s).reshape([BLOCK_M]).load(gl.SliceLayout(1, dq_l))" in tma
    assert "3 * l_desc.block_type.nbytes" in tma
    assert "dm = torch.empty((2, b, hq, sq_pad)" in tma and '"QMul": dm[1]' in tma


def test_the_limb_mutant_edits_the_two_limb_render_only():
    """gluon-bwd-fixed-fma-limb edits the renders with bwd_fixed_fma 3 only; the GPU test (test_gluon_bwd_gpu.py)
    and scripts/gpu_detbwd_s10.py must catch it."""
    from fagen.verify.mutants import GLUON_MUTANTS
    limb = next(m for m in GLUON_MUTANTS if m.name == "gluon-bwd-fixed-fma-limb")
    for variant, edited in (({"bwd_fixed": 1, "bwd_fixed_fma": 3}, True), ({"bwd_fixed": 1, "bwd_fixed_fma": 2}, False),
                            ({"bwd_fixed": 1}, False), ({}, False)):
        spec, source = _render(**variant)
        assert limb.applies(spec) and (limb.old in source) == edited


def test_the_tma_rows_mutant_edits_the_tma_render_only():
    """gluon-bwd-fixed-tma-rows (the delta rows in place of qmul) edits the renders with bwd_fixed_tma only, the d128
    MHA default among them; the GPU test and scripts/gpu_detbwd_s10.py must catch it."""
    from fagen.verify.mutants import GLUON_MUTANTS
    rows = next(m for m in GLUON_MUTANTS if m.name == "gluon-bwd-fixed-tma-rows")
    for variant, edited in (({"bwd_d128": {}, "bwd_fixed": 1, "bwd_fixed_tma": 1}, True),
                            ({"bwd_d128": {}, "bwd_fixed": 1}, False), ({"bwd_d128": {}}, False), ({}, True)):
        spec, source = _render(**variant)
        assert rows.applies(spec) and (rows.old in source) == edited
