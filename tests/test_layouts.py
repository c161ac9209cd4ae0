"""The varlen and paged layouts (README "Layouts"): forward, backward and decode against the float64 reference on
each sequence's gathered dense equivalent, the layouts' input errors, and the mutants the suite must catch."""

import pytest
import torch
from hypothesis import Phase, given, settings

import fagen
from _env import DEVICE, ON_GPU
from fagen.runtime.loader import load
from fagen.verify import layouts
from fagen.verify.engine import mutant_module
from fagen.verify.mutants import LAYOUT_MUTANTS
from fagen.verify.tolerances import PropertyFailure

SMALL = dict(block_m=16, block_n=16, num_warps=1, num_stages=1) if not ON_GPU else {}
MAX_LEN = 40 if not ON_GPU else 700


def _spec(layout, mask, kind="prefill", direction="fwd", dtype="fp16", gqa=2, **switches):
    small = SMALL if kind == "prefill" or not ON_GPU else {}
    return fagen.KernelSpec(head_dim=32 if not ON_GPU else 128, mask=mask, gqa=gqa, dtype=dtype, kind=kind,
                            direction=direction, layout=layout, **small, **switches)


LAYOUT_SPECS = [("varlen", "prefill"), ("paged", "prefill"), ("paged", "decode")]


def _search(spec, check, cpu, gpu):
    """Hypothesis over the layout's cases: `check` (forward or backward) against the gathered reference."""
    module = load(spec)

    @settings(max_examples=cpu if not ON_GPU else gpu)
    @given(layouts.cases(spec, max_len=MAX_LEN))
    def run(case):
        check(module, spec, case, DEVICE)

    run()


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("layout,kind", LAYOUT_SPECS)
def test_forward_matches_the_gathered_reference(layout, kind, mask, dtype):
    _search(_spec(layout, mask, kind, dtype=dtype), layouts.check_forward, cpu=6, gpu=25)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_tree_decode_on_a_paged_cache(dtype):
    """Speculative verification: each sequence's draft tree is its last Sq cached keys."""
    _search(_spec("paged", "tree", "decode", dtype=dtype), layouts.check_forward, cpu=6, gpu=25)


@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_varlen_backward_matches_the_reference(mask, dtype):
    _search(_spec("varlen", mask, direction="bwd", dtype=dtype), layouts.check_backward, cpu=4, gpu=10)


SWITCH_SETS = [dict(window=True), dict(softcap=True, alibi=True), dict(window=True, sinks=True)]


@pytest.mark.parametrize("switches", SWITCH_SETS, ids=lambda s: "+".join(s))
@pytest.mark.parametrize("layout,kind", LAYOUT_SPECS)
def test_score_switches_compose_with_the_layouts(layout, kind, switches):
    _search(_spec(layout, "causal", kind, dtype="fp16", **switches), layouts.check_forward, cpu=4, gpu=15)


@pytest.mark.parametrize("switches", [dict(window=True, sinks=True), dict(softcap=True, alibi=True)],
                         ids=lambda s: "+".join(s))
def test_score_switches_in_the_varlen_backward(switches):
    # fp32 on the CPU; bf16 at GPU scale (an fp32 d128 backward with switches compiles for minutes)
    spec = _spec("varlen", "causal", direction="bwd", dtype="bf16" if ON_GPU else "fp32", **switches)
    _search(spec, layouts.check_backward, cpu=3, gpu=8)


