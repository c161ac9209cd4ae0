"""The Gluon fp8 latent decode in the product (fagen/templates/gluon/mla_decode_fp8.py.j2, [Note] Gluon fp8 latent
decode in fagen/backends/gluon_decode.py; issue 27 part 2): the spec and its template, the selection rule
(select_fp8_latent, hopper.LATENT_FP8_MAX_ROWS, the bench's spec), the host checks of the scale forms, the split
rules, the memory-safety clamps as rendered, the sm_90 builds (ptxas: no spill, two programs an SM, asynchronous
wgmma) and the merge (plain Triton, interpreted) against float64; on an H100/H200, the kernel against float64."""

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
    fields = dict(head_dim=D, head_dim_v=DV, shared_kv=True, kind="decode", gqa=16, dtype="bf16", mask="causal",
                  layout="paged", backend=backend, kv_dtype="fp8_e4m3")
    return KernelSpec(**{**fields, **kw})


def test_an_e4m3_latent_spec_renders_the_fp8_template_and_e5m2_is_refused():
    from fagen.codegen.render import render, template_name

    assert template_name(spec()) == "gluon/mla_decode_fp8.py.j2"
    assert template_name(spec(kv_dtype=None)) == "gluon/mla_decode.py.j2"
    src = render(spec()).source
    assert "def _mla_decode_fp8(" in src and "cvt.rn.f16x2.e4m3x2" in src
    with pytest.raises(SpecError) as e:
        spec(kv_dtype="fp8_e5m2")
    assert e.value.field == "kv_dtype" and "triton" in str(e.value)


def test_the_selection_follows_the_switch_and_is_bounded_by_rows(monkeypatch):
    """select_fp8_latent (on since H100 round A) off: the Triton decode keeps fp8 latent caches; on: the gluon fp8
    twin up to LATENT_FP8_MAX_ROWS rows (programs of 16 rows: Hq 16 Sq 1), none with FAGEN_HOPPER=0 or off sm_90."""
    assert backends.GLUON.select_fp8_latent
    cuda = torch.device("cuda", 0)
    triton_spec = spec("triton")
    monkeypatch.setattr(hopper, "is_hopper", lambda device: True)
    monkeypatch.setattr(hopper, "gluon_missing", lambda: None)
    monkeypatch.setattr(backends.GLUON, "select_fp8_latent", False)
    assert hopper.latent_decode_spec(triton_spec, cuda, 16) is None
    monkeypatch.setattr(backends.GLUON, "select_fp8_latent", True)
    twin = hopper.latent_decode_spec(triton_spec, cuda, 16)
    assert twin == spec() and twin.kv_dtype is triton_spec.kv_dtype
    assert hopper.latent_decode_spec(spec("triton", layout="dense"), cuda, 16) == spec(layout="dense")
    assert hopper.latent_decode_spec(triton_spec, cuda, hopper.LATENT_FP8_MAX_ROWS + 16) is None
    assert hopper.latent_decode_spec(spec("triton", kv_dtype="fp8_e5m2"), cuda, 16) is None
    assert hopper.latent_decode_spec(spec("triton", dtype="fp16"), cuda, 16) is None  # not measured
    assert hopper.latent_decode_spec(spec("triton", kv_dtype=None), cuda, 16) is not None  # bf16: its own rule
    monkeypatch.setenv(hopper.ENV, "0")
    assert hopper.latent_decode_spec(triton_spec, cuda, 16) is None
    monkeypatch.delenv(hopper.ENV)
    monkeypatch.setattr(hopper, "is_hopper", lambda device: False)
    assert hopper.latent_decode_spec(triton_spec, cuda, 16) is None


