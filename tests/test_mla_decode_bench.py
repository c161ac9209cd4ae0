"""The serving bench's absorbed MLA decode rows (fagen/bench/serving.py, case.shared_kv): d 576 / v 512 over one
latent cache read once (v=None), bf16 and an fp8 latent, at Hq 16 Sq 1 and Hq 128 Sq 2; what they count, which
kernel serves them (as fagen.attention picks), and that the bench checks them against float64 (interpreter)."""

import dataclasses

import pytest
import torch

from fagen import backends
from fagen.bench.cases import BenchOptions
from fagen.bench.impls import run_case
from fagen.bench.inputs import make_inputs
from fagen.bench.serving import serving_rows
from fagen.bench.workloads import kv_bytes, make_case
from fagen.runtime import hopper
from fagen.spec.axes import Backend

from _env import ON_GPU


def _rows(quick=False):
    return {c.name: c for c in serving_rows(quick) if c.shared_kv}


def test_the_rows_cover_both_shapes_bf16_and_fp8():
    rows = _rows()
    assert {(c.heads_q, c.seq_q, c.kv_dtype) for c in rows.values()} == {
        (16, 1, None), (128, 2, None), (16, 1, "fp8_e4m3"), (128, 2, "fp8_e4m3")}
    assert all(c.head_dim == 576 and c.head_dim_v == 512 and c.heads_kv == 1 and not c.peers for c in rows.values())
    assert {c.seq_k for c in rows.values() if c.heads_q == 16} == {4096, 32768}


def test_gbs_counts_the_latent_row_once():
    c = _rows()["decode-mla-absorbed-h16-kv4k-b128"]
    assert kv_bytes(c) == 128 * 4096 * 576 * 2  # not 576 + 512 a key
    assert kv_bytes(_rows()["decode-mla-absorbed-h16-kv4k-b128-fp8"]) == 128 * 4096 * 576


def test_inputs_pass_v_none_and_k_scale_only():
    c = _rows(quick=True)["decode-mla-absorbed-h16-kv4k-b128-fp8"]
    s = make_inputs(c, torch.device("cpu"), 0)
    assert s.v is None and s.k.dtype == torch.float8_e4m3fn and set(s.scores) == {"k_scale"}


def test_shared_kv_needs_a_narrower_v_and_a_decode_shape():
    with pytest.raises(ValueError, match="shared_kv"):
        make_case("x", head_dim=576, head_dim_v=576, shared_kv=True, mask="none", batch=1, heads_q=16, heads_kv=1,
                  seq_q=1, seq_k=4096)


@pytest.mark.skipif(ON_GPU, reason="fakes sm_90 on the CPU")
def test_the_spec_is_what_fagen_attention_picks(monkeypatch):
    """[Note] Hopper selection: on sm_90 the Hq 128 Sq 2 bf16 row runs the gluon MLA decode; Hq 16 (a padded tile)
    does where [Note] Latent padded tiles selects it; the fp8 rows at Hq 16 run the gluon fp8 decode where
    select_fp8_latent, the Hq 128 fp8 row the fp8 seesaw where fp8lat_seesaw is on (the Triton decode before)."""
    monkeypatch.setattr(hopper, "is_hopper", lambda device: True)
    monkeypatch.setattr(hopper, "gluon_missing", lambda: None)
    monkeypatch.setattr(hopper, "LATENT_PAD_SELECTED", False)
    rows = _rows()
    assert rows["decode-mla-absorbed-h128-sq2-kv8k-b32"].spec("cpu")[0].backend is Backend.GLUON
    assert rows["decode-mla-absorbed-h16-kv4k-b128"].spec("cpu")[0].backend is Backend.TRITON
    seesaw = Backend.GLUON if backends.GLUON.variant["fp8lat_seesaw"] else Backend.TRITON  # 256 rows: the fp8 seesaw
    assert rows["decode-mla-absorbed-h128-sq2-kv8k-b32-fp8"].spec("cpu")[0].backend is seesaw
    fp8 = Backend.GLUON if backends.GLUON.select_fp8_latent else Backend.TRITON
    assert rows["decode-mla-absorbed-h16-kv32k-b32-fp8"].spec("cpu")[0].backend is fp8
    monkeypatch.setattr(hopper, "LATENT_PAD_SELECTED", True)
    assert rows["decode-mla-absorbed-h16-kv4k-b128"].spec("cpu")[0].backend is Backend.GLUON


@pytest.mark.skipif(ON_GPU, reason="the CPU interpreter's run; on a GPU `fagen bench --suite serving` checks the row")
@pytest.mark.parametrize("name", ["decode-mla-absorbed-h16-kv4k-b128", "decode-mla-absorbed-h16-kv4k-b128-fp8"])
def test_the_bench_checks_the_row_against_float64(name):
    """The quick row (b2, 300 keys) through the bench's fagen column on the CPU interpreter:
    checked against the float64 reference of v=None (V the latent's first 512 columns, dequantized for fp8)."""
    c = dataclasses.replace(_rows(quick=True)[name], heads_q=16, batch=2, seq_k=300)
    recs = run_case(c, BenchOptions(device="cpu", impls=("fagen", ), rep_ms=1, sets=1, warmup_ms=1),
                    log=lambda *_: None)
    assert [r["check"] for r in recs] == ["ok"], recs