def test_one_packed_sequence_equals_the_dense_kernel_bitwise():
    """A packed batch of one sequence gives the dense kernel's result (same tiles): the layouts share kernels."""
    dense = load(_spec("dense", "causal"))
    varlen = load(_spec("varlen", "causal"))
    torch.manual_seed(0)
    q, k, v = (torch.randn(37, h, 32 if not ON_GPU else 128, dtype=torch.float16, device=DEVICE) for h in (4, 2, 2))
    cu = torch.tensor([0, 37], dtype=torch.int32, device=DEVICE)
    out, lse = varlen.forward(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=37, max_seqlen_k=37)
    want, want_lse = dense.forward(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
    assert torch.equal(out, want[0].transpose(0, 1))
    assert torch.equal(lse, want_lse[0])


def test_fagen_attention_takes_the_varlen_form():
    torch.manual_seed(1)
    d = 32 if not ON_GPU else 128
    lens = [3, 0, 21]
    cu = torch.tensor([0, 3, 3, 24], dtype=torch.int32, device=DEVICE)
    q = torch.randn(24, 4, d, dtype=torch.float16, device=DEVICE, requires_grad=True)
    k = torch.randn(24, 2, d, dtype=torch.float16, device=DEVICE, requires_grad=True)
    v = torch.randn(24, 2, d, dtype=torch.float16, device=DEVICE, requires_grad=True)
    out = fagen.attention(q, k, v, mask="causal", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=21, max_seqlen_k=21)
    out.float().sum().backward()
    for b, n in enumerate(lens):
        s = slice(int(cu[b]), int(cu[b + 1]))
        want, _ = layouts.reference_sequence(fagen.KernelSpec(head_dim=d, mask="causal", gqa=2), q[s].detach().cpu(),
                                             k[s].detach().cpu(), v[s].detach().cpu())
        if n:
            assert (out[s].detach().cpu().double() - want).abs().max() < 2e-3
    assert q.grad is not None and torch.isfinite(q.grad).all() and k.grad.abs().sum() > 0


# -- errors ----------------------------------------------------------------------------------------------------
def _varlen_inputs(d=32):
    q = torch.randn(10, 4, d, dtype=torch.float16, device=DEVICE)
    k = torch.randn(12, 2, d, dtype=torch.float16, device=DEVICE)
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEVICE)
    return q, k, k.clone(), dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=6, max_seqlen_k=7)


