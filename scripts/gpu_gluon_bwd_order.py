"""The deterministic Gluon backward's launch order and fixed-point dQ on an H100 (issue 28, ninth session).

    PYTHONPATH=$PWD python3 scripts/gpu_gluon_bwd_order.py        # every phase in a child with a timeout (< 70 s)
    GBWD_ORDER_ROUND=A PYTHONPATH=$PWD python3 scripts/gpu_gluon_bwd_order.py   # round A's variant list
    python scripts/gpu_gluon_bwd_order.py --phase causal           # one phase here (no child, no timeout)
    GPU_GLUON_BWD_ORDER_DRY=1 python scripts/gpu_gluon_bwd_order.py   # any machine: sm_90 builds, ptxas numbers

At d128 bf16 B1 H16 s16k, causal and full: cuDNN (torch SDPA, cuDNN backend) and the lab's v1 (lab/gluon_bwd.py,
the product default's arithmetic and schedule) in a few variants: `chain` (deterministic, fixed-order dQ, the
product default), `unord` (deterministic=False), `grid` (GRID 1: one CTA per tile, FA3's grid), `gridspt` (causal:
GRID 1 + SPT, shortest tiles first with descending turns), `order4` / `order8` (full: neighbours 4 / 8 steps apart),
`fixed` (fixed-point dQ, cvt.rni), `fixedfma` (fixed-point dQ rounded on the FMA pipe) and `fixedfma2` (the same
without the IADD: the postprocess takes the offsets out), `fixraw*` (a diagnostic, wrong dQ: the int32 adds of a
bitcast, no rounding; timed only); and the product's render called through the module's
backward() (deterministic=True): `p-chain` its default, `p-fixedfma` the variants bwd_fixed + bwd_fixed_fma
(`p-fixedfma2`: bwd_fixed_fma 2, no IADD), `p-gridspt` bwd_grid + bwd_spt, `p-grid` bwd_grid, `p-fixfmagrid`
bwd_fixed + bwd_fixed_fma on one CTA per tile, `p-order4` bwd_order 4 (full). Before its timing each variant is
checked against a float64 autograd reference (B1 H16 1360 x 1360: 176 tiles, two waves), for exact zeros (causal:
query row 0 sees key 0 only, dq = 0) and, deterministic ones, bitwise over 2 runs at B1 H16 s4000 (512 tiles, 4
waves); the fixed-point ones' dq at s16k is compared with the chain's. Phases: `warm0..` (parallel children, a
tiny launch of each kernel with the timed shapes' specialization: lengths multiples of 16, B1 H16), then `causal`
and `full` (checks, then TF/s, a line each).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import _phases  # noqa: E402

DRY = bool(os.environ.get("GPU_GLUON_BWD_ORDER_DRY"))
C, F = (True, ), (False, )
# (label, dq_mode, constexprs, masks: causal True / False). The lab's v1: dq_mode 0 ordered adds (deterministic),
# 1 unordered, 4 fixed-point (deterministic in any order), constexprs its knobs. A label "p-..." is the product's
# render (fagen/templates/gluon/backward.py.j2) with GluonBackend.variant updated by the dict, dq_mode 0 its
# deterministic mode (deterministic=True), 1 deterministic=False. Round A: the lab's candidates as the eighth
# session left them, the FMA rounding, and the product's ports (bwd_fixed_fma, bwd_grid, bwd_spt).
PFMA = {"bwd_fixed": 1, "bwd_fixed_fma": 1}
VARIANTS = [("chain", 0, {}, C + F), ("unord", 1, {}, C + F), ("fixedfma", 4, {"FIXED_FMA": 1}, C + F),
            ("fixedfma2", 4, {"FIXED_FMA": 2}, C + F), ("fixraw*", 4, {"FIXED_FMA": 3}, C + F),
            ("p-fixedfma", 0, PFMA, C + F), ("p-fixedfma2", 0, {**PFMA, "bwd_fixed_fma": 2}, C + F),
            ("p-fixfmagrid", 0, {**PFMA, "bwd_grid": 1}, C + F),
            ("fixed", 4, {}, C + F), ("grid", 0, {"GRID": 1}, C + F), ("gridspt", 0, {"GRID": 1, "SPT": 1}, C),
            ("order4", 0, {"ORDER": 4}, F), ("order8", 0, {"ORDER": 8}, F), ("p-chain", 0, {}, C + F),
            ("p-gridspt", 0, {"bwd_grid": 1, "bwd_spt": 1}, C), ("p-grid", 0, {"bwd_grid": 1}, F),
            ("p-order4", 0, {"bwd_order": 4}, F)]
# Round B (the default; GBWD_ORDER_ROUND=A: round A's list above). Round A (docs/hopper.md, "The deterministic
# backward's launch order"): GRID 1 even, SPT -46%, ORDER 4 / 8 -5% / -19%; the lab's fixed-point dQ far ahead of
# the product's render (FMA 2: 522 / 540 against 498 / 500), and the FMA units too coarse at s16k (dq 1.1e-2 from
# the chain's at full). Here: the fixed-point renders with cvt and FMA 2 in the lab and the product, the FMA mutant
# (must fail its check: `!`), dq of head 0 at s16k against float64, and a second pass of four (run-to-run spread).
MUT = ("dq = _fma_rni(dq, qm[:, None])", "dq = _fma_rni(dq, 1.0)")  # gluon-bwd-fixed-fma-no-scale
VARIANTS_B = [("chain", 0, {}, C + F), ("unord", 1, {}, C + F), ("fixed", 4, {}, C + F),
              ("fixedfma2", 4, {"FIXED_FMA": 2}, C + F), ("p-chain", 0, {}, C + F),
              ("p-fixed", 0, {"bwd_fixed": 1}, C + F), ("p-fixedfma2", 0, {**PFMA, "bwd_fixed_fma": 2}, C + F),
              ("p-fmamut!", 0, PFMA, C), ("chain#2", 0, {}, C + F), ("unord#2", 1, {}, C + F),
              ("fixed#2", 4, {}, C + F), ("fixedfma2#2", 4, {"FIXED_FMA": 2}, C + F)]
if os.environ.get("GBWD_ORDER_ROUND", "B") == "B":
    VARIANTS = VARIANTS_B
B, H, S, D = 1, 16, 16384, 128
CHECK_S, BIT_S, WARM_S = 1360, 4000, 400  # all multiples of 16: one specialization of the kernels' integers
LIMIT = {"warm": 25, "causal": 21, "full": 22}  # 68 s: the runner stops the call at 75 s
WARM_WORKERS = 16


def log(*parts):
    print(*parts, flush=True)


def jobs():
    """Each kernel once: (label, mode, kw, causal) of the variants, repeats (`#2`) left out."""
    return [(label, mode, kw, causal) for label, mode, kw, masks in VARIANTS for causal in masks if "#" not in label]


def inputs(sq, seed=0):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn((B, H, sq, D), generator=g, device="cuda").bfloat16() for _ in range(4)]  # q, k, v, do


def forward(q, k, v, causal, scale):
    """(out, lse) from torch's flash forward (lse natural log, [B, H, S] float32)."""
    import torch
    r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return r[0].contiguous(), r[1][..., :q.shape[2]].contiguous()


