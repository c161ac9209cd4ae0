"""No input value makes a kernel touch memory outside its tensors ([Note] Memory safety in triton/masks.j2).

scripts/gpu_memcheck_fuzz.py builds the bad-value cases (lengths, cu_seqlens, page indices, tree parents, window
extents: past the tensors, negative, int32 extremes) for every layout x kind x direction and checks that the other
sequences' results stay bitwise those of a good call. Here it runs on the interpreter, each batch of cases in a
subprocess, so that a segfault or a corrupted heap (what these values did before the clamps: exit 139, "double free
or corruption") fails the test instead of killing pytest. On a GPU machine the subprocess runs the compiled kernels
(a bad access is a CUDA error there), and the same script runs under compute-sanitizer as well.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _env import DEVICE

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_memcheck_fuzz.py"


@pytest.mark.parametrize("groups", [("padding", "window"), ("varlen", "tree"), ("paged",),
                                    ("fp8_token", "paged_fp8", "dense_fp8", "mla192")], ids="+".join)
def test_bad_values_stay_inside_the_tensors(groups):
    cmd = [sys.executable, str(SCRIPT), "--device", DEVICE, *(a for g in groups for a in ("--group", g))]
    # The interpreter on the CPU; on a GPU the compiled kernels themselves (the interpreter over CUDA tensors tests
    # neither: it copies them to the host), where a bad access is a CUDA error in the subprocess.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if DEVICE == "cpu":
        env["TRITON_INTERPRET"] = "1"
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = run.stdout.splitlines()
    failed = [line for line in lines if line.startswith("FAIL")]
    summary = [line for line in lines if line.startswith("summary:")]
    assert run.returncode == 0 and not failed and summary, (
        f"exit {run.returncode} (-11: segfault, -6: abort on a corrupted heap)\n" + "\n".join(failed or lines[-5:])
        + "\n" + run.stderr[-2000:])
    assert " 0 failed" in summary[0]
