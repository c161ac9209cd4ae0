"""KernelSpec's mod fields: validated by parsing, canonical, in the name and hash only when set, and round-tripping
JSON and TOML."""

import pytest

from fagen.spec.kernel import KernelSpec, SpecError

MOD = dict(score_mod="score+bias[h,q_idx-kv_idx+4095]*cap", mask_mod="doc[q_idx]==doc[kv_idx]",
           mod_tensors=[["doc", "i32", 1], ["bias", "fp32", 2]], mod_scalars=[["cap", "float"]])


def test_fields_are_canonical_and_round_trip():
    spec = KernelSpec(head_dim=64, mask="causal", **MOD)
    assert spec.score_mod == "score + bias[h, q_idx - kv_idx + 4095] * cap"
    assert spec.mod_tensors == (("bias", "fp32", 2), ("doc", "i32", 1))
    assert spec.mod_scalars == (("cap", "float"),)
    assert KernelSpec.from_json(spec.to_json()) == spec and KernelSpec.from_toml(spec.to_toml()) == spec
    assert spec.name == f"attn_fwd_causal_d64_m128n128w4s3_g1_mod{spec.mods_hash}_fp16"
    respelled = KernelSpec(head_dim=64, mask="causal", **{**MOD, "score_mod": "score + (bias[h, q_idx - kv_idx + "
                                                                                "4095] * cap)"})
    assert respelled.name == spec.name and respelled.hash == spec.hash


def test_unset_mods_change_nothing():
    plain = KernelSpec(head_dim=64)
    assert "mod" not in plain.to_json() and "_mod" not in plain.name
    assert KernelSpec(head_dim=64, score_mod="score * 2.0").hash != plain.hash


def test_each_mod_changes_the_name():
    names = {KernelSpec(head_dim=64, score_mod=t).name for t in ("score * 2.0", "score * 3.0", "score + 2.0")}
    assert len(names) == 3


@pytest.mark.parametrize("fields, field", [
    (dict(score_mod="score.__class__"), "score_mod"),
    (dict(mask_mod="score > 0"), "mask_mod"),
    (dict(score_mod="score + bias[h, h]"), "score_mod"),
    (dict(score_mod="score", mod_tensors=[["bias", "fp32", 2]]), "mod_tensors"),
    (dict(mod_scalars=[["cap", "float"]]), "mod_scalars"),
    (dict(score_mod="score", backend="cuda"), "backend"),
    (dict(score_mod=3), "score_mod"),
    (dict(score_mod="score", mod_tensors="bias=fp32:2"), "mod_tensors"),
])
def test_invalid_mods_name_the_field(fields, field):
    with pytest.raises(SpecError) as e:
        KernelSpec(head_dim=64, **fields)
    assert e.value.field == field, str(e.value)


def test_mods_render_into_every_triton_kind_and_layout():
    """Mods render into the Triton prefill (dense, varlen, paged) and decode (dense, paged) kernels
    (tests/test_mods_layouts.py runs them); the cuda and gluon backends name the field."""
    from fagen.codegen.render import render

    for fields in ({}, {"layout": "varlen"}, {"layout": "paged"}, {"kind": "decode"},
                   {"kind": "decode", "layout": "paged"}):
        source = render(KernelSpec(head_dim=64, mask="causal", score_mod="score * 2.0", **fields)).source
        assert "# ln 2: the mod sees scale * q.k" in source, fields
    with pytest.raises(SpecError, match="^backend: .*triton"):
        KernelSpec(head_dim=64, score_mod="score * 2.0", backend="cuda")
