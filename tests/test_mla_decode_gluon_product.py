"""The Gluon MLA absorbed decode in the product (fagen/templates/gluon/mla_decode.py.j2, [Note] Gluon MLA decode in
fagen/backends/gluon.py): its spec limits, the use-time rule (fagen/runtime/hopper.py: latent_decode_spec, and the
module's fits), the sm_90 builds (ptxas: shared memory, no spills, asynchronous wgmma), the split rule and the
merge (plain Triton, interpreted here) against float64; on an H100/H200, the kernel against float64."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fagen
from fagen import backends
from fagen.runtime import hopper
from fagen.spec.kernel import KernelSpec, SpecError

from _env import ON_GPU
from test_hopper_compile import build_sm90
from test_mla_decode_gluon import MERGE_CASE, MERGE_SAVE, merge_matches_float64

ROOT = Path(__file__).resolve().parent.parent
D, DV = 576, 512


def spec(backend="gluon", **kw):
    fields = dict(head_dim=D, head_dim_v=DV, shared_kv=True, kind="decode", gqa=128, dtype="bf16", mask="causal",
                  layout="paged", backend=backend)
    return KernelSpec(**{**fields, **kw})


@pytest.mark.parametrize("fields, field", [
    (dict(head_dim=128, head_dim_v=None, shared_kv=False), "backend"),
    (dict(mask="tree"), "mask"),
    (dict(kv_dtype="fp8_e5m2"), "kv_dtype"),  # e4m3: the gluon fp8 latent decode (test_mla_decode_fp8_gluon.py)
    (dict(softcap=True), "softcap"),
    (dict(block_n=128), "block_n"),
    (dict(kind="prefill", shared_kv=False, head_dim=128, head_dim_v=None), "layout"),
])
def test_the_gluon_decode_refuses_what_it_lacks_naming_the_field(fields, field):
    with pytest.raises(SpecError) as e:
        spec(**fields)
    assert e.value.field == field and ("triton" in str(e.value) or "leave it unset" in str(e.value))


def test_the_rule_picks_bf16_causal_or_none_only():
    assert backends.GLUON.decode_selected(spec()) and backends.GLUON.decode_selected(spec(mask="none"))
    assert backends.GLUON.decode_selected(spec(layout="dense"))
    assert not backends.GLUON.decode_selected(spec(dtype="fp16"))  # not measured
    # an e4m3 latent: the gluon fp8 decode, where select_fp8_latent (test_mla_decode_fp8_gluon.py)
    assert backends.GLUON.decode_selected(spec("triton", kv_dtype="fp8_e4m3")) is backends.GLUON.select_fp8_latent
    assert not backends.GLUON.decode_selected(spec("triton", kv_dtype="fp8_e5m2"))  # kvfp8's Triton path
    assert not backends.GLUON.decode_selected(spec("triton", softcap=True))


def test_latent_decode_spec_needs_sm90_the_api_and_the_switch(monkeypatch):
    triton_spec = spec("triton")
    cuda = torch.device("cuda", 0)
    assert hopper.latent_decode_spec(triton_spec, torch.device("cpu")) is None
    monkeypatch.setattr(hopper, "is_hopper", lambda device: True)
    monkeypatch.setattr(hopper, "gluon_missing", lambda: None)
    twin = hopper.latent_decode_spec(triton_spec, cuda)
    assert twin == spec() and twin.layout is triton_spec.layout
    assert hopper.latent_decode_spec(spec("triton", layout="dense"), cuda) == spec(layout="dense")
    assert hopper.latent_decode_spec(spec("triton", kv_dtype="fp8_e4m3"), cuda, 200) is None  # > LATENT_FP8_MAX_ROWS
    seesaw = spec(kv_dtype="fp8_e4m3") if backends.GLUON.variant["fp8lat_seesaw"] else None  # 64-row multiples
    assert hopper.latent_decode_spec(spec("triton", kv_dtype="fp8_e4m3"), cuda, 256) == seesaw
    assert hopper.latent_decode_spec(triton_spec, cuda, 128) == spec()
    monkeypatch.setattr(hopper, "LATENT_PAD_SELECTED", False)
    assert hopper.latent_decode_spec(triton_spec, cuda, 16) is None  # [Note] Latent padded tiles
    monkeypatch.setattr(hopper, "LATENT_PAD_SELECTED", True)
    assert hopper.latent_decode_spec(triton_spec, cuda, 16) == spec()
    monkeypatch.setattr(hopper, "LATENT_PAD_SELECTED", False)
    monkeypatch.setenv(hopper.ENV, "0")
    assert hopper.latent_decode_spec(triton_spec, cuda) is None
    monkeypatch.delenv(hopper.ENV)
    monkeypatch.setattr(hopper, "gluon_missing", lambda: "triton 3.9")
    assert hopper.latent_decode_spec(triton_spec, cuda) is None


@pytest.mark.parametrize("hq, sq, hkv, page, ok", [
    (128, 2, 1, 64, True), (64, 1, 1, 128, True), (32, 2, 1, 64, True), (16, 1, 1, 64, True), (16, 3, 1, 64, True),
    (16, 5, 1, 64, False), (8, 1, 1, 64, False), (128, 3, 1, 64, True), (96, 1, 1, 64, False),
    (128, 2, 2, 64, False), (128, 2, 1, 32, False)])
def test_fits_takes_rows_in_tiles_of_64_one_head_and_pages_of_64(hq, sq, hkv, page, ok):
    """Tiles of 64 rows, or one padded tile of 16, 32 or 48 ([Note] Padded row tiles)."""
    mod = fagen.load(spec(gqa=hq // hkv))
    q = torch.empty(1, hq, sq, D, dtype=torch.bfloat16)
    k = torch.empty(2, page, hkv, D, dtype=torch.bfloat16)
    why = mod.fits(q, k)
    assert (why is None) == ok, why


@pytest.mark.skipif(ON_GPU, reason="CPU tensors with sm_90 faked: its Triton path needs the interpreter")
def test_fagen_attention_takes_the_gluon_decode_where_it_fits(monkeypatch):
    """With sm_90 faked, fagen.attention(q, k, None) reaches the gluon module (whose device check then refuses CPU
    tensors: the proof it was picked) where Hq x Sq is a multiple of 64 from LATENT_MIN_WORK pairs, and the Triton
    decode elsewhere."""
    monkeypatch.setattr(hopper, "is_hopper", lambda device: True)
    monkeypatch.setattr(hopper, "gluon_missing", lambda: None)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 1, 40, D, generator=gen).bfloat16()
    q64 = torch.randn(1, 64, 1, D, generator=gen).bfloat16()
    with torch.no_grad():  # below LATENT_MIN_WORK pairs the Triton decode (interpreted) serves: it runs here
        assert torch.isfinite(fagen.attention(q64, k, None, head_dim_v=DV, mask="causal")).all()
    monkeypatch.setattr(hopper, "LATENT_MIN_WORK", 1)
    with torch.no_grad(), pytest.raises(ValueError, match="this Gluon kernel .* runs on a CUDA device"):
        fagen.attention(q64, k, None, head_dim_v=DV, mask="causal")
    q16 = torch.randn(1, 16, 1, D, generator=gen).bfloat16()  # a padded tile: only if selected ([Note] Latent padded
    monkeypatch.setattr(hopper, "LATENT_PAD_SELECTED", False)  # tiles)
    with torch.no_grad():
        assert torch.isfinite(fagen.attention(q16, k, None, head_dim_v=DV, mask="causal")).all()
    monkeypatch.setattr(hopper, "LATENT_PAD_SELECTED", True)
    with torch.no_grad(), pytest.raises(ValueError, match="this Gluon kernel .* runs on a CUDA device"):
        fagen.attention(q16, k, None, head_dim_v=DV, mask="causal")
    q = torch.randn(1, 2, 1, D, generator=gen).bfloat16()  # 2 rows: the Triton decode (interpreted) serves
    with torch.no_grad():
        out = fagen.attention(q, k, None, head_dim_v=DV, mask="causal")
    assert out.shape == (1, 2, 1, DV) and torch.isfinite(out).all()


@pytest.mark.skipif(ON_GPU, reason="CPU tensors with sm_90 faked: its Triton path needs the interpreter")
def test_batch_invariant_calls_pick_the_kernel_without_the_batch(monkeypatch):
    """[Note] Latent decode and batch invariance: with batch_invariant=True fagen.attention takes the gluon decode
    wherever it fits, below LATENT_MIN_WORK pairs too (the size floor weighs the batch: a sequence alone and in a
    large batch would run different kernels); without it, the floor keeps the Triton decode there."""
    monkeypatch.setattr(hopper, "is_hopper", lambda device: True)
    monkeypatch.setattr(hopper, "gluon_missing", lambda: None)
    monkeypatch.setattr(hopper, "LATENT_PAD_SELECTED", True)
    monkeypatch.setattr(hopper, "LATENT_CAPTURED_MIN_WORK", None)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(1, 1, 40, D, generator=gen).bfloat16()
    for hq in (16, 64):
        q = torch.randn(1, hq, 1, D, generator=gen).bfloat16()
        with torch.no_grad():
            assert torch.isfinite(fagen.attention(q, k, None, head_dim_v=DV, batch_invariant=False)).all()
        with torch.no_grad(), pytest.raises(ValueError, match="this Gluon kernel .* runs on a CUDA device"):
            fagen.attention(q, k, None, head_dim_v=DV, batch_invariant=True)


def test_the_swap_ab_tile_sizes_invariant_chunks_from_the_length_only():
    """[Note] Swap-AB invariant chunks: the grid follows the span, the smallest chunk never the batch; the split
    rule takes whole blocks."""
    mod = fagen.load(spec(gqa=16))
    lo, most = mod.SAB_INVARIANT
    for b in (1, 7, 32, 128):
        for span in (77, 4096, 32768):
            per, splits = mod.splits_for(b, 16, span, invariant=True, sms=132, swap_ab=True)
            assert per == -(-lo // 64) and splits == max(1, min(most, -(-(-(-span // 64)) // per)))
    per, splits = mod.splits_for(32, 16, 4096, sms=132, swap_ab=True)
    assert splits == 4 and per * splits >= 64


def test_the_split_rule_follows_the_batch_only_without_batch_invariance():
    mod = fagen.load(spec())
    assert mod.splits_for(32, 256, 8192, sms=132) == (128, 1)  # 128 programs fill 132 SMs: one split
    assert mod.splits_for(1, 256, 8192, sms=132)[1] > 1
    inv = {mod.splits_for(b, 256, 8192, invariant=True, sms=132)[0] for b in (1, 7, 32, 128)}
    assert inv == {mod.INVARIANT_CHUNK // 64}  # the chunk never follows the batch
    for b in (1, 5, 64):
        per, splits = mod.splits_for(b, 128, 1000, sms=132)
        assert per % 2 == 0 and (splits - 1) * per < 16 <= splits * per  # whole pairs that cover the 16 blocks


def test_the_kernel_clamps_page_indexes_and_lengths():
    """[Note] Gluon decode memory safety, as rendered: a page index is clamped to the cache and a length to the
    block table's capacity before either picks a row (the GPU test feeds bad values)."""
    from fagen.codegen.render import render

    src = render(spec()).source
    assert "page = gl.minimum(gl.maximum(page, 0), num_pages - 1)" in src
    assert "seq_len = gl.minimum(gl.maximum(gl.load(Seqlens + b), 0), bt_width * PAGE)" in src
    # [Note] Padded row tiles: a tile's rows past ROWS (the next sequence's q) are never stored
    assert src.count("mask=oreal)") == 2 and src.count("mask=real)") == 2
    # [Note] Swap-AB tile: its TMA rows come from the same clamped _kv_row, its tail is zeroed before P V
    sab = src[src.index("def _mla_decode_sab("):src.index("def _merge(")]
    assert "_sab_issue(" in sab and "_sab_zero_tail(kc_s, st, seq_len - start)" in sab
    assert "row = _kv_row(BlockTable, bt_row, start, num_pages, b, kv_b, PAGE, PAGED)" in src


