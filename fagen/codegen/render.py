"""Render a KernelSpec into source text through one strict Jinja environment, once.

`render(spec)` returns a Rendered: every file of the variant (the source, and the launcher where the backend has
one) and the sha256 of them all. The cache key, the cached source, the build directory and nvcc all take that one
Rendered, so a spec is rendered once per process however many stages use it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from pathlib import Path

import jinja2

from fagen import __version__, backends
from fagen.spec import tables
from fagen.spec.axes import DECODE_MAX_SEQ_Q, MAX_PAGE_SIZE, DType, Kind, Layout, Mask
from fagen.spec.kernel import KernelSpec, SpecError

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "templates"  # fagen/templates, installed with the package


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
    return backends.get(spec.backend).templates[spec.kind]


def _context(spec: KernelSpec) -> dict:
    """Everything a template sees: the spec (enums and integers only), and values the tables derive from it."""
    backend = backends.get(spec.backend)
    return dict(spec=spec, spec_json=spec.to_json(), version=__version__, max_seq_q=DECODE_MAX_SEQ_Q,
                dot_precision=tables.DOT_KWARGS[spec.dtype], tma=backend.tma_loads(spec), gluon=backends.GLUON.variant,
                xargs=SCORE_ARGS if spec.switches else "", xsig=SCORE_SIG if spec.switches else "",
                max_page_size=MAX_PAGE_SIZE, **_out_context(spec), **_kv_context(spec), **_layout_context(spec))


def _kv_context(spec: KernelSpec) -> dict:
    """An fp8 cache's launch-form scale arguments ([Note] fp8 cache in triton/decode.py.j2): floats, and per-KV-head
    tensors or None."""
    if spec.kv_dtype is None:
        return dict(kvargs="", kvsig="", kv_torch_dtype="")
    return dict(kvargs=", k_scale, v_scale, k_scales, v_scales",
                kvsig=", k_scale: float, v_scale: float, k_scales: Optional[torch.Tensor], "
                      "v_scales: Optional[torch.Tensor]",
                kv_torch_dtype=tables.TORCH_KV_DTYPE[spec.kv_dtype])


def _out_context(spec: KernelSpec) -> dict:
    """out's shape and allocation: q's, or with v's head dim where it differs (README "Serving")."""
    if spec.head_dim_v == spec.head_dim:
        return dict(out_shape="q.shape", new_out="_new_out(q)")
    return dict(out_shape=f"(*q.shape[:-1], {spec.head_dim_v})",
                new_out=f"q.new_empty((*q.shape[:-1], {spec.head_dim_v}))")


# [Note] Layout arguments. The varlen and paged layouts ([Note] Layouts in triton/masks.j2) pass host ints and the
# block table beside the seqlens slots, which carry cu_seqlens (varlen q and k, paged-prefill q) or the cached
# lengths (paged k). Like the score arguments they are appended to the launch, operator and autograd argument
# lists ({{ largs }} / {{ lsig }}); a dense spec renders none of them.
_LAYOUT_ARGS = {
    (Layout.VARLEN, Kind.PREFILL): ("max_seqlen_q", "max_seqlen_k"),
    (Layout.PAGED, Kind.PREFILL): ("block_table", "max_seqlen_q"),
    (Layout.PAGED, Kind.DECODE): ("block_table",),
}
_LAYOUT_TYPES = {"max_seqlen_q": "int", "max_seqlen_k": "int", "block_table": "torch.Tensor"}
# The public keyword arguments of each layout (README "Layouts"), in place of seqlens_q, seqlens_k and tree_mask.
_LAYOUT_KEYWORDS = {
    (Layout.VARLEN, Kind.PREFILL): ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"),
    (Layout.PAGED, Kind.PREFILL): ("cu_seqlens_q", "max_seqlen_q", "block_table", "seqlens_k"),
    (Layout.PAGED, Kind.DECODE): ("block_table", "seqlens_k"),
}


def _layout_context(spec: KernelSpec) -> dict:
    names = _LAYOUT_ARGS.get((spec.layout, spec.kind), ())
    paged = spec.layout is Layout.PAGED
    tree = spec.mask is Mask.TREE
    return dict(packed_q=spec.packed_q, packed_k=spec.layout is Layout.VARLEN, paged=paged,
                ragged=spec.mask.padded or spec.layout is not Layout.DENSE,
                lkw=", ".join(_LAYOUT_KEYWORDS.get((spec.layout, spec.kind), ()) + (("tree_mask",) if tree else ())),
                tree_keys="len_k" if paged else "seq_k",  # tree nodes are the last Sq of these keys
                lse_shape="(q.shape[1], q.shape[0])" if spec.packed_q else "q.shape[:3]",
                # the autograd's view of them: saved on ctx (varlen, the one layout with a backward), no gradient
                layout_ctx="".join(", ctx." + n for n in names), layout_none=", None" * len(names),
                largs="".join(", " + n for n in names), lsig="".join(f", {n}: {_LAYOUT_TYPES[n]}" for n in names),
                # the kernels' page arguments: the top-level kernel's, and the inner loops' (this sequence's row)
                xkpg=", BlockTable, stride_btb, page_shift, num_pages" if paged else "",
                xpg=", table, stride_kb, stride_vb, page_shift, num_pages" if paged else "")


# [Note] Score arguments. A spec with any score switch threads these launch-form values through its launch
# function, operators and autograd (appended to every argument list as {{ xargs }} / {{ xsig }}); a spec without
# switches renders neither, so its source is unchanged.
SCORE_ARGS = ", window_left, window_right, softcap, alibi_slopes, sinks"
SCORE_SIG = (", window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor], "
             "sinks: Optional[torch.Tensor]")


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
    """(name, mtime, size) of every template file: an edited template changes it, so a memoised render is redone."""
    return tuple(sorted((str(p.relative_to(root)), st.st_mtime_ns, st.st_size)
                        for p in root.rglob("*.j2") for st in (p.stat(),)))


def render(spec: KernelSpec) -> Rendered:
    """Render every file of `spec` once per process (memoised until a template file changes).

    [Note] Cache keys hash the render. The render reads the templates and the tables (dot precision, TMA choice,
    ...), so hashing the rendered text, not the template bytes, keeps a cache entry from outliving either.
    """
    if not isinstance(spec, KernelSpec):
        raise TypeError(f"render() takes a KernelSpec, got {type(spec).__name__}")
    if spec.modded:  # the spec and the fagen.mods front end exist; no template emits a mod yet
        raise SpecError("score_mod" if spec.score_mod else "mask_mod", spec.score_mod or spec.mask_mod,
                        "user mods are not rendered into kernels yet (docs/mods.md)")
    root = template_dir()
    return _render(spec, root, _stamp(root))


render.cache_clear = lambda: _render.cache_clear()  # for tests that change the tables under a render


@functools.lru_cache(maxsize=512)
def _render(spec: KernelSpec, root: Path, stamp: tuple) -> Rendered:
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