_PRODUCT = {}


def product_module(causal, overrides, mutant=None):
    """The product's gluon bwd module (d128 bf16 MHA) rendered with GluonBackend.variant updated by `overrides`,
    `mutant` (old, new) applied to its source."""
    key = (causal, tuple(sorted(overrides.items())), mutant)
    if key not in _PRODUCT:
        import fagen
        from fagen import backends
        from fagen.codegen import render
        from fagen.runtime.loader import load_source
        from fagen.spec.kernel import KernelSpec
        spec = KernelSpec(backend="gluon", direction="bwd", head_dim=D, mask="causal" if causal else "none",
                          dtype="bf16")
        saved = dict(backends.GLUON.variant)
        backends.GLUON.variant.update(overrides)
        render.render.cache_clear()
        try:
            source = fagen.generate(spec)
        finally:
            backends.GLUON.variant.clear()
            backends.GLUON.variant.update(saved)
            render.render.cache_clear()
        tag = "_".join(f"{k}{v}" for k, v in overrides.items()) or "default"
        if mutant:
            assert mutant[0] in source, "the mutant's text is not in the render"
            source, tag = source.replace(mutant[0], mutant[1]), tag + "_mut"
        _PRODUCT[key] = load_source(source, f"{spec.name}_{tag}")
    return _PRODUCT[key]


