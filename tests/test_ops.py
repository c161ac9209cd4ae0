"""torch.library operators: opcheck on every mask x kind, and torch.compile(fullgraph=True) through fagen.attention
with zero graph breaks, dynamic lengths without recompiles, caller-owned buffers. On the CPU the compiled graph
runs with the aot_eager backend (the kernels through Triton's interpreter); on a GPU with Inductor
(FAGEN_TEST_INDUCTOR=1 takes Inductor on the CPU too, for its C++ lowering of the host code)."""

import os
import pytest
import torch
from torch.library import opcheck

import fagen
from fagen.runtime.resolve import resolve
from fagen.verify import reference
from fagen.verify.strategies import Problem
from fagen.verify.tolerances import TOLERANCE, compare
from _env import DEVICE, ON_GPU

BACKEND = "inductor" if ON_GPU or os.environ.get("FAGEN_TEST_INDUCTOR") else "aot_eager"
MASKS = ["none", "causal", "padding", "causal+padding", "tree"]


def _problem(spec, sq=20, sk=27):
    lens = ((sq, sq - 3), (sk, sk - 4)) if spec.mask.padded else (None, None)
    parents = ((-1,) + tuple(i // 2 for i in range(sq - 1)),) * 2 if spec.mask == "tree" else None
    return Problem(batch=2, heads_kv=2, seq_q=sq, seq_k=max(sk, sq), seed=5, seqlens_q=lens[0], seqlens_k=lens[1],
                   parents=parents)


def _launch_args(module, spec, problem):
    (q, k, v), kw = problem.inputs(spec, DEVICE)
    sq, sk, tree = module._check_mask_inputs(q, k, kw.get("seqlens_q"), kw.get("seqlens_k"), kw.get("tree_mask"))
    return q, k, v, spec.head_dim ** -0.5, sq, sk, tree


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_opcheck_every_mask_and_kind(mask, kind):
    direction = "bwd" if kind == "prefill" else "fwd"
    spec = fagen.KernelSpec(head_dim=16, mask=mask, gqa=2, dtype="fp32", direction=direction, kind=kind,
                            block_m=16, block_n=16)
    module = fagen.load(spec)
    problem = _problem(spec, sq=3 if kind == "decode" else 20, sk=27)
    q, k, v, *rest = _launch_args(module, spec, problem)  # no grad: the operators carry none ([Note] One autograd)
    assert module.forward_op._qualname.startswith("fagen::" + spec.name)
    result = opcheck(module.forward_op, (q, k, v, *rest))
    assert set(result.values()) == {"SUCCESS"}, result
    out, lse = torch.empty_like(q), q.new_empty(q.shape[:3])
    result = opcheck(module.forward_out_op, (q.detach(), k.detach(), v.detach(), *rest, out, lse))
    assert set(result.values()) == {"SUCCESS"}, result


def _graph_ops(layer, *inputs):
    """The custom operators in the FX graph Dynamo captures from layer(*inputs) (one graph, no break)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(layer, fullgraph=True, backend=backend)(*inputs)
    assert len(graphs) == 1
    return {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function" and "fagen" in str(n.target)}


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_compiled_fagen_attention_runs_the_modules_own_operators(kind):
    """fagen.attention under torch.compile traces into the module an eager call would run (its operators, and for
    a bwd module its one autograd): no operator of its own ([Note] One autograd, also under torch.compile)."""
    torch._dynamo.reset()
    spec = fagen.KernelSpec(head_dim=16, mask="causal", gqa=2, dtype="fp32", kind=kind)
    sq, sk = (3, 300) if kind == "decode" else (20, 27)  # decode: few queries, a long cache (prefers_decode)
    (q, k, v), _ = Problem(batch=1, heads_kv=2, seq_q=sq, seq_k=sk, seed=8).inputs(spec, DEVICE)
    ops = _graph_ops(lambda q, k, v: fagen.attention(q, k, v, mask="causal"), q, k, v)
    module = resolve(q, k, v, "causal", kind == "decode")
    assert module.__name__.split(".")[-1].startswith("decode_fwd" if kind == "decode" else "attn_bwd"), module
    assert ops == {f"fagen.{module.forward_op._qualname.split('::')[1]}.default"}, ops
    compiled = torch.compile(lambda q, k, v: fagen.attention(q, k, v, mask="causal"), fullgraph=True,
                             backend=BACKEND)
    assert torch.equal(compiled(q, k, v), fagen.attention(q, k, v, mask="causal"))


@pytest.mark.parametrize("mask", MASKS)
def test_fullgraph_compile_forward_and_backward_without_graph_breaks(mask):
    torch._dynamo.reset()
    spec = fagen.KernelSpec(head_dim=16, mask=mask, gqa=2, dtype="fp32", direction="bwd")
    problem = _problem(spec)
    (q, k, v), kw = problem.inputs(spec, DEVICE)

    def layer(q, k, v):
        return fagen.attention(q, k, v, mask=mask, **kw).sum(-1)

    explain = torch._dynamo.explain(layer)(q, k, v)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    compiled = torch.compile(layer, fullgraph=True, backend=BACKEND)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled(*leaves).sum().backward()
    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    layer(*eager).sum().backward()
    for a, b in zip(leaves, eager):
        compare("grad", a.grad, b.grad, atol=1e-5, rtol=1e-5, expected="eager")


def test_dynamic_lengths_do_not_recompile():
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    spec = fagen.KernelSpec(head_dim=16, mask="causal", dtype="fp32", direction="bwd")

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def f(q, k, v):
        return fagen.attention(q, k, v, mask="causal")

    for sq in (17, 23, 40, 41):
        (q, k, v), _ = Problem(batch=1, heads_kv=1, seq_q=sq, seq_k=sq + 5, seed=sq).inputs(spec, DEVICE)
        want, _ = reference.attention(q, k, v, mask="causal")
        compare("out", f(q, k, v), want, **TOLERANCE[spec.dtype])
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 4 lengths"


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_caller_owned_out_and_lse(kind):
    spec = fagen.KernelSpec(head_dim=16, mask="causal", gqa=2, dtype="fp32", kind=kind, block_m=16, block_n=16)
    module = fagen.load(spec)
    (q, k, v), _ = _problem(spec, sq=3 if kind == "decode" else 20).inputs(spec, DEVICE)
    want_out, want_lse = module.forward(q, k, v)
    out = torch.full((q.shape[0], q.shape[2], q.shape[1], q.shape[3]), float("nan"), device=DEVICE).transpose(1, 2)
    lse = torch.full(q.shape[:3], float("nan"), device=DEVICE)
    got_out, got_lse = module.forward(q, k, v, out=out, lse=lse)
    assert got_out is out and got_lse is lse
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    with pytest.raises(module.InputError, match="lse: expected a contiguous float32"):
        module.forward(q, k, v, lse=torch.empty(3))


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_opcheck_with_every_score_switch(kind):
    """The per-spec operators carry window, softcap, slopes and sinks (and the sinks' gradient)."""
    direction = "bwd" if kind == "prefill" else "fwd"
    spec = fagen.KernelSpec(head_dim=16, mask="causal", gqa=2, dtype="fp32", direction=direction, kind=kind,
                            block_m=16, block_n=16, window=True, softcap=True, alibi=True, sinks=True)
    module = fagen.load(spec)
    (q, k, v), _ = _problem(spec, sq=3 if kind == "decode" else 20, sk=27).inputs(spec, DEVICE)
    g = torch.Generator().manual_seed(3)
    slopes, sinks = torch.rand(4, generator=g).to(DEVICE), torch.randn(4, generator=g).to(DEVICE)
    args = (q, k, v, 0.25, None, None, None, 5, 0, 3.0, slopes, sinks)
    result = opcheck(module.forward_op, args)
    assert set(result.values()) == {"SUCCESS"}, result
    if kind == "prefill":
        do = torch.randn_like(q)
        out, lse = module.forward_op(*args)
        result = opcheck(module.backward_op, (do, q, k, v, out, lse, *args[3:]))
        assert set(result.values()) == {"SUCCESS"}, result


def test_module_attention_compiles_fullgraph_with_its_one_autograd():
    """A bwd module's attention() under torch.compile(fullgraph=True): _Attention traced around the operators, the
    same gradients as eager (q, k, v and the sinks), no graph break."""
    torch._dynamo.reset()
    spec = fagen.KernelSpec(head_dim=16, mask="causal", gqa=2, dtype="fp32", direction="bwd", block_m=16, block_n=16,
                            window=True, softcap=True, sinks=True)
    module = fagen.load(spec)
    (q, k, v), _ = _problem(spec).inputs(spec, DEVICE)
    sinks = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(6)).to(DEVICE)

    def layer(q, k, v, sinks):
        return module.attention(q, k, v, window=(5, 0), softcap=3.0, sinks=sinks).sum(-1)

    explain = torch._dynamo.explain(layer)(q, k, v, sinks)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    compiled = torch.compile(layer, fullgraph=True, backend=BACKEND)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    compiled(*leaves).sum().backward()
    eager = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    layer(*eager).sum().backward()
    for a, b in zip(leaves, eager):
        compare("grad", a.grad, b.grad, atol=1e-5, rtol=1e-5, expected="eager")


def test_fullgraph_compile_with_score_switches_and_sink_gradient():
    torch._dynamo.reset()
    spec = fagen.KernelSpec(head_dim=16, mask="causal", gqa=2, dtype="fp32", direction="bwd")
    (q, k, v), _ = _problem(spec).inputs(spec, DEVICE)
    sinks = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(4)).to(DEVICE)

    def layer(q, k, v, sinks):
        return fagen.attention(q, k, v, mask="causal", window=(7, 0), softcap=2.0, sinks=sinks).sum(-1)

    compiled = torch.compile(layer, fullgraph=True, backend=BACKEND)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    compiled(*leaves).sum().backward()
    eager = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    layer(*eager).sum().backward()
    for a, b in zip(leaves, eager):
        compare("grad", a.grad, b.grad, atol=1e-5, rtol=1e-5, expected="eager")
