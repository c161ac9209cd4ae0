"""deterministic=False: the backward whose dK/dV kernel also adds dQ with fp32 atomics ([Note] Atomic dQ in
fagen/templates/triton/backward.py.j2; README "Deterministic backward"), against the float64 reference.

On the CPU the interpreter runs the atomics one after another, so the order-dependence itself shows only on a GPU
(test_dq_within_tolerance_of_the_deterministic_path_on_gpu and scripts/gpu_bwd_modes.py)."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fagen
from _env import DEVICE, ON_GPU
from fagen.codegen.render import generate
from fagen.runtime import loader as runtime
from fagen.spec.axes import Direction, Mask, SpecError
from fagen.verify import layouts, mutants, reference
from fagen.verify.properties import PropertyFailure, check_backward, grad_output
from fagen.verify.strategies import Problem, problems, specs

ATOMIC_MUTANTS = [m for m in mutants.MUTANTS if m.deterministic is False]


def atomic_spec(mask, dtype="bf16", gqa=2, head_dim=40, block=16, **kw):
    return fagen.KernelSpec(head_dim=head_dim, mask=mask, dtype=dtype, gqa=gqa, direction="bwd", block_m=block,
                            block_n=block, deterministic=False, **kw)


def ragged(mask, **kw):
    """Lengths that are no multiple of the blocks, Sq != Sk, a padded row block, NaN in padding, a forest."""
    sq, sk = (9, 9 + 37) if mask is Mask.TREE else (37, 53)
    return Problem(batch=2, heads_kv=1, seq_q=sq, seq_k=sk, seed=11, poison=mask.padded,
                   seqlens_q=(37, 20) if mask.padded else None, seqlens_k=(53, 1) if mask.padded else None,
                   parents=((-1, 0, 1, 1, 0, 4, -1, 6, 2),) * 2 if mask is Mask.TREE else None, **kw)


def test_spec_switch_name_json_and_errors():
    plain = fagen.KernelSpec(head_dim=64, direction="bwd")
    fused = fagen.KernelSpec(head_dim=64, direction="bwd", deterministic=False)
    assert plain.deterministic is True and "deterministic" not in plain.to_json()
    assert fused.name == plain.name + "_nondet" and '"deterministic":false' in fused.to_json()
    assert fagen.KernelSpec.from_json(fused.to_json()) == fused
    for fields, field in ((dict(), "deterministic"), (dict(direction="bwd", kind="decode"), "direction"),
                          (dict(direction="bwd", score_mod="score * 2.0"), "deterministic")):
        with pytest.raises(SpecError) as e:
            fagen.KernelSpec(head_dim=64, deterministic=False, **fields)
        assert e.value.field == field
    with pytest.raises(SpecError, match="must be true or false"):
        fagen.KernelSpec(head_dim=64, direction="bwd", deterministic=0)
    source = generate(fused)
    assert "tl.atomic_add(" in source and "def _attn_bwd_dq_post(" in source and "def _attn_bwd_dq(" not in source
    assert "atomic_add" not in generate(plain) and "DQAccum" not in generate(plain)


@pytest.mark.parametrize("mask", list(Mask))
@settings(max_examples=3 if not ON_GPU else 2, deadline=None)
@given(data=st.data())
def test_drawn_specs_and_problems_match_the_reference(mask, data):
    """Hypothesis over head dims, gqa, blocks, dtypes, score switches and problems, as tests/test_backward.py."""
    on = (False, True)
    spec = data.draw(specs(masks=[mask], directions=[Direction.BWD], head_dims=(16, 24, 40), blocks=(16, 32),
                           window=on, softcap=on, alibi=on, sinks=on), label="spec")
    spec = dataclasses.replace(spec, deterministic=False)
    problem = data.draw(problems(spec, "cpu"), label="problem")
    check_backward(fagen.load(spec), spec, problem, DEVICE)


@pytest.mark.parametrize("mask", list(Mask))
def test_matches_reference_with_gqa_ragged_lengths_and_poison(mask):
    spec = atomic_spec(mask)
    check_backward(fagen.load(spec), spec, ragged(mask), DEVICE)


@pytest.mark.parametrize("dtype, head_dim_v", [("fp32", None), ("fp16", 24)])
def test_fp32_and_a_narrower_v(dtype, head_dim_v):
    """fp32 (full fp32 dots) and MLA-style head dims (v narrower than q and k: DQAccum takes q's)."""
    spec = atomic_spec("causal+padding", dtype=dtype, head_dim=40, head_dim_v=head_dim_v)
    check_backward(fagen.load(spec), spec, ragged(Mask.CAUSAL_PADDING), DEVICE)


@pytest.mark.parametrize("mask", ["causal", "none"])
def test_wide_blocks_and_gqa_4(mask):
    """block 128: each dK/dV program owns 128 keys and steps over 64 queries, adding [64, D] dQ partials."""
    spec = atomic_spec(mask, gqa=4, head_dim=24, block=128)
    mod = fagen.load(spec)
    assert (mod.DKDV_BLOCK_N, mod.DKDV_BLOCK_M) == (128, 64)
    check_backward(mod, spec, Problem(batch=1, heads_kv=1, seq_q=150, seq_k=301, seed=21), DEVICE)


def test_score_switches():
    """window, softcap, ALiBi and sinks through the fused path (fp32: the switches' bugs, not rounding, show)."""
    spec = atomic_spec("causal", dtype="fp32", head_dim=32, window=True, softcap=True, alibi=True, sinks=True)
    check_backward(fagen.load(spec), spec, ragged(Mask.CAUSAL, window=(9, 3), softcap=2.0, alibi=True, sinks=True,
                                                  magnitude=4.0), DEVICE)


def test_varlen():
    spec = fagen.KernelSpec(head_dim=32, mask="causal", gqa=2, dtype="fp16", direction="bwd", layout="varlen",
                            block_m=16, block_n=16, num_warps=1, num_stages=1, deterministic=False)
    module = fagen.load(spec)

    @settings(max_examples=4 if not ON_GPU else 10)
    @given(layouts.cases(spec, max_len=40 if not ON_GPU else 700))
    def run(case):
        layouts.check_backward(module, spec, case, DEVICE)

    run()


def test_rows_that_see_no_key_get_zero_dq_and_keys_nobody_sees_get_nothing():
    problem = Problem(batch=2, heads_kv=1, seq_q=30, seq_k=30, seqlens_q=(25, 0), seqlens_k=(3, 30), poison=True,
                      seed=3)
    spec = atomic_spec("causal+padding", head_dim=32)
    mod = fagen.load(spec)
    (q, k, v), kwargs = problem.inputs(spec, DEVICE)
    do = grad_output(problem, spec, DEVICE)
    out, lse = mod.forward(q, k, v, **kwargs)
    dq, dk, dv = mod.backward(do, q, k, v, out, lse, **kwargs)
    vis = reference.visible(Mask.CAUSAL_PADDING, 2, 30, 30, device=DEVICE, **kwargs)
    empty, unseen = ~vis.any(-1), ~vis.any(-2)
    assert all(g.isfinite().all() for g in (dq, dk, dv))
    assert (dq.float()[empty.unsqueeze(1).expand(-1, dq.shape[1], -1)] == 0).all(), "dq of an empty row is not 0"
    for g in (dk, dv):
        assert (g.float()[unseen.unsqueeze(1).expand(-1, g.shape[1], -1)] == 0).all(), "unseen key got a gradient"


def test_only_dq_or_only_dkdv_requested():
    """dQ comes out of the dK/dV kernel: asking for dq alone still runs it; asking for dk/dv alone gives no dq."""
    spec = atomic_spec("causal", head_dim=32)
    mod = fagen.load(spec)
    problem = ragged(Mask.CAUSAL)
    (q, k, v), kwargs = problem.inputs(spec, DEVICE)
    do = grad_output(problem, spec, DEVICE)
    out, lse = mod.forward(q, k, v, **kwargs)
    dq, dk, dv = mod.backward(do, q, k, v, out, lse, **kwargs)
    only_q = mod._launch_backward(do, q, k, v, out, lse, q.shape[-1] ** -0.5, None, None, None, need_dkdv=False)
    only_kv = mod._launch_backward(do, q, k, v, out, lse, q.shape[-1] ** -0.5, None, None, None, need_dq=False)
    assert torch.equal(only_q[0], dq) and only_kv[0] is None
    assert torch.equal(only_kv[1], dk) and torch.equal(only_kv[2], dv)


def test_fagen_attention_keyword_trains_and_matches_the_deterministic_path():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 37, 32, dtype=torch.float32, device=DEVICE) for _ in range(3))
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    grads = []
    for deterministic in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fagen.attention(*leaves, mask="causal", deterministic=deterministic).square().sum().backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with pytest.raises(fagen.AttentionError, match="deterministic"):
        fagen.attention(q, k, v, deterministic="no")
    with pytest.raises(fagen.AttentionError, match="user mods keep the deterministic backward"):
        fagen.attention(q, k, v, score_mod=lambda score, b, h, q_idx, kv_idx: score * 2, deterministic=False)


