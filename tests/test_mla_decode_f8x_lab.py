"""The eleventh session's variants of the fp8 latent swap-AB lab decode (lab/gluon_mla_decode_f8x.py; issue 27 part
2): [Note] Lab partial row sums (L_PART) and [Note] Lab ablations (timing only). sm_90 builds without a GPU: two
CTAs an SM by shared memory, the key loop's CTA barriers, and what each ablation leaves out. On an H100:
scripts/gpu_fp8lat_s11.py (checks against float64 on the dequantized cache, NaN past the lengths, then % of copy)."""

import re

import pytest

from _env import ON_GPU
from test_hopper_compile import build_sm90

_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
from lab import gluon_mla_decode_f8x
from sm90 import loops, ptxas

out = {}
for key, kw in json.loads(sys.argv[2]).items():
    ck = gluon_mla_decode_f8x.compile_for(**kw)
    ptx = ck.asm["ptx"]
    res, log, _ = ptxas(ptx)
    res = next(iter(res.values()))
    body = loops(ptx, 8)
    out[key] = dict(shared=ck.metadata.shared, spills=res.spill_stores + res.spill_loads, registers=res.registers,
                    loops=len(body), loop=body[0] if body else "")
print("RESULT " + json.dumps(out))
"""

BUILDS = {"token": dict(), "token_lpart": dict(l_part=True), "token_f16": dict(f16=True),
          "token_lpart_f16": dict(l_part=True, f16=True),
          "no_cvt": dict(ablate=1), "no_max": dict(ablate=2)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, BUILDS, "gluon-mla-decode-f8x-lab")


def _bars(loop):
    return len(re.findall(r"\bbar\.sync|\bbarrier\.sync", loop))


@pytest.mark.skipif(ON_GPU, reason="sm_90 builds on the CPU")
@pytest.mark.parametrize("key", list(BUILDS))
def test_two_ctas_an_sm_one_key_loop(built, key):
    r = built[key]
    assert 2 * r["shared"] <= 227 * 1024 and 2 * 128 * r["registers"] <= 65536, (r["shared"], r["registers"])
    assert r["loops"] == 1 and r["loop"].count("wgmma.mma_async") == 36 + 32
    if key != "token_lpart":  # [Note] Lab partial row sums: at 255 registers ptxas spills 24 bytes there
        assert r["spills"] == 0, r["spills"]


@pytest.mark.skipif(ON_GPU, reason="sm_90 builds on the CPU")
@pytest.mark.parametrize("key,base", [("token_lpart", "token"), ("token_lpart_f16", "token_f16")])
def test_partial_row_sums_take_the_sums_barriers_out_of_the_key_loop(built, key, base):
    """The per-block cross-warp column sum (its shared-memory round and barriers) leaves the key loop; the max's
    stays (the ablation no_max takes it out instead: as many barriers as L_PART)."""
    assert _bars(built[key]["loop"]) == _bars(built[base]["loop"]) - 3, (_bars(built[key]["loop"]),
                                                                         _bars(built[base]["loop"]))
    assert _bars(built["no_max"]["loop"]) == _bars(built["token_lpart"]["loop"])


@pytest.mark.skipif(ON_GPU, reason="sm_90 builds on the CPU")
def test_the_no_cvt_ablation_converts_nothing_and_still_loads_every_byte(built):
    token, no_cvt = built["token"]["loop"], built["no_cvt"]["loop"]
    assert token.count("fma.rn.bf16x2") == 2 * 72 and no_cvt.count("fma.rn.bf16x2") == 0
    v4 = r"ld\.global[.\w]*\.v4\.b32"
    assert len(re.findall(v4, no_cvt)) == len(re.findall(v4, token)) == 18
