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


# -- fwd_tail_first ([Note] Tail block first in fagen/templates/gluon/attention.py.j2; docs/mods.md, "The cold first
# call: a smaller modded forward (nineteenth session)")
_SPEC = r"""
def _issue_spec(mask="none", mod=True):
    # the cold row's Gluon modded forward (score + where(q_idx >= kv_idx, 0.5, -0.5)), or the plain one
    import torch

    from fagen.runtime import mods, modded
    from fagen.spec.kernel import KernelSpec

    if not mod:
        return KernelSpec(head_dim=128, dtype="bf16", mask=mask, backend="gluon")
    fn = eval("lambda score, b, h, q_idx, kv_idx: score + torch.where(q_idx >= kv_idx, 0.5, -0.5)", {"torch": torch})
    spec = modded.modded_spec(KernelSpec(head_dim=128, dtype="bf16", mask=mask), mods.prepare(score_mod=fn).fields,
                              arch="sm_90")
    return KernelSpec(head_dim=128, mask=spec.mask, gqa=spec.gqa, dtype=spec.dtype, backend="gluon",
                      score_mod=spec.score_mod, mod_tensors=spec.mod_tensors, mod_scalars=spec.mod_scalars)
"""
exec(_SPEC)  # _issue_spec here; the sm_90 build's child (no TRITON_INTERPRET, so not this module) runs the same text


def _renders(monkeypatch, tail: int, **kw) -> str:
    import fagen
    from fagen import backends

    monkeypatch.setitem(backends.GLUON.variant, "fwd_tail_first", tail)
    return fagen.generate(_issue_spec(**kw))


def test_tail_first_renders_only_a_non_causal_score_mod_forward(monkeypatch):
    off = {k: _renders(monkeypatch, 0, **k_) for k, k_ in
           (("none", {}), ("causal", dict(mask="causal")), ("plain", dict(mod=False)))}
    on = {k: _renders(monkeypatch, 1, **k_) for k, k_ in
          (("none", {}), ("causal", dict(mask="causal")), ("plain", dict(mod=False)))}
    assert on["causal"] == off["causal"] and on["plain"] == off["plain"]
    assert all("Tail block first" not in src for src in off.values())
    assert "[Note] Tail block first" in on["none"]
    # one step loop fewer in each consumer: the masked one (the prologue's masked softmax stays)
    assert on["none"].count("= _consumer_step(") == off["none"].count("= _consumer_step(") - 1 == 1
    assert "BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, True, CAUSAL)" not in on["none"]


def test_tail_first_loads_each_key_block_once_in_the_consumers_order(monkeypatch):
    """The producer's order (its `last` and `start_n` expressions, read from the render and evaluated here) is the
    consumers': the last block, then the full blocks from 0; every block once, only the first one cut."""
    import re

    src = _renders(monkeypatch, 1)
    loader = src[src.index("def _loader("):src.index("def _softmax(")]
    last_expr = re.search(r"\n\s+last = (.+?)  #", loader).group(1)
    start_expr = re.search(r"\n\s+start_n = (.+)\n", loader).group(1)
    consumer = src[src.index("def _consumer("):]
    assert re.search(r"\n\s+last = " + re.escape(last_expr) + "  #", consumer)
    assert "for start_n in range(0, last, BLOCK_N):" in consumer
    assert "cols = last + gl.arange(" in consumer
    for block_n in (64, 128):
        for hi in list(range(1, 700)) + [4001, 4096, 8192]:
            env = {"hi": hi, "BLOCK_N": block_n}
            last = eval(last_expr, env)
            order = [eval(start_expr, {**env, "j": j, "last": last}) for j in range(0, hi, block_n)]
            assert order == [last] + list(range(0, last, block_n)), (hi, block_n)
            assert sorted(order) == list(range(0, hi, block_n))
            assert all(s + block_n <= hi for s in order[1:]), (hi, block_n)  # the unmasked loop's blocks are full


_BUILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import fagen
from fagen import backends
exec(sys.argv[2])
out = {}
for tail in (0, 1):
    backends.GLUON.variant["fwd_tail_first"] = tail
    ptx = fagen.load(_issue_spec()).compile_for(seq_q=4096, seq_k=4096).asm["ptx"]
    out[tail] = {"lines": ptx.count("\n"), "ex2": ptx.count("ex2.approx"), "wgmma": ptx.count("wgmma.mma_async")}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.skipif(ON_GPU, reason="builds for a faked sm_90 target; the GPU machine runs scripts/gpu_coldgl_s19.py")
def test_tail_first_builds_for_sm90_with_a_third_fewer_softmax_copies(tmp_path):
    reason = _gluon_hopper_missing()
    if reason:
        pytest.skip(reason)
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(FAGEN_CACHE_DIR=str(tmp_path / "fagen"), TRITON_CACHE_DIR=str(tmp_path / "triton"))
    p = subprocess.run([sys.executable, "-c", _BUILD, str(ROOT), _SPEC], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = {int(k): v for k, v in json.loads(p.stdout.split("RESULT ", 1)[1]).items()}
    # each consumer: three softmax copies (masked prologue, unmasked and masked steps) -> two; both consumers'
    # exponentials (64 of P and 2 of alpha a copy per thread) and matmuls (S, P V) scale by 2/3
    assert 3 * got[1]["ex2"] == 2 * got[0]["ex2"] and 3 * got[1]["wgmma"] == 2 * got[0]["wgmma"], got
    assert got[1]["lines"] < 0.8 * got[0]["lines"], got
