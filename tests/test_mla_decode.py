"""MLA absorbed decode (README "MLA absorbed decode"): one shared latent cache, V = its first head_dim_v columns
(spec field shared_kv), paged and dense, against the float64 reference on the cache with V sliced from K."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings

import fagen
from _env import DEVICE, ON_GPU, SCALE
from fagen.errors import SpecError
from fagen.runtime.loader import load
from fagen.verify import layouts, reference
from fagen.verify.properties import check_forward
from fagen.verify.strategies import decode_problems
from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare

# (head_dim, head_dim_v) scaled down for the CPU: a power-of-two latent, one that is not (padded, masked columns) and
# a rope part that is not a power of two (24 columns in a 32-column tile); MLA's own 576/512 runs with few keys.
SMALL_DIMS = [(48, 32), (40, 24), (56, 32)]
DTYPE = "bf16"


def _spec(d, dv, gqa, mask="causal", layout="dense", **kw):
    return fagen.KernelSpec(head_dim=d, head_dim_v=dv, shared_kv=True, kind="decode", gqa=gqa, dtype=DTYPE,
                            mask=mask, layout=layout, **({} if ON_GPU else dict(block_n=16)), **kw)


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen).to(torch.bfloat16).to(DEVICE)


def _paged(gen, k_seqs, page_size):
    """A page cache [num_pages, page_size, 1, D] holding each sequence's keys on shuffled pages, its block table and
    lengths; pages past a sequence's length hold garbage (NaN) that no valid output may see."""
    lens = [k.shape[0] for k in k_seqs]
    width = max(1, max(-(-n // page_size) for n in lens))
    num_pages = len(k_seqs) * width + 1
    d = k_seqs[0].shape[-1]
    cache = torch.full((num_pages, page_size, 1, d), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    order = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.zeros(len(k_seqs), width, dtype=torch.int32)
    for b, k in enumerate(k_seqs):
        for p in range(-(-k.shape[0] // page_size)):
            page = order.pop()
            table[b, p] = page
            rows = k[p * page_size:(p + 1) * page_size]
            cache[page, :rows.shape[0], 0] = rows
    return cache, table.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def _check_sequences(spec, out, lse, q, k_seqs, mask, scale=None):
    tol = TOLERANCE[spec.dtype]
    for b, k in enumerate(k_seqs):
        want, want_lse = reference.attention(q[b:b + 1].cpu(), k.cpu().transpose(0, 1)[None], None,
                                             head_dim_v=spec.head_dim_v, mask=mask, scale=scale)
        compare(f"out (sequence {b})", out[b:b + 1].cpu(), want, **tol)
        compare(f"lse (sequence {b})", lse[b:b + 1].cpu(), want_lse, **LSE_TOLERANCE)


@pytest.mark.parametrize("dims", SMALL_DIMS, ids=lambda p: f"d{p[0]}v{p[1]}")
@pytest.mark.parametrize("sq", [1, 2, 5])
def test_dense_latent_decode_matches_the_reference(dims, sq):
    """Dense cache [B, 1, Sk, D]: gqa 4 x Sq packed rows (Sq 1: the multiply-sum path; 2 and 5: tl.dot), causal
    alignment among the Sq steps, a length that is not a multiple of the key block, and a forced split count."""
    d, dv = dims
    spec = _spec(d, dv, gqa=4)
    module = load(spec)
    gen = torch.Generator().manual_seed(d + sq)
    q, k = _randn(gen, 2, 4, sq, d), _randn(gen, 2, 1, 45, d)
    want, want_lse = reference.attention(q, k, None, head_dim_v=dv, mask="causal")
    for out, lse in (module.forward(q, k, None), module.forward_split(q, k, None, num_splits=3)):
        assert out.shape == (2, 4, sq, dv)
        compare("out", out, want, **TOLERANCE[spec.dtype])
        compare("lse", lse, want_lse, **LSE_TOLERANCE)


@pytest.mark.parametrize("page_size", [4, 64])
@pytest.mark.parametrize("sq", [1, 2, 5])
def test_paged_latent_decode_matches_the_reference(page_size, sq):
    """Page cache [num_pages, page_size, 1, D] (64: FlashMLA's and vLLM's page), shuffled pages, lengths that are
    not multiples of the page or key block, one empty sequence (out 0, lse -inf) and one shorter than Sq (its
    first rows see no key)."""
    d, dv = SMALL_DIMS[2]
    spec = _spec(d, dv, gqa=2, layout="paged")
    module = load(spec)
    gen = torch.Generator().manual_seed(page_size + sq)
    k_seqs = [_randn(gen, n, d) for n in (70, 0, 3, 33)]
    cache, table, lens = _paged(gen, k_seqs, page_size)
    q = _randn(gen, 4, 2, sq, d)
    out, lse = module.forward(q, cache, None, block_table=table, seqlens_k=lens)
    assert out.shape == (4, 2, sq, dv)
    _check_sequences(spec, out, lse, q, [k[:, None] for k in k_seqs], "causal")
    out2, lse2 = module.forward_split(q, cache, None, block_table=table, seqlens_k=lens, num_splits=4)
    _check_sequences(spec, out2, lse2, q, [k[:, None] for k in k_seqs], "causal")


@pytest.mark.parametrize("split", [False, True], ids=["joint", "split"])
@pytest.mark.parametrize("mask", ["causal", "none"])
def test_latent_decode_64_row_tiles(mask, split, monkeypatch):
    """Hq x Sq of 64 rows and more on one latent cache in 64-row tiles on 8 warps (the compute-bound shape's tile:
    [Note] Split scores, whose always-true `if`s and loop over no keys run here too): two row tiles, ragged
    lengths across key blocks and pages, an empty sequence, one split and several."""
    d, dv = SMALL_DIMS[1]
    spec = _spec(d, dv, gqa=48, mask=mask, layout="paged", block_m=64, num_warps=8)
    module = load(spec)
    monkeypatch.setattr(module, "SPLIT_SCORES", type(module.SPLIT_SCORES)(split))
    gen = torch.Generator().manual_seed(11)
    k_seqs = [_randn(gen, n, d) for n in (45, 0, 19)]
    cache, table, lens = _paged(gen, k_seqs, 16)
    q = _randn(gen, 3, 48, 2, d)
    for splits in (1, 3):
        out, lse = module.forward_split(q, cache, None, block_table=table, seqlens_k=lens, num_splits=splits)
        _check_sequences(spec, out, lse, q, [k[:, None] for k in k_seqs], mask)


def test_latent_wide_merge_gives_the_same_bits():
    """[Note] Wide merge: a 16-row tile merges each split's whole partial row at once (the default), with the same
    sums in the same order as the 128-column slices, so the same bits, and both match float64; several splits of
    ragged chunks (v 160 pads to 256 columns: two 128-column slices)."""
    d, dv = 176, 160
    spec = _spec(d, dv, gqa=8, mask="none", layout="paged")
    module = load(spec)
    assert module.MERGE_WIDE_ROWS >= 16 and module.SPLIT_SCORES
    gen = torch.Generator().manual_seed(5)
    k_seqs = [_randn(gen, n, d) for n in (77, 50)]
    cache, table, lens = _paged(gen, k_seqs, 16)
    q = _randn(gen, 2, 8, 2, d)
    got = {}
    for wide in (16, 0):
        old = module.MERGE_WIDE_ROWS
        module.MERGE_WIDE_ROWS = type(old)(wide)
        try:
            got[wide] = module.forward_split(q, cache, None, block_table=table, seqlens_k=lens, num_splits=4)
        finally:
            module.MERGE_WIDE_ROWS = old
    _check_sequences(spec, *got[16], q, [k[:, None] for k in k_seqs], "none")
    assert torch.equal(got[16][0], got[0][0]) and torch.equal(got[16][1], got[0][1])


@pytest.mark.parametrize("sq", [1, 2])
def test_mla_576_512_with_few_keys(sq):
    """MLA's own shape: d_qk 576 (512 latent + 64 rope), d_v 512, 16 query heads on one latent cache of 64-key
    pages, through forward and plan/run, with the scale DeepSeek passes (1/sqrt(192))."""
    spec = _spec(576, 512, gqa=16, layout="paged")
    module = load(spec)
    gen = torch.Generator().manual_seed(sq)
    k_seqs = [_randn(gen, n, 576) for n in (37, 90)]
    cache, table, lens = _paged(gen, k_seqs, 64)
    q = _randn(gen, 2, 16, sq, 576)
    scale = 192 ** -0.5
    out, lse = module.forward(q, cache, None, block_table=table, seqlens_k=lens, scale=scale)
    assert out.shape == (2, 16, sq, 512)
    _check_sequences(spec, out, lse, q, [k[:, None] for k in k_seqs], "causal", scale)
    plan = module.plan(2, 16, sq, table.shape[1] * 64, device=DEVICE)
    out2, lse2 = plan.run(q, cache, None, block_table=table, seqlens_k=lens, scale=scale)
    _check_sequences(spec, out2, lse2, q, [k[:, None] for k in k_seqs], "causal", scale)


@pytest.mark.parametrize("mask", ["none", "padding", "tree"])
def test_latent_decode_masks_and_switches(mask):
    """The other masks and every score switch go through the shared cache's loads unchanged."""
    d, dv = SMALL_DIMS[0]
    switches = dict(window=True, softcap=True, alibi=True, sinks=True) if mask == "none" else {}
    spec = _spec(d, dv, gqa=2, mask=mask, **switches)
    module = load(spec)
    gen = torch.Generator().manual_seed(11)
    q, k = _randn(gen, 2, 2, 3, d), _randn(gen, 2, 1, 29, d)
    kw = {}
    if mask == "padding":
        kw = dict(seqlens_q=torch.tensor([3, 1], device=DEVICE), seqlens_k=torch.tensor([29, 17], device=DEVICE))
    if mask == "tree":
        kw = dict(tree_mask=torch.tensor([[-1, 0, 0], [-1, 0, 1]], device=DEVICE))
    if switches:
        kw = dict(window=(9, 0), softcap=5.0, alibi_slopes=torch.rand(2, generator=gen).to(DEVICE),
                  sinks=torch.randn(2, generator=gen).to(DEVICE))
    out, lse = module.forward(q, k, None, **kw)
    ref_kw = dict(kw)
    if mask == "tree":
        ref_kw["tree_mask"] = module.tree_mask_from_parents(kw["tree_mask"].cpu())
    want, want_lse = reference.attention(q.cpu(), k.cpu(), None, head_dim_v=dv, mask=mask,
                                         **{n: t.cpu() if isinstance(t, torch.Tensor) else t
                                            for n, t in ref_kw.items()})
    compare("out", out.cpu(), want, **TOLERANCE[spec.dtype])
    compare("lse", lse.cpu(), want_lse, **LSE_TOLERANCE)


def test_latent_decode_is_batch_invariant():
    """A sequence's bits alone equal its bits in a batch (README "Serving", batch_invariant)."""
    d, dv = SMALL_DIMS[0]
    module = load(_spec(d, dv, gqa=4, layout="paged"))
    gen = torch.Generator().manual_seed(5)
    k_seqs = [_randn(gen, n, d) for n in (61, 100, 7)]
    cache, table, lens = _paged(gen, k_seqs, 16)
    q = _randn(gen, 3, 4, 2, d)
    out, lse = module.forward(q, cache, None, block_table=table, seqlens_k=lens, batch_invariant=True)
    alone, alone_lse = module.forward(q[1:2], cache, None, block_table=table[1:2], seqlens_k=lens[1:2],
                                      batch_invariant=True)
    assert torch.equal(out[1:2], alone) and torch.equal(lse[1:2], alone_lse)


def test_latent_merge_of_one_split_is_the_direct_result():
    """[Note] Latent merge: a merged launch whose tiles have one split each (the batch-invariant rule over a cache
    shorter than its minimum chunk) gives the bits of the direct launch (one split, no merge): the one weight is
    exactly 1. Several splits, merged in 128-column slices, match the reference (the paged tests above)."""
    d, dv = 576, 512  # the merge's column slices (128) need a latent wider than one slice
    spec = _spec(d, dv, gqa=2, layout="paged")
    module = load(spec)
    gen = torch.Generator().manual_seed(9)
    k_seqs = [_randn(gen, n, d) for n in (11, 5)]  # one key block each under the interpreter
    cache, table, lens = _paged(gen, k_seqs, 16)
    q = _randn(gen, 2, 2, 2, d)
    kw = dict(block_table=table, seqlens_k=lens)
    merged, merged_lse = module.forward(q, cache, None, **kw)
    direct, direct_lse = module.forward_split(q, cache, None, num_splits=1, **kw)
    assert torch.equal(merged, direct) and torch.equal(merged_lse, direct_lse)
    _check_sequences(spec, merged, merged_lse, q, [k[:, None] for k in k_seqs], "causal")


def test_latent_input_errors():
    d, dv = SMALL_DIMS[0]
    module = load(_spec(d, dv, gqa=2))
    q, k = torch.randn(1, 2, 1, d, device=DEVICE).bfloat16(), torch.randn(1, 1, 9, d, device=DEVICE).bfloat16()
    with pytest.raises(module.InputError, match=f"v: this kernel .* reads V as the first {dv} columns of the k "
                                                "cache .*; pass v=None"):
        module.forward(q, k, k[..., :dv])
    with pytest.raises(module.InputError, match=f"k: head_dim {dv} but this kernel is built for head_dim {d}"):
        module.forward(q, k[..., :dv], None)
    with pytest.raises(module.InputError, match="out"):
        module.forward(q, k, None, out=torch.empty_like(q))


def test_latent_decode_default_tiles():
    """[Note] Latent decode tiles: 16-row tiles below gqa 64 (no spills at any Sq), 64-row tiles with 64-key blocks
    at gqa 64 and up on sm_90, 32-key blocks where 217 KB of shared memory does not fit; given fields win."""
    def tiles(gqa, **kw):
        s = fagen.KernelSpec(head_dim=576, head_dim_v=512, shared_kv=True, kind="decode", gqa=gqa, dtype="bf16",
                             layout="paged", **kw)
        return s.block_m, s.block_n, s.num_warps, s.num_stages

    assert tiles(16) == tiles(1) == (16, 32, 4, 3)
    assert tiles(128) == tiles(64) == (64, 64, 8, 2)
    assert tiles(128, arch="sm_80") == (64, 32, 8, 2)
    assert tiles(16, num_stages=2) == (16, 32, 4, 2)


def test_shared_kv_spec_errors():
    base = dict(head_dim=576, head_dim_v=512, shared_kv=True, kind="decode", gqa=16, dtype="bf16")
    spec = fagen.KernelSpec(**base)
    assert spec.name.endswith("_g16_shared_bf16") and "d576v512" in spec.name
    assert fagen.KernelSpec.from_json(spec.to_json()) == spec
    assert "shared_kv" not in fagen.KernelSpec(head_dim=64).to_json()
    for fields, field, words in (
            (dict(kind="prefill"), "shared_kv", "decode kernels"),
            (dict(head_dim=512), "head_dim_v", "below head_dim"),
            (dict(head_dim_v=None), "head_dim_v", "below head_dim"),
            (dict(head_dim=584), "head_dim", "from 16 to 576"),
            (dict(head_dim=512, head_dim_v=128), "head_dim", "at most 256"),
            (dict(shared_kv=1), "shared_kv", "true or false"),
            (dict(shared_kv=False), "head_dim", "up to 576 with shared_kv")):
        with pytest.raises(SpecError, match=words) as info:
            fagen.KernelSpec(**dict(base, **fields))
        assert info.value.field == field, (fields, info.value)
    assert dataclasses.replace(spec, head_dim=64, head_dim_v=48).head_dim == 64


def test_fagen_attention_takes_v_none():
    """fagen.attention(q, kv, None, head_dim_v=...) runs the shared latent decode; without head_dim_v, with a
    gradient or with too many queries it says what to do."""
    d, dv = SMALL_DIMS[0]
    gen = torch.Generator().manual_seed(9)
    q, k = _randn(gen, 2, 4, 2, d), _randn(gen, 2, 1, 300, d)
    with torch.no_grad():
        out = fagen.attention(q, k, None, head_dim_v=dv, mask="causal")
    want, _ = reference.attention(q, k, None, head_dim_v=dv, mask="causal")
    compare("out", out, want, **TOLERANCE[fagen.KernelSpec(head_dim=d, dtype=DTYPE).dtype])
    with pytest.raises(fagen.AttentionError, match="pass head_dim_v"):
        fagen.attention(q, k, None)
    with pytest.raises(fagen.AttentionError, match="drop head_dim_v"):
        fagen.attention(q, k, k, head_dim_v=dv)
    with pytest.raises(fagen.AttentionError, match="no backward"):
        fagen.attention(q.requires_grad_(), k, None, head_dim_v=dv)
    with torch.no_grad(), pytest.raises(fagen.AttentionError, match="1 to 16 queries"):
        fagen.attention(_randn(gen, 1, 4, 17, d), k[:1], None, head_dim_v=dv)
    with torch.no_grad(), pytest.raises(fagen.AttentionError, match="head_dim_v"):
        fagen.attention(q, k, None, head_dim_v=d)


def test_fagen_attention_builds_the_latent_spec_once(monkeypatch):
    """The shared latent decode's spec is built once a case (api._latent_spec): a KernelSpec's validation is host
    time a decode step would pay every call (docs/serving.md, "MLA decode, tenth session")."""
    from fagen.runtime import api
    d, dv = SMALL_DIMS[0]
    gen = torch.Generator().manual_seed(10)
    q, k = _randn(gen, 1, 4, 1, d), _randn(gen, 1, 1, 70, d)
    with torch.no_grad():
        first = fagen.attention(q, k, None, head_dim_v=dv)

        def no_spec(*args, **kwargs):
            raise AssertionError("a KernelSpec built on a warm call")
        monkeypatch.setattr(api, "KernelSpec", no_spec)
        assert torch.equal(fagen.attention(q, k, None, head_dim_v=dv), first)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_fp8_latent_cache_matches_the_dequantized_reference(kv, layout):
    """An fp8 latent cache (kv_dtype with shared_kv): one scale, k_scale, for K and for V (the cache's first
    head_dim_v columns), against the reference on the dequantized cache; per tensor, per head, and per tensor
    again at one shape (a GPU's decode steps must not replay one form's kernel for the other, [Note] Decode
    steps); a v_scale is refused."""
    d, dv = SMALL_DIMS[1]
    spec = _spec(d, dv, gqa=4, layout=layout, kv_dtype=kv)
    module = load(spec)
    fp8 = getattr(torch, {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[kv])
    gen = torch.Generator().manual_seed(13)
    q = _randn(gen, 2, 4, 2, d)
    k_seqs = [_randn(gen, n, d).to(fp8) for n in (50, 23)]
    for scale in (0.7, torch.tensor([1.3], device=DEVICE), 0.7):
        if layout == "dense":
            cache = torch.stack([k_seqs[0][:23], k_seqs[1]])[:, None]  # [2, 1, 23, D]
            out, lse = module.forward(q, cache, None, k_scale=scale)
            keys = [cache[0, 0], cache[1, 0]]
        else:
            cache, table, lens = _paged(gen, [k.to(torch.bfloat16) for k in k_seqs], 16)
            cache = cache.nan_to_num(0.0).to(fp8)
            out, lse = module.forward(q, cache, None, block_table=table, seqlens_k=lens, k_scale=scale)
            keys = k_seqs
        for b, k in enumerate(keys):
            want, want_lse = reference.attention(q[b:b + 1].cpu(), k.cpu()[None, None], None, head_dim_v=dv,
                                                 mask="causal", k_scale=scale.cpu() if isinstance(scale, torch.Tensor)
                                                 else scale)
            compare(f"out (sequence {b})", out[b:b + 1].cpu(), want, **TOLERANCE[spec.dtype])
            compare(f"lse (sequence {b})", lse[b:b + 1].cpu(), want_lse, **LSE_TOLERANCE)
    with pytest.raises(module.InputError, match="v_scale: a shared latent cache has one scale, k_scale"):
        module.forward(q, cache, None, **({} if layout == "dense" else dict(block_table=table, seqlens_k=lens)),
                       k_scale=1.0, v_scale=1.0)


@pytest.mark.parametrize("kv", [None, "fp8_e4m3"])
@pytest.mark.parametrize("mask", ["causal", "causal+padding", "tree"])
def test_latent_decode_property(mask, kv):
    """The verify property (fagen.verify.properties.check_forward, v=None for a shared cache) over Hypothesis's
    decode problems: batch, lengths, Sq, scales and magnitudes drawn."""
    d, dv = SMALL_DIMS[1]
    spec = _spec(d, dv, gqa=4, mask=mask, kv_dtype=kv)
    module = load(spec)

    @settings(max_examples=3 if not ON_GPU else 12, deadline=None)
    @given(decode_problems(spec, SCALE))
    def run(problem):
        check_forward(module, spec, problem, DEVICE)

    run()


@pytest.mark.parametrize("kv", [None, "fp8_e5m2"])
@pytest.mark.parametrize("mask", ["none", "causal", "tree"])
def test_paged_latent_decode_property(mask, kv):
    """The paged verify property (fagen.verify.layouts.check_forward, v=None for a shared cache) over Hypothesis's
    layout cases: page sizes, lengths per sequence, Sq and trees drawn."""
    d, dv = SMALL_DIMS[2]
    spec = _spec(d, dv, gqa=2, mask=mask, layout="paged", kv_dtype=kv)
    module = load(spec)

    @settings(max_examples=3 if not ON_GPU else 12, deadline=None)
    @given(layouts.cases(spec, max_len=40 if not ON_GPU else 700))
    def run(case):
        layouts.check_forward(module, spec, case, DEVICE)

    run()


# The split kernel of an MLA 576/512 spec (one split; the tests below pick the tile, the cache dtype, SPLIT_SCORES)
# lowered to sm_90 TTGIR on the CPU: the IR after Triton's layouts and software pipeliner, before LLVM (a few seconds, no ptxas). In a fresh
# process: this one has run the interpreter, whose patched builtins break a compile in the same process.
_TTGIR_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton._C.libtriton import ir
import fagen
from fagen.aot.artifacts import import_for_compile

cfg = json.loads(sys.argv[2])  # spec: KernelSpec fields; cval: constexprs beside the shared ones; split: SPLIT_SCORES
spec = fagen.KernelSpec(**cfg["spec"])
module = import_for_compile(spec)
if cfg.get("split") is not None:
    module.SPLIT_SCORES = type(module.SPLIT_SCORES)(cfg["split"])
fn = module._decode_split
cval = dict(HEAD_DIM=576, BLOCK_D=64, HEAD_DIM_V=512, BLOCK_DV=512, BLOCK_N=spec.block_n, DOT=True, DIRECT=True,
            SPLITS_PER_SEQ=0, UPCAST=False, stride_tb=0, stride_tm=0, SeqlensQ=None, TreeMask=None, **cfg["cval"])
elem = {"fp8_e4m3": "*fp8e4nv", "fp8_e5m2": "*fp8e5"}.get(cfg["spec"].get("kv_dtype"), "*bf16")
ptrs = {"Q": "*bf16", "K": elem, "V": elem, "Dst": "*fp32", "DstLse": "*fp32", "Out": "*bf16", "Lse": "*fp32",
        "Counter": "*i32", "SeqlensK": "*i32", "BlockTable": "*i32"}
floats = set(cfg["floats"])
sig, consts, attrs = {}, {}, {}
for i, name in enumerate(fn.arg_names):
    if fn.params[i].is_constexpr or name in cval:
        sig[name], consts[name] = "constexpr", cval[name]
    else:
        sig[name] = ptrs.get(name, "fp32" if name in floats else "i32")
        if name not in floats | {"seq_q", "seq_k", "chunk", "n_tiles", "page_shift", "num_pages"}:
            attrs[(i,)] = [["tt.divisibility", 16]]  # pointers and strides as torch allocates them
target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
opts = backend.parse_options({"num_warps": spec.num_warps, "num_stages": spec.num_stages})
src = ASTSource(fn, sig, consts, attrs)
ctx = ir.context()
ir.load_dialects(ctx)
backend.load_dialects(ctx)
mod = src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), ctx)
stages, metadata = {}, {}
backend.add_stages(stages, opts, src.language)
print(stages["ttgir"](stages["ttir"](mod, metadata), metadata))
"""


def _ttgir(tmp_path, spec: dict, cval: dict, floats=("qk_scale",), split=None) -> str:
    """_decode_split of this MLA spec lowered to sm_90 TTGIR in a fresh process (the script above)."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FAGEN_CACHE_DIR"] = str(tmp_path)
    cfg = json.dumps(dict(spec=spec, cval=cval, floats=list(floats), split=split))
    proc = subprocess.run([sys.executable, "-c", _TTGIR_SCRIPT, root, cfg], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.parametrize("kv,layout", [("fp8_e4m3", "paged"), ("fp8_e5m2", "dense")])
def test_fp8_latent_tile_streams_and_converts_once_on_sm90(kv, layout, tmp_path):
    """[Note] V converted once: at MLA's 576/512 on sm_90 the fp8 latent tile [BLOCK_N, 512] streams into shared
    memory through cp.async in both key loops (the masked and the unmasked one), is never a plain load waited for
    in the loop, and each loop converts it once (one asm or cast to bf16 of a BLOCK_N x 512 tile, in the load's
    layout, not in a dot operand's). With a pure conversion Triton converted it in both dot operands' layouts and
    gave it no pipeline stages (docs/serving.md, "An fp8 latent cache")."""
    import re
    spec = dict(head_dim=576, head_dim_v=512, shared_kv=True, kind="decode", gqa=16, dtype="bf16", mask="causal",
                layout=layout, kv_dtype=kv, block_m=16, block_n=32, num_warps=4, num_stages=3)
    ttgir = _ttgir(tmp_path, spec, dict(ROWS=16, GQA=16, KScale=None, VScale=None, KTok=None, VTok=None),
                   floats=("qk_scale", "k_scale", "v_scale"))
    fp8 = {"fp8_e4m3": "f8E4M3FN", "fp8_e5m2": "f8E5M2"}[kv]
    streamed = re.findall(rf"async_copy_global_to_local .*tensor<32x512x!tt\.ptr<{fp8}>", ttgir)
    waited = re.findall(rf"= tt\.load .*: tensor<32x512x!tt\.ptr<{fp8}>", ttgir)
    # the conversions: an op taking the 8-bit tile (bytes to the asm, fp8 to a cast) and giving bf16 (or fp16: [Note]
    # fp16 dots), in a layout
    converted = re.findall(r"tensor<32x512x(?:i8|f8E\w+), ([^\n]*?)> -> tensor<32x512xb?f16, [^\n]*?> loc", ttgir)
    assert len(streamed) >= 2 and not waited, (len(streamed), len(waited))
    assert len(converted) == 2 and not any("dot_op" in layout for layout in converted), converted


@pytest.mark.parametrize("split", ["joint", "split"])
def test_latent_scores_split_over_the_warpgroups_on_sm90(split, tmp_path):
    """[Note] Split scores: at Hq 128, Sq 2 on sm_90 (64-row tiles, two warpgroups) with SPLIT_SCORES every wgmma
    layout has warps [4, 2], so each warpgroup computes half of a key block's scores (32-key blocks: wgmma n16),
    none [8, 1]; and in the loops that read keys the softmax stays in the scores' layout: each of their score `if`s
    gives one fp32 tile, and P reaches P @ V as a bf16 tile through shared memory, once a loop. Without it (joint)
    the score dots take warps [8, 1]: both warpgroups compute all 64 x 32 scores."""
    import re
    spec = dict(head_dim=576, head_dim_v=512, shared_kv=True, kind="decode", gqa=128, dtype="bf16", mask="causal",
                layout="paged", block_m=64, block_n=32, num_warps=8, num_stages=3)
    ttgir = _ttgir(tmp_path, spec, dict(ROWS=64, GQA=128), split=split == "split")
    mmas = re.findall(r"#ttg\.nvidia_mma<\{versionMajor = 3, [^}]*warpsPerCTA = \[(\d+), (\d+)\], "
                      r"instrShape = \[16, (\d+), 16\]", ttgir)
    if split == "joint":
        assert any((a, b) == ("8", "1") for a, b, _ in mmas), mmas
        return
    assert mmas and all((a, b) == ("4", "2") for a, b, _ in mmas), mmas
    assert ("4", "2", "16") in mmas, mmas
    loops = ttgir.split("scf.for")[1:]
    work = [body for body in loops if "async_copy_global_to_local" in body or "warp_group_dot" in body]
    ifs = [re.findall(r"= scf\.if [^\n]*-> \(([^\n]*?)\) \{", body) for body in work[-2:]]
    assert len(work) >= 2 and all(len(found) == 2 and all(r.count("tensor<") == 1 for r in found)
                                  for found in ifs), ifs
    handed = [re.findall(r"local_alloc %\S+ : \(tensor<64x32xbf16", body) for body in work[-2:]]
    assert all(len(h) == 1 for h in handed), handed