@pytest.mark.parametrize("change,message", [
    (dict(cu_seqlens_q=[0, 6, 4, 10]), "non-decreasing"),
    (dict(cu_seqlens_q=[1, 4, 10]), "must start at 0"),
    (dict(cu_seqlens_k=[0, 5, 11]), "must equal the packed rows (12)"),
    (dict(max_seqlen_q=3), "more than max_seqlen"),
])
def test_bad_cu_seqlens_are_input_errors_with_check(change, message):
    spec = _spec("varlen", "causal")
    module = load(spec)
    q, k, v, kw = _varlen_inputs(spec.head_dim)
    for name, value in change.items():
        if isinstance(value, list):
            value = torch.tensor(value, dtype=torch.int32, device=DEVICE)
        if name == "cu_seqlens_q" and value.shape[0] != kw["cu_seqlens_k"].shape[0]:
            kw["cu_seqlens_k"] = torch.tensor([0, 2, 5, 12], dtype=torch.int32, device=DEVICE)
        kw[name] = value
    with pytest.raises(module.InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        module.forward(q, k, v, check=True, **kw)


def test_layout_dtype_and_shape_errors_need_no_check():
    spec = _spec("varlen", "none")
    module = load(spec)
    q, k, v, kw = _varlen_inputs(spec.head_dim)
    with pytest.raises(module.InputError, match="cu_seqlens_q: expected dtype torch.int32 or torch.int64"):
        module.forward(q, k, v, **{**kw, "cu_seqlens_q": kw["cu_seqlens_q"].float()})
    with pytest.raises(module.InputError, match="q: expected 3 dims"):
        module.forward(q[None], k, v, **kw)
    with pytest.raises(module.InputError, match="max_seqlen_k: expected a host int"):
        module.forward(q, k, v, **{**kw, "max_seqlen_k": torch.tensor(7)})
    with pytest.raises(module.InputError, match="dtype torch.float32 but this kernel"):
        module.forward(q.float(), k, v, **kw)


def _paged_inputs(spec, page=4):
    d = spec.head_dim
    q = torch.randn(2, 4, 2, d, dtype=torch.float16, device=DEVICE)
    kc = torch.randn(6, page, 2, d, dtype=torch.float16, device=DEVICE)
    table = torch.tensor([[0, 1, 2], [3, 4, -1]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([9, 7], dtype=torch.int32, device=DEVICE)
    return q, kc, kc.clone(), dict(block_table=table, seqlens_k=lens)


def test_paged_errors():
    spec = _spec("paged", "causal", kind="decode")
    module = load(spec)
    q, kc, vc, kw = _paged_inputs(spec)
    module.forward(q, kc, vc, check=True, **kw)  # the valid inputs pass
    bad_table = kw["block_table"].clone()
    bad_table[1, 0] = 6
    with pytest.raises(module.InputError, match="page 6 lies outside the cache's 6 pages"):
        module.forward(q, kc, vc, check=True, **{**kw, "block_table": bad_table})
    with pytest.raises(module.InputError, match=r"lengths must lie in \[0, 12\]"):
        module.forward(q, kc, vc, check=True, **{**kw, "seqlens_k": torch.tensor([13, 1], dtype=torch.int32,
                                                                                  device=DEVICE)})
    with pytest.raises(module.InputError, match="power of two"):
        module.forward(q, kc[:, :3], vc[:, :3], **kw)
    with pytest.raises(module.InputError, match="block_table: expected dtype torch.int32 or torch.int64"):
        module.forward(q, kc, vc, **{**kw, "block_table": kw["block_table"].to(torch.int16)})


def test_layout_spec_errors():
    with pytest.raises(fagen.SpecError, match="padding is implied: use mask causal"):
        fagen.KernelSpec(head_dim=64, mask="causal+padding", layout="varlen")
    with pytest.raises(fagen.SpecError, match="forward-only"):
        fagen.KernelSpec(head_dim=64, layout="paged", direction="bwd")
    with pytest.raises(fagen.SpecError, match="decode steps read a paged or dense cache"):
        fagen.KernelSpec(head_dim=64, layout="varlen", kind="decode")
    with pytest.raises(fagen.SpecError, match="layout: got 'thd'"):
        fagen.KernelSpec(head_dim=64, layout="thd")
    assert fagen.KernelSpec(head_dim=64, layout="dense").to_json() == fagen.KernelSpec(head_dim=64).to_json()


# -- mutants ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mutant", LAYOUT_MUTANTS, ids=lambda m: m.name)
def test_layout_mutant_is_caught(mutant):
    layout = str(mutant.layouts[0])
    kind = str(mutant.kinds[0])
    direction = str(mutant.directions[0]) if len(mutant.directions) == 1 else "fwd"
    spec = _spec(layout, str(mutant.masks[0]), kind, direction=direction, dtype="fp32" if direction == "bwd" else "fp16")
    broken = mutant_module(spec, mutant.name)
    check = layouts.check_backward if direction == "bwd" else layouts.check_forward

    @settings(max_examples=30, database=None, report_multiple_bugs=False, phases=[Phase.generate])  # caught: no shrinking
    @given(layouts.cases(spec, max_len=MAX_LEN))
    def run(case):
        check(broken, spec, case, DEVICE)

    with pytest.raises(PropertyFailure):
        run()


def test_the_layouts_bench_suite_runs_and_checks_its_rows(tmp_path):
    """`fagen bench --suite layouts --quick`: both row kinds, checked against fagen's dense kernels, into JSON."""
    import json

    from click.testing import CliRunner

    from fagen.cli import main

    out = tmp_path / "layouts.json"
    res = CliRunner().invoke(main, ["bench", "--suite", "layouts", "--quick", "--device", DEVICE, "--json", str(out)])
    assert res.exit_code == 0, res.output
    records = json.loads(out.read_text())["records"]
    assert [r["kind"] for r in records] == ["paged-decode", "varlen-prefill"]
    assert records[0]["max_err_vs_dense"] < 1e-2 and records[0]["paged/dense"] > 0
    assert records[1]["fagen varlen"]["TF/s"] > 0


def test_fagen_verify_searches_layout_specs(tmp_path):
    """`fagen verify` routes varlen and paged specs to the gathered-reference search, and it fails on a mutant."""
    import json

    from click.testing import CliRunner

    from fagen.cli import main
    from fagen.verify.layouts import verify_layout_spec

    report = tmp_path / "verify.json"
    res = CliRunner().invoke(main, ["verify", "--head-dim", "32", "--mask", "causal", "--gqa", "2", "--dtype", "fp16",
                                    "--layout", "paged", "--kind", "decode", "--block-n", "16", "--examples", "4",
                                    "--device", DEVICE, "--json", str(report), "-q"])
    assert res.exit_code == 0, res.output
    assert "decode_fwd_causal_d32" not in res.output and "all 1 checks passed" in res.output  # -q: no table
    assert json.loads(report.read_text())["layouts"][0]["passed"] is True
    spec = _spec("paged", "causal", "decode")
    broken = verify_layout_spec(spec, examples=30, seed=0, device=DEVICE, scale="cpu", mutant="paged-page-boundary")
    assert not broken[0].passed and "sequence" in broken[0].failure


# -- runtime: operators, torch.compile, CUDA graphs (the runtime issue's contract holds for the layouts) ----------
def _runtime_case(layout, kind, direction="fwd"):
    spec = _spec(layout, "causal", kind, direction=direction, dtype="fp32")
    case = layouts.LayoutCase([3, 0, 9] if kind == "prefill" else [2, 2, 2], [5, 4, 9], heads_kv=2, page_size=4,
                              seed=3)
    return spec, fagen.load(spec), layouts.make_inputs(spec, case, DEVICE)


@pytest.mark.parametrize("layout,kind", LAYOUT_SPECS)
def test_layout_operators_pass_opcheck(layout, kind):
    from torch.library import opcheck

    spec, module, inputs = _runtime_case(layout, kind, "bwd" if layout == "varlen" else "fwd")
    q, k, v = inputs.args
    slots = module._check_layout(q, k, v, **inputs.kwargs)
    args = (q, k, v, spec.head_dim ** -0.5, *slots)  # no grad: the operators carry none ([Note] One autograd)
    result = opcheck(module.forward_op, args)
    assert set(result.values()) == {"SUCCESS"}, result
    if layout == "varlen":
        out, lse = module.forward_op(*args)
        result = opcheck(module.backward_op, (torch.randn_like(q), q, k, v, out, lse, *args[3:]))
        assert set(result.values()) == {"SUCCESS"}, result


def test_varlen_compiles_fullgraph_forward_and_backward():
    torch._dynamo.reset()
    spec, module, inputs = _runtime_case("varlen", "prefill", "bwd")

    def layer(q, k, v):
        return module.attention(q, k, v, **inputs.kwargs).sum(-1)

    explain = torch._dynamo.explain(layer)(*inputs.args)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    compiled = torch.compile(layer, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    leaves = [t.clone().requires_grad_() for t in inputs.args]
    compiled(*leaves).sum().backward()
    eager = [t.clone().requires_grad_() for t in inputs.args]
    layer(*eager).sum().backward()
    for a, b in zip(leaves, eager):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("layout,kind", LAYOUT_SPECS)
def test_layouts_capture_and_replay_equal_to_eager(layout, kind):
    spec, module, inputs = _runtime_case(layout, kind)
    want, want_lse = module.forward(*inputs.args, **inputs.kwargs)
    out, lse = torch.empty_like(want), torch.empty_like(want_lse)
    module.forward(*inputs.args, **inputs.kwargs, out=out, lse=lse)  # warm: compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        module.forward(*inputs.args, **inputs.kwargs, out=out, lse=lse)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
