"""A paged fp8 KV cache with its own V ([Note] Paged prefetch (fp8, own V) in the decode template): each key step
loads the next step's page numbers and carries them. The result must be the float64 reference's on the dequantized
cache at the query dtype's tolerance, with pages smaller than, equal to and larger than the key block (4, 16, 64
keys against 16-key blocks), lengths that are multiples of neither, table entries past each sequence's pages that
point outside the cache, NaN in every page no sequence owns, through the split rule (one key block a split under
the interpreter) and one split (the carried page numbers across every block); and the prefetch must not change a
bit against the page numbers loaded in the step that uses them (PAGE_PREFETCH off). The row offsets in 32 bits
([Note] Paged rows in 32 bits, PAGED_ROWS32 1 and 2, tenth session) must not change a bit either."""

import re

import pytest
import torch

import fagen
from _env import DEVICE, ON_GPU
from fagen.runtime.loader import load_source
from fagen.verify import reference
from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
HD, HKV, G = (128, 8, 4) if ON_GPU else (32, 2, 4)
LENS = (70, 23, 1, 129)  # 16-key blocks: none a multiple of a block or of a page of 4, 16 or 64
PREFETCH = ("PAGE_PREFETCH = tl.constexpr(True)", "PAGE_PREFETCH = tl.constexpr(False)")


def _module(kv: str, prefetch: bool, rows32: int | None = None):
    """The paged fp8 decode module, with the page numbers loaded in the step (prefetch False) and PAGED_ROWS32 set to
    rows32 (None: as rendered)."""
    spec = fagen.KernelSpec(head_dim=HD, gqa=G, kind="decode", layout="paged", dtype="bf16", kv_dtype=kv,
                            **({} if ON_GPU else dict(block_n=16)))
    source = fagen.generate(spec)
    assert PREFETCH[0] in source, "the paged fp8 decode render has no PAGE_PREFETCH switch"
    if not prefetch:
        source = source.replace(*PREFETCH)
    if rows32 is not None:
        source, n = re.subn(r"^PAGED_ROWS32 = \d+$", f"PAGED_ROWS32 = {rows32}", source, flags=re.M)
        assert n == 1, "the paged fp8 decode render has no PAGED_ROWS32 switch"
    return load_source(source, f"{spec.name}_prefetch{int(prefetch)}_rows{rows32}")


