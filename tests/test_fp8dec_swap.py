"""Swapped dots in the fp8 decode (twentieth session; [Note] Swapped dots in the decode template). With SWAP_AB a
tile of 3 to 8 packed query rows (GQA 4 or 8 at one query, GQA 4 at two) takes 8 rows, and the key step computes
S^T = K q^T and O^T += V^T P^T with the keys as the mma's M. On since round B (H200) for the measured cache (e4m3,
d128, bf16 queries, dense and paged); other fp8 caches render it off and take 16 rows. On, the kernels must match
float64 on the dequantized cache (dense and paged, per-head and per-token scales, through the split rule, one split,
three and the batch-invariant chunks), give batch_invariant=True's bits alone and in a batch, and build for sm_90
with fewer instructions a key and no spills in the dense tiles."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import fagen
from _env import DEVICE, ON_GPU
from fagen.runtime.loader import load_source
from test_fp8dec_tiles import _check as _check_dense
from test_fp8dec_tiles import _problem as _dense_problem
from test_fp8kv_paged import HD as PAGED_HD
from test_fp8kv_paged import G as PAGED_G
from test_fp8kv_paged import _check as _check_paged
from test_fp8kv_paged import _problem as _paged_problem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ON = (r"^SWAP_AB = tl\.constexpr\(False\)$", "SWAP_AB = tl.constexpr(True)")


def _spec(**fields):
    return fagen.KernelSpec(kind="decode", **{"head_dim": 128, "dtype": "bf16", "gqa": 4, "kv_dtype": "fp8_e4m3",
                                              **fields})


def _swapped(spec, tag="", also=()):
    """The render with SWAP_AB on, and the constexpr flags in `also` ([Note] Lazy rescale)."""
    src = fagen.generate(spec)
    for flag in ("SWAP_AB", *also):
        src, n = re.subn(rf"^{flag} = tl\.constexpr\((False|True)\)$", f"{flag} = tl.constexpr(True)", src, flags=re.M)
        assert n == 1, (spec.name, flag)
    return load_source(src, f"{spec.name}_swap{tag}{''.join(also)}")


def test_on_for_the_measured_cache_off_for_other_fp8_caches_and_absent_elsewhere():
    """On (round B, H200) for e4m3 d128 with bf16 queries, dense and paged; other fp8 caches render it off."""
    for spec, on in ((_spec(), True), (_spec(layout="paged"), True), (_spec(kv_dtype="fp8_e5m2"), False),
                     (_spec(dtype="fp16"), False), (_spec(head_dim=64), False)):
        lines = [x for x in fagen.generate(spec).splitlines() if x.startswith("SWAP_AB")]
        assert lines == [f"SWAP_AB = tl.constexpr({on})"], spec.name
        m = load_source(fagen.generate(spec), f"{spec.name}_swapon")
        assert (m.tile_rows(4), m.tile_rows(8), m.tile_rows(2)) == ((8, 8, 2) if on else (16, 16, 2)), spec.name
    mla = fagen.KernelSpec(head_dim=576, head_dim_v=512, shared_kv=True, kind="decode", gqa=16, dtype="bf16",
                           kv_dtype="fp8_e4m3")
    for spec in (_spec(kv_dtype=None), _spec(kv_dtype=None, layout="paged"), mla):
        assert "SWAP_AB" not in fagen.generate(spec), spec.name


def test_on_tiles_of_three_to_eight_rows_take_eight():
    m = _swapped(_spec(), "rows")
    assert [m.tile_rows(r) for r in (1, 2, 3, 4, 8, 12, 16, 32)] == [1, 2, 8, 8, 8, 16, 16, 32]
    assert m._geometry(32, 8, 1, 8192, None, 0)[:2] == (8, 1)  # GQA 4, one query: one tile of 8 rows
    assert m._geometry(32, 8, 4, 8192, None, 0)[:2] == (16, 1)  # 16 rows: the row-major dots


@pytest.mark.parametrize("form,sk,shape_tile", [("head", 77, False), ("token", 130, False), ("head", 77, True),
                                                 ("head", 1, False)])
def test_dense_swapped_matches_the_dequantized_reference(form, sk, shape_tile):
    """The product's dense tile (n64w2s3) and its tile by shape (n32w1s4) with the dots swapped, through the split
    rule, one split, three and the batch-invariant chunks; lengths that are multiples of no block."""
    m = _swapped(_spec(), f"ref{int(shape_tile)}")
    m.SHAPE_TILE_MIN_CHUNK = 1 if shape_tile else 10**9  # read by the rule's first call at a shape (memoised)
    assert m._geometry(3, 2, 1, 64 * -(-sk // 64), None, 0)[4] == (m.SHAPE_TILE if shape_tile else m.TILE)
    q, kc, vc, kw, seqs = _dense_problem(form, seed=sk + 7, sk=sk)
    for out, lse in (m.forward(q, kc, vc, **kw), m.forward_split(q, kc, vc, num_splits=1, **kw),
                     m.forward_split(q, kc, vc, num_splits=3, **kw),
                     m.forward(q, kc, vc, batch_invariant=True, **kw)):
        _check_dense(out, lse, q, seqs)


@pytest.mark.parametrize("also", [("LAZY_RESCALE",)])
def test_dense_swapped_with_the_lazy_rescale(also):
    """The lazy rescale on the swapped step (round B's candidate; off): the same float64 checks over 301 keys (5
    blocks in one split)."""
    m = _swapped(_spec(), "b", also)
    q, kc, vc, kw, seqs = _dense_problem("head", seed=31, sk=301)
    for out, lse in (m.forward(q, kc, vc, **kw), m.forward_split(q, kc, vc, num_splits=1, **kw),
                     m.forward_split(q, kc, vc, num_splits=3, **kw)):
        _check_dense(out, lse, q, seqs)


@pytest.mark.parametrize("gqa,sq", [(8, 1), (4, 2), (2, 2)])
def test_dense_swapped_at_eight_rows_of_other_groups(gqa, sq):
    """8 packed rows of GQA 8 at one query and GQA 4 at two queries (rows r = g * Sq + i), 4 of GQA 2 at two."""
    from fagen.verify import reference
    from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare
    m = _swapped(_spec(gqa=gqa), f"g{gqa}")
    assert m.tile_rows(gqa * sq) == 8
    gen = torch.Generator().manual_seed(gqa * 10 + sq)
    q = torch.randn(2, 2 * gqa, sq, 128, generator=gen).mul(2).bfloat16()
    kc, vc = (torch.randn(2, 2, 301, 128, generator=gen).to(torch.float8_e4m3fn) for _ in range(2))
    ks, vs = torch.exp2(torch.rand(2, generator=gen) * 6 - 3), torch.exp2(torch.rand(2, generator=gen) * 6 - 3)
    kd, vd = reference.dequantize(kc, ks, 1), reference.dequantize(vc, vs, 1)
    want, wlse = reference.attention(q.double(), kd, vd)
    unit = reference.attention(q.double(), kd, vd.abs())[0].clamp(min=1.0)
    qd, kcd, vcd, ksd, vsd = (t.to(DEVICE) for t in (q, kc, vc, ks, vs))
    for out, lse in (m.forward(qd, kcd, vcd, k_scale=ksd, v_scale=vsd),
                     m.forward_split(qd, kcd, vcd, num_splits=1, k_scale=ksd, v_scale=vsd),  # 5 blocks in one split
                     m.forward_split(qd, kcd, vcd, num_splits=3, k_scale=ksd, v_scale=vsd)):
        compare("out", out.cpu().double() / unit, want / unit, **TOLERANCE["bf16"])
        compare("lse", lse.cpu(), wlse, **LSE_TOLERANCE)


@pytest.mark.parametrize("page,form", [(16, "head"), (16, "token"), (64, "tensor")])
def test_paged_swapped_matches_the_dequantized_reference(page, form):
    spec = _spec(layout="paged", head_dim=PAGED_HD, gqa=PAGED_G)
    m = _swapped(spec, "paged")
    assert (m.BLOCK_N, m.NUM_WARPS, m.tile_rows(4)) == (64, 2, 8)
    q, kc, vc, kw, seqs = _paged_problem("fp8_e4m3", page, form, seed=200 + page)
    for out, lse in (m.forward(q, kc, vc, **kw), m.forward_split(q, kc, vc, num_splits=1, **kw),
                     m.forward_split(q, kc, vc, num_splits=3, **kw),
                     m.forward(q, kc, vc, batch_invariant=True, **kw)):
        _check_paged(out, lse, q, seqs)


def test_batch_invariant_bits_alone_and_in_the_batch():
    """batch_invariant=True with the dots swapped: each sequence alone gives its rows' bits in the batch."""
    m = _swapped(_spec(), "inv")
    q, kc, vc, kw, _ = _dense_problem("head", seed=5, sk=200, b=4)
    out, lse = m.forward(q, kc, vc, batch_invariant=True, **kw)
    for i in range(q.shape[0]):
        o1, l1 = m.forward(q[i:i + 1], kc[i:i + 1], vc[i:i + 1], batch_invariant=True, **kw)
        assert torch.equal(o1[0], out[i]) and torch.equal(l1[0], lse[i]), i


