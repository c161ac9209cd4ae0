"""The Gluon lab MLA absorbed decode (lab/gluon_mla_decode.py, issue 27): it builds for sm_90 without a GPU within
shared memory and without spills, its key loop is the [Note] Lab schedule (S and P V wgmma, S awaited with P V
still in flight), and its split merge (plain Triton, interpreted here) is the log-sum-exp rule against float64. On
an H100: scripts/gpu_mla_decode_s7.py (docs/serving.md, "A Gluon lab kernel for the compute-bound shape")."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_hopper_compile import build_sm90

ROOT = Path(__file__).resolve().parent.parent

_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
from lab import gluon_mla_decode as g
from sm90 import loops, ptxas

out = {}
for key, kw in json.loads(sys.argv[2]).items():
    ck = g.compile_for(**kw)
    ptx = ck.asm["ptx"]
    res, log, _ = ptxas(ptx)
    res = next(iter(res.values()))
    steps = loops(ptx, 30, innermost=True)
    out[key] = dict(shared=ck.metadata.shared, spills=res.spill_stores + res.spill_loads, stack=res.stack,
                    block_n=g.VARIANTS.get(kw["variant"], (64, 0))[0],
                    serialized="C7514" in log,
                    setmaxnreg=sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
                    steps=[dict(wgmma=s.count("wgmma.mma_async"),
                                waits=re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", s)) for s in steps])
print("RESULT " + json.dumps(out))
"""

BUILDS = {"direct": dict(variant="n32s4", num_splits=1), "split": dict(variant="n32s4", num_splits=2),
          "sq1": dict(variant="n16s8", sq=1, num_splits=1), "ss": dict(variant="ss", num_splits=1),
          "ss_split": dict(variant="ss", num_splits=2)}
ONE_PARTITION = [k for k in BUILDS if BUILDS[k]["variant"] != "ss"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, BUILDS, "gluon-mla-decode-lab")


@pytest.mark.parametrize("key", list(BUILDS))
def test_builds_within_shared_memory_without_spills(built, key):
    r = built[key]
    assert r["shared"] <= 227 * 1024 and r["spills"] == 0 and r["stack"] == 0, r


@pytest.mark.parametrize("key", ONE_PARTITION)
def test_the_key_loop_overlaps_s_with_p_v(built, key):
    """One key loop: S (576 / 16 = 36 wgmma k-steps) and P V (block_n / 16 k-steps of n256 per warpgroup); P_{j-1}
    V_{j-1} is awaited first (wait_group 0), S_{j+1} with P_j V_j still in flight (wait_group 1), and ptxas keeps
    the wgmma asynchronous (no C7514 serialisation: [Note] Lab schedule)."""
    steps = built[key]["steps"]
    assert len(steps) == 1, steps
    assert steps[0]["wgmma"] == 36 + built[key]["block_n"] // 16, steps
    assert sorted(steps[0]["waits"]) == ["0", "1"], steps  # the PTX lays the loop out rotated: any order
    assert not built[key]["serialized"], built[key]


# A split merge's inputs in a child process (b, ns, rows, dv set before): partial rows with an empty split (lse
# -inf, out 0) and a row no split saw; the merge then writes out / lse and the child saves all four.
MERGE_CASE = """
gen = torch.Generator().manual_seed(3)
part_o = torch.randn(b * ns * rows, dv, generator=gen)
part_lse = torch.randn(b * ns * rows, generator=gen) * 4
part_lse.view(b, ns, rows)[1, 2] = float("-inf")
part_o.view(b, ns, rows, dv)[1, 2] = 0.0
part_lse.view(b, ns, rows)[0, :, 5] = float("-inf")
part_o.view(b, ns, rows, dv)[0, :, 5] = 0.0
out = torch.empty(b, rows, dv, dtype=torch.bfloat16)
lse = torch.empty(b, rows)
"""
MERGE_SAVE = "torch.save(dict(part_o=part_o, part_lse=part_lse, out=out, lse=lse), sys.argv[2])\n"

_MERGE = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
from lab.gluon_mla_decode import _merge

b, ns, rows, dv = 2, 3, 32, 32
""" + MERGE_CASE + """
_merge[(rows // 16, b)](part_o, part_lse, out, lse, ROWS=rows, NUM_SPLITS=ns, BLOCK_R=16, DV_=dv)
""" + MERGE_SAVE


def merge_matches_float64(r):
    """A split merge's result r (partial rows part_o / part_lse in log2, merged out / lse) against the log-sum-exp
    rule in float64; row 5 of batch 0 sees no key in any split (lse -inf, out 0)."""
    b, rows, dv = r["out"].shape
    ln2 = torch.log(torch.tensor(2.0, dtype=torch.float64))
    lse2 = r["part_lse"].double().view(b, -1, rows)
    w = torch.softmax(lse2 * ln2, dim=1).nan_to_num()
    want = (w[..., None] * r["part_o"].double().view(b, -1, rows, dv)).sum(1)
    torch.testing.assert_close(r["out"].double(), want, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(r["lse"].double(), torch.logsumexp(lse2 * ln2, dim=1), atol=1e-5, rtol=1e-5)
    assert r["lse"][0, 5] == float("-inf") and (r["out"][0, 5] == 0).all()


def test_merge_is_the_log_sum_exp_rule(tmp_path):
    """Splits' partial rows (log2 lse; one split empty: lse -inf, out 0) against float64 (the lab's Triton merge,
    interpreted, in a child process: tests import nothing from lab/)."""
    path = tmp_path / "merge.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _MERGE, str(ROOT), str(path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merge_matches_float64(torch.load(path))


@pytest.mark.parametrize("key", ["ss", "ss_split"])
def test_the_seesaw_keeps_each_warpgroup_on_its_own_loop(built, key):
    """Two pair loops (one a warpgroup: [Note] Seesaw pair), each S of its own 64-key block (36 k-steps) and two
    P V of its 256 columns (4 k-steps each): 44 wgmma; asynchronous (no C7514), no spills (the wgmma descriptors are
    computed in the loop: [Note] Seesaw descriptors), the two warpgroups at 256 and 240 registers, the loader 24."""
    r = built[key]
    assert [s["wgmma"] for s in r["steps"]] == [44, 44], r
    assert not r["serialized"] and r["spills"] == 0, r
    assert {240, 256, 24} <= set(r["setmaxnreg"]), r
