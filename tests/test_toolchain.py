"""fagen's kernels build with one ptxas ([Note] One ptxas, fagen/runtime/toolchain.py): whatever TRITON_PTXAS_PATH a
library set in the process (torch.compile's Inductor sets it to torch's ptxas), a fagen module's JIT functions
build with Triton's bundled ptxas (or FAGEN_PTXAS_PATH), and the variable is the process's again after."""

import os
import subprocess
import sys

import pytest
import triton
from triton.runtime.jit import JITFunction

from fagen.runtime import toolchain
from fagen.runtime.loader import load_source

OTHER = "/usr/local/cuda/bin/ptxas"  # CUDA 13.0's, as torch 2.11+cu130 ships it in torch/bin
TINY = '''
import triton
import triton.language as tl


@triton.jit
def _k(x):
    tl.store(x + tl.arange(0, 16), tl.arange(0, 16))
'''


def test_a_modules_kernels_build_with_the_bundled_ptxas_and_the_variable_comes_back(monkeypatch):
    seen = []

    def recorder(self, *args, **kwargs):  # JITFunction._do_compile as the module's functions capture it
        seen.append(os.environ.get("TRITON_PTXAS_PATH"))
        return "built"

    monkeypatch.setattr(JITFunction, "_do_compile", recorder)
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/opt/elsewhere/ptxas")
    monkeypatch.delenv("FAGEN_PTXAS_PATH", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # @triton.jit reads it when the module is imported
    m = load_source(TINY, f"toolchain_tiny_{os.getpid()}")
    assert isinstance(m._k, JITFunction)
    assert m._k._do_compile("key", {}, 0, {}, None, {}, False) == "built"
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    assert seen == [bundled]
    assert os.environ["TRITON_PTXAS_PATH"] == "/opt/elsewhere/ptxas"
    monkeypatch.setenv("FAGEN_PTXAS_PATH", "/opt/chosen/ptxas")  # the user's deliberate choice wins
    m._k._do_compile("key", {}, 0, {}, None, {}, False)
    assert seen[-1] == "/opt/chosen/ptxas" and os.environ["TRITON_PTXAS_PATH"] == "/opt/elsewhere/ptxas"
    monkeypatch.delenv("TRITON_PTXAS_PATH")
    m._k._do_compile("key", {}, 0, {}, None, {}, False)
    assert "TRITON_PTXAS_PATH" not in os.environ  # unset before, unset after


def test_nested_scopes_restore_the_outer_value_once(monkeypatch):
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/opt/elsewhere/ptxas")
    monkeypatch.setenv("FAGEN_PTXAS_PATH", "/opt/chosen/ptxas")
    with toolchain.pinned_ptxas():
        with toolchain.pinned_ptxas():
            assert os.environ["TRITON_PTXAS_PATH"] == "/opt/chosen/ptxas"
        assert os.environ["TRITON_PTXAS_PATH"] == "/opt/chosen/ptxas"
    assert os.environ["TRITON_PTXAS_PATH"] == "/opt/elsewhere/ptxas"


CHILD = """
import os, re, subprocess, sys
import triton
import fagen
from fagen.runtime import toolchain
from fagen.runtime.loader import load_source
spec = fagen.KernelSpec(backend="gluon", direction="bwd", head_dim=128, mask="causal", dtype="bf16", window=True)
m = load_source(fagen.generate(spec), spec.name + "_toolchain")
if sys.argv[1] == "pinned":
    with toolchain.pinned_ptxas():
        k = m.compile_backward_for(seq_q=8192, seq_k=8192)
else:
    k = m.compile_backward_for(seq_q=8192, seq_k=8192)
path = os.path.join(os.environ["TRITON_CACHE_DIR"], "k.cubin")
open(path, "wb").write(k.asm["cubin"])
exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
out = subprocess.run([exe, "-res-usage", path], capture_output=True, text=True, check=True).stdout
print("STACK", re.search(r"STACK:(\\d+)", out).group(1), os.environ.get("TRITON_PTXAS_PATH"))
"""


def _stack(tmp_path, name, ptxas, pinned=False):
    """The sm_90 window backward's stack frame in bytes, built in a fresh process (a Gluon sm_90 build after
    interpreted kernels in one process can fail in triton 3.6) with TRITON_PTXAS_PATH = ptxas, its own cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_PTXAS_PATH",
                                                              "FAGEN_PTXAS_PATH")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / name)
    os.makedirs(env["TRITON_CACHE_DIR"])
    if ptxas:
        env["TRITON_PTXAS_PATH"] = ptxas
    out = subprocess.run([sys.executable, "-c", CHILD, "pinned" if pinned else "plain"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    _, stack, after = out.stdout.split()[-3:]
    assert after == (ptxas or "None")  # the process's value after the build
    return int(stack)


@pytest.mark.skipif(not os.access(OTHER, os.X_OK), reason="no second ptxas on this machine")
def test_the_window_backward_builds_as_with_the_bundled_ptxas_when_the_process_points_elsewhere(tmp_path):
    """The measured case (sm_90, triton 3.6): the window row's Gluon backward has a 64-byte stack with Triton's
    ptxas 12.8 and a 104-byte one with CUDA 13.0's (7.8% slower on the H200). Under the pinned scope, a process
    whose TRITON_PTXAS_PATH names CUDA 13.0's ptxas gets the bundled build. Each build in a cache folder of its
    own: Triton's key keeps the ptxas version it read first, so one folder would serve the first build again."""
    bundled, other = _stack(tmp_path, "bundled", None), _stack(tmp_path, "other", OTHER)
    if other == bundled:
        pytest.skip(f"{OTHER} builds this kernel as the bundled ptxas does")
    pinned = _stack(tmp_path, "pinned", OTHER, pinned=True)
    assert (bundled, pinned) == (64, 64) and other > bundled, (bundled, other, pinned)


def test_the_build_key_names_the_ptxas_the_build_uses(monkeypatch):
    """fagen build's key ([Note] Artifact keys) holds the pinned ptxas, not the process's TRITON_PTXAS_PATH."""
    from fagen.aot.keys import codegen_env

    monkeypatch.delenv("FAGEN_PTXAS_PATH", raising=False)
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/opt/elsewhere/ptxas")
    assert codegen_env()["TRITON_PTXAS_PATH"] == toolchain.ptxas_path() != "/opt/elsewhere/ptxas"
    monkeypatch.setenv("FAGEN_PTXAS_PATH", "/opt/chosen/ptxas")
    assert codegen_env()["TRITON_PTXAS_PATH"] == "/opt/chosen/ptxas"
