"""The dense fp8 decode's tiles and split rule by shape (nineteenth session; [Note] fp8 decode tiles by shape in
fagen/backends/triton.py, [Note] Split heuristic in the decode template). With DENSE_FP8_TWO_WARPS a dense fp8 cache
on sm_90 takes 64-key blocks on 2 warps, whose split rule counts 4 programs an SM and takes the smallest split count
within 95% of the best wave efficiency (SPLIT_WAVES); where that rule chooses the count, batches that leave a second
tile's slots idle with chunks of 1024 keys or more take it (SHAPE_TILE: 32-key blocks on one warp, 6 an SM); forced
counts and batch_invariant=True keep the spec's tile. Off, the render is the one before (128 keys on 4 warps, 2 an SM,
85%). Both tiles must match the float64 reference on the dequantized cache at lengths that are multiples of no block,
through the rule, one split and three, with per-head and per-token scales; batch_invariant=True must give a sequence
the same bits alone and in a batch; the sm_90 builds must hold the programs an SM their rule counts, without spills."""

import json
import os
import subprocess
import sys

import pytest
import torch

import fagen
from _env import DEVICE, ON_GPU
from fagen.backends import triton as triton_backend
from fagen.runtime.loader import load_source
from fagen.verify import reference
from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HKV, G = 2, 4


def _spec(kv="fp8_e4m3", **fields):
    return fagen.KernelSpec(kind="decode", dtype="bf16", gqa=G, kv_dtype=kv, **{"head_dim": 128, **fields})


@pytest.fixture
def two_warps(monkeypatch):
    monkeypatch.setattr(triton_backend, "DENSE_FP8_TWO_WARPS", True)


def _lines(spec, *starts):
    return [x.strip() for x in fagen.generate(spec).splitlines() if x.strip().startswith(starts)]


def _module(spec, tag=""):
    return load_source(fagen.generate(spec), f"{spec.name}_s19{tag}")


def test_off_the_dense_fp8_render_is_the_one_before(monkeypatch):
    monkeypatch.setattr(triton_backend, "DENSE_FP8_TWO_WARPS", False)
    spec = _spec()
    assert (spec.block_n, spec.num_warps, spec.num_stages) == (128, 4, 3)
    assert _lines(spec, "PROGRAMS_PER_SM =", "SPLIT_WAVES =", "return min(n for") == [
        "PROGRAMS_PER_SM = 2", "return min(n for n, e in effs.items() if e >= 0.85 * best)"]


def test_the_lever_is_on_for_the_measured_cache_only():
    """The product's default since round B (H200): an e4m3 d128 cache; e5m2 and d64 were not measured."""
    assert triton_backend.DENSE_FP8_TWO_WARPS
    assert (_spec().block_n, _spec().num_warps, _spec().num_stages) == (64, 2, 3)
    for other in (_spec("fp8_e5m2"), _spec(head_dim=64)):
        assert (other.block_n, other.num_warps, other.num_stages) == (128, 4, 3), other.name
        assert not _lines(other, "SPLIT_WAVES =", "SHAPE_TILE =")


@pytest.mark.parametrize("kv", ["fp8_e4m3"])
def test_on_a_dense_fp8_cache_takes_two_warps_and_the_95_percent_rule(two_warps, kv):
    spec = _spec(kv)
    assert (spec.block_m, spec.block_n, spec.num_warps, spec.num_stages) == (64, 64, 2, 3), spec.name
    assert _lines(spec, "PROGRAMS_PER_SM =", "SPLIT_WAVES =", "return min(n for") == [
        "PROGRAMS_PER_SM = 4", "SPLIT_WAVES = 0.95",
        "return min(n for n, e in effs.items() if e >= SPLIT_WAVES * best)"]
    m = _module(spec, kv)
    # splits on 132 SMs (528 slots) at 8 KV heads: the serving suite's rows and the grid between them
    want = {(8, 32768): 8, (8, 4096): 8, (16, 8192): 4, (32, 8192): 2, (32, 32768): 2, (64, 8192): 1,
            (128, 4096): 1}
    assert {k: m.num_splits_for(k[0] * 8, k[1], 132) for k in want} == want
    # the tile by shape: one warp on 32 keys where B x 8 KV heads leave its 792 slots 80% empty and its split count
    # keeps chunks of 1024 keys or more; else the spec's tile. (block_n, splits):
    tiles = {(8, 32768): (32, 12), (8, 4096): (64, 8), (8, 8192): (64, 8), (16, 8192): (32, 6), (32, 4096): (32, 3),
             (32, 8192): (32, 3), (64, 8192): (32, 3), (128, 4096): (64, 1), (128, 8192): (64, 1)}
    assert {k: (m._geometry(k[0], 8, 1, k[1], None, 0)[4][0], m._geometry(k[0], 8, 1, k[1], None, 0)[3])
            for k in tiles} == tiles
    assert m.SHAPE_TILE == (32, 1, 4, 6) and m.TILE == (64, 2, 3, 4)
    for forced in (3, (m.INVARIANT_MIN_CHUNK, m.INVARIANT_SPLITS)):  # forward_split, Plans, batch_invariant=True
        assert m._geometry(32, 8, 1, 8192, forced, 0)[4] == m.TILE
    assert m._geometry(32, 8, 2, 8192, None, 0)[4] == m.TILE  # two queries a sequence: the spec's tile
    # the 85% rule on the same slots took 7 at b8 (448 programs, 0.85 of a wave); the e4m3 d128 paged render takes
    # the 95% rule too since the twentieth session (8 splits), other paged renders keep 85%
    paged = _module(_spec(kv, layout="paged"), "paged")
    assert (paged.BLOCK_N, paged.NUM_WARPS, paged.PROGRAMS_PER_SM) == (64, 2, 4)
    assert paged.num_splits_for(8 * 8, 32768, 132) == 8
    e5m2 = _module(_spec("fp8_e5m2", layout="paged"), "paged5")
    assert e5m2.num_splits_for(8 * 8, 32768, 132) == 7


