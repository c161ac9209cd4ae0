"""The fp8 (e4m3) Gluon forward, eleventh session (issue 28), on an H100/H200: each variant checked against float64
on the dequantized inputs (the fingerprint fails a P V computed in bf16), the packed-P variants also bit for bit
against the product (the same rounding, the same matmuls), a mutant that must fail; then TF/s at d128 (and d64)
B1 H16 s16k, causal and full: fagen's bf16 forward, cuDNN's fp8 SDPA (the bench's cudnn-fp8 peer), the fp8
product and the variants, in one process, PASSES interleaved passes, medians.

    PYTHONPATH=$PWD python3 scripts/gpu_fp8fwd_s11.py          # < 80 s on an H100; one table; $OUTX/gpu_fp8fwd_s11.md
    GPU_FP8_FWD_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_fp8fwd_s11.py   # any machine: sm_90 builds of every variant

Phases (each a child process with a timeout; scripts/_phases.py): build (a pool; fills triton's cache), check
(scripts/gpu_fp8.py's check through scripts/gpu_fp8_fwd_s7.py's modules; the bench's own check of cudnn-fp8),
time. docs/hopper.md, "fp8 forward (eleventh session)".
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

# name -> None (the product) or {"variant": GluonBackend.variant keys, "fields": spec fields, "patch": ((regex,
# replacement), ...) on the render, "mutant": True for a variant broken on purpose (its checks must FAIL; never timed)}
# Round A (H100, /work/wt/results/fp8fwd-A.txt; TF/s causal / full, d128 s16k): product (P in fp32) 770 / 775,
# packed P 887 / 869 (now the product: fp8_p_cvt 3), packed P + softmax under the P V 784 / 780, 192-key steps 813 /
# 806, with the softmax under the P V 813 / 795; d64 557 / 577 -> packed 609 / 612; cudnn-fp8 848 / 908, bf16 635 /
# 566. Round B confirms the flip against main's product and measures the K/V ring's depth (the 192-key steps run 2
# stages) and the 192-key steps once more.
VARIANTS = {
    "product": None,
    "P in fp32 (main's product)": {"variant": {"fp8_p_cvt": 2}, "checks": 1},
    "product, 2 stages": {"fields": {"num_stages": 2}, "checks": 1},
    "product, 3 stages": {"fields": {"num_stages": 3}, "checks": 1},
    # [Note] fp8 192-key steps: S of 128 + 64 keys, P V of three 64-key boxes, P packed (fp8_n192; no window)
    "192-key steps": {"variant": {"fp8_n192": 1}, "block_n": 192, "checks": 1},  # round A: 5 / 5 checks passed
    # the same with S in three 64-key parts from 64-row K slots, so 3 stages fit (fp8_n192 2)
    "192-key steps, 3 stages": {"variant": {"fp8_n192": 2}, "block_n": 192, "checks": 2},
    # the packed carry with keys 4j and 4j + 1 swapped in each word: must fail the float64 check
    "mutant: packed P, bytes swapped": {"mutant": True, "patch": ((r"lo, \$2, \$1;", "lo, $1, $2;"), )},
}
s7.VARIANTS = VARIANTS
TIMED = ("product", "P in fp32 (main's product)", "product, 2 stages", "product, 3 stages", "192-key steps",
         "192-key steps, 3 stages")
D64 = ("product", "P in fp32 (main's product)")  # d64 fp8 (3 WGs at block_n 128: fp8_d64), ratios to the first
EQUAL = {n: "product" for n in ("P in fp32 (main's product)", "product, 2 stages", "product, 3 stages")}
FULL = ("product", "192-key steps, 3 stages")  # s7.PRODUCT_CHECKS: GQA 4 / 2, per-head descales, the window
ALONE = "product"  # also timed with Vt made once (the in-kernel transpose's ceiling)
PASSES = 3
PHASE_TIMEOUT = {"build": 26, "check": 17, "time": 29}
s7.PHASE_TIMEOUT = PHASE_TIMEOUT


def check_cases():
    """(variant, head_dim, s7.CHECKS-style row, window) of every fp8 check; the product first at each shape."""
    cases = [(n, 128, c, None) for n in VARIANTS if not VARIANTS[n] or not VARIANTS[n].get("mutant")
             for c in s7.CHECKS[:(VARIANTS[n] or {}).get("checks", len(s7.CHECKS))]]
    cases += [(n, 128, s7.CHECKS[0], None) for n in VARIANTS if (VARIANTS[n] or {}).get("mutant")]
    cases += [(n, 64, c, None) for n in D64 for c in s7.CHECKS[:1]]
    return cases + [(n, 128, c[:-1], c[-1]) for n in FULL for c in s7.PRODUCT_CHECKS
                    if not (c[-1] and (VARIANTS[n] or {}).get("block_n"))]  # 192-key steps: no window


def jobs():
    out = [(mask, n, 128, False, 1) for n in VARIANTS for mask in s7.MASKS
           if not (VARIANTS[n] or {}).get("mutant") or mask == s7.CHECKS[0][0]]
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
            rows = [gpu_fp8.check(d, mask, gqa, b, hkv, sq, sk, False, per_head, window=window, seed=call,
                                  device=s7.DEV, forward=fwd) for call in range(2)]
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
                s7.emit(section="check", variant=shown, case=label, value="PASS" if ok else "FAIL", note=note)
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
        except Exception as e:  # noqa: BLE001
            s7.emit(section="time", variant="cudnn-fp8", mask=mask, value="ERROR",
                    note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    g = torch.Generator(device="cuda").manual_seed(1)
    x = [torch.randn((b, h, s, d), generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    q8 = [gpu_fp8.quantize(t.float(), False) for t in x]
    x64 = [torch.randn((b, h, s, 64), generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    q64 = [gpu_fp8.quantize(t.float(), False) for t in x64]
    del x64
    for mask in s7.MASKS:
        flops = 4 * b * h * s * s * d / (2 if mask == "causal" else 1)
        bf = fagen.load(s7.spec_of(mask, "bf16")).forward
        rows.append(("fagen bf16", mask, flops, lambda bf=bf: bf(*x)))
        for name in TIMED:
            m = s7.module(mask, name)
            rows.append((f"fp8 {name}", mask, flops, lambda m=m, t=q8: m.forward(
                t[0][0], t[1][0], t[2][0], q_descale=t[0][1], k_descale=t[1][1], v_descale=t[2][1])))
        m = s7.module(mask, ALONE)  # its kernel without the V transpose (Vt made once): the in-kernel lever
        (a, da), (k, dk), (v, dv) = q8
        vt = m.transpose_v(v)

        def alone(m=m, vt=vt, a=a, k=k, v=v, da=da, dk=dk, dv=dv):
            saved = m.transpose_v
            m.transpose_v = lambda _: vt  # _launch_forward reads the module's transpose_v
            try:
                return m.forward(a, k, v, q_descale=da, k_descale=dk, v_descale=dv)
            finally:
                m.transpose_v = saved
        rows.append((f"fp8 {ALONE}, kernel alone", mask, flops, alone))
        for name in D64:
            m = s7.module(mask, name, 64)
            rows.append((f"d64 fp8 {name}", mask, flops / 2, lambda m=m, t=q64: m.forward(
                t[0][0], t[1][0], t[2][0], q_descale=t[0][1], k_descale=t[1][1], v_descale=t[2][1])))
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
        for label, mask, flops, fn in rows:
            if isinstance(times.get((label, mask)), str):
                continue
            try:
                ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
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
        elif label.startswith("d64 ") and label != f"d64 fp8 {D64[0]}" and (f"d64 fp8 {D64[0]}", mask) in tf:
            note = f"{tf[(label, mask)] / tf[(f'd64 fp8 {D64[0]}', mask)]:.2f}x d64 product"
        s7.emit(section="time", variant=label, mask=mask, value=round(tf[(label, mask)], 1), ms=round(ms, 4),
                note=(note + f" [passes {' '.join(f'{flops / x / 1e9:.0f}' for x in t)}]").strip())


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        {"build": s7.phase_build, "check": phase_check, "time": phase_time}[sys.argv[2]]()
        return
    env = child_env("/tmp/fagen-cache-gpu-fp8fwd-s11")
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
    text = s7.table(rows)
    s7.log(text)
    s7.log(f"total {time.time() - s7.T0:.0f}s")
    out = os.environ.get("OUTX") or os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu_fp8fwd_s11.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
