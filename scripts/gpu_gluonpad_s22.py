"""Padding masks in the Gluon (Hopper) forward, twenty-second session: masks padding and causal+padding in
fagen/templates/gluon/attention.py.j2 ([Note] Gluon padding masks), bf16/fp16 and fp8 e4m3, against float64 and
timed on the standard suite's row fwd-causalpad-d128-s8k against the Triton forward that serves it now.

Phases, each a child process with a wall-clock limit (a fault or a hang costs its own child only), < 50 s in all:
  build     a pool builds every module (a small call each): the gluon padding modules of CASES and the timed rows'
            modules (the Triton product's and the gluon candidate's);
  check     CASES against float64 (fagen.verify.reference: bf16/fp16 within fagen's TOLERANCE / LSE_TOLERANCE; fp8
            on the dequantized inputs within scripts/gpu_fp8.py's bounds: RMSE <= 1.5x the e4m3 emulation's + 1e-4,
            lse <= 2e-3); lengths 0, 1, odd, not multiples of 64/128, lq > lk and lq < lk, GQA 4, d64, fp16; padded
            rows out exactly 0 and lse -inf; NaN written into every padding position of q, k and v: out and lse
            finite and bit for bit the clean call's; lengths past the tensors (-7, 10^6) bit for bit the clamped
            ones'; a teeth row: the same outputs against the reference without padding must fail;
  memcheck  (beside check) compute-sanitizer --tool memcheck on small padded calls, bf16 and fp8, lengths in range
            and out of it (-7, 10^6: clamped in the kernel, [Note] Memory safety);
  time      the suite's row fwd-causalpad-d128-s8k (B8 H16 s8k d128 bf16, the suite's seeded lengths) and the same row
            with mask padding, through the suite's row function (fagen.bench.impls.prepare_fagen) and measure
            (fagen.bench.timing.measure), the Triton product (backend 'triton' pinned) and the gluon candidate
            (backend 'gluon' pinned), every pass a fresh seeded shuffle; per-pass time ratios Triton / gluon.

    python3 scripts/gpu_gluonpad_s22.py --round A    # (B: the default)
    python3 scripts/gpu_gluonpad_s22.py --dry-run    # every gluon module built for sm_90 on the CPU: regs, spills

docs/hopper.md, "Padding masks in the Gluon forward (twenty-second session)".
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
from _phases import child_env, run_phase  # noqa: E402

ROUND = (sys.argv[sys.argv.index("--round") + 1] if "--round" in sys.argv
         else os.environ.get("GLUONPAD_ROUND", "B")).upper()  # the children read the parent's round from the env
OUT = Path(os.environ.get("OUT") or "/tmp/gluonpad-out")
WORK = Path("/tmp/gluonpad-work")  # caches and the mutant's source: not under $OUT (it comes back)
T0 = time.time()
LIMIT = {"build": 20, "check": 12, "memcheck": 16, "time": 10}
BIG = 10 ** 6
# (name, mask, dtype, head_dim, gqa, batch, kv heads, sq, sk, lengths q, lengths k)
CASES = [
    ("mix", "causal+padding", "bf16", 128, 1, 4, 2, 300, 300, (0, 1, 137, 300), (5, 1, 200, 255)),
    ("mix", "padding", "bf16", 128, 1, 4, 2, 300, 300, (0, 1, 137, 300), (5, 1, 200, 255)),
    ("gqa4", "causal+padding", "bf16", 128, 4, 3, 2, 257, 513, (257, 100, 3), (513, 64, 129)),
    ("gqa4", "padding", "bf16", 128, 4, 3, 2, 257, 513, (257, 100, 3), (513, 64, 129)),
    ("big", "causal+padding", "bf16", 128, 1, 2, 4, 2048, 1500, (2048, 701), (1500, 1201)),
    ("big", "padding", "bf16", 128, 1, 2, 4, 2048, 2048, (2047, 1300), (1999, 2048)),
    ("d64", "causal+padding", "bf16", 64, 1, 3, 2, 1000, 1000, (999, 500, 1000), (1000, 777, 1)),
    ("d64", "padding", "fp16", 64, 1, 3, 2, 1000, 1000, (999, 500, 1000), (1000, 777, 1)),
    ("mix", "causal+padding", "fp8_e4m3", 128, 1, 4, 2, 300, 300, (0, 1, 137, 300), (5, 1, 200, 255)),
    ("mix", "padding", "fp8_e4m3", 128, 1, 4, 2, 300, 300, (0, 1, 137, 300), (5, 1, 200, 255)),
    ("gqa4", "causal+padding", "fp8_e4m3", 128, 4, 3, 2, 257, 513, (257, 100, 3), (513, 64, 129)),
    ("big", "causal+padding", "fp8_e4m3", 128, 1, 2, 4, 2048, 1500, (2048, 701), (1500, 1201)),
    ("big", "padding", "fp8_e4m3", 128, 1, 2, 4, 2048, 2048, (2047, 1300), (1999, 2048)),
    ("d64", "causal+padding", "fp8_e4m3", 64, 1, 3, 2, 1000, 1000, (999, 500, 1000), (1000, 777, 1)),
]
ROW = "fwd-causalpad-d128-s8k"
# Candidates ([Note] Gluon padding masks): "e", GluonBackend.variant pad_empty 1 (a tile with no key loads no Q and
# stores the zeros its staging buffer already holds; checked in round A: the children read round B then); "eo", and
# pad_order 2 (the tile counter, heavy first by batch, instead of round-robin). Each is checked on its VAR_CASES
# (indices into CASES) and timed beside the product's padding render (both 0); the fp8 row of the suite's shape too.
VARIANTS = {"e": {"pad_empty": 1}, "eo": {"pad_empty": 1, "pad_order": 2}}
VAR_CASES = {"A": {"e": (0, 1, 2, 4, 8, 11)}, "B": {"eo": (0, 1, 2, 4, 6, 8, 11, 13)}}[ROUND]
TIMED = {"A": ("e",), "B": ("e", "eo")}[ROUND]
MOCK = os.environ.get("GLUONPAD_MOCK") == "1"  # the check plumbing on the CPU: the float64 reference stands in
DEV = "cpu" if MOCK else "cuda"
PASSES = 20
BENCH_MS = (10, 40)


def log(*a):
    print(*a, flush=True)


def spec_of(mask, dtype, head_dim, gqa, backend="gluon"):
    from fagen.spec.kernel import KernelSpec
    return KernelSpec(backend=backend, head_dim=head_dim, mask=mask, dtype=dtype, gqa=gqa)


def modules():
    """(mask, dtype, head_dim, gqa) of every gluon module the checks call."""
    return list(dict.fromkeys((c[1], c[2], c[3], c[4]) for c in CASES))


def var_modules():
    return list(dict.fromkeys((v,) + tuple(CASES[i][1:5]) for v, idx in VAR_CASES.items() for i in idx))


class variant:
    """GluonBackend.variant changed by VARIANTS[name] inside the block (fagen.load keys its modules on the variant a
    render reads: render.render_state)."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        from fagen import backends
        self.saved = dict(backends.GLUON.variant)
        backends.GLUON.variant.update(VARIANTS[self.name])

    def __exit__(self, *exc):
        from fagen import backends
        backends.GLUON.variant.clear()
        backends.GLUON.variant.update(self.saved)


