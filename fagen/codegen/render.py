"""Render a KernelSpec into source text through one strict Jinja environment, once.

`render(spec)` returns a Rendered: every file of the variant (the source, and the launcher where the backend has
one) and the sha256 of them all. The cache key, the cached source, the build directory and nvcc all take that one
Rendered, so a spec is rendered once per process however many stages use it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from pathlib import Path

import jinja2

from fagen import __version__, backends
from fagen.codegen import signatures
from fagen.spec import tables
from fagen.spec.axes import DECODE_BATCH_INVARIANT, DECODE_MAX_SEQ_Q, MAX_PAGE_SIZE, DType, Layout
from fagen.spec.kernel import KernelSpec

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "templates"  # fagen/templates, installed with the package
_PACKAGE = jinja2.FileSystemLoader(TEMPLATE_DIR.parent)  # fagen/: static modules a launcher includes verbatim


def template_dir() -> Path:
    """The templates folder: $FAGEN_TEMPLATE_DIR if set (to try edited templates), else fagen/templates."""
    return Path(os.environ["FAGEN_TEMPLATE_DIR"]) if os.environ.get("FAGEN_TEMPLATE_DIR") else TEMPLATE_DIR


def _torchtype(dtype: DType) -> str:
    return "torch." + tables.TORCH_DTYPE[DType(dtype)]


def _cudatype(dtype: DType) -> str:
    return tables.CUDA_DTYPE[DType(dtype)]


def _mmatype(dtype: DType) -> str:
    return tables.CUDA_MMA_TYPE[DType(dtype)]


def _smem_bytes(spec: KernelSpec) -> int:
    return backends.get(spec.backend).smem_bytes(spec)


def environment() -> jinja2.Environment:
    return _environment(template_dir())


@functools.cache
def _environment(root: Path) -> jinja2.Environment:
    if not (root / "triton").is_dir():
        raise FileNotFoundError(f"fagen's templates are missing: {root} has no triton/ folder "
                                "(reinstall fagen, or unset FAGEN_TEMPLATE_DIR)")
    env = jinja2.Environment(
        # auto_reload: an edited template is read again; "fagen/..." names a package module, included verbatim
        loader=jinja2.ChoiceLoader([jinja2.FileSystemLoader(root), jinja2.PrefixLoader({"fagen": _PACKAGE})]),
        bytecode_cache=_TemplateCode(),
        undefined=jinja2.StrictUndefined,  # a missing variable fails here, not as a compiler error later
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters.update(torchtype=_torchtype, cudatype=_cudatype,
                       mmatype=_mmatype, smem_bytes=_smem_bytes)
    signatures.register(env)  # def_kernel, launch, args, ...: the argument lists of fagen/codegen/args.py
    env.globals["verbatim"] = _verbatim
    return env


# [Note] Template bytecode. Jinja compiles each template to Python once per process: 0.12 s of the first render on
# the dev machine's CPU, 0.5 s on the H100 host, as much as a warm first call is allowed in all. Jinja's own bytecode
# cache keeps the compiled code under <cache>/jinja/<key>/: a file per template, named by Jinja from the template's
# name and path and checked against the sha1 of its source and the Python version when read; <key> covers what
# else shapes the code (the fagen and Jinja versions and this environment's options). Reads and writes are best
# effort: a damaged file is compiled again, and a read-only cache compiles in memory as before.
_ENV_OPTIONS = "StrictUndefined trim_blocks lstrip_blocks keep_trailing_newline no-autoescape"


class _TemplateCode(jinja2.BytecodeCache):
    """Jinja's compiled templates under the cache root ([Note] Template bytecode)."""

    def _path(self, bucket) -> Path:
        from fagen import files

        key = files.digest(__version__, jinja2.__version__, _ENV_OPTIONS)[:16]
        return files.cache_root() / "jinja" / key / f"{bucket.key}.bin"

    def load_bytecode(self, bucket) -> None:
        try:
            with open(self._path(bucket), "rb") as f:
                bucket.load_bytecode(f)
        except Exception:  # noqa: BLE001 - missing, unreadable or damaged: compile the template instead
            bucket.reset()

    def dump_bytecode(self, bucket) -> None:
        from fagen import files

        try:
            files.write_if_different(self._path(bucket), bucket.bytecode_to_string())
        except OSError:
            pass


