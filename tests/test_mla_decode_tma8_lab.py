"""The lab fp8 latent MLA decode with a TMA ring (lab/gluon_mla_decode_tma8.py, [Note] Lab fp8 TMA ring; issue 27,
tenth session). It builds for sm_90 without a GPU: one CTA an SM (the ring, the bf16 tiles, Q and P in shared
memory), no spill, every wgmma asynchronous (no C7514/C7515 serialisation) with O^T split by query rows ([Note]
Lab O split); its key loop reads the cache only by TMA (five boxes a block, issued STAGES blocks ahead), never by
global loads, and converts each fp8 word once. On an H100: scripts/gpu_mladec_s10.py (checks against float64 on the
dequantized cache, NaN past the lengths, then % of copy bandwidth)."""

import re
from pathlib import Path

import pytest

from test_hopper_compile import build_sm90

ROOT = Path(__file__).resolve().parent.parent

_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
from lab import gluon_mla_decode_tma8
from sm90 import ptxas

out = {}
for key, kw in json.loads(sys.argv[2]).items():
    ck = gluon_mla_decode_tma8.compile_for(**kw)
    ptx = ck.asm["ptx"]
    res, log, _ = ptxas(ptx)
    res = next(iter(res.values()))
    out[key] = dict(shared=ck.metadata.shared, spills=res.spill_stores + res.spill_loads, stack=res.stack,
                    registers=res.registers, serialized="C7514" in log or "C7515" in log, ptx=ptx)
print("RESULT " + json.dumps(out))
"""

BUILDS = {"token": dict(), "token_split": dict(num_splits=3), "tensor": dict(per_token=False),
          "s2": dict(stages=2), "w4": dict(warps=4, stages=2), "token_f16": dict(f16=True),
          "tensor_f16": dict(f16=True, per_token=False), "h128_sq2_nq32": dict(hq=128, sq=2, nq=32),
          "h8_sq2_none": dict(hq=8, sq=2, causal=False), "w4_2chains": dict(warps=4, stages=3, s_accs=2)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, BUILDS, "gluon-mla-decode-tma8-lab")


def _key_loop(ptx):
    """The PTX of the outermost loop that issues wgmma, as LLVM annotates its blocks ("Loop Header: Depth=1" and
    "in Loop: Header=<it> Depth=1"): this kernel's loop is laid out in pieces (its back edges branch both ways)."""
    blocks, cur = [], []
    for line in ptx.splitlines():
        if re.match(r"^(\$L__BB\d+_\d+:|// %bb\.\d+:)", line) and cur:
            blocks.append(cur)
            cur = []
        cur.append(line)
    blocks.append(cur)
    head = lambda b: " ".join(b[:2])  # noqa: E731 - a block's label and its annotation line
    for b in blocks:
        m = re.match(r"^\$L__BB(\d+_\d+):.*Loop Header: Depth=1", b[0])
        if m:
            body = [x for x in blocks if x is b or f"in Loop: Header=BB{m.group(1)} Depth=1" in head(x)]
            text = "\n".join("\n".join(x) for x in body)
            if "wgmma.mma_async" in text:
                return text
    return ""


@pytest.mark.parametrize("key", list(BUILDS))
def test_one_cta_an_sm_without_spills_or_serialised_wgmma(built, key):
    r = built[key]
    assert r["shared"] <= 227 * 1024, r["shared"]
    assert r["spills"] == 0 and r["stack"] == 0 and not r["serialized"], (r["spills"], r["serialized"])


@pytest.mark.parametrize("key", ["token", "tensor", "token_f16", "tensor_f16", "s2", "w4", "w4_2chains"])
def test_the_key_loop_reads_by_tma_and_converts_once(built, key):
    """Per 64-key block: five TMA boxes (four [64, 32] int32 latent, one [64, 16] rope) into the ring, no global
    load of the cache (at most the per-token scales and a page index: 32-bit loads, no vectors), each word
    converted once (the block's 36 KB over 256 threads: 36 words, 72 with one warpgroup), 36 S^T k-steps and
    V^T P^T's 4 x 2 x 4 (two m64 tiles of 128 rows, 4 k-steps)."""
    loop = _key_loop(built[key]["ptx"])
    words = 72 if key.startswith("w4") else 36
    assert loop.count("cp.async.bulk.tensor.2d.shared::cluster.global") == 5, loop.count("cp.async.bulk.tensor")
    assert not re.findall(r"ld\.global[.\w]*\.v\d", loop)
    f16 = key.endswith("f16")
    assert loop.count("fma.rn.bf16x2") == (0 if f16 else 2 * words)
    assert loop.count("cvt.rn.f16x2.e4m3x2") == (2 * words if f16 else 0)
    assert loop.count("wgmma.mma_async") == 36 + 32, loop.count("wgmma.mma_async")
    assert len(re.findall(r"ld\.shared\.v4\.b32", loop)) == words // 4


def test_the_kernel_clamps_page_indexes_and_lengths():
    """As the product's [Note] Gluon decode memory safety: a page index clamped to the cache, a length to the block
    table's capacity, the pages past the split read masked, and rows past the sequence end zeroed before P V."""
    src = (ROOT / "lab" / "gluon_mla_decode_tma8.py").read_text()
    assert "return gl.minimum(gl.maximum(page, 0), num_pages - 1)" in src
    assert "seq_len = gl.minimum(gl.maximum(gl.load(Seqlens + b), 0), bt_width * PAGE)" in src
    assert "page = gl.load(BlockTable + bt_row + start // PAGE, mask=ok, other=0)" in src
    assert "x = gl.where(ok, x, gl.zeros_like(x))" in src