def load(mask, dtype, d, gqa, var=None):
    import fagen
    if not var:
        return fagen.load(spec_of(mask, dtype, d, gqa))
    with variant(var):
        return fagen.load(spec_of(mask, dtype, d, gqa))


def mutant_module():
    """The bf16 causal+padding module without its V zeroing (the epilogue's _zero_pad_keys call left out): the NaN
    check must catch it (teeth on the GPU)."""
    from fagen.codegen.render import render
    from fagen.runtime.modules import import_module
    src = render(spec_of("causal+padding", "bf16", 128, 1)).source
    cut = "".join(x for x in src.splitlines(keepends=True) if "_zero_pad_keys(v_smem.index(sp)" not in x)
    assert cut.count("\n") == src.count("\n") - 1
    path = WORK / "gluonpad_mutant_nozero.py"
    if not path.exists() or path.read_text() != cut:
        path.write_text(cut)
    return import_module(path, "gluonpad_mutant_nozero")


# -- build ---------------------------------------------------------------------------------------------------
def _warm(key):
    t = time.time()
    try:
        import torch
        import fagen
        if key[0] == "row":
            cc, fn = row_fn(*key[1:])
            fn(0)
            torch.cuda.synchronize()
            return f"built row {key[1]} {key[2]} in {time.time() - t:.1f}s"
        var = key[0] if key[0] in VARIANTS else None
        mask, dtype, d, gqa = key[1:] if var else key
        m = mutant_module() if mask == "mutant" else load(mask, dtype, d, gqa, var)
        lens = torch.tensor([70], dtype=torch.int32, device=DEV)
        q = torch.randn(1, gqa, 100, d, device=DEV)
        k = torch.randn(1, 1, 100, d, device=DEV)
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn}[dtype]
        m.forward(q.to(dt), k.to(dt), k.to(dt), seqlens_q=lens, seqlens_k=lens)
        torch.cuda.synchronize()
        return f"built {mask} {dtype} d{d} gqa{gqa} in {time.time() - t:.1f}s"
    except Exception as e:  # noqa: BLE001
        return f"build ERROR {key}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def phase_build():
    work = [("row", ROW, b) for b in ("triton", "gluon")] + [("row", "pad", b) for b in ("triton", "gluon")]
    work += modules() + [("mutant", "bf16", 128, 1)] + var_modules()
    work += [("row", w, "gluon", v) for v in TIMED for w in (ROW, "pad", "fp8")] + [("row", "fp8", "gluon")]
    work = sorted(work, key=lambda w: w[0] != "row")  # the rows first: their inputs take longest
    with mp.get_context("spawn").Pool(min(len(work), 16)) as pool:
        for msg in pool.imap_unordered(_warm, work):
            log(msg)


