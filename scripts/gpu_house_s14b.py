"""Fourteenth session, house round B: first the document+causal forward's host path once more (scripts/
gpu_house_s14.py's phase: the entries rotated, after an untimed pass each); then scripts/_fp8_timing.py (the fp8
forward scripts' shared harness) on the GPU, through scripts/gpu_fp8mma_s13.py trimmed to the product (its build,
check and time phases: the float64 checks, cudnn-fp8's bench check, the rotated do_bench passes, the table), so
one short run shows the moved scripts still print their table.

    PYTHONPATH=$PWD python3 scripts/gpu_house_s14b.py          # < 70 s on an H100

The trim (module globals of gpu_fp8mma_s13, set again in each child: the phases run this file): VARIANTS the product
alone, on the bench inputs and random ones, its GQA / window checks; phase timeouts 18 / 10 / 12 s, 5 passes.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_fp8mma_s13 as M  # noqa: E402
import _fp8_timing as T  # noqa: E402
from _phases import child_env, run_phase as run_child  # noqa: E402

M.VARIANTS = {"product": None}
M.s7.VARIANTS = M.VARIANTS
M.TIMED, M.BENCH_INPUTS, M.FULL, M.EQUAL, M.DIAG_TIMED = ("product", ), ("product", ), ("product", ), {}, ()
M.PASSES = 5
M.PHASE_TIMEOUT = {"build": 18, "check": 10, "time": 12}
M.s7.PHASE_TIMEOUT = M.PHASE_TIMEOUT
DOC_LIMIT = 19


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase" and sys.argv[2] == "doc":
        import gpu_house_s14
        gpu_house_s14.host_phase(rounds=3)
        return
    if len(sys.argv) == 1:  # the document phase first: its lines are short and must come back
        M.s7.log(f"#### phase doc (timeout {DOC_LIMIT}s)")
        rc, _ = run_child(os.path.abspath(__file__), "doc", DOC_LIMIT,
                          child_env("/tmp/fagen-house-s14", Path(__file__).resolve().parent.parent))
        M.s7.log(f"#### phase doc: rc={rc} ({time.time() - M.s7.T0:.0f}s so far)")
    T.main(M.s7, __file__, {"build": M.s7.phase_build, "check": M.phase_check, "time": M.phase_time},
           M.PHASE_TIMEOUT, M.check_cases, ("product", ), "gpu_house_s14b_fp8.md", "/tmp/fagen-cache-gpu-house-s14b")


if __name__ == "__main__":
    main()
