"""The product's Gluon backward (fagen/templates/gluon/backward.py.j2) through fagen.attention on an H100/H200.

    PYTHONPATH=$PWD python3 scripts/gpu_gluon_bwd_product.py        # every phase, each in a child with a timeout
    python scripts/gpu_gluon_bwd_product.py --phase check           # one phase here (no child, no timeout)
    GPU_GLUON_BWD_PRODUCT_DRY=1 python scripts/gpu_gluon_bwd_product.py   # any machine: sm_90 builds only

Checks (bf16, fagen.attention with gradients; the problem-size floor hopper.BWD_MIN_WORK lowered to 0 so that small
shapes take the Gluon backward, which each check asserts): gradients of both modes (deterministic=True, False)
against a float64 autograd reference, beside the Triton backward's error on the same inputs (S not a multiple of
64/128, causal with rows that see no key, GQA 4); exact zeros (a row that sees one key: dQ = dK = 0); bitwise
repeatability of the deterministic mode over 3 runs; the mutant gluon-bwd-dq-one-half must fail the reference check.
Timing (triton.testing.do_bench median of torch.autograd.grad through fagen.attention's autograd, backward only,
TF/s = 2.5 x forward FLOPs / time): the product default (Gluon, deterministic), deterministic=False, the Triton
backward (its module, as FAGEN_HOPPER=0 gives) and cuDNN (SDPA), one table at the end; then the host time per
call of a small backward (B1 H8 s256 causal), Gluon vs Triton; last, gbwdlev's levers in the product's render
(GluonBackend.variant bwd_*): checked, then timed beside the default render.
Eighth session (GPU_GLUON_BWD_PRODUCT_PHASES=fwarm,fcheck,ftime0,ftime1,ftime2, the default): the deterministic
mode's fixed-point dQ (variant bwd_fixed, [Note] Fixed-point dQ) in the product's render: `fwarm` builds every module
the later phases run, in parallel children; `fcheck` checks the fixed render's deterministic mode against float64
(causal Sq > Sk, full, GQA 4 causal), exact zeros, bitwise over 3 runs, and its mutant (the row scale left out) must
fail; `ftimeN` times the default render's two modes, the fixed render's deterministic mode and cuDNN, one case each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for _phases
from _phases import child_env, run_phase as run_child  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (case, B, Hq, Hkv, S, causal)
CASES = [("d128 causal B1 H16 s16k", 1, 16, 16, 16384, True), ("d128 full B1 H16 s16k", 1, 16, 16, 16384, False),
         ("gqa 32/8 causal B4 s4k", 4, 32, 8, 4096, True)]
# Round B: the checks round A ran out of time on, split in two, and the levers; round A's table (time0..2, host) is
# in docs/hopper.md and runs with GPU_GLUON_BWD_PRODUCT_PHASES=time0,time1,time2,host.
ALL_PHASES = {"check_gqa": 40, "check": 50, "levers": 40, "time0": 20, "time1": 20, "time2": 20, "host": 15,
              "fwarm": 40, "fcheck": 20, "ftime0": 9, "ftime1": 9, "ftime2": 7, "ftime3": 7, "bwarm": 28, "btime": 30}
# Round A (03:30 UTC) ran fwarm,fcheck (all passed) and lost every ftime phase to first-launch compiles at the
# s16k shapes; round B (65 s): bwarm builds at the real shapes in parallel children, btime times every case in one.
PHASE_TIMEOUT = {name: ALL_PHASES[name] for name in
                 os.environ.get("GPU_GLUON_BWD_PRODUCT_PHASES", "bwarm,btime").split(",")}
MUTANT = "gluon-bwd-dq-one-half"
IMPL = ["gluon det (default)", "gluon unordered", "triton", "cudnn", "gluon fixed (det)"]


def log(*parts):
    print(*parts, flush=True)


def spec(causal, gqa, backend="triton", d=128):
    from fagen.spec.kernel import KernelSpec
    return KernelSpec(head_dim=d, mask="causal" if causal else "none", gqa=gqa, dtype="bf16", direction="bwd",
                      backend=backend)


def inputs(b, hq, hkv, sq, sk, seed=0, d=128):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, generator=g, device="cuda").bfloat16()
            for shape in ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d), (b, hq, sq, d))]


def reference(q, k, v, do, causal, scale):
    """float64 autograd gradients; bottom-right causal (query i sees key j iff j <= i + Sk - Sq); rows that see no
    key: out = 0, no gradient."""
    import torch
    gqa = q.shape[1] // k.shape[1]
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    kk, vv = (t.repeat_interleave(gqa, dim=1) for t in (k64, v64))
    s = (q64 @ kk.transpose(-1, -2)) * scale
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.autograd.grad(p @ vv, (q64, k64, v64), do.double())


def rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def grads(fn, q, k, v, do):
    """(dq, dk, dv) of out = fn(q, k, v) for the cotangent do."""
    import torch
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    return torch.autograd.grad(fn(qg, kg, vg), (qg, kg, vg), do)


def served(q, k, causal):
    """The name of the module fagen.attention runs with gradients for these inputs (resolve's memo)."""
    from fagen.runtime import resolve
    return resolve.resolve(q, k, k, "causal" if causal else "none", False, big_bwd=True).NAME


# -- phases --------------------------------------------------------------------------------------------------
def check_shape(results, b, hq, hkv, sq, sk, causal, mutant=False):
    """Both modes through fagen.attention against float64, beside the Triton backward's error; with `mutant`, the
    dQ mutant must fail the same bound."""
    import torch
    import fagen
    from fagen.verify import engine
    scale = 128 ** -0.5
    q, k, v, do = inputs(b, hq, hkv, sq, sk)
    mask = "causal" if causal else "none"
    name = served(q, k, causal)
    assert name.endswith("_gluon"), f"fagen.attention picked {name}, not the gluon backward"
    ref = reference(q, k, v, do, causal, scale)
    tri = grads(lambda *t: fagen.load(spec(causal, hq // hkv)).attention(*t, scale=scale), q, k, v, do)
    bound = [max(2 * rel(t, r), 5e-3) for t, r in zip(tri, ref)]
    shape = f"B{b} H{hq}/{hkv} {sq}x{sk} {mask}"
    log(f"{shape:<26} triton        rel dq {rel(tri[0], ref[0]):.2e} dk {rel(tri[1], ref[1]):.2e} "
        f"dv {rel(tri[2], ref[2]):.2e}  ({name} serves)")
    for det in (True, False):
        label = "det" if det else "unordered"
        got = grads(lambda *t: fagen.attention(*t, mask=mask, scale=scale, deterministic=det), q, k, v, do)
        errs = [rel(x, r) for x, r in zip(got, ref)]
        ok = all(e <= bd for e, bd in zip(errs, bound)) and all(torch.isfinite(x).all() for x in got)
        log(f"{shape:<26} {label:<13} rel dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e} "
            f"-> {'PASS' if ok else 'FAIL'}")
        results.append(dict(check="reference", shape=shape, mode=label, errs=errs, ok=bool(ok)))
    if mutant:
        broken = engine.mutant_module(spec(causal, hq // hkv, "gluon"), MUTANT)
        got = grads(lambda *t: broken.attention(*t, scale=scale), q, k, v, do)
        errs = [rel(x, r) for x, r in zip(got, ref)]
        caught = not all(e <= bd for e, bd in zip(errs, bound))
        log(f"{shape:<26} mutant {MUTANT}: rel dq {errs[0]:.2e} -> {'caught' if caught else 'NOT CAUGHT'}")
        results.append(dict(check="mutant", ok=caught))


def bitwise(results, hq, hkv, causal):
    import torch
    import fagen
    q, k, v, do = inputs(1, hq, hkv, 2000, 2000, seed=2)
    for det in (True, False):
        runs = [grads(lambda *t: fagen.attention(*t, mask="causal" if causal else "none", scale=0.09,
                                                 deterministic=det), q, k, v, do) for _ in range(3)]
        same = all(torch.equal(a, b) for r in runs[1:] for a, b in zip(r, runs[0]))
        label = f"H{hq}/{hkv} s2000 {'causal' if causal else 'none'} {'det' if det else 'unordered'}"
        verdict = ("equal" if same else "differ") + ("" if same or not det else " FAIL")
        log(f"bitwise over 3 runs {label:<30} -> {verdict}")
        results.append(dict(check="bitwise", what=label, same=same, ok=same or not det))


def phase_check_gqa(results):
    """GQA 4, causal, Sq > Sk (rows that see no key), lengths off the blocks; the deterministic mode's repeatability
    at GQA causal (round A ran out of time here, compiling)."""
    from fagen.runtime import api
    api.BWD_MIN_WORK = 0  # small shapes take the Gluon backward too (the floor is a host-time rule)
    check_shape(results, 2, 8, 2, 257, 190, True)
    bitwise(results, 8, 2, True)
    log(f"checks (gqa): {'ALL PASS' if all(r['ok'] for r in results) else 'SOME FAILED'}")


def phase_check(results):
    import fagen
    from fagen.runtime import api
    api.BWD_MIN_WORK = 0
    check_shape(results, 1, 2, 2, 300, 190, True, mutant=True)  # Sq > Sk, causal: rows 0..109 see no key
    check_shape(results, 1, 2, 2, 200, 333, False)
    # exact zeros: full mask with Sk = 1 (every row sees one key), causal Sq = Sk (row 0 sees key 0 only)
    for (sq, sk, causal) in ((100, 1, False), (200, 200, True)):
        q, k, v, do = inputs(1, 2, 2, sq, sk, seed=1)
        dq, dk, dv = grads(lambda *t: fagen.attention(*t, mask="causal" if causal else "none", scale=0.1), q, k, v,
                           do)
        ok = bool((dq[:, :, 0] == 0).all()) if causal else bool((dq == 0).all() and (dk == 0).all())
        what = "dq[row 0], causal" if causal else "dq, dk (Sk = 1)"
        log(f"exact zeros {what:<18} -> {'PASS' if ok else 'FAIL'} (max |dq| {dq.float().abs().max().item():.1e})")
        results.append(dict(check="zeros", what=what, ok=ok))
    bitwise(results, 4, 4, False)
    # what `fagen bench --suite standard` runs on its bwd rows (BenchCase.spec), and its fagen-nondet column
    from fagen.bench.impls import case_impls
    from fagen.bench.workloads import standard_suite
    for c in standard_suite():
        if c.direction.value == "bwd":
            sp, note = c.spec("cuda")
            log(f"bench {c.name:<24} {sp.name} ({note}); impls {case_impls(c, ('fagen', 'fagen-nondet'))}")
    log(f"checks: {'ALL PASS' if all(r['ok'] for r in results) else 'SOME FAILED'}")


# Round A (gbwdlev's lab run): no lever won in the deterministic mode; with unordered adds at d128 causal s16k all of
# them together ran 520 against 469 TF/s. Here: the unordered mode's own kernel with levers (variant
# bwd_unordered_levers, causal specs; the deterministic kernel unchanged), which one. (The wave order lost everywhere;
# snake alone lost 8% deterministic, so it is timed only inside nes.)
LEVERS = {"u-epi": {"bwd_epi_tma": 1}, "u-named": {"bwd_named": 2},
          "u-nes": {"bwd_named": 2, "bwd_epi_tma": 1, "bwd_snake": 1}}


def lever_module(causal, gqa, name):
    """The gluon bwd module rendered with the unordered mode's levers LEVERS[name] (GluonBackend.variant
    bwd_unordered_levers, [Note] Gluon backward levers), loaded under its own name."""
    import fagen
    from fagen import backends
    from fagen.codegen import render as _render
    from fagen.runtime.loader import load_source
    s = spec(causal, gqa, "gluon")
    saved = backends.GLUON.variant["bwd_unordered_levers"]
    backends.GLUON.variant["bwd_unordered_levers"] = LEVERS[name]
    _render.render.cache_clear()
    try:
        source = fagen.generate(s)
    finally:
        backends.GLUON.variant["bwd_unordered_levers"] = saved
        _render.render.cache_clear()
    assert "_attn_bwd_hopper_u" in source, "the unordered kernel with levers was not rendered"
    return load_source(source, f"{s.name}_{name.replace('-', '_')}")


def phase_levers(results):
    """The unordered mode's levers in the product's render: each checked against float64 at a small causal shape
    (unordered; the deterministic mode's kernel is the default one), then timed at d128 causal s16k beside the
    default render's two modes, in one process."""
    import torch
    import triton
    import fagen
    q, k, v, do = inputs(1, 2, 2, 300, 300)
    ref = reference(q, k, v, do, True, 128 ** -0.5)
    tri = grads(lambda *t: fagen.load(spec(True, 1)).attention(*t), q, k, v, do)
    bound = [max(2 * rel(t, r), 5e-3) for t, r in zip(tri, ref)]
    mods = {name: lever_module(True, 1, name) for name in LEVERS}
    for name, mod in mods.items():
        got = grads(lambda *t: mod.attention(*t, deterministic=False), q, k, v, do)
        errs = [rel(x, r) for x, r in zip(got, ref)]
        ok = all(e <= bd for e, bd in zip(errs, bound)) and all(torch.isfinite(x).all() for x in got)
        log(f"levers {name:<8} B1 H2/2 300x300 causal unordered: rel dq {errs[0]:.2e} dk {errs[1]:.2e} "
            f"dv {errs[2]:.2e} -> {'PASS' if ok else 'FAIL'}")
        results.append(dict(check="levers", what=name, ok=bool(ok)))
    name_c, b, hq, hkv, s, causal = CASES[0]
    flops = 2.5 * 4 * b * hq * s * s * 128 * (0.5 if causal else 1.0)
    q, k, v, do = inputs(b, hq, hkv, s, s)
    runs = [("default", True), ("default", False)] + [(name, False) for name in LEVERS] + [("default", False)]
    for label, det in runs:
        mod = fagen.load(spec(causal, hq // hkv, "gluon")) if label == "default" else mods[label]
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        mode = "det" if det else "unordered"
        try:
            out = mod.attention(qg, kg, vg, scale=128 ** -0.5, deterministic=det)
            step = lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)  # noqa: E731
            step()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(step, warmup=10, rep=60)
            log(f"levers {name_c:<24} {label:<8} {mode:<9} {ms:8.3f} ms {flops / ms / 1e9:6.1f} TF/s")
        except Exception as e:
            log(f"levers {name_c:<24} {label:<8} {mode:<9} ERROR {type(e).__name__}: {str(e)[:200]}")


# -- eighth session: the fixed-point dQ (variant bwd_fixed) -------------------------------------------------------
FIXED = {"bwd_fixed": 1}
FIXED_MUTANT = ("dq = _cvt_rni(dq * qm[:, None])", "dq = _cvt_rni(dq)")  # the row scale left out
# CASES and d64 (the gluon backward builds d64; selected only at d128): (case, B, Hq, Hkv, S, causal, D)
FCASES = [c + (128, ) for c in CASES] + [("d64 causal B1 H32 s16k", 1, 32, 32, 16384, True, 64)]
# (the Triton backward at d64 only: whether the gluon one should serve d64 is the question there)
FWARM_JOBS = [(c, r) for c in range(len(FCASES)) for r in ("default", "fixed")] + [(3, "triton"), (0, "mutant")]


def variant_module(causal, gqa, overrides, mutant=None, d=128):
    """The gluon bwd module rendered with GluonBackend.variant updated by `overrides` ([Note] Gluon backward
    levers), `mutant` (old, new) applied to its source, loaded under its own name."""
    import fagen
    from fagen import backends
    from fagen.codegen import render as _render
    from fagen.runtime.loader import load_source
    s = spec(causal, gqa, "gluon", d)
    saved = dict(backends.GLUON.variant)
    backends.GLUON.variant.update(overrides)
    _render.render.cache_clear()
    try:
        source = fagen.generate(s)
    finally:
        backends.GLUON.variant.clear()
        backends.GLUON.variant.update(saved)
        _render.render.cache_clear()
    tag = "_".join(f"{k}{v}" for k, v in overrides.items())
    if mutant:
        assert mutant[0] in source, "the mutant's text is not in the render"
        source, tag = source.replace(mutant[0], mutant[1]), tag + "_mut"
    return load_source(source, f"{s.name}_{tag}")


def case_module(which, render):
    name_c, b, hq, hkv, s, causal, d = FCASES[which]
    if render in ("default", "triton"):
        import fagen
        return fagen.load(spec(causal, hq // hkv, "gluon" if render == "default" else "triton", d))
    return variant_module(causal, hq // hkv, FIXED, FIXED_MUTANT if render == "mutant" else None, d)


def phase_fwarm(results, part):
    """Child `part`: build FWARM_JOBS[part] by a tiny forward and backward in each mode it runs later."""
    which, render = FWARM_JOBS[part]
    _, b, hq, hkv, s, causal, d = FCASES[which]
    t0 = time.time()
    mod = case_module(which, render)
    q, k, v, do = inputs(1, hq // hkv, 1, 200, 200, d=d)
    for det in ((True, False) if render == "default" else (True, )):
        grads(lambda *t: mod.attention(*t, **({} if render == "triton" else {"deterministic": det})), q, k, v, do)
    import torch
    torch.cuda.synchronize()
    log(f"fwarm {FCASES[which][0]} {render}: built ({time.time() - t0:.1f}s)")


def phase_fcheck(results):
    """The fixed render's deterministic mode against float64 beside the default render's error; exact zeros;
    bitwise over 3 runs; the mutant must fail."""
    import torch
    for (b, hq, hkv, sq, sk, causal), which in (((1, 2, 2, 300, 190, True), 0), ((1, 2, 2, 200, 333, False), 1),
                                                 ((2, 8, 2, 257, 190, True), 2), ((1, 2, 2, 130, 260, True), 3)):
        mod = case_module(which, "fixed")
        d = FCASES[which][-1]
        scale = d ** -0.5
        q, k, v, do = inputs(b, hq, hkv, sq, sk, d=d)
        ref = reference(q, k, v, do, causal, scale)
        # the bound: twice the default render's (float32-ordered) error, as the other checks take the Triton one's
        tri = grads(lambda *t: case_module(which, "default").attention(*t, scale=scale), q, k, v, do)
        bound = [max(2 * rel(t, r), 5e-3) for t, r in zip(tri, ref)]
        shape = f"d{d} B{b} H{hq}/{hkv} {sq}x{sk} {'causal' if causal else 'none'}"
        runs = [("fixed", mod)] + ([("fixed mutant*", case_module(0, "mutant"))] if which == 0 else [])
        for label, m in runs:
            got = grads(lambda *t: m.attention(*t, scale=scale, deterministic=True), q, k, v, do)
            errs = [rel(x, r) for x, r in zip(got, ref)]
            ok = all(e <= bd for e, bd in zip(errs, bound)) and all(torch.isfinite(x).all() for x in got)
            if label.endswith("*"):
                log(f"{shape:<26} {label:<14} rel dq {errs[0]:.2e} -> {'caught' if not ok else 'NOT CAUGHT'}")
                results.append(dict(check="mutant", ok=not ok))
            else:
                log(f"{shape:<26} {label:<14} rel dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e} (default dq "
                    f"{rel(tri[0], ref[0]):.2e}) -> {'PASS' if ok else 'FAIL'}")
                results.append(dict(check="reference", shape=shape, ok=bool(ok)))
    for (sq, sk, causal), which in (((100, 1, False), 1), ((200, 200, True), 0)):
        q, k, v, do = inputs(1, 2, 2, sq, sk, seed=1)
        mod = case_module(which, "fixed")
        dq, dk, dv = grads(lambda *t: mod.attention(*t, scale=0.1), q, k, v, do)
        ok = bool((dq[:, :, 0] == 0).all()) if causal else bool((dq == 0).all() and (dk == 0).all())
        what = "dq[row 0], causal" if causal else "dq, dk (Sk = 1)"
        log(f"fixed exact zeros {what:<18} -> {'PASS' if ok else 'FAIL'}")
        results.append(dict(check="zeros", ok=ok))
    for (b, hq, hkv, s, causal), which in (((2, 16, 16, 4000, False), 1), ((4, 8, 2, 3000, True), 2)):
        q, k, v, do = inputs(b, hq, hkv, s, s, seed=2)
        mod = case_module(which, "fixed")
        runs = [grads(lambda *t: mod.attention(*t, scale=0.09), q, k, v, do) for _ in range(3)]
        same = all(torch.equal(a, c) for r in runs[1:] for a, c in zip(r, runs[0]))
        det = grads(lambda *t: case_module(which, "default").attention(*t, scale=0.09), q, k, v, do)
        eq = (runs[0][0] == det[0]).float().mean().item()
        log(f"fixed bitwise x3 B{b} H{hq}/{hkv} s{s} {'causal' if causal else 'none'} -> "
            f"{'equal' if same else 'DIFFER FAIL'}; dq equal to the float32-ordered det's in {eq:.4f} of elements")
        results.append(dict(check="bitwise", ok=same))
    log(f"fixed checks: {'ALL PASS' if all(r['ok'] for r in results) else 'SOME FAILED'}")


def phase_bwarm(results, part):
    """Child `part`: FWARM_JOBS[part]'s module run once at its case's real shape in each mode btime times (the
    first launch at a shape compiles its specializations)."""
    import torch
    which, render = FWARM_JOBS[part]
    name_c, b, hq, hkv, s, causal, d = FCASES[which]
    t0 = time.time()
    mod = case_module(which, render)
    q, k, v, do = inputs(b, hq, hkv, s, s, d=d)
    for det in ((True, False) if render == "default" else (True, )):
        kw = {} if render == "triton" else {"deterministic": det}
        grads(lambda *t: mod.attention(*t, scale=d ** -0.5, **kw), q, k, v, do)
    torch.cuda.synchronize()
    log(f"bwarm {name_c} {render}: built and ran ({time.time() - t0:.1f}s)")


def phase_btime(results):
    """Every FCASES case in turn, one process: phase_ftime's rows."""
    import torch
    for which in range(len(FCASES)):
        phase_ftime(results, which)
        torch.cuda.empty_cache()


def phase_ftime(results, which):
    """TF/s of the default render (deterministic, unordered), the fixed render's deterministic mode and cuDNN, one
    process, backward only through autograd (the Triton backward: docs/hopper.md's earlier runs)."""
    import torch
    import triton
    name_c, b, hq, hkv, s, causal, d = FCASES[which]
    flops = 2.5 * 4 * b * hq * s * s * d * (0.5 if causal else 1.0)
    q, k, v, do = inputs(b, hq, hkv, s, s, d=d)
    row = dict(case=name_c)
    runs = [("gluon det (default)", case_module(which, "default"), True),
            ("gluon fixed (det)", case_module(which, "fixed"), True),
            ("gluon unordered", case_module(which, "default"), False),
            ("cudnn", None, True)] + ([("triton", case_module(which, "triton"), True)] if d == 64 else [])
    for label, mod, det in runs:
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        try:
            if mod is None:
                from torch.nn.attention import SDPBackend, sdpa_kernel
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    out = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal,
                                                                           enable_gqa=hq != hkv)
            else:
                kw = {} if label == "triton" else {"deterministic": det}
                out = mod.attention(qg, kg, vg, scale=d ** -0.5, **kw)
            step = lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)  # noqa: E731
            step()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(step, warmup=3, rep=25)
            row[label] = flops / ms / 1e9
            log(f"{name_c:<24} {label:<20} {ms:8.3f} ms {row[label]:6.1f} TF/s")
        except Exception as e:
            log(f"{name_c:<24} {label:<20} ERROR {type(e).__name__}: {str(e)[:200]}")
    results.append(row)


def phase_host(results):
    """Host time per call of a small backward (B1 H8 s256 d128 causal): the median wall time of one
    torch.autograd.grad, synchronised, over 200 calls, Gluon vs Triton module."""
    import torch
    import fagen
    q, k, v, do = inputs(1, 8, 8, 256, 256)
    for label, module in (("gluon", fagen.load(spec(True, 1, "gluon"))), ("triton", fagen.load(spec(True, 1)))):
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = module.attention(qg, kg, vg)
        times = []
        for _ in range(200):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        times.sort()
        log(f"host: one small backward (B1 H8 s256 causal), {label:<7} median {times[100] * 1e6:7.1f} us a call "
            f"(min {times[0] * 1e6:.1f})")
        results.append(dict(host=label, us=times[100] * 1e6))


def dry_run():
    """Any machine: build the gluon backward for sm_90 in both modes and print ptxas's numbers."""
    import re
    import fagen
    sys.path.insert(0, str(ROOT / "tests"))
    from sm90 import ptxas
    ok = True
    for causal, gqa in ((True, 1), (False, 1), (True, 4)):
        for det in (True, False):
            try:
                ck = fagen.load(spec(causal, gqa, "gluon")).compile_backward_for(deterministic=det)
                res = next(iter(ptxas(ck.asm["ptx"])[0].values()))
                regs = sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)",
                                                          ck.asm["ptx"])})
                log(f"{'causal' if causal else 'none':<6} gqa {gqa} {'det' if det else 'unordered':<9}: shared "
                    f"{ck.metadata.shared} B, spills {res.spill_stores}/{res.spill_loads} B, setmaxnreg {regs}")
            except Exception as e:
                ok = False
                log(f"causal {causal} gqa {gqa} det {det}: BUILD ERROR {type(e).__name__}: {str(e)[:300]}")
    for causal, gqa, d in ((True, 1, 128), (False, 1, 128), (True, 4, 128), (True, 1, 64)):  # the fixed render
        try:
            ck = variant_module(causal, gqa, FIXED, d=d).compile_backward_for(deterministic=True)
            res = next(iter(ptxas(ck.asm["ptx"])[0].values()))
            log(f"fixed d{d} {'causal' if causal else 'none':<6} gqa {gqa} det: shared {ck.metadata.shared} B, spills "
                f"{res.spill_stores}/{res.spill_loads} B, cvt.rni {ck.asm['ptx'].count('cvt.rni.s32.f32')}")
            variant_module(causal, gqa, FIXED, FIXED_MUTANT, d)  # the mutant's text is in the render
        except Exception as e:
            ok = False
            log(f"fixed causal {causal} gqa {gqa}: BUILD ERROR {type(e).__name__}: {str(e)[:300]}")
    for causal, gqa, name in ((True, 1, "u-nes"), ):
        try:
            ck = lever_module(causal, gqa, name).compile_backward_for(deterministic=False)
            res = next(iter(ptxas(ck.asm["ptx"])[0].values()))
            log(f"levers {name:<5} {'causal' if causal else 'none':<6} gqa {gqa}: shared {ck.metadata.shared} B, "
                f"spills {res.spill_stores}/{res.spill_loads} B")
        except Exception as e:
            ok = False
            log(f"levers {name}: BUILD ERROR {type(e).__name__}: {str(e)[:300]}")
    log(f"dry run: {'OK' if ok else 'FAILED'}")
    return ok


# -- driver --------------------------------------------------------------------------------------------------
def run_phase(name):
    import torch
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        log(f"{name}: needs an sm_90 GPU")
        return []
    results = []
    try:
        if name == "check":
            phase_check(results)
        elif name == "check_gqa":
            phase_check_gqa(results)
        elif name == "host":
            phase_host(results)
        elif name == "levers":
            phase_levers(results)
        elif name.startswith("fwarm") and name != "fwarm":
            phase_fwarm(results, int(name[5:]))
        elif name.startswith("bwarm") and name != "bwarm":
            phase_bwarm(results, int(name[5:]))
        elif name == "btime":
            phase_btime(results)
        elif name == "fcheck":
            phase_fcheck(results)
        elif name.startswith("ftime"):
            phase_ftime(results, int(name[-1]))
        else:
            phase_ftime(results, int(name[-1]))  # time0..2: the same table (the fixed render beside)
    except Exception as e:
        log(f"{name}: ERROR {type(e).__name__}: {e}")
        traceback.print_exc()
    print("RESULTS " + json.dumps(results), flush=True)
    return results


def table(rows):
    """One row per case: TF/s of each implementation and the ratios of the two Gluon modes to Triton and cuDNN."""
    log("\n| case | " + " | ".join(IMPL) + " | det / triton | det / cudnn | unordered / cudnn | fixed / cudnn |")
    log("|---|" + "---:|" * (len(IMPL) + 4))
    for r in rows:
        cells = [f"{r[i]:.0f}" if i in r else "-" for i in IMPL]
        ratio = lambda a, b: f"{r[a] / r[b]:.2f}x" if a in r and b in r else "-"  # noqa: E731
        log(f"| {r['case']} | " + " | ".join(cells) + f" | {ratio(IMPL[0], 'triton')} | {ratio(IMPL[0], 'cudnn')} | "
            f"{ratio(IMPL[1], 'cudnn')} | {ratio(IMPL[4], 'cudnn')} |")
    log("(bf16, backward only through autograd, TF/s = 2.5 x forward FLOPs / median time; GQA causal: "
        "deterministic=False serves the deterministic kernel by the rule)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", help="run one phase here (no child process): check, time0..time2, host, levers")
    args = ap.parse_args()
    if os.environ.get("GPU_GLUON_BWD_PRODUCT_DRY"):
        sys.exit(0 if dry_run() else 1)
    if args.phase:
        run_phase(args.phase)
        return
    t0 = time.time()
    out = os.environ.get("OUT")
    env = child_env("/tmp/fagen-cache-gpu-gluon-bwd-product", ROOT)
    rows, logs = [], []
    for name, limit in PHASE_TIMEOUT.items():
        log(f"#### phase {name} (timeout {limit}s)")
        if name in ("fwarm", "bwarm"):  # one child per FWARM_JOBS entry, all at once
            procs = [subprocess.Popen([sys.executable, __file__, "--phase", f"{name}{i}"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                     for i in range(len(FWARM_JOBS) - (name == "bwarm"))]  # bwarm: not the mutant (last)
            deadline = time.time() + limit
            for p in procs:
                try:
                    outs = p.communicate(timeout=max(deadline - time.time(), 0.1))[0]
                except subprocess.TimeoutExpired:
                    p.kill()
                    outs = p.communicate()[0] + "killed (timeout)\n"
                logs.append(outs)
                print("".join(x + "\n" for x in outs.splitlines() if not x.startswith("RESULTS ")), end="",
                      flush=True)
            log(f"#### phase {name}: {time.time() - t0:.0f}s so far")
            continue
        rc, lines = run_child(__file__, name, limit, env,
                              lambda line: line.startswith("RESULTS ") or print(line, end="", flush=True))
        for line in lines:
            if line.startswith("RESULTS ") and name.startswith(("time", "ftime", "btime")):
                rows += json.loads(line[8:])
        logs += lines
        log(f"#### phase {name}: rc={rc}, {time.time() - t0:.0f}s so far")
    table(rows)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu_gluon_bwd_product.log").write_text("".join(logs))


if __name__ == "__main__":
    main()