_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import fagen
from sm90 import loops, ptxas

out = {}
for key, (layout, kw) in json.loads(sys.argv[2]).items():
    gqa = kw.pop("gqa", 128)
    mod = fagen.load(fagen.KernelSpec(head_dim=576, head_dim_v=512, shared_kv=True, kind="decode", gqa=gqa,
                                      dtype="bf16", mask="causal", layout=layout, backend="gluon"))
    ck = mod.compile_for(**kw)
    ptx = ck.asm["ptx"]
    res, log, _ = ptxas(ptx)
    res = next(iter(res.values()))
    out[key] = dict(shared=ck.metadata.shared, spills=res.spill_stores + res.spill_loads, stack=res.stack,
                    serialized="C7514" in log,
                    setmaxnreg=sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
                    wgmma=[s.count("wgmma.mma_async") for s in loops(ptx, 30, innermost=True)])
print("RESULT " + json.dumps(out))
"""
BUILDS = {"paged_sq2": ("paged", dict(seq_q=2)), "paged_sq2_split": ("paged", dict(seq_q=2, num_splits=2)),
          "paged_sq1": ("paged", dict(seq_q=1)), "dense_sq2": ("dense", dict(seq_q=2)),
          "paged_h16_sq1": ("paged", dict(seq_q=1, gqa=16)), "paged_h16_sq1_split": ("paged", dict(seq_q=1, gqa=16,
                                                                                                 num_splits=3)),
          "sab_paged_h16_sq1": ("paged", dict(seq_q=1, gqa=16, swap_ab=True)),
          "sab_dense_h16_sq1_inv": ("dense", dict(seq_q=1, gqa=16, swap_ab=True, invariant=True)),
          "sab_paged_h8_sq2_split": ("paged", dict(seq_q=2, gqa=8, swap_ab=True, num_splits=3))}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, BUILDS, "gluon-mla-decode-product")


@pytest.mark.parametrize("key", list(BUILDS))
def test_builds_within_shared_memory_without_spills(built, key):
    """The spec's formula bounds the build, no spill, the wgmma asynchronous (no C7514), each warpgroup's pair loop
    44 wgmma ([Note] Seesaw pair: S of its 64-key block, 36 k-steps, and two P V of 4), the register split."""
    r = built[key]
    assert r["shared"] <= backends.smem_bytes(spec()) <= 232448, r
    assert r["spills"] == 0 and r["stack"] == 0 and not r["serialized"], r
    if key.startswith("sab"):  # [Note] Swap-AB tile: one warpgroup, a block's 36 + 32 wgmma, no setmaxnreg
        assert r["wgmma"] == [68] and r["shared"] <= 170 * 1024, r
        return
    assert r["wgmma"] == [44, 44], r
    regs = 240 if "sq1" in key else 232
    assert {regs, 24} <= set(r["setmaxnreg"]), r


_MERGE = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
import fagen

mod = fagen.load(fagen.KernelSpec(head_dim=576, head_dim_v=512, shared_kv=True, kind="decode", gqa=128,
                                  dtype="bf16", mask="causal", layout="paged", backend="gluon"))
b, ns, rows, dv = 2, 3, 32, 512
""" + MERGE_CASE + """
mod._merge[(rows // 16, b)](part_o, part_lse, out, lse, ROWS=rows, NUM_SPLITS=ns, BLOCK_R=16, DV_=dv)
cols = int(sys.argv[3])
if cols:  # [Note] Merge column slices: the same bits in slices of `cols` columns
    whole, whole_lse = out.clone(), lse.clone()
    out.fill_(7.0)
    lse.fill_(7.0)
    mod._merge[(rows // 16, b, dv // cols)](part_o, part_lse, out, lse, ROWS=rows, NUM_SPLITS=ns, BLOCK_R=16, DV_=dv,
                                            COLS=cols)
    assert torch.equal(out, whole) and torch.equal(lse, whole_lse)
""" + MERGE_SAVE