# -- check ---------------------------------------------------------------------------------------------------
def _inputs(c, seed):
    """(q, k, v in the kernel's dtype, forward keywords, the float64 reference inputs)."""
    import torch
    sys.path.insert(0, str(HERE))
    import gpu_fp8
    _, mask, dtype, d, gqa, b, hkv, sq, sk, lq, lk = c
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = [torch.randn(s, generator=g, device=DEV).to(torch.bfloat16).float()
         for s in ((b, hkv * gqa, sq, d), (b, hkv, sk, d), (b, hkv, sk, d))]
    if dtype == "fp8_e4m3":
        (q8, dq), (k8, dk), (v8, dv) = (gpu_fp8.quantize(t, True) for t in x)
        kw = dict(q_descale=dq, k_descale=dk, v_descale=dv)
        return [q8, k8, v8], kw, [gpu_fp8.dequantize(t, s) for t, s in ((q8, dq), (k8, dk), (v8, dv))]
    dt = torch.bfloat16 if dtype == "bf16" else torch.float16
    t = [y.to(dt) for y in x]
    return t, {}, [y.double() for y in t]


def _poison(t, lens):
    """A copy of t [B, H, S, D] with NaN in every position at or past its sequence's length."""
    import torch
    t = t.clone()
    fp8 = t.dtype == torch.float8_e4m3fn
    u = t.view(torch.uint8) if fp8 else t  # e4m3fn's NaN is the byte 0x7f (no fill kernel for fp8 needed)
    for i, n in enumerate(lens):
        u[i, :, max(n, 0):] = 0x7F if fp8 else float("nan")
    return t


class _Mock:
    """GLUONPAD_MOCK=1: the reference as the module (out rounded to bf16), so the checks' plumbing runs on the CPU."""

    def __init__(self, mask):
        self.mask = mask

    def forward(self, q, k, v, seqlens_q, seqlens_k, check=None, q_descale=None, k_descale=None, v_descale=None):
        import torch
        import gpu_fp8
        lq, lk = seqlens_q.clamp(0, q.shape[2]), seqlens_k.clamp(0, k.shape[2])
        x = [t.double() if d is None else gpu_fp8.dequantize(t, d) for t, d in ((q, q_descale), (k, k_descale),
                                                                               (v, v_descale))]
        from fagen.verify import reference
        o, lse = reference.attention(*x, mask=self.mask, seqlens_q=lq, seqlens_k=lk)
        return o.to(torch.bfloat16 if q.dtype != torch.float16 else q.dtype), lse.float()


