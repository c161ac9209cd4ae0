"""`fagen tune` and the tuned table it writes: lookups, validation, the shared-memory filter, the tuner's runs."""

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner

import fagen
from fagen.bench.tune import candidates
from fagen.bench.workloads import make_case
from fagen.cli import main
from fagen.backends import triton as triton_backend
from fagen.spec import tuned
from fagen.spec.axes import Direction, DType, Kind, Mask
from fagen.backends.triton import smem_bytes
from fagen.verify.properties import check_forward
from fagen.verify.strategies import Problem
from _env import DEVICE, ON_GPU

CPU = torch.device("cpu")


# -- the tuned table --------------------------------------------------------------------------------------
ENTRY = dict(arch="sm_90", head_dim=64, mask="causal", dtype="fp16", direction="fwd", kind="prefill", block_m=64,
             block_n=32, num_warps=4, num_stages=4)


@pytest.fixture
def tuned_table(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    monkeypatch.setattr(tuned, "TUNED_PATH", path)
    tuned._index.cache_clear()
    yield path
    tuned._index.cache_clear()


def test_specs_read_the_tuned_table_for_sm90_only(tuned_table):
    hand = triton_backend.default_config(64, DType.FP16, Direction.FWD, Kind.PREFILL)
    assert fagen.KernelSpec(head_dim=64, mask="causal").block_m == hand["block_m"]  # no file: hand defaults
    tuned.upsert(tuned_table, ENTRY)
    tuned.upsert(tuned_table, {**ENTRY, "arch": "sm_80", "block_m": 16})
    spec = fagen.KernelSpec(head_dim=64, mask="causal")
    assert (spec.block_m, spec.block_n, spec.num_warps, spec.num_stages) == (64, 32, 4, 4)
    assert fagen.KernelSpec(head_dim=64, mask="causal", block_n=128).block_n == 128  # explicit fields win
    assert fagen.KernelSpec(head_dim=64, mask="none").block_m == hand["block_m"]  # other key: hand defaults
    assert fagen.KernelSpec(head_dim=64, mask="causal", dtype="bf16").block_m == hand["block_m"]
    assert triton_backend.default_config(64, DType.FP16, Direction.FWD, Kind.PREFILL, mask=Mask.CAUSAL,
                                         arch="sm_80")["block_m"] == 16
    assert triton_backend.default_config(64, DType.FP16, Direction.FWD, Kind.PREFILL, mask=Mask.CAUSAL,
                                         arch="sm_100") == hand  # sm_90's family, no entry of its own
    assert fagen.KernelSpec(head_dim=64, mask="causal", arch="sm_80").block_m == 16  # a spec given an arch
    assert spec.for_arch("sm_80").block_m == 16 and spec.for_arch("sm_90") == spec
    tuned.upsert(tuned_table, {**ENTRY, "block_m": 128, "ms": 1.0})  # same key: replaced, not duplicated
    assert len(tuned.read_table(tuned_table)) == 2
    assert fagen.KernelSpec(head_dim=64, mask="causal").block_m == 128


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    ('{"format": 2, "entries": []}', "expected"),
    (json.dumps({"format": 1, "entries": [{**ENTRY, "block_m": 48}]}), "block_m = 48"),
    (json.dumps({"format": 1, "entries": [{k: v for k, v in ENTRY.items() if k != "num_warps"}]}), "num_warps"),
    (json.dumps({"format": 1, "entries": [{**ENTRY, "mask": "diagonal"}]}), "mask = 'diagonal'"),
    (json.dumps({"format": 1, "entries": [ENTRY, {**ENTRY, "block_m": 128}]}), "share the key"),
])
def test_malformed_tuned_tables_are_rejected(tmp_path, text, message):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(tuned.TunedTableError, match=message):
        tuned.read_table(path)


