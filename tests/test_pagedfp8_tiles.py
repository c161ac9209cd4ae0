"""The paged fp8 decode's tiles on sm_90 (eighteenth session; [Note] Paged fp8 decode tiles in
fagen/backends/triton.py, [Note] Split heuristic in the decode template): 64-key blocks on 2 warps, and the split rule
counts 4 programs an SM for them (2 splits at b32 x 8 KV heads, where 128-key blocks on 8 warps took 1). The default
tile must match the float64 reference on the dequantized cache at small shapes (pages of 4, 16 and 64 keys against
the 64-key block; lengths that are multiples of neither; shuffled page tables with entries past each sequence
pointing outside the cache), through the split rule, one split and three; and its sm_90
build must hold the 4 programs an SM the rule counts (registers and shared memory), without spills."""

import json
import os
import subprocess
import sys

import pytest

import fagen
from _env import ON_GPU
from fagen.runtime.loader import load_source
from test_fp8kv_paged import HD, HKV, G, _check, _problem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _spec(**fields):
    return fagen.KernelSpec(kind="decode", dtype="bf16", gqa=G, head_dim=HD, **fields)


def _pps(spec) -> int:
    line = next(x for x in fagen.generate(spec).splitlines() if x.startswith("PROGRAMS_PER_SM = "))
    return int(line.split("=")[1])


def test_the_split_rule_counts_four_programs_an_sm_for_the_two_warp_paged_tiles():
    paged = _spec(kv_dtype="fp8_e4m3", layout="paged")
    assert (paged.block_n, paged.num_warps, paged.num_stages) == (64, 2, 3)
    assert _pps(paged) == 4 and _pps(_spec(kv_dtype="fp8_e5m2", layout="paged")) == 4
    # 2 everywhere else: the old paged tile, the dense fp8 cache, the bf16 caches, MLA's shared latent cache
    assert _pps(_spec(kv_dtype="fp8_e4m3", layout="paged", block_n=128, num_warps=8)) == 2
    # (the dense fp8 cache at its pre-sm_90 tile: on sm_90 an e4m3 d128 cache takes the 2-warp tile by default,
    # counted at 4, tests/test_fp8dec_tiles.py)
    assert _pps(_spec(kv_dtype="fp8_e4m3", block_n=128, num_warps=4)) == 2 and _pps(_spec(layout="paged")) == 2 \
        and _pps(_spec()) == 2
    assert _pps(_spec(layout="paged", num_warps=2)) == 2  # a bf16 cache's 2-warp tile: not measured, not counted
    mla = fagen.KernelSpec(head_dim=576, head_dim_v=512, shared_kv=True, kind="decode", gqa=16, dtype="bf16",
                           layout="paged", kv_dtype="fp8_e4m3", num_warps=2)
    assert _pps(mla) == 2
    # the serving row's shape (b32 x 8 KV heads, 8192 keys, 132 SMs): 2 splits, where the old tile took 1
    new = load_source(fagen.generate(paged), f"{paged.name}_pps")
    old_spec = _spec(kv_dtype="fp8_e4m3", layout="paged", block_n=128, num_warps=8)
    old = load_source(fagen.generate(old_spec), f"{old_spec.name}_pps")
    assert new.num_splits_for(32 * 8, 8192, 132) == 2 and old.num_splits_for(32 * 8, 8192, 132) == 1
    assert new.num_splits_for(128 * 8, 8192, 132) == 1  # b128 fills the 528 slots alone