def test_the_bench_rows_take_what_the_selection_says(monkeypatch):
    """The serving bench's fp8 latent rows (BenchCase.spec): the gluon fp8 decode where selected, else Triton."""
    from fagen.bench.serving import serving_rows

    monkeypatch.setattr(hopper, "is_hopper", lambda device: True)
    monkeypatch.setattr(hopper, "gluon_missing", lambda: None)
    cases = {c.name: c for c in serving_rows()}
    row = cases["decode-mla-absorbed-h16-kv4k-b128-fp8"]
    h128 = cases["decode-mla-absorbed-h128-sq2-kv8k-b32-fp8"]
    monkeypatch.setattr(backends.GLUON, "select_fp8_latent", True)
    got, note = row.spec("cuda")
    assert got.backend.value == "gluon" and got.kv_dtype is not None and "gluon" in note
    seesaw = "gluon" if backends.GLUON.variant["fp8lat_seesaw"] else "triton"  # 256 rows: 64-row multiples
    assert h128.spec("cuda")[0].backend.value == seesaw
    monkeypatch.setattr(backends.GLUON, "select_fp8_latent", False)
    assert row.spec("cuda")[0].backend.value == "triton"


def _cpu_inputs(layout="paged", b=2):
    q = torch.randn(b, 16, 1, D).bfloat16()
    if layout == "paged":
        k = torch.randn(8, 64, 1, D).to(torch.float8_e4m3fn)
        return q, k, dict(block_table=torch.zeros(b, 4, dtype=torch.int32),
                          seqlens_k=torch.full((b, ), 5, dtype=torch.int32)), torch.ones(8, 64, 1)
    k = torch.randn(b, 1, 100, D).to(torch.float8_e4m3fn)
    return q, k, {}, torch.ones(b, 1, 100)


@pytest.mark.parametrize("layout", ["paged", "dense"])
def test_the_host_checks_take_three_scale_forms_and_name_what_is_wrong(layout):
    """A float, a float32 [1] (per KV head) and one a token pass every check (then the device check refuses CPU
    tensors: the proof the checks passed); anything else, v_scale, a bf16 cache, two KV heads are InputErrors."""
    mod = fagen.load(spec(layout=layout))
    q, k, kw, tokens = _cpu_inputs(layout)
    for ok in (0.5, None, torch.tensor([1.5]), tokens):
        with pytest.raises(ValueError, match="runs on a CUDA device"):
            mod.forward(q, k, None, k_scale=ok, **kw)
    for bad in (torch.ones(3), -1.0, float("nan"), True, tokens.double(), tokens[..., :-1]):
        with pytest.raises(ValueError, match="k_scale"):
            mod.forward(q, k, None, k_scale=bad, **kw)
    with pytest.raises(ValueError, match="v_scale"):
        mod.forward(q, k, None, k_scale=0.5, v_scale=0.5, **kw)
    with pytest.raises(ValueError, match="dtype torch.bfloat16"):
        mod.forward(q, k.bfloat16(), None, k_scale=0.5, **kw)
    with pytest.raises(ValueError, match="v: this kernel"):
        mod.forward(q, k, k, k_scale=0.5, **kw)


