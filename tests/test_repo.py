"""Repository hygiene: the README's set-up commands are the ones CI runs; the package has no import cycles and
no oversized modules; `import fagen` stays free of torch."""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fagen"


def test_readme_test_command_is_what_ci_runs():
    lines = (ROOT / ".ci/run").read_text().splitlines()
    install = next(line for line in lines if line.startswith('python -m pip install "torch==2.13.0" -e'))
    test = next(line for line in lines if line.startswith("python -m pytest"))
    assert f"{install.removeprefix('python -m ')} && {test}" in (ROOT / "README.md").read_text()


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the fagen modules it imports, at module level or inside functions (lazy imports count too)."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                target = resolve(name) if name.startswith("fagen") else None
                # a module reading names from the package it belongs to is not an edge back into itself
                if target and target != mod and not mod.startswith(target + "."):
                    graph[mod].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycles_inside_fagen():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"split these modules: {long}"


def test_import_fagen_and_help_do_not_import_torch():
    code = ("import sys, fagen, fagen.cli, fagen.spec, fagen.codegen; from click.testing import CliRunner; "
            "r = CliRunner().invoke(fagen.cli.main, ['--help']); assert r.exit_code == 0, r.output; "
            "fagen.generate(fagen.KernelSpec(head_dim=64)); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_python_m_fagen_cli_has_every_command():
    out = subprocess.run([sys.executable, "-m", "fagen.cli", "bench", "--help"], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 0 and "--suite" in out.stdout, out.stdout + out.stderr


def _template_texts() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE / "templates")): p.read_text() for p in (PACKAGE / "templates").rglob("*")
            if p.suffix in (".j2", ".py")}


def hand_written_signatures(texts: dict[str, str]) -> list[str]:
    """Places where a template spells an argument list that fagen/codegen/args.py owns: a kernel's definition, the
    cuda kernel's parameters, the host functions' launch form, the public score keywords."""
    from fagen.codegen.args import KERNELS

    found = []
    for name, text in texts.items():
        for m in re.finditer(r"^def (\w+)\(", text, re.M):
            if m.group(1) in KERNELS:
                found.append(f"{name}: def {m.group(1)}(...) written by hand; use def_kernel(\"{m.group(1)}\")")
        if re.search(r"fagen_attn_fwd\(\s*(const |int |float |T\*)", text):
            found.append(f"{name}: the cuda kernel's parameters written by hand; use c_params(...)")
        for literal in ("q, k, v, scale, seqlens_q", "window=None, softcap=None", "window_left, window_right, softcap"):
            if literal in text:
                found.append(f"{name}: {literal!r} written by hand; use the args/keywords helpers")
    return found


def test_no_template_spells_a_kernel_signature():
    """Kernel definitions, launches, operator schemas and public keywords come from the argument lists (fagen/codegen/
    args.py); a template that writes one by hand would drift from its launch and AOT entry."""
    assert hand_written_signatures(_template_texts()) == []


def test_the_signature_finder_finds_hand_written_signatures():
    texts = {"a.j2": "@triton.jit\ndef _attn_fwd(Q, K, V,\n    qk_scale):\n",
             "b.j2": "def f(q, k, v, scale, seqlens_q):",
             "c.cu.j2": "void fagen_attn_fwd(\n    const T* __restrict__ q)", "d.j2": "{{ def_kernel(\"_attn_fwd\") }}"}
    assert [f.split(":")[0] for f in hand_written_signatures(texts)] == ["a.j2", "b.j2", "c.cu.j2"]