def _problem(kv: str, page: int, form: str, seed: int):
    """q, the paged caches, the call's keywords and each sequence's float64 dequantized (k, v) [1, Hkv, n, D]."""
    gen = torch.Generator().manual_seed(seed)
    b = len(LENS)
    width = -(-max(LENS) // page) + 1  # one column past the longest sequence's pages
    n_pages = b * width + 2
    q = torch.randn(b, HKV * G, 1, HD, generator=gen).mul(2).bfloat16()
    kc, vc = (torch.randn(n_pages, page, HKV, HD, generator=gen).to(FP8[kv]) for _ in range(2))
    table = torch.randperm(n_pages, generator=gen)[:b * width].to(torch.int32).view(b, width)
    owned = torch.zeros(n_pages, dtype=torch.bool)
    for i, n in enumerate(LENS):
        used = -(-n // page)
        owned[table[i, :used].long()] = True
        table[i, used:] = torch.tensor([10**6, -3, n_pages] * width, dtype=torch.int32)[:width - used]
    for c in (kc, vc):  # NaN in the pages no sequence owns (e4m3fn and e5m2: 0x7f)
        c.view(torch.uint8)[~owned] = 0x7F

    def draw(shape):
        return torch.exp2(torch.rand(shape, generator=gen) * 6 - 3)  # log-uniform 1/8 .. 8

    ks, vs = {"tensor": (0.7, 1.6), "head": (draw((HKV,)), draw((HKV,))),
              "token": (draw(kc.shape[:-1]), draw(vc.shape[:-1]))}[form]
    kw = dict(block_table=table, seqlens_k=torch.tensor(LENS, dtype=torch.int32), k_scale=ks, v_scale=vs)
    kd, vd = reference.dequantize(kc, ks, head_dim_axis=2), reference.dequantize(vc, vs, head_dim_axis=2)
    seqs = []
    for i, n in enumerate(LENS):
        rows = table[i, :-(-n // page)].long()
        seqs.append(tuple(x[rows].reshape(-1, HKV, HD)[:n].transpose(0, 1)[None] for x in (kd, vd)))
    to = lambda t: t.to(DEVICE) if isinstance(t, torch.Tensor) else t  # noqa: E731
    return q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), {k: to(v) for k, v in kw.items()}, seqs


def _check(out, lse, q, seqs):
    for i, (k, v) in enumerate(seqs):
        want, wlse = reference.attention(q[i:i + 1].double().cpu(), k, v)
        terms, _ = reference.attention(q[i:i + 1].double().cpu(), k, v.abs())  # the softmax-weighted |v|
        unit = terms.clamp(min=1.0)
        compare(f"out {i}", out[i:i + 1].double().cpu() / unit, want / unit, **TOLERANCE["bf16"])
        compare(f"lse {i}", lse[i:i + 1].cpu(), wlse, **LSE_TOLERANCE)


@pytest.mark.parametrize("kv,page,form", [("fp8_e4m3", 4, "head"), ("fp8_e4m3", 16, "token"),
                                          ("fp8_e5m2", 64, "tensor"), ("fp8_e4m3", 64, "head")])
def test_paged_fp8_decode_matches_the_dequantized_reference(kv, page, form):
    """Through the split rule and through one split, against float64 on the dequantized cache."""
    m = _module(kv, prefetch=True)
    q, kc, vc, kw, seqs = _problem(kv, page, form, seed=page)
    for out, lse in (m.forward(q, kc, vc, **kw), m.forward_split(q, kc, vc, num_splits=1, **kw)):
        _check(out, lse, q, seqs)


@pytest.mark.parametrize("page", [4, 64])
def test_page_prefetch_does_not_change_a_bit(page):
    """The page numbers loaded a step ahead address the same rows: the same bits as loading them in the step."""
    q, kc, vc, kw, _ = _problem("fp8_e4m3", page, "head", seed=3)
    on, off = _module("fp8_e4m3", True), _module("fp8_e4m3", False)
    for call in ("forward", "forward_split"):
        extra = dict(num_splits=1) if call == "forward_split" else {}
        a, b = getattr(on, call)(q, kc, vc, **kw, **extra), getattr(off, call)(q, kc, vc, **kw, **extra)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), call


@pytest.mark.parametrize("rows32,page,form", [(1, 4, "head"), (1, 64, "token"), (2, 16, "tensor"), (2, 64, "head")])
def test_paged_rows_in_32_bits_do_not_change_a_bit(rows32, page, form):
    """[Note] Paged rows in 32 bits: the slot part of a row's offset computed once (blocks start at multiples of
    BLOCK_N; pages of 4 and 64 keys against 16-key blocks: the block's slot offset is 0, then a multiple of 16) and
    the products in int32 (1) or u32 x u32 -> u64 (2) address the same rows as the int64 path: the same bits, per-token
    scales (which read the same page and slot) included, through the split rule and one split."""
    q, kc, vc, kw, _ = _problem("fp8_e4m3", page, form, seed=5)
    base, cand = _module("fp8_e4m3", True, 0), _module("fp8_e4m3", True, rows32)
    for call in ("forward", "forward_split"):
        extra = dict(num_splits=1) if call == "forward_split" else {}
        a, b = getattr(base, call)(q, kc, vc, **kw, **extra), getattr(cand, call)(q, kc, vc, **kw, **extra)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), call


def test_paged_rows_in_32_bits_only_where_every_row_fits():
    """[Note] Paged rows in 32 bits: the launch passes PAGED_ROWS32 only while (pages - 1) * stride(0) + (page_size -
    1) * stride(1) of k and of v stays below 2^31 (caches on the meta device: shapes and strides, no memory), and 0
    (int64 offsets) with the switch off."""
    m = _module("fp8_e4m3", True, 1)

    def meta(pages, pad=0):  # the launch's kernel view [pages, kv heads, slots, D] of a vLLM cache (pages padded)
        return torch.empty(pages, 16 * 8 * 128 + pad, dtype=torch.float8_e4m3fn, device="meta")[:, :16 * 8 * 128] \
            .view(pages, 16, 8, 128).permute(0, 2, 1, 3)

    fits, too_big = meta(2**17), meta(2**17 + 1)  # last row offsets 2^31 - 1024 and 2^31 + 15360
    # k and v of the same strides: 3 where the render takes [Note] Paged same rows (e4m3 d128), else 1
    assert m._rows32(fits, fits) == (3 if m.PAGED_SAME_ROWS else 1)
    assert m._rows32(too_big, fits) == 0 and m._rows32(fits, too_big) == 0
    assert _module("fp8_e4m3", True, 0)._rows32(fits, fits) == 0
    # pages padded by 16 bytes: the last page's slot 0 at 2^31 - 2048, its slot 15 at 2^31 + 13312 (the heads' dim
    # said 2^31 - 1152: 32 bits, and the row wrapped)
    padded = meta(130945, 16)
    assert padded.stride() == (16400, 128, 1024, 1) and m._rows32(padded, fits) == 0 and m._rows32(fits, padded) == 0
    assert m._rows32(meta(130944, 16), fits) == 1  # its last slot's offset 2^31 - 3088 (strides differ: not 3)
    assert _module("fp8_e4m3", True).PAGED_ROWS32 == 1  # the default (tenth session, round A)


def test_serving_bench_paged_row_reads_the_dense_rows_keys():
    """The serving bench's paged fp8 row (decode-d128-kv8k-b32-fp8-paged16): a paged spec, the bytes of the dense fp8
    row; and its inputs (make_inputs' pages in a random order, the block table that reads them back) give fagen's
    paged kernel the reference's keys: the bench's own check, whose float64 slices gather their keys back from the
    pages (the set keeps no dense copy), passes on a small case of the same form. The set holds the pages once at a
    byte an element, so the row rotates 3 input sets under the bench's budget, as the dense row does."""
    from fagen.bench.cases import SET_BUDGET, CaseContext
    from fagen.bench.inputs import set_bytes
    from fagen.bench.check import check
    from fagen.bench.impls import prepare_fagen
    from fagen.bench.serving import serving_rows
    from fagen.bench.workloads import kv_bytes, make_case

    rows = {c.name: c for c in serving_rows()}
    paged, dense = rows["decode-d128-kv8k-b32-fp8-paged16"], rows["decode-d128-kv8k-b32-fp8"]
    assert paged.spec("cpu")[0].layout == "paged" and kv_bytes(paged) == kv_bytes(dense)
    assert SET_BUDGET // set_bytes(paged) >= 3 and set_bytes(paged) == set_bytes(dense)  # 3 sets (was 1)
    case = make_case("paged-small", head_dim=HD, mask="none", batch=2, heads_q=HKV * G, heads_kv=HKV, seq_q=1,
                     seq_k=256 if not ON_GPU else 8192, kv_dtype="fp8_e4m3", page_size=16, peers=False)
    cc = CaseContext(case, torch.device(DEVICE), 1)
    s = cc.sets[0]
    assert s.paged["k_cache"].shape == (2 * case.seq_k // 16, 16, HKV, HD) and s.k is None and s.v is None
    assert not torch.equal(s.paged["block_table"].flatten().cpu(), torch.arange(2 * case.seq_k // 16))  # shuffled
    status, message, _ = check("fagen", prepare_fagen(case, cc), cc)
    assert status == "ok", message
