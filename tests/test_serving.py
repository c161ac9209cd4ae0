"""Serving (README "Serving"): a V head dim unlike q's (MLA), an fp8 KV cache and batch-invariant decode, each
against the float64 reference (the fp8 cache's: on the dequantized cache) or, for batch invariance, bitwise against
the same sequence run alone."""

import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fagen
from _env import DEVICE, ON_GPU, SCALE
from fagen.runtime.loader import load
from fagen.spec.axes import DECODE_BATCH_INVARIANT
from fagen.verify import layouts, reference
from fagen.verify.properties import check_backward, check_forward
from fagen.verify.strategies import Problem, decode_problems, problems
from fagen.verify.tolerances import TOLERANCE, compare

# (head_dim, head_dim_v): MLA's prefill shape and the two the README names; small ones on the CPU (one with a
# V head dim that is not a power of two, so its columns are padded and masked).
DV_PAIRS = [(192, 128), (128, 64), (64, 128)] if ON_GPU else [(32, 16), (16, 32), (40, 24)]
SMALL = {} if ON_GPU else dict(block_m=16, block_n=16)
EXAMPLES = 12 if ON_GPU else 3
ALL_SWITCHES = dict(window=True, softcap=True, alibi=True, sinks=True)


def _ids(pair):
    return f"d{pair[0]}v{pair[1]}"


# -- head_dim_v ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pair", DV_PAIRS, ids=_ids)
@pytest.mark.parametrize("mask", ["none", "causal", "padding", "causal+padding", "tree"])
def test_head_dim_v_forward_matches_the_reference(mask, pair):
    spec = fagen.KernelSpec(head_dim=pair[0], head_dim_v=pair[1], mask=mask, dtype="fp16", gqa=2, **SMALL)
    module = load(spec)

    @settings(max_examples=EXAMPLES)
    @given(problems(spec, SCALE))
    def run(problem):
        check_forward(module, spec, problem, DEVICE)

    run()


@pytest.mark.parametrize("pair", DV_PAIRS, ids=_ids)
@pytest.mark.parametrize("mask", ["none", "causal", "padding", "causal+padding", "tree"])
def test_head_dim_v_backward_matches_the_reference(mask, pair):
    spec = fagen.KernelSpec(head_dim=pair[0], head_dim_v=pair[1], mask=mask, dtype="bf16" if ON_GPU else "fp32",
                            direction="bwd", gqa=2, **SMALL)
    module = load(spec)

    @settings(max_examples=EXAMPLES)
    @given(problems(spec, "gpu-bwd" if ON_GPU else SCALE))
    def run(problem):
        check_backward(module, spec, problem, DEVICE)

    run()


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_head_dim_v_with_every_score_switch(direction):
    d, dv = DV_PAIRS[0]
    spec = fagen.KernelSpec(head_dim=d, head_dim_v=dv, mask="causal", dtype="fp32" if not ON_GPU else "bf16",
                            direction=direction, gqa=2, **SMALL, **ALL_SWITCHES)
    module, check = load(spec), check_forward if direction == "fwd" else check_backward

    @settings(max_examples=EXAMPLES)
    @given(problems(spec, SCALE if direction == "fwd" or not ON_GPU else "gpu-bwd"))
    def run(problem):
        check(module, spec, problem, DEVICE)

    run()


def _layout_search(spec, check):
    module = load(spec)

    @settings(max_examples=EXAMPLES)
    @given(layouts.cases(spec, max_len=40 if not ON_GPU else 700))
    def run(case):
        check(module, spec, case, DEVICE)

    run()


@pytest.mark.parametrize("pair", DV_PAIRS[:2], ids=_ids)
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_head_dim_v_varlen(direction, pair):
    spec = fagen.KernelSpec(head_dim=pair[0], head_dim_v=pair[1], mask="causal", layout="varlen", gqa=2,
                            dtype="fp32" if direction == "bwd" and not ON_GPU else "bf16", direction=direction,
                            **SMALL)
    _layout_search(spec, layouts.check_forward if direction == "fwd" else layouts.check_backward)