def check_case(c, seed=0, var=None):
    import torch
    import fagen
    import gpu_fp8
    from fagen.spec.axes import DType
    from fagen.verify import reference
    from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE
    name, mask, dtype, d, gqa, b, hkv, sq, sk, lq, lk = c
    m = _Mock(mask) if MOCK else load(mask, dtype, d, gqa, var)
    (q, k, v), kw, ref_in = _inputs(c, seed)
    sl = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731
    out, lse = m.forward(q, k, v, seqlens_q=sl(lq), seqlens_k=sl(lk), **kw)
    if not MOCK:
        torch.cuda.synchronize() if not MOCK else None
    ref_out, ref_lse = reference.attention(*ref_in, mask=mask, seqlens_q=sl(lq), seqlens_k=sl(lk))
    seen = ref_lse > float("-inf")
    notes, ok = [], True
    o, ro = out.double(), ref_out
    if dtype == "fp8_e4m3":
        vis = reference.visible(mask, b, sq, sk, seqlens_q=sl(lq), seqlens_k=sl(lk), device=DEV).unsqueeze(1)
        e8 = gpu_fp8.emulate(q, k, v, kw["q_descale"], kw["k_descale"], kw["v_descale"], vis, torch.float8_e4m3fn)
        rmse, emu = gpu_fp8._rmse(out, ro), gpu_fp8._rmse(e8, ro)
        lse_err = (lse.double() - ref_lse).where(seen, 0.0).abs().max().item()
        # elementwise too (fagen's fp8 TOLERANCE, from the reference or else from the e4m3 emulation, whose P rounds
        # as the kernel's: a row of few keys errs by a P rounding): one wrong row cannot hide in the RMSE
        tol = TOLERANCE[DType.FP8_E4M3]
        e8d = e8.double()
        elem = not bool((((o - ro).abs() > tol["atol"] + tol["rtol"] * ro.abs())
                         & ((o - e8d).abs() > tol["atol"] + tol["rtol"] * e8d.abs())).any())
        good = rmse <= gpu_fp8.EMU_SLACK * emu + 1e-4 and lse_err <= gpu_fp8.LSE_BOUND and elem
        notes.append(f"rmse {rmse:.2e} (emu {emu:.2e}) max|err| {(o - ro).abs().max().item():.1e} lse {lse_err:.1e}")
    else:
        tol = TOLERANCE[DType(dtype)]
        err = (o - ro).abs() - tol["atol"] - tol["rtol"] * ro.abs()
        lerr = ((lse.double() - ref_lse).abs() - LSE_TOLERANCE["atol"] - LSE_TOLERANCE["rtol"] * ref_lse.abs())
        lerr = lerr.where(seen, -1.0)
        good = err.max().item() <= 0 and lerr.max().item() <= 0
        notes.append(f"max|err| {(o - ro).abs().max().item():.1e} lse {(lse.double() - ref_lse).where(seen, 0.0).abs().max().item():.1e}")
    ok &= good
    if not good:  # where: the worst element's (batch, head, row) and its sequence's lengths
        w = (o - ro).abs().nan_to_num(1e9).flatten().argmax().item()
        bi, hi, ri = w // (o.shape[1] * sq * d), w // (sq * d) % o.shape[1], w // d % sq
        notes.append(f"worst at b{bi} h{hi} row {ri} (lq {lq[bi]} lk {lk[bi]}): {o.flatten()[w].item():.3g} vs "
                     f"{ro.flatten()[w].item():.3g}")
    pad_rows = torch.zeros(b, sq, dtype=torch.bool, device=DEV)
    for i, n in enumerate(lq):
        pad_rows[i, max(n, 0):] = True
    pad_rows = pad_rows[:, None, :].expand(b, hkv * gqa, sq)
    empty = bool((out[pad_rows] == 0).all() and (lse[pad_rows] == float("-inf")).all()
                 and (out.double()[~seen] == 0).all() and (lse[~seen] == float("-inf")).all())
    ok &= empty and not bool(out.isnan().any())
    notes.append(f"padded rows 0/-inf {empty} ({int(pad_rows.sum())}), unseen {int((~seen).sum())}")
    # NaN in every padding position: out and lse bit for bit the clean call's
    out2, lse2 = m.forward(_poison(q, lq), _poison(k, lk), _poison(v, lk), seqlens_q=sl(lq), seqlens_k=sl(lk), **kw)
    same = bool(torch.isfinite(out2.float()).all()) and torch.equal(out2, out) and torch.equal(lse2, lse)
    ok &= same
    notes.append(f"NaN padding {'==' if same else '!='}")
    if not same:
        bad = (out2 != out).flatten(1).any(1).view(b, -1).any(1).tolist()
        notes.append(f"differs in batches {[i for i, x in enumerate(bad) if x]}, NaN {int(out2.isnan().sum())}")
    if name == "mix" and not var:  # lengths past the tensors: clamped, the same as in range
        bad_q = tuple(-7 if n == 0 else BIG if n == sq else n for n in lq)
        bad_k = tuple(BIG if n == max(lk) else n for n in lk)
        out3, lse3 = m.forward(q, k, v, seqlens_q=sl(bad_q), seqlens_k=sl(bad_k), check=False, **kw)
        out4, lse4 = m.forward(q, k, v, seqlens_q=sl(lq), seqlens_k=sl(tuple(sk if n == max(lk) else n for n in lk)),
                               **kw)
        clamp = torch.equal(out3, out4) and torch.equal(lse3, lse4)
        ok &= clamp
        notes.append(f"clamp {'==' if clamp else '!='}")
        # teeth: the reference without padding must not pass
        wrong, _ = reference.attention(*ref_in, mask="causal" if mask.startswith("causal") else "none")
        if dtype == "fp8_e4m3":
            teeth = gpu_fp8._rmse(out, wrong) > gpu_fp8.EMU_SLACK * emu + 1e-4
        else:
            teeth = bool(((o - wrong).abs() > tol["atol"] + tol["rtol"] * wrong.abs()).any())
        ok &= teeth
        notes.append(f"teeth {'ok' if teeth else 'NONE'}")
        if dtype == "bf16" and mask == "causal+padding" and not MOCK and not var:  # without its V zeroing
            mo, ml = mutant_module().forward(_poison(q, lq), _poison(k, lk), _poison(v, lk), seqlens_q=sl(lq),
                                             seqlens_k=sl(lk))
            caught = not (torch.equal(mo, out) and torch.equal(ml, lse))
            ok &= caught
            notes.append(f"no-zeroing mutant {'caught' if caught else 'NOT caught'} (NaN {bool(mo.isnan().any())})")
    return ok, "; ".join(notes)


