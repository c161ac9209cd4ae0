"""Lab (not the product): the product's Gluon dK/dV kernel for MLA's split head dims (d_qk 192, d_v 128;
fagen/templates/gluon/mla_dkdv.py, [Note] MLA Gluon dK/dV) with its tiles and switches as arguments, for sweeps and
sm_90 builds on the CPU (twenty-second session, docs/serving.md "MLA backward (twenty-second session)"; folded into
the product's kernel in the twenty-third: no second copy of the kernel lives here).

lab/gluon_bwd_mla.py (fifteenth session) computed dK, dV and dQ in one warp-specialized kernel and lost to its
lockstep step chain: both compute warpgroups exchanged dS^T every step for dQ_j^T = K^T dS^T. The product's kernel
leaves dQ to the Triton dQ kernel (from the same preprocess), so each compute warpgroup walks its own 64 keys
without waiting on the other, as FA3's MMA warpgroups do.

The constexprs a caller may pass (defaults: the product's MLA_KV_* constants): BLOCK_M (queries a step), STAGES (ring
slots), GROUP ((batch, KV head) pairs a group; 0 here: one group of every pair, key-block major), PIPE (the next
step's scores issued before this step's dK/dV wait), DV_EARLY (dV's matmul before the wait for dP^T), COMPUTE_REGS,
PRODUCER_REGS, MUTANT (tests only: dK's scale left out). The twenty-second session's SMEM_OPS (P^T and dS^T through
shared memory) is gone with the lab copy (it spilled 828 B at 64-query steps and was never timed ahead).
ptxas (CPU, triton 3.6): `PYTHONPATH=$PWD python3 lab/gluon_bwd_mla_kv.py BLOCK_M=64 ...`.
"""
import torch
import triton

from fagen.templates.gluon import mla_dkdv as _k
from lab.gluon_bwd import _sms

DA = _k.DA
KV_BLOCK_M = _k.MLA_KV_BLOCK_M
KV_BLOCK_N = 128  # the kernel's only key block (two compute warpgroups of 64 keys)
KV_STAGES = _k.MLA_KV_STAGES
KV_COMPUTE_REGS = _k.MLA_KV_COMPUTE_REGS
KV_PRODUCER_REGS = _k.MLA_KV_PRODUCER_REGS
KV_PIPE = _k.MLA_KV_PIPE
KV_GROUP = _k.MLA_KV_GROUP


def _args(q, do, k, v, lse2, delta, dk, dv, scale, num_tiles, num_bh, hkv, sq, sk, causal, **constexprs):
    da = DA.value
    db = q.shape[-1] - da
    kw = dict(DB=db, DV=v.shape[-1], BLOCK_M=KV_BLOCK_M, BLOCK_N=KV_BLOCK_N, STAGES=KV_STAGES,
              GQA=q.shape[1] // k.shape[1], CAUSAL=causal, COMPUTE_REGS=KV_COMPUTE_REGS,
              PRODUCER_REGS=KV_PRODUCER_REGS, PIPE=KV_PIPE, GROUP=KV_GROUP, num_warps=4)
    kw.update(constexprs)
    kw["GROUP"] = kw["GROUP"] or num_bh  # 0: every pair in one group (key-block major)
    bm, bn = kw["BLOCK_M"], kw["BLOCK_N"]
    args = (_k._mla_kv_descriptor(q, bm, cols=da), _k._mla_kv_descriptor(q, bm, cols=db),
            _k._mla_kv_descriptor(do, bm), _k._mla_kv_descriptor(k, bn, cols=da),
            _k._mla_kv_descriptor(k, bn, cols=db), _k._mla_kv_descriptor(v, bn), _k._mla_kv_rows(lse2, bm),
            _k._mla_kv_rows(delta, bm), dk, dv, scale * 1.4426950408889634, scale, num_tiles, num_bh, hkv, sq, sk)
    return args, kw


def prepared(q, k, v, do, dk, dv, lse2, delta, scale, causal, grid_all=True, **constexprs):
    """dkdv's launch as a function of no arguments, its descriptors built now: a caller builds it before the
    preprocess's launch, so the host's work overlaps the GPU's (the statistics are read at launch, not here).
    grid_all: one program per key block (the heaviest causal blocks first), else one per SM taking every P-th."""
    b, hq, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    num_bh = b * hkv
    num_tiles = triton.cdiv(sk, constexprs.get("BLOCK_N", KV_BLOCK_N)) * num_bh
    args, kw = _args(q, do, k, v, lse2, delta, dk, dv, scale, num_tiles, num_bh, hkv, sq, sk, causal, **constexprs)
    grid = (num_tiles if grid_all else min(num_tiles, _sms(q.device)), )
    return lambda: _k._attn_bwd_mla_kv[grid](*args, **kw)


def dkdv(q, k, v, do, dk, dv, lse2, delta, scale, causal, grid_all=True, **constexprs):
    """dK, dV into dk, dv (contiguous [B, Hkv, Sk, 192] / [B, Hkv, Sk, 128]) from contiguous bf16 q [B, Hq, Sq, 192],
    k, v, do and the product's preprocess (lse2, delta [B, Hq, S_pad] float32, S_pad a multiple of BLOCK_M)."""
    prepared(q, k, v, do, dk, dv, lse2, delta, scale, causal, grid_all, **constexprs)()
    return dk, dv


def compile_for(dqk=192, dv=128, gqa=1, causal=True, dtype=torch.bfloat16, seq_q=1000, seq_k=1000, **constexprs):
    """Build the kernel for sm_90 without a GPU (triton's bundled ptxas); returns the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    sq_pad = triton.cdiv(seq_q, 128) * 128
    q = torch.empty((1, gqa, seq_q, dqk), dtype=dtype)
    k = torch.empty((1, 1, seq_k, dqk), dtype=dtype)
    v = torch.empty((1, 1, seq_k, dv), dtype=dtype)
    do = torch.empty((1, gqa, seq_q, dv), dtype=dtype)
    rows = torch.empty((1, gqa, sq_pad), dtype=torch.float32)
    args, kw = _args(q, do, k, v, rows, rows, k, v, 0.5, 2, 2, 2, seq_q, seq_k, causal, **constexprs)
    fn = _k._attn_bwd_mla_kv
    names = list(fn.arg_names)[:len(args)]
    num_warps = kw.pop("num_warps")
    signature = {n: mangle_type(a) for n, a in zip(names, args)}
    signature.update({n: "constexpr" for n in kw})
    src = GluonASTSource(fn=fn, signature=signature, constexprs=kw)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


if __name__ == "__main__":  # the CPU's sm_90 build: registers, spills, shared memory
    import sys

    from lab.gluon_bwd import resources, step_sass
    for spec in sys.argv[1:] or ["BLOCK_M=64"]:
        kw = {a.split("=")[0]: int(a.split("=")[1]) for a in spec.split(",") if a}
        ck = compile_for(**kw)
        print(spec, resources(ck), step_sass(ck, 8), flush=True)