@pytest.mark.parametrize("mask", ["none", "causal", "padding", "causal+padding", "tree"])
def test_head_dim_v_dense_decode(mask):
    d, dv = DV_PAIRS[0]
    spec = fagen.KernelSpec(head_dim=d, head_dim_v=dv, mask=mask, kind="decode", dtype="bf16", gqa=4)
    module = load(spec)

    @settings(max_examples=EXAMPLES)
    @given(decode_problems(spec, SCALE))
    def run(problem):
        check_forward(module, spec, problem, DEVICE)

    run()


@pytest.mark.parametrize("kind, mask", [("decode", "none"), ("decode", "tree"), ("prefill", "causal")])
def test_head_dim_v_paged(kind, mask):
    d, dv = DV_PAIRS[0]
    spec = fagen.KernelSpec(head_dim=d, head_dim_v=dv, mask=mask, kind=kind, layout="paged", dtype="fp16", gqa=2,
                            **(SMALL if kind == "prefill" else {}))
    _layout_search(spec, layouts.check_forward)


def test_fagen_attention_takes_head_dim_v_from_v():
    """out is [..., Dv]; the differentiable path and the decode path (few queries, no gradient) alike."""
    d, dv = DV_PAIRS[0]
    gen = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    q = torch.randn(2, 4, 37, d, generator=gen).to(dtype).to(DEVICE).requires_grad_()
    k = torch.randn(2, 2, 45, d, generator=gen).to(dtype).to(DEVICE).requires_grad_()
    v = torch.randn(2, 2, 45, dv, generator=gen).to(dtype).to(DEVICE).requires_grad_()
    out = fagen.attention(q, k, v, mask="causal")
    assert out.shape == (2, 4, 37, dv)
    want, _ = reference.attention(q.detach(), k.detach(), v.detach(), mask="causal")
    compare("out", out, want, **TOLERANCE[fagen.KernelSpec(head_dim=d, dtype="bf16" if ON_GPU else "fp32").dtype])
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    with torch.no_grad():
        step = fagen.attention(q[:, :, :1], k, v)  # one query against 45 keys: the decode kernel
    assert step.shape == (2, 4, 1, dv)
    want, _ = reference.attention(q[:, :, :1].detach(), k.detach(), v.detach())
    compare("decode out", step, want, **TOLERANCE[fagen.KernelSpec(head_dim=d, dtype="bf16" if ON_GPU
                                                                   else "fp32").dtype])


def test_head_dim_v_shape_errors():
    spec = fagen.KernelSpec(head_dim=32, head_dim_v=16, dtype="fp32", **SMALL)
    module = load(spec)
    q, k = torch.randn(1, 1, 5, 32, device=DEVICE), torch.randn(1, 1, 5, 32, device=DEVICE)
    with pytest.raises(module.InputError, match="v: head_dim 32 but this kernel is built for head_dim_v 16"):
        module.forward(q, k, torch.randn(1, 1, 5, 32, device=DEVICE))
    with pytest.raises(module.InputError, match="k: head_dim 16"):
        module.forward(q, torch.randn(1, 1, 5, 16, device=DEVICE), torch.randn(1, 1, 5, 16, device=DEVICE))
    with pytest.raises(module.InputError, match="out"):
        module.forward(q, k, torch.randn(1, 1, 5, 16, device=DEVICE), out=torch.empty_like(q))


# -- fp8 KV cache --------------------------------------------------------------------------------------------------
KV_DTYPES = ["fp8_e4m3", "fp8_e5m2"]


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("mask", ["none", "causal", "padding", "causal+padding", "tree"])
def test_fp8_dense_decode_matches_the_dequantized_reference(mask, kv):
    spec = fagen.KernelSpec(head_dim=64 if not ON_GPU else 128, mask=mask, kind="decode", dtype="bf16", gqa=4,
                            kv_dtype=kv)
    module = load(spec)

    @settings(max_examples=EXAMPLES + 2)
    @given(decode_problems(spec, SCALE))
    def run(problem):
        check_forward(module, spec, problem, DEVICE)

    run()


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("mask", ["none", "causal", "tree"])
def test_fp8_paged_decode_matches_the_dequantized_reference(mask, kv):
    spec = fagen.KernelSpec(head_dim=64 if not ON_GPU else 128, mask=mask, kind="decode", layout="paged",
                            dtype="fp16", gqa=2, kv_dtype=kv)
    _layout_search(spec, layouts.check_forward)


