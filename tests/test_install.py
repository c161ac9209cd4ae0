"""Issue 18, bug 1: a non-editable install must find its templates. The wheel is installed into a bare folder and
imported from outside the checkout (CI also installs it, with its dependencies, into a fresh venv)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_built_wheel_renders_from_outside_the_checkout(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(ROOT)], check=True, capture_output=True, timeout=300)
    [wheel] = (tmp_path / "dist").glob("fagen-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(tmp_path / "site"),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    code = ("import fagen, sys; from pathlib import Path; "
            "assert Path(fagen.__file__).is_relative_to(Path(sys.argv[1])), fagen.__file__; "
            "from fagen.cli import main; main(['generate', '--head-dim', '64', '--mask', 'tree', '-o', 'out'])")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(tmp_path / "site")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "site")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    [out] = (tmp_path / "out").iterdir()
    assert out.read_text() == __import__("fagen").generate(__import__("fagen").KernelSpec(head_dim=64, mask="tree"))
