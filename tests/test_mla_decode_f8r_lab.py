"""The register-A scores fp8 latent lab decode (lab/gluon_mla_decode_f8r.py, [Note] Lab register-A scores; issue 27
part 2). sm_90 builds without a GPU: two CTAs an SM without spills or serialised wgmma; a key loop whose scores'
wgmma take K from registers (no bf16 K tile: V's 8 chunks only), whose cache bytes come in 16-byte loads (18 a thread
a block) and are converted once each. On an H100: scripts/gpu_fp8lat_s11.py (checks against float64 on the
dequantized cache, NaN past the lengths, the split rule and one split and three, then % of copy)."""

import re

import pytest

from _env import ON_GPU
from test_hopper_compile import build_sm90

_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
from lab import gluon_mla_decode_f8r
from sm90 import loops, ptxas

out = {}
for key, kw in json.loads(sys.argv[2]).items():
    ck = gluon_mla_decode_f8r.compile_for(**kw)
    ptx = ck.asm["ptx"]
    res, log, _ = ptxas(ptx)
    res = next(iter(res.values()))
    body = loops(ptx, 8)
    out[key] = dict(shared=ck.metadata.shared, spills=res.spill_stores + res.spill_loads, stack=res.stack,
                    registers=res.registers, serialized="C7514" in log or "C7515" in log, loops=len(body),
                    loop=body[0] if body else "")
print("RESULT " + json.dumps(out))
"""

BUILDS = {"token": dict(), "tensor": dict(per_token=False), "token_split": dict(num_splits=3),
          "h8_sq2_none": dict(hq=8, sq=2, causal=False), "token_f16": dict(f16=True),
          "tensor_f16": dict(f16=True, per_token=False), "token_early": dict(early=True),
          "tensor_f16_early": dict(f16=True, per_token=False, early=True),
          "token_lpart_early": dict(l_part=1, early=True), "tensor_lmma_early": dict(l_part=2, per_token=False, early=True),
          "tensor_lmma_split": dict(l_part=2, per_token=False, num_splits=3),
          "tensor_f16_lmma_late": dict(l_part=2, per_token=False, f16=True, page_late=True),
          "token_lpart_late": dict(l_part=1, page_late=True), "tensor_f16_lmma": dict(l_part=2, per_token=False, f16=True),
          "token_f16_lpart_late": dict(l_part=1, f16=True, page_late=True)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, BUILDS, "gluon-mla-decode-f8r-lab")


@pytest.mark.skipif(ON_GPU, reason="sm_90 builds on the CPU")
@pytest.mark.parametrize("key", list(BUILDS))
def test_two_ctas_an_sm_without_spills(built, key):
    r = built[key]
    assert 2 * r["shared"] <= 227 * 1024 and 2 * 128 * r["registers"] <= 65536, (r["shared"], r["registers"])
    assert not r["serialized"], key
    # per token under F16 the block's scale max went across the warps: ptxas spilled ~330 bytes at 255 registers;
    # in-warp ([Note] Lab warp max of the scales) 220 registers
    assert r["spills"] == 0 and r["stack"] == 0, r["spills"]
    assert r["shared"] < (98 if "lmma" in key else 90) * 1024  # V (64 KB), Q (18 KB), P (and L_PART 2's ones)


@pytest.mark.skipif(ON_GPU, reason="sm_90 builds on the CPU")
@pytest.mark.parametrize("key", ["token", "tensor", "token_f16", "tensor_f16", "token_early", "tensor_f16_early"])
def test_the_scores_take_k_from_registers(built, key):
    """36 score k-steps with A in registers (a {..} register list where a descriptor would be) and 32 V^T P^T
    k-steps from shared memory (8 chunks of 64 latent rows, 4 k-steps each); 18 16-byte loads of the next block a
    thread, no byte loads; each word converted once (72 a thread: two bf16x2 fma each, or under F16 two hardware
    cvt, [Note] Lab fp16 dots)."""
    loop = built[key]["loop"]
    wgmma = re.findall(r"wgmma\.mma_async[^;]*;", loop, flags=re.S)
    reg_a = [w for w in wgmma if re.search(r"\}\s*,\s*\{", w)]
    assert len(wgmma) == 36 + 32 and len(reg_a) == 36, (len(wgmma), len(reg_a))
    assert len(re.findall(r"ld\.global[.\w]*\.v4\.b32", loop)) == 18
    assert not re.findall(r"ld\.global[.\w]*\.(?:u8|b8|s8)\b", loop)
    f16 = "f16" in key
    assert loop.count("fma.rn.bf16x2") == (0 if f16 else 2 * 72)
    assert loop.count("cvt.rn.f16x2.e4m3x2") == (2 * 72 if f16 else 0)
    assert ("m64n16k16.f32.f16.f16" in loop) == f16


@pytest.mark.skipif(ON_GPU, reason="sm_90 builds on the CPU")
@pytest.mark.parametrize("key", ["token", "tensor", "tensor_f16"])
def test_v_chunks_are_separate_allocations_without_a_barrier_each(built, key):
    """[Note] Lab separate buffers: with V's 8 chunks in one allocation Triton's barrier pass put a CTA barrier
    before each chunk's store (14 in the key loop); as 8 allocations, 7."""
    loop = built[key]["loop"]
    assert len(re.findall(r"\bbar\.sync|\bbarrier\.sync", loop)) <= 7


