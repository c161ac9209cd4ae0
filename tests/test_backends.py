"""One descriptor per backend: every fact that differs between triton, cuda and gluon lives in fagen/backends/."""

import subprocess
import sys
from pathlib import Path

import pytest

import fagen
from fagen import backends
from fagen.backends.cuda import CudaBackend
from fagen.codegen.render import TEMPLATE_DIR, render
from fagen.spec.axes import Backend, Kind, Layout

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("backend", list(Backend))
def test_every_backend_has_a_descriptor_with_its_files(backend):
    desc = backends.get(backend)
    assert desc.backend is backend and backends.get(str(backend)) is desc
    assert desc.templates and all((TEMPLATE_DIR / t).is_file() for t in desc.templates.values())
    assert desc.launcher is None or (TEMPLATE_DIR / desc.launcher).is_file()
    assert Layout.DENSE in desc.layouts
    spec = fagen.KernelSpec(head_dim=128, mask="causal", dtype="bf16", backend=backend)
    assert spec.name.endswith(desc.name_suffix) and render(spec).files.keys() >= {desc.suffix}
    assert backends.smem_bytes(spec) == desc.smem_bytes(spec) > 0


def test_the_descriptors_are_spec_level():
    """fagen.backends reads only the spec's modules, and importing it first (before fagen.spec.kernel, which reads
    it) works without torch."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_repo import import_graph

    graph = import_graph()
    for module in (m for m in graph if m.startswith("fagen.backends")):
        assert all(dep.startswith(("fagen.spec", "fagen.backends")) for dep in graph[module]), (module, graph[module])
    code = "import sys, fagen.backends; fagen.backends.get('cuda'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_a_backend_is_changed_in_one_place(monkeypatch):
    """A subclass of the cuda descriptor with other limits, defaults and templates: the spec's checks, its default
    tiles, its name and its render follow it, with no other edit."""

    class Narrow(CudaBackend):
        supported = {**CudaBackend.supported, "block_n": ((32,), "this cuda takes block_n 32 only")}
        name_suffix = "_narrow"

        def default_config(self, spec, arch, given):
            return {**super().default_config(spec, arch, given), "block_n": 32}

    monkeypatch.setitem(backends.BACKENDS, Backend.CUDA, Narrow())
    spec = fagen.KernelSpec(head_dim=64, backend="cuda")
    assert spec.block_n == 32 and spec.name.endswith("_narrow")
    with pytest.raises(fagen.SpecError, match="this cuda takes block_n 32 only"):
        fagen.KernelSpec(head_dim=64, backend="cuda", block_n=64)
    monkeypatch.setattr(Narrow, "templates", {Kind.PREFILL: "cuda/attention.cu.j2", Kind.DECODE: "cuda/attention.cu.j2"})
    assert fagen.KernelSpec(head_dim=64, backend="cuda", kind="decode").kind is Kind.DECODE
    monkeypatch.setattr(backends.GLUON, "templates", {Kind.PREFILL: "gluon/attention.py.j2"})
    with pytest.raises(fagen.SpecError, match="no templates for this backend and kind yet"):
        fagen.KernelSpec(head_dim=64, backend="gluon", kind="decode")


def test_the_gluon_selection_rule_is_the_descriptors():
    from fagen.runtime import hopper

    assert hopper.selected == backends.GLUON.selected
    case = dict(head_dim=128, dtype="bf16", gqa=4)
    assert backends.GLUON.selected(fagen.KernelSpec(mask="causal", **case))
    # MHA causal: the gluon forward with a tile order ([Note] Gluon tile order), the Triton one without
    assert backends.GLUON.selected(fagen.KernelSpec(mask="causal", **{**case, "gqa": 1})) == \
        (backends.GLUON.variant["causal_order"] is not None)
    assert not backends.GLUON.selected(fagen.KernelSpec(mask="causal", **{**case, "head_dim": 64}))  # d64: Triton
    assert not backends.TRITON.selected(fagen.KernelSpec(mask="causal", **case))