def test_on_other_caches_keep_their_tiles(two_warps):
    assert (_spec(arch="sm_80").block_n, _spec(arch="sm_80").num_warps) == (64, 4)  # the lever is sm_90's
    assert (_spec(head_dim=256).num_warps, _spec(None).num_warps) == (4, 4)
    assert _spec(block_n=128, num_warps=4).block_n == 128  # a field the spec sets stays
    for spec in (_spec(None), _spec(None, layout="paged"), _spec("fp8_e5m2", layout="paged"),
                 _spec(block_n=128, num_warps=4)):
        assert not _lines(spec, "SPLIT_WAVES ="), spec.name
    # the e4m3 d128 paged cache's 2-warp tile takes the 95% rule since the twentieth session (no tile by shape)
    assert _lines(_spec(layout="paged"), "SPLIT_WAVES =", "SHAPE_TILE =") == ["SPLIT_WAVES = 0.95"]
    mla = fagen.KernelSpec(head_dim=576, head_dim_v=512, shared_kv=True, kind="decode", gqa=16, dtype="bf16",
                           kv_dtype="fp8_e4m3")
    assert (mla.block_n, mla.num_warps) == (32, 4) and not _lines(mla, "SPLIT_WAVES =")


def _problem(form, seed, sk, b=3):
    """q and the dense caches [B, Hkv, Sk, D], their scales (per KV head or per token), the float64 dequantized k, v."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, HKV * G, 1, 128, generator=gen).mul(2).bfloat16()
    kc, vc = (torch.randn(b, HKV, sk, 128, generator=gen).to(torch.float8_e4m3fn) for _ in range(2))
    draw = lambda shape: torch.exp2(torch.rand(shape, generator=gen) * 6 - 3)  # noqa: E731
    ks, vs = {"head": (draw((HKV,)), draw((HKV,))), "token": (draw(kc.shape[:-1]), draw(vc.shape[:-1]))}[form]
    kd, vd = reference.dequantize(kc, ks, 1), reference.dequantize(vc, vs, 1)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return to(q), to(kc), to(vc), dict(k_scale=to(ks), v_scale=to(vs)), [(kd[i:i + 1], vd[i:i + 1]) for i in range(b)]


def _check(out, lse, q, seqs):
    for i, (k, v) in enumerate(seqs):
        want, wlse = reference.attention(q[i:i + 1].double().cpu(), k, v)
        terms, _ = reference.attention(q[i:i + 1].double().cpu(), k, v.abs())  # the softmax-weighted |v|
        unit = terms.clamp(min=1.0)
        compare(f"out {i}", out[i:i + 1].double().cpu() / unit, want / unit, **TOLERANCE["bf16"])
        compare(f"lse {i}", lse[i:i + 1].cpu(), wlse, **LSE_TOLERANCE)


@pytest.mark.parametrize("form,sk,shape_tile", [("head", 77, False), ("token", 130, False), ("head", 1, False),
                                                 ("head", 77, True), ("token", 130, True)])
def test_the_two_warp_tile_matches_the_dequantized_reference(two_warps, form, sk, shape_tile):
    """Through the split rule (several splits at this small batch; with shape_tile its chunks are long enough for
    SHAPE_TILE, whose launches then take 32-key blocks), one split (DIRECT), three, and the batch-invariant chunks;
    lengths that are multiples of no 64- or 32-key block."""
    spec = _spec()
    m = _module(spec, f"ref{int(shape_tile)}")
    assert (m.BLOCK_N, m.NUM_WARPS, m.PROGRAMS_PER_SM) == (64, 2, 4)
    m.SHAPE_TILE_MIN_CHUNK = 1 if shape_tile else 10**9  # read by the rule's first call at a shape (memoised)
    assert m._geometry(3, HKV, 1, 64 * -(-sk // 64), None, 0)[4] == (m.SHAPE_TILE if shape_tile else m.TILE)
    q, kc, vc, kw, seqs = _problem(form, seed=sk, sk=sk)
    for out, lse in (m.forward(q, kc, vc, **kw), m.forward_split(q, kc, vc, num_splits=1, **kw),
                     m.forward_split(q, kc, vc, num_splits=3, **kw),
                     m.forward(q, kc, vc, batch_invariant=True, **kw)):
        _check(out, lse, q, seqs)


def test_batch_invariant_bits_alone_and_in_the_batch(two_warps):
    """batch_invariant=True: each sequence's (out, lse) alone are its rows' bits in the batch, where the split rule
    (which follows the batch) takes other split counts for the two."""
    m = _module(_spec(), "inv")
    q, kc, vc, kw, _ = _problem("head", seed=5, sk=200, b=4)
    out, lse = m.forward(q, kc, vc, batch_invariant=True, **kw)
    for i in range(q.shape[0]):
        o1, l1 = m.forward(q[i:i + 1], kc[i:i + 1], vc[i:i + 1], batch_invariant=True, **kw)
        assert torch.equal(o1[0], out[i]) and torch.equal(l1[0], lse[i]), i
    assert m.num_splits_for(1 * 8, 8192, 132) != m.num_splits_for(64 * 8, 8192, 132)


_BUILD = r"""
import json, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import fagen
from fagen.backends import triton as triton_backend
from fagen.runtime.loader import load_source
from sm90 import ptxas
PTR = {"Q": "*bf16", "K": "*fp8e4nv", "V": "*fp8e4nv", "Dst": "*fp32", "DstLse": "*fp32", "Out": "*bf16",
       "Lse": "*fp32", "Counter": "*i32", "KScale": "*fp32", "VScale": "*fp32"}
