"""The MLA 192/128 decode's tile and split rule (twenty-third session; [Note] MLA 192/128 decode tiles in
fagen/backends/triton.py, [Note] Split heuristic in the decode template). With MLA192_DECODE a d_qk 192 / d_v 128
decode on a dense bf16/fp16 cache of its own V takes MLA192_DECODE_TILE on sm_90, and its split rule counts the tile's
programs an SM; off, the render is the one before (m32n32w4s2, 2 an SM). The tile must match the float64 reference at
lengths that are multiples of no block (GQA 16 over one KV head) through the rule and forced splits, with an empty
sequence (out 0, lse -inf); its sm_90 builds must hold the programs an SM the rule counts, without spills."""

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
# (batch, KV length): the split count on 132 SMs with the lever on: the serving suite's rows, b8 and b1
SPLITS_ON = {(128, 4096): 2, (64, 8192): 4, (32, 32768): 7, (8, 32768): 29, (1, 32768): 128}
SPLITS_OFF = {(128, 4096): 2, (64, 8192): 4, (32, 32768): 7, (8, 32768): 28, (1, 32768): 114}


def _spec(**fields):
    return fagen.KernelSpec(**{"kind": "decode", "dtype": "bf16", "gqa": 16, "head_dim": 192, "head_dim_v": 128,
                               "mask": "none", **fields})


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setattr(triton_backend, "MLA192_DECODE", True)


def _lines(spec, *starts):
    return [x.strip() for x in fagen.generate(spec).splitlines() if x.strip().startswith(starts)]


def _module(spec, tag=""):
    return load_source(fagen.generate(spec), f"{spec.name}_s23{tag}")


def test_the_lever_is_on_with_the_measured_tile():
    """The branch's default since round B (H200): m32n64w4s3 at 2 programs an SM (round A's m32n32w4s3 at 3 lost to it
    at 7 of round B's 9 shapes)."""
    assert triton_backend.MLA192_DECODE and triton_backend.MLA192_DECODE_TILE == (64, 4, 3, 2)
    spec = _spec()
    assert spec.name == "decode_fwd_full_d192v128_m32n64w4s3_g16_bf16"
    assert _lines(spec, "PROGRAMS_PER_SM =") == ["PROGRAMS_PER_SM = 2"]


def test_off_the_render_is_the_one_before(monkeypatch):
    monkeypatch.setattr(triton_backend, "MLA192_DECODE", False)
    spec = _spec()
    assert (spec.block_m, spec.block_n, spec.num_warps, spec.num_stages) == (32, 32, 4, 2)
    assert _lines(spec, "PROGRAMS_PER_SM =") == ["PROGRAMS_PER_SM = 2"]
    m = _module(spec, "off")
    assert {k: m._geometry(k[0], 1, 1, k[1], None, 0)[3] for k in SPLITS_OFF} == SPLITS_OFF


def test_on_the_spec_takes_the_tile_and_its_programs_an_sm(on, monkeypatch):
    bn, nw, ns, pps = triton_backend.MLA192_DECODE_TILE
    for spec in (_spec(), _spec(mask="padding"), _spec(dtype="fp16"), _spec(mask="causal")):
        assert (spec.block_m, spec.block_n, spec.num_warps, spec.num_stages) == (32, bn, nw, ns), spec.name
        assert _lines(spec, "PROGRAMS_PER_SM =") == [f"PROGRAMS_PER_SM = {pps}"], spec.name
    m = _module(_spec(), "on")
    assert {k: m._geometry(k[0], 1, 1, k[1], None, 0)[3] for k in SPLITS_ON} == SPLITS_ON
    # forced counts and batch_invariant=True keep theirs: the invariant chunks follow the spec's constants only
    assert m._geometry(32, 1, 1, 32768, 3, 0)[3] == 3
    inv = m._geometry(32, 1, 1, 32768, (m.INVARIANT_MIN_CHUNK, m.INVARIANT_SPLITS), 0)
    assert inv[3] == m.INVARIANT_SPLITS
    # the tile's fourth field is what the rule counts (the default's is the template's own 2)
    monkeypatch.setattr(triton_backend, "MLA192_DECODE_TILE", (bn, nw, ns, 3))
    assert _lines(_spec(), "PROGRAMS_PER_SM =") == ["PROGRAMS_PER_SM = 3"]


def test_on_other_specs_keep_theirs(on):
    assert (_spec(arch="sm_80").block_n, _spec(arch="sm_80").num_stages) == (32, 2)  # the tile is sm_90's
    # a spec off the tile (its fields given) keeps the template's count
    bn = triton_backend.MLA192_DECODE_TILE[0]
    other = _spec(block_n=16 if bn != 16 else 64)
    assert triton_backend.decode_programs_per_sm(other) is None
    assert _lines(other, "PROGRAMS_PER_SM =") == ["PROGRAMS_PER_SM = 2"]
    for spec in (_spec(head_dim=128, head_dim_v=None), _spec(layout="paged"), _spec(kv_dtype="fp8_e4m3"),
                 fagen.KernelSpec(head_dim=576, head_dim_v=512, shared_kv=True, kind="decode", gqa=16, dtype="bf16"),
                 _spec(kind="prefill")):
        assert not triton_backend.decode_programs_per_sm(spec), spec.name
        assert not triton_backend.mla192_decode(spec), spec.name


