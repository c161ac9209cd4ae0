"""Repository hygiene: the README's set-up commands are the ones CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_test_command_is_what_ci_runs():
    ci = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line.startswith("python -m")]
    install, test = ci
    assert f"{install.removeprefix('python -m ')} && {test}" in (ROOT / "README.md").read_text()