VERBATIM_MARKER = "# -- fagen: included verbatim below this line --\n"


@jinja2.pass_environment
def _verbatim(env: jinja2.Environment, name: str) -> str:
    """The static code of templates/<name>, or of the package module fagen/<...> (a .py file linters read): the text
    below its marker line, without the last newline (the including template's line supplies it)."""
    source = env.loader.get_source(env, name)[0]
    if VERBATIM_MARKER not in source:
        raise ValueError(f"templates/{name} has no line {VERBATIM_MARKER.strip()!r} to include below")
    return source.split(VERBATIM_MARKER, 1)[1].removesuffix("\n")


def template_name(spec: KernelSpec) -> str:
    return backends.get(spec.backend).template_for(spec)


def _context(spec: KernelSpec) -> dict:
    """Everything a template sees: the spec (enums and integers only), values the tables derive from it, and the
    argument-list helpers (fagen/codegen/signatures.py)."""
    backend = backends.get(spec.backend)
    paged = spec.layout is Layout.PAGED
    return dict(spec=spec, spec_json=spec.to_json(), version=__version__, max_seq_q=DECODE_MAX_SEQ_Q,
                batch_invariant=DECODE_BATCH_INVARIANT,
                dot_precision=tables.DOT_KWARGS[spec.dtype], tma=backend.tma_loads(spec), gluon=backends.GLUON.variant_for(spec),
                max_page_size=MAX_PAGE_SIZE, packed_q=spec.packed_q, packed_k=spec.layout is Layout.VARLEN,
                paged=paged, ragged=spec.mask.padded or spec.layout is not Layout.DENSE, **_out_context(spec),
                kv_torch_dtype=tables.TORCH_KV_DTYPE[spec.kv_dtype] if spec.kv_dtype else "",
                tree_keys="len_k" if paged else "seq_k",  # tree nodes are the last Sq of these keys
                lse_shape="(q.shape[1], q.shape[0])" if spec.packed_q else "q.shape[:3]",
                mod=_mod_code(spec), **render_switches(spec))


# [Note] Render switches. Module-level values a render reads beyond the spec, the template files and the Gluon
# variant, in one list: each reader gives the value for a spec whose render reads it, else None (then the switch is
# neither in the templates' context as anything but None nor in render_state's key). Templates see them by name;
# render_state keys on the ones that are set, so a render made under one value is never served under another. A new
# run-time lever adds its reader here and nowhere else.
def _mla_gluon_dkdv(spec: KernelSpec) -> bool | None:
    """fagen/backends/triton.py's MLA_GLUON_DKDV ([Note] MLA Gluon dK/dV) for a 192/128 backward."""
    from fagen.backends import triton as triton_backend

    mla_bwd = spec.direction == "bwd" and (spec.head_dim, spec.head_dim_v) == (192, 128)
    return (triton_backend.MLA_GLUON_DKDV or None) if mla_bwd else None


def _decode_pps(spec: KernelSpec) -> int | None:
    """fagen/backends/triton.py's decode_programs_per_sm ([Note] MLA 192/128 decode tiles)."""
    from fagen.backends import triton as triton_backend

    return triton_backend.decode_programs_per_sm(spec)


def _diag_sums(spec: KernelSpec) -> int | None:
    """fagen/codegen/mod_args.py's DIAG_SUMS ([Note] Diagonal sums through a scratch) for a spec with captured
    tensors (a plain spec's render imports no mods code), where not 0."""
    if not spec.mod_tensors:
        return None
    from fagen.codegen import mod_args

    return mod_args.DIAG_SUMS or None


_SWITCHES = (("mla_gluon_dkdv", _mla_gluon_dkdv), ("decode_pps", _decode_pps), ("diag_sums", _diag_sums))


def render_switches(spec: KernelSpec) -> dict:
    """{name: value or None} of every render switch ([Note] Render switches) for `spec`."""
    return {name: read(spec) for name, read in _SWITCHES}


def _mod_code(spec: KernelSpec):
    """The templates' view of a spec's user mods (fagen/codegen/mod_args.py), or None."""
    if not spec.modded:
        return None
    from fagen.codegen.mod_args import ModCode

    return ModCode(spec)


