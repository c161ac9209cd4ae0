"""The Gluon (sm_90) backward on an H100/H200: correctness against float64, exact zeros, bitwise repeatability,
timings against cuDNN and fagen's Triton backward in the same process (docs/hopper.md, phase 3).

    OUT=/tmp/out python scripts/hopper_bwd_gpu.py          # writes $OUT/bwd.log and $OUT/bwd.json

Modules: fagen.load(KernelSpec(backend="gluon", direction="bwd", ...)) (the template), the Triton bwd module of the
same case, torch SDPA forced to cuDNN. The standalone prototype (scripts/hopper_bwd_proto.py, no warp
specialization, dQ added by the compute warps) is timed beside them with HOPPER_PROTO=1. TF/s as `fagen bench`
counts them: backward = 2.5 x forward FLOPs, forward = 4 B H Sq Sk D (halved for causal); medians of
triton.testing.do_bench, best of two.
"""
import json
import os
import sys
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]

import fagen  # noqa: E402
from fagen.spec.kernel import KernelSpec  # noqa: E402
from fagen.verify import reference as verify_reference  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
LINES = []
FAILS = []


def log(msg):
    print(msg, flush=True)
    LINES.append(msg)


def reference(q, k, v, do, scale, causal):
    """float64 out, lse, dq, dk, dv: fagen's reference (fagen.verify.reference) and autograd."""
    leaves = tuple(t.double().requires_grad_() for t in (q, k, v))
    out, lse = verify_reference.attention(*leaves, mask="causal" if causal else "none", scale=scale)
    dq, dk, dv = torch.autograd.grad(out, leaves, do.double())
    return out.detach(), lse.detach(), dq, dk, dv


WORST = {}


def compare(tag, got, ref, tol):
    err = (got.double() - ref).abs()
    rel = ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    ok = bool((err <= tol + tol * ref.abs()).all().item()) and not torch.isnan(got).any().item() and rel < 1e-2
    WORST[tag] = max(WORST.get(tag, 0.0), rel)
    if not ok:
        FAILS.append(tag)
        log(f"  FAIL {tag}: max|err| {err.max().item():.2e} rel {rel:.2e}")


def gluon_bwd(mask, gqa, dtype="bf16"):
    return fagen.load(KernelSpec(backend="gluon", head_dim=128, mask=mask, gqa=gqa, dtype=dtype, direction="bwd"))


def triton_bwd(mask, gqa, dtype="bf16"):
    return fagen.load(KernelSpec(head_dim=128, mask=mask, gqa=gqa, dtype=dtype, direction="bwd"))


