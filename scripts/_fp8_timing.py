"""The fp8 forward GPU scripts' shared harness (fourteenth session; scripts/_bwd_timing.py is the backward's): the
check phase (every variant against float64 on the dequantized inputs, the exact ones bit for bit against the
product, mutants that must fail), cuDNN's fp8 peer and its check, the standard timing rows, warm calls, timing in
rotated passes, the TF/s rows with their ratios, and the driver that runs the phases as child processes.

`s7` is scripts/gpu_fp8_fwd_s7.py: a script sets s7.VARIANTS, s7.check_cases and s7.jobs, and these read its
module(), emit(), log(), table(), MASKS, TIME_SHAPE, MOCK, DRY, DEV and T0. Rotation: pass p times the rows starting
at row p * len(rows) // passes, so each row runs first, middle and last in some pass (the eleventh session saw
8-11% on whichever fp8 row ran first); a row's number is the median of its passes' (statistics.median).
Built from scripts/gpu_fp8fwd_s13.py and scripts/gpu_fp8mma_s13.py, which it serves; the older fp8 scripts keep
their own copies as records.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from _phases import child_env, run_phase as run_child


def _error(e: Exception, width: int = 160) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:width]}"


def skipped() -> list[str]:
    """The variants the driver found unfit to time (checks failed or unfinished): FP8FWD_SKIP, '|'-separated."""
    return os.environ.get("FP8FWD_SKIP", "").split("|")


def check_variants(s7, cases, equal, diag=()):
    """The check phase: every (variant, head_dim, s7.CHECKS-style row, window) of `cases` by scripts/gpu_fp8.py's
    check (RMSE within 1.5x the emulation's, lse, fingerprint, empty rows; each module called twice, seeds 0 and 1),
    the variants in `equal` bit for bit against the product's out and lse, mutants ("mutant" in the variant) expected
    to FAIL. `diag`: variants checked without lse's bound (PASS* where only lse misses it: a diagnostic's speed)."""
    import torch
    import gpu_fp8
    outs = {}
    for name, d, (mask, gqa, b, hkv, sq, sk, per_head), window in cases:
        label = (f"{mask} gqa{gqa} b{b} h{gqa * hkv}/{hkv} sq{sq} sk{sk}{' per-head' if per_head else ''}"
                 f"{f' window{window}' if window else ''}")
        shown = f"{name}{' d64' if d == 64 else ''}"
        mutant = (s7.VARIANTS[name] or {}).get("mutant")
        saved = gpu_fp8.emulate
        try:
            if (s7.VARIANTS[name] or {}).get("block_n"):  # the emulation blocked as the module's steps
                gpu_fp8.emulate = lambda *a, _e=saved, _n=s7.VARIANTS[name]["block_n"], **kw: _e(*a, block_n=_n, **kw)
            m = s7.module(mask, name, d, window is not None, gqa)
            got = []

            def fwd(*a, **kw):
                r = m.forward(*a, **kw)
                got.append(tuple(t.clone() for t in r))
                return r
            bound = gpu_fp8.LSE_BOUND
            if name in diag:  # every check but lse's bound (its error is printed)
                gpu_fp8.LSE_BOUND = float("inf")
            try:
                rows = [gpu_fp8.check(d, mask, gqa, b, hkv, sq, sk, False, per_head, window=window, seed=call,
                                      device=s7.DEV, forward=fwd) for call in range(2)]
            finally:
                gpu_fp8.LSE_BOUND = bound
            ok = all(r["pass"] for r in rows)
            r = max(rows, key=lambda r: r["rmse"] / r["emu_rmse"])
            note = (f"rmse {r['rmse']:.2e} (emu {r['emu_rmse']:.2e}) lse {r['lse_err']:.1e} "
                    f"finger {r['fingerprint']:.3f} empty {r['empty_rows']}")
            key = (d, label)
            if name == "product":
                outs[key] = got
            elif name in equal and key in outs:
                same = all(torch.equal(x, y) for a, b_ in zip(got, outs[key]) for x, y in zip(a, b_))
                ok = ok and same
                note += f"; {'==' if same else '!='} product bitwise"
            if mutant:
                s7.emit(section="check", variant=shown, case=label, value="RED (as it must)" if not ok else
                        "FAIL: the mutant passed", note=note)
            else:
                lse_ok = all(r_["lse_err"] <= bound for r_ in rows)
                s7.emit(section="check", variant=shown, case=label,
                        value=("PASS" if lse_ok else "PASS*") if ok else "FAIL", note=note)
        except Exception as e:  # noqa: BLE001
            s7.emit(section="check", variant=shown, case=label, value="FAIL", note=_error(e))
            traceback.print_exc(limit=3)
        finally:
            gpu_fp8.emulate = saved


def check_peer(s7, mask, prepared, cc):
    """The bench's check of cudnn-fp8 (fagen/bench/check.py: out against float64 row slices, atol = rtol = 0.1)."""
    from fagen.bench.check import check
    try:
        status, msg, worst = check("cudnn-fp8", prepared, cc)
        s7.emit(section="check", variant="cudnn-fp8", case=f"bench row {mask}",
                value="PASS" if status == "ok" else "FAIL",
                note=(f"max err {worst:.3g}" if worst is not None else msg[:200]))
    except Exception as e:  # noqa: BLE001
        s7.emit(section="check", variant="cudnn-fp8", case=f"bench row {mask}", value="FAIL", note=_error(e, 200))
    cc._refs = None


