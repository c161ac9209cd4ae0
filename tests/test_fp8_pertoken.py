"""Per-token fp8 scales for the KV cache (README "fp8 KV cache", [Note] Per-token scales in the decode template):
k_scale / v_scale as float32 tensors shaped like the cache without its last dim, MLA's latent cache (one scale a
row, for K and V) and a cache with its own v, dense and paged, against the float64 reference on the cache
dequantized token by token."""

import math
import re

import pytest
import torch

import fagen
from _env import DEVICE
from fagen.verify import reference
from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
D, DV = 40, 24  # MLA's 576 / 512 scaled down: a latent that is not a power of two, a 16-column rope part
LENS = (50, 23)  # not multiples of the key block (16) or of the pages (but 1)


def _mla(kv, layout="dense", mask="causal", gqa=4):
    return fagen.load(fagen.KernelSpec(head_dim=D, head_dim_v=DV, shared_kv=True, kind="decode", gqa=gqa,
                                       dtype="bf16", mask=mask, layout=layout, kv_dtype=kv, block_n=16))


def _scales(gen, *shape):
    """log-uniform in [1/8, 8]: never all ones, and a dropped or misplaced scale is off by far more than bf16's
    tolerance."""
    return torch.exp2(torch.rand(*shape, generator=gen) * 6 - 3)