def test_the_render_memo_follows_the_lever(monkeypatch):
    """One process renders the spec off, then on, then off: each render is the lever's (render_state keys it)."""
    spec = _spec(block_n=32, num_warps=4, num_stages=2)
    monkeypatch.setattr(triton_backend, "MLA192_DECODE", False)
    off = fagen.generate(spec)
    monkeypatch.setattr(triton_backend, "MLA192_DECODE_TILE", (32, 4, 2, 5))
    monkeypatch.setattr(triton_backend, "MLA192_DECODE", True)
    assert "PROGRAMS_PER_SM = 5" in fagen.generate(spec)  # the same spec (m32n32w4s2): the tile matches
    monkeypatch.setattr(triton_backend, "MLA192_DECODE", False)
    assert fagen.generate(spec) == off


@pytest.mark.parametrize("mask", ["none", "padding"])
def test_on_matches_float64_at_odd_lengths(on, mask):
    """GQA 16 over one KV head, Sk 77 and 133 (multiples of no block), the rule and 3 / 7 forced splits; padding
    lengths with an empty sequence: out 0, lse -inf."""
    spec = _spec(mask=mask)
    m = _module(spec, mask)
    gen = torch.Generator().manual_seed(23)
    for sk in (77, 133):
        b = 3
        q = torch.randn(b, 16, 1, 192, generator=gen).bfloat16().to(DEVICE)
        k = torch.randn(b, 1, sk, 192, generator=gen).bfloat16().to(DEVICE)
        v = torch.randn(b, 1, sk, 128, generator=gen).bfloat16().to(DEVICE)
        lens = (sk, 0, 50) if mask == "padding" else (sk,) * b
        kw = {} if mask == "none" else dict(seqlens_q=torch.ones(b, dtype=torch.int32, device=DEVICE),
                                            seqlens_k=torch.tensor(lens, dtype=torch.int32, device=DEVICE))
        for o, lse in (m.forward(q, k, v, **kw), m.forward_split(q, k, v, num_splits=3, **kw),
                       m.forward_split(q, k, v, num_splits=7, **kw)):
            for i, n in enumerate(lens):
                if n == 0:
                    assert torch.all(o[i] == 0) and torch.all(lse[i] == float("-inf"))
                    continue
                want, wlse = reference.attention(q[i:i + 1].double(), k[i:i + 1, :, :n].double(),
                                                 v[i:i + 1, :, :n].double())
                compare(f"out {sk} {i}", o[i:i + 1].double(), want, **TOLERANCE["bf16"])
                compare(f"lse {sk} {i}", lse[i:i + 1], wlse, **LSE_TOLERANCE)


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
PTR = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Dst": "*fp32", "DstLse": "*fp32", "Out": "*bf16",
       "Lse": "*fp32", "Counter": "*i32"}
triton_backend.MLA192_DECODE = True
spec = fagen.KernelSpec(head_dim=192, head_dim_v=128, gqa=16, kind="decode", dtype="bf16")
m = load_source(fagen.generate(spec), spec.name + "_sm90")
fn, out = m._decode_split, {}
for direct in (True, False):
    consts = dict(HEAD_DIM=192, BLOCK_D=256, HEAD_DIM_V=128, BLOCK_DV=128, ROWS=m.tile_rows(16), BLOCK_N=m.BLOCK_N,
                  GQA=16, DOT=True, DIRECT=direct, SPLITS_PER_SEQ=0, UPCAST=False)
    sig, cx, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        n = p.name
        if p.is_constexpr:
            sig[n], cx[n] = "constexpr", consts[n]
        elif n == "seq_q":
            sig[n], cx[n] = "constexpr", 1
        elif n in ("SeqlensQ", "SeqlensK", "TreeMask", "KScale", "VScale", "KTok", "VTok"):
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
                        options=dict(num_warps=m.NUM_WARPS, num_stages=m.NUM_STAGES))
    r = next(iter(ptxas(ck.asm["ptx"])[0].values()))
    out[f"direct={direct}"] = dict(regs=r.registers, spills=r.spill_stores + r.spill_loads, shared=ck.metadata.shared,
                                   warps=ck.metadata.num_warps, pps=m.PROGRAMS_PER_SM)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.skipif(ON_GPU, reason="builds for sm_90 on the CPU (a GPU machine runs the kernel itself)")
def test_the_tile_builds_the_programs_an_sm_its_rule_counts_without_spills(tmp_path):
    """sm_90 (ptxas): the one-split kernel and the split one of MLA192_DECODE_TILE hold the programs an SM their rule
    counts, by registers (65536 an SM, allocated by 8s) and by shared memory (228 KB an SM, 1 KB of it a block's
    reserve), with no spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FAGEN_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _BUILD, ROOT], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    built = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert len(built) == 2
    for direct, r in built.items():
        assert r["spills"] == 0 and r["warps"] == triton_backend.MLA192_DECODE_TILE[1], (direct, r)
        assert r["pps"] == triton_backend.MLA192_DECODE_TILE[3], r
        assert r["pps"] * -(-r["regs"] // 8) * 8 * 32 * r["warps"] <= 65536, (direct, r)  # registers (by 8s)
        assert r["pps"] * (r["shared"] + 1024) <= 228 * 1024, (direct, r)  # shared memory
