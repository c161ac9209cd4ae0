"""A user score_mod in the Gluon (sm_90) forward (docs/mods.md, "Gluon"): the spec rules, the rendered Gluon code
(printed from the parsed tree, never the user's text), the tiles, the selection switch, and sm_90 builds without a
GPU (Gluon kernels cannot run under the interpreter; scripts/gpu_gluon_mods.py checks them on an H100)."""

import pytest

from fagen import backends
from fagen.codegen.mod_args import ModCode
from fagen.codegen.render import render
from fagen.runtime import hopper
from fagen.spec.axes import SpecError
from fagen.spec.kernel import KernelSpec

from test_hopper_compile import build_sm90

RELBIAS = dict(score_mod="score + bias[h, q_idx - kv_idx + 4095]", mod_tensors=[["bias", "fp32", 2]])
ALIBI = dict(score_mod="score + slopes[h] * (kv_idx - q_idx)", mod_tensors=[["slopes", "fp32", 1]])
SOFTCAP = dict(score_mod="cap * tanh(score / cap)", mod_scalars=[["cap", "float"]])


def gluon(**fields) -> KernelSpec:
    return KernelSpec(backend="gluon", **{"head_dim": 128, "dtype": "bf16", "mask": "causal", **fields})


def test_gluon_takes_a_score_mod_and_refuses_the_rest_in_one_line():
    assert gluon(**RELBIAS).modded and gluon(**SOFTCAP, mask="none").name.endswith("_bf16_gluon")
    refusals = {"mask_mod": dict(mask_mod="q_idx >= kv_idx"),
                "score_mod": dict(**SOFTCAP, dtype="fp8_e4m3")}
    for field, fields in refusals.items():
        with pytest.raises(SpecError) as e:
            gluon(**fields)
        assert "\n" not in str(e.value) and str(e.value).startswith(field + ":"), e.value
    with pytest.raises(SpecError, match="set backend 'triton' for a mask_mod"):
        gluon(**SOFTCAP, mask_mod="q_idx >= kv_idx")
    with pytest.raises(SpecError, match="backend: .*set backend 'triton'"):
        KernelSpec(backend="cuda", head_dim=128, dtype="bf16", **SOFTCAP)


def test_the_render_holds_the_tree_s_gluon_code_and_not_the_user_s_text(monkeypatch):
    spec = gluon(score_mod="score+bias[h,q_idx-kv_idx+4095]", mod_tensors=[["bias", "fp32", 2]])  # user spelling
    add = ModCode(spec).additive("off_b", "off_h", "rows[:, None]", "cols[None, :]")  # [Note] Additive mods in the
    assert f"s_acc = gl.fma(s_acc, qk_scale, ({add}) * 1.4426950408889634)" in render(spec).source  # Gluon forward
    monkeypatch.setitem(backends.GLUON.variant, "fwd_mod_add", 0)  # the mod as written, around the log2 domain
    render.cache_clear()
    src = render(spec).source
    render.cache_clear()
    code = ModCode(spec).score("score", "off_b", "off_h", "rows[:, None]", "cols[None, :]")
    assert code in src and "gl.load(mt0 + _mod_index((off_h), mt0_n0) * mt0_s0" in code, code
    # natural score in (qk_scale is the log2-domain factor), log2-domain score out; exp2 without qk_scale again
    assert "score = s_acc * (qk_scale * 0.6931471805599453)" in src
    assert f"s_acc = ({code}) * 1.4426950408889634" in src and "p = gl.exp2(s_acc - m_use[:, None])" in src
    assert "score+bias" not in src and "tl." not in code
    assert "@gluon.jit\ndef _mod_index" in src and "@triton.jit" not in src
    # the captured values come through the typed argument list: kernel, consumers, step, softmax
    assert src.count("mt0, mt0_s0, mt0_s1, mt0_n0, mt0_n1") >= 8
    assert '"mt0_s0", "mt0_s1", "mt0_n0", "mt0_n1"' in src  # not specialised: a changed size is no recompile
    scalar = render(gluon(**SOFTCAP)).source
    assert "_mod_tanh(((score) * (1.0 / (ms0))))" in scalar and "ms0" in scalar.split("def _attn_fwd_hopper(")[1][:400]
    plain = render(gluon()).source
    assert "_mod_" not in plain and "score = s_acc" not in plain


def test_gathers_take_block_n_64_and_the_rest_the_plain_tiles():
    assert gluon(**RELBIAS).mod_gathers and (gluon(**RELBIAS).block_n, gluon(**RELBIAS).num_stages) == (64, 4)
    for fields in (ALIBI, SOFTCAP):
        assert not gluon(**fields).mod_gathers
        assert (gluon(**fields).block_n, gluon(**fields).num_stages) == (gluon().block_n, gluon().num_stages)