def _latent(gen, kv, layout, page_size=16, seqs=LENS):
    """An fp8 latent cache, its per-token scales, the layout's keywords, and a function giving each sequence's
    float64 keys [1, 1, n, D] dequantized with a given scale tensor (the cache's own by default). Paged: shuffled pages, and
    NaN scales in every slot no sequence owns (no valid output may read one)."""
    n_max = max(seqs)
    if layout == "dense":
        cache = torch.randn(len(seqs), 1, n_max, D, generator=gen).to(FP8[kv])
        scales = _scales(gen, len(seqs), 1, n_max)
        for b, n in enumerate(seqs):
            scales[b, :, n:] = float("nan")  # past the sequence's length: never read
        kw = {"seqlens_k": torch.tensor(seqs, dtype=torch.int32)} if len(set(seqs)) > 1 else {}

        def keys(b, s=None):
            s = scales if s is None else s
            return (cache[b:b + 1].double() * s[b:b + 1].double()[..., None])[:, :, :seqs[b]]
        return cache, scales, kw, keys
    width = -(-n_max // page_size)
    num_pages = len(seqs) * width + 1
    cache = torch.randn(num_pages, page_size, 1, D, generator=gen).to(FP8[kv])
    scales = torch.full((num_pages, page_size, 1), float("nan"))
    order = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.zeros(len(seqs), width, dtype=torch.int32)
    for b, n in enumerate(seqs):
        for p in range(-(-n // page_size)):
            table[b, p] = page = order.pop()
            used = min(page_size, n - p * page_size)
            scales[page, :used] = _scales(gen, used, 1)
    lens = torch.tensor(seqs, dtype=torch.int32)

    def keys(b, s=None):
        s = scales if s is None else s
        pages = table[b].long()
        rows = cache[pages].double() * s[pages].double()[..., None]
        return rows.reshape(-1, 1, D)[:seqs[b]].transpose(0, 1)[None]
    return cache, scales, dict(block_table=table, seqlens_k=lens), keys


def _on(device, *items):
    return [x.to(device) if isinstance(x, torch.Tensor) else x for x in items]


def _compare_terms(name, got, want, terms, dtype):
    """|got - want| <= atol * max(1, terms) + rtol * |want|, elementwise: `terms` is the reference on |V|, the
    softmax-weighted mean of the values' magnitudes. P @ V rounds P to q's type, an error relative to the terms and
    not to a result they cancel to, and per-token scales 64x apart make such cancellations (the H100 run: 1 of
    16384 outputs over bf16's absolute atol, where the bf16 kernel on the same values rounded to bf16 has 3x the
    error; docs/serving.md, "Per-token scales")."""
    unit = terms.clamp(min=1.0)
    compare(f"{name} (over max(1, terms))", got.double().cpu() / unit, want / unit, **TOLERANCE[dtype])


def _check(out, lse, q, keys, mask="causal", scales=None):
    for b in range(q.shape[0]):
        k = keys(b, scales)
        want, want_lse = reference.attention(q[b:b + 1].cpu(), k, None, head_dim_v=DV, mask=mask)
        terms, _ = reference.attention(q[b:b + 1].cpu(), k, k[..., :DV].abs(), mask=mask)
        _compare_terms(f"out (sequence {b})", out[b:b + 1], want, terms, "bf16")
        compare(f"lse (sequence {b})", lse[b:b + 1].cpu(), want_lse, **LSE_TOLERANCE)


@pytest.mark.parametrize("kv,layout,page_size,sq", [
    ("fp8_e4m3", "dense", None, 1), ("fp8_e5m2", "dense", None, 3), ("fp8_e4m3", "paged", 64, 1),
    ("fp8_e5m2", "paged", 16, 2), ("fp8_e4m3", "paged", 1, 2)], ids=str)
def test_latent_cache_with_per_token_scales_matches_the_dequantized_reference(kv, layout, page_size, sq):
    """MLA's latent cache, one scale a row for K and V: forward, forward_split over 3 splits, plan/run and the
    batch-invariant forward against the reference on x.double() * scale of each token (paged: each sequence alone
    gives the batch-invariant forward's bits). Pages of 64 (FlashMLA's and
    vLLM's), 16 and 1; dense with ragged lengths (the padding past a sequence's length is never read)."""
    gen = torch.Generator().manual_seed(sum(map(ord, f"{kv}{layout}{page_size}{sq}")))  # str hash is salted
    mask = "causal+padding" if layout == "dense" else "causal"
    module = _mla(kv, layout, mask=mask)
    cache, scales, kw, keys = _latent(gen, kv, layout, page_size or 16)
    q = torch.randn(len(LENS), 4, sq, D, generator=gen).bfloat16()
    q, cache, scales = _on(DEVICE, q, cache, scales)
    kw = {k: v.to(DEVICE) for k, v in kw.items()}
    if layout == "dense":
        kw["seqlens_q"] = torch.full((len(LENS),), sq, dtype=torch.int32, device=DEVICE)
    n_keys = cache.shape[2] if layout == "dense" else kw["block_table"].shape[1] * cache.shape[1]
    for name, (out, lse) in {
            "forward": module.forward(q, cache, None, k_scale=scales, **kw),
            "forward_split": module.forward_split(q, cache, None, num_splits=3, k_scale=scales, **kw),
            "plan.run": module.plan(len(LENS), 4, sq, n_keys, device=DEVICE).run(q, cache, None, k_scale=scales,
                                                                                 **kw),
            "batch_invariant": module.forward(q, cache, None, k_scale=scales, batch_invariant=True, **kw)}.items():
        assert out.shape == (len(LENS), 4, sq, DV), name
        _check(out, lse, q, keys, "causal")  # each sequence's keys cut to its length: causal is the padding's
    if layout == "paged":  # batch invariance: each sequence alone (its own block table row) gives the same bits
        out, lse = module.forward(q, cache, None, k_scale=scales, batch_invariant=True, **kw)
        for b in range(len(LENS)):
            alone = module.forward(q[b:b + 1], cache, None, k_scale=scales, batch_invariant=True,
                                   block_table=kw["block_table"][b:b + 1], seqlens_k=kw["seqlens_k"][b:b + 1])
            assert torch.equal(alone[0], out[b:b + 1]) and torch.equal(alone[1], lse[b:b + 1]), b


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_per_token_scales_are_read_from_their_own_token(layout):
    """The kernel's result is the reference's on the cache's own scales and far from it on the scales every other
    plausible bug reads: all ones (scales ignored), one per tensor (their mean), and each token's neighbour's (an
    off-by-one row, slot or page)."""
    gen = torch.Generator().manual_seed(7)
    module = _mla("fp8_e4m3", layout, mask="none")
    cache, scales, kw, keys = _latent(gen, "fp8_e4m3", layout, seqs=(45, 45))
    q = torch.randn(2, 4, 2, D, generator=gen).bfloat16()
    out, lse = module.forward(*_on(DEVICE, q, cache), None, k_scale=scales.to(DEVICE),
                              **{k: v.to(DEVICE) for k, v in kw.items()})
    _check(out, lse, q, keys, "none")
    real = scales.nan_to_num(1.0)
    wrong = {"ones": torch.ones_like(real), "the mean": torch.full_like(real, real.mean().item()),
             "the next token's": torch.roll(real, -1, dims=2 if layout == "dense" else 1)}
    if layout == "paged":
        wrong["the next page's"] = torch.roll(real, -1, dims=0)
    for name, other in wrong.items():
        with pytest.raises(AssertionError):
            _check(out, lse, q, keys, "none", other)
            pytest.fail(f"the kernel's result also matches the reference on {name} scales")


@pytest.mark.parametrize("layout", ["dense", "paged"])
@pytest.mark.parametrize("gqa,sq", [(2, 1), (4, 5)], ids=["multiply-sum", "dot"])
def test_separate_k_and_v_per_token_scales(layout, gqa, sq):
    """A cache with its own v: k and v per token (each its own scales), k per token with v per head, and k per
    tensor with v per token, against the reference on both caches dequantized; the multiply-sum path (2 rows) and
    tl.dot (20 rows)."""
    gen = torch.Generator().manual_seed(11 + gqa)
    module = fagen.load(fagen.KernelSpec(head_dim=32, kind="decode", gqa=gqa, dtype="fp16", kv_dtype="fp8_e5m2",
                                         mask="causal", layout=layout, block_n=16))
    hkv, n, page = 2, 37, 8
    q = torch.randn(2, gqa * hkv, sq, 32, generator=gen).half()
    k, v = (torch.randn(2, hkv, n, 32, generator=gen).to(torch.float8_e5m2) for _ in range(2))
    ks, vs, head = _scales(gen, 2, hkv, n), _scales(gen, 2, hkv, n), _scales(gen, hkv)
    pages = -(-n // page)

    def paged(t):  # [B, Hkv, n, ...] -> [B * pages, page, Hkv, ...], sequence b on pages b * pages ...
        t = torch.cat([t, t[:, :, :pages * page - n]], 2)
        return t.unflatten(2, (pages, page)).permute(0, 2, 3, 1, *range(4, t.dim() + 1)).flatten(0, 1)

    for k_form, v_form in ((ks, vs), (ks, head), (0.5, vs)):
        def deq(x, s):
            if isinstance(s, float):
                return x.double() * s
            return x.double() * (s.double()[..., None] if s.dim() == 3 else s.double()[None, :, None, None])
        want, want_lse = reference.attention(q, deq(k, k_form), deq(v, v_form), mask="causal")
        terms, _ = reference.attention(q, deq(k, k_form), deq(v, v_form).abs(), mask="causal")
        if layout == "dense":
            args, kw = (q, k, v), {}
            k_s, v_s = k_form, v_form
        else:
            args = (q, paged(k.view(torch.uint8)).view(k.dtype), paged(v.view(torch.uint8)).view(v.dtype))
            kw = dict(block_table=torch.arange(2 * pages, dtype=torch.int32).view(2, pages),
                      seqlens_k=torch.tensor([n, n], dtype=torch.int32))
            k_s, v_s = (paged(s) if isinstance(s, torch.Tensor) and s.dim() == 3 else s for s in (k_form, v_form))
        out, lse = module.forward(*_on(DEVICE, *args), k_scale=_on(DEVICE, k_s)[0], v_scale=_on(DEVICE, v_s)[0],
                                  **{a: b.to(DEVICE) for a, b in kw.items()})
        _compare_terms("out", out, want, terms, "fp16")
        compare("lse", lse.cpu(), want_lse, **LSE_TOLERANCE)


def test_per_token_scale_errors_name_what_was_wrong():
    """One line each, before any launch: dtype, shape (the cache's shape without its last dim, named), device, a
    shared cache's v_scale, and a tensor of neither form."""
    gen = torch.Generator().manual_seed(3)
    module = _mla("fp8_e4m3", "paged")
    cache, scales, kw, _ = _latent(gen, "fp8_e4m3", "paged", 16)
    q = torch.randn(2, 4, 1, D, generator=gen).bfloat16()
    q, cache, scales = _on(DEVICE, q, cache, scales)
    kw = {k: v.to(DEVICE) for k, v in kw.items()}
    shape = list(cache.shape[:-1])
    cases = [
        (scales.bfloat16(), "k_scale: per-token scales must be float32, got torch.bfloat16; pass k_scale.float()"),
        (scales[:, :-1], re.escape(f"k_scale: per-token scales must have the cache's shape without its last dim, "
                                   f"{shape} (num_pages, page_size, Hkv), got [9, 15, 1]")),
        (torch.ones(shape, device="meta"), "k_scale: per-token scales must be on q's device"),
        (scales[0], r"k_scale: expected a positive finite float, a float32 tensor \[1\] \(per KV head\) or a float32 "
                    r"tensor \[.*\] \(per token\)"),
    ]
    for bad, message in cases:
        with pytest.raises(module.InputError, match=message) as info:
            module.forward(q, cache, None, k_scale=bad, **kw)
        assert "\n" not in str(info.value)
    with pytest.raises(module.InputError, match="v_scale: a shared latent cache has one scale, k_scale"):
        module.forward(q, cache, None, k_scale=scales, v_scale=scales, **kw)
    dense = fagen.load(fagen.KernelSpec(head_dim=32, kind="decode", gqa=2, dtype="fp16", kv_dtype="fp8_e4m3",
                                        block_n=16))
    k = torch.randn(1, 2, 20, 32).to(torch.float8_e4m3fn).to(DEVICE)
    with pytest.raises(dense.InputError, match=r"v_scale: per-token scales must have the cache's shape without its "
                                               r"last dim, \[1, 2, 20\] \(B, Hkv, Sk\), got \[1, 20, 2\]"):
        dense.forward(torch.randn(1, 4, 1, 32).half().to(DEVICE), k, k, v_scale=torch.ones(1, 20, 2).to(DEVICE))


def test_per_token_scales_through_the_operators_and_torch_compile():
    """The operators carry the per-token tensors (opcheck: the fake), and forward under
    torch.compile(fullgraph=True) is one graph of the module's operator with the eager bits."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(5)
    module = _mla("fp8_e5m2", "paged")
    cache, scales, kw, _ = _latent(gen, "fp8_e5m2", "paged", 16)
    q = torch.randn(2, 4, 1, D, generator=gen).bfloat16()
    q, cache, scales = _on(DEVICE, q, cache, scales)
    table, lens = kw["block_table"].to(DEVICE), kw["seqlens_k"].to(DEVICE)
    want = module.forward(q, cache, None, block_table=table, seqlens_k=lens, k_scale=scales)
    scale = 1 / math.sqrt(D)
    op_args = (q, cache, cache[..., :DV], scale, None, lens, None, table, 1.0, 1.0, None, None, scales, scales, None)
    # opcheck's schema test multiplies the inputs, which torch cannot do on fp8 tensors on the CPU
    result = torch.library.opcheck(module.forward_op, op_args, test_utils=("test_faketensor",))
    assert set(result.values()) == {"SUCCESS"}, result
    nodes = []

    def backend(gm, example_inputs):
        nodes.extend(n for n in gm.graph.nodes if n.op == "call_function" and "fagen" in str(n.target))
        return gm.forward

    call = lambda q, c, s: module.forward(q, c, None, block_table=table, seqlens_k=lens, k_scale=s)  # noqa: E731
    with torch.no_grad():
        got = torch.compile(call, fullgraph=True, backend=backend)(q, cache, scales)
    assert len(nodes) == 1, nodes
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_decode_steps_never_replay_a_kernel_built_for_another_scale_form(monkeypatch):
    """[Note] Decode steps on the CPU, with fakes for the GPU's fast launches (as tests/test_fp8.py): a float,
    per-token, per-head and per-token scales again at one shape, then shorter dense caches (a step's key holds the
    per-token strides' classes, as k's): each form builds its kernel once and replays only into a kernel of its own
    form and stride classes."""
    spec = fagen.KernelSpec(head_dim=32, kind="decode", dtype="fp16", gqa=2, kv_dtype="fp8_e4m3", block_n=16)
    m = fagen.load(spec)
    names = m._decode_split.arg_names
    at = [names.index(n) for n in ("KScale", "VScale", "KTok", "VTok")]
    at_zb = names.index("stride_zb")
    launches = []  # (built for form, called with form, replayed)

    def form(args):  # which of k's and v's scales are per head, per token, or neither (floats)
        return tuple(args[i] is None for i in at), args[at_zb]

    class Built:
        def __init__(self, fn):
            pass

        def __getitem__(self, grid):
            return self

        def __call__(self, *args, **consts):
            launches.append((form(args)[0], form(args)[0], False))
            return (None, (0, 0), None, None, (), 0, form(args)[0])  # a direct entry ([Note] Fast launches)

    def replay(entry, grid, device, args):
        launches.append((entry[-1], form(args)[0], True))
        strides.append(form(args)[1])

    strides = []
    monkeypatch.setattr(m, "_fast", Built)
    monkeypatch.setattr(m, "_launch_entry", replay)
    monkeypatch.setattr(m, "_STEPS", {})
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 1, 32, generator=g).half().to(DEVICE)
    k, v = (torch.randn(2, 2, 41, 32, generator=g).to(torch.float8_e4m3fn).to(DEVICE) for _ in range(2))
    per_head = torch.tensor([0.5, 2.0], device=DEVICE)
    tok = _scales(g, 2, 2, 41).to(DEVICE)
    for scales in (dict(k_scale=0.5), dict(k_scale=tok, v_scale=tok), dict(k_scale=per_head, v_scale=per_head),
                   dict(k_scale=tok, v_scale=tok), dict(k_scale=0.5), dict(k_scale=tok, v_scale=per_head),
                   dict(k_scale=tok, v_scale=2.0), dict(k_scale=tok, v_scale=2.0)):
        m.forward(q, k, v, **scales)
    assert [r for _, _, r in launches] == [False, False, False, True, True, False, False, True], launches
    assert all(built == called for built, called, _ in launches), launches
    for n in (40, 39):  # 40: stride_zb 80, a multiple of 16 where 82 was not: a kernel of its own; 39: replays 41's
        m.forward(q, k[:, :, :n].contiguous(), v[:, :, :n].contiguous(), k_scale=tok[:, :, :n].contiguous(),
                  v_scale=tok[:, :, :n].contiguous())
    assert [r for _, _, r in launches[8:]] == [False, True], launches
    assert strides[-1] == 2 * 39, strides  # the replay passes this call's strides, not the first call's


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a CUDA device")
def test_per_token_scales_in_a_cuda_graph():
    """A plan's run with per-token scales, captured in a CUDA graph, reads the scales' current values at each replay
    (changed in place after the capture) and matches the reference on them."""
    gen = torch.Generator().manual_seed(9)
    module = _mla("fp8_e4m3", "paged")
    cache, scales, kw, keys = _latent(gen, "fp8_e4m3", "paged", 64)
    q = torch.randn(len(LENS), 4, 1, D, generator=gen).bfloat16()
    q, cache, scales = _on(DEVICE, q, cache, scales)
    kw = {k: v.to(DEVICE) for k, v in kw.items()}
    plan = module.plan(len(LENS), 4, 1, kw["block_table"].shape[1] * 64, device=DEVICE)
    out, lse = torch.empty(len(LENS), 4, 1, DV, dtype=q.dtype, device=DEVICE), q.new_empty(len(LENS), 4, 1).float()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        plan.run(q, cache, None, k_scale=scales, out=out, lse=lse, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(q, cache, None, k_scale=scales, out=out, lse=lse, **kw)
    scales.mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    _check(out, lse, q, lambda b, s=None: keys(b, scales.cpu() if s is None else s), "causal")


@pytest.mark.parametrize("extra", ["switches", "mods"])
def test_score_switches_and_mods_see_the_dequantized_score(extra):
    """The per-token k scale multiplies the score before the softcap, ALiBi, the window and a score_mod see it, and
    the sinks join the dequantized softmax: against the reference on the dequantized cache."""
    gen = torch.Generator().manual_seed(41)
    q = torch.randn(2, 4, 2, 32, generator=gen).half()
    k, v = (torch.randn(2, 2, 50, 32, generator=gen).to(torch.float8_e4m3fn) for _ in range(2))
    ks, vs = _scales(gen, 2, 2, 50), _scales(gen, 2, 2, 50)
    kd, vd = k.double() * ks.double()[..., None], v.double() * vs.double()[..., None]
    if extra == "switches":
        spec = fagen.KernelSpec(head_dim=32, gqa=2, dtype="fp16", kind="decode", mask="causal", kv_dtype="fp8_e4m3",
                                window=True, softcap=True, alibi=True, sinks=True, block_n=16)
        slopes, sinks = torch.rand(4, generator=gen), torch.randn(4, generator=gen)
        kw = dict(window=(30, 0), softcap=20.0, alibi_slopes=slopes, sinks=sinks)
        ref_kw = dict(kw)
    else:
        spec = fagen.KernelSpec(head_dim=32, gqa=2, dtype="fp16", kind="decode", mask="causal", kv_dtype="fp8_e4m3",
                                score_mod="(score - (0.1 * abs((q_idx - kv_idx))))", mask_mod="((kv_idx % 3) != 1)",
                                block_n=16)
        kw = dict(mods={})
        ref_kw = dict(mod_positions="absolute", score_mod=lambda s, b, h, qi, ki: s - 0.1 * (qi - ki).abs(),
                      mask_mod=lambda b, h, qi, ki: (ki % 3) != 1)
    module = fagen.load(spec)
    out, lse = module.forward_split(*_on(DEVICE, q, k, v), num_splits=2, k_scale=ks.to(DEVICE), v_scale=vs.to(DEVICE),
                                    **{a: _on(DEVICE, b)[0] for a, b in kw.items()})
    want, want_lse = reference.attention(q.double(), kd, vd, mask="causal", **ref_kw)
    terms, _ = reference.attention(q.double(), kd, vd.abs(), mask="causal", **ref_kw)
    _compare_terms("out", out, want, terms, "fp16")
    compare("lse", lse.cpu(), want_lse, **LSE_TOLERANCE)
