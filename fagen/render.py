"""Render a KernelSpec into source text through one strict Jinja environment."""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import os
from pathlib import Path

import jinja2

from fagen import __version__, tables
from fagen.enums import DType
from fagen.spec import KernelSpec


def template_dir() -> Path:
    """The templates/ folder: $FAGEN_TEMPLATE_DIR if set, else packaged as fagen.templates when installed,
    else at the repo root in a checkout."""
    if os.environ.get("FAGEN_TEMPLATE_DIR"):
        return Path(os.environ["FAGEN_TEMPLATE_DIR"])
    try:
        packaged = Path(str(importlib.resources.files("fagen.templates")))
        if packaged.is_dir():
            return packaged
    except ModuleNotFoundError:
        pass
    return Path(__file__).resolve().parent.parent / "templates"


def _torchtype(dtype: DType) -> str:
    return "torch." + tables.TORCH_DTYPE[DType(dtype)]


def _cudatype(dtype: DType) -> str:
    return tables.CUDA_DTYPE[DType(dtype)]


def _mmatype(dtype: DType) -> str:
    return tables.CUDA_MMA_TYPE[DType(dtype)]


def _smem_bytes(spec: KernelSpec) -> int:
    return tables.cuda_smem_bytes(spec.head_dim, spec.dtype, spec.block_m, spec.block_n, spec.num_stages)


def environment() -> jinja2.Environment:
    return _environment(template_dir())


@functools.cache
def _environment(root: Path) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(root),  # auto_reload: an edited template is read again
        undefined=jinja2.StrictUndefined,  # a missing variable fails here, not as a compiler error later
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters.update(torchtype=_torchtype, cudatype=_cudatype,
                       mmatype=_mmatype, smem_bytes=_smem_bytes)
    return env


def template_name(spec: KernelSpec) -> str:
    return tables.TEMPLATE[(spec.backend, spec.kind)]


def generate(spec: KernelSpec) -> str:
    """The source text of one variant. Byte-identical for equal specs."""
    if not isinstance(spec, KernelSpec):
        raise TypeError(f"generate() takes a KernelSpec, got {type(spec).__name__}")
    template = environment().get_template(template_name(spec))
    return template.render(spec=spec, spec_json=spec.to_json(), version=__version__,
                           dot_precision=tables.DOT_KWARGS[spec.dtype], tma=tables.tma_loads(spec))


def source_digest(spec: KernelSpec) -> str:
    """sha256 over everything rendered for the spec (source, and launcher where the backend has one).

    [Note] Cache keys hash the render. The render reads the templates and the tables (dot precision, TMA choice,
    ...), so hashing the rendered text, not the template bytes, keeps a cache entry from outliving either.
    """
    h = hashlib.sha256(generate(spec).encode())
    if spec.backend in tables.LAUNCHER:
        h.update(b"\0" + generate_launcher(spec).encode())
    return h.hexdigest()


def generate_launcher(spec: KernelSpec) -> str:
    """The Python module that compiles, loads and launches a non-Python source (the cuda backend's .cu)."""
    if spec.backend not in tables.LAUNCHER:
        raise ValueError(f"backend {spec.backend} emits Python directly; it has no launcher")
    template = environment().get_template(tables.LAUNCHER[spec.backend])
    return template.render(spec=spec, spec_json=spec.to_json(), version=__version__)