def test_the_compiled_path_carries_the_mode():
    """fagen.runtime.ops.attention (what fagen.attention runs under torch.compile) picks the deterministic=False
    module when told, and its autograd is that module's: the gradients are the fused path's."""
    from fagen.runtime import ops, resolve

    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 21, 16, dtype=torch.float32, device=DEVICE) for _ in range(3))
    do = torch.randn_like(q)
    fused = resolve.resolve(q, k, v, "causal", False, deterministic=False)
    plain = resolve.resolve(q, k, v, "causal", False)
    assert hasattr(fused, "_attn_bwd_dq_post") and hasattr(plain, "_attn_bwd_dq") and fused is not plain
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, _ = ops.attention(qg, kg, vg, "causal", None, None, None, None, False, deterministic=False)
    out.backward(do)
    assert fused.__name__ in ops._MODULES
    out_f, lse_f = fused.forward(q, k, v)
    want = fused.backward(do, q, k, v, out_f, lse_f)
    assert torch.equal(out.detach(), out_f)
    assert torch.equal(kg.grad, want[1]) and torch.equal(vg.grad, want[2])  # dk, dv: no atomics
    torch.testing.assert_close(qg.grad, want[0], rtol=0, atol=1e-5)  # dq: atomics, any order


@pytest.mark.parametrize("mutant", ATOMIC_MUTANTS, ids=lambda m: m.name)
def test_check_backward_catches_the_atomic_mutants(mutant):
    spec = atomic_spec(mutant.masks[0], head_dim=24)
    assert mutant.applies(spec) and not mutant.applies(dataclasses.replace(spec, deterministic=True))
    problem = ragged(mutant.masks[0])
    check_backward(fagen.load(spec), spec, problem, DEVICE)
    broken = runtime.load_source(mutant.apply(generate(spec)), f"{spec.name}_{mutant.name.replace('-', '_')}")
    with pytest.raises(PropertyFailure):
        check_backward(broken, spec, problem, DEVICE)