def correctness():
    torch.manual_seed(0)
    shapes = [(2, 4, 4, 256, 256), (1, 4, 1, 333, 200), (1, 2, 2, 200, 333), (2, 2, 2, 97, 97), (1, 2, 2, 1, 130),
              (1, 4, 2, 1000, 1000), (1, 2, 2, 128, 384), (1, 8, 2, 777, 1025)]
    for dtype, tdt, tol in (("bf16", torch.bfloat16, 2e-2), ("fp16", torch.float16, 3e-3)):
        for (b, hq, hkv, sq, sk) in shapes if dtype == "bf16" else shapes[:4]:
            for mask in ("none", "causal"):
                mod = gluon_bwd(mask, hq // hkv, dtype)
                q = torch.randn(b, hq, sq, 128, device="cuda", dtype=tdt)
                k = torch.randn(b, hkv, sk, 128, device="cuda", dtype=tdt)
                v = torch.randn(b, hkv, sk, 128, device="cuda", dtype=tdt)
                do = torch.randn(b, hq, sq, 128, device="cuda", dtype=tdt)
                scale = 128 ** -0.5
                ref = reference(q, k, v, do, scale, mask == "causal")
                # backward() on the reference's out/lse, then the autograd path (gluon forward + backward)
                dq, dk, dv = mod.backward(do, q, k, v, ref[0].to(tdt), ref[1].float())
                for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2:]):
                    compare(f"gluon {dtype} {name}", got, want, tol)
                qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
                out = mod.attention(qg, kg, vg)
                out.backward(do)
                compare(f"gluon {dtype} out (autograd)", out.detach(), ref[0], tol)
                for name, got, want in zip(("dq", "dk", "dv"), (qg.grad, kg.grad, vg.grad), ref[2:]):
                    compare(f"gluon {dtype} {name} (autograd)", got, want, tol)
                if dtype == "bf16":
                    tq, tk, tv = triton_bwd(mask, hq // hkv).backward(do, q, k, v, ref[0].to(tdt), ref[1].float())
                    for name, got, want in zip(("dq", "dk", "dv"), (tq, tk, tv), ref[2:]):
                        compare(f"triton {dtype} {name}", got, want, tol)
    log("worst relative Frobenius error: " + ", ".join(f"{k} {v:.2e}" for k, v in WORST.items()))
    # fagen.attention with gradients on sm_90 (the selection), its gradients vs the reference
    q = torch.randn(1, 4, 300, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 1, 300, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 1, 300, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(1, 4, 300, 128, device="cuda", dtype=torch.bfloat16)
    from fagen.runtime import resolve
    os.environ["FAGEN_HOPPER_BWD"] = "1"  # the opt-in (run 4 ran before it existed, with the rule on by default)
    mod = resolve.resolve(q, k, v, "causal", False)
    log(f"fagen.attention with gradients resolves to {mod.NAME}")
    out = fagen.attention(q, k, v, mask="causal")
    out.backward(do)
    ref = reference(q.detach(), k.detach(), v.detach(), do, 128 ** -0.5, True)
    for name, got, want in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref[2:]):
        compare(f"fagen.attention {name}", got, want, 2e-2)


def exact_zero():
    """Every query row sees exactly one key: dQ = dK = 0 (PyTorch gives 0)."""
    for mask, sq, sk, gqa in (("none", 300, 1, 1), ("causal", 1, 1, 1), ("none", 64, 1, 4), ("causal", 333, 1, 2)):
        q = torch.randn(2, 2 * gqa, sq, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, 2, sk, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(2, 2, sk, 128, device="cuda", dtype=torch.bfloat16)
        do = torch.randn(2, 2 * gqa, sq, 128, device="cuda", dtype=torch.bfloat16)
        g, t = gluon_bwd(mask, gqa), triton_bwd(mask, gqa)
        out, lse = g.forward(q, k, v)
        dq, dk, _ = g.backward(do, q, k, v, out, lse)
        tout, tlse = t.forward(q, k, v)
        tq, tk, _ = t.backward(do, q, k, v, tout, tlse)
        zero = dq.abs().max().item() == 0 and dk.abs().max().item() == 0
        log(f"one key per row ({mask}, Sq {sq}, Sk {sk}, gqa {gqa}): gluon max|dq| {dq.abs().max().item():.1e} "
            f"max|dk| {dk.abs().max().item():.1e}; triton max|dq| {tq.abs().max().item():.1e} max|dk| "
            f"{tk.abs().max().item():.1e}")
        if not zero:
            FAILS.append(f"exact zero {mask} {sq} {sk}")


def timings():
    from triton.testing import do_bench
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import hopper_bwd_proto as proto
    rows = []
    for label, mask, hq, hkv, s, bsz in (("bwd d128 causal s16k", "causal", 16, 16, 16384, 1),
                                         ("bwd d128 full s16k", "none", 16, 16, 16384, 1),
                                         ("bwd gqa 32/8 d128 causal s4k", "causal", 32, 8, 4096, 4),
                                         ("bwd d128 causal s4k B4", "causal", 16, 16, 4096, 4)):
        causal = mask == "causal"
        q = torch.randn(bsz, hq, s, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(bsz, hkv, s, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(bsz, hkv, s, 128, device="cuda", dtype=torch.bfloat16)
        do = torch.randn(bsz, hq, s, 128, device="cuda", dtype=torch.bfloat16)
        g, t = gluon_bwd(mask, hq // hkv), triton_bwd(mask, hq // hkv)
        out, lse = t.forward(q, k, v)
        first = g.backward(do, q, k, v, out, lse)
        same = all(all(torch.equal(a, b) for a, b in zip(first, g.backward(do, q, k, v, out, lse)))
                   for _ in range(4))
        tq, tk, tv = t.backward(do, q, k, v, out, lse)
        diff = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(first, (tq, tk, tv)))
        log(f"{label}: bitwise repeatable over 5 runs: {same}; relative difference to the Triton backward {diff:.1e}")
        if not same or diff > 2e-3:
            FAILS.append(f"repeatable/agree {label}")
        del first, tq, tk, tv
        flop = 2.5 * 4 * bsz * hq * s * s * 128 / (2 if causal else 1)
        fns = {"gluon": lambda: g.backward(do, q, k, v, out, lse),
               "triton": lambda: t.backward(do, q, k, v, out, lse)}
        if os.environ.get("HOPPER_PROTO") == "1":  # phase 3's prototype (no writer warp), not timed by default
            fns["proto (no writer warp)"] = lambda: proto.backward(do, q, k, v, out, lse, 128 ** -0.5, causal)
        qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                oc = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal,
                                                                      enable_gqa=hq != hkv)
            fns["cudnn"] = lambda: torch.autograd.grad(oc, (qg, kg, vg), do, retain_graph=True)
        except Exception as e:  # noqa: BLE001
            log(f"  cudnn: {type(e).__name__}: {e}")
        res = {"case": label, "B": bsz, "Hq": hq, "Hkv": hkv, "S": s, "mask": mask}
        for name, fn in fns.items():
            try:
                fn()
                torch.cuda.synchronize()
                ms = min(do_bench(fn, warmup=50, rep=300, return_mode="median") for _ in range(2))
                res[name] = round(flop / ms / 1e9, 1)
            except Exception as e:  # noqa: BLE001
                log(f"  {name}: {type(e).__name__}: {e}")
        rows.append(res)
        log("  " + ", ".join(f"{k} {v:.0f}" for k, v in res.items() if isinstance(v, float)) + " TF/s")
    mm = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: mm @ mm, warmup=50, rep=300, return_mode="median")
    rows.append({"case": "bf16 matmul 8192^3", "cublas": round(2 * 8192 ** 3 / ms / 1e9, 1)})
    log(f"bf16 matmul 8192^3: {rows[-1]['cublas']:.0f} TF/s")
    return rows


def main():
    log(f"device {torch.cuda.get_device_name()} torch {torch.__version__}")
    rows = []
    parts = (correctness, exact_zero) + ((timings, ) if os.environ.get("HOPPER_TIMINGS", "1") == "1" else ())
    for part in parts:
        try:
            r = part()
            rows = r if r else rows
        except Exception:  # noqa: BLE001
            FAILS.append(part.__name__)
            log(traceback.format_exc())
    log(f"checks failed: {len(FAILS)} {FAILS}")
    with open(os.path.join(OUT, "bwd.log"), "w") as f:
        f.write("\n".join(LINES) + "\n")
    with open(os.path.join(OUT, "bwd.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
