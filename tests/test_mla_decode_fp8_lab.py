"""The Gluon lab swap-AB MLA decodes, fp8 latent (lab/gluon_mla_decode_fp8.py, [Note] Lab fp8 swap-AB; issue 27
part 2) and bf16 (lab/gluon_mla_decode_sab.py). The fp8 one builds for sm_90 without a GPU, two CTAs an SM (shared
memory and registers), without spills and with its wgmma asynchronous; its key loop is one block's S^T (36
k-steps) and V^T P^T (4 x 4 k-steps of 128 rows), the cache read in 16-byte loads and converted once. On an H100:
scripts/gpu_mla_dec_s9.py (checks against float64 on the dequantized cache, NaN past the lengths, then % of copy
bandwidth)."""

import re
from pathlib import Path

import pytest

from test_hopper_compile import build_sm90

ROOT = Path(__file__).resolve().parent.parent

_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
from lab import gluon_mla_decode_fp8, gluon_mla_decode_sab
from sm90 import ptxas

out = {}
for key, kw in json.loads(sys.argv[2]).items():
    g = gluon_mla_decode_sab if kw.pop("sab", False) else gluon_mla_decode_fp8
    ck = g.compile_for(**kw)
    ptx = ck.asm["ptx"]
    res, log, _ = ptxas(ptx)
    res = next(iter(res.values()))
    out[key] = dict(shared=ck.metadata.shared, spills=res.spill_stores + res.spill_loads, stack=res.stack,
                    registers=res.registers, serialized="C7514" in log, ptx=ptx)
print("RESULT " + json.dumps(out))
"""

# 16 query rows (wgmma N 16). At 32 rows (Hq 16, Sq 2) the four [128, 32] accumulators take 128 registers a thread
# and ptxas spills 256 bytes: more rows want a second warpgroup (not done).
BUILDS = {"token": dict(), "token_split": dict(num_splits=3), "tensor": dict(per_token=False),
          "h8_sq2_none": dict(hq=8, sq=2, causal=False), "token_f16": dict(f16=True),
          "tensor_f16": dict(f16=True, per_token=False), "token_2chains": dict(s_accs=2),
          "token_2chains_split": dict(s_accs=2, num_splits=3), "token_2chains_f16": dict(s_accs=2, f16=True)}
SAB = {"sab": dict(sab=True), "sab_split": dict(sab=True, num_splits=3)}  # the bf16 swap-AB (gluon_mla_decode_sab)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, {**BUILDS, **SAB}, "gluon-mla-decode-fp8-lab")


@pytest.mark.parametrize("key", list(BUILDS))
def test_two_ctas_an_sm_without_spills(built, key):
    r = built[key]
    assert 2 * r["shared"] <= 227 * 1024 and 2 * 128 * r["registers"] <= 65536, r["shared"]
    assert r["spills"] == 0 and r["stack"] == 0 and not r["serialized"], (r["spills"], r["serialized"])


def _key_loop(ptx):
    """The PTX loop (a label .. a backward branch to it) that issues wgmma."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\$L__BB\d+_\d+):", line))}
    for j, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if m and m.group(1) in labels and labels[m.group(1)] < j:
            body = "\n".join(lines[labels[m.group(1)]:j + 1])
            if "wgmma.mma_async" in body:
                return body
    return ""


@pytest.mark.parametrize("key", ["token", "tensor", "token_f16", "tensor_f16"])
def test_the_key_loop_converts_once_and_reads_16_byte_rows(built, key):
    """Per 64-key block: 36 + 4 x 4 x 2 wgmma (S^T over 576 columns; V^T P^T, four 128-row accumulators of two
    m64 tiles, 4 k-steps each), 18 16-byte loads of the next block's bytes a thread (16 latent, 2 rope), and each
    fp8 word converted once (72 a thread: the block's 36 KB over 128 threads), with no byte loads: by the bf16
    asm's two bf16x2 multiplies a word, or under F16 ([Note] Lab fp16 dots) by two hardware cvt a word."""
    loop = _key_loop(built[key]["ptx"])
    assert loop.count("wgmma.mma_async") == 36 + 32, loop.count("wgmma.mma_async")
    assert len(re.findall(r"ld\.global[.\w]*\.v4\.b32", loop)) == 18
    assert not re.findall(r"ld\.global[.\w]*\.(?:u8|b8|s8)\b", loop)
    f16 = key.endswith("f16")
    assert loop.count("fma.rn.bf16x2") == (0 if f16 else 2 * 72)
    assert loop.count("cvt.rn.f16x2.e4m3x2") == (2 * 72 if f16 else 0)
    assert ("m64n16k16.f32.f16.f16" in loop) == f16
    assert loop.count("wgmma.wait_group") >= 2


def test_the_kernel_clamps_page_indexes_and_lengths():
    """As the product's [Note] Gluon decode memory safety: a page index clamped to the cache, a length to the block
    table's capacity, and the next block's page read only where it exists (masked)."""
    src = (ROOT / "lab" / "gluon_mla_decode_fp8.py").read_text()
    assert "return gl.minimum(gl.maximum(page, 0), num_pages - 1)" in src
    assert "seq_len = gl.minimum(gl.maximum(gl.load(Seqlens + b), 0), bt_width * PAGE)" in src
    assert "gl.load(BlockTable + bt_row + start // PAGE, mask=ok_block, other=0)" in src


@pytest.mark.parametrize("key", list(SAB))
def test_the_bf16_swap_ab_builds_one_cta_an_sm_without_spills(built, key):
    """[Note] Lab swap-AB bf16: two 72 KB slots, Q and P (one CTA an SM), no spill, the wgmma asynchronous, and
    one key loop of 36 + 32 wgmma."""
    r = built[key]
    assert r["shared"] <= 227 * 1024 and r["spills"] == 0 and r["stack"] == 0 and not r["serialized"], r["shared"]
    assert _key_loop(r["ptx"]).count("wgmma.mma_async") == 36 + 32