def run_v1(do, q, k, v, out, lse, scale, causal, mode, kw, label=""):
    """The lab's v1 (dq_mode, constexprs kw), or for a "p-" label the product's render (variant kw)."""
    if label.startswith("p-"):
        mod = product_module(causal, kw, MUT if label.endswith("!") else None)
        return mod.backward(do, q, k, v, out, lse, scale=scale, deterministic=mode == 0)
    from lab import gluon_bwd as gb
    return gb.backward(do, q, k, v, out, lse, scale, causal, "v1", mode, **kw)


def reference(q, k, v, do, causal, scale):
    import torch
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    s = (q64 @ k64.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ v64
    return torch.autograd.grad(out, (q64, k64, v64), do.double())


def rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


# -- phases --------------------------------------------------------------------------------------------------
def phase_warm(part):
    import torch
    for label, mode, kw, causal in jobs()[part::WARM_WORKERS]:
        t0 = time.time()
        q, k, v, do = inputs(WARM_S)
        out, lse = forward(q, k, v, causal, 0.1)
        run_v1(do, q, k, v, out, lse, 0.1, causal, mode, kw, label)
        torch.cuda.synchronize()
        log(f"warm {label:<12} {'causal' if causal else 'full':<6} built and ran ({time.time() - t0:.1f}s)")


def phase_mask(causal):
    """Checks, then timings, of every variant of one mask; each timed row printed at once (ROW lines)."""
    import torch
    import triton
    mask = "causal" if causal else "full"
    scale = D ** -0.5
    cq, ck_, cv, cdo = inputs(CHECK_S, seed=1)
    cout, clse = forward(cq, ck_, cv, causal, scale)
    ref = reference(cq, ck_, cv, cdo, causal, scale)
    bq, bk, bv, bdo = inputs(BIT_S, seed=2)
    bout, blse = forward(bq, bk, bv, causal, scale)
    q, k, v, do = inputs(S)
    out, lse = forward(q, k, v, causal, scale)
    flops = 2.5 * 4 * B * H * S * S * D * (0.5 if causal else 1.0)
    row = dict(case=f"d128 {mask} B1 H16 s16k")

    def timed(label, fn):
        ms = triton.testing.do_bench(fn, warmup=5, rep=40)
        row[label] = flops / ms / 1e9
        log(f"TIME {mask:<6} {label:<12} {ms:7.3f} ms {row[label]:6.1f} TF/s")
        print("ROW " + json.dumps(row), flush=True)

    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, scale=scale)
    timed("cudnn", lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True))
    dq_chain = ref0 = None
    for label, mode, kw, masks in VARIANTS:
        if causal not in masks:
            continue
        try:
            if label.endswith("*"):  # a diagnostic (wrong dQ by construction): timed only
                timed(label, lambda: run_v1(do, q, k, v, out, lse, scale, causal, mode, kw, label))
                continue
            got = run_v1(cdo, cq, ck_, cv, cout, clse, scale, causal, mode, kw, label)
            errs = [rel(x, r) for x, r in zip(got, ref)]
            ok = all(e < 5e-3 for e in errs) and all(bool(torch.isfinite(x).all()) for x in got)
            zeros = bool((got[0][:, :, 0] == 0).all()) if causal else True
            same = True
            if mode != 1:  # deterministic: bitwise over 2 runs on a 4-wave shape
                runs = [run_v1(bdo, bq, bk, bv, bout, blse, scale, causal, mode, kw, label) for _ in range(2)]
                same = all(torch.equal(a, b) for a, b in zip(*runs))
            verdict = "PASS" if ok and zeros and same else "FAIL"
            if label.endswith("!"):  # a mutant: its check must fail
                caught = "caught" if verdict == "FAIL" else "NOT CAUGHT"
                log(f"MUTANT {mask:<6} {label:<12} rel dq {errs[0]:.2e} -> {caught}")
                continue
            log(f"CHECK {mask:<6} {label:<12} rel dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e}; "
                f"{'zeros ok' if zeros else 'ZEROS WRONG'}; {'bitwise x2' if mode != 1 else 'unordered'}"
                f"{'' if same else ' DIFFER'} -> {verdict}")
            if verdict == "PASS":
                timed(label, lambda: run_v1(do, q, k, v, out, lse, scale, causal, mode, kw, label))
                if ("fixed" in label or label == "chain") and "#" not in label:  # dq at s16k: float64, the chain
                    dq = run_v1(do, q, k, v, out, lse, scale, causal, mode, kw, label)[0].float()
                    if ref0 is None:  # head 0 at s16k in float64 (about 10 GB)
                        ref0 = reference(q[:, :1], k[:, :1], v[:, :1], do[:, :1], causal, scale)[0]
                    log(f"S16K  {mask:<6} {label:<12} dq of head 0 against float64: rel {rel(dq[:, :1], ref0):.2e}")
                    if label == "chain":
                        dq_chain = dq
                    else:
                        diff = (dq - dq_chain).abs()
                        log(f"S16K  {mask:<6} {label:<12} dq vs chain: {(diff == 0).float().mean().item():.4f} of "
                            f"bf16 elements equal, max diff {diff.max().item() / dq_chain.abs().max().item():.1e} "
                            f"of max|dq|, rel {rel(dq, dq_chain.double()):.1e}")
        except Exception as e:
            log(f"ERROR {mask:<6} {label:<12} {type(e).__name__}: {str(e)[:200]}")


