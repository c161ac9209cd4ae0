"""Where the Gluon backward serves ([Note] Gluon backward rule in fagen/backends/gluon.py, [Note] Hopper selection in
fagen/runtime/hopper.py), the deterministic keyword, the bench's rows and the dQ mutant. The device is faked
(as_if_hopper, test_hopper_selection.py), so these run on any machine; the kernels run in test_gluon_bwd_gpu.py."""

import pytest
import torch

import fagen
from fagen import backends
from fagen.bench.impls import case_impls
from fagen.bench.workloads import BenchCase
from fagen.codegen.render import generate
from fagen.runtime import hopper, resolve
from fagen.runtime.resolve import AttentionError
from fagen.spec.kernel import KernelSpec
from fagen.verify.mutants import GLUON_MUTANTS, MUTANTS
from _env import DEVICE, ON_GPU
from test_hopper_selection import as_if_hopper  # noqa: F401 (a fixture)


def case(**fields) -> KernelSpec:
    return KernelSpec(**{"head_dim": 128, "dtype": "bf16", "direction": "bwd", **fields})


@pytest.mark.parametrize("fields,picked", [
    (dict(mask="causal"), True), (dict(mask="none"), True), (dict(mask="causal", gqa=4), True),
    (dict(mask="none", gqa=8), True),
    (dict(mask="causal", head_dim=64), True),  # the fixed-point render: 407 vs Triton's 379 TF/s (test_gluon_bwd_gqa64)
    (dict(mask="causal", dtype="fp16"), False),  # not measured
    (dict(mask="padding"), False), (dict(mask="causal", softcap=True), False),
    (dict(mask="causal", window=True), True),  # the fixed-point render, 0.533 vs Triton's 0.614 ms (docs/mods.md,
    (dict(mask="none", window=True), False),  # "The window's backward (eleventh session)"); mask none: not measured
])
def test_the_backward_rule_picks_measured_wins_only(as_if_hopper, fields, picked):  # noqa: F811
    spec = case(**fields)
    assert backends.GLUON.bwd_selected(spec) == picked
    got = hopper.backward_spec(spec, torch.device("cuda"))
    assert got == (KernelSpec(backend="gluon", direction="bwd", head_dim=spec.head_dim, dtype="bf16", mask=spec.mask,
                              gqa=spec.gqa, window=spec.window) if picked else None)


def test_unordered_adds_only_where_they_won():
    """GQA causal: the unordered adds lost (292 vs 368 TF/s deterministic, H100): deterministic=False keeps the
    deterministic mode there."""
    rule = backends.GLUON.unordered_selected
    assert rule("causal", 1) and rule("none", 1) and rule("none", 8)
    assert rule("causal", 4) == bool(backends.GLUON.variant["bwd_gqa"].get("bwd_sections"))  # test_gluon_bwd_gqa64


def test_no_backward_selection_off_hopper_or_when_turned_off(as_if_hopper, monkeypatch):  # noqa: F811
    monkeypatch.setenv(hopper.ENV, "0")
    assert hopper.backward_spec(case(mask="causal"), torch.device("cuda")) is None
    monkeypatch.undo()
    assert hopper.backward_spec(case(mask="causal"), torch.device("cpu")) is None


def test_fagen_attention_routes_big_gradient_calls_to_the_gluon_backward(as_if_hopper):  # noqa: F811
    q = torch.zeros(1, 4, 8, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 8, 128, dtype=torch.bfloat16)
    big = resolve.resolve(q, k, k, "causal", False, big_bwd=True)
    assert big.NAME == "attn_bwd_causal_d128_m128n128w8s2_g4_bf16_gluon" and hasattr(big, "attention")
    assert hopper.unordered(big)  # GQA causal: L2 sections (variant bwd_gqa, test_gluon_bwd_gqa64)
    full = resolve.resolve(k, k, k, "none", False, big_bwd=True)
    assert full.NAME.endswith("_gluon") and hopper.unordered(full)
    small = resolve.resolve(q, k, k, "causal", False)
    assert not small.NAME.endswith("_gluon") and not hopper.unordered(small)
    assert hopper.BWD_MIN_WORK >= hopper.MIN_WORK  # the floor ([Note] Gluon backward size rule)
    if not torch.cuda.is_available():
        big_q = torch.zeros(1, 32, 4096, 128, dtype=torch.bfloat16, requires_grad=True)
        big_k = torch.zeros(1, 8, 4096, 128, dtype=torch.bfloat16, requires_grad=True)
        assert 32 * 4096 * 4096 >= hopper.BWD_MIN_WORK
        with pytest.raises(ValueError, match="Gluon kernel"):  # the gluon module's InputError: it was called
            fagen.attention(big_q, big_k, big_k, mask="causal")