_CONTEXTS = {}


def peer(mask):
    """(Prepared, CaseContext) of the bench's fwd-fp8-d128-<mask>-s16k row for cudnn-fp8 (fagen/bench's peer)."""
    import torch
    from fagen.bench import peer_cudnn_fp8
    from fagen.bench.cases import CaseContext
    from fagen.bench.workloads import standard_suite
    if mask not in _CONTEXTS:
        row = f"fwd-fp8-d128-{'causal' if mask == 'causal' else 'full'}-s16k"
        case = next(c for c in standard_suite() if c.name == row)
        _CONTEXTS[mask] = CaseContext(case, torch.device("cuda"), 1)
    cc = _CONTEXTS[mask]
    return peer_cudnn_fp8.prepare_cudnn_fp8(cc.case, cc), cc


def flops_of(s7, mask):
    """4 B H S^2 D at s7.TIME_SHAPE, halved causal."""
    b, h, s, d = s7.TIME_SHAPE
    return 4 * b * h * s * s * d / (2 if mask == "causal" else 1)


def standard_rows(s7, *, bench_inputs, timed, alone, masks_of=None, extra=None):
    """The do_bench rows (label, mask, flops, fn()): per mask, cudnn-fp8 (checked) and the `bench_inputs` variants on
    the bench row's own inputs (q ~ 3 N(0, 1), per-KV-head k / v scales, as fagen/bench/impls.py's prepare_fagen
    calls the module); then on random inputs (one seeded set, per tensor) fagen bf16, the `timed` variants, and the
    `alone` ones without the V transpose (Vt made once; the product also with the pass beside it). Skipped variants
    (skipped()) and masks not in masks_of(name) are left out. extra(rows, mask, flops, q8, g): more rows of a mask,
    after its own (g: the seeded generator, past the random inputs)."""
    import torch
    import fagen
    import gpu_fp8
    b, h, s, d = s7.TIME_SHAPE
    skip = skipped()
    masks_of = masks_of or (lambda name: s7.MASKS)
    rows = []
    for mask in s7.MASKS:
        flops = flops_of(s7, mask)
        try:
            prepared, cc = peer(mask)
            check_peer(s7, mask, prepared, cc)
            st = cc.sets[0]
            rows.append(("cudnn-fp8", mask, flops, (lambda p=prepared, st=st: p.fn(st))))
            for name in bench_inputs:
                if name in skip or mask not in masks_of(name):  # failed or unfinished checks: never timed
                    continue
                m = s7.module(mask, name)
                sc = {n: t for n, t in st.scores.items() if n not in ("k_scale", "v_scale")}
                rows.append((f"bench inputs: fp8 {name}", mask, flops, lambda m=m, st=st, sc=sc: m.forward(
                    st.q, st.k, st.v, k_descale=st.scores["k_scale"], v_descale=st.scores["v_scale"], **st.kwargs,
                    **sc)))
        except Exception as e:  # noqa: BLE001
            s7.emit(section="time", variant="cudnn-fp8", mask=mask, value="ERROR", note=_error(e))
    g = torch.Generator(device="cuda").manual_seed(1)
    x = [torch.randn((b, h, s, d), generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    q8 = [gpu_fp8.quantize(t.float(), False) for t in x]
    for mask in s7.MASKS:
        flops = flops_of(s7, mask)
        bf = fagen.load(s7.spec_of(mask, "bf16")).forward
        rows.append(("fagen bf16", mask, flops, lambda bf=bf: bf(*x)))
        for name in timed:
            if name in skip or mask not in masks_of(name):
                continue
            m = s7.module(mask, name)
            rows.append((f"fp8 {name}", mask, flops, lambda m=m, t=q8: m.forward(
                t[0][0], t[1][0], t[2][0], q_descale=t[0][1], k_descale=t[1][1], v_descale=t[2][1])))
        for name in alone:  # its kernel without the V transpose (Vt made once)
            m = s7.module(mask, name)
            (a, da), (k, dk), (v, dv) = q8
            vt = m.transpose_v(v)

            def kernel(m=m, vt=vt, a=a, k=k, v=v, da=da, dk=dk, dv=dv):
                saved = m.transpose_v
                m.transpose_v = lambda _: vt  # _launch_forward reads the module's transpose_v
                try:
                    return m.forward(a, k, v, q_descale=da, k_descale=dk, v_descale=dv)
                finally:
                    m.transpose_v = saved
            rows.append((f"fp8 {name}, kernel alone", mask, flops, kernel))
            if name == "product":  # diagnostic: the pass runs (its Vt unused), the kernel reads the Vt made once

                def beside(m=m, v=v, kernel=kernel):
                    m.transpose_v(v)
                    return kernel()
                rows.append((f"fp8 {name}, pass + kernel on an old Vt", mask, flops, beside))
        if extra is not None:
            extra(rows, mask, flops, q8, g)
    return rows


def do_bench_ms(fn):
    """do_bench's median (5 ms warm-up, 30 ms of repeats): the do_bench rows' measure."""
    import triton
    return triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")


def time_rows(s7, rows, passes, limit, t_phase, measure=do_bench_ms, warm=lambda fn: fn(), margin=(1.2, 2.0)):
    """{(label, mask): [ms a pass] or an error string}: each row called once (warm), then `passes` passes with the
    order rotated; a pass is skipped when the passes so far, times margin[0], would overrun the phase's `limit`
    seconds (from t_phase) less margin[1]."""
    import torch
    times = {}
    for label, mask, _, fn in rows:
        try:
            warm(fn)
        except Exception as e:  # noqa: BLE001
            times[(label, mask)] = _error(e)
    torch.cuda.synchronize()
    t_passes = time.time()
    for p in range(passes):
        left = limit - (time.time() - t_phase)
        if p and (time.time() - t_passes) / p * margin[0] > left - margin[1]:
            s7.log(f"pass {p} skipped: the phase's time is short")
            break
        k = p * len(rows) // passes  # the order rotated: each row runs first, middle and last in some pass
        for label, mask, flops, fn in rows[k:] + rows[:k]:
            if isinstance(times.get((label, mask)), str):
                continue
            try:
                times.setdefault((label, mask), []).append(measure(fn))
            except Exception as e:  # noqa: BLE001
                times[(label, mask)] = _error(e)
        s7.log(f"pass {p} done ({time.time() - s7.T0:.0f}s)")
    return times


def emit_times(s7, rows, times, bf16="fagen bf16", noted=("fp8 ", ), digits=2,
               base: Callable[[str], str] | None = None):
    """One time row a (label, mask): TF/s of the median pass, ms, the passes' TF/s; labels starting with `noted` also
    their ratios to `bf16`'s and cudnn-fp8's rows (and to base(label)'s row where given), with `digits` decimals."""
    tf = {(label, mask): flops / statistics.median(times[(label, mask)]) / 1e9 for label, mask, flops, _ in rows
          if isinstance(times.get((label, mask)), list) and times[(label, mask)]}
    for label, mask, flops, _ in rows:
        t = times.get((label, mask))
        if isinstance(t, str) or not t:
            s7.emit(section="time", variant=label, mask=mask, value="ERROR", note=str(t)[:160])
            continue
        note = ""
        if label.startswith(noted):
            mine = tf[(label, mask)]
            refs = ((bf16, "bf16"), ("cudnn-fp8", "cudnn")) + (((base(label), "product"), ) if base else ())
            note = " ".join(f"{mine / tf[(ref, mask)]:.{digits}f}x {word}" for ref, word in refs
                            if tf.get((ref, mask)))
        s7.emit(section="time", variant=label, mask=mask, value=round(tf[(label, mask)], 1),
                ms=round(statistics.median(t), 4),
                note=(note + f" [passes {' '.join(f'{flops / x / 1e9:.0f}' for x in t)}]").strip())


def main(s7, script, phases: dict, timeouts: dict, cases, candidates, out_name, cache_dir, diag=(), unfinished_ok=()):
    """The driver: `script --phase NAME` runs phases[NAME]; otherwise each phase in a child process under
    timeouts[NAME] (x10 for DRY / MOCK; DRY: build only, MOCK: check only), its ROW lines collected; after the check
    phase the `candidates` whose checks failed or did not all run (a hang?; `unfinished_ok`: failed only) go into
    FP8FWD_SKIP, never timed (diag's PASS* counts as passed); last, s7.table of the rows, printed and written to
    $OUTX/<out_name> (or $OUT)."""
    import sys
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        phases[sys.argv[2]]()
        return
    env = child_env(cache_dir)
    rows = []
    names = ("build", ) if s7.DRY else ("check", ) if s7.MOCK else tuple(timeouts)
    for name in names:
        limit = timeouts[name] * (10 if s7.DRY or s7.MOCK else 1)
        s7.log(f"#### phase {name} (timeout {limit}s, {time.time() - s7.T0:.0f}s so far)")

        def on_line(line):
            print(line, end="", flush=True)
            if line.startswith("ROW "):
                rows.append(json.loads(line[4:]))
        rc, _ = run_child(script, name, limit, env, on_line)
        s7.log(f"#### phase {name}: rc={rc}")
        if name == "check":
            done = [r for r in rows if r.get("section") == "check"]
            want = {}
            for n, d, *_ in cases():  # d64 rows are named "<variant> d64"
                if d == 128:
                    want[n] = want.get(n, 0) + 1
            bad = [n for n in candidates if sum(r["variant"] == n for r in done) < want.get(n, 0)
                   and n not in unfinished_ok
                   or any(r["variant"] == n and r["value"] != "PASS" and not (n in diag and r["value"] == "PASS*")
                          for r in done)]
            env["FP8FWD_SKIP"] = "|".join(bad)
            if bad:
                s7.log(f"not timed (checks failed or unfinished): {bad}")
    text = s7.table(rows)
    s7.log(text)
    s7.log(f"total {time.time() - s7.T0:.0f}s")
    out = os.environ.get("OUTX") or os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / out_name).write_text(text + "\n")