ONE_KEY = [  # every row that sees a key sees exactly one (softmax exactly 1): dQ and dK are exactly 0
    ("none", Problem(batch=2, heads_kv=2, seq_q=150, seq_k=1, seed=6)),
    ("tree", Problem(batch=2, heads_kv=2, seq_q=70, seq_k=70, seed=8, parents=(tuple([-1] * 70),) * 2)),
]


@pytest.mark.skipif(not ON_GPU, reason="a property of the tensor cores' sums (tests/test_backward.py)")
@pytest.mark.parametrize("mask, problem", ONE_KEY, ids=lambda x: x if isinstance(x, str) else "")
def test_rows_that_see_one_key_get_exactly_zero_dq_and_dk(mask, problem):
    """[Note] Atomic dQ: dS = 0 exactly in every block, so every atomic adds zeros and dQ stays exactly 0."""
    spec = atomic_spec(mask, head_dim=128, block=64)
    mod = fagen.load(spec)
    (q, k, v), kwargs = problem.inputs(spec, DEVICE)
    out, lse = mod.forward(q, k, v, **kwargs)
    dq, dk, dv = mod.backward(grad_output(problem, spec, DEVICE), q, k, v, out, lse, **kwargs)
    assert dq.abs().max().item() == 0 and dk.abs().max().item() == 0 and dv.abs().max().item() > 0