@pytest.mark.skipif(ON_GPU, reason="sm_90 builds on the CPU")
@pytest.mark.parametrize("key", ["token_early", "tensor_f16_early"])
def test_early_loads_go_out_chunk_by_chunk(built, key):
    """[Note] Lab early loads: the next block's two 16-byte loads of a chunk follow that chunk's score wgmma (4
    k-steps), not the block's 36: the loads are spread over the scores instead of issued after them."""
    loop = built[key]["loop"]
    marks = "".join("L" if re.search(r"ld\.global[.\w]*\.v4", x) else "W" for x in loop.splitlines()
                    if re.search(r"ld\.global[.\w]*\.v4|wgmma\.mma_async", x))
    assert marks[:6 * 9].count("L") == 18 and marks.startswith("WWWWLL"), marks


@pytest.mark.skipif(ON_GPU, reason="sm_90 builds on the CPU")
@pytest.mark.parametrize("key", ["token_lpart_early", "tensor_lmma_early"])
def test_row_sums_leave_the_key_loop_without_serialising_the_wgmma(built, key):
    """L_PART 1 ([Note] Lab partial row sums) and 2 ([Note] Lab row sums by the tensor cores): no cross-warp sum a
    block (at most 4 CTA barriers in the key loop, against 7), and P V retired before the loop's back edge so that
    ptxas keeps the wgmma asynchronous (with the wait at the loop's top it serialised them: C7515); L_PART 2's
    ones tile adds one V^T chunk (4 wgmma)."""
    r = built[key]
    assert not r["serialized"] and r["spills"] == 0
    assert len(re.findall(r"\bbar\.sync|\bbarrier\.sync", r["loop"])) <= 4
    assert r["loop"].count("wgmma.mma_async") == 36 + 32 + (4 if "lmma" in key else 0)


@pytest.mark.skipif(ON_GPU, reason="sm_90 builds on the CPU")
@pytest.mark.parametrize("key", ["tensor_f16_lmma_late", "token_lpart_late"])
def test_late_page_clamp_leaves_the_table_read_unconsumed_in_its_step(built, key):
    """[Note] Lab late page clamp: the block table's entry for the block after next is loaded in the key loop and
    clamped only in the next step, where it addresses the bytes (round A's ncu: the clamp right after the load
    held ~9% of the ninth session's kernel's stall samples, long scoreboard). So no min/max follows the entry's
    load in the loop body."""
    loop = built[key]["loop"].splitlines()
    at = [i for i, x in enumerate(loop) if re.search(r"ld\.global(?:\.nc)?\.b32 ", x)]
    assert at  # the entry's load is the loop's last 4-byte load (per token the scales' two come before it)
    assert not any(re.search(r"\b(?:max|min)\.s32", x) for x in loop[at[-1]:]), "clamped in the load's step"
