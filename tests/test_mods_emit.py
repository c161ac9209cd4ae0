"""The Triton emitter and the derivatives, checked by running emitted code (Triton's interpreter on the CPU)
against the user's own function evaluated by torch, and torch autograd for the derivatives."""

import pytest
import torch

import mods_kernel
from fagen.mods import emit, grad, ir
from fagen.mods.text import parse
from fagen.mods.trace import trace_score_mod

B, H, SQ, SK = 2, 3, 8, 16


def _grid(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, SQ, SK, dtype=torch.float64, generator=g) * 3, mods_kernel.indices(B, H, SQ, SK)


def _check(fn, atol=1e-5, rtol=1e-5):
    traced = trace_score_mod(fn)
    score, ix = _grid()
    got = mods_kernel.run(traced.score_mod, {n: v for n, v in traced.values.items() if torch.is_tensor(v)},
                          {n: v for n, v in traced.values.items() if not torch.is_tensor(v)}, score)
    want = fn(score, *ix).expand(B, H, SQ, SK)
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=rtol)
    return traced


def test_int_floor_division_and_remainder_follow_python_for_negative_operands():
    # q_idx - kv_idx - 5 runs from -20 to 2: both signs of the dividend, and both signs of the divisor below.
    den = 3

    def mod(score, b, h, q_idx, kv_idx):
        d = q_idx - kv_idx - 5
        return score + d // den + (d % den) * 10.0 + (d // -4) * 100.0 + (d % -4) * 1000.0 + (-7 // (h + 2)) * 1e4

    _check(mod)


@pytest.mark.parametrize("den", [1, 2, 3, 4, 6, 7, 12, 64, 96, -1, -3, -8, 1000003, 2**31 - 1])
def test_divisibility_by_a_uniform_int_is_python_s(den):
    """`a % d == 0` / `!= 0` with d uniform over the tile (a closure int, h): _mod_divisible's inverse of d's odd part
    ([Note] Cheaper forms), for dividends of both signs, int32's extremes and 0."""
    g = torch.Generator().manual_seed(3)
    vals = torch.randint(-2**31, 2**31, (SK,), dtype=torch.int64, generator=g)
    vals[:8] = torch.tensor([-2**31, 2**31 - 1, 0, den, -den, 2 * den if abs(den) < 2**30 else 1, -1, 96 * 7 * 5])
    vals = vals.to(torch.int32)

    step = den if abs(den) < 2**20 else 5  # a stays inside int32 (the kernels' index arithmetic wraps there)

    def mod(score, b, h, q_idx, kv_idx):
        a = vals[kv_idx] // 4 + (q_idx - 3) * step
        return score + (a % den == 0) * 1.0 + (vals[kv_idx] % den != 0) * 10.0 + ((q_idx - kv_idx) % (h + 2) == 0) * 100.0

    traced = _check(mod)
    assert "_mod_divisible" in emit.to_triton(traced.score_mod, _names(traced))


def _names(traced):
    names = {"score": "score", "b": "b", "h": "h", "q_idx": "q_idx", "kv_idx": "kv_idx"}
    for name, v in traced.values.items():
        names[name] = emit.TensorRef("t", ("s",), ("n",)) if torch.is_tensor(v) else "x"
    return names


