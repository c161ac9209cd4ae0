"""The GPU scripts' phase runner.

A GPU script runs each of its phases in a child process (`python3 <script> --phase NAME`) under a wall-clock
limit, so a kernel that faults or hangs costs that phase only: the parent keeps the rows the other phases printed,
prints the child's lines as they come (a timeout of the whole call keeps what was printed), and goes on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable


def child_env(cache_dir: str, root: str | os.PathLike | None = None) -> dict[str, str]:
    """The environment of a phase: the real GPU (no TRITON_INTERPRET), its own kernel cache unless one is set, and
    `root` first on PYTHONPATH when given (so the child imports the checkout's fagen)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("FAGEN_CACHE_DIR", cache_dir)
    if root is not None:
        env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_phase(script: str, name: str, limit: float, env: dict[str, str],
              on_line: Callable[[str], None] | None = None, extra: tuple[str, ...] = ()) -> tuple[object, list[str]]:
    """Run `script --phase name *extra` for at most `limit` seconds. Each line of its output goes to `on_line`
    (default: printed at once). Returns (exit code, or a sentence saying it was killed; the lines)."""
    lines: list[str] = []
    proc = subprocess.Popen([sys.executable, script, "--phase", name, *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            if on_line is None:
                print(line, end="", flush=True)
            else:
                on_line(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc: object = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = f"killed after {limit}s (a hung kernel?)"
    reader.join(timeout=5)
    return rc, lines