def test_fp8_with_head_dim_v_and_switches():
    d, dv = DV_PAIRS[0]
    spec = fagen.KernelSpec(head_dim=d, head_dim_v=dv, mask="causal", kind="decode", dtype="bf16", gqa=2,
                            kv_dtype="fp8_e4m3", **ALL_SWITCHES)
    module = load(spec)

    @settings(max_examples=EXAMPLES)
    @given(decode_problems(spec, SCALE))
    def run(problem):
        check_forward(module, spec, problem, DEVICE)

    run()


def test_fp8_cache_is_read_as_fp8_not_as_bf16():
    """A cache of small fp8 values whose bytes, read two at a time as bf16, are wildly different numbers: the
    reference on that misreading is far from the true one, and the kernel must match the true one."""
    spec = fagen.KernelSpec(head_dim=64, kind="decode", dtype="bf16", gqa=2, kv_dtype="fp8_e4m3")
    problem = Problem(batch=2, heads_kv=2, seq_q=3, seq_k=77, kv_scales="head", seed=7)
    (q, k, v), kw = problem.inputs(spec, DEVICE)
    misread = [t.view(torch.uint8).view(torch.bfloat16).repeat_interleave(2, -1) for t in (k, v)]
    right, _ = reference.attention(q, k, v, **kw)
    wrong, _ = reference.attention(q, *misread, k_scale=kw["k_scale"], v_scale=kw["v_scale"])
    assert not torch.allclose(right, wrong.nan_to_num(), atol=0.3)  # the misreading is detectable at all
    out, _ = load(spec).forward(q, k, v, **kw)
    compare("out", out, right, **TOLERANCE[spec.dtype])


def test_fp8_input_errors():
    spec = fagen.KernelSpec(head_dim=32, kind="decode", dtype="fp16", kv_dtype="fp8_e4m3")
    module = load(spec)
    q = torch.randn(1, 1, 1, 32, device=DEVICE).half()
    k = torch.randn(1, 1, 9, 32, device=DEVICE).to(torch.float8_e4m3fn)
    with pytest.raises(module.InputError, match="k: dtype torch.float16 but this kernel .* torch.float8_e4m3fn"):
        module.forward(q, k.half(), k.half())
    with pytest.raises(module.InputError, match="q: dtype"):
        module.forward(q.float(), k, k)
    with pytest.raises(module.InputError,
                       match=r"k_scale: expected a positive finite float, a float32 tensor \[1\] \(per KV head\)"):
        module.forward(q, k, k, k_scale=torch.ones(3))
    with pytest.raises(module.InputError, match="v_scale"):
        module.forward(q, k, k, v_scale=-1.0)
    plain = load(dataclasses.replace(spec, kv_dtype=None))
    with pytest.raises(TypeError):
        plain.forward(q, k.half(), k.half(), k_scale=1.0)
    out, _ = module.forward(q, k, k)  # scales default to 1.0
    want, _ = reference.attention(q, k, k)
    compare("out", out, want, **TOLERANCE[spec.dtype])


# -- batch-invariant decode ----------------------------------------------------------------------------------------
# [Note] The metamorphic property: a sequence's out and lse, run alone, are the same bits as in any batch, at any
# position and batch size, through forward, plan/run and fagen.attention. On the CPU the modules' invariant chunk is
# shrunk so that a sequence of a hundred keys still spans several splits (and the merge order is exercised).
DECODE_MASKS = ["none", "causal", "padding", "causal+padding", "tree"]


def _small_chunks(module, monkeypatch):
    """On the CPU: invariant chunks of one 16-key block, and a GPU of 2 SMs, so that the default split rule does
    change with the batch size at these small sizes (as it does with 132 SMs at real ones)."""
    if not ON_GPU:
        monkeypatch.setattr(module, "INVARIANT_MIN_CHUNK", 16)
        monkeypatch.setattr(module, "sm_count", lambda index: 2)
        module._geometry.cache_clear()  # memoised per shape, not per SM count
        monkeypatch.setattr(module, "_STEPS", {})


def _equal_bits(name, got, want):
    if not torch.equal(got, want):
        diff = (got.double() - want.double()).abs().nan_to_num(0.0)
        raise AssertionError(f"{name}: not bitwise equal alone and in a batch (max |diff| {diff.max().item():.3g})")


