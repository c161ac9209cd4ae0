"""The fp8 (e4m3) Gluon forward's main loop, thirteenth session (issue 28), on an H100/H200: exponentials on the FMA
pipe (fp8_exp_poly, [Note] fp8 exp2 on the FMA pipe) and O's rescale skipped by the warp (fp8_o_warp_skip, [Note] fp8
O rescale by warp) against the product, each checked against float64 on the dequantized inputs (scripts/gpu_fp8.py's
check: RMSE, lse, the fingerprint that fails a P V in bf16, empty rows), the exact ones bit for bit against the
product, mutants that must fail; then TF/s at d128 B1 H16 s16k, causal and full: cuDNN's fp8 SDPA (the bench's
cudnn-fp8 peer), fagen's bf16 forward and the fp8 rows in one process, PASSES passes whose row order is rotated from
pass to pass, medians; the product and the candidates also on the standard suite's own fp8 inputs.

    PYTHONPATH=$PWD python3 scripts/gpu_fp8mma_s13.py          # < 70 s on an H100; one table; $OUTX/gpu_fp8mma_s13.md
    GPU_FP8_FWD_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_fp8mma_s13.py   # any machine: sm_90 builds of every variant

Phases (each a child process with a timeout; scripts/_phases.py): build (a pool; fills triton's cache), check, time.
The harness is scripts/gpu_fp8fwd_s12.py's. docs/hopper.md, "fp8 forward: the main loop (thirteenth session)".
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_fp8_fwd_s7 as s7  # noqa: E402
from _phases import child_env, run_phase as run_child  # noqa: E402

# Round A (H100, /work/wt/results/fp8mma-A.txt; the table in docs/hopper.md, "fp8 forward: the main loop (thirteenth
# session)"): TF/s causal / full, random inputs: product 784 / 777, exp2 1/8 on FMA 839 / 830, O skip by warp 833 / 864;
# bench inputs: product 857 / 868, O skip 839 / 841; the lazy max failed the fingerprint, the row sum by wgmma read NaN.
# Round B: every variant on the bench inputs (the target), three on random ones.
# name -> None (the product) or {"variant": GluonBackend.variant keys, "fields": spec fields, "patch": ((regex,
# replacement), ...) on the render, "mutant": True for a variant broken on purpose (its checks must FAIL; never timed)}
VARIANTS = {
    "product": None,
    "exp2 1/8 on FMA": {"variant": {"fp8_exp_poly": 8}},
    "exp2 1/16 on FMA": {"variant": {"fp8_exp_poly": 16}, "checks": 1},
    "exp2 1/4 on FMA": {"variant": {"fp8_exp_poly": 4}, "checks": 1},
    "O skip by warp": {"variant": {"fp8_o_warp_skip": 1}, "checks": 1},
    "exp2 1/8 + O skip": {"variant": {"fp8_exp_poly": 8, "fp8_o_warp_skip": 1}},
    # round A read NaN with rows 0..7 of the ones slot written; round B writes the whole slot
    "l by wgmma (diag if lse fails)": {"variant": {"fp8_l_mma": 1}},  # removed after round B (read NaN): now renders the product
}
s7.VARIANTS = VARIANTS
TIMED = ("product", "exp2 1/8 on FMA", "O skip by warp")  # on random inputs too
D64 = ()
D64_ONLY = ()
EQUAL = {n: "product" for n in ("O skip by warp", )}
FULL = ("product", "exp2 1/8 on FMA")  # s7.PRODUCT_CHECKS: GQA 4 / 2, per-head descales, the window
ALONE = ()  # also timed with Vt made once
# timed even where a check fails on lse alone (l from the rounded P: a diagnostic of the lever's speed; its lse
# error is the question of the check's rows)
DIAG_TIMED = ("l by wgmma (diag if lse fails)", )
# also timed on the standard suite's fp8 rows' own inputs (round B: every variant)
BENCH_INPUTS = ("product", "exp2 1/8 on FMA", "exp2 1/16 on FMA", "exp2 1/4 on FMA", "O skip by warp",
                "exp2 1/8 + O skip", "l by wgmma (diag if lse fails)")
PASSES = 9  # the phase skips the last when its time runs short
PHASE_TIMEOUT = {"build": 24, "check": 14, "time": 26}
s7.PHASE_TIMEOUT = PHASE_TIMEOUT


def check_cases():
    """(variant, head_dim, s7.CHECKS-style row, window) of every fp8 check; the product first at each shape."""
    cases = [(n, 128, c, None) for n in VARIANTS if not VARIANTS[n] or not (VARIANTS[n].get("mutant") or n in D64_ONLY)
             for c in s7.CHECKS[:(VARIANTS[n] or {}).get("checks", len(s7.CHECKS))]]
    cases += [(n, 128, s7.CHECKS[0], None) for n in VARIANTS if (VARIANTS[n] or {}).get("mutant")]
    cases += [(n, 64, c, None) for n in D64 for c in s7.CHECKS[:1]]
    return cases + [(n, 128, c[:-1], c[-1]) for n in FULL for c in s7.PRODUCT_CHECKS
                    if not (c[-1] and (VARIANTS[n] or {}).get("block_n"))]  # 192-key steps: no window


def jobs():
    out = [(mask, n, 128, False, 1) for n in VARIANTS for mask in s7.MASKS
           if (not (VARIANTS[n] or {}).get("mutant") or mask == s7.CHECKS[0][0]) and n not in D64_ONLY]
    out += [(mask, n, d, w is not None, gqa) for n, d, (mask, gqa, *_), w in check_cases() if gqa > 1 or w]
    out += [(mask, n, 64, False, 1) for n in D64 for mask in s7.MASKS]
    return list(dict.fromkeys(out))


s7.check_cases = check_cases
s7.jobs = jobs


def phase_check():
    """Every fp8 check (s7's rows: RMSE within 1.5x the emulation's, lse, fingerprint, empty rows; each module
    called twice, seeds 0 and 1), the EQUAL variants' out and lse against the product's bit for bit, the mutants
    expected to FAIL; then the bench's check of cudnn-fp8 on both rows."""
    import torch
    import gpu_fp8
    outs = {}
    for name, d, (mask, gqa, b, hkv, sq, sk, per_head), window in check_cases():
        label = (f"{mask} gqa{gqa} b{b} h{gqa * hkv}/{hkv} sq{sq} sk{sk}{' per-head' if per_head else ''}"
                 f"{f' window{window}' if window else ''}")
        shown = f"{name}{' d64' if d == 64 else ''}"
        mutant = (VARIANTS[name] or {}).get("mutant")
        saved = gpu_fp8.emulate
        try:
            if (VARIANTS[name] or {}).get("block_n"):  # the emulation blocked as the module's steps
                gpu_fp8.emulate = lambda *a, _e=saved, _n=VARIANTS[name]["block_n"], **kw: _e(*a, block_n=_n, **kw)
            m = s7.module(mask, name, d, window is not None, gqa)
            got = []

            def fwd(*a, **kw):
                r = m.forward(*a, **kw)
                got.append(tuple(t.clone() for t in r))
                return r
            bound = gpu_fp8.LSE_BOUND
            if name in DIAG_TIMED:  # every check but lse's bound (its error is printed): PASS* ([Note] fp8 row sum
                gpu_fp8.LSE_BOUND = float("inf")  # by wgmma: l from the rounded P)
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
            elif name in EQUAL and key in outs:
                same = all(torch.equal(x, y) for a, b_ in zip(got, outs[key]) for x, y in zip(a, b_))
                ok = ok and same
                note += f"; {'==' if same else '!='} product bitwise"
            if mutant:
                s7.emit(section="check", variant=shown, case=label, value="RED (as it must)" if not ok else
                        "FAIL: the mutant passed", note=note)
            else:
                lse_ok = all(r_["lse_err"] <= bound for r_ in rows)
                s7.emit(section="check", variant=shown, case=label, note=note,
                        value=("PASS" if lse_ok else "PASS*") if ok else "FAIL")
        except Exception as e:  # noqa: BLE001
            s7.emit(section="check", variant=shown, case=label, value="FAIL",
                    note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
            traceback.print_exc(limit=3)
        finally:
            gpu_fp8.emulate = saved


def check_peer(mask, prepared, cc):
    """The bench's check of cudnn-fp8 (fagen/bench/check.py: out against float64 row slices, atol = rtol = 0.1)."""
    from fagen.bench.check import check
    try:
        status, msg, worst = check("cudnn-fp8", prepared, cc)
        s7.emit(section="check", variant="cudnn-fp8", case=f"bench row {mask}",
                value="PASS" if status == "ok" else "FAIL",
                note=(f"max err {worst:.3g}" if worst is not None else msg[:200]))
    except Exception as e:  # noqa: BLE001
        s7.emit(section="check", variant="cudnn-fp8", case=f"bench row {mask}", value="FAIL",
                note=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    cc._refs = None


def _peer(mask):
    """(Prepared, CaseContext) of the bench's fwd-fp8-d128-<mask>-s16k row for cudnn-fp8 (fagen/bench's peer)."""
    import torch
    from fagen.bench import peer_cudnn_fp8 as peer
    from fagen.bench.cases import CaseContext
    from fagen.bench.workloads import standard_suite
    if mask not in _peer.contexts:
        row = f"fwd-fp8-d128-{'causal' if mask == 'causal' else 'full'}-s16k"
        case = next(c for c in standard_suite() if c.name == row)
        _peer.contexts[mask] = CaseContext(case, torch.device("cuda"), 1)
    cc = _peer.contexts[mask]
    return peer.prepare_cudnn_fp8(cc.case, cc), cc


_peer.contexts = {}


T_PHASE = time.time()


def phase_time():
    """TF/s (4 B H S^2 D, halved causal; do_bench medians over PASSES interleaved passes, each row's own median of
    its repeats): cudnn-fp8 and fagen bf16 first, then the fp8 rows, the V transpose counted."""
    import torch
    import triton
    import fagen
    import gpu_fp8
    b, h, s, d = s7.TIME_SHAPE
    s7.log(f"== time: B{b} H{h} S{s}; {torch.cuda.get_device_name()}; torch {torch.__version__}, "
           f"triton {triton.__version__}")
    rows = []  # (label, mask, flops, fn, keep-alive)
    for mask in s7.MASKS:
        flops = 4 * b * h * s * s * d / (2 if mask == "causal" else 1)
        try:
            prepared, cc = _peer(mask)
            check_peer(mask, prepared, cc)
            st = cc.sets[0]
            rows.append(("cudnn-fp8", mask, flops, (lambda p=prepared, st=st: p.fn(st))))
            for name in BENCH_INPUTS:  # the bench row's own inputs (q ~ 3 N(0, 1), per-KV-head k / v scales), as
                if name in os.environ.get("FP8FWD_SKIP", "").split("|"):  # failed or unfinished checks
                    continue
                m = s7.module(mask, name)  # fagen/bench/impls.py's prepare_fagen calls the module
                sc = {n: t for n, t in st.scores.items() if n not in ("k_scale", "v_scale")}
                rows.append((f"bench inputs: fp8 {name}", mask, flops, lambda m=m, st=st, sc=sc: m.forward(
                    st.q, st.k, st.v, k_descale=st.scores["k_scale"], v_descale=st.scores["v_scale"], **st.kwargs,
                    **sc)))
        except Exception as e:  # noqa: BLE001
            s7.emit(section="time", variant="cudnn-fp8", mask=mask, value="ERROR",
                    note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    g = torch.Generator(device="cuda").manual_seed(1)
    x = [torch.randn((b, h, s, d), generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    q8 = [gpu_fp8.quantize(t.float(), False) for t in x]
    for mask in s7.MASKS:
        flops = 4 * b * h * s * s * d / (2 if mask == "causal" else 1)
        bf = fagen.load(s7.spec_of(mask, "bf16")).forward
        rows.append(("fagen bf16", mask, flops, lambda bf=bf: bf(*x)))
        for name in TIMED:
            if name in os.environ.get("FP8FWD_SKIP", "").split("|"):  # failed or unfinished checks: never timed
                continue
            m = s7.module(mask, name)
            rows.append((f"fp8 {name}", mask, flops, lambda m=m, t=q8: m.forward(
                t[0][0], t[1][0], t[2][0], q_descale=t[0][1], k_descale=t[1][1], v_descale=t[2][1])))
        for name in ALONE:  # its kernel without the V transpose (Vt made once)
            m = s7.module(mask, name)
            (a, da), (k, dk), (v, dv) = q8
            vt = m.transpose_v(v)

            def alone(m=m, vt=vt, a=a, k=k, v=v, da=da, dk=dk, dv=dv):
                saved = m.transpose_v
                m.transpose_v = lambda _: vt  # _launch_forward reads the module's transpose_v
                try:
                    return m.forward(a, k, v, q_descale=da, k_descale=dk, v_descale=dv)
                finally:
                    m.transpose_v = saved
            rows.append((f"fp8 {name}, kernel alone", mask, flops, alone))
            if name == "product":  # diagnostic: the pass runs (its Vt unused), the kernel reads the Vt made once

                def beside(m=m, vt=vt, a=a, k=k, v=v, da=da, dk=dk, dv=dv, alone=alone):
                    m.transpose_v(v)
                    return alone()
                rows.append((f"fp8 {name}, pass + kernel on an old Vt", mask, flops, beside))
    times = {}
    for label, mask, _, fn in rows:
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            times[(label, mask)] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    torch.cuda.synchronize()
    t_passes = time.time()
    for p in range(PASSES):
        left = PHASE_TIMEOUT["time"] - (time.time() - T_PHASE)
        if p and (time.time() - t_passes) / p * 1.2 > left - 2:
            s7.log(f"pass {p} skipped: the phase's time is short")
            break
        k = p * len(rows) // PASSES  # the order rotated: each row runs first, middle and last in some pass
        for label, mask, flops, fn in rows[k:] + rows[:k]:
            if isinstance(times.get((label, mask)), str):
                continue
            try:
                ms = triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")
                times.setdefault((label, mask), []).append(ms)
            except Exception as e:  # noqa: BLE001
                times[(label, mask)] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        s7.log(f"pass {p} done ({time.time() - s7.T0:.0f}s)")
    tf = {}
    for label, mask, flops, _ in rows:
        t = times.get((label, mask))
        if isinstance(t, str) or not t:
            s7.emit(section="time", variant=label, mask=mask, value="ERROR", note=str(t)[:160])
            continue
        ms = statistics.median(t)
        tf[(label, mask)] = flops / ms / 1e9
        note = ""
        if label.startswith("fp8 "):
            bfv, cu = tf.get(("fagen bf16", mask)), tf.get(("cudnn-fp8", mask))
            note = " ".join(x for x in (f"{tf[(label, mask)] / bfv:.2f}x bf16" if bfv else "",
                                        f"{tf[(label, mask)] / cu:.2f}x cudnn" if cu else "") if x)
        s7.emit(section="time", variant=label, mask=mask, value=round(tf[(label, mask)], 1), ms=round(ms, 4),
                note=(note + f" [passes {' '.join(f'{flops / x / 1e9:.0f}' for x in t)}]").strip())


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        {"build": s7.phase_build, "check": phase_check, "time": phase_time}[sys.argv[2]]()
        return
    env = child_env("/tmp/fagen-cache-gpu-fp8mma-s13")
    rows = []
    phases = ("build", ) if s7.DRY else ("check", ) if s7.MOCK else tuple(PHASE_TIMEOUT)
    for name in phases:
        limit = PHASE_TIMEOUT[name] * (10 if s7.DRY or s7.MOCK else 1)
        s7.log(f"#### phase {name} (timeout {limit}s, {time.time() - s7.T0:.0f}s so far)")

        def on_line(line):
            print(line, end="", flush=True)
            if line.startswith("ROW "):
                rows.append(s7.json.loads(line[4:]))
        rc, _ = run_child(__file__, name, limit, env, on_line)
        s7.log(f"#### phase {name}: rc={rc}")
        if name == "check":  # a variant whose checks failed or did not all run (a hang?) is not timed
            done = [r for r in rows if r.get("section") == "check"]
            want = {}
            for n, d, *_ in check_cases():  # d64 rows are named "<variant> d64" (round B missed this: the
                if d == 128:  # product went untimed)
                    want[n] = want.get(n, 0) + 1
            bad = [n for n in dict.fromkeys(TIMED + BENCH_INPUTS)
                   if sum(r["variant"] == n for r in done) < want.get(n, 0)
                   or any(r["variant"] == n and r["value"] != "PASS" and not (
                       n in DIAG_TIMED and r["value"] == "PASS*") for r in done)]
            env["FP8FWD_SKIP"] = "|".join(bad)
            if bad:
                s7.log(f"not timed (checks failed or unfinished): {bad}")
    text = s7.table(rows)
    s7.log(text)
    s7.log(f"total {time.time() - s7.T0:.0f}s")
    out = os.environ.get("OUTX") or os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu_fp8mma_s13.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
