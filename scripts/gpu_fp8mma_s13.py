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
The harness is scripts/_fp8_timing.py's (fourteenth session; before, a copy of scripts/gpu_fp8fwd_s12.py's).
docs/hopper.md, "fp8 forward: the main loop (thirteenth session)".
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_fp8_fwd_s7 as s7  # noqa: E402
import _fp8_timing as T  # noqa: E402
from _removed import refuse_removed  # noqa: E402

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
    """Every fp8 check (_fp8_timing.check_variants); l by wgmma without lse's bound (PASS* where only lse misses)."""
    T.check_variants(s7, check_cases(), EQUAL, DIAG_TIMED)


T_PHASE = time.time()


def phase_time():
    """TF/s (4 B H S^2 D, halved causal; do_bench medians over PASSES rotated passes): cudnn-fp8 and the
    BENCH_INPUTS variants on the bench row's inputs, then fagen bf16 and the TIMED fp8 rows on random inputs, the V
    transpose counted (_fp8_timing.standard_rows, time_rows, emit_times)."""
    import torch
    import triton
    b, h, s, d = s7.TIME_SHAPE
    s7.log(f"== time: B{b} H{h} S{s}; {torch.cuda.get_device_name()}; torch {torch.__version__}, "
           f"triton {triton.__version__}")
    rows = T.standard_rows(s7, bench_inputs=BENCH_INPUTS, timed=TIMED, alone=ALONE)
    times = T.time_rows(s7, rows, PASSES, PHASE_TIMEOUT["time"], T_PHASE)
    T.emit_times(s7, rows, times)


def main():
    refuse_removed("gpu_fp8mma_s13.py", {k for v in VARIANTS.values() if v for k in v.get("variant", {})},
                   'docs/hopper.md, "fp8 forward: the main loop (thirteenth session)"')
    T.main(s7, __file__, {"build": s7.phase_build, "check": phase_check, "time": phase_time}, PHASE_TIMEOUT,
           check_cases, dict.fromkeys(TIMED + BENCH_INPUTS), "gpu_fp8mma_s13.md", "/tmp/fagen-cache-gpu-fp8mma-s13",
           diag=DIAG_TIMED)


if __name__ == "__main__":
    main()