def _dense_batch(spec, n, sq, sk, seed, lens=None):
    """n sequences of sk keys (padding masks: lengths `lens`) and sq queries, as one dense batch."""
    problem = Problem(batch=n, heads_kv=2, seq_q=sq, seq_k=sk + (sq if spec.mask == "tree" else 0), seed=seed,
                      seqlens_q=(sq,) * n if spec.mask.padded else None, seqlens_k=lens,
                      parents=tuple(tuple(-1 if i == 0 else random.Random(seed + b).randrange(i) for i in range(sq))
                                    for b in range(n)) if spec.mask == "tree" else None,
                      kv_scales="head" if spec.kv_dtype is not None else None,
                      sinks=spec.sinks, window=(40, 0) if spec.window else None)
    return problem.inputs(spec, DEVICE)


def _take(kwargs, rows, trim=None):
    """The kwargs of the batch rows `rows` (tensors with a batch dim are indexed; per-head scales are not)."""
    out = {}
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor) and name in ("seqlens_q", "seqlens_k", "tree_mask", "block_table"):
            value = value[rows].contiguous()
            if name == "block_table" and trim is not None:
                value = value[:, :trim].contiguous()
        out[name] = value
    return out


@pytest.mark.parametrize("kv, switches", [(None, {}), ("fp8_e4m3", {}), (None, dict(window=True, sinks=True))],
                         ids=["bf16", "fp8", "window+sinks"])
@pytest.mark.parametrize("mask", DECODE_MASKS)
def test_dense_decode_is_batch_invariant(mask, kv, switches, monkeypatch):
    """Sinks join the merge (or the split, with one split): invariance holds only if one sequence's sum never
    changes place; a window moves each sequence's first split."""
    if switches and mask in ("none", "padding"):
        pytest.skip("the switches' case runs with the causal masks and the tree")
    spec = fagen.KernelSpec(head_dim=32 if not ON_GPU else 128, mask=mask, kind="decode", dtype="bf16", gqa=4,
                            kv_dtype=kv, block_n=16 if not ON_GPU else None, **switches)
    module = load(spec)
    _small_chunks(module, monkeypatch)
    sk = 131 if not ON_GPU else 9000
    rng = random.Random(f"{mask}-{kv}")
    for trial in range(3 if not ON_GPU else 6):
        n, sq = rng.randint(2, 6 if not ON_GPU else 64), rng.choice([1, 3])
        lens = tuple(rng.randint(0, sk) for _ in range(n)) if spec.mask.padded else None
        (q, k, v), kw = _dense_batch(spec, n, sq, sk, seed=trial, lens=lens)
        out, lse = module.forward(q, k, v, batch_invariant=True, **kw)
        for b in rng.sample(range(n), min(n, 3)):
            own = lens[b] if lens else sk + (sq if mask == "tree" else 0)  # alone: a cache cut to its own keys
            alone_kw = _take(kw, slice(b, b + 1))
            q1, k1, v1 = (t[b:b + 1, :, :, :].clone() for t in (q, k, v))
            if lens:
                k1, v1 = k1[:, :, :max(own, 1)].clone(), v1[:, :, :max(own, 1)].clone()
            o1, l1 = module.forward(q1, k1, v1, batch_invariant=True, **alone_kw)
            _equal_bits(f"out of sequence {b} of {n}", out[b], o1[0])
            _equal_bits(f"lse of sequence {b} of {n}", lse[b], l1[0])


