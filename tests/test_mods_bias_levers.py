"""The bias rows' levers (docs/mods.md, "Bias rows (tenth session)"): the split offsets of the Gluon backward's
clamp-free reads ([Note] Split offsets in fagen/mods/emit.py) give every element the offset the written index gives;
ModCode.kv_slope finds `score + kv_idx * A` and nothing else; the lever renders ([Note] Additive mods in the Gluon
forward, bwd_mod_fixed, bwd_mod_fold) hold their code only where on. Gluon cannot run here: the sm_90 builds are in
scripts/modsbias_builds.py and the float64 checks on the H100 in scripts/gpu_modsbias_s10.py."""

import random
import types

import pytest
import torch

from fagen import backends
from fagen.codegen.mod_args import ModCode
from fagen.codegen.render import render
from fagen.mods import ir
from fagen.mods.emit import TensorRef, to_gluon
from fagen.mods.simplify import simplify
from fagen.mods.text import parse
from fagen.spec.kernel import KernelSpec
from fagen.codegen.mod_args import ModScalar, ModTensor

INDEXES = ["q_idx - kv_idx + c - 1", "kv_idx - q_idx + c", "c - (kv_idx - q_idx)", "2 * q_idx - 3 * kv_idx + h",
           "-(kv_idx) + q_idx * c + 7", "(q_idx + h) * 3 - kv_idx", "kv_idx", "q_idx", "h * c + q_idx - kv_idx * 2"]

# a `gl` that evaluates the emitted source over torch int64 tensors: load() returns the offset it was given
GL = types.SimpleNamespace(int64=torch.int64, int32=torch.int64, float32=torch.float64, load=lambda p: p)


def _tree(index: str):
    decls = ((ModTensor("t", "fp32", 2),), (ModScalar("c", "int"),))
    return simplify(parse(f"score + t[h, {index}]", "score_mod", *decls)).b


def _names(q, kv):
    return {"score": "", "b": "b", "h": "h", "q_idx": q, "kv_idx": kv, "c": "c",
            "t": TensorRef("P", ("s0", "s1"), ("n0", "n1"))}


@pytest.mark.parametrize("index", INDEXES)
def test_split_offsets_equal_the_written_offsets_on_every_element(index):
    tree = _tree(index)
    plain = to_gluon(tree, _names("qrows[None, :]", "keys[:, None]"), unclamped=True)
    split = to_gluon(tree, _names("qrows[None, :]", "keys[:, None]"), unclamped=True,
                     split={"q_idx": ("m0", "qrow0[None, :]"), "kv_idx": ("n0", "keys0[:, None]")})
    unit = to_gluon(tree, _names("qrows[None, :]", "keys[:, None]"), unclamped=True,
                    split={"q_idx": ("m0", "qrow0[None, :]"), "kv_idx": ("n0", "keys0[:, None]"), "unit": True})
    assert "qrows" not in split and "keys[" not in split, split  # the tile's offsets, not the positions
    rng = random.Random(index)
    for _ in range(20):
        m0, n0 = rng.randrange(0, 4096, 64), rng.randrange(0, 4096, 128)
        qrow0, keys0 = torch.arange(64), torch.arange(64) + 64 * rng.randrange(2)
        env = dict(gl=GL, m0=torch.tensor(m0), n0=torch.tensor(n0), qrow0=qrow0, keys0=keys0, qrows=m0 + qrow0,
                   keys=n0 + keys0, h=torch.tensor(rng.randrange(16)), b=torch.tensor(0), c=torch.tensor(rng.randrange(-50, 9000)),
                   s0=torch.tensor(rng.randrange(1, 20000)), s1=torch.tensor(rng.choice([1, 2, 3])), P=torch.tensor(10 ** 9))
        want, got = (eval(code, env) for code in (plain, split))  # noqa: S307 - our own emitted text
        assert torch.equal(torch.broadcast_to(got, want.shape), want), (index, plain, split)
        env["s1"] = torch.tensor(1)  # what the host checks before MOD_FREE 2 (host_unit_strides)
        want, got = (eval(code, env) for code in (plain, unit))  # noqa: S307
        assert torch.equal(torch.broadcast_to(got, want.shape), want), (index, plain, unit)


def test_an_index_that_is_not_affine_keeps_the_written_offsets():
    tree = _tree("q_idx * kv_idx")
    names = _names("qrows[None, :]", "keys[:, None]")
    split = {"q_idx": ("m0", "qrow0[None, :]"), "kv_idx": ("n0", "keys0[:, None]")}
    assert to_gluon(tree, names, unclamped=True, split=split) == to_gluon(tree, names, unclamped=True)


def spec(direction="fwd", **fields):
    return KernelSpec(backend="gluon", direction=direction, head_dim=128, dtype="bf16", mask="none", **fields)


