"""The Gluon (sm_90) backward's dQ-writer variants on an H100/H200, against cuDNN and fagen's Triton backward in the
same process (docs/hopper.md, phase 4).

    OUT=/tmp/out python scripts/hopper_bwd_sweep.py [P,SWIZZLE,HEAD_MAJOR[,MUTANT] ...]   # $OUT/sweep.log, .json

A variant sets the module constants BWD_DQ_PENDING (dQ adds in flight before the writer awaits their completion:
0, 1, 2), BWD_DQ_SWIZZLE (0 or 128: the float32 dQ staging tile's swizzle) and BWD_HEAD_MAJOR (tile order) of the
template's module; each is a separate compile (they are constexprs). Before it is timed, each variant is checked:
gradients against fagen's float64 reference (two shapes per module) and bitwise repeatability over 3 runs on each
timed case. A variant naming a MUTANT of scripts/hopper_bwd_mutant.py (no-turn-wait, no-reduce) is a diagnostic,
wrong by construction: timed only, on the first case. TF/s as `fagen bench` counts them (backward = 2.5 x forward FLOPs); medians of do_bench, best of
two.
"""
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]

import fagen  # noqa: E402
from fagen.spec.kernel import KernelSpec  # noqa: E402
from fagen.verify import reference as verify_reference  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
LINES, FAILS = [], []
CASES = [("bwd d128 causal s16k", "causal", 16, 16, 16384, 1),
         ("bwd gqa 32/8 d128 causal s4k", "causal", 32, 8, 4096, 4),
         ("bwd d128 full s16k", "none", 16, 16, 16384, 1)]


def log(msg):
    print(msg, flush=True)
    LINES.append(msg)


def gluon_bwd(mask, gqa):
    return fagen.load(KernelSpec(backend="gluon", head_dim=128, mask=mask, gqa=gqa, dtype="bf16", direction="bwd"))


def triton_bwd(mask, gqa):
    return fagen.load(KernelSpec(head_dim=128, mask=mask, gqa=gqa, dtype="bf16", direction="bwd"))


def set_variant(mod, pending, swizzle, head_major):
    mod.BWD_DQ_PENDING, mod.BWD_DQ_SWIZZLE, mod.BWD_HEAD_MAJOR = pending, swizzle, head_major


def parse(arg):
    parts = arg.split(",")
    return tuple(int(x) for x in parts[:3]) + (parts[3] if len(parts) > 3 else "", )


def mutant(mask, gqa, name):
    import hopper_bwd_mutant as hm
    old, new = next((o, n) for m, o, n in hm.MUTANTS if m == name)
    spec = KernelSpec(backend="gluon", head_dim=128, mask=mask, gqa=gqa, dtype="bf16", direction="bwd")
    return hm.mutant_module(spec, name, old, new)