def phase_check():
    import torch
    fails = 0
    jobs = [(c, None) for c in CASES] + [(CASES[i], v) for v, idx in VAR_CASES.items() for i in idx]
    for c, var in jobs:
        label = f"{c[2]:>8} {c[1]:>14} d{c[3]} g{c[4]} {c[0]} b{c[5]} sq{c[7]} sk{c[8]}{' ' + var if var else ''}"
        try:
            ok, note = check_case(c, var=var)
        except Exception as e:  # noqa: BLE001
            ok, note = False, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            traceback.print_exc(limit=4)
        fails += not ok
        log(f"CHECK {'PASS' if ok else 'FAIL'} {label}: {note}")
    log(f"CHECKS {'PASS' if not fails else 'FAIL'} {len(jobs) - fails}/{len(jobs)}")


def phase_memcheck():
    """Small padded calls, in range and out of it, under compute-sanitizer (the parent wraps this child): the bf16 and
    fp8 products, and in round B the bf16 "eo" candidate (its tile counter's atomics too)."""
    import torch
    runs = [(CASES[0], None), (CASES[8], None)] + ([(CASES[0], "eo")] if ROUND == "B" else [])
    for c, var in runs:
        (q, k, v), kw, _ = _inputs(c, 3)
        m = load(c[1], c[2], c[3], c[4], var)
        for lq, lk in ((c[9], c[10]), ((-7, BIG, 3, BIG), (BIG, -1, 300, 77))):
            sl = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731
            m.forward(_poison(q, lq), _poison(k, lk), _poison(v, lk), seqlens_q=sl(lq), seqlens_k=sl(lk), check=False,
                      **kw)
        torch.cuda.synchronize()
        log(f"memcheck ran {c[2]} {c[1]}{' ' + var if var else ''}")


