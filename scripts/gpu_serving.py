"""GPU checks and timings of the serving features (docs/serving.md, issue 27): MLA 192/128 prefill forward and
backward against SDPA (cuDNN) and FlexAttention, fp8 against bf16 KV-cache decode in GB/s of bytes actually read,
and the cost of batch-invariant decode at b1 and b32 (with a bitwise alone-vs-batch check at realistic sizes).

    python scripts/gpu_serving.py            # about 3 minutes on an H100; prints a table, logs to $OUT if set
    GPU_SERVING_DRY=1 python scripts/gpu_serving.py   # the same code on the CPU interpreter at tiny shapes

Every timed kernel is first checked against the float64 reference on a slice (one batch entry, one KV group).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

DRY = os.environ.get("GPU_SERVING_DRY") == "1"  # a CPU rehearsal: tiny shapes, one timed call each
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import fagen  # noqa: E402
from fagen.verify import reference
from fagen.verify.tolerances import TOLERANCE, compare
from fagen.spec.axes import DType

DEV = "cpu" if DRY else "cuda"
S = (lambda n: max(32, n // 128)) if DRY else (lambda n: n)  # sequence lengths
B = (lambda n: min(n, 2)) if DRY else (lambda n: n)  # batch sizes
ROWS: list[dict] = []
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def bench(fn, rep=200) -> float:
    if DRY:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return do_bench(fn, warmup=25, rep=rep)  # ms, median


def row(section: str, case: str, impl: str, value: float | None, unit: str, ms: float | None, note: str = ""):
    ROWS.append(dict(section=section, case=case, impl=impl, value=value, unit=unit, ms=ms, note=note))
    shown = "-" if value is None else f"{value:.1f} {unit}"
    log(f"{section:<10} {case:<34} {impl:<16} {shown:>14}  {'' if ms is None else f'{ms:.4f} ms'}  {note}")


def guarded(section: str, case: str, impl: str):
    """A decorator-like runner: a failure becomes a row with its first line, never stops the script."""
    def run(fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            row(section, case, impl, None, "", None, f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            traceback.print_exc(file=sys.stderr)
            return None
    return run


# -- MLA prefill -------------------------------------------------------------------------------------------------
def mla_prefill(b=4, h=16, s=4096, d=192, dv=128):
    b, h, s = B(b), min(h, 2) if DRY else h, S(s)
    flops_fwd = 2 * (d + dv) * h * b * s * s / 2  # causal, Sq == Sk: half the pairs
    gen = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(b, h, s, d, device=DEV, generator=gen).mul(3).bfloat16()
    k = torch.randn(b, h, s, d, device=DEV, generator=gen).bfloat16()
    v = torch.randn(b, h, s, dv, device=DEV, generator=gen).bfloat16()
    do = torch.randn(b, h, s, dv, device=DEV, generator=gen).bfloat16()
    case = f"causal b{b} h{h} s{s} d{d}v{dv}"
    spec = fagen.KernelSpec(head_dim=d, head_dim_v=dv, mask="causal", dtype="bf16", direction="bwd")
    m = fagen.load(spec)

    def check():  # one batch entry, one head, float64, forward and gradients
        q1, k1, v1 = (t[:1, :1].detach().double().requires_grad_() for t in (q, k, v))
        ref, _ = reference.attention(q1, k1, v1, mask="causal")
        ref.backward(do[:1, :1].double())
        qq, kk, vv = (t[:1, :1].detach().clone().requires_grad_() for t in (q, k, v))
        out = m.attention(qq, kk, vv)
        out.backward(do[:1, :1])
        err = compare("out", out, ref, **TOLERANCE[DType.BF16])
        for name, got, want in (("dq", qq.grad, q1.grad), ("dk", kk.grad, k1.grad), ("dv", vv.grad, v1.grad)):
            unit = max(1.0, want.abs().max().item())
            compare(name, got, want, atol=2e-2 * unit, rtol=2e-2)
        return err

    err = guarded("mla", case, "fagen check")(check)
    note = "" if err is None else f"checked vs float64 (err {err:.1e})"
    fwd = guarded("mla", case, "fagen fwd")(lambda: bench(lambda: m.forward(q, k, v)))
    if fwd:
        row("mla", case, "fagen fwd", flops_fwd / fwd / 1e9, "TF/s", fwd, note)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = m.forward(q, k, v)
    bwd = guarded("mla", case, "fagen bwd")(lambda: bench(lambda: m.backward(do, q, k, v, out, lse)))
    if bwd:
        row("mla", case, "fagen bwd", 2.5 * flops_fwd / bwd / 1e9, "TF/s", bwd, note)

    # Tiles for 192/128 beyond the wide-head defaults (sm_90 ptxas on the CPU: no spills in any of these;
    # fwd m128n64w8s2 161 KB of shared memory, bwd m128n32w8s2 145 KB): the fastest is a candidate default.
    for tiles in (dict(block_m=128, block_n=64, num_warps=8, num_stages=2),):
        def run_fwd(tiles=tiles):
            mt = fagen.load(fagen.KernelSpec(head_dim=d, head_dim_v=dv, mask="causal", dtype="bf16", **tiles))
            compare("out", mt.forward(q[:1, :1], k[:1, :1], v[:1, :1])[0],
                    reference.attention(q[:1, :1], k[:1, :1], v[:1, :1], mask="causal")[0], **TOLERANCE[DType.BF16])
            t = bench(lambda: mt.forward(q, k, v))
            row("mla", case, "fagen fwd " + "m{block_m}n{block_n}w{num_warps}s{num_stages}".format(**tiles),
                flops_fwd / t / 1e9, "TF/s", t)
        guarded("mla", case, "fagen fwd tiles")(run_fwd)
    for tiles in (dict(block_m=128, block_n=32, num_warps=8, num_stages=2),
                  dict(block_m=64, block_n=64, num_warps=8, num_stages=2)):
        def run_bwd(tiles=tiles):
            mt = fagen.load(fagen.KernelSpec(head_dim=d, head_dim_v=dv, mask="causal", dtype="bf16", direction="bwd",
                                             **tiles))
            o, l = mt.forward(q, k, v)
            t = bench(lambda: mt.backward(do, q, k, v, o, l))
            row("mla", case, "fagen bwd " + "m{block_m}n{block_n}w{num_warps}s{num_stages}".format(**tiles),
                2.5 * flops_fwd / t / 1e9, "TF/s", t, "not checked (the default tile's check covers the template)")
        guarded("mla", case, "fagen bwd tiles")(run_bwd)

    from torch.nn.attention import SDPBackend, sdpa_kernel
    for name, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                          ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def sdpa():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)

        def run_sdpa():
            with torch.no_grad():
                got = sdpa()
            compare("sdpa out", got[:1, :1], reference.attention(q[:1, :1], k[:1, :1], v[:1, :1], mask="causal")[0],
                    **TOLERANCE[DType.BF16])
            with torch.no_grad():
                t_f = bench(sdpa)
            row("mla", case, f"{name} fwd", flops_fwd / t_f / 1e9, "TF/s", t_f)
            o = sdpa()
            t_b = bench(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True))
            row("mla", case, f"{name} bwd", 2.5 * flops_fwd / t_b / 1e9, "TF/s", t_b)
        guarded("mla", case, name)(run_sdpa)

    def run_flex():
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        mask = create_block_mask(lambda bb, hh, i, j: j <= i, None, None, s, s, device=DEV)
        flex = torch.compile(flex_attention, dynamic=False)
        with torch.no_grad():
            t_f = bench(lambda: flex(q, k, v, block_mask=mask))
        row("mla", case, "flex fwd", flops_fwd / t_f / 1e9, "TF/s", t_f)
        o = flex(qg, kg, vg, block_mask=mask)
        t_b = bench(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True))
        row("mla", case, "flex bwd", 2.5 * flops_fwd / t_b / 1e9, "TF/s", t_b)
    guarded("mla", case, "flex")(run_flex)


# -- fp8 vs bf16 decode -----------------------------------------------------------------------------------------
def decode_inputs(b, hq, hkv, sk, d, dv, kv_dtype, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, hq, 1, d, device=DEV, generator=gen).mul(3).bfloat16()
    k = torch.randn(b, hkv, sk, d, device=DEV, generator=gen)
    v = torch.randn(b, hkv, sk, dv, device=DEV, generator=gen)
    kw = {}
    if kv_dtype is None:
        k, v = k.bfloat16(), v.bfloat16()
    else:
        torch_dtype = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_dtype]
        k, v = k.to(torch_dtype), v.to(torch_dtype)
        kw = dict(k_scale=(0.5 + torch.rand(hkv, device=DEV, generator=gen)),
                  v_scale=(0.5 + torch.rand(hkv, device=DEV, generator=gen)))
    return q, k, v, kw


def check_decode(m, q, k, v, kw):
    g = q.shape[1] // k.shape[1]
    ref, _ = reference.attention(q[-1:, :g], k[-1:, :1], v[-1:, :1],
                                 **{n: (t[:1] if isinstance(t, torch.Tensor) else t) for n, t in kw.items()})
    out, _ = m.forward(q, k, v, **kw)
    return compare("out", out[-1:, :g], ref, **TOLERANCE[DType.BF16])


def copy_bandwidth() -> float:
    x = torch.empty(1 << (20 if DRY else 30), dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e6


def fp8_decode():
    peak = copy_bandwidth()
    row("fp8", "device copy (read + write)", "torch copy_", peak, "GB/s", None)
    for b, sk in ((32, 8192), (8, 32768), (128, 4096)):
        b, sk = B(b), S(sk)
        for kv, tiles in ((None, {}), ("fp8_e4m3", {}), ("fp8_e5m2", {}), ("fp8_e4m3", dict(block_n=128))):
            case = f"d128 h32/8 b{b} kv{sk}"
            impl = f"fagen {kv or 'bf16'}" + (" n128" if tiles else "")  # fp8 tiles of 128 keys: the same bytes

            def run():
                spec = fagen.KernelSpec(head_dim=128, gqa=4, dtype="bf16", kind="decode", kv_dtype=kv, **tiles)
                m = fagen.load(spec)
                q, k, v, kw = decode_inputs(b, 32, 8, sk, 128, 128, kv)
                err = check_decode(m, q, k, v, kw)
                ms = bench(lambda: m.forward(q, k, v, **kw))
                read = k.numel() * k.element_size() + v.numel() * v.element_size()
                tokens = b / (ms * 1e-3)
                row("fp8", case, impl, read / ms / 1e6, "GB/s", ms,
                    f"{100 * read / ms / 1e6 / peak:.0f}% of copy; {tokens:.0f} seq-steps/s; err {err:.1e}")
            guarded("fp8", case, impl)(run)


# -- batch-invariant decode -------------------------------------------------------------------------------------
def invariance():
    for b, sk in ((1, 4096), (1, 32768), (32, 4096), (32, 32768), (128, 8192)):
        b, sk = B(b), S(sk)
        case = f"d128 h32/8 b{b} kv{sk}"

        def run():
            spec = fagen.KernelSpec(head_dim=128, gqa=4, dtype="bf16", kind="decode", mask="padding")
            m = fagen.load(spec)
            q, k, v, _ = decode_inputs(b, 32, 8, sk, 128, 128, None)
            lens = torch.randint(sk // 2, sk + 1, (b,), device=DEV, dtype=torch.int32)
            lens[-1] = sk
            lq = torch.ones(b, device=DEV, dtype=torch.int32)
            kw = dict(seqlens_q=lq, seqlens_k=lens)
            times = {}
            for inv in (False, True):
                out, lse = m.forward(q, k, v, batch_invariant=inv, **kw)
                times[inv] = bench(lambda: m.forward(q, k, v, batch_invariant=inv, **kw))
                row("invariant", case, f"fagen {'invariant' if inv else 'split rule'}",
                    2 * int(lens.sum()) * 8 * 128 * 2 / times[inv] / 1e6, "GB/s", times[inv])
            # bitwise: the last sequence alone (its cache cut to its own length) equals its row in the batch
            out, lse = m.forward(q, k, v, batch_invariant=True, **kw)
            n = int(lens[-1])
            o1, l1 = m.forward(q[-1:].clone(), k[-1:, :, :n].clone(), v[-1:, :, :n].clone(), batch_invariant=True,
                               seqlens_q=lq[-1:].clone(), seqlens_k=lens[-1:].clone())
            same = torch.equal(out[-1], o1[0]) and torch.equal(lse[-1], l1[0])
            o0, _ = m.forward(q[-1:].clone(), k[-1:, :, :n].clone(), v[-1:, :, :n].clone(), batch_invariant=False,
                              seqlens_q=lq[-1:].clone(), seqlens_k=lens[-1:].clone())
            plain_same = torch.equal(m.forward(q, k, v, batch_invariant=False, **kw)[0][-1], o0[0])
            cost = times[True] / times[False] - 1
            row("invariant", case, "cost", 100 * cost, "%", None,
                f"alone == in batch: invariant {same}, split rule {plain_same}")
            if not same:
                raise AssertionError("batch_invariant=True: the sequence alone differs from its row in the batch")
        guarded("invariant", case, "fagen")(run)


def invariant_chunks():
    """The invariant rule's smallest chunk (module.INVARIANT_MIN_CHUNK, read at each call): GB/s per choice at b1 and
    b32, beside the default split rule, to pick the constant ([Note] Batch-invariant splits)."""
    spec = fagen.KernelSpec(head_dim=128, gqa=4, dtype="bf16", kind="decode")
    m = fagen.load(spec)
    default = m.INVARIANT_MIN_CHUNK
    for b, sk in ((1, 4096), (1, 32768), (32, 4096), (32, 32768)):
        b, sk = B(b), S(sk)
        case = f"d128 h32/8 b{b} kv{sk}"

        def run():
            q, k, v, _ = decode_inputs(b, 32, 8, sk, 128, 128, None)
            read = k.numel() * 2 * 2
            base = bench(lambda: m.forward(q, k, v, batch_invariant=False))
            row("chunks", case, "split rule", read / base / 1e6, "GB/s", base)
            for chunk in (128, 256, 512, 1024, 2048):
                m.INVARIANT_MIN_CHUNK = chunk
                ms = bench(lambda: m.forward(q, k, v, batch_invariant=True))
                row("chunks", case, f"invariant min {chunk}", read / ms / 1e6, "GB/s", ms,
                    f"cost {100 * (ms / base - 1):+.1f}%")
        try:
            guarded("chunks", case, "fagen")(run)
        finally:
            m.INVARIANT_MIN_CHUNK = default


def table() -> str:
    lines = ["| section | case | impl | value | ms | note |", "|---|---|---|---|---|---|"]
    for r in ROWS:
        value = "-" if r["value"] is None else f"{r['value']:.1f} {r['unit']}"
        ms = "" if r["ms"] is None else f"{r['ms']:.4f}"
        lines.append(f"| {r['section']} | {r['case']} | {r['impl']} | {value} | {ms} | {r['note']} |")
    return "\n".join(lines)


def main() -> None:
    if not torch.cuda.is_available() and not DRY:
        sys.exit("gpu_serving.py needs a CUDA GPU (GPU_SERVING_DRY=1 rehearses it on the CPU)")
    log(f"{'CPU rehearsal' if DRY else torch.cuda.get_device_name()}  torch {torch.__version__}  fagen {fagen.__file__}")
    for part in (mla_prefill, fp8_decode, invariance, invariant_chunks):
        part()
    text = table()
    print("\n" + text)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_serving.json"), "w") as f:
            json.dump(ROWS, f, indent=1)
        with open(os.path.join(out, "gpu_serving.md"), "w") as f:
            f.write(text + "\n")
    failed = [r for r in ROWS if r["note"].startswith("ERROR") and r["impl"].startswith("fagen")]
    log(f"done in {time.time() - T0:.0f} s; {len(failed)} fagen errors")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