def check(tag, mod, mask, gqa):
    """Gradients of two shapes against float64 autograd (bf16 tolerance 2e-2 + 2e-2 |ref|, as hopper_bwd_gpu)."""
    torch.manual_seed(0)
    for (b, hkv, sq, sk) in ((1, 2, 1000, 1000), (2, 2, 333, 200)):
        q, do = (torch.randn(b, hkv * gqa, sq, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(b, hkv, sk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        leaves = tuple(t.double().requires_grad_() for t in (q, k, v))
        out, lse = verify_reference.attention(*leaves, mask=mask, scale=128 ** -0.5)
        ref = torch.autograd.grad(out, leaves, do.double())
        got = mod.backward(do, q, k, v, out.detach().to(torch.bfloat16), lse.detach().float())
        for name, g, r in zip(("dq", "dk", "dv"), got, ref):
            err = (g.double() - r).abs()
            ok = bool((err <= 2e-2 + 2e-2 * r.abs()).all()) and not torch.isnan(g).any().item()
            if not ok:
                FAILS.append(f"{tag} {mask} g{gqa} {sq}x{sk} {name}")
                log(f"  FAIL {tag} {mask} gqa {gqa} {sq}x{sk} {name}: max|err| {err.max().item():.2e}")


def main():
    from triton.testing import do_bench
    from torch.nn.attention import SDPBackend, sdpa_kernel
    variants = [parse(a) for a in sys.argv[1:]] or [(1, 128, 0, ""), (1, 128, 1, "")]
    log(f"device {torch.cuda.get_device_name()} torch {torch.__version__}; variants (pending, swizzle, head major, "
        f"mutant) {variants}")
    rows = []
    for label, mask, hq, hkv, s, bsz in CASES:
        causal, gqa = mask == "causal", hq // hkv
        q, do = (torch.randn(bsz, hq, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(bsz, hkv, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        g, t = gluon_bwd(mask, gqa), triton_bwd(mask, gqa)
        out, lse = t.forward(q, k, v)
        tq, tk, tv = t.backward(do, q, k, v, out, lse)
        flop = 2.5 * 4 * bsz * hq * s * s * 128 / (2 if causal else 1)
        res = {"case": label}
        fns = {}
        for pending, swizzle, head_major, name in variants:
            tag = f"gluon p{pending} s{swizzle} hm{head_major}" + (f" DIAGNOSTIC {name}" if name else "")
            if name:
                if label != CASES[0][0]:
                    continue
                m = mutant(mask, gqa, name)
                set_variant(m, pending, swizzle, head_major)
                m.backward(do, q, k, v, out, lse)
                torch.cuda.synchronize()
                ms = min(do_bench(lambda: m.backward(do, q, k, v, out, lse), warmup=25, rep=200,
                                  return_mode="median") for _ in range(2))
                res[tag] = round(flop / ms / 1e9, 1)
                log(f"  {label} {tag}: {res[tag]:.0f} TF/s (wrong by construction: timed only)")
                continue
            set_variant(g, pending, swizzle, head_major)
            t0 = time.time()
            check(tag, g, mask, gqa)
            first = g.backward(do, q, k, v, out, lse)
            same = all(all(torch.equal(a, b) for a, b in zip(first, g.backward(do, q, k, v, out, lse)))
                       for _ in range(2))
            diff = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                       for a, b in zip(first, (tq, tk, tv)))
            log(f"{label} {tag}: checked in {time.time() - t0:.0f} s; bitwise repeatable over 3 runs: {same}; "
                f"relative difference to the Triton backward {diff:.1e}")
            if not same or diff > 2e-3:
                FAILS.append(f"repeatable/agree {label} {tag}")
            del first
            ms = min(do_bench(lambda: g.backward(do, q, k, v, out, lse), warmup=25, rep=200, return_mode="median")
                     for _ in range(2))
            res[tag] = round(flop / ms / 1e9, 1)
            log(f"  {label} {tag}: {res[tag]:.0f} TF/s")
        set_variant(g, 1, 128, 1)
        fns["triton"] = lambda: t.backward(do, q, k, v, out, lse)
        qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            oc = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, enable_gqa=gqa > 1)
        fns["cudnn"] = lambda: torch.autograd.grad(oc, (qg, kg, vg), do, retain_graph=True)
        for name, fn in fns.items():
            fn()
            torch.cuda.synchronize()
            ms = min(do_bench(fn, warmup=25, rep=200, return_mode="median") for _ in range(2))
            res[name] = round(flop / ms / 1e9, 1)
        rows.append(res)
        log("  " + ", ".join(f"{k} {v:.0f}" for k, v in res.items() if isinstance(v, float)) + " TF/s")
        del q, k, v, do, out, lse, tq, tk, tv, oc, qg, kg, vg, fns
        torch.cuda.empty_cache()
    log(f"checks failed: {len(FAILS)} {FAILS}")
    with open(os.path.join(OUT, "sweep.log"), "w") as f:
        f.write("\n".join(LINES) + "\n")
    with open(os.path.join(OUT, "sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