@pytest.mark.parametrize("bad", ["yes", 1, 0, None, torch.tensor(True)])
def test_deterministic_must_be_a_bool(bad):
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(AttentionError, match="deterministic: expected True or False") as e:
        fagen.attention(q, q, q, deterministic=bad)
    assert "\n" not in str(e.value)


def test_deterministic_false_elsewhere_is_the_deterministic_kernel():
    """Off Hopper (here: the CPU interpreter) every backward is the Triton one, deterministic: the keyword changes
    nothing."""
    q, k, v = (torch.randn(1, 2, 37, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    do = torch.randn(1, 2, 37, 16, device=DEVICE)
    one = torch.autograd.grad(fagen.attention(q, k, v, mask="causal", deterministic=False), (q, k, v), do)
    two = torch.autograd.grad(fagen.attention(q, k, v, mask="causal"), (q, k, v), do)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_the_bench_times_the_gluon_backward_and_its_unordered_mode(as_if_hopper):  # noqa: F811
    bwd = BenchCase("bwd-d128-causal", 128, "causal", 1, 16, 16, 1024, 1024, direction="bwd")
    spec, note = bwd.spec("cuda")
    assert spec.backend.value == "gluon" and spec.direction.value == "bwd" and hopper.ENV in note
    assert bwd.spec("cuda", hopper=False)[0].backend.value == "triton"
    impls = ("fagen", "fagen-nondet", "sdpa-cudnn")
    assert case_impls(bwd, impls) == impls
    fwd = BenchCase("fwd-d128-causal", 128, "causal", 1, 16, 16, 1024, 1024)
    assert case_impls(fwd, impls) == ("fagen", "sdpa-cudnn")


def test_the_dq_mutants_edit_the_gluon_backward_only(monkeypatch):
    """gluon-bwd-dq-one-half edits every render; gluon-bwd-fixed-no-scale the renders with the fixed-point dQ
    (variant bwd_fixed 1; with 2 not GQA causal; MHA causal with bwd_prefix 2, [Note] Prefix rows in the backward)."""
    from fagen.codegen import render
    gluon_bwd = KernelSpec(backend="gluon", direction="bwd", head_dim=128, dtype="bf16", mask="causal")
    monkeypatch.setitem(backends.GLUON.variant, "bwd_gqa", {})  # GQA causal's own keys: test_gluon_bwd_gqa64
    monkeypatch.setitem(backends.GLUON.variant, "bwd_d128", {})  # MHA d128's own keys: test_gluon_bwd_compile
    for fixed in (0, 1, 2):
        monkeypatch.setitem(backends.GLUON.variant, "bwd_fixed", fixed)
        render.render.cache_clear()
        for mutant in GLUON_MUTANTS:
            assert mutant not in MUTANTS  # the CPU search (test_backward.py) cannot run a Gluon kernel
            if mutant.name in ("gluon-bwd-fixed-fma-no-scale", "gluon-bwd-fixed-fma-limb",
                               "gluon-bwd-fixed-tma-rows"):  # bwd_fixed_fma / bwd_fixed_tma renders:
                continue  # test_gluon_bwd_order.py, test_gluon_bwd_fixed_round.py
            every = mutant.name != "gluon-bwd-fixed-no-scale"
            prefix2 = backends.GLUON.variant["bwd_prefix"] == 2  # MHA causal renders carry mode 2 for the prefix
            assert mutant.applies(gluon_bwd) and (mutant.old in generate(gluon_bwd)) == (every or fixed > 0 or prefix2)
            gqa4 = KernelSpec(backend="gluon", direction="bwd", head_dim=128, dtype="bf16", mask="causal", gqa=4)
            assert (mutant.old in generate(gqa4)) == (every or fixed == 1)
            assert mutant.old not in generate(case(mask="causal")) and mutant.old not in generate(
                KernelSpec(backend="gluon", head_dim=128, dtype="bf16", mask="causal"))
    render.render.cache_clear()


def test_deterministic_traces_under_torch_compile_fullgraph():
    """The keyword is checked and carried under torch.compile(fullgraph=True) as in eager mode: one graph, the same
    gradients (the traced call takes the bwd module resolve finds while tracing)."""
    q, k, v = (torch.randn(1, 2, 21, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    do = torch.randn(1, 2, 21, 16, device=DEVICE)

    def layer(q, k, v):
        return fagen.attention(q, k, v, mask="causal", deterministic=False)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v), do)
    want = torch.autograd.grad(layer(q, k, v), (q, k, v), do)
    assert all(torch.allclose(a, b) for a, b in zip(got, want))
    with pytest.raises(Exception, match="deterministic: expected True or False"):
        torch.compile(lambda q: fagen.attention(q, q, q, deterministic="no"), fullgraph=True, backend="eager")(q)


def test_the_transformers_backend_passes_deterministic_on():
    from fagen.integrations.transformers import attention_forward
    layer = torch.nn.Module()
    q = torch.randn(1, 2, 9, 16, device=DEVICE)
    out, _ = attention_forward(layer, q, q, q, None, is_causal=True, deterministic=False)
    assert torch.equal(out, attention_forward(layer, q, q, q, None, is_causal=True)[0])
    with pytest.raises(AttentionError, match="deterministic"):
        attention_forward(layer, q, q, q, None, deterministic="off")


def _reference_launches(mod, monkeypatch, calls):
    """Stand-ins for the gluon bwd module's launches (float64 math on CPU tensors, counted in `calls`), so that its
    torch.compile path runs here: forward_op and backward_op call them as they call the kernels."""
    def probs(q, k, scale):
        s = (q.double() @ k.double().transpose(-1, -2)) * scale  # MHA (gqa 1) only
        if mod.CAUSAL:
            s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(s.shape[-1] - s.shape[-2] + 1), -torch.inf)
        return s.softmax(-1), s.logsumexp(-1)

    def forward(q, k, v, scale, *rest, out=None, lse=None):
        calls.append("fwd")
        p, lse_ = probs(q, k, scale)
        return (p @ v.double()).to(q.dtype), lse_.float()

    def backward(do, q, k, v, out, lse, scale, *rest, deterministic=True, **kw):
        calls.append("bwd" if deterministic else "bwd-unordered")
        p, _ = probs(q, k, scale)
        do, q, k, v = (t.double() for t in (do, q, k, v))
        dp = do @ v.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        return tuple(g.to(q.dtype) for g in (scale * ds @ k, scale * ds.transpose(-1, -2) @ q,
                                              p.transpose(-1, -2) @ do))

    monkeypatch.setattr(mod, "_launch", forward)
    monkeypatch.setattr(mod, "_launch_forward", forward)
    monkeypatch.setattr(mod, "_launch_backward", backward)
    monkeypatch.setattr(mod, "_check_device", lambda q: None)


@pytest.mark.skipif(ON_GPU, reason="CPU tensors with sm_90 faked: its Triton path needs the interpreter")
@pytest.mark.parametrize("deterministic", [True, False])
def test_torch_compile_fullgraph_takes_the_gluon_backward(as_if_hopper, monkeypatch, deterministic):  # noqa: F811
    """[Note] Gluon backward under torch.compile: fagen.attention with gradients, traced with fullgraph=True, runs
    the gluon bwd module's operators where an eager call would (the size rule as a guard), in the mode asked for
    where it won (none: unordered; GQA causal: deterministic)."""
    from fagen.runtime import ops
    torch._dynamo.reset()
    monkeypatch.setattr(hopper, "BWD_MIN_WORK", 300)
    monkeypatch.setattr(ops, "_MODULES", {})
    mod = fagen.load(KernelSpec(backend="gluon", direction="bwd", head_dim=128, dtype="bf16", mask="none"))
    calls = []
    _reference_launches(mod, monkeypatch, calls)
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 13, 128, dtype=torch.bfloat16) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def layer(q, k, v):
        return fagen.attention(q, k, v, deterministic=deterministic)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append({str(n.target) for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
                       for n in m.graph.nodes if n.op == "call_function" and "fagen" in str(n.target)})
        return gm.forward

    got = torch.autograd.grad(torch.compile(layer, fullgraph=True, backend=backend)(q, k, v), (q, k, v), do)
    name = mod.forward_op._qualname.split("::")[1][:-len("_fwd")]
    assert graphs == [{f"fagen.{name}_fwd.default", f"fagen.{name}_bwd{'' if deterministic else '_unordered'}.default"}]
    assert calls == ["fwd", "bwd" if deterministic else "bwd-unordered"]
    want = torch.autograd.grad(layer(q, k, v), (q, k, v), do)  # eager: the same module, the same stand-ins
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and calls[2:] == calls[:2]
    calls.clear()
    small = [t.detach()[:, :, :8].clone().requires_grad_() for t in (q, k, v)]  # 2 x 8 x 8 < 300 pairs: Triton
    torch.autograd.grad(torch.compile(layer, fullgraph=True, backend="aot_eager")(*small), small,
                        do[:, :, :8])
    assert calls == []
