"""The render switches ([Note] Render switches in fagen/codegen/render.py): one list of the module-level values a
render reads beyond the spec and the templates. Each is in render_state's key exactly for the specs whose render
reads it, so the render memo and the loader's index never serve a module rendered under another value."""
import pytest

from fagen.backends import triton as triton_backend
from fagen.codegen import mod_args, render as render_mod
from fagen.spec import KernelSpec

MLA_BWD = KernelSpec(head_dim=192, head_dim_v=128, dtype="bf16", direction="bwd", mask="causal")
MLA_DECODE = KernelSpec(head_dim=192, head_dim_v=128, dtype="bf16", kind="decode", mask="none", gqa=16,
                        block_m=32, block_n=64, num_warps=4, num_stages=3)
BIAS = KernelSpec(head_dim=64, mask="causal", dtype="fp32", direction="bwd",
                  score_mod="score + bias[h, q_idx - kv_idx + n - 1]", mod_tensors=[["bias", "fp32", 2]],
                  mod_scalars=[["n", "int"]])
PLAIN = (KernelSpec(head_dim=128, mask="causal", dtype="bf16"), KernelSpec(head_dim=128, mask="causal", dtype="bf16",
                                                                            direction="bwd"),
         KernelSpec(head_dim=128, dtype="bf16", kind="decode", mask="none"))

# (module, attribute, the value that turns the switch off, a spec that reads it, what its key shows when on)
CASES = {"mla_gluon_dkdv": (triton_backend, "MLA_GLUON_DKDV", False, MLA_BWD, " mla_gluon_dkdv"),
         "decode_pps": (triton_backend, "MLA192_DECODE", False, MLA_DECODE, " decode_pps="),
         "diag_sums": (mod_args, "DIAG_SUMS", 0, BIAS, " diag_sums=")}


def test_every_switch_is_listed_and_in_the_templates_context():
    assert [name for name, _ in render_mod._SWITCHES] == list(CASES)
    ctx = render_mod._context(MLA_BWD)
    assert all(name in ctx for name in CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_the_key_follows_the_switch_where_the_render_reads_it(monkeypatch, name):
    module, attr, off, spec, shown = CASES[name]
    on_state = render_mod.render_state(spec)
    assert shown in on_state  # the product's value is on for each of the three
    monkeypatch.setattr(module, attr, off)
    off_state = render_mod.render_state(spec)
    assert shown not in off_state and off_state != on_state
    assert render_mod.render_switches(spec)[name] is None


@pytest.mark.parametrize("spec", PLAIN, ids=lambda s: s.name)
def test_a_spec_that_reads_no_switch_keys_only_its_variant(spec):
    assert set(render_mod.render_switches(spec).values()) == {None}
    state = render_mod.render_state(spec)
    assert not any(name in state for name in CASES)
