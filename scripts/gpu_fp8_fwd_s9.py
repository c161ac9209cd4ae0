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
# Round A (H100, results/fp8fwd-A.txt) timed 3 WGs at block_n 128 (767 / 783 TF/s: spills), with p_cvt 1 (654 /
# 682) and two diagnostics of 3 WGs at block_n 64 (no exp2 886 / 861, no O rescale 899 / 887); round B confirms
# the product against 3 WGs at block_n 64, times the product's O rescale, tries skipping it exactly (_O_SKIP) with
# 2 and 3 WGs, and 3 WGs at d64 (block_n 128: no spills there).
_O_SKIP = (r"^    o_acc = o_acc \* gl\.convert_layout\(alpha, gl\.SliceLayout\(1, o_layout\)\)\[:, None\]\n",
           "    if gl.min(alpha, 0) < 1.0:  # a row's max moved: rescale O (skipped, O * 1 is O)\n"
           "        o_acc = o_acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]\n")
s7.VARIANTS = {
    "product": None,
    "3 WGs, block_n 64": {"variant": {"fp8_wgs": 3}, "fields": {"block_n": 64}},
    "3 WGs, block_n 128": {"variant": {"fp8_wgs": 3}},
    # exact: O rescaled only when some row's max moved in the step (gl.min over the warpgroup's 64 alphas < 1; a
    # cross-warp reduction, +3 BAR a step in SASS); ptxas: no spill (the product: 28 full, 156 causal)
    "O rescale skipped when no max moved": {"patch": (_O_SKIP, )},
    "3 WGs, block_n 64, O rescale skipped": {"variant": {"fp8_wgs": 3}, "fields": {"block_n": 64}, "patch": (_O_SKIP, )},
    # the O rescale's share of the product's step (64 FMUL a step and thread; wrong numerics: timed, not checked)
    "diag: product, no O rescale": {
        "diag": True,
        "patch": ((r"^    o_acc = o_acc \* gl\.convert_layout\(alpha, gl\.SliceLayout\(1, o_layout\)\)\[:, None\]\n", ""), )},
}
s7.D64_VARIANTS = ("product", "3 WGs, block_n 128")
FULL_CHECKS = ("product", "3 WGs, block_n 64", "O rescale skipped when no max moved")  # also the GQA and window rows
s7.PHASE_TIMEOUT = {"build": 30, "check": 17, "time": 16, "host": 5}


def check_cases():
    """(variant, head_dim, check row, window) of every check: CHECKS for every variant, d64 for D64_VARIANTS, the
    GQA / window rows for FULL_CHECKS."""
    cases = [(name, 128, c, None) for name in s7.VARIANTS if not (s7.VARIANTS[name] or {}).get("diag")
             for c in s7.CHECKS]
    cases += [(name, 64, c, None) for name in s7.D64_VARIANTS for c in s7.CHECKS[:2]]
    return cases + [(name, 128, c[:-1], c[-1]) for name in FULL_CHECKS for c in s7.PRODUCT_CHECKS]


s7.check_cases = check_cases


def _check_blocked_as_the_module(check):
    """gpu_fp8.check with its e4m3 emulation blocked as the module's key loop (BLOCK_N): round A's fingerprint of
    3 WGs at block_n 64 against a 128-key emulation read 0.513 on the window row (rmse 2.49e-3, the emulation's
    2.52e-3), the blocking of the online softmax, not P's precision."""
    import gpu_fp8

    def blocked(*args, forward=None, **kw):
        block_n = getattr(forward, "__globals__", {}).get("BLOCK_N", 128)
        saved = gpu_fp8.emulate.__defaults__
        gpu_fp8.emulate.__defaults__ = (block_n, ) + saved[1:]
        try:
            return check(*args, forward=forward, **kw)
        finally:
            gpu_fp8.emulate.__defaults__ = saved
    gpu_fp8.check = blocked


def phase_host():
    """Per-call time of a tiny forward (B1 H1 S128 d128: the GPU's part is a few us), fp8 and bf16: the host path."""
    import torch
    import triton
    import fagen
    import gpu_fp8
    if s7.MOCK:
        return
    x = [torch.randn((1, 1, 128, 128), device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    (q8, dq), (k8, dk), (v8, dv) = (gpu_fp8.quantize(t.float(), False) for t in x)
    for name, fn in (("host: fp8 product tiny call", lambda m: m.forward(q8, k8, v8, q_descale=dq, k_descale=dk,
                                                                           v_descale=dv)),
                     ("host: bf16 tiny call", lambda m: m.forward(*x))):
        for mask in s7.MASKS:
            m = fagen.load(s7.spec_of(mask, "bf16" if "bf16" in name else "fp8_e4m3"))
            fn(m)
            torch.cuda.synchronize()
            us = triton.testing.do_bench(lambda: fn(m), warmup=25, rep=100, return_mode="median") * 1e3
            s7.emit(section="time", variant=name, mask=mask, value=round(us, 1), note="us")


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        _check_blocked_as_the_module(__import__("gpu_fp8").check)
        {"build": s7.phase_build, "check": s7.phase_check, "time": s7.phase_time, "host": phase_host}[sys.argv[2]]()
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