@pytest.mark.parametrize("kv", [None, "fp8_e5m2"])
@pytest.mark.parametrize("mask", ["none", "causal", "tree"])
def test_paged_decode_is_batch_invariant_through_forward_and_plan(mask, kv, monkeypatch):
    spec = fagen.KernelSpec(head_dim=32 if not ON_GPU else 128, mask=mask, kind="decode", layout="paged",
                            dtype="fp16", gqa=2, kv_dtype=kv, block_n=16 if not ON_GPU else None)
    module = load(spec)
    _small_chunks(module, monkeypatch)
    rng = random.Random(7)
    top = 150 if not ON_GPU else 20000
    for trial in range(3 if not ON_GPU else 6):
        n, sq = rng.randint(2, 5 if not ON_GPU else 64), rng.choice([1, 2])
        lens = [rng.randint(sq if mask == "tree" else 0, top) for _ in range(n)]
        case = layouts.LayoutCase([sq] * n, lens, heads_kv=2, page_size=rng.choice([1, 16, 64]), seed=trial,
                                  parents=[[-1] + [rng.randrange(i) for i in range(1, sq)] for _ in range(n)]
                                  if mask == "tree" else None)
        inputs = layouts.make_inputs(spec, case, DEVICE)
        q, k_cache, v_cache = inputs.args
        kw = dict(inputs.kwargs, **inputs.scores)
        out, lse = module.forward(q, k_cache, v_cache, batch_invariant=True, **kw)
        plan = module.plan(n + 3, q.shape[1], sq, kw["block_table"].shape[1] * case.page_size, device=DEVICE,
                           batch_invariant=True)
        p_out, p_lse = plan.run(q, k_cache, v_cache, **kw)
        _equal_bits("plan.run against forward", p_out, out)
        _equal_bits("plan.run lse against forward", p_lse, lse)
        for b in range(n):
            pages = -(-lens[b] // case.page_size)
            alone = _take(kw, slice(b, b + 1), trim=max(pages, 1))
            o1, l1 = module.forward(q[b:b + 1].clone(), k_cache, v_cache, batch_invariant=True, **alone)
            _equal_bits(f"out of sequence {b} of {n}", out[b], o1[0])
            _equal_bits(f"lse of sequence {b} of {n}", lse[b], l1[0])


def test_fagen_attention_takes_batch_invariant(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(5, 8, 1, 64, generator=gen).to(DEVICE)
    k, v = (torch.randn(5, 2, 300, 64, generator=gen).to(DEVICE) for _ in range(2))
    with torch.no_grad():
        batch = fagen.attention(q, k, v, batch_invariant=True)
        for b in range(5):
            alone = fagen.attention(q[b:b + 1].clone(), k[b:b + 1].clone(), v[b:b + 1].clone(),
                                    batch_invariant=True)
            _equal_bits(f"fagen.attention sequence {b}", batch[b], alone[0])


def _modes_module(monkeypatch):
    """A decode module of the tiles fagen.attention takes, its chunks small, and one batch where the two rules give
    different bits (so a mode that is lost on the way shows)."""
    spec = fagen.KernelSpec(head_dim=32, kind="decode", dtype="fp32", gqa=4)
    module = load(spec)
    _small_chunks(module, monkeypatch)
    (q, k, v), kw = _dense_batch(spec, 1, 1, 300 if not ON_GPU else 9000, seed=1)
    assert not kw  # mask "none": the launch below takes no mask inputs
    want = {False: module.forward_split(q, k, v),  # the split rule's own count
            True: module._launch_decode(q, k, v, SCALE_32, None, None, None, module.INVARIANT)}
    assert not torch.equal(want[True][0], want[False][0])
    return module, (q, k, v), want


SCALE_32 = 32 ** -0.5  # the default scale of head_dim 32


def _same(name, got, want):
    """got's (out, lse) are the bits of the mode's own call (lse None: not returned)."""
    for what, g, w in (("out", got[0], want[0]), ("lse", got[1], want[1])):
        if g is not None and not torch.equal(g, w):
            raise AssertionError(f"{name}: {what} is not the bits of the mode asked for (max |diff| "
                                 f"{(g.double() - w.double()).abs().nan_to_num(0.0).max().item():.3g})")


@pytest.mark.parametrize("mode", [True, False])
def test_both_modes_on_every_entry_point(mode, monkeypatch):
    """batch_invariant=True takes the invariant rule and False the split rule (forward_split's count), through
    forward, plan/run and fagen.attention, whatever the default; the defaults follow BATCH_INVARIANT (fagen.spec.axes.
    DECODE_BATCH_INVARIANT) and plan(num_splits=n) opts out; the operators carry the mode (num_splits)."""
    module, (q, k, v), want = _modes_module(monkeypatch)
    h, sk = q.shape[1], k.shape[2]
    _same("forward", module.forward(q, k, v, batch_invariant=mode), want[mode])
    _same("plan.run", module.plan(1, h, 1, sk, device=DEVICE, batch_invariant=mode).run(q, k, v), want[mode])
    with torch.no_grad():
        _same("fagen.attention", (fagen.attention(q, k, v, batch_invariant=mode), None), want[mode])
    _same("forward_op", module.forward_op(q, k, v, SCALE_32, None, None, None,
                                          module.INVARIANT if mode else None), want[mode])
    out, lse = torch.empty_like(q), q.new_empty(q.shape[:3])
    module.forward_out_op(q, k, v, SCALE_32, None, None, None, out, lse, module.INVARIANT if mode else None)
    _same("forward_out_op", (out, lse), want[mode])
    result = torch.library.opcheck(module.forward_op, (q, k, v, SCALE_32, None, None, None,
                                                       module.INVARIANT if mode else None))
    assert set(result.values()) == {"SUCCESS"}, result
    default = module.BATCH_INVARIANT
    assert default is DECODE_BATCH_INVARIANT
    _same("forward's default", module.forward(q, k, v), want[default])
    _same("plan's default", module.plan(1, h, 1, sk, device=DEVICE).run(q, k, v), want[default])
    with torch.no_grad():
        _same("fagen.attention's default", (fagen.attention(q, k, v), None), want[default])
    assert module.plan(1, h, 1, sk, device=DEVICE, num_splits=2).num_splits == 2
    with pytest.raises(module.InputError, match="batch_invariant: expected True or False"):
        module.forward(q, k, v, batch_invariant=1)
    with pytest.raises(module.InputError, match="batch_invariant=True chooses the splits"):
        module.plan(1, h, 1, sk, device=DEVICE, num_splits=2, batch_invariant=True)


@pytest.mark.parametrize("mode", [True, False])
def test_both_modes_compile_fullgraph(mode, monkeypatch):
    """Under torch.compile(fullgraph=True) forward, plan/run and fagen.attention keep the mode asked for: one graph,
    the module's operator with num_splits INVARIANT (True) or None (False; a plan: its count), and the eager bits."""
    torch._dynamo.reset()
    module, (q, k, v), want = _modes_module(monkeypatch)
    plan = module.plan(1, q.shape[1], 1, k.shape[2], device=DEVICE, batch_invariant=mode)
    calls = {"forward": lambda q, k, v: module.forward(q, k, v, batch_invariant=mode),
             "plan.run": lambda q, k, v: plan.run(q, k, v),
             "fagen.attention": lambda q, k, v: (fagen.attention(q, k, v, batch_invariant=mode), None)}
    for name, call in calls.items():
        nodes = []

        def backend(gm, example_inputs):
            nodes.extend(n for n in gm.graph.nodes if n.op == "call_function" and "fagen" in str(n.target))
            return gm.forward

        with torch.no_grad():
            got = torch.compile(call, fullgraph=True, backend=backend)(q, k, v)
        _same(f"compiled {name}", got, want[mode])
        assert [str(n.target) for n in nodes] == [f"fagen.{module.forward_op._qualname.split('::')[1]}.default"], nodes
        carried = nodes[0].args[-1] if len(nodes[0].args) == 8 else nodes[0].kwargs.get("num_splits")
        # a plan carries its own choice: INVARIANT, or the split rule's count for its largest problem
        expected = plan.num_splits if name == "plan.run" else module.INVARIANT if mode else None
        assert carried == expected, (name, nodes[0].args, nodes[0].kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("mode", [True, False])
def test_both_modes_replay_in_a_cuda_graph(mode):
    """A plan's run and forward(batch_invariant=mode), captured in a CUDA graph, replay the eager bits of that mode."""
    spec = fagen.KernelSpec(head_dim=128, kind="decode", dtype="bf16", gqa=4, mask="padding")
    module = load(spec)
    lens = tuple(random.Random(3).randint(1, 9000) for _ in range(8))
    (q, k, v), kw = _dense_batch(spec, 8, 1, 9000, seed=4, lens=lens)
    plan = module.plan(8, q.shape[1], 1, k.shape[2], device=DEVICE, batch_invariant=mode)
    for name, call in (("plan.run", lambda: plan.run(q, k, v, **kw)),
                       ("forward", lambda: module.forward(q, k, v, batch_invariant=mode, **kw))):
        eager = module.forward(q, k, v, batch_invariant=mode, **kw)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            call()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = call()
        static[0].zero_()
        graph.replay()
        torch.cuda.synchronize()
        _same(f"graphed {name}", static, eager)
