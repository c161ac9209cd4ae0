"""H100: the sm_90 default tiles that spill a few words (tests/test_arch_defaults.py, MEASURED_SPILLS) against the
largest tile of the same case that spills nothing, timed by `fagen bench` (fagen only, checked first). The paged
and varlen allowances are not here (`fagen bench` times those layouts only in --suite layouts, at default tiles),
nor the cuda one (docs/cuda.md has its numbers).

    python scripts/gpu_arch_tiles.py          # about 2 minutes; logs and JSON to $OUT if set

Prints one row per case: TF/s of the default tile and of the spill-free tile. A spill-free tile within noise (or
faster) should replace the default in fagen/backends/triton.py or fagen/spec/tuned.json; otherwise the allowance
stays, with these numbers in the test's table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# (case flags, default tiles (spills on sm_90), spill-free tiles (ptxas/nvcc, sm_90, 2026-11-26))
CASES = [
    ("--head-dim 128 --mask causal --dtype bf16 --direction bwd --seq-q 16384 --batch 1", "128,128,8,3", "64,32,8,2"),
    ("--head-dim 128 --mask tree --dtype bf16 --seq-q 128 --seq-k 16512 --batch 8", "128,128,8,3", "64,32,8,2"),
]


def run(flags: str, tiles: str, out: Path) -> float | None:
    m, n, w, s = tiles.split(",")
    path = out / f"{abs(hash((flags, tiles)))}.json"
    cmd = [sys.executable, "-m", "fagen", "bench", *flags.split(), "--block-m", m, "--block-n", n, "--num-warps", w,
           "--num-stages", s, "--impl", "fagen", "--json", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    (out / (path.stem + ".log")).write_text(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
    try:
        records = json.loads(path.read_text())
        records = records["records"] if isinstance(records, dict) else records
        return max(r["tflops"] for r in records if r.get("tflops"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def main() -> None:
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="fagen-arch-tiles-"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for flags, default, free in CASES:
        rows.append((flags, default, run(flags, default, out), free, run(flags, free, out)))
    print(f"\n{'case':<100} {'default':>12} {'TF/s':>7} {'no spill':>12} {'TF/s':>7}")
    for flags, default, a, free, b in rows:
        fmt = lambda x: f"{x:7.1f}" if x else "    ERR"  # noqa: E731
        print(f"{flags:<100} {default:>12} {fmt(a)} {free:>12} {fmt(b)}")
    print(f"logs: {out}")


if __name__ == "__main__":
    main()
