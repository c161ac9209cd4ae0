"""Repository hygiene: the README's set-up commands are the ones CI runs; the package has no import cycles and
no oversized modules; `import fagen` stays free of torch; templates hold Jinja, shipped kernels hold no experiment
switch, and the product takes nothing from the lab (scripts/, lab/, benchmarks/)."""

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


# -- the product tree: real templates, no experiment switches, no lab ------------------------------------------------
TEMPLATES = PACKAGE / "templates"
# A template with no Jinja in it is code, and should be a .py file that the render includes verbatim (as
# host/launch.py is). No exceptions left.
NO_JINJA_EXCEPTIONS: set[str] = set()
# Switches measured slower on the H100 and taken out of the kernels users get (docs/hopper.md, "What left the
# product"); the commit there brings each back for a measurement, never the product.
EXPERIMENT_SWITCHES = ("PINGPONG", "V_LATE", "K_LATE", "O_VIA_Q", "KV_JOIN", "Q_STAGES", "BWD_HEAD_MAJOR",
                       "BWD_DQ_PENDING", "BWD_DQ_SWIZZLE", "BWD_STAGES", "_FWD_FUSED")
LAB = ("scripts", "lab", "benchmarks")  # top-level folders of probes, run scripts and measurements


def templates_without_jinja(root: Path = TEMPLATES) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*.j2")
            if "{{" not in (text := p.read_text()) and "{%" not in text}


def test_every_template_has_jinja_in_it():
    static = templates_without_jinja() - NO_JINJA_EXCEPTIONS
    assert not static, f"these templates are plain code: make them .py files the render includes verbatim: {static}"
    assert NO_JINJA_EXCEPTIONS <= {str(p.relative_to(TEMPLATES)) for p in TEMPLATES.rglob("*.j2")}, \
        "an exception names a template that is gone: remove it from NO_JINJA_EXCEPTIONS"


def test_the_jinja_finder_finds_static_templates(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "static.py.j2").write_text("def f():\n    return {}\n")
    (tmp_path / "a" / "real.py.j2").write_text("X = {{ spec.head_dim }}\n")
    (tmp_path / "a" / "block.j2").write_text("{% if x %}y{% endif %}\n")
    assert templates_without_jinja(tmp_path) == {"a/static.py.j2"}


def experiment_switches(source: str) -> set[str]:
    """Experiment switch names bound or read in a rendered source or a template (as names, not in prose)."""
    return {name for name in EXPERIMENT_SWITCHES if re.search(rf"(?<![\w.]){name}(?!\w)\s*[:=,)]", source)}


def test_no_experiment_switch_in_a_shipped_kernel():
    from fagen.codegen.render import render
    from fagen.spec.kernel import KernelSpec
    from fagen.spec.manifest import DEFAULT_CATALOG, load_manifest

    specs = list(load_manifest(DEFAULT_CATALOG).specs)
    specs += [KernelSpec(head_dim=d, mask=m, dtype="bf16", backend="gluon", **sw) for d in (64, 128)
              for m in ("none", "causal") for sw in ({}, {"window": True}, {"softcap": True})]
    found = {s.name: hits for s in specs for text in render(s).files.values() if (hits := experiment_switches(text))}
    assert not found, f"experiment switches in shipped kernels: {found}"
    found = {str(p.relative_to(TEMPLATES)): hits for p in TEMPLATES.rglob("*.j2")
             if (hits := experiment_switches(p.read_text()))}
    assert not found, f"experiment switches in templates: {found}"


def test_the_switch_finder_finds_a_constexpr():
    assert experiment_switches("PINGPONG = 0\n") == {"PINGPONG"}
    assert experiment_switches("def f(x, KV_JOIN: gl.constexpr):") == {"KV_JOIN"}
    assert experiment_switches("g(O_VIA_Q, Q_STAGES)") == {"O_VIA_Q", "Q_STAGES"}
    assert experiment_switches("# measured with a ping-pong token (PINGPONG in c68d572)") == set()


def lab_imports(path: Path, lab: tuple[str, ...] = LAB) -> list[str]:
    """What `path` takes from the lab folders: imports of their modules, and paths into them handed to sys.path
    or importlib."""
    names = {p.stem for folder in lab for p in (ROOT / folder).rglob("*.py")} | set(lab)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [node.module] if node.module.split(".")[0] in names else []
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("spec_from_file_location", "insert",
                                                                                  "append", "import_module"):
            found += [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                      and any(re.search(rf"(^|/){folder}(/|$)", c.value) or c.value == folder for folder in lab)]
    return found


def test_the_product_imports_nothing_from_the_lab():
    found = {str(p.relative_to(ROOT)): hits for p in PACKAGE.rglob("*.py") if (hits := lab_imports(p))}
    assert not found, f"fagen/ must not depend on scripts/, lab/ or benchmarks/: {found}"
    found = {str(p.relative_to(ROOT)): hits for p in (ROOT / "tests").glob("*.py") if (hits := lab_imports(p, ("lab",)))}
    assert not found, f"tests must not import lab scripts: {found}"


def test_the_lab_finder_finds_an_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import sys\nsys.path.insert(0, 'scripts')\nimport hopper_profile\nfrom lab import x\n")
    assert sorted(lab_imports(probe)) == ["hopper_profile", "lab", "scripts"]


BOTTOM = ("fagen.spec", "fagen.backends", "fagen.mods", "fagen.errors", "fagen.files")


def test_the_spec_layer_imports_only_itself_and_files():
    """spec (with the user mods' expression trees, which are spec values) is the bottom of the pipeline: it may
    raise fagen.errors and write files (fagen.files) but reaches no later stage."""
    def bottom(t: str) -> bool:
        return t == "fagen" or any(t == b or t.startswith(b + ".") for b in BOTTOM)

    up = {m: sorted(t for t in targets if not bottom(t))
          for m, targets in import_graph().items() if m.startswith(("fagen.spec", "fagen.mods"))}
    assert not {m: t for m, t in up.items() if t}, up


def test_tests_take_the_machine_from_env():
    """One way to know where tests run: `from _env import ...` (conftest is pytest's, not a module to import)."""
    found = [p.name for p in (ROOT / "tests").glob("*.py")
             if re.search(r"^\s*(from conftest import|import conftest)", p.read_text(), re.M)]
    assert not found, f"import ON_GPU/DEVICE/SCALE from _env instead: {found}"
