"""The docs run: every ```python block of README.md and docs/*.md is executed, so an example cannot drift from the code.

[Note] Doc blocks. Each block is a program of its own, run in a fresh subprocess (cwd a temporary folder, a fresh
FAGEN_CACHE_DIR, TRITON_INTERPRET=1: the CPU, through Triton's interpreter). An HTML comment on the line just before
the fence says what else a block needs (docs/verify.md, "The examples in the docs run", documents the words):
    <!-- fagen-docs: gpu -->        needs a CUDA GPU: runs compiled where torch sees one, skipped elsewhere;
    <!-- fagen-docs: torchrun -->   needs several processes (torch.distributed): not run;
    <!-- fagen-docs: fragment -->   an excerpt that names inputs from the text around it: not run;
    <!-- fagen-docs: continue -->   runs after the file's previous block with the same needs, in its process
                                    (shares its names); say the needs again: <!-- fagen-docs: gpu, continue -->.
Unmarked blocks see no GPU (CUDA_VISIBLE_DEVICES is empty). Blocks that are not run are still checked: they must
parse, their imports must import, and every `name.attr` on a name they imported must exist (the drift the docs once
had: modules renamed under them).
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _env import INTERPRETER_WORKS

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!--\s*fagen-docs:\s*(?P<words>[\w\s,-]*?)\s*-->\s*$")
WORDS = {"gpu", "torchrun", "fragment", "continue"}
TIMEOUT_S = 300


@dataclasses.dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    source: str
    words: frozenset

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        if re.match(r"^```python\s*$", lines[i]):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            marker = MARKER.match(lines[i - 1]) if i else None
            words = frozenset(w for w in re.split(r"[\s,]+", marker["words"]) if w) if marker else frozenset()
            found.append(Block(path, i + 1, "\n".join(lines[i + 1:end]) + "\n", words))
            i = end
        elif lines[i].startswith("<!--") and "fagen-docs" in lines[i] and not MARKER.match(lines[i]):
            raise AssertionError(f"{path.relative_to(ROOT)}:{i + 1}: malformed marker {lines[i]!r}; "
                                 "write <!-- fagen-docs: gpu, continue -->")
        i += 1
    return found


def programs() -> list[list[Block]]:
    """Blocks grouped into programs: a block and the blocks that continue it."""
    groups: list[list[Block]] = []
    for path in DOCS:
        mine: list[list[Block]] = []
        for block in blocks(path):
            needs = block.words - {"continue"}
            before = [g for g in mine if g[0].words - {"continue"} == needs]
            if "continue" in block.words and before:
                before[-1].append(block)
            else:
                mine.append([block])
        groups += mine
    return groups


ALL = programs()


def test_markers_are_known_and_continuations_agree():
    problems = []
    for group in ALL:
        head = group[0]
        for block in group:
            if block.words - WORDS:
                problems.append(f"{block.where}: unknown marker word(s) {sorted(block.words - WORDS)}; "
                                f"known: {sorted(WORDS)}")
        if "continue" in head.words:
            problems.append(f"{head.where}: marked continue, but no earlier python block of the file has its needs "
                            f"({sorted(head.words - {'continue'})})")
    assert not problems, "\n".join(problems)


def _imports_and_attributes(source: str) -> str:
    """A program that runs the imports of `source` and checks each `name.attr` on an imported name."""
    tree = ast.parse(source)
    imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    bound = {(alias.asname or alias.name).split(".")[0] for node in imports for alias in node.names}
    attrs = sorted({(node.value.id, node.attr) for node in ast.walk(tree)
                    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound})
    checks = [f"assert hasattr({name}, {attr!r}), '{name}.{attr} does not exist'" for name, attr in attrs]
    return "\n".join([ast.unparse(node) for node in imports] + checks) + "\n"


def _run(program: str, tmp_path: Path, where: str, *, interpret: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FAGEN_CHECK")}
    env.update(FAGEN_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if interpret:  # the CPU even where a GPU is present
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    script = tmp_path / "doc_block.py"
    script.write_text(program)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{where} failed (exit {done.returncode}):\n{done.stderr[-3000:]}"


@pytest.mark.parametrize("group", ALL, ids=[g[0].where for g in ALL])
def test_doc_block_runs(group, tmp_path):
    head = group[0]
    source = "".join(block.source for block in group)
    compile(source, head.where, "exec")
    if head.words & {"torchrun", "fragment"}:
        _run(_imports_and_attributes(source), tmp_path, head.where, interpret=True)
        return
    if "gpu" in head.words:
        if not torch.cuda.is_available():
            pytest.skip(f"{head.where} needs a GPU")
        _run(source, tmp_path, head.where, interpret=False)
        return
    if not INTERPRETER_WORKS:
        pytest.skip(f"{head.where} runs on the CPU interpreter, which needs numpy < 2.4 (this machine has a newer one)")
    _run(source, tmp_path, head.where, interpret=True)


def test_a_broken_block_fails(tmp_path):
    """The runner can fail: a block that calls a renamed module is red."""
    with pytest.raises(AssertionError, match="fagen.verifier"):
        _run("import fagen.verifier\n", tmp_path, "example", interpret=True)
    with pytest.raises(AssertionError, match="nvcc.compile_everything does not exist"):
        _run(_imports_and_attributes("from fagen.aot import nvcc\nnvcc.compile_everything(src)\n"), tmp_path,
             "example", interpret=True)