@pytest.mark.parametrize("hkv, page, ok", [(1, 64, True), (1, 128, True), (2, 64, False), (1, 32, False)])
def test_fits_takes_one_kv_head_and_pages_of_64(hkv, page, ok):
    mod = fagen.load(spec(gqa=16 // hkv))
    q = torch.empty(1, 16, 1, D, dtype=torch.bfloat16)
    k = torch.empty(2, page, hkv, D, dtype=torch.float8_e4m3fn)
    assert (mod.fits(q, k) is None) == ok


def test_the_split_rules():
    """The split rule fills about one wave of two programs an SM and covers the blocks; batch_invariant launches
    at most INVARIANT_SPLITS splits of at least INVARIANT_MIN_KEYS keys, whatever the batch."""
    mod = fagen.load(spec())
    assert mod.splits_for(128, 16, 4096, sms=132) == (32, 2)
    assert mod.splits_for(32, 16, 32768, sms=132) == (64, 8)
    assert mod.splits_for(32, 256, 8192, sms=132)[1] == 1  # 16 programs a sequence fill the GPU
    for b in (1, 3, 64, 500):
        per, splits = mod.splits_for(b, 16, 1000, sms=132)
        assert (splits - 1) * per < 16 <= splits * per
    inv = {mod.splits_for(b, 16, 8192, invariant=True, sms=132) for b in (1, 7, 32, 128)}
    assert inv == {(mod.INVARIANT_MIN_KEYS // 64, mod.INVARIANT_SPLITS)}
    assert mod.splits_for(4, 16, 100, invariant=True)[1] == 1


def test_the_kernel_clamps_page_indexes_and_lengths_where_they_are_used():
    """[Note] Gluon fp8 latent memory safety, as rendered: a length is clamped to the block table's capacity, a page
    index to the cache where it picks rows (loaded a step before, clamped in the step that uses it: no min/max right
    after the table's load), keys past a sequence's end masked in the byte and scale loads."""
    from fagen.codegen.render import render

    src = render(spec()).source
    assert "seq_len = gl.minimum(gl.maximum(gl.load(Seqlens + b), 0), bt_width * PAGE)" in src
    assert "pg_next = gl.minimum(gl.maximum(pg_raw, 0), num_pages - 1)" in src
    first = "gl.minimum(gl.maximum(_page_raw(BlockTable, bt_row, k_lo, n_blocks > 0, PAGE, PAGED), 0), num_pages - 1)"
    assert first in src
    assert "return gl.load(BlockTable + bt_row + start // PAGE, mask=ok_block, other=0)" in src
    assert "ok = ((start + r < seq_len) & ok_block)[:, None]" in src
    # the register loads and the staged copies ([Note] Staged chunks: their masks in the staged test)
    assert src.count("mask=ok, other=0)") + src.count("async_copy.async_copy_global_to_shared(") == 9
    assert src.count("< seq_len) & ok_n, other=0.0)") == 2  # the next block's per-token scales
    # a program's rows past Hq x Sq are never stored
    seesaw = 2 if backends.GLUON.variant["fp8lat_seesaw"] else 0  # the seesaw's own out / lse stores in the module
    assert src.count("mask=real)") == 16 + seesaw and src.count("mask=nr < ROWS)") == 2


def _render_with(**var):
    from fagen import backends
    from fagen.codegen.render import render

    keep = backends.GLUON.variant
    try:
        backends.GLUON.variant = {**keep, **var}
        render.cache_clear()
        return render(spec()).source
    finally:
        backends.GLUON.variant = keep
        render.cache_clear()


def test_short_splits_load_every_chunk_masked_with_evict_first_and_stage_nothing():
    """[Note] Short splits (variant fp8lat_short 8), as rendered: the SHORT form loads all 9 chunks by registers,
    masked as the staged form's loads (keys past the end, blocks the split does not have: not read), with
    evict_first, at the clamped rows (row0, row_n); the staged reads and copies only in the other form."""
    src = _render_with(fp8lat_stage=7, fp8lat_short=8)
    fetch = src[src.index("def _fetch_all("):src.index("def _stage(")]
    assert "ok = ((start + r < seq_len) & ok_block)[:, None]" in fetch
    assert "base = Cache + (row0 + r.to(gl.int64))[:, None] * ROW_W + c[None, :]" in fetch
    assert fetch.count('mask=ok, other=0, eviction_policy="evict_first")') == 9
    assert all(f"x{c} = gl.load(base{' + %d' % (16 * c) if c else ''}, mask=ok" in fetch for c in range(9))
    xall = "x0, x1, x2, x3, x4, x5, x6, x7, x8"
    assert f"if SHORT:  # [Note] Short splits: every chunk by registers\n        {xall} = _fetch_all(Cache, row0, " \
           "k_lo, seq_len, n_blocks > 0)\n    else:\n        _stage(" in src
    loop = src[src.index("for j in range(n_blocks):"):]
    guard = loop.index("if not SHORT:")
    assert guard < loop.index("async_copy.wait_group(0)") < loop.index("x0 = st0.load(") < loop.index(
        "_stage(Cache, st0,") < loop.index("tok, a = _chunk(x0,")
    assert f"if SHORT:  # [Note] Short splits\n            {xall} = _fetch_all(Cache, row_n, nxt, seq_len, ok_n)" in loop
    assert "SHORT=not invariant and per <= SHORT_PER," in src and "SHORT_PER = 8" in src
    assert "_fetch_all" not in _render_with(fp8lat_stage=7, fp8lat_short=0)


def test_short_splits_are_chosen_by_the_host_where_a_split_takes_at_most_short_per_blocks():
    """[Note] Short splits: the launch passes SHORT where the split rule gives at most SHORT_PER blocks a split and not
    batch_invariant (b32 kv4k at Hq 16: 8 blocks, SHORT; b128 kv4k: 32 blocks, the staged form), the kernel's grid
    and the split count unchanged (the launches recorded on CPU tensors, no kernel run)."""
    from fagen.runtime.loader import load_source
    mod = load_source(_render_with(fp8lat_stage=7, fp8lat_short=8), "fp8lat_short_host")
    seen = []

    class Rec:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append((self.name, grid, kw))

    mod._fast_mla_decode, mod._fast_merge = Rec("decode"), Rec("merge")
    for b, span, inv, short in ((32, 4096, False, True), (128, 4096, False, False), (32, 32768, False, False),
                                (32, 4096, True, False), (4, 1024, False, True)):
        seen.clear()
        q = torch.zeros(b, 16, 1, D, dtype=torch.bfloat16)
        cache = torch.zeros(b * span // 64, 64, 1, D, dtype=torch.uint8).view(torch.float8_e4m3fn)
        table = torch.zeros(b, span // 64, dtype=torch.int32)
        lens = torch.full((b, ), span, dtype=torch.int32)
        mod._launch_decode(q, cache, 0.1, (1.0, None, 0), table, lens, None, inv, None, None)
        per, splits = mod.splits_for(b, 16, span, None, inv, mod.FALLBACK_SMS)
        (name, grid, kw), = [x for x in seen if x[0] == "decode"]
        assert kw["SHORT"] is short and grid == (1, splits, b), (b, span, inv, per, kw["SHORT"])
        assert short == (per <= 8 and not inv)


def test_staged_chunks_are_masked_as_the_register_loads_and_read_after_their_wait():
    """[Note] Staged chunks (variant fp8lat_stage 7), as rendered: chunks 0..6 come by cp.async masked as the register
    loads of chunks 7 and 8 (keys past the sequence's end and blocks the split does not have: not read, zero-filled),
    at the clamped page's rows (row_n, the prologue's row0); each step waits for its copies before reading the slots,
    and issues the next block's copies only after reading them."""
    from fagen import backends
    from fagen.codegen.render import render

    keep = backends.GLUON.variant
    try:
        backends.GLUON.variant = {**keep, "fp8lat_stage": 7}
        render.cache_clear()
        src = render(spec()).source
    finally:
        backends.GLUON.variant = keep
        render.cache_clear()
    stage = src[src.index("def _stage("):src.index("async_copy.commit_group()")]
    fetch = src[src.index("def _fetch("):src.index("def _stage(")]
    ok = "ok = ((start + r < seq_len) & ok_block)[:, None]"
    base = "base = Cache + (row0 + r.to(gl.int64))[:, None] * ROW_W + c[None, :]"
    assert ok in stage and ok in fetch and base in stage and base in fetch
    assert stage.count("mask=ok)") == 7 and fetch.count("mask=ok, other=0)") == 2
    assert "_stage(Cache, st0, st1, st2, st3, st4, st5, st6, row0, k_lo, seq_len, n_blocks > 0)" in src
    loop = src[src.index("for j in range(n_blocks):"):]
    wait = loop.index("async_copy.wait_group(0)")
    reads = [loop.index(f"x{c} = st{c}.load(_frag_words())") for c in range(7)]
    nxt = loop.index("_stage(Cache, st0, st1, st2, st3, st4, st5, st6, row_n, nxt, seq_len, j + 1 < n_blocks)")
    assert wait < min(reads) and max(reads) < nxt < loop.index("tok, a = _chunk(x0,")
    assert "x7, x8 = _fetch(Cache, row_n, nxt, seq_len, ok_n)" in loop
    after = loop[loop.index("\n    o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(0, "):]
    assert after.index("async_copy.wait_group(0)") < after.index("l_i = gl.sum(l_p, 0)")  # no copy in flight after


_MERGE = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
import fagen

mod = fagen.load(fagen.KernelSpec(head_dim=576, head_dim_v=512, shared_kv=True, kind="decode", gqa=8,
                                  dtype="bf16", mask="causal", layout="paged", backend="gluon", kv_dtype="fp8_e4m3"))
b, ns, rows, dv = 2, 3, 24, 32
""" + MERGE_CASE + """
mod._merge[((rows + 15) // 16, b)](part_o, part_lse, out, lse, ROWS=rows, NUM_SPLITS=ns, BLOCK_R=16, DV_=dv,
                                   **({"COLS": dv} if getattr(mod, "MERGE_COLS", 0) else {}))
""" + MERGE_SAVE


@pytest.mark.skipif(ON_GPU, reason="the interpreter")
def test_merge_is_the_log_sum_exp_rule_with_rows_not_a_multiple_of_16(tmp_path):
    """24 rows (a program of 16 and one of 8 real rows): the masked rows are neither read nor written."""
    path = tmp_path / "merge.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "FAGEN_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", _MERGE, str(ROOT), str(path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merge_matches_float64(torch.load(path))


_MERGE_COLS = _MERGE.replace("mod = fagen.load(", """from fagen import backends
from fagen.codegen.render import render
from fagen.runtime.loader import load_source
backends.GLUON.variant = {**backends.GLUON.variant, "fp8lat_merge_cols": 16}
mod = load_source(render(""").replace(
    'kv_dtype="fp8_e4m3"))', 'kv_dtype="fp8_e4m3")).source, "merge_cols")').replace(
    "mod._merge[((rows + 15) // 16, b)](part_o, part_lse, out, lse, ROWS=rows, NUM_SPLITS=ns, BLOCK_R=16, DV_=dv,\n"
    "                                   **({\"COLS\": dv} if getattr(mod, \"MERGE_COLS\", 0) else {}))",
    "assert mod.MERGE_COLS == 16\n"
    "mod._merge[((rows + 15) // 16, b, dv // 16)](part_o, part_lse, out, lse, ROWS=rows, NUM_SPLITS=ns, BLOCK_R=16, "
    "DV_=dv, COLS=16)")


@pytest.mark.skipif(ON_GPU, reason="the interpreter")
def test_the_merge_by_column_blocks_is_the_log_sum_exp_rule(tmp_path):
    """[Note] Merge by column blocks (variant fp8lat_merge_cols, here 16 of 32 columns: two column programs a tile),
    24 rows (a tile of 8 real rows): every column and the lse against float64, the masked rows neither read nor
    written."""
    assert "COLS=16" in _MERGE_COLS and "load_source(render(" in _MERGE_COLS
    path = tmp_path / "merge.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "FAGEN_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", _MERGE_COLS, str(ROOT), str(path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merge_matches_float64(torch.load(path))


_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import fagen
from sm90 import loops, ptxas

from fagen import backends
from fagen.codegen.render import render
from fagen.runtime.loader import load_source

out = {}
for key, (layout, gqa, kw) in json.loads(sys.argv[2]).items():
    spec = fagen.KernelSpec(head_dim=576, head_dim_v=512, shared_kv=True, kind="decode", gqa=gqa, dtype="bf16",
                            mask="causal", layout=layout, backend="gluon", kv_dtype="fp8_e4m3")
    var = kw.pop("variant", None)  # the variant's fp8lat_* keys ([Note] Lazy block max, [Note] Early first block,
    # [Note] Staged chunks)
    if var:
        keep = backends.GLUON.variant
        backends.GLUON.variant = {**keep, **var}
        render.cache_clear()
        mod = load_source(render(spec).source, f"{spec.name}_{key}")
        backends.GLUON.variant = keep
        render.cache_clear()
        assert mod.LAZY == var.get("fp8lat_lazy", 0)
    else:
        mod = fagen.load(spec)
    ck = mod.compile_for(**kw)
    ptx = ck.asm["ptx"]
    res, log, _ = ptxas(ptx)
    res = next(iter(res.values()))
    body = loops(ptx, 8)
    out[key] = dict(shared=ck.metadata.shared, spills=res.spill_stores + res.spill_loads, stack=res.stack,
                    registers=res.registers, serialized="C7514" in log or "C7515" in log,
                    wgmma=[b.count("wgmma.mma_async") for b in body], bars=[b.count("bar.sync") for b in body])
print("RESULT " + json.dumps(out))
"""
BUILDS = {"paged_token": ("paged", 16, dict()), "paged_tensor": ("paged", 16, dict(scales=0)),
          "paged_head_split": ("paged", 16, dict(scales=1, num_splits=3)),
          "paged_token_invariant": ("paged", 16, dict(invariant=True)),
          "dense_head": ("dense", 16, dict(scales=1, num_splits=2)), "dense_token": ("dense", 16, dict()),
          "h8_sq2": ("paged", 8, dict(seq_q=2)), "h128_sq2": ("paged", 128, dict(seq_q=2, scales=0)),
          "paged_token_lazy6": ("paged", 16, dict(variant={"fp8lat_lazy": 6})),
          "paged_tensor_lazy6": ("paged", 16, dict(variant={"fp8lat_lazy": 6}, scales=0)),
          "paged_token_early": ("paged", 16, dict(variant={"fp8lat_early_fetch": 1})),
          "paged_token_staged7": ("paged", 16, dict(variant={"fp8lat_stage": 7})),
          "dense_head_staged7": ("dense", 16, dict(variant={"fp8lat_stage": 7}, scales=1, num_splits=2)),
          # [Note] Short splits: the SHORT form (unstaged, evict_first) and the staged form of the same render
          "paged_token_short": ("paged", 16, dict(variant={"fp8lat_short": 8}, num_splits=3, short=True)),
          "paged_tensor_short": ("paged", 16, dict(variant={"fp8lat_short": 8}, scales=0, num_splits=3, short=True)),
          "paged_token_short_off": ("paged", 16, dict(variant={"fp8lat_short": 8}, num_splits=3))}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, BUILDS, "gluon-mla-decode-fp8-product")


@pytest.mark.skipif(ON_GPU, reason="sm_90 builds on the CPU")
@pytest.mark.parametrize("key", list(BUILDS))
def test_builds_two_programs_an_sm_without_spills(built, key):
    """The key loop: 68 asynchronous wgmma a block (36 k-steps of S^T with K from registers, 32 of O^T), 4 CTA
    barriers; no spill; two programs an SM (shared memory and registers); the spec's formula bounds the build."""
    r = built[key]
    assert r["spills"] == 0 and r["stack"] == 0 and not r["serialized"], r
    assert 2 * r["shared"] <= 227 * 1024 and 2 * 128 * r["registers"] <= 65536, r
    stage = {**backends.GLUON.variant, **BUILDS[key][2].get("variant", {})}["fp8lat_stage"]  # [Note] Staged chunks
    assert r["shared"] <= backends.smem_bytes(spec()) + 4096 * stage, r
    # lazy: the loop's body in two branches; staged chunks: one more (before the next block's copies reuse the slots;
    # the copies' wait shares the step's first)
    stage = 0 if BUILDS[key][2].get("short") else stage  # [Note] Short splits: nothing staged in the SHORT form
    assert set(r["wgmma"]) == {68} and set(r["bars"]) == {5 if stage else 4}, r


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and hopper.gluon_missing() is None


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU and triton's Gluon Hopper API")
@pytest.mark.parametrize("form, splits, invariant, hq, sq", [
    ("token", None, False, 16, 1), ("token", 3, False, 16, 1), ("tensor", 1, False, 16, 1), ("head", None, True, 16, 1),
    ("token", None, False, 16, 3), ("tensor", None, False, 8, 2)])
def test_gpu_against_float64(form, splits, invariant, hq, sq):
    """Ragged lengths (odd, one empty, NaN past each end in shuffled pages, in the bytes and the per-token scales)
    against float64 on the dequantized cache."""
    from fagen.verify import reference
    lens, page = [1000, 77, 0, 513, 64], 64
    gen = torch.Generator().manual_seed(sq)
    width = -(-max(lens) // page)
    pages = len(lens) * width + 3
    q = torch.randn(len(lens), hq, sq, D, generator=gen).bfloat16().cuda()
    cache = torch.randn(pages, page, 1, D, generator=gen).to(torch.float8_e4m3fn)
    scales = {"token": torch.exp2(torch.rand(pages, page, 1, generator=gen) * 6 - 3), "tensor": 0.7,
              "head": torch.tensor([1.3])}[form]
    table = torch.randperm(pages, generator=gen)[:len(lens) * width].int().view(len(lens), width)
    for i, n in enumerate(lens):
        for p in range(width):
            if n - p * page < page:
                cache.view(torch.uint8)[table[i, p], max(0, n - p * page):] = 0x7F
                if form == "token":
                    scales[table[i, p], max(0, n - p * page):] = float("nan")
    scales = scales.cuda() if isinstance(scales, torch.Tensor) else scales
    cache, table, seqlens = cache.cuda(), table.cuda(), torch.tensor(lens, dtype=torch.int32).cuda()
    mod = fagen.load(spec(gqa=hq))
    kw = dict(block_table=table, seqlens_k=seqlens, scale=0.07, k_scale=scales)
    out, lse = (mod.forward_split(q, cache, None, num_splits=splits, **kw) if splits
                else mod.forward(q, cache, None, batch_invariant=invariant, **kw))
    keys_all = reference.dequantize(cache, scales, head_dim_axis=2)
    for i, n in enumerate(lens):
        if n == 0:
            assert (out[i] == 0).all() and (lse[i] == float("-inf")).all()
            continue
        keys = keys_all[table[i].long()].reshape(-1, 1, D)[:n].transpose(0, 1)[None]
        want, wlse = reference.attention(q[i:i + 1].double(), keys, None, head_dim_v=DV, mask="causal", scale=0.07)
        torch.testing.assert_close(out[i:i + 1].double(), want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse[i:i + 1].double(), wlse, atol=1e-3, rtol=1e-3)


@pytest.mark.skipif(ON_GPU, reason="CPU tensors: the launch is faked")
def test_checked_signatures_skip_only_the_checks_of_a_signature_already_checked(monkeypatch):
    """[Note] Checked signatures (HOST_MEMO, off by default): a call whose inputs' types, shapes, dtypes, devices
    and scale match a checked call's goes to the launch with the kept scale and form (the per-token tensor of this
    call); any other input (another scale form, shape, dtype or value) is checked again and refused as before."""
    mod = fagen.load(spec())
    assert mod.HOST_MEMO is False
    launched = []
    monkeypatch.setattr(mod, "HOST_MEMO", True)
    monkeypatch.setattr(mod, "_MEMO", {})
    monkeypatch.setattr(mod, "_check_device", lambda q: None)
    monkeypatch.setattr(mod, "_launch_decode", lambda *a: launched.append(a) or a)
    q = torch.randn(2, 16, 1, 576).bfloat16()
    cache = torch.randn(8, 64, 1, 576).to(torch.float8_e4m3fn)
    tok = torch.rand(8, 64, 1)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    lens = torch.tensor([100, 200], dtype=torch.int32)
    call = dict(block_table=table, seqlens_k=lens, scale=0.1)
    mod.forward(q, cache, None, k_scale=tok, **call)
    checked = mod._checked
    monkeypatch.setattr(mod, "_checked", lambda *a, **kw: pytest.fail("checked again"))
    tok2 = torch.rand(8, 64, 1)
    a = mod.forward(q, cache, None, k_scale=tok2, **call)
    assert a[2] == 0.1 and a[3] == (1.0, tok2, 2) and a[4] is table and a[5] is lens
    monkeypatch.setattr(mod, "_checked", checked)
    for bad, match in ((dict(k_scale=tok.half()), "k_scale: per-token scales must be float32"),
                       (dict(k_scale=torch.rand(8, 64)), "k_scale: expected a positive finite float"),
                       (dict(k_scale=-1.0), "k_scale: expected a positive finite float"),
                       (dict(k_scale=tok, scale=-0.1), "scale: expected a positive finite float")):
        with pytest.raises(mod.InputError, match=match):
            mod.forward(q, cache, None, **{**call, **bad})
    with pytest.raises(mod.InputError, match="block_table"):
        mod.forward(q, cache, None, k_scale=tok, **{**call, "block_table": table[:1]})
    assert len(launched) == 2