_BUILD = r"""
import json, os, re, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
sys.path.insert(0, os.path.join(sys.argv[1], "lab"))
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import fagen
from fagen.runtime.loader import load_source
from sm90 import ptxas
from pagedfp8_swap_decode import loop_sass
PTR = {"Q": "*bf16", "K": "*fp8e4nv", "V": "*fp8e4nv", "Dst": "*fp32", "DstLse": "*fp32", "Out": "*bf16",
       "Lse": "*fp32", "Counter": "*i32", "KScale": "*fp32", "VScale": "*fp32", "SeqlensK": "*i32",
       "BlockTable": "*i32"}
out = {}
for layout in ("dense", "paged"):
    spec = fagen.KernelSpec(head_dim=128, gqa=4, kind="decode", dtype="bf16", kv_dtype="fp8_e4m3", layout=layout)
    for swap in (False, True):
        src = fagen.generate(spec)
        src = re.sub(r"^SWAP_AB = tl\.constexpr\((False|True)\)$", f"SWAP_AB = tl.constexpr({swap})", src, flags=re.M)
        m = load_source(src, f"{spec.name}_sm90_{int(swap)}")
        fn = m._decode_split
        tiles = [m.TILE, m.SHAPE_TILE] if layout == "dense" else [(m.BLOCK_N, m.NUM_WARPS, m.NUM_STAGES, 4)]
        for bn, nw, ns, pps in tiles:
            rows = m.tile_rows(4)
            consts = dict(HEAD_DIM=128, BLOCK_D=128, HEAD_DIM_V=128, BLOCK_DV=128, ROWS=rows, BLOCK_N=bn, GQA=4,
                          DOT=rows >= 16, DIRECT=True, SPLITS_PER_SEQ=0, UPCAST=False, ROWS32=1)
            sig, cx, attrs = {}, {}, {}
            for i, p in enumerate(fn.params):
                n = p.name
                if p.is_constexpr:
                    sig[n], cx[n] = "constexpr", consts[n]
                elif n == "seq_q":
                    sig[n], cx[n] = "constexpr", 1
                elif n in ("SeqlensQ", "TreeMask", "KTok", "VTok") or (n == "SeqlensK" and layout == "dense"):
                    sig[n], cx[n] = "constexpr", None
                elif n in PTR:
                    sig[n] = PTR[n]
                    attrs[(i,)] = [["tt.divisibility", 16]]
                elif n in ("qk_scale", "k_scale", "v_scale"):
                    sig[n] = "fp32"
                else:
                    sig[n] = "i32"
                    if n.startswith("stride_") and n not in ("stride_qm", "stride_om", "stride_dm", "stride_tb",
                                                              "stride_tm", "stride_zb", "stride_zh", "stride_zn") \
                            or n in ("seq_k", "chunk"):  # the timed shapes' (scripts/gpu_fp8dec_s20.py --dry-run)
                        attrs[(i,)] = [["tt.divisibility", 16]]
            ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs),
                                target=GPUTarget("cuda", 90, 128), options=dict(num_warps=nw, num_stages=ns))
            r = next(iter(ptxas(ck.asm["ptx"])[0].values()))
            out[f"{layout} n{bn}w{nw} swap={int(swap)}"] = dict(
                regs=r.registers, spills=r.spill_stores + r.spill_loads, shared=ck.metadata.shared, warps=nw, pps=pps,
                per_key=min(x["per_key"] for x in loop_sass(ck, bn, nw, "HMMA")))
print("RESULT " + json.dumps(out))
"""


@pytest.mark.skipif(ON_GPU, reason="builds for sm_90 on the CPU (a GPU machine runs the kernel itself)")
def test_the_swapped_steps_build_with_fewer_instructions_a_key(tmp_path):
    """sm_90 (ptxas, cuobjdump): each product tile's unmasked key loop with the dots swapped issues at most 80% of
    the warp instructions a key of the same tile unswapped (19.4 -> 14.0 at n32w1s4, 18.8 -> 14.6 at n64w2s3, paged
    19.1 -> 14.7 when written), holds the programs an SM its rule counts, and the dense tiles spill nothing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FAGEN_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _BUILD, ROOT], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    built = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert len(built) == 6, built
    for name, r in built.items():
        if name.endswith("swap=1"):
            was = built[name.replace("swap=1", "swap=0")]
            assert r["per_key"] <= 0.8 * was["per_key"], (name, r, was)
            assert r["spills"] == 0 or name.startswith("paged"), (name, r)
        assert r["pps"] * -(-r["regs"] // 8) * 8 * 32 * r["warps"] <= 65536, (name, r)  # registers (by 8s)
        assert r["pps"] * (r["shared"] + 1024) <= 228 * 1024, (name, r)  # shared memory
