"""The Gluon forward builds for sm_90 without a GPU: triton's compiler and bundled ptxas, for an explicit target.

Each module of MODULES is compiled in one fresh interpreter without TRITON_INTERPRET (conftest sets it on CPU
machines; it would turn the jit helpers into interpreted functions that the Gluon compiler cannot call). From the
PTX and `ptxas -v`: shared memory against the spec's formula, spills, the register budgets, the barrier operations
of a consumer step ([Note] Barriers), the score switches' code.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fagen.runtime import hopper
from fagen import backends
from fagen.spec import targets
from fagen.spec.kernel import KernelSpec

ROOT = Path(__file__).resolve().parent.parent

# Both head dims and masks, GQA, fp16, and the score switches (causal, as the selection uses them).
MODULES = {
    "full": dict(mask="none"),
    "gqa_fp16": dict(mask="causal", gqa=4, dtype="fp16"),
    "d64": dict(head_dim=64, mask="causal"),
    "softcap": dict(mask="causal", softcap=True),
    "window": dict(mask="causal", window=True),
    "both": dict(mask="causal", window=True, softcap=True),
}


def gluon(**fields) -> KernelSpec:
    return KernelSpec(backend="gluon", **{"head_dim": 128, "dtype": "bf16", **fields})


def _gluon_hopper_missing():
    reason = hopper.gluon_missing()
    if reason:
        return reason
    import triton
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists() and not os.environ.get("TRITON_PTXAS_PATH"):
        return f"no ptxas: neither {ptxas} nor $TRITON_PTXAS_PATH"
    return None


_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import fagen
from fagen.spec.kernel import KernelSpec
from sm90 import loops, ptxas

out = {}
for key, fields in json.loads(sys.argv[2]).items():
    mod = fagen.load(KernelSpec(backend="gluon", **{"head_dim": 128, "dtype": "bf16", **fields}))
    ck = mod.compile_for()
    ptx = ck.asm["ptx"]
    res = ptxas(ptx)[0]["_attn_fwd_hopper"]
    # innermost loops that hold a whole consumer step (S and P V: (D + N) / 16 wgmma); the producer's loop is laid
    # out in pieces (its back edge branches forward), so it is not counted
    steps = loops(ptx, (mod.HEAD_DIM + mod.BLOCK_N) // 16, innermost=True)
    out[key] = dict(shared=ck.metadata.shared, num_warps=ck.metadata.num_warps, cubin=len(ck.asm["cubin"]),
                    wgmma=ptx.count("wgmma.mma_async"), tma=ptx.count("cp.async.bulk.tensor"),
                    tanh=ptx.count("tanh.approx.f32"),
                    setmaxnreg=sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
                    spills=res.spill_stores + res.spill_loads, stack=res.stack, step_loops=len(steps),
                    step=[dict(bar_sync=len(re.findall(r"\b(?:bar|barrier)\.sync\b", s)),
                               arrive=s.count("mbarrier.arrive"), wait=s.count("mbarrier.try_wait")) for s in steps])
print("RESULT " + json.dumps(out))
"""


def build_sm90(tmp_path_factory, script: str, modules: dict, name: str) -> dict:
    """Run a build script for sm_90 in a fresh process (compiled, not interpreted: no TRITON_INTERPRET) with its
    own cache; its `RESULT {json}` line, or a skip where this triton has no Gluon Hopper API."""
    reason = _gluon_hopper_missing()
    if reason:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FAGEN_CACHE_DIR"] = str(tmp_path_factory.mktemp(name))
    proc = subprocess.run([sys.executable, "-c", script, str(ROOT), json.dumps(modules)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, MODULES, "gluon-sm90")


@pytest.mark.parametrize("key", list(MODULES))
def test_builds_within_shared_memory_without_spills(built, key):
    r = built[key]
    formula = backends.smem_bytes(gluon(**MODULES[key]))
    # The spec's formula bounds the build from above, within the 1 KB it adds for barriers and scratch.
    assert formula - 1024 <= r["shared"] <= formula <= targets.ARCH_SMEM_LIMIT["sm_90"], r
    assert r["spills"] == 0 and r["stack"] == 0, r
    assert r["num_warps"] == 12 and r["cubin"] > 0, r  # 4 + 4 + 1 warps, padded to whole warpgroups
    assert {backends.GLUON.variant["loader_regs"], backends.GLUON.variant["consumer_regs"]} <= set(r["setmaxnreg"])
    head_dim, block_n = gluon(**MODULES[key]).head_dim, gluon(**MODULES[key]).block_n
    # 2 consumer warpgroups x (S in the prologue, S and P V in each of two loops, P V in the epilogue), each a
    # warpgroup_mma of HEAD_DIM/16 or BLOCK_N/16 wgmma instructions.
    assert r["wgmma"] >= 2 * 4 * min(head_dim, block_n) // 16, r
    assert r["tma"] >= 4, r  # Q, K, V loads and the O store


@pytest.mark.parametrize("key", list(MODULES))
def test_a_consumer_step_pays_three_barriers_and_two_releases(built, key):
    """[Note] Barriers: per step, a bar.sync before the K/V waits, before the K release and before the V release;
    one arrive each on K's and V's `empty` barrier. Two unmasked/masked step loops per warpgroup, and with a window
    its left-edge masked loop too."""
    r = built[key]
    assert r["step_loops"] == 4 + (2 if MODULES[key].get("window") else 0), r
    for step in r["step"]:
        assert (step["bar_sync"], step["arrive"], step["wait"]) == (3, 2, 2), r


def test_the_softcap_s_tanh_is_there_exactly_with_the_switch(built):
    for key, fields in MODULES.items():
        assert (built[key]["tanh"] > 0) == bool(fields.get("softcap")), (key, built[key])