# -- time ----------------------------------------------------------------------------------------------------
def row_fn(which, backend, var=None):
    """(CaseContext, fn(i)) of the suite's row (or its padding twin, or its fp8 twin) through the suite's row
    function, with the backend pinned; var: the module of the VARIANT render."""
    import torch
    from fagen.bench import impls
    from fagen.bench.cases import CaseContext
    from fagen.bench.workloads import standard_suite
    case = {c.name: c for c in standard_suite()}[ROW]
    if which == "pad":
        case = dataclasses.replace(case, name="fwd-pad-d128-s8k", mask="padding")
    if which == "fp8":
        case = dataclasses.replace(case, name="fwd-fp8-causalpad-d128-s8k", dtype="fp8_e4m3", peers=False)
    case = dataclasses.replace(case, overrides=(("backend", backend),))
    cc = CaseContext(case, torch.device("cuda"), 3)
    if var:
        with variant(var):
            fn = impls.prepare_fagen(case, cc).fn
    else:
        fn = impls.prepare_fagen(case, cc).fn
    return cc, lambda i: fn(cc.sets[i])


def phase_time():
    import torch
    from fagen.bench.timing import measure
    from fagen.bench.workloads import flops
    rows = []
    todo = [(w, b, None) for w in (ROW, "pad") for b in ("triton", "gluon")] + [("fp8", "gluon", None)]
    todo += [(w, "gluon", v) for v in TIMED for w in (ROW, "pad", "fp8")]
    for which, backend, var in todo:
        try:
            cc, fn = row_fn(which, backend, var)
        except Exception as e:  # noqa: BLE001
            log(f"TIME {which} {backend}{' ' + var if var else ''}: ERROR {type(e).__name__}: {str(e)[:160]}")
            continue
        spec = cc.case.spec(torch.device("cuda"))[0]
        rows.append((which, backend + (" " + var if var else ""), fn, len(cc.sets), flops(cc.case), spec.name))
    for r in rows:
        r[2](0)
    torch.cuda.synchronize()
    times = {}
    t_start = time.time()
    for p in range(PASSES):
        left = LIMIT["time"] - 1.5 - (time.time() - T0)
        if p and (time.time() - t_start) / p * 1.2 > left:
            log(f"pass {p}: stopped, the phase's time is short")
            break
        for which, backend, fn, n, _, _ in random.Random(7000 + p).sample(rows, len(rows)):
            times.setdefault((which, backend), []).append(measure(fn, n, torch.device("cuda"), *BENCH_MS))
    for which, backend, _, _, fl, name in rows:
        t = times[(which, backend)]
        notes = []
        bases = ["gluon", "triton"] if backend.startswith("gluon ") else ["triton"] if backend == "gluon" else []
        for base in bases:
            if (which, base) not in times:
                continue
            rr = sorted(a / g for a, g in zip(times[(which, base)], t))
            q = len(rr) // 4
            notes.append(f"per pass {base}/this: median {statistics.median(rr):.3f}, quartiles {rr[q]:.3f}-"
                         f"{rr[-1 - q]:.3f}, range {rr[0]:.3f}-{rr[-1]:.3f}, {sum(x > 1 for x in rr)}/{len(rr)} above 1")
        note = "; ".join(notes)
        log(f"TIME {which} {backend:>16} {fl / statistics.median(t) / 1e9:7.1f} TF/s {statistics.median(t):.4f} ms "
            f"({len(t)} passes; {name}) {note}")


