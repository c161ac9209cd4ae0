"""Generated backward kernels and autograd against float64 autograd through the reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fagen
from fagen.runtime import loader as runtime
from fagen.verify import mutants, reference
from fagen.spec.axes import Direction, DType, Mask
from fagen.codegen.render import generate
from fagen.verify.strategies import Problem, problems, specs
from fagen.verify.properties import (TOLERANCE, PropertyFailure, check_backward, compare, compare_grad, grad_output,
                          reference_gradients)
from _env import DEVICE, ON_GPU

BWD = Direction.BWD
# GPU: realistic head dims and one block config, so few kernels compile (fp32's ieee dots compile slowly: D 64 and
# 32-blocks only); at most 4 examples per mask x dtype keeps the run within minutes, compiles dominating.
# CPU: the interpreter, small shapes and blocks, the profile's example count ("ci": 10).
SCALE = "gpu-bwd" if ON_GPU else "cpu"
EXAMPLES = settings(max_examples=4) if ON_GPU else settings()


def search_space(dtype):
    """(head_dims, blocks) the properties draw from for `dtype`."""
    if not ON_GPU:
        return (16, 24, 40, 64), (16, 32)
    return ((64,), (32,)) if dtype is DType.FP32 else ((64, 128), (64,))


def bwd_spec(mask, dtype="fp16", gqa=1, head_dim=40, block=16, **kw):
    return fagen.KernelSpec(head_dim=head_dim, mask=mask, dtype=dtype, gqa=gqa, direction=BWD, block_m=block,
                            block_n=block, **kw)


def ragged_problem(mask, **kw):
    """Lengths that are no multiple of 16 or 32, Sq != Sk, a padded row block and a tree with several roots."""
    sq, sk = (9, 9 + 37) if mask is Mask.TREE else (37, 53)
    return Problem(batch=2, heads_kv=1, seq_q=sq, seq_k=sk, seed=11,
                   seqlens_q=(37, 20) if mask.padded else None, seqlens_k=(53, 1) if mask.padded else None,
                   parents=((-1, 0, 1, 1, 0, 4, -1, 6, 2),) * 2 if mask is Mask.TREE else None, **kw)


@pytest.mark.parametrize("dtype", list(DType.portable()))
@pytest.mark.parametrize("mask", list(Mask))
@EXAMPLES
@given(data=st.data())
def test_backward_matches_reference(mask, dtype, data):
    head_dims, blocks = search_space(dtype)
    spec = data.draw(specs(masks=[mask], dtypes=[dtype], directions=[BWD], head_dims=head_dims, blocks=blocks),
                     label="spec")
    problem = data.draw(problems(spec, SCALE), label="problem")
    check_backward(fagen.load(spec), spec, problem, DEVICE)


@pytest.mark.parametrize("mask", list(Mask))
def test_every_mask_with_gqa_4_odd_head_dim_and_poison(mask):
    """Fixed coverage: gqa 4, head_dim 40 (padded to 64 inside), ragged lengths, NaN in every padding slot."""
    spec = bwd_spec(mask, dtype="bf16", gqa=4)
    check_backward(fagen.load(spec), spec, ragged_problem(mask, poison=mask.padded), DEVICE)


def wide_block_problem(mask):
    """Several 128-blocks and 64-steps on both axes, ragged tails, Sq != Sk, padding with NaN, a 70-node forest."""
    if mask is Mask.TREE:
        parents = tuple(-1 if i % 23 == 0 else (i - 1 if i % 3 else i // 2) for i in range(70))
        return Problem(batch=2, heads_kv=1, seq_q=70, seq_k=70 + 141, seed=21, parents=(parents,) * 2)
    return Problem(batch=2, heads_kv=1, seq_q=150, seq_k=301, seed=21, poison=mask.padded,
                   seqlens_q=(150, 70) if mask.padded else None, seqlens_k=(301, 129) if mask.padded else None)


@pytest.mark.parametrize("mask", list(Mask))
def test_wide_blocks_step_over_the_other_axis_in_tiles_of_64(mask):
    """block_m = block_n = 128 (the d128 default): dK/dV programs own 128 keys and step over 64 queries at a time,
    dQ programs own 128 queries and step over 64 keys; the query/key ranges, masks and gqa-2 sums stay exact."""
    spec = bwd_spec(mask, dtype="bf16", gqa=2, head_dim=128 if ON_GPU else 24, block=128)
    mod = fagen.load(spec)
    assert (mod.DKDV_BLOCK_N, mod.DKDV_BLOCK_M, mod.DQ_BLOCK_M, mod.DQ_BLOCK_N) == (128, 64, 128, 64)
    check_backward(mod, spec, wide_block_problem(mask), DEVICE)


@pytest.mark.parametrize("mask", ["causal", "tree"])
def test_default_d128_bwd_spec_matches_reference(mask):
    """The d128 default tiles (m128n128w8s3; tree m64n32w8s2) on ragged problems, gqa 4 (one flat head loop)."""
    spec = fagen.KernelSpec(head_dim=128, mask=mask, dtype="bf16", gqa=4, direction=BWD)
    assert (spec.block_m, spec.block_n) == ((128, 128) if mask == "causal" else (64, 32))
    problem = wide_block_problem(Mask(mask))
    check_backward(fagen.load(spec), spec, problem, DEVICE)


@pytest.mark.skipif(not ON_GPU, reason="realistic shapes need a GPU")
@pytest.mark.parametrize("mask", ["causal", "none"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_realistic_shapes_on_gpu(head_dim, dtype, mask):
    """S = 4096 with D 64 and 128: one KV head and gqa 2 keep the float64 reference within memory."""
    spec = fagen.KernelSpec(head_dim=head_dim, mask=mask, dtype=dtype, gqa=2, direction=BWD)
    check_backward(fagen.load(spec), spec, Problem(batch=1, heads_kv=1, seq_q=4096, seq_k=4096, seed=1), DEVICE)


@pytest.mark.parametrize("mask", list(Mask))
def test_two_runs_give_bitwise_identical_gradients(mask):
    """No atomics: the same inputs give the same bits, including dK/dV summed over gqa heads."""
    spec = bwd_spec(mask, gqa=4, **({} if not ON_GPU else dict(head_dim=128, block=64)))
    problem = ragged_problem(mask) if not ON_GPU else Problem(
        batch=2, heads_kv=2, seq_q=1000 if mask is not Mask.TREE else 100, seq_k=1500, seed=3,
        seqlens_q=(1000, 517) if mask.padded else None, seqlens_k=(1500, 999) if mask.padded else None,
        parents=(tuple(range(-1, 99)),) * 2 if mask is Mask.TREE else None)
    mod = fagen.load(spec)
    (q, k, v), kwargs = problem.inputs(spec, DEVICE)
    do = grad_output(problem, spec, DEVICE)
    out, lse = mod.forward(q, k, v, **kwargs)
    first = mod.backward(do, q, k, v, out, lse, **kwargs)
    second = mod.backward(do.clone(), q.clone(), k.clone(), v.clone(), out.clone(), lse.clone(), **kwargs)
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} differs between two identical runs"


EMPTY_ROWS = [  # every problem has rows that see no key; some poison padding with NaN
    ("causal", Problem(batch=1, heads_kv=1, seq_q=40, seq_k=7, seed=1)),  # rows i < 33 see nothing
    ("padding", Problem(batch=2, heads_kv=1, seq_q=20, seq_k=20, seqlens_q=(20, 5), seqlens_k=(0, 20), seed=2)),
    ("causal+padding", Problem(batch=2, heads_kv=1, seq_q=30, seq_k=30, seqlens_q=(25, 0), seqlens_k=(3, 30),
                               poison=True, seed=3)),
    ("none", Problem(batch=1, heads_kv=1, seq_q=5, seq_k=0, seed=4)),
    ("padding", Problem(batch=1, heads_kv=1, seq_q=33, seq_k=17, seqlens_q=(0,), seqlens_k=(17,), poison=True,
                        seed=5)),
]


@pytest.mark.parametrize("dtype", list(DType.portable()))
@pytest.mark.parametrize("mask, problem", EMPTY_ROWS)
def test_rows_that_see_no_key_get_zero_dq_and_give_nothing(mask, problem, dtype):
    spec = bwd_spec(mask, dtype=dtype, gqa=2, head_dim=32)
    mod = fagen.load(spec)
    (q, k, v), kwargs = problem.inputs(spec, DEVICE)
    do = grad_output(problem, spec, DEVICE)
    out, lse = mod.forward(q, k, v, **kwargs)
    dq, dk, dv = mod.backward(do, q, k, v, out, lse, **kwargs)
    vis = reference.visible(mask, problem.batch, problem.seq_q, problem.seq_k, device=DEVICE,
                            **{k_: v_ for k_, v_ in kwargs.items() if k_.startswith("seqlens")})
    empty, unseen = ~vis.any(-1), ~vis.any(-2)  # [B, Sq] rows that see no key, [B, Sk] keys no row sees
    assert empty.any(), "the problem must contain rows that see no key"
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert not g.isnan().any() and not g.isinf().any(), f"{name} is not finite"
    assert (dq.float()[empty.unsqueeze(1).expand(-1, dq.shape[1], -1)] == 0).all(), "dq of an empty row is not 0"
    for g in (dk, dv):
        assert (g.float()[unseen.unsqueeze(1).expand(-1, g.shape[1], -1)] == 0).all(), "unseen key got a gradient"
    check_backward(mod, spec, problem, DEVICE)


ONE_KEY = [  # every row that sees a key sees exactly one (softmax exactly 1): dQ and dK are exactly 0
    ("none", Problem(batch=2, heads_kv=2, seq_q=150, seq_k=1, seed=6)),
    ("padding", Problem(batch=2, heads_kv=2, seq_q=150, seq_k=70, seqlens_q=(150, 37), seqlens_k=(1, 1), seed=7)),
    ("tree", Problem(batch=2, heads_kv=2, seq_q=70, seq_k=70, seed=8, parents=(tuple([-1] * 70),) * 2)),
]


@pytest.mark.skipif(not ON_GPU, reason="a property of the tensor cores' sums: the interpreter's numpy dot sums in a "
                                         "shape-dependent order")
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("mask, problem", ONE_KEY, ids=lambda x: x if isinstance(x, str) else "")
def test_rows_that_see_one_key_get_exactly_zero_dq_and_dk(mask, problem, dtype):
    """[Note] Exact delta: with p = 1 the forward stores O_i = V_j exactly, and delta_i must equal dP_ij bitwise,
    so dS = 0 and dQ = dK = 0 exactly, as in PyTorch (rowsum(dO * O) on the CUDA cores left up to ~5e-5)."""
    spec = bwd_spec(mask, dtype=dtype, gqa=2, head_dim=128, block=64)
    mod = fagen.load(spec)
    (q, k, v), kwargs = problem.inputs(spec, DEVICE)
    do = grad_output(problem, spec, DEVICE)
    out, lse = mod.forward(q, k, v, **kwargs)
    dq, dk, dv = mod.backward(do, q, k, v, out, lse, **kwargs)
    for name, g in (("dq", dq), ("dk", dk)):
        assert g.abs().max().item() == 0, f"{name} is not exactly 0: max |{name}| = {g.abs().max().item():.3g}"
    assert dv.abs().max().item() > 0, "dv must carry the gradient (the problem is not degenerate)"


# The delta line of [Note] Exact delta and the rowsum it replaced: the teeth of the test above.
EXACT_DELTA = "delta = tl.sum(tl.where(eye, tl.dot(o, tl.trans(do)), 0.0), 1)"
ROWSUM_DELTA = "delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)"


@pytest.mark.skipif(not ON_GPU, reason="a property of the tensor cores' sums (see above)")
def test_one_key_test_fails_with_a_rowsum_delta():
    """With delta = rowsum(dO * O) on the CUDA cores (the backward before [Note] Exact delta), the one-key rows of
    the test above are left with a residue: that test can fail."""
    mask, problem = ONE_KEY[0]
    spec = bwd_spec(mask, dtype="bf16", gqa=2, head_dim=128, block=64)
    source = generate(spec)
    assert EXACT_DELTA in source
    mod = runtime.load_source(source.replace(EXACT_DELTA, ROWSUM_DELTA), f"{spec.name}_rowsum_delta")
    (q, k, v), kwargs = problem.inputs(spec, DEVICE)
    do = grad_output(problem, spec, DEVICE)
    out, lse = mod.forward(q, k, v, **kwargs)
    dq, dk, _ = mod.backward(do, q, k, v, out, lse, **kwargs)
    assert max(dq.abs().max().item(), dk.abs().max().item()) > 0, "the rowsum delta cancelled exactly too"


@pytest.mark.parametrize("dtype", list(DType.portable()))
@pytest.mark.parametrize("mask", list(Mask))
def test_no_nan_with_large_magnitude_inputs(mask, dtype):
    """|logits| in the hundreds (one-hot softmax rows and rare near-ties): every gradient stays finite."""
    spec = bwd_spec(mask, dtype=dtype, gqa=2, head_dim=32)
    problem = ragged_problem(mask, magnitude=300.0, poison=mask.padded)
    mod = fagen.load(spec)
    (q, k, v), kwargs = problem.inputs(spec, DEVICE)
    do = grad_output(problem, spec, DEVICE)
    out, lse = mod.forward(q, k, v, **kwargs)
    grads = mod.backward(do, q, k, v, out, lse, **kwargs)
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert torch.isfinite(g).all(), f"{name} has {int((~torch.isfinite(g)).sum())} non-finite entries"
    # Scores of ~1e3 carry ~1e-4 relative fp32 rounding into P: beyond fp32's table (sized for |q| <= 16, which the
    # properties compare in full) but well inside fp16/bf16's. dV = P^T dO is the one gradient not scaled by |q|.
    if spec.dtype is not DType.FP32:
        _, _, _, _, ref_dv = reference_gradients(q, k, v, do, mask, out=out, **kwargs)
        compare_grad("dv", grads[2], ref_dv, spec.dtype)


@pytest.mark.parametrize("mask", list(Mask))
def test_module_attention_autograd(mask):
    """out = mod.attention(...); out.backward(g) fills .grad like backward(); k needs no grad and gets None."""
    spec = bwd_spec(mask, dtype="fp32", gqa=2, head_dim=24)
    mod = fagen.load(spec)
    problem = ragged_problem(mask)
    (q, k, v), kwargs = problem.inputs(spec, DEVICE)
    do = grad_output(problem, spec, DEVICE)
    q.requires_grad_()
    v.requires_grad_()
    out = mod.attention(q, k, v, **kwargs)
    assert out.requires_grad
    out.backward(do)
    ref_out, lse = mod.forward(q.detach(), k, v, **kwargs)
    dq, _, dv = mod.backward(do, q.detach(), k, v, ref_out, lse, **kwargs)
    assert torch.equal(out.detach(), ref_out)
    assert torch.equal(q.grad, dq) and torch.equal(v.grad, dv) and k.grad is None
    _, _, want_dq, _, want_dv = reference_gradients(q, k, v, do, mask, out=ref_out, **kwargs)
    compare_grad("dq", q.grad, want_dq, spec.dtype)
    compare_grad("dv", v.grad, want_dv, spec.dtype)


def test_attention_without_grad_and_with_strided_inputs_and_expanded_do():
    """No input needs grad: a plain forward. Then [B, S, H, D] views and out.sum() (a stride-0 dO) train."""
    spec = bwd_spec("causal", gqa=2, head_dim=32)
    mod = fagen.load(spec)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 33, 4, 32, generator=g).half().to(DEVICE).transpose(1, 2)
    k = torch.randn(2, 21, 2, 32, generator=g).half().to(DEVICE).transpose(1, 2)
    v = torch.randn(2, 21, 2, 32, generator=g).half().to(DEVICE).transpose(1, 2)
    assert not mod.attention(q, k, v).requires_grad
    for t in (q, k, v):
        t.requires_grad_()
    out = mod.attention(q, k, v)
    out.float().sum().backward()
    _, _, *want = reference_gradients(q, k, v, torch.ones_like(out), "causal", out=out)
    for name, got, ref in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want):
        compare_grad(name, got, ref, spec.dtype)


@pytest.mark.parametrize("mask", list(Mask))
def test_fagen_attention_picks_the_kernel_and_trains(mask):
    problem = ragged_problem(mask)
    from fagen.runtime.api import spec_for

    spec = spec_for(*problem.inputs(bwd_spec(mask, gqa=2, head_dim=24), DEVICE)[0], mask=mask)
    assert (spec.gqa, spec.head_dim, spec.dtype, spec.direction, spec.mask) == (2, 24, DType.FP16, BWD, mask)
    (q, k, v), kwargs = problem.inputs(spec, DEVICE)
    do = grad_output(problem, spec, DEVICE)
    for t in (q, k, v):
        t.requires_grad_()
    out = fagen.attention(q, k, v, mask=str(mask), **kwargs)
    out.backward(do)
    _, _, *want = reference_gradients(q, k, v, do, mask, out=out, **kwargs)
    for name, got, ref in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want):
        compare_grad(name, got, ref, spec.dtype)


def _qkv(dtype=torch.float16, hq=4, hkv=2, d=32):
    return (torch.randn(1, hq, 8, d).to(dtype).to(DEVICE), torch.randn(1, hkv, 8, d).to(dtype).to(DEVICE),
            torch.randn(1, hkv, 8, d).to(dtype).to(DEVICE))


@pytest.mark.parametrize("args, kwargs, message", [
    (_qkv(torch.float64), {}, "dtype torch.float64 is not supported"),
    (_qkv(d=12), {}, "head_dim: got 12"),
    (_qkv(hq=3, hkv=2), {}, "q's heads must be a multiple"),
    (_qkv()[:1] + (_qkv(d=40)[1],) + _qkv()[2:], {}, "head_dim: q has 32 and k 40"),  # v's may differ (MLA)
    (_qkv(), {"mask": "diagonal"}, "mask: got 'diagonal'"),
    ((torch.randn(8, 32),) + _qkv()[1:], {}, "q: expected 4 dims"),
])
def test_fagen_attention_rejects_unsupported_inputs(args, kwargs, message):
    with pytest.raises(fagen.AttentionError, match=message):
        fagen.attention(*args, **kwargs)


def test_fagen_attention_passes_mask_input_errors_through():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="needs seqlens_q"):
        fagen.attention(q, k, v, mask="padding")


@pytest.mark.parametrize("which, message", [
    ("do_shape", "do: expected"), ("do_dtype", "do: expected"), ("out_shape", "out: expected"),
    ("lse_dtype", "lse: expected float32"), ("lse_shape", "lse: expected float32"),
])
def test_backward_rejects_bad_saved_inputs(which, message):
    spec = bwd_spec("causal", gqa=2, head_dim=32)
    mod = fagen.load(spec)
    q, k, v = _qkv()
    out, lse = mod.forward(q, k, v)
    do = torch.randn_like(q)
    bad = {"do_shape": dict(do=do[:, :, :4]), "do_dtype": dict(do=do.float()), "out_shape": dict(out=out[:, :2]),
           "lse_dtype": dict(lse=lse.double()), "lse_shape": dict(lse=lse[0])}[which]
    args = dict(do=do, q=q, k=k, v=v, out=out, lse=lse) | bad
    with pytest.raises(mod.InputError, match=message):
        mod.backward(args["do"], args["q"], args["k"], args["v"], args["out"], args["lse"])


# (the atomic dQ path's mutants: tests/test_backward_atomic.py)
BWD_MUTANTS = [m for m in mutants.MUTANTS if m.directions == (Direction.BWD,) and m.deterministic is None]


@pytest.mark.parametrize("mutant", BWD_MUTANTS, ids=lambda m: m.name)
def test_check_backward_catches_mutants(mutant):
    """Each backward mutant, on a spec it applies to, fails check_backward; the unmutated source passes."""
    mask = mutant.masks[0]
    switches = {switch: True for switch in mutant.switches}
    spec = bwd_spec(mask, gqa=2, head_dim=24, **switches)
    assert mutant.applies(spec) and not mutant.applies(fagen.KernelSpec(head_dim=24, mask=mask, **switches))
    problem = ragged_problem(mask, **({"softcap": 2.0, "magnitude": 4.0} if "softcap" in switches else {}),
                             **({"sinks": True} if "sinks" in switches else {}))
    check_backward(fagen.load(spec), spec, problem, DEVICE)
    broken = runtime.load_source(mutant.apply(generate(spec)), f"{spec.name}_{mutant.name.replace('-', '_')}")
    with pytest.raises(PropertyFailure):
        check_backward(broken, spec, problem, DEVICE)


def test_aot_kernel_list():
    """AOT_KERNELS lists the three backward kernels with a type for every argument, in argument order."""
    for mask in ("padding", "tree", "none"):
        mod = fagen.load(bwd_spec(mask, dtype="bf16", gqa=2))
        entries = {e["name"]: e for e in mod.AOT_KERNELS}
        assert {"_attn_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq"} <= set(entries)
        for name in ("_attn_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq"):
            e = entries[name]
            assert list(e["signature"]) == list(e["fn"].arg_names)
            consts = {a for a, t in e["signature"].items() if t == "constexpr"}
            assert consts == set(e["constexprs"]), name
            assert e["signature"].get("Q", "*bf16") == "*bf16" and e["num_warps"] == mod.NUM_WARPS
        dkdv = entries["_attn_bwd_dkdv"]
        assert dkdv["constexprs"]["GQA"] == 2 and dkdv["constexprs"]["UPCAST"] is False
        assert (dkdv["signature"]["SeqlensQ"] == "*i32") == (mask == "padding")
        assert (dkdv["signature"]["TreeMask"] == "*u8") == (mask == "tree")
        assert mask == "padding" or dkdv["constexprs"]["SeqlensQ"] is None


def test_cli_generates_the_backward_source(tmp_path):
    from click.testing import CliRunner
    from fagen.cli import main

    result = CliRunner().invoke(main, ["generate", "--direction", "bwd", "--head-dim", "64", "--mask", "causal",
                                       "--gqa", "4", "--dtype", "bf16", "-o", str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (path,) = tmp_path.iterdir()
    source = path.read_text()
    assert path.name.startswith("attn_bwd_causal_d64_") and source == generate(bwd_spec("causal", "bf16", 4, 64, 64))
    for name in ("def _attn_bwd_preprocess(", "def _attn_bwd_dkdv(", "def _attn_bwd_dq(", "def backward(",
                 "class _Attention(torch.autograd.Function)", "def attention(", "AOT_KERNELS"):
        assert name in source



def test_fagen_attention_picks_decode_for_few_queries_without_grad(monkeypatch):
    """No gradient, 3 queries against 300 keys: the decode kernel serves it; with gradients, the bwd prefill."""
    from fagen.runtime import api, resolve

    seen = []
    real = resolve._module
    monkeypatch.setattr(resolve, "_module", lambda spec: seen.append(spec.kind.value) or real(spec))
    monkeypatch.setattr(resolve, "_FAST", {})
    monkeypatch.setattr(api, "_FAST", resolve._FAST)
    spec = fagen.KernelSpec(head_dim=32, mask="causal", gqa=2, direction="bwd")
    (q, k, v), _ = Problem(batch=1, heads_kv=2, seq_q=3, seq_k=300, seed=11).inputs(spec, DEVICE)
    ref, _ = reference.attention(q, k, v, mask="causal")
    compare("out", fagen.attention(q, k, v, mask="causal"), ref, **TOLERANCE[spec.dtype])
    q.requires_grad_()
    compare("out", fagen.attention(q, k, v, mask="causal"), ref, **TOLERANCE[spec.dtype])
    assert seen == ["decode", "prefill"]