triton_backend.DENSE_FP8_TWO_WARPS = True
spec = fagen.KernelSpec(head_dim=128, gqa=4, kind="decode", dtype="bf16", kv_dtype="fp8_e4m3")
m = load_source(fagen.generate(spec), spec.name + "_sm90")
fn, out = m._decode_split, {}
for (bn, nw, ns, pps), direct in [(t, d) for t in (m.TILE, m.SHAPE_TILE) for d in (True, False)]:
    consts = dict(HEAD_DIM=128, BLOCK_D=128, HEAD_DIM_V=128, BLOCK_DV=128, ROWS=m.tile_rows(4), BLOCK_N=bn,
                  GQA=4, DOT=m.tile_rows(4) >= 16, DIRECT=direct, SPLITS_PER_SEQ=0, UPCAST=False)
    sig, cx, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        n = p.name
        if p.is_constexpr:
            sig[n], cx[n] = "constexpr", consts[n]
        elif n == "seq_q":
            sig[n], cx[n] = "constexpr", 1
        elif n in ("SeqlensQ", "SeqlensK", "TreeMask", "KTok", "VTok"):
            sig[n], cx[n] = "constexpr", None
        elif n in PTR:
            sig[n] = PTR[n]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in ("qk_scale", "k_scale", "v_scale"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if n.startswith("stride_") and n not in ("stride_qm", "stride_om", "stride_dm", "stride_tb", "stride_tm",
                                                      "stride_zb", "stride_zh", "stride_zn"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs), target=GPUTarget("cuda", 90, 128),
                        options=dict(num_warps=nw, num_stages=ns))
    r = next(iter(ptxas(ck.asm["ptx"])[0].values()))
    out[f"n{bn} direct={direct}"] = dict(regs=r.registers, spills=r.spill_stores + r.spill_loads,
                                         shared=ck.metadata.shared, warps=ck.metadata.num_warps, pps=pps, want=nw)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.skipif(ON_GPU, reason="builds for sm_90 on the CPU (a GPU machine runs the kernel itself)")
def test_the_tiles_build_the_programs_an_sm_their_rule_counts_without_spills(tmp_path):
    """sm_90 (ptxas): the one-split kernel and the split one of the spec's tile (4 an SM) and of the tile by shape (6
    an SM) hold the programs an SM their rule counts, by registers (65536 an SM) and by shared memory (228 KB an SM,
    1 KB of it a block's reserve), with no spills in their key loops."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FAGEN_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _BUILD, ROOT], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    built = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert len(built) == 4
    for direct, r in built.items():
        # the swapped 2-warp step's one-split form keeps 3 words on the stack outside its key loops ([Note] Swapped
        # dots; sm_90 SASS: STL before the loops, LDL after), where seq_k and chunk are not known multiples of 16
        assert r["spills"] <= (28 if direct == "n64 direct=True" else 0) and r["warps"] == r["want"], (direct, r)
        assert r["pps"] == (4 if r["want"] == 2 else 6), r
        assert r["pps"] * -(-r["regs"] // 8) * 8 * 32 * r["warps"] <= 65536, (direct, r)  # registers (by 8s)
        assert r["pps"] * (r["shared"] + 1024) <= 228 * 1024, (direct, r)  # shared memory