ALIBI = dict(score_mod="score + kv_idx * exp2(-((h + 1) * 8.0 / H))", mod_scalars=[["H", "int"]])
RELBIAS = dict(score_mod="score + bias[h, q_idx - kv_idx + 4095]", mod_tensors=[["bias", "fp32", 2]])


@pytest.mark.parametrize("text,found", [("score + kv_idx * s", "(ms0)"), ("score + s * kv_idx", "(ms0)"),
                                        ("kv_idx * s + score", "(ms0)"), ("score + kv_idx * (h * s)", "h"),
                                        ("score + q_idx * s", None), ("score + kv_idx * s * q_idx", None),
                                        ("score * kv_idx * s", None), ("score + kv_idx * score * s", None),
                                        ("score + kv_idx * 2 + s", None), ("score + (kv_idx - q_idx) * s", None)])
def test_kv_slope_finds_the_row_free_alibi_only(text, found):
    fields = dict(score_mod=text, mod_scalars=[["s", "float"]])
    got = ModCode(spec(**fields)).kv_slope("off_b", "off_h")
    assert (got is None) if found is None else (got is not None and found in got), got


def _render(sp, **lever):
    saved = {k: backends.GLUON.variant[k] for k in lever}
    backends.GLUON.variant.update(lever)
    render.cache_clear()
    try:
        return render(sp).files[".py"]
    finally:
        backends.GLUON.variant.update(saved)
        render.cache_clear()


OFF = dict(fwd_mod_add=0, bwd_mod_fixed=0, bwd_mod_split=0, bwd_mod_fold=0)


def test_the_levers_render_only_where_on():
    assert "gl.fma(s_acc" not in _render(spec(**ALIBI), **OFF)
    add1 = _render(spec(**ALIBI), **{**OFF, "fwd_mod_add": 1})
    assert "xk = (" not in add1 and "gl.fma(s_acc" in add1
    assert "xk = (" in _render(spec(**ALIBI), **{**OFF, "fwd_mod_add": 2})
    assert "xk = (" not in _render(spec(**RELBIAS), fwd_mod_add=2)  # a gather: not a column term
    assert "gl.fma(s_acc" in _render(spec(**RELBIAS), fwd_mod_add=2)
    assert "gl.fma(s_acc" not in _render(spec(score_mod="score * 2.0"), fwd_mod_add=2)  # not additive
    bwd = spec("bwd", **RELBIAS)
    assert "BWD_DET_MODE = 0" in _render(bwd, **OFF) and "BWD_DET_MODE = 2" in _render(bwd, bwd_mod_fixed=1)
    assert "BWD_DET_MODE = 2" in _render(bwd, bwd_mod_fixed=2)
    gqa_causal = KernelSpec(backend="gluon", direction="bwd", head_dim=128, dtype="bf16", mask="causal", gqa=4,
                            **RELBIAS)
    assert "BWD_DET_MODE = 0" in _render(gqa_causal, bwd_mod_fixed=2)
    assert "BWD_DET_MODE = 2" in _render(gqa_causal, bwd_mod_fixed=1)
    assert "BWD_DET_MODE = 0" in _render(spec("bwd", score_mod="score * 2.0"), bwd_mod_fixed=1)  # dS not P(dP - delta)
    assert "BWD_DET_MODE = 0" in _render(spec("bwd"), bwd_mod_fixed=1, bwd_d128={})  # plain: bwd_fixed's, not this lever's
    assert "(bwd_mod_fold)" not in _render(bwd, **OFF) and "(bwd_mod_fold)" in _render(bwd, bwd_mod_fold=1)
    assert "Split offsets (fagen" not in _render(bwd, **OFF) and "Split offsets (fagen" in _render(bwd, bwd_mod_split=1)


def test_the_unit_stride_test_names_the_strides_the_queries_multiply():
    assert ModCode(spec("bwd", **RELBIAS)).host_unit_strides() == "mt0.stride(1) == 1"
    col = ModCode(spec("bwd", score_mod="score + bias[q_idx - kv_idx + 4095, h]", mod_tensors=[["bias", "fp32", 2]]))
    assert col.host_unit_strides() == "mt0.stride(0) == 1"
    assert ModCode(spec("bwd", score_mod="score + bias[h, kv_idx]", mod_tensors=[["bias", "fp32", 2]])).host_unit_strides() is None
    src = _render(spec("bwd", **RELBIAS), bwd_mod_split=1)
    assert "return (2 if mt0.stride(1) == 1 else 1) if " in src and "if MOD_FREE == 2:" in src
    assert "MOD_FREE == 2" not in _render(spec("bwd", **RELBIAS), bwd_mod_split=0)
