"""The fp8 (e4m3) Gluon forward's main loop, fourteenth session (issue 28), on an H100/H200: S a step ahead
(fp8_s_ahead, [Note] fp8 S a step ahead: S_{n+1} issued inside step n, so a step's exponentials wait for its P V
alone) and the thirteenth session's candidate (fp8_exp_poly 8 + fp8_o_warp_skip 1) against the product, each checked
against float64 on the dequantized inputs (scripts/gpu_fp8.py's check: RMSE, lse, the fingerprint that fails a P V
in bf16, empty rows), the exact ones bit for bit against the product; then TF/s at d128 B1 H16 s16k, causal and
full, in the standard suite's own measure (fagen.bench.timing.measure: the rows' 3 input sets rotated, do_bench's L2
flush): cuDNN's fp8 SDPA (the bench's cudnn-fp8 peer), fagen's bf16 and fp8 rows through the bench's preparers, and
the variants called as prepare_fagen calls the product, PASSES passes whose row order is rotated, medians.

    PYTHONPATH=$PWD python3 scripts/gpu_fp8mma_s14.py          # < 70 s on an H100; one table; $OUTX/gpu_fp8mma_s14.md
    GPU_FP8_FWD_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_fp8mma_s14.py   # any machine: sm_90 builds of every variant

Phases (each a child process with a timeout; scripts/_phases.py): build (a pool; fills triton's cache), check, time.
The harness is scripts/gpu_fp8mma_s13.py's (checks) and scripts/gpu_fp8fwd_s13.py's round B (timing). docs/hopper.md,
"fp8 forward: the main loop (fourteenth session)".
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_fp8_fwd_s7 as s7  # noqa: E402
import _fp8_timing as T  # noqa: E402
from _removed import refuse_removed  # noqa: E402

# name -> None (the product) or {"variant": GluonBackend.variant keys, "checks": how many of s7.CHECKS (default
# all), "extra": also the EXTRA rows}
CAND = {"fp8_exp_poly": 8, "fp8_o_warp_skip": 1}  # the thirteenth session's candidate (round B: +2.9% / +0.9%)
VARIANTS = {
    "product": None,
    "exp2 1/8 + O skip": {"variant": CAND},
    "S ahead 1": {"variant": {"fp8_s_ahead": 1}, "extra": True},
    # round A also timed "S ahead 2" (fp8_s_ahead 2: S_{n+1} issued before S_n's softmax; the template at 19c6fa7)
    "S ahead 1 + exp2 1/8 + O skip": {"variant": {"fp8_s_ahead": 1, **CAND}, "checks": 1},
    # round B diagnostics (wrong numerics: built and timed, never checked): what the softmax's parts cost a step
    "diag: P without exp2": {"diag": True, "patch": ((
        r"^    p = gl\.exp2\(s_acc \* qk_scale - \(m_use - 8\.0\)\[:, None\]\)$",
        "    p = s_acc * qk_scale - (m_use - 8.0)[:, None]"), )},
    "diag: unmasked steps without the row max": {"diag": True, "patch": ((
        r"^        m_new = gl\.maximum\(m_i, gl\.max\(s_acc, 1\) \* qk_scale\)$", "        m_new = m_i * 1.0"), )},
}
# Round A (H100, 23:26 UTC, /work/wt/results/fp8mma-A.txt; docs/hopper.md, "fp8 forward: the main loop (fourteenth
# session)"): TF/s causal / full, the rows' order rotated: product 888 / 881, the candidate 871 / 850, S ahead 1 866 /
# 849, S ahead 2 732 / 661, S ahead 1 + the candidate 893 / 838; the product through the bench's prepare_fagen (the
# same module and call) 821 / 807, the row that always came right after the bf16 row. Round B (ROUND "B", the
# default): S ahead 2 dropped; a second closure of the product; the row order shuffled anew in every pass (a seeded
# permutation), so that no row has the same neighbour in every pass.
ROUND = os.environ.get("FP8MMA_ROUND", "B")
s7.VARIANTS = VARIANTS
# short key ranges for the peeled last step (one block: no S ahead; two: S_1 then the peeled step), and the
# prologue alone; the product's rows first
EXTRA = (("none", 1, 1, 2, 300, 100, False), ("none", 1, 1, 2, 260, 200, True), ("causal", 1, 1, 2, 129, 300, False))
D64 = ()
D64_ONLY = ()
EQUAL = {n: "product" for n in ("S ahead 1", "S ahead 2")}
FULL = ("exp2 1/8 + O skip", ) + (("S ahead 1", ) if ROUND == "B" else ())  # s7.PRODUCT_CHECKS: GQA 4 / 2,
# per-head descales, the window (the product's: main's)
DIAG_TIMED = ()
TIMED = tuple(VARIANTS)
PASSES = 12 if ROUND == "A" else 16  # the phase stops early when its time runs short
BENCH_MS = (10, 50)  # the bench's measure's warm-up and rep ms (the bench's own: 25, 100)
PHASE_TIMEOUT = {"build": 22, "check": 15, "time": 27}
s7.PHASE_TIMEOUT = PHASE_TIMEOUT


def check_cases():
    """(variant, head_dim, s7.CHECKS-style row, window) of every fp8 check; the product first at each shape."""
    cases = [(n, 128, c, None) for n in VARIANTS
             if not VARIANTS[n] or not (VARIANTS[n].get("mutant") or VARIANTS[n].get("diag") or n in D64_ONLY)
             for c in s7.CHECKS[:(VARIANTS[n] or {}).get("checks", len(s7.CHECKS))]]
    cases += [(n, 128, c, None) for n in VARIANTS if not VARIANTS[n] or VARIANTS[n].get("extra") for c in EXTRA]
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
    expected to FAIL (scripts/_fp8_timing.py's check phase); the bench's check of cudnn-fp8 runs in the time phase."""
    T.check_variants(s7, check_cases(), EQUAL, DIAG_TIMED)


