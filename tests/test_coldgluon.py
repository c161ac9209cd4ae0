"""The cold first call's compile, by Triton stage (docs/mods.md, "The cold first call on the H200 (eighteenth
session)"): scripts/gpu_coldstart.py's stage table, and scripts/cpu_coldgluon.py building the issue's new mod for
sm_90 on a CPU (the Gluon modded forward and the Triton one), its stage times from Triton's compilation listener."""

import importlib.util
import time
from pathlib import Path

import pytest

from _env import ON_GPU
from test_hopper_compile import _gluon_hopper_missing

ROOT = Path(__file__).resolve().parent.parent


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(compiles: list) -> dict:
    return {"mode": "newmod", "call": 3.0, "first result": 3.0, "dynamo imported": False, "max diff": 1e-3,
            "phases": {"compile": 2.9}, "counts": {"compile": len(compiles)}, "compiles": compiles,
            "repeat call ms": 1.5}


def test_the_stage_table_lists_each_compile_by_stage_and_no_cache_hit():
    cs = _script("gpu_coldstart")
    stages = {"ir init": 0.25, "ttgir": 0.03, "llir": 0.8, "ptx": 0.4, "cubin": 1.3}
    records = {"new mod cold": _record([["_attn_fwd_hopper", False, stages]]),
               "new mod warm": _record([["_attn_fwd_hopper", True, {"ir init": 0.001}]])}  # a hit: times too
    table = cs.stage_table(records, list(records))
    rows = [line for line in table.splitlines() if line.startswith("| new mod")]
    assert rows == ["| new mod cold | _attn_fwd_hopper | 0.250 | - | 0.030 | 0.800 | 0.400 | 1.300 | 2.780 |"], table
    out = cs.table(records, 2e-2)  # the listener's triples reach the summary and the stage table
    assert "PASS new mod cold: max diff 1.00e-03 (tol 0.02); compiles 1 ['_attn_fwd_hopper'], cache hits 0" in out
    assert "cache hits 1 ['_attn_fwd_hopper']" in out and rows[0] in out
    assert "new mod cold: 3.00 s against the issue's 3.0 s: met" in out


@pytest.mark.skipif(ON_GPU, reason="builds for a faked sm_90 target; the GPU machine runs scripts/gpu_coldstart.py")
def test_the_cpu_script_times_every_stage_of_both_forwards():
    reason = _gluon_hopper_missing()
    if reason:
        pytest.skip(reason)
    cg = _script("cpu_coldgluon")
    c = 0.5 + time.time_ns() % 10**6 / 10**6  # a literal no cache has seen
    recs = [cg.run(kind, (c,), {}) for kind in ("gluon", "triton")]
    want = {"gluon": ["ttgir", "llir", "ptx", "cubin"], "triton": ["ttir", "ttgir", "llir", "ptx", "cubin"]}
    for rec in recs:
        (b,) = rec["builds"]
        assert not b["hit"] and list(b["stages"]) == want[rec["kind"]], b
        assert b["name"] == ("_attn_fwd_hopper" if rec["kind"] == "gluon" else "_attn_fwd"), b
        assert all(b["cpu"][s] > 0 for s in want[rec["kind"]]) and b["cpu"]["total"] >= b["cpu"]["cubin"], b
        # the listener's stages account for the compile call (the rest: the cache's writes, the listener)
        assert 0.8 * b["compile"] <= b["init"] + sum(b["stages"].values()) <= b["compile"], b
    table = cg.table(recs)
    assert "| gluon first mod |" in table and "| triton first mod |" in table and "(CPU s)" in table
