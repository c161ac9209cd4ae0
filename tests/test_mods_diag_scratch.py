"""The learned bias's gradient through a scratch ([Note] Diagonal sums through a scratch in
fagen/codegen/mod_args.py, lever DIAG_SUMS, 1 in the product; docs/mods.md "The learned bias's gradient (twenty-third
session)"): the render holds the scratch only where on (and the render state names it), and with it on a learned
relative bias (attention-gym's, a diagonal class) gives dq, dk, dv and d(bias) against float64 at odd shapes, causal
and full, GQA 2, bitwise repeatable; the sm_90 build keeps the Q/dO pipelining (cp.async) and spills less than the
gather."""

import pytest
import torch

import fagen
from _env import DEVICE, ON_GPU
from fagen.bench import gym_mods as g
from fagen.codegen import mod_args, render as render_mod
from fagen.mods import lower as lowering
from fagen.runtime import modded
from fagen.verify import reference


@pytest.fixture(params=[1, 2, 3, 4])
def scratch(monkeypatch, request):
    """The lever on (1: the band read masked; 2: zeros around the band, read unmasked; 3: the rotation; 4: 2 a step
    late), the modded-module memo empty (it keys on the spec, not the render state)."""
    monkeypatch.setattr(mod_args, "DIAG_SUMS", request.param)
    monkeypatch.setattr(modded, "_MODULES", {})


def _spec(**fields):
    return fagen.KernelSpec(head_dim=32, dtype="fp32", direction="bwd", mask="causal",
                            score_mod="score + bias[h, q_idx - kv_idx + n - 1]", mod_tensors=[["bias", "fp32", 2]],
                            mod_scalars=[["n", "int"]], **fields)


@pytest.mark.parametrize("lever", [1, 2, 3, 4])
def test_the_scratch_renders_only_where_on(monkeypatch, lever):
    monkeypatch.setattr(mod_args, "DIAG_SUMS", 0)  # the gather (the product's 1 since the twenty-third session)
    off = render_mod.render(_spec()).source
    state_off = render_mod.render_state(_spec())
    assert "_mod_cta_barrier" not in off and "tl.gather(gval, tl.where(g_ok" in off
    monkeypatch.setattr(mod_args, "DIAG_SUMS", lever)
    on = render_mod.render(_spec()).source
    assert "tl.gather(gval, tl.where(g_ok" not in on
    if lever == 3:  # the rotation: one gather of the tile's shape, no scratch
        assert "_mod_cta_barrier" not in on and on.count("tl.gather(gval, g_src") == 1
    elif lever == 4:  # one barrier a step and one after the loop (flat loops); the lists' loops keep 2's two
        assert on.count("g_tok = _mod_cta_barrier(") == 2 and on.count("g_par = 1 - g_par") == 1
    else:
        assert on.count("_mod_cta_barrier(") == 3  # the helper, two barriers a step
    assert ("mask=g_ok" in on) == (lever == 1) and ("new_zeros(n + b * hq" in on) == (lever in (2, 4))
    assert render_mod.render_state(_spec()) != state_off
    varlen = render_mod.render(_spec(layout="varlen")).source  # packed rows keep the gather
    assert "_mod_cta_barrier" not in varlen


def _run(q, k, v, do, bias, s_k, causal):
    score_mod = g.generate_relative_bias(bias, s_k)
    mask_mod = g.causal_mask if causal else None
    out = fagen.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    return torch.autograd.grad(out, (q, k, v, bias), do)


# causal lowers to the causal switch (as the bench's row); lowering off runs the block mask's lists
@pytest.mark.parametrize("causal, hq, hkv, s, lowered", [(True, 2, 2, 77, True), (False, 4, 2, 45, True),
                                                          (True, 4, 2, 130, True), (True, 2, 1, 70, False)])