T_PHASE = time.time()


def phase_time():
    """TF/s in the standard suite's measure (fagen.bench.timing.measure over the rows' 3 input sets, rotated;
    do_bench's L2 flush), PASSES passes with the row order rotated, medians: cudnn-fp8 and fagen's product through
    the bench's own preparers, fagen bf16 on the bench's bf16 rows, the fp8 variants called as prepare_fagen does."""
    import torch
    import triton
    from fagen.bench import impls, peer_cudnn_fp8 as peer
    from fagen.bench.cases import CaseContext
    from fagen.bench.timing import measure
    from fagen.bench.workloads import standard_suite
    b, h, s, d = s7.TIME_SHAPE
    s7.log(f"== time (bench measure): B{b} H{h} S{s}; {torch.cuda.get_device_name()}; torch {torch.__version__}, "
           f"triton {triton.__version__}")
    dev = torch.device("cuda")
    suite = {c.name: c for c in standard_suite()}
    skip = os.environ.get("FP8FWD_SKIP", "").split("|")
    rows, keep = [], []  # (label, mask, flops, call(i), n_sets)

    def fp8_call(m):
        def call(st):
            sc = {n: t for n, t in st.scores.items() if n not in ("k_scale", "v_scale")}
            return m.forward(st.q, st.k, st.v, k_descale=st.scores["k_scale"], v_descale=st.scores["v_scale"],
                             **st.kwargs, **sc)[0]
        return call
    for mask in s7.MASKS:
        flops = 4 * b * h * s * s * d / (2 if mask == "causal" else 1)
        word = "causal" if mask == "causal" else "full"
        try:
            cc = CaseContext(suite[f"fwd-fp8-d128-{word}-s16k"], dev, 3)
            bcc = CaseContext(suite[f"fwd-d128-{word}-s16k"], dev, 3)
            keep += [cc, bcc]
        except Exception as e:  # noqa: BLE001
            s7.emit(section="time", variant="setup", mask=mask, value="ERROR",
                    note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
            continue

        def cudnn(cc=cc, mask=mask):
            prepared = peer.prepare_cudnn_fp8(cc.case, cc)
            T.check_peer(s7, mask, prepared, cc)
            return prepared.fn
        makers = [("cudnn-fp8", cudnn, cc),
                  ("fagen bf16 (bench row)", lambda bcc=bcc: impls.prepare_fagen(bcc.case, bcc).fn, bcc),
                  ("fp8 product (bench's prepare_fagen)", lambda cc=cc: impls.prepare_fagen(cc.case, cc).fn, cc)]
        makers += [(f"fp8 {n}", lambda n=n, mask=mask: fp8_call(s7.module(mask, n)), cc) for n in TIMED
                   if n not in skip]
        if ROUND == "B" and "product" not in skip:  # the same module and call again: the spread of a row
            makers.append(("fp8 product (2nd closure)", lambda mask=mask: fp8_call(s7.module(mask, "product")), cc))
        for label, make, c in makers:  # one failing row (a peer that declines) leaves the others
            try:
                fn = make()
                rows.append((label, mask, flops, lambda i, fn=fn, c=c: fn(c.sets[i]), len(c.sets)))
            except Exception as e:  # noqa: BLE001
                s7.emit(section="time", variant=label, mask=mask, value="ERROR",
                        note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
                traceback.print_exc(limit=3)
    times, after_bf16 = {}, {}  # after_bf16: per measurement, whether a bf16 row ran right before it
    with torch.no_grad():
        for label, mask, _, fn, n in rows:
            try:
                fn(0)
            except Exception as e:  # noqa: BLE001
                times[(label, mask)] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        torch.cuda.synchronize()
        t_passes = time.time()
        for p in range(PASSES):
            left = PHASE_TIMEOUT["time"] - (time.time() - T_PHASE)
            if p and (time.time() - t_passes) / p * 1.15 > left - 1.5:
                s7.log(f"pass {p} skipped: the phase's time is short")
                break
            k = p * len(rows) // PASSES  # the order rotated: each row runs first, middle and last in some pass
            order = rows[k:] + rows[:k]
            if ROUND == "B":  # a seeded permutation a pass: no fixed neighbours (round A: the row after bf16 read low)
                order = random.Random(p).sample(rows, len(rows))
            prev = None
            for label, mask, flops, fn, n in order:
                after = prev is not None and prev.startswith("fagen bf16")
                prev = label
                if isinstance(times.get((label, mask)), str):
                    continue
                try:
                    times.setdefault((label, mask), []).append(measure(fn, n, dev, *BENCH_MS))
                    after_bf16.setdefault((label, mask), []).append(after)
                except Exception as e:  # noqa: BLE001
                    times[(label, mask)] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            s7.log(f"pass {p} done ({time.time() - s7.T0:.0f}s)")
    tf = {(label, mask): flops / statistics.median(times[(label, mask)]) / 1e9 for label, mask, flops, _, _ in rows
          if isinstance(times.get((label, mask)), list) and times[(label, mask)]}
    for label, mask, flops, _, _ in rows:
        t = times.get((label, mask))
        if isinstance(t, str) or not t:
            s7.emit(section="time", variant=label, mask=mask, value="ERROR", note=str(t)[:160])
            continue
        note = ""
        if label.startswith("fp8 "):
            bfv, cu = tf.get(("fagen bf16 (bench row)", mask)), tf.get(("cudnn-fp8", mask))
            base = tf.get(("fp8 product", mask))
            # per pass: the row's time against the product's in the same pass (the pass's own noise cancels)
            pp = times.get(("fp8 product", mask))
            ratios = [y / x for x, y in zip(t, pp)] if isinstance(pp, list) and len(pp) == len(t) else []
            note = " ".join(x for x in (f"{tf[(label, mask)] / bfv:.3f}x bf16" if bfv else "",
                                        f"{tf[(label, mask)] / cu:.3f}x cudnn" if cu else "",
                                        f"{tf[(label, mask)] / base:.3f}x product" if base else "",
                                        f"(pass ratios: median {statistics.median(ratios):.3f}, "
                                        f"{sum(r > 1 for r in ratios)}/{len(ratios)} above)" if ratios else "") if x)
        ab = after_bf16.get((label, mask), [])
        if ROUND == "B" and len(ab) == len(t) and any(ab) and not all(ab):  # right after a bf16 row / otherwise
            note += (f" (after bf16: {flops / statistics.median([x for x, a in zip(t, ab) if a]) / 1e9:.0f} in "
                     f"{sum(ab)}, else {flops / statistics.median([x for x, a in zip(t, ab) if not a]) / 1e9:.0f})")
        s7.emit(section="time", variant=label, mask=mask, value=round(tf[(label, mask)], 1),
                ms=round(statistics.median(t), 4),
                note=(note + f" [passes {' '.join(f'{flops / x / 1e9:.0f}' for x in t)}]").strip())


def main():
    refuse_removed("gpu_fp8mma_s14.py", {k for v in VARIANTS.values() if v for k in v.get("variant", {})},
                   'docs/hopper.md, "fp8 forward: the main loop (fourteenth session)"')
    # main's product is timed unless a check of it failed (round B of the thirteenth session left it untimed when
    # its d64 rows were miscounted)
    T.main(s7, __file__, {"build": s7.phase_build, "check": phase_check, "time": phase_time}, PHASE_TIMEOUT,
           check_cases, TIMED, "gpu_fp8mma_s14.md", "/tmp/fagen-cache-gpu-fp8mma-s14", DIAG_TIMED,
           unfinished_ok=("product", ))


if __name__ == "__main__":
    main()