@pytest.mark.skipif(not ON_GPU, reason="the interpreter runs atomics in order")
def test_dk_dv_bitwise_and_dq_within_tolerance_across_runs_on_gpu():
    spec = atomic_spec("causal", head_dim=128, block=64, gqa=4)
    mod = fagen.load(spec)
    problem = Problem(batch=2, heads_kv=2, seq_q=1000, seq_k=1500, seed=3)
    (q, k, v), kwargs = problem.inputs(spec, DEVICE)
    do = grad_output(problem, spec, DEVICE)
    out, lse = mod.forward(q, k, v, **kwargs)
    first = mod.backward(do, q, k, v, out, lse, **kwargs)
    second = mod.backward(do, q, k, v, out, lse, **kwargs)
    assert torch.equal(first[1], second[1]) and torch.equal(first[2], second[2])
    torch.testing.assert_close(first[0].float(), second[0].float(), atol=1e-2, rtol=1e-2)
    check_backward(mod, spec, problem, DEVICE)


def test_direction_is_bwd_only():
    assert atomic_spec("causal").direction is Direction.BWD


def test_the_standard_suite_has_both_backward_modes_and_their_targets():
    """`fagen bench --suite standard`: the deterministic=False row runs the same case, fagen only, and is scored
    against the deterministic row's cuDNN number (issue 28: >= 1.0x; the deterministic row >= 0.95x)."""
    from fagen.bench.report import relative_target
    from fagen.bench.workloads import standard_suite

    by = {c.name: c for c in standard_suite()}
    det, fast = by["bwd-d128-causal-s16k"], by["bwd-d128-causal-s16k-nondet"]
    assert fast.spec("cpu")[0] == dataclasses.replace(det.spec("cpu")[0], deterministic=False)
    assert not fast.peers and det.peers
    records = {("bwd-d128-causal-s16k", "sdpa-cudnn"): {"tflops": 520.0, "metric": "tflops", "status": "ok"}}
    assert relative_target("bwd-d128-causal-s16k-nondet", 546.0, records) == \
        "1.05x bwd-d128-causal-s16k/sdpa-cudnn (>= 1 met)"
    assert relative_target("bwd-d128-causal-s16k", 470.0, records) == "0.90x sdpa-cudnn (>= 0.95 MISSED)"


def test_cli_flag_and_tune_refusal(tmp_path):
    """--no-deterministic renders the fused module; `fagen tune` leaves such a spec alone (the tuned table's keys
    have no mode, so its winner would become the deterministic spec's default)."""
    from click.testing import CliRunner

    from fagen.cli import main

    res = CliRunner().invoke(main, ["generate", "--head-dim", "32", "--direction", "bwd", "--no-deterministic", "-o",
                                    str(tmp_path)], catch_exceptions=False)
    assert res.exit_code == 0 and (tmp_path / "attn_bwd_full_d32_m64n64w4s3_g1_fp16_nondet.py").exists()
    res = CliRunner().invoke(main, ["tune", "--device", "cpu", "--quick", "--head-dim", "32", "--direction", "bwd",
                                    "--no-deterministic", "--dry-run"], catch_exceptions=False)
    assert "deterministic=False is not tuned" in res.output and "nothing tuned" in res.output