def test_the_selection_of_modded_specs_follows_the_switch(monkeypatch):
    assert backends.GLUON.select_score_mods is True  # measured on the H100 (docs/mods.md, "Gluon")
    monkeypatch.setattr(type(backends.GLUON), "select_score_mods", False)
    assert not hopper.selected(gluon(**RELBIAS)) and not hopper.selected(gluon(**SOFTCAP, mask="none"))
    monkeypatch.setattr(type(backends.GLUON), "select_score_mods", True)
    assert hopper.selected(gluon(**RELBIAS)) and hopper.selected(gluon(**SOFTCAP, mask="none"))
    assert not hopper.selected(gluon(**SOFTCAP, dtype="fp16"))  # the plain rule's dtypes and head dims
    # mod_forward_spec: the Triton modded spec's gluon twin (none off sm_90: this machine has no GPU)
    triton_spec = KernelSpec(head_dim=128, dtype="bf16", mask="causal", **RELBIAS)
    assert hopper.mod_forward_spec(triton_spec, "cpu") is None


def test_the_selection_when_on_serves_a_score_mod_with_its_gluon_twin(monkeypatch):
    monkeypatch.setattr(type(backends.GLUON), "select_score_mods", True)
    monkeypatch.setattr(hopper, "is_hopper", lambda device: True)
    monkeypatch.setattr(hopper, "gluon_missing", lambda: None)
    monkeypatch.setenv(hopper.ENV, "1")
    triton_spec = KernelSpec(head_dim=128, dtype="bf16", mask="causal", block_n=64, num_stages=2, **RELBIAS)
    twin = hopper.mod_forward_spec(triton_spec, "cuda")
    assert twin == gluon(**RELBIAS) and twin.score_mod == triton_spec.score_mod, twin
    assert hopper.mod_forward_spec(KernelSpec(head_dim=128, dtype="bf16", mask="causal", mask_mod="q_idx >= kv_idx"),
                                   "cuda") is None  # a mask_mod stays on Triton
    assert hopper.mod_forward_spec(KernelSpec(head_dim=64, dtype="bf16", **SOFTCAP), "cuda") is None  # not d64
    monkeypatch.setenv(hopper.ENV, "0")
    assert hopper.mod_forward_spec(triton_spec, "cuda") is None


def test_the_module_checks_the_captured_values_before_the_device():
    import torch

    import fagen

    module = fagen.load(gluon(**RELBIAS))
    q = torch.randn(1, 2, 40, 128, dtype=torch.bfloat16)
    bias = torch.randn(2, 8191)
    with pytest.raises(ValueError, match=r"mods\['bias'\]: expected a torch.float32 tensor of rank 2"):
        module.forward(q, q, q, mods={"bias": bias[0]})
    with pytest.raises(ValueError, match="Gluon kernel"):  # the mods passed: only the CPU device is refused
        module.forward(q, q, q, mods={"bias": bias})


_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import fagen
from fagen.spec.kernel import KernelSpec
from sm90 import ptxas

out = {}
for key, fields in json.loads(sys.argv[2]).items():
    mod = fagen.load(KernelSpec(backend="gluon", **{"head_dim": 128, "dtype": "bf16", **fields}))
    ck = mod.compile_for()
    ptx = ck.asm["ptx"]
    res = ptxas(ptx)[0]["_attn_fwd_hopper"]
    out[key] = dict(spills=res.spill_stores + res.spill_loads, stack=res.stack, shared=ck.metadata.shared,
                    tanh=ptx.count("tanh.approx.f32"), ldg=ptx.count("ld.global"), wgmma=ptx.count("wgmma.mma_async"))
print("RESULT " + json.dumps(out))
"""

MODULES = {"softcap": dict(mask="causal", **SOFTCAP), "alibi": dict(mask="causal", **ALIBI),
           "relbias": dict(mask="none", **RELBIAS)}


def test_score_mods_build_for_sm_90_without_spills(tmp_path_factory):
    built = build_sm90(tmp_path_factory, _SCRIPT, MODULES, "gluon-mods-sm90")
    for key, r in built.items():
        assert r["spills"] == 0 and r["stack"] == 0, (key, r)
        assert r["shared"] <= 232448 and r["wgmma"] > 0, (key, r)
    assert built["softcap"]["tanh"] > 0 and built["alibi"]["tanh"] == 0  # the mod's tanh is tanh.approx.f32
    assert built["relbias"]["ldg"] > 0 and built["softcap"]["ldg"] == 0  # the gather is in the consumers' loop