def test_shipped_tuned_configs_pass_the_forward_properties():
    """Every config `fagen tune` shipped is correct (tiny ragged problems on the CPU, bigger on a GPU)."""
    entries = tuned.read_table(tuned.TUNED_PATH)
    for e in entries:
        if e["direction"] != "fwd" or e["arch"] != "sm_90":
            continue
        spec = fagen.KernelSpec(**{k: e[k] for k in ("head_dim", "mask", "dtype", "direction", "kind", "block_m",
                                                    "block_n", "num_warps", "num_stages")}, gqa=2)
        sq, sk = (9, 9 + 70) if spec.mask is Mask.TREE else (1 if spec.kind is Kind.DECODE else 70, 133)
        if ON_GPU:
            sq, sk = (37, 37 + 1000) if spec.mask is Mask.TREE else (1 if spec.kind is Kind.DECODE else 1000, 1333)
        problem = Problem(batch=2, heads_kv=2, seq_q=sq, seq_k=sk, seed=5,
                          seqlens_q=(sq, sq // 2) if spec.mask.padded else None,
                          seqlens_k=(sk, sk // 3) if spec.mask.padded else None,
                          parents=(tuple(range(-1, sq - 1)),) * 2 if spec.mask is Mask.TREE else None)
        check_forward(fagen.load(spec), spec, problem, DEVICE)


def test_tuner_candidates_respect_shared_memory():
    spec = fagen.KernelSpec(head_dim=128, mask="causal", dtype="bf16")
    kept, dropped = candidates(spec, {}, {"block_m": (64, 128), "block_n": (32, 64, 128), "num_warps": (4, 8),
                                          "num_stages": (2, 3, 4)}, 227 * 1024)
    assert len(kept) + len(dropped) == 36 and dropped
    for cfg in kept:
        assert smem_bytes(dataclasses.replace(spec, **cfg)) <= 227 * 1024
    assert {"block_m": 128, "block_n": 128, "num_warps": 4, "num_stages": 4} in [c for c, _ in dropped]
    assert smem_bytes(dataclasses.replace(spec, block_m=128, block_n=128, num_stages=4)) == (128 + 8 * 128) * 128 * 2
    pinned, _ = candidates(spec, {"block_m": 128, "num_warps": 8}, {"block_m": (64, 128), "block_n": (32, 64),
                                                                     "num_warps": (4, 8), "num_stages": (2,)}, 1 << 30)
    assert [(c["block_m"], c["num_warps"]) for c in pinned] == [(128, 8), (128, 8)]


# -- the tuner ----------------------------------------------------------------------------------------------
@pytest.mark.skipif(ON_GPU, reason="CPU smoke run of the tuner")
def test_tune_smoke_run_on_the_cpu(tmp_path, tuned_table):
    table = tmp_path / "cpu.json"
    args = ["tune", "--device", "cpu", "--quick", "--head-dim", "16", "--mask", "padding", "--block-m", "16"]
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 2 and "--dry-run" in res.output  # never writes interpreter timings into the package
    res = CliRunner().invoke(main, [*args, "--table", str(table)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert f"wrote 1 entry to {table}" in res.output
    (entry,) = tuned.read_table(table)
    assert entry["arch"] == "cpu" and entry["block_m"] == 16 and entry["block_n"] in (16, 32)
    assert entry["mask"] == "padding" and entry["ms"] > 0
    res = CliRunner().invoke(main, [*args, "--table", str(table)], catch_exceptions=False)
    assert "already has an entry" in res.output


def test_precompile_worker_builds_every_candidate(tmp_path):
    """What a precompile process does (on a GPU, in parallel) runs each config on both shapes without raising."""
    from fagen.bench import tune
    from fagen.runtime import loader as runtime

    case = make_case("p", head_dim=16, mask="causal", batch=1, heads_q=2, heads_kv=1, seq_q=20, seq_k=20,
                     dtype="fp16", direction="fwd")
    configs = [{"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1},
               {"block_m": 16, "block_n": 32, "num_warps": 4, "num_stages": 1}]
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"case": case.to_dict(), "configs": configs, "seed": 0, "device": "cpu"}))
    tune._precompile_main(str(job))
    specs = {dataclasses.replace(case, overrides=tuple(c.items())).spec()[0] for c in configs}
    assert {s.hash for s in specs} <= {key[0] for key in runtime._loaded}  # (spec hash, render state) keys




def test_the_incumbent_stays_unless_beaten_by_more_than_the_margin():
    """A 0.25% win is inside the H100's run-to-run spread: the config specs have today stays (with a note)."""
    from fagen.bench.tune import KEEP_MARGIN, Trial, choose
    inc = {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3}
    new = {**inc, "block_n": 64}
    near = [Trial(inc, "ok", ms=1.961), Trial(new, "ok", ms=1.956), Trial({**inc, "num_stages": 2}, "rejected")]
    kept = choose(near, inc)
    assert kept.config == inc and "within 1%" in kept.note and "1.956" in kept.note
    far = [Trial(inc, "ok", ms=1.961 * (1 + KEEP_MARGIN) + 1e-3), Trial(new, "ok", ms=1.961)]
    assert choose(far, inc).config == new and not choose(far, inc).note
    assert choose([Trial(new, "ok", ms=2.0), Trial(inc, "error")], inc).config == new  # incumbent did not run
    assert choose([Trial(inc, "ok", ms=1.9), Trial(new, "ok", ms=2.0)], inc).note == ""  # it is the fastest
    assert choose([Trial(inc, "rejected")], inc) is None