def test_the_bias_gradient_through_the_scratch_against_float64(scratch, monkeypatch, causal, hq, hkv, s, lowered):
    monkeypatch.setattr(lowering, "ENABLED", lowered)
    gen = torch.Generator().manual_seed(s)
    q = torch.randn(1, hq, s, 32, generator=gen).to(DEVICE).requires_grad_()
    k, v = (torch.randn(1, hkv, s, 32, generator=gen).to(DEVICE).requires_grad_() for _ in range(2))
    do = torch.randn(1, hq, s, 32, generator=gen).to(DEVICE)
    bias = (torch.randn(hq, 2 * s - 1, generator=gen) * 0.5).to(DEVICE).requires_grad_()
    got = [_run(q, k, v, do, bias, s, causal) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*got))  # bitwise repeatable
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    want = reference.attention(*leaves[:3], mask_mod=g.causal_mask if causal else None,
                               score_mod=g.generate_relative_bias(leaves[3], s))
    want = torch.autograd.grad(want[0] if isinstance(want, tuple) else want, leaves, do.double())
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), got[0], want):
        assert (a.double() - b).abs().max().item() < 1e-4, name


_BUILD_SM90 = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import torch
from fagen.aot.artifacts import _compile_kernel, _compiled_mode, import_for_compile
from fagen.bench import gym_mods as g
from fagen.codegen import mod_args
from fagen.runtime.modded import modded_spec
from fagen.runtime.mods import prepare
from fagen.spec.kernel import KernelSpec
from sm90 import ptxas

out = {}
for lever in json.loads(sys.argv[2]):
    mod_args.DIAG_SUMS = lever
    base = KernelSpec(head_dim=128, dtype="bf16", direction="bwd", mask="causal")
    spec = modded_spec(base, prepare(score_mod=g.generate_relative_bias(torch.zeros(16, 511), 256)).fields,
                       arch="sm_90")
    entry = next(e for e in import_for_compile(spec).AOT_KERNELS if e["name"] == "_attn_bwd_dkdv")
    # the gradient asked (MG pointers), 16-byte aligned as the JIT specialises a torch allocation
    entry = dict(entry, divisible=list(entry["divisible"]) + ["MG0", "MGI0"])
    with _compiled_mode():
        ptx, _, record = _compile_kernel(spec, "sm_90", entry)
    ptx = ptx.decode()
    res, log, _ = ptxas(ptx)
    r = res["_attn_bwd_dkdv"]
    out[lever] = dict(spills=r.spill_stores // 4, cp_async=ptx.count("cp.async."),
                      serialized="instructions are serialized" in log,
                      barrier=ptx.count("bar.sync 0;\n\tmov.b32"))
print("RESULT " + json.dumps(out))
"""


def test_the_rows_dkdv_kernel_keeps_its_pipelining_and_spills_less_for_sm_90(tmp_path_factory):
    """ptxas sm_90 of the row's dK/dV kernel with the bias gradient: the product's gather (lever 0) spills hundreds
    of words and serialises the step's wgmma (C7513); the scratch levers keep the Q/dO pipelining (cp.async: a
    tl.debug_barrier in the loop turned it off) and spill at most a third of that; 1 and 4 do not serialise (2
    does, C7515: docs/mods.md)."""
    from test_hopper_compile import build_sm90

    built = build_sm90(tmp_path_factory, _BUILD_SM90, [0, 1, 2, 4], "lbgrad-sm90")
    assert built["0"]["serialized"] and built["0"]["spills"] > 300, built
    for lever in ("1", "2", "4"):
        b = built[lever]
        assert b["cp_async"] >= 100 and b["spills"] <= 128, (lever, built)
        assert b["barrier"] >= 1, (lever, built)  # the asm barrier, not gpu.barrier
    assert not built["1"]["serialized"] and not built["4"]["serialized"], built


@pytest.mark.parametrize("lever", [1, 2, 3, 4])
def test_a_gluon_modded_forward_with_a_learned_tensor_takes_none_of_it(monkeypatch, lever):
    """The learned bias's forward runs the Gluon modded forward on sm_90 (fagen.attention): its module has no
    diagonal sums and none of their Triton helpers (the H200's final run of the twenty-third session read "NameError:
    name 'tl' is not defined" there: the barrier's helper was emitted into the Gluon module), and it loads."""
    from fagen.runtime.loader import load_source

    monkeypatch.setattr(mod_args, "DIAG_SUMS", lever)
    spec = fagen.KernelSpec(head_dim=128, dtype="bf16", mask="causal", backend="gluon",
                            score_mod="score + bias[h, q_idx - kv_idx + n - 1]", mod_tensors=[["bias", "fp32", 2]],
                            mod_scalars=[["n", "int"]])
    src = render_mod.render(spec).source
    assert "_mod_cta_barrier" not in src and "_MOD_CTA_BARRIER" not in src
    load_source(src, f"{spec.name}_diag{lever}")
