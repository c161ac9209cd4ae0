"""The frame the GPU check scripts share (gpu_fp8kv, gpu_mla, gpu_invariant, gpu_gluon_mods, gpu_mods_layouts): a
clock since import, log lines that carry it, one timing call (triton's do_bench on a GPU; one untimed call on the
CPU interpreter of a dry run), the six-column rows of gpu_fp8kv and gpu_mla, and the PASS/FAIL checks of
gpu_gluon_mods and gpu_mods_layouts; a failure is a row or a FAIL line, never the end of the run."""
from __future__ import annotations

import sys
import time
import traceback

T0 = time.time()
ROWS: list[tuple] = []  # (section, case, impl, value, ms, note)


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def bench(fn, dry: bool, **do_bench_kw) -> float:
    """Milliseconds per call: do_bench's median on a GPU; one untimed call's wall time in a dry run."""
    if dry:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, **do_bench_kw)


def row(section, case, impl, value, unit, ms, note=""):
    ROWS.append((section, case, impl, "-" if value is None else f"{value:.1f} {unit}",
                 "" if ms is None else f"{ms:.4f}", note))
    log(" | ".join(ROWS[-1]))


def guarded(section, case, impl, fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a failure is a row, never the end of the run
        row(section, case, impl, None, "", None, f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:150]}")
        traceback.print_exc(file=sys.stderr)
        return None


CHECKS: list[tuple[str, bool, str]] = []  # (name, passed, note) of check()


def check(name: str, fn) -> None:
    """Run one comparison against the reference: a PASS line with fn's note, or a FAIL line with the error's first
    line (and its traceback on stderr), never the end of the run."""
    try:
        note = fn()
        CHECKS.append((name, True, note or ""))
        print(f"PASS {name} {note or ''}", flush=True)
    except Exception as e:  # noqa: BLE001
        first = (str(e).splitlines() or [""])[0][:200]
        CHECKS.append((name, False, first or type(e).__name__))
        print(f"FAIL {name}: {type(e).__name__}: {first}", flush=True)
        traceback.print_exc(file=sys.stderr)
