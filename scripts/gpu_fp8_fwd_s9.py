"""The fp8 (e4m3) Gluon forward with three consumer warpgroups on an H100/H200 (issue 28, ninth session): each variant
checked against float64, then one table of TF/s at d128 B1 H16 s16k, causal and full, beside fagen's bf16 forward.

    PYTHONPATH=$PWD python3 scripts/gpu_fp8_fwd_s9.py          # < 70 s on an H100; one table; $OUT/gpu_fp8_fwd_s9.md
    GPU_FP8_FWD_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_fp8_fwd_s9.py   # any machine: sm_90 builds of every variant
    GPU_FP8_FWD_MOCK=1 PYTHONPATH=$PWD python3 scripts/gpu_fp8_fwd_s9.py  # the CPU: the script's own plumbing

The phases (build in a pool, check against float64 with scripts/gpu_fp8.py's check, time with do_bench, each in a
child process with a timeout) are scripts/gpu_fp8_fwd_s7.py's, run with this session's variants (VARIANTS below:
GluonBackend.variant keys and spec fields; docs/hopper.md, "fp8 forward, ninth session"). The check: RMSE within
1.5x the e4m3 emulation's, lse, the fingerprint (fails if P V ran in bf16), empty rows; causal Sq != Sk both ways,
mask none, lengths off the blocks; GQA 4 / 2 with per-head descales and the window for FULL_CHECKS' variants.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_fp8_fwd_s7 as s7  # noqa: E402
from _phases import child_env, run_phase as run_child  # noqa: E402

# name -> None (the product: fagen.load's module) or {"variant": GluonBackend.variant keys, "fields": spec fields,
# "patch": (regex, replacement) pairs on the render, "diag": True for a timing-only diagnostic}
s7.VARIANTS = {
    "product": None,
    "3 WGs, block_n 64": {"variant": {"fp8_wgs": 3}, "fields": {"block_n": 64}},
    "3 WGs, block_n 128": {"variant": {"fp8_wgs": 3}},
    "3 WGs, block_n 128, P e4m3 (p_cvt 1)": {"variant": {"fp8_wgs": 3, "fp8_p_cvt": 1}},
    # the exponentials' share of a 3-warpgroup step (P = the exp2's argument; wrong numerics: timed, not checked)
    "diag: 3 WGs, block_n 64, no exp2": {
        "variant": {"fp8_wgs": 3}, "fields": {"block_n": 64}, "diag": True,
        "patch": ((r"p = gl\.exp2\((s_acc \* qk_scale - \(m_use - 8\.0\)\[:, None\])\)", r"p = \1"), )},
    # the O rescale's share (64 FMUL a step and thread whatever block_n; wrong numerics: timed, not checked)
    "diag: 3 WGs, block_n 64, no O rescale": {
        "variant": {"fp8_wgs": 3}, "fields": {"block_n": 64}, "diag": True,
        "patch": ((r"^    o_acc = o_acc \* gl\.convert_layout\(alpha, gl\.SliceLayout\(1, o_layout\)\)\[:, None\]\n", ""), )},
}
s7.D64_VARIANTS = ("product", "3 WGs, block_n 64")
FULL_CHECKS = ("product", "3 WGs, block_n 64")  # also the GQA and window rows
s7.PHASE_TIMEOUT = {"build": 30, "check": 20, "time": 18}


def check_cases():
    """(variant, head_dim, check row, window) of every check: CHECKS for every variant, d64 for D64_VARIANTS, the
    GQA / window rows for FULL_CHECKS."""
    cases = [(name, 128, c, None) for name in s7.VARIANTS if not (s7.VARIANTS[name] or {}).get("diag")
             for c in s7.CHECKS]
    cases += [(name, 64, c, None) for name in s7.D64_VARIANTS for c in s7.CHECKS[:2]]
    return cases + [(name, 128, c[:-1], c[-1]) for name in FULL_CHECKS for c in s7.PRODUCT_CHECKS]


s7.check_cases = check_cases


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        {"build": s7.phase_build, "check": s7.phase_check, "time": s7.phase_time}[sys.argv[2]]()
        return
    env = child_env("/tmp/fagen-cache-gpu-fp8-fwd-s9")
    rows = []
    for name in (("build", ) if s7.DRY else ("check", "time") if s7.MOCK else s7.PHASE_TIMEOUT):
        limit = s7.PHASE_TIMEOUT[name] * (10 if s7.DRY or s7.MOCK else 1)
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
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "gpu_fp8_fwd_s9.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