@pytest.mark.parametrize("cols", [0, 128])
def test_merge_is_the_log_sum_exp_rule(tmp_path, cols):
    """Splits' partial rows (log2 lse; one split empty: lse -inf, out 0; one row empty in every split) against
    float64: the product module's Triton merge, interpreted in a child process (the module imports Gluon); cols:
    the merge in column slices gives the whole merge's bits ([Note] Merge column slices)."""
    path = tmp_path / "merge.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "FAGEN_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", _MERGE, str(ROOT), str(path), str(cols)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merge_matches_float64(torch.load(path))


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and hopper.gluon_missing() is None


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU and triton's Gluon Hopper API")
@pytest.mark.parametrize("sq, invariant, splits, hq, sab", [
    (2, False, None, 128, 0), (2, False, 1, 128, 0), (2, True, None, 128, 0), (1, False, 3, 128, 0),
    (1, False, None, 16, 0), (1, True, None, 16, 0), (3, False, 1, 16, 0), (1, False, None, 16, 16),
    (1, True, None, 16, 16), (1, False, 1, 16, 16), (2, False, 3, 8, 16)])
def test_gpu_against_float64(sq, invariant, splits, hq, sab, monkeypatch):
    """Ragged lengths (odd, one empty, NaN past each end in shuffled pages) against float64; bad page indexes and
    lengths change only their own sequences. Hq 16: one padded tile ([Note] Padded row tiles); sab 16: the swap-AB
    tile ([Note] Swap-AB tile)."""
    from fagen.verify import reference
    lens, page = [1000, 77, 0, 513, 64], 64
    gen = torch.Generator().manual_seed(sq)
    width = -(-max(lens) // page)
    pages = len(lens) * width + 3
    q = torch.randn(len(lens), hq, sq, D, generator=gen).bfloat16().cuda()
    cache = torch.randn(pages, page, 1, D, generator=gen).bfloat16()
    table = torch.randperm(pages, generator=gen)[:len(lens) * width].int().view(len(lens), width)
    for i, n in enumerate(lens):
        for p in range(width):
            if n - p * page < page:
                cache[table[i, p], max(0, n - p * page):] = float("nan")
    cache, table, seqlens = cache.cuda(), table.cuda(), torch.tensor(lens, dtype=torch.int32).cuda()
    mod = fagen.load(spec(gqa=hq))
    monkeypatch.setattr(mod, "SWAP_AB_ROWS", sab)
    kw = dict(block_table=table, seqlens_k=seqlens, scale=0.07)
    out, lse = (mod.forward_split(q, cache, None, num_splits=splits, **kw) if splits
                else mod.forward(q, cache, None, batch_invariant=invariant, **kw))
    for i, n in enumerate(lens):
        if n == 0:
            assert (out[i] == 0).all() and torch.isneginf(lse[i]).all()
            continue
        k = cache[table[i].long()].double().reshape(-1, 1, D)[:n].transpose(0, 1)[None]
        want, want_lse = reference.attention(q[i:i + 1].double(), k, None, head_dim_v=DV, mask="causal", scale=0.07)
        torch.testing.assert_close(out[i:i + 1].double(), want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse[i:i + 1].double(), want_lse, atol=1e-3, rtol=1e-3)
    bad_t, bad_l = table.clone(), seqlens.clone()
    bad_t[1, 0], bad_t[3] = -7, 10 ** 9
    bad_l[2], bad_l[4] = 10 ** 6, -5
    out2, lse2 = mod.forward(q, cache, None, block_table=bad_t, seqlens_k=bad_l, scale=0.07,
                             batch_invariant=invariant)
    torch.cuda.synchronize()
    base = mod.forward(q, cache, None, batch_invariant=invariant, **kw)
    assert torch.equal(out2[0], base[0][0]) and (out2[4] == 0).all()