def dry_run():
    """Any machine: each (variant, mask) main kernel built for sm_90; ptxas's numbers."""
    from lab import gluon_bwd as gb
    ok = True
    for label, mode, kw, causal in jobs():
        try:
            if label.startswith("p-"):
                ck = product_module(causal, kw, MUT if label.endswith("!") else None).compile_backward_for(
                    deterministic=mode == 0)
            else:
                ck = gb.compile_for("v1", head_dim=D, gqa=1, causal=causal, dq_mode=mode, **kw)
            r = gb.resources(ck)
            log(f"{label:<12} {'causal' if causal else 'full':<6} " + " ".join(f"{k} {v}" for k, v in r.items()))
        except Exception as e:
            ok = False
            log(f"{label:<12} causal={causal}: BUILD ERROR {type(e).__name__}: {str(e)[:300]}")
    log(f"dry run: {'OK' if ok else 'FAILED'}")
    return ok


# -- driver --------------------------------------------------------------------------------------------------
def table(rows):
    """One line per variant: TF/s and the ratio to cuDNN in each case (a blank where it did not run)."""
    cases = [r["case"] for r in rows]
    log("\n| variant | " + " | ".join(cases) + " |")
    log("|---|" + "---:|" * len(cases))
    for x in ["cudnn"] + [v[0] for v in VARIANTS]:
        cells = [(f"{r[x]:.0f}" + (f" ({r[x] / r['cudnn']:.2f}x)" if x != "cudnn" and "cudnn" in r else ""))
                 if x in r else "" for r in rows]
        log(f"| {x} | " + " | ".join(cells) + " |")
    log("(H100 bf16 d128 B1 H16 s16k, backward only, TF/s = 2.5 x forward FLOPs / mean time; (x) = / cuDNN; chain = "
        "the product's deterministic default in the lab; every variant deterministic but unord)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", help="warm0..warm11, causal, full")
    args = ap.parse_args()
    if DRY:
        sys.exit(0 if dry_run() else 1)
    if args.phase:
        import torch
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
            log(f"{args.phase}: needs an sm_90 GPU")
        elif args.phase.startswith("warm"):
            phase_warm(int(args.phase[4:]))
        else:
            phase_mask(args.phase == "causal")
        return
    t0 = time.time()
    env = _phases.child_env("/tmp/fagen-cache-gpu-gluon-bwd-order", ROOT)
    logs, rows = [], []
    n = min(WARM_WORKERS, len(jobs()))
    log(f"#### warm: {len(jobs())} kernels in {n} children ({LIMIT['warm']}s)")
    res = [None] * n

    def warm(i):
        res[i] = _phases.run_phase(__file__, f"warm{i}", LIMIT["warm"], env, on_line=lambda s: print(s, end=""))
    threads = [threading.Thread(target=warm, args=(i, )) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    logs += [line for r in res if r for line in r[1]]
    log(f"#### warm done: rc {[r[0] if r else None for r in res]}, {time.time() - t0:.0f}s")
    for name in ("causal", "full"):
        rc, lines = _phases.run_phase(__file__, name, LIMIT[name], env,
                                      on_line=lambda s: None if s.startswith("ROW ") else print(s, end="", flush=True))
        logs += lines
        rows += [json.loads(s[4:]) for s in lines if s.startswith("ROW ")][-1:]
        log(f"#### {name}: rc {rc}, {time.time() - t0:.0f}s")
    table(rows)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "gpu_gluon_bwd_order.log").write_text("".join(logs))


if __name__ == "__main__":
    main()