def _out_context(spec: KernelSpec) -> dict:
    """out's shape and allocation: q's, or with v's head dim where it differs (README "Serving")."""
    if spec.head_dim_v == spec.head_dim:
        return dict(out_shape="q.shape", new_out="_new_out(q)")
    return dict(out_shape=f"(*q.shape[:-1], {spec.head_dim_v})",
                new_out=f"q.new_empty((*q.shape[:-1], {spec.head_dim_v}))")


@dataclasses.dataclass(frozen=True)
class Rendered:
    """Every file of one variant, by suffix (".py"; or ".cu" and its ".py" launcher), and their sha256."""

    spec: KernelSpec
    files: dict[str, str]
    digest: str

    @property
    def source(self) -> str:
        """The kernel source (the .py module, or the .cu file of the cuda backend)."""
        return self.files[backends.get(self.spec.backend).suffix]

    @property
    def launcher(self) -> str | None:
        return self.files[".py"] if backends.get(self.spec.backend).launcher else None


def _stamp(root: Path) -> tuple:
    """(name, mtime, size) of every template file (.j2, and the static .py included verbatim): an edited template
    changes it, so a memoised render is redone."""
    return tuple(sorted((str(p.relative_to(root)), st.st_mtime_ns, st.st_size)
                        for p in root.rglob("*") if p.suffix in (".j2", ".py") for st in (p.stat(),)))


def render(spec: KernelSpec) -> Rendered:
    """Render every file of `spec` once per process (memoised until a template file changes).

    [Note] Cache keys hash the render. The render reads the templates and the tables (dot precision, TMA choice,
    ...), so hashing the rendered text, not the template bytes, keeps a cache entry from outliving either.
    """
    if not isinstance(spec, KernelSpec):
        raise TypeError(f"render() takes a KernelSpec, got {type(spec).__name__}")
    root = template_dir()
    return _render(spec, root, _stamp(root), render_state(spec))


def render_state(spec: KernelSpec) -> str:
    """What a render reads at run time beyond the spec and the template files: the Gluon variant of the spec
    (`GluonBackend.variant_for`), which measurement scripts set in-process, and the render switches that are set for
    it ([Note] Render switches: `name`, or `name=value`). The render memo and the loader's render index ([Note] Render
    index in fagen/runtime/loader.py) key on it, so a render made under one variant is never served under another, in
    this process or a later one."""
    state = json.dumps(backends.GLUON.variant_for(spec), sort_keys=True, default=repr)
    for name, value in render_switches(spec).items():
        if value is not None:
            state += f" {name}" if value is True else f" {name}={value}"
    return state


INDEX_TRUSTED = True  # whether fagen.runtime.loader may serve a load from its render index ([Note] Render index)


def _cache_clear() -> None:
    """Forget the memoised renders (tests that change the tables under a render); the loader's render index is then
    not trusted for the rest of the process either."""
    global INDEX_TRUSTED
    _render.cache_clear()
    INDEX_TRUSTED = False


render.cache_clear = _cache_clear


@functools.lru_cache(maxsize=512)
def _render(spec: KernelSpec, root: Path, stamp: tuple, state: str = "") -> Rendered:
    env, backend = _environment(root), backends.get(spec.backend)
    files = {backend.suffix: env.get_template(template_name(spec)).render(**_context(spec))}
    if backend.launcher:
        files[".py"] = env.get_template(backend.launcher).render(**_context(spec))
    h = hashlib.sha256(files[backend.suffix].encode())
    if ".py" in files and backend.suffix != ".py":
        h.update(b"\0" + files[".py"].encode())
    return Rendered(spec=spec, files=files, digest=h.hexdigest())


def generate(spec: KernelSpec) -> str:
    """The source text of one variant. Byte-identical for equal specs."""
    if not isinstance(spec, KernelSpec):
        raise TypeError(f"generate() takes a KernelSpec, got {type(spec).__name__}")
    return render(spec).source


def generate_launcher(spec: KernelSpec) -> str:
    """The Python module that compiles, loads and launches a non-Python source (the cuda backend's .cu)."""
    if not backends.get(spec.backend).launcher:
        raise ValueError(f"backend {spec.backend} emits Python directly; it has no launcher")
    return render(spec).launcher


def source_digest(spec: KernelSpec) -> str:
    """sha256 over everything rendered for the spec (source, and launcher where the backend has one)."""
    return render(spec).digest