def test_float_ops_where_clamp_minmax_match_torch():
    cap = 7.5

    def mod(score, b, h, q_idx, kv_idx):
        s = cap * torch.tanh(score / cap) + torch.sigmoid(score) - torch.exp2(-(h + 1) * 0.5)
        s = torch.where(q_idx >= kv_idx, s, s * 0.5 + torch.log(torch.abs(score) + 1.0))
        s = s + torch.sqrt(torch.abs(score)) - torch.exp(torch.minimum(score, torch.clamp(score * 0.1, min=-1.0)))
        return s + torch.clamp(score, (kv_idx - q_idx) * 0.25 - 1.0, (kv_idx - q_idx) * 0.25 + 1.0) + (score % 1.5) + (score // 0.7) + kv_idx / 3

    _check(mod)


def test_bools_compose_and_promote():
    def mod(score, b, h, q_idx, kv_idx):
        keep = (q_idx >= kv_idx) | ~(kv_idx % 3 == 0) & (b == 1)
        return torch.where(keep, score, -float("inf")) + (q_idx > 2) * 1.0

    _check(mod)


def test_tensor_loads_clamp_out_of_range_indices_and_wrap_negative_ones():
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(H, 2 * SK, generator=g)
    doc = torch.randint(0, 4, (SK,), dtype=torch.int32, generator=g)

    def mod(score, b, h, q_idx, kv_idx):  # q_idx - kv_idx + SK - 1 runs over [0, SK + SQ - 2]: all in range
        return score + bias[h, q_idx - kv_idx + SK - 1] * doc[kv_idx]

    _check(mod)

    def wild(score, b, h, q_idx, kv_idx):
        # kv_idx - 20 runs from -20 to -5: torch wraps [-SK, -1] from the end; below -SK, the kernel clamps to 0
        return score + doc[kv_idx - 10] * 1.0 + bias[h, kv_idx * 3] * 0.0

    traced = trace_score_mod(wild)
    score, ix = _grid()
    got = mods_kernel.run(traced.score_mod, {"doc": doc, "bias": bias}, {}, score)
    kv = ix[3].expand(B, H, SQ, SK)
    i = kv - 10
    want = score + doc[torch.where(i < 0, i + SK, i).clamp(0, SK - 1)].double()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("text", [
    "score * score + 2.0 * score",
    "cap * tanh(score / cap)",
    "where(q_idx >= kv_idx, exp(score * 0.1), sigmoid(score))",
    "log(abs(score) + 1.0) + sqrt(abs(score) + 0.5) + exp2(score * 0.2)",
    "minimum(score, 1.5) + maximum(score * 2.0, -1.0) + clamp(score, -1.0, 2.0)",
    "score / (abs(score) + 1.0) + score % 1.5",  # float // has no torch derivative (ours: 0)
    "score + bias[h, kv_idx]",
    "minimum(score, score) + maximum(score, score + 0.0)",  # ties: torch splits the gradient evenly
])
def test_d_score_matches_autograd(text):
    tensors = (("bias", "fp32", 2),)
    scalars = (("cap", "float"),)
    tree = parse(text, tensors=tensors, scalars=scalars)
    dtree = grad.d_score(tree)
    g = torch.Generator().manual_seed(2)
    bias = torch.randn(H, SK, generator=g)
    score, ix = _grid()
    got = mods_kernel.run(dtree, {"bias": bias}, {"cap": 4.0}, score)
    s = score.clone().requires_grad_(True)
    env = {"score": s, "b": ix[0], "h": ix[1], "q_idx": ix[2], "kv_idx": ix[3], "cap": 4.0, "bias": bias.double()}
    want, = torch.autograd.grad(_torch_eval(tree, env).sum(), s)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_d_score_simplifies_trivial_cases():
    tensors = (("bias", "fp32", 2),)
    assert grad.d_score(parse("score + bias[h, q_idx - kv_idx + 4095]", tensors=tensors)) == grad.ONE
    assert grad.d_score(parse("score * 2.0 - 1.0")) == ir.const(2.0)
    assert grad.d_score(parse("where(q_idx >= kv_idx, score, -inf)")) == parse("where(q_idx >= kv_idx, 1.0, 0.0)")


def test_d_bias_per_load():
    tensors = (("bias", "fp32", 2), ("w", "fp32", 1))
    tree = parse("score * w[h] + bias[h, kv_idx] * 2.0 + bias[h, q_idx]", tensors=tensors)
    loads = grad.d_loads(tree, "bias")
    assert [(emit_text(load), emit_text(d)) for load, d in loads] == [("bias[h, kv_idx]", "2.0"), ("bias[h, q_idx]", "1.0")]
    (load, d), = grad.d_loads(tree, "w")
    assert emit_text(d) == "score"


def emit_text(node):
    from fagen.mods.text import to_text
    return to_text(node)


def test_emitter_needs_every_name():
    with pytest.raises(KeyError, match="q_idx"):
        emit.to_triton(parse("score + q_idx"), {"score": "s"})


def _torch_eval(node, env):
    """A test-only evaluator of a tree in torch (float64), for autograd's derivatives of parsed texts."""
    ev = lambda n: _torch_eval(n, env)  # noqa: E731
    if isinstance(node, (ir.Input, ir.Scalar)):
        return env[node.name]
    if isinstance(node, ir.Const):
        return node.value
    if isinstance(node, ir.Load):
        return env[node.name][tuple(ev(i) for i in node.index)]
    if isinstance(node, ir.Where):
        return torch.where(ev(node.cond), ev(node.a), ev(node.b))
    if isinstance(node, ir.Clamp):
        return torch.clamp(ev(node.x), ev(node.lo), ev(node.hi))
    if isinstance(node, ir.Unary):
        x = ev(node.x)
        x = x if torch.is_tensor(x) else torch.tensor(x, dtype=torch.float64)
        return {"neg": torch.neg, "invert": torch.bitwise_not, "abs": torch.abs, "exp": torch.exp, "exp2": torch.exp2,
                "log": torch.log, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "sqrt": torch.sqrt}[node.op](x)
    a, b = ev(node.a), ev(node.b)
    a = a if torch.is_tensor(a) else torch.tensor(a, dtype=torch.float64)
    if node.op in ir.MINMAX:
        b = b if torch.is_tensor(b) else torch.tensor(b, dtype=torch.float64)
        return getattr(torch, node.op)(a, b)
    return {"+": a.__add__, "-": a.__sub__, "*": a.__mul__, "/": a.__truediv__, "//": a.__floordiv__,
            "%": a.__mod__, "&": a.__and__, "|": a.__or__, "<": a.__lt__, "<=": a.__le__, ">": a.__gt__,
            ">=": a.__ge__, "==": a.__eq__, "!=": a.__ne__}[node.op](b)


@pytest.mark.parametrize("name", ["document + causal", "prefix-lm", "sliding window + causal", "dilated", "natten",
                                  "flamingo (rows of a captured tensor)"])
def test_gym_mask_mods_emit_what_torch_computes(name):
    from test_mods_trace import MASK_MODS
    from fagen.mods.trace import trace_mask_mod
    from fagen.verify.mods_reference import mask_mod_visible

    fn = MASK_MODS[name][0]()
    traced = trace_mask_mod(fn)
    score, ix = _grid()
    got = mods_kernel.run(traced.mask_mod, {n: v for n, v in traced.values.items() if torch.is_tensor(v)},
                          {n: v for n, v in traced.values.items() if not torch.is_tensor(v)}, score)
    # document ids cover 33 positions and flamingo's boundaries 18, more than SK: torch reads them all in range.
    want = mask_mod_visible(fn, B, H, SQ, SK)  # the reference's own evaluation (vmapped, as Flex's)
    assert torch.equal(got.bool(), want)


def test_hoist_takes_out_the_largest_loop_invariant_loads_once():
    """[Note] Hoisted loads: document_id[q_idx] and q_idx - offsets[document_id[q_idx]] leave a loop over keys;
    whatever reads kv_idx (or h in the dK/dV loop) stays, and equal subtrees share one placeholder."""
    from fagen.codegen.mod_args import hoist
    from fagen.mods.text import ModTensor, to_text

    decls = (ModTensor("doc", "i32", 1), ModTensor("off", "i32", 1), ModTensor("hb", "fp32", 2))
    tree = parse("(doc[q_idx] == doc[kv_idx]) & (q_idx - off[doc[q_idx]] >= kv_idx - off[doc[kv_idx]]) & "
                 "(doc[q_idx] <= kv_idx)", "mask_mod", decls, ())
    rest, found = hoist(tree, frozenset({"b", "h", "q_idx"}), "q")
    assert [to_text(sub) for _, sub in found] == ["doc[q_idx]", "q_idx - off[doc[q_idx]]"]
    assert "q_idx" not in to_text(rest).replace("_modq", "") and to_text(rest).count("_modq0") == 2
    rest, found = hoist(tree, frozenset({"b", "kv_idx"}), "k")
    assert [to_text(sub) for _, sub in found] == ["doc[kv_idx]", "kv_idx - off[doc[kv_idx]]"]
    assert "doc[kv_idx]" not in to_text(rest) and "off[" not in to_text(rest).replace("off[doc[q_idx]]", "")
    score = parse("score + hb[h, kv_idx] + hb[h, q_idx]", "score_mod", decls, ())
    _, found = hoist(score, frozenset({"b", "kv_idx"}), "k")
    assert found == ()  # h varies in the dK/dV loop
    _, found = hoist(score, frozenset({"b", "h", "q_idx"}), "q")
    assert [to_text(sub) for _, sub in found] == ["hb[h, q_idx]"]