@pytest.mark.parametrize("page,form", [(4, "head"), (16, "token"), (64, "tensor"), (16, "head")])
def test_the_default_tile_matches_the_dequantized_reference(page, form):
    """The product's default paged fp8 tile (not the small blocks test_fp8kv_paged.py pins on the CPU), through the
    split rule (several splits and the merge at these small batches), one split (DIRECT) and three."""
    spec = _spec(kv_dtype="fp8_e4m3", layout="paged")
    m = load_source(fagen.generate(spec), f"{spec.name}_tiles")
    assert m.BLOCK_N == 64 and m.NUM_WARPS == 2
    q, kc, vc, kw, seqs = _problem("fp8_e4m3", page, form, seed=100 + page)
    for out, lse in (m.forward(q, kc, vc, **kw), m.forward_split(q, kc, vc, num_splits=1, **kw),
                     m.forward_split(q, kc, vc, num_splits=3, **kw)):
        _check(out, lse, q, seqs)


_BUILD = r"""
import json, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import fagen
from fagen.runtime.loader import load_source
from sm90 import ptxas
PTR = {"Q": "*bf16", "K": "*fp8e4nv", "V": "*fp8e4nv", "Dst": "*fp32", "DstLse": "*fp32", "Out": "*bf16",
       "Lse": "*fp32", "Counter": "*i32", "SeqlensK": "*i32", "KScale": "*fp32", "VScale": "*fp32",
       "BlockTable": "*i32"}
spec = fagen.KernelSpec(head_dim=128, gqa=4, kind="decode", layout="paged", dtype="bf16", kv_dtype="fp8_e4m3")
m = load_source(fagen.generate(spec), spec.name + "_sm90")
fn, out = m._decode_split, {}
for direct in (True, False):
    consts = dict(HEAD_DIM=128, BLOCK_D=128, HEAD_DIM_V=128, BLOCK_DV=128, ROWS=m.tile_rows(4), BLOCK_N=spec.block_n,
                  GQA=4, DOT=m.tile_rows(4) >= 16, DIRECT=direct, SPLITS_PER_SEQ=0, UPCAST=False, ROWS32=1)
    sig, cx, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        n = p.name
        if p.is_constexpr:
            sig[n], cx[n] = "constexpr", consts[n]
        elif n == "seq_q":
            sig[n], cx[n] = "constexpr", 1
        elif n in ("SeqlensQ", "TreeMask", "KTok", "VTok"):
            sig[n], cx[n] = "constexpr", None
        elif n in PTR:
            sig[n] = PTR[n]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in ("qk_scale", "k_scale", "v_scale"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if n.startswith("stride_") and n not in ("stride_qm", "stride_om", "stride_dm", "stride_tb", "stride_tm"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs), target=GPUTarget("cuda", 90, 128),
                        options=dict(num_warps=spec.num_warps, num_stages=spec.num_stages))
    r = next(iter(ptxas(ck.asm["ptx"])[0].values()))
    out[str(direct)] = dict(regs=r.registers, spills=r.spill_stores + r.spill_loads, shared=ck.metadata.shared,
                            warps=ck.metadata.num_warps, pps=m.PROGRAMS_PER_SM)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.skipif(ON_GPU, reason="builds for sm_90 on the CPU (a GPU machine runs the kernel itself)")
def test_the_default_tile_builds_four_programs_an_sm_without_spills(tmp_path):
    """sm_90 (ptxas): the one-split kernel and the split one hold the PROGRAMS_PER_SM the rule counts, by registers
    (65536 an SM) and by shared memory (228 KB an SM, 1 KB of it a block's reserve), with no spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FAGEN_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _BUILD, ROOT], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    built = json.loads(proc.stdout.split("RESULT ", 1)[1])
    for direct, r in built.items():
        # the swapped step's one-split form keeps 3 words on the stack outside its key loops ([Note] Swapped dots;
        # sm_90 SASS: STL before the loops, LDL after)
        assert r["spills"] <= (28 if direct == "True" else 0) and r["warps"] == 2, (direct, r)
        assert r["pps"] == 4, r
        assert r["pps"] * -(-r["regs"] // 8) * 8 * 32 * r["warps"] <= 65536, (direct, r)  # registers (by 8s)
        assert r["pps"] * (r["shared"] + 1024) <= 228 * 1024, (direct, r)  # shared memory