# -- dry run -------------------------------------------------------------------------------------------------
def dry_run():
    sys.path.insert(0, str(ROOT / "tests"))
    from sm90 import ptxas
    import fagen
    failed = 0
    for mask in ("padding", "causal+padding"):
        for dtype in ("bf16", "fp16", "fp8_e4m3"):
            for d in (128, 64):
                t = time.time()
                try:
                    m = fagen.load(spec_of(mask, dtype, d, 1))
                    r = ptxas(m.compile_for().asm["ptx"])[0]["_attn_fwd_hopper"]
                    extra = ""
                    if dtype == "fp8_e4m3":
                        m.compile_transpose_for()
                        extra = ", transpose_v built"
                    spills = r.spill_stores + r.spill_loads
                    failed += bool(spills)
                    log(f"{mask:>14} {dtype:>8} d{d}: {r.registers} regs, spills {spills}{extra} ({time.time() - t:.0f}s)")
                except Exception as e:  # noqa: BLE001
                    failed += 1
                    log(f"{mask} {dtype} d{d}: BUILD ERROR {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    for var, mask, dtype, d, gqa in var_modules():
        try:  # the round's candidates (VARIANTS)
            r = ptxas(load(mask, dtype, d, gqa, var).compile_for().asm["ptx"])[0]["_attn_fwd_hopper"]
            failed += bool(r.spill_stores + r.spill_loads)
            log(f"{mask:>14} {dtype:>8} d{d} g{gqa} {VARIANTS[var]}: {r.registers} regs, spills "
                f"{r.spill_stores + r.spill_loads}")
        except Exception as e:  # noqa: BLE001
            failed += 1
            log(f"{mask} {dtype} d{d} {VARIANTS[var]}: BUILD ERROR {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    sys.exit(1 if failed else 0)


def main():
    if "--dry-run" in sys.argv:
        dry_run()
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        {"build": phase_build, "check": phase_check, "memcheck": phase_memcheck, "time": phase_time}[sys.argv[2]]()
        return
    OUT.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    env = child_env(str(WORK / "fagen-cache"), ROOT)
    env["TRITON_CACHE_DIR"] = env.get("TRITON_CACHE_DIR") or str(WORK / "triton-cache")
    env["GLUONPAD_ROUND"] = ROUND
    log(f"gluonpad s22 round {ROUND}; {time.strftime('%H:%M:%S')}")
    keep = []

    def show(line):
        keep.append(line)
        if line.startswith(("CHECK", "TIME", "built", "build ERROR", "memcheck", "=====", "pass", "Traceback")) \
                or "Error" in line:
            print(line, end="", flush=True)
    rc, _ = run_phase(__file__, "build", LIMIT["build"], env, show)
    log(f"build: rc {rc} at {time.time() - T0:.0f}s")
    results = {}
    san = shutil.which("compute-sanitizer")

    def memcheck():
        if not san:
            results["memcheck"] = "compute-sanitizer not found: not run"
            return
        try:
            p = subprocess.run([san, "--tool", "memcheck", "--error-exitcode", "1", sys.executable, __file__, "--phase",
                                "memcheck"], env=env, capture_output=True, text=True, timeout=LIMIT["memcheck"])
            errs = [ln for ln in p.stdout.splitlines() if "ERROR SUMMARY" in ln]
            ran = [ln for ln in p.stdout.splitlines() if ln.startswith("memcheck ran")]
            results["memcheck"] = (f"rc {p.returncode}; {errs[-1] if errs else 'no summary'}; {len(ran)}/"
                                   f"{3 if ROUND == 'B' else 2} ran: " + ", ".join(x[13:] for x in ran))
            (OUT / "memcheck.txt").write_text(p.stdout + p.stderr)
        except subprocess.TimeoutExpired:
            results["memcheck"] = f"killed at {LIMIT['memcheck']}s (did not fit)"
    th = threading.Thread(target=memcheck)
    th.start()
    rc, lines = run_phase(__file__, "check", LIMIT["check"], env, show)
    th.join()
    checks_ok = rc == 0 and any(ln.startswith("CHECKS PASS") for ln in lines)
    log(f"check: rc {rc}, {'all passed' if checks_ok else 'NOT all passed'} at {time.time() - T0:.0f}s")
    log(f"memcheck: {results.get('memcheck')}")
    left = 48 - (time.time() - T0)
    LIMIT["time"] = max(3, left)
    env["GLUONPAD_TIME_LIMIT"] = str(LIMIT["time"])
    rc, _ = run_phase(__file__, "time", LIMIT["time"], env, show)
    log(f"time: rc {rc}; total {time.time() - T0:.0f}s")
    (OUT / "gluonpad.log").write_text("".join(keep))
    mem = results.get("memcheck", "")
    sys.exit(0 if checks_ok and (mem.startswith("rc 0") or not mem.startswith("rc ")) else 1)


if __name__ == "__main__":
    if "GLUONPAD_TIME_LIMIT" in os.environ:
        LIMIT["time"] = float(os.environ["GLUONPAD_TIME_LIMIT"])
    main()
