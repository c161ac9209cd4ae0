"""The product's Gluon dK/dV kernel at MLA's split head dims, through the lab's sweep wrapper (lab/gluon_bwd_mla_kv.py
over fagen/templates/gluon/mla_dkdv.py: d_qk 192 beside d_v 128, two
compute warpgroups of 64 keys, no dQ) builds for sm_90 without a GPU: within shared memory and setmaxnreg 240 / 24,
no spills at 32-query steps (none in a step loop), each compute warpgroup's step one loop of 13 wgmma ops; and
scripts/gpu_mlabwd_s22.py's edit of the product's render (the hook that hands dK/dV to it) applies to today's
render. On an H200: scripts/gpu_mlabwd_s22.py (float64 checks, exact zeros, bitwise repeatability, timings beside
cuDNN; docs/serving.md, "MLA backward (twenty-second session)")."""

import importlib.util
import os

import pytest

from test_hopper_compile import ROOT, build_sm90

_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
from lab import gluon_bwd_mla_kv
from lab.gluon_bwd import step_sass
from sm90 import loops, ptxas

out = {}
for key, kw in json.loads(sys.argv[2]).items():
    ck = gluon_bwd_mla_kv.compile_for(**kw)
    ptx = ck.asm["ptx"]
    res = next(iter(ptxas(ptx)[0].values()))
    out[key] = dict(shared=ck.metadata.shared, spills=res.spill_stores + res.spill_loads,
                    setmaxnreg=sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)",
                                                                  ptx)}),
                    steps=sorted(s.count("wgmma.mma_async") for s in loops(ptx, 8, innermost=True)),
                    local=[x["ldl"] + x["stl"] for x in step_sass(ck, 8)],
                    atomics=len(re.findall(r"\b(atom|red)\.", ptx)))
print("RESULT " + json.dumps(out))
"""

BUILDS = {"m32 s2 g4": dict(BLOCK_M=32, STAGES=2, GROUP=4), "m32 s3": dict(BLOCK_M=32, STAGES=3),
          "m32 s2 gqa2": dict(BLOCK_M=32, STAGES=2, GROUP=4, gqa=2, causal=False),
          "m32 s2 g4 dv early": dict(BLOCK_M=32, STAGES=2, GROUP=4, DV_EARLY=1)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, BUILDS, "gluon-bwd-mla-kv")


def test_it_fits_shared_memory_and_the_register_split_without_spills(built):
    for r in built.values():
        assert r["shared"] <= 227 * 1024, r  # sm_90's opt-in shared memory per block
        assert {240, 24} <= set(r["setmaxnreg"]), r
        assert r["spills"] == 0, r
        assert not any(r["local"]), r  # no local memory in a step loop
        assert r["atomics"] == 0, r  # one program owns each key block: no atomics, the same bits every call


def test_each_compute_warpgroup_steps_in_one_loop(built):
    """Per step of 32 queries: S^T 12 wgmma (K = d_qk: 128 + 64 in k16 steps), dP^T 8, dV 2, dK 2 + 2: 26 in SASS;
    the PTX counts one wgmma.mma_async per warpgroup_mma k-step, so a step loop holds a fixed count, the same in
    both warpgroups."""
    for r in built.values():
        assert len(r["steps"]) >= 2 and len(set(r["steps"])) == 1, r


def _script():
    spec = importlib.util.spec_from_file_location("gpu_mlabwd_s22", os.path.join(ROOT, "scripts", "gpu_mlabwd_s22.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_gpu_scripts_hook_applies_to_the_product_render():
    """The hook edits the Triton pair's render (MLA_GLUON_DKDV off), as the script's lever_render gives it."""
    import fagen

    script = _script()
    for mask, gqa in (("causal", 1), ("none", 2)):
        spec = fagen.KernelSpec(head_dim=192, head_dim_v=128, mask=mask, gqa=gqa, dtype="bf16", direction="bwd")
        src = script.lever_render(spec, False)
        for old, new in script.HOOK:
            assert src.count(old) == 1, old
            src = src.replace(old, new)
        compile(src, spec.name, "exec")
        # the Gluon launch is built before the preprocess's launch and runs where the Triton dK/dV kernel's would
        assert src.index("gkv = _GLUON_KV(") < src.index("_fast(_attn_bwd_preprocess)[") < src.index("gkv()")
        assert src.index("gkv()") < src.index("_fast(_attn_bwd_dkdv)[")
