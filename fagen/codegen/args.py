"""The typed argument lists of the generated code: one list per kernel and per host calling convention.

Every signature, launch call, operator schema, fake, autograd tuple and AOT signature of a generated module is
rendered from these lists by fagen/codegen/signatures.py; no template spells a kernel's parameters by hand.
A new kernel argument (a captured tensor of a user mod, say) is one more `Arg` here, with the specs it belongs to.

[Note] Argument lists
An Arg names one parameter: its kind (tensor, int, float, constexpr), a tensor's element type, `when` (the specs
that have the parameter at all) and, for tensors, `real` (the specs that pass a tensor: the others pass None, a
constexpr None to an ahead-of-time build). `host` is the launcher's expression for it; a star expression there
("*tree_strides") also covers the following args whose host is "". Args of one `pack` are passed as one star
(`*ints`): the launcher binds the pack's tuple from their host expressions once, and may keep it for the next
call ([Note] Forward steps). `br` starts a new line in a rendered definition, so the definitions read as before.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from fagen.spec.axes import DType, Kind, Layout, Mask
from fagen.spec.kernel import KernelSpec

TENSOR, INT, FLOAT, CONSTEXPR = "tensor", "int", "float", "constexpr"
IO = "io"  # a tensor of the spec's own dtype (q, k, v, out and their gradients)

Pred = Callable[[KernelSpec], bool]


def always(spec: KernelSpec) -> bool:
    return True


def switched(spec: KernelSpec) -> bool:
    """Any score switch: the spec then takes every score argument (None or 0 for the switches it lacks)."""
    return bool(spec.switches)


def alibi(spec: KernelSpec) -> bool:
    return spec.alibi


def sinks(spec: KernelSpec) -> bool:
    return spec.sinks


def window(spec: KernelSpec) -> bool:
    return spec.window


def fp8(spec: KernelSpec) -> bool:
    """The fp8 (e4m3) gluon forward: descales, and V transposed (docs/hopper.md, "fp8 forward")."""
    return spec.dtype is DType.FP8_E4M3


def dense(spec: KernelSpec) -> bool:
    return spec.layout is Layout.DENSE


def varlen(spec: KernelSpec) -> bool:
    return spec.layout is Layout.VARLEN


def paged(spec: KernelSpec) -> bool:
    return spec.layout is Layout.PAGED


def packed_q(spec: KernelSpec) -> bool:
    return spec.packed_q


def tree(spec: KernelSpec) -> bool:
    return spec.mask is Mask.TREE


def paged_tree(spec: KernelSpec) -> bool:
    return paged(spec) and tree(spec)


def lengths_q(spec: KernelSpec) -> bool:
    """The kernels read per-sequence query lengths (padding masks) or offsets (packed q)."""
    return spec.mask.padded or spec.packed_q


def lengths_k(spec: KernelSpec) -> bool:
    """The kernels read per-sequence key lengths or offsets (padding masks, and every non-dense layout)."""
    return spec.mask.padded or spec.layout is not Layout.DENSE


def padded(spec: KernelSpec) -> bool:
    return spec.mask.padded


def modded(spec: KernelSpec) -> bool:
    return spec.modded


def mask_modded(spec: KernelSpec) -> bool:
    """A mask_mod in a prefill kernel: the kernels take a block mask's classes and lists (None without one). Decode
    kernels take none (they read memory; every key block runs the mask_mod)."""
    return spec.mask_mod is not None and spec.kind is Kind.PREFILL


def rows_16(spec: KernelSpec) -> bool:
    """Contiguous row strides are multiples of 16 only when the head dims are (what the AOT build assumes of them)."""
    return spec.head_dim % 16 == 0 and spec.head_dim_v % 16 == 0


def paged_fp8_own_v(spec: KernelSpec) -> bool:
    """A paged fp8 KV cache with its own V: the decode takes ROWS32 ([Note] Paged rows in 32 bits, triton/decode)."""
    return paged(spec) and spec.kv_dtype is not None and not spec.shared_kv


def fp8_cache(spec: KernelSpec) -> bool:
    """A decode kernel reading an fp8 KV cache (README "Serving"): it takes the cache's scales."""
    return spec.kv_dtype is not None


@dataclasses.dataclass(frozen=True)
class Arg:
    """One parameter of a kernel or host function ([Note] Argument lists)."""

    name: str
    kind: str
    dtype: str = ""  # tensors: IO, "fp32", "i32", "u8"
    when: Pred = always  # the specs that have this parameter
    real: Pred = always  # tensors: the specs that pass a tensor rather than None
    host: str | Callable[[KernelSpec], str] = ""  # the launcher's expression ("" when an earlier star covers it)
    fast: str = ""  # the expression in a step's launch, where it differs ([Note] Forward steps)
    pack: str = ""  # passed as part of `*pack`
    aot: str = ""  # constexprs: the value an AOT build takes, where it differs from host
    divisible: Pred | None = None  # AOT: specs where it is assumed a multiple of 16 (a pointer: 16-byte aligned)
    br: bool = False  # starts a new line in a rendered definition
    wide: bool = False  # cuda: int64_t rather than int
    written: bool = False  # cuda: a pointer the kernel stores through (not const)
    optional: bool = False  # host: the value may be None (Optional[...] in an operator schema)
    grad: str = ""  # host: the autograd expression of this input's gradient where `real` ("" for none)

    def __post_init__(self) -> None:
        if self.kind not in (TENSOR, INT, FLOAT, CONSTEXPR):
            raise ValueError(f"Arg {self.name}: unknown kind {self.kind!r}")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """An entry point: its argument list and how it is built ahead of time."""

    name: str
    args: tuple[Arg, ...]
    packs: dict = dataclasses.field(default_factory=dict)  # pack -> the star expression's value (default: its name)
    warps: str = "NUM_WARPS"  # num_warps and num_stages of its launches and AOT entry ("": not passed)
    stages: str = "NUM_STAGES"
    constexpr_type: str = "tl.constexpr"

    def of(self, spec: KernelSpec) -> list[Arg]:
        return expand(self.args, spec)


@dataclasses.dataclass(frozen=True)
class Each:
    """Args that depend on a spec's values, not only on whether it has a feature: one per captured tensor (and
    its strides and sizes) and per runtime scalar of a user mod ([Note] Mod argument names in mod_args.py)."""

    fn: Callable[[KernelSpec], list]


def expand(items, spec: KernelSpec) -> list:
    """The entries of a list that `spec` has, with each Each expanded in place."""
    out = []
    for a in items:
        if isinstance(a, Each):
            out += a.fn(spec)
        elif a.when(spec):
            out.append(a)
    return out


def T(name, dtype=IO, **kw) -> Arg:  # noqa: N802 - the kinds read as types in the tables below
    return Arg(name, TENSOR, dtype, **kw)


def I(name, **kw) -> Arg:  # noqa: E743, N802
    return Arg(name, INT, **kw)


def F(name, **kw) -> Arg:  # noqa: N802
    return Arg(name, FLOAT, **kw)


def C(name, host=None, **kw) -> Arg:  # noqa: N802
    return Arg(name, CONSTEXPR, host=name if host is None else host, **kw)


def _strides(prefix: str, dims: str, source: str, pack: str = "", br: str = "", divisible: Pred | None = rows_16,
             host: str = "{src}.stride({i})") -> list[Arg]:
    """stride_<prefix><dim> for each dim; the launcher passes `host` of (source, i), or a star over all of them
    ("*name" source)."""
    def expr(i: int) -> str:
        if not source:
            return ""
        if source.startswith("*"):
            return source if i == 0 else ""
        return host.format(src=source, i=i)

    return [I(f"stride_{prefix}{d}", host=expr(i), pack=pack, br=d in br, divisible=divisible)
            for i, d in enumerate(dims)]


# -- the triton kernels' shared pieces -----------------------------------------------------------------------------
SCALE_LOG2 = "scale * 1.4426950408889634"  # 1/ln 2: the kernels' exp2 domain
SCORE_LAUNCH = "_score_launch(scale, window_left, window_right, softcap, alibi_slopes, sinks)"
_LENGTHS = [T("SeqlensQ", "i32", real=lengths_q, host="seqlens_q"),
            T("SeqlensK", "i32", real=lengths_k, host="seqlens_k"),
            T("TreeMask", "u8", real=tree, host="tree")]
_SCORES = [I("win_left", when=switched, pack="scores"), I("win_right", when=switched, pack="scores"),
           F("cap_in", when=switched, pack="scores"), F("cap_out", when=switched, pack="scores"),
           T("Slopes", "fp32", when=switched, real=alibi, pack="scores")]
_SINKS = T("Sinks", "fp32", when=switched, real=sinks, pack="scores")
_PAGING = [T("BlockTable", "i32", when=paged, pack="paging"), I("stride_btb", when=paged, pack="paging"),
           I("page_shift", when=paged, pack="paging"), I("num_pages", when=paged, pack="paging")]
_TREE_STRIDES = [I("stride_tb", host="*tree_strides"), I("stride_tm")]
_HEAD = [C("HEAD_DIM", br=True), C("BLOCK_D", "_pow2(HEAD_DIM)", aot="triton.next_power_of_2(HEAD_DIM)")]
_HEAD_D = [_HEAD[0], dataclasses.replace(_HEAD[1], host="block_d")]  # launchers that compute block_d once
# v's and out's head dim (README "Serving": head_dim_v), padded like HEAD_DIM
_HEAD_V = [C("HEAD_DIM_V"), C("BLOCK_DV", "_pow2(HEAD_DIM_V)", aot="triton.next_power_of_2(HEAD_DIM_V)")]
_HEAD_DV = [_HEAD_V[0], dataclasses.replace(_HEAD_V[1], host="block_dv")]
# an fp8 cache's scales ([Note] fp8 cache in triton/decode.py.j2): per-tensor floats, per-KV-head tensors or None,
# per-token tensors or None and their strides as the kernel's [B', Hkv, slots] ([Note] Per-token scales)
_KV_SCALES = [F("k_scale", when=fp8_cache, host="k_scale"), F("v_scale", when=fp8_cache, host="v_scale"),
              T("KScale", "fp32", when=fp8_cache, host="k_scales"),
              T("VScale", "fp32", when=fp8_cache, host="v_scales"),
              T("KTok", "fp32", when=fp8_cache, host="k_tokens"), T("VTok", "fp32", when=fp8_cache, host="v_tokens"),
              *(dataclasses.replace(a, when=fp8_cache) for a in _strides("z", "bhn", "*tok_strides", divisible=None))]
_UPCAST = C("UPCAST", aot="False")  # compiled kernels never upcast ([Note] Interpreter upcast)


_MOD_PTR = {"bool": "i1"}  # a captured tensor's Triton pointer type where it differs from its dtype's spelling


def _fast_ptr(name: str) -> str:
    """A step's launch expression of a tensor that may be None: its device address, or None (a None constexpr)."""
    return f"{name} if {name} is None else {name}.data_ptr()"


def _mod_args(spec: KernelSpec) -> list[Arg]:
    """A user mod's kernel arguments: per captured tensor its pointer, strides and sizes, then each scalar."""
    out = []
    for i, (_, dtype, rank) in enumerate(spec.mod_tensors):
        out.append(T(f"mt{i}", _MOD_PTR.get(dtype, dtype), host=f"mt{i}", fast=f"mt{i}.data_ptr()", br=i == 0))
        out += [I(f"mt{i}_s{d}", host=f"mt{i}.stride({d})") for d in range(rank)]
        out += [I(f"mt{i}_n{d}", host=f"mt{i}.shape[{d}]") for d in range(rank)]
    for j, (_, kind) in enumerate(spec.mod_scalars):
        out.append((I if kind == "int" else F)(f"ms{j}", host=f"ms{j}", br=not spec.mod_tensors and j == 0))
    return out


MOD_ARGS = Each(_mod_args)


def _grad_loads(spec: KernelSpec) -> int:
    """How many loads of captured float tensors the score_mod makes (fagen.codegen.mod_args.ModCode.grad_loads)."""
    if spec.score_mod is None:
        return 0
    from fagen.codegen.mod_args import ModCode

    return len(ModCode(spec).grad_loads)


# Each such load's gradient workspace pair, None when its tensor needs no gradient ([Note] Captured-tensor
# gradients in fagen/codegen/mod_args.py): the dK/dV kernel's and its loop's.
# Varlen adds mg_sk, the workspaces' key extent (max_seqlen_k; dense: seq_k).
MOD_GRAD_ARGS = Each(lambda spec: [T(f"{n}{k}", dt, pack="mod_ws", br=k == 0 and n == "MG")
                                   for k in range(_grad_loads(spec)) for n, dt in (("MG", "fp32"), ("MGI", "i64"))]
                     + ([I("mg_sk", pack="mod_ws")] if varlen(spec) and _grad_loads(spec) else []))
# A block mask's kernel form ([Note] Block classes in fagen/runtime/block_mask.py): classes int8 [B', H', QB, KB],
# lists int32 [B', H', QB, 4 KB + 2] (the partial key blocks ascending, the full ones ascending, then the running
# count of each: [Note] Partial and full lists) and their transpose [B', H', KB, 4 QB + 2] (the dK/dV loop's), the
# strides of each (0 on a broadcast b or h), and the granularity; None and zeros without a block mask.
_BLOCK_INTS = ("blk_cb", "blk_ch", "blk_cq", "blk_lb", "blk_lh", "blk_lq", "blk_tb", "blk_th", "blk_tk", "blk_m",
               "blk_n")
BLOCK_ARGS = [T("BlkCls", "i8", when=mask_modded, host="blk_cls", fast=_fast_ptr("blk_cls"), br=True),
              T("BlkList", "i32", when=mask_modded, host="blk_list", fast=_fast_ptr("blk_list")),
              T("BlkListT", "i32", when=mask_modded, host="blk_list_t", fast=_fast_ptr("blk_list_t")),
              *(I(n, when=mask_modded, pack="blocks") for n in _BLOCK_INTS)]
_BLOCK_PACK = "_block_ints(blk_cls, blk_list, blk_list_t, blk_m, blk_n)"
_THREADED_BLOCKS = (T("BlkCls", "i8", when=mask_modded), T("BlkList", "i32", when=mask_modded),
                    T("BlkListT", "i32", when=mask_modded), *(I(n, when=mask_modded) for n in _BLOCK_INTS))


def _in_pack(args: list[Arg], pack: str) -> list[Arg]:
    return [dataclasses.replace(a, pack=pack) for a in args]


ATTN_FWD = Kernel("_attn_fwd", (
    T("Q", host="q", fast="pq", divisible=always), T("K", host="k", fast="pk", divisible=always),
    T("V", host="v", fast="pv", divisible=always), T("Out", host="out", fast="po", divisible=always),
    T("Lse", "fp32", host="lse", fast="pl", divisible=always), *_LENGTHS, F("qk_scale", host=SCALE_LOG2),
    *_SCORES, _SINKS, *_PAGING, MOD_ARGS, *BLOCK_ARGS,
    *_strides("q", "bhm", "q", "ints", br="b"), *_strides("k", "bhn", "k", "ints"),
    *_strides("v", "bhn", "v", "ints", br="b"), *_strides("o", "bhm", "out", "ints"),
    *_in_pack([dataclasses.replace(_TREE_STRIDES[0], br=True), _TREE_STRIDES[1]], "ints"),
    I("num_heads", host="hq", pack="ints"), I("seq_q", host="sq", pack="ints"), I("seq_k", host="sk", pack="ints"),
    *_HEAD, *_HEAD_V, C("BLOCK_M"), C("BLOCK_N"), C("GQA", br=True), _UPCAST, C("TMA"),
), packs={"scores": SCORE_LAUNCH, "blocks": _BLOCK_PACK})

# The backward ([Note] Backward tiles in triton/backward.py.j2): no sinks (their gradient is a host reduction).
_BWD_QKV_STRIDES = [*_strides("q", "bhm", "q", "qkv_strides", br="b"), *_strides("k", "bhn", "k", "qkv_strides"),
                    *_strides("v", "bhn", "v", "qkv_strides", br="b"), *_strides("do", "bhm", "do", "qkv_strides")]
_ROW_STATS = [T("Lse2", "fp32", host="lse2", divisible=always), T("Delta", "fp32", host="delta", divisible=always)]
_BWD_TAIL = [I("stride_sh", host="sq_pad", divisible=always), I("num_heads", host="hq"), I("seq_q", host="sq"),
             I("seq_k", host="sk")]
_BWD_SCALES = [F("qk_scale", host="qk_scale"), F("scale", host="scale"), *_SCORES, MOD_ARGS, *BLOCK_ARGS]

ATTN_BWD_PREPROCESS = Kernel("_attn_bwd_preprocess", (
    T("Out", host="out", divisible=always), T("DO", host="do", divisible=always),
    T("Lse", "fp32", host="lse", divisible=always), T("Delta", "fp32", host="delta", divisible=always),
    T("Lse2", "fp32", host="lse2", divisible=always), _LENGTHS[0], *_strides("o", "bhm", "out"),
    *_strides("do", "bhm", "do", br="m"), I("stride_sh", host="sq_pad", divisible=always),
    I("num_heads", host="hq"), I("seq_q", host="sq"),
    *_HEAD_DV, C("BLOCK_M", "DQ_BLOCK_M"), _UPCAST,
), warps="DQ_NUM_WARPS", stages="DQ_NUM_STAGES")

ATTN_BWD_DKDV = Kernel("_attn_bwd_dkdv", (
    T("Q", host="q", divisible=always), T("K", host="k", divisible=always), T("V", host="v", divisible=always),
    T("DO", host="do", divisible=always), T("DK", host="dk", divisible=always), T("DV", host="dv", divisible=always),
    *_ROW_STATS, *_LENGTHS, *_BWD_SCALES, *_BWD_QKV_STRIDES,
    *_strides("dk", "bhn", "dk", br="b"), *_strides("dv", "bhn", "dv"),
    dataclasses.replace(_TREE_STRIDES[0], br=True), _TREE_STRIDES[1], *_BWD_TAIL, MOD_GRAD_ARGS,
    *_HEAD_D, *_HEAD_DV, C("BLOCK_M", "DKDV_BLOCK_M"), C("BLOCK_N", "DKDV_BLOCK_N"), C("GQA", br=True), _UPCAST,
), packs={"scores": "scores", "blocks": _BLOCK_PACK, "mod_ws": "mod_ws"}, warps="DKDV_NUM_WARPS",
    stages="DKDV_NUM_STAGES")

ATTN_BWD_DQ = Kernel("_attn_bwd_dq", (
    T("Q", host="q", divisible=always), T("K", host="k", divisible=always), T("V", host="v", divisible=always),
    T("DO", host="do", divisible=always), T("DQ", host="dq", divisible=always),
    *_ROW_STATS, *_LENGTHS, *_BWD_SCALES, *_BWD_QKV_STRIDES,
    *_strides("dq", "bhm", "dq", br="b"), *_TREE_STRIDES, *_BWD_TAIL,
    *_HEAD_D, *_HEAD_DV, C("BLOCK_M", "DQ_BLOCK_M"), C("BLOCK_N", "DQ_BLOCK_N"), C("GQA", br=True), _UPCAST,
), packs={"scores": "scores", "blocks": _BLOCK_PACK}, warps="DQ_NUM_WARPS", stages="DQ_NUM_STAGES")

# Split-KV decode ([Note] Last split merges in triton/decode.py.j2): one kernel, whose last split merges.
DECODE_SPLIT = Kernel("_decode_split", (
    T("Q", host="q", fast="pq"), T("K", host="k", fast="pk"), T("V", host="v", fast="pv"),
    T("Dst", "fp32", host="dst", fast="pd"), T("DstLse", "fp32", host="dst_lse", fast="pdl"),
    T("Out", host="out", fast="po"), T("Lse", "fp32", host="lse", fast="pl"),
    T("Counter", "i32", host="tickets", fast="pc"), *_LENGTHS, F("qk_scale", host=SCALE_LOG2), *_KV_SCALES,
    *_SCORES, _SINKS, *_PAGING, MOD_ARGS,
    *_strides("q", "bhm", "qs", "split_ints", br="b", host="{src}[{i}]"),
    *_strides("k", "bhn", "ks", "split_ints", host="{src}[{i}]"),
    *_strides("v", "bhn", "vs", "split_ints", host="{src}[{i}]"),
    *_strides("d", "sbhm", "*dst_strides", "split_ints", br="s"), *_strides("l", "sbh", "", "split_ints"),
    *_strides("o", "bhm", "os_", "split_ints", br="b", host="{src}[{i}]"),
    *_strides("e", "bh", "ls", "split_ints", host="{src}[{i}]"),
    *_in_pack([dataclasses.replace(_TREE_STRIDES[0], br=True), _TREE_STRIDES[1]], "split_ints"),
    I("seq_q", host="sq", pack="split_ints"), I("seq_k", host="sk", pack="split_ints"),
    I("chunk", host="chunk", pack="split_ints"), I("n_tiles", host="n_tiles", pack="split_ints"),
    *_HEAD_D, *_HEAD_DV, C("ROWS", "rows"), C("BLOCK_N"), C("GQA", br=True), C("DOT", "rows >= 16"),
    C("DIRECT", "direct"), C("SPLITS_PER_SEQ", "num_splits[1] if invariant else 0"),
    _UPCAST, C("ROWS32", "_rows32(k, v)", when=paged_fp8_own_v),
), packs={"scores": SCORE_LAUNCH})

# -- the cuda and gluon forwards ----------------------------------------------------------------------------------
def _c_strides(prefix: str, dims: str, source: str) -> list[Arg]:
    return [dataclasses.replace(a, pack="strides", wide=True, divisible=None)
            for a in _strides(prefix, dims, source, br=dims[0])]


CUDA_FWD = Kernel("fagen_attn_fwd", (
    T("q", host="q"), T("k", host="k"), T("v", host="v"), T("out", host="out", written=True),
    T("lse", "fp32", host="lse", written=True, br=True), T("seqlens_q", "i32", host="seqlens_q"),
    T("seqlens_k", "i32", host="seqlens_k"), T("tree_bits", "i32", host="tree", br=True),
    *_c_strides("q", "bhm", "q"), *_c_strides("k", "bhn", "k"), *_c_strides("v", "bhn", "v"),
    *_c_strides("o", "bhm", "out"), *_c_strides("t", "bm", "*tree_strides"),
    I("num_heads", host="q.shape[1]", br=True), I("seq_q", host="q.shape[2]"), I("seq_k", host="k.shape[2]"),
    F("qk_scale_log2", host=SCALE_LOG2), *_SCORES[:4],
), packs={"strides": "(ctypes.c_int64(s) for s in strides)",
          "scores": "_score_params(scale, window_left, window_right, softcap, alibi_slopes, sinks)"})


def _gluon_scale(spec: KernelSpec) -> str:
    return "cap_out" if spec.softcap else SCALE_LOG2  # [Note] Gluon score switches


def _gluon_v(spec: KernelSpec) -> str:
    from fagen import backends  # [Note] fp8 V; with the in-kernel transpose V's rows, as K's
    if not fp8(spec):
        return "_descriptor(v, BLOCK_N)"
    return "_descriptor(vt, BLOCK_N)" if backends.GLUON.fp8_vt(spec) else "_descriptor(vt, HEAD_DIM, BLOCK_N)"


def gluon_sched(spec: KernelSpec) -> bool:
    """The gluon forward's tile counter ([Note] Tile schedule in fagen/templates/gluon/attention.py.j2)."""
    from fagen import backends

    return backends.GLUON.tile_schedule(spec)


_DESCALES = (T("QDescale", "fp32", when=fp8, host="qd"), T("KDescale", "fp32", when=fp8, host="kd"),
             T("VDescale", "fp32", when=fp8, host="vd"), I("qd_h", when=fp8, host="qd_h"),
             I("kd_h", when=fp8, host="kd_h"), I("vd_h", when=fp8, host="vd_h"))

GLUON_FWD = Kernel("_attn_fwd_hopper", (
    T("q_desc", host="_descriptor(q, BLOCK_M)"), T("k_desc", host="_descriptor(k, BLOCK_N)"),
    T("v_desc", host=_gluon_v), T("o_desc", host="_descriptor(o, BLOCK_M)"),
    T("Lse", "fp32", host="lse"), F("qk_scale", host=_gluon_scale), I("num_tiles", host="num_tiles"),
    I("n_m", host="n_m"), I("num_heads", host="hq"), I("seq_q", host="sq"), I("seq_k", host="sk"),
    T("SeqlensQ", "i32", when=padded, host="seqlens_q"), T("SeqlensK", "i32", when=padded, host="seqlens_k"),
    T("TileCounter", "i32", when=gluon_sched, host="tile_counter"),
    I("win_left", when=switched, host="win_left"), I("win_right", when=switched, host="win_right"),
    F("cap_in", when=switched, host=lambda spec: "0.0" if fp8(spec) else "cap_in"), *_DESCALES, MOD_ARGS,
    C("HEAD_DIM", br=True), C("BLOCK_M"), C("BLOCK_N"), C("STAGES"), C("GQA"), C("CAUSAL"), C("CONSUMER_REGS", br=True),
    C("LOADER_REGS"),
), warps="4", stages="", constexpr_type="gl.constexpr")

KERNELS = {k.name: k for k in (ATTN_FWD, ATTN_BWD_PREPROCESS, ATTN_BWD_DKDV, ATTN_BWD_DQ, DECODE_SPLIT, CUDA_FWD,
                               GLUON_FWD)}

# -- what the kernels thread through their @triton.jit helpers ----------------------------------------------------
_INNER_SCORES = (I("win_left", when=switched), I("win_right", when=switched), F("cap_in", when=switched),
                 F("cap_out", when=switched))
THREADED = {
    # the key-block loops of the forward and decode (_fwd_inner, _decode_inner), and the backward's dQ loop
    "fwd_inner": (*_INNER_SCORES, F("slope2", when=switched), T("table", "i32", when=paged),
                  I("stride_kb", when=paged), I("stride_vb", when=paged), I("page_shift", when=paged),
                  I("num_pages", when=paged)),
    "dq_inner": (*_INNER_SCORES, F("slope2", when=switched)),
    "dkdv_inner": (*_INNER_SCORES, T("slope_base", "fp32", when=switched)),
    # a user mod's captured values and block mask, threaded into the modded loops (_fwd_mod, _dq_mod, _dkdv_mod)
    "mods_inner": (MOD_ARGS, *_THREADED_BLOCKS),
    "mod_grads_inner": (MOD_GRAD_ARGS,),
    "decode_mods": (I("off_h", when=modded), MOD_ARGS),  # decode's _decode_inner: the rows' query heads, the mods
    "merge": (T("Sinks", "fp32", when=sinks),),  # decode's _merge_splits
    # and a padding mask's lengths ([Note] Gluon padding masks: every function that takes the score arguments)
    "gluon_scores": (*_INNER_SCORES[:3], T("SeqlensQ", "i32", when=padded), T("SeqlensK", "i32", when=padded)),
    "gluon_window": (I("win_left", when=window), I("win_right", when=window)),
    "gluon_sched": (T("TileCounter", "i32", when=gluon_sched),),  # [Note] Tile schedule
    "gluon_descales": _DESCALES,  # the fp8 consumers' descale pointers and head strides
    # a score_mod's captured values ([Note] Gluon score_mod): to the consumers, and with the tile's batch and query
    # head into _consumer_step and _softmax
    "gluon_mods": (MOD_ARGS,),
    "gluon_mod_step": (I("off_b", when=modded), I("off_h", when=modded), MOD_ARGS),
}

# -- the host's calling conventions -------------------------------------------------------------------------------
# [Note] Launch form. The checked inputs of one call, in the order every host function of a generated module takes
# them (_launch_forward, _launch_backward, the operators and their fakes, _call, _Attention): the mask inputs in
# the kernels' form, the score inputs in theirs (_check_scores), the layout's host ints and block table last.
OP_BASE = (T("q", grad="dq"), T("k", grad="dk if need_k else None"), T("v", grad="dv if need_v else None"),
           F("scale"), T("seqlens_q", optional=True), T("seqlens_k", optional=True), T("tree", optional=True))
OP_SCORES = (I("window_left", when=switched), I("window_right", when=switched), F("softcap", when=switched),
             T("alibi_slopes", "fp32", when=switched, real=alibi, optional=True),
             T("sinks", "fp32", when=switched, real=sinks, optional=True, grad="dsinks"))
OP_LAYOUT = (T("block_table", "i32", when=paged), I("max_seqlen_q", when=packed_q), I("max_seqlen_k", when=varlen))
OP_MODS = (Each(lambda spec: [dataclasses.replace(a, host="", br=False, grad=f"mod_grads[{a.name[2:]}]" if
                                                  a.kind == TENSOR else "") for a in _mod_args(spec)
                              if not (a.kind == INT and "_" in a.name)]),
           T("blk_cls", "i8", when=mask_modded, optional=True), T("blk_list", "i32", when=mask_modded, optional=True),
           T("blk_list_t", "i32", when=mask_modded, optional=True),
           I("blk_m", when=mask_modded), I("blk_n", when=mask_modded))
# an fp8 cache's scales in launch form (_check_kv_scales): floats, per-KV-head and per-token tensors or None
OP_KV = (F("k_scale", when=fp8_cache), F("v_scale", when=fp8_cache),
         T("k_scales", "fp32", when=fp8_cache, optional=True), T("v_scales", "fp32", when=fp8_cache, optional=True),
         T("k_tokens", "fp32", when=fp8_cache, optional=True), T("v_tokens", "fp32", when=fp8_cache, optional=True))
OP = OP_BASE + OP_SCORES + OP_LAYOUT + OP_KV + OP_MODS
# The backward's: dO first, the forward's out and lse after v.
OP_BWD = (T("do"),) + OP_BASE[:3] + (T("out"), T("lse")) + OP_BASE[3:] + OP_SCORES + OP_LAYOUT + OP_MODS


@dataclasses.dataclass(frozen=True)
class Keyword:
    """A keyword argument of the public functions (forward, backward, attention, Plan.run)."""

    name: str
    when: Pred = always
    default: str | None = "None"  # None: required
    switch: str = ""  # the score switch that takes this keyword


# The mask or layout keywords (README "Layouts"): dense specs take the mask inputs, the others their layout's.
MASK_KEYWORDS = (
    Keyword("seqlens_q", dense), Keyword("seqlens_k", dense), Keyword("tree_mask", dense),
    Keyword("cu_seqlens_q", packed_q, None), Keyword("cu_seqlens_k", varlen, None),
    Keyword("max_seqlen_q", packed_q, None), Keyword("max_seqlen_k", varlen, None),
    Keyword("block_table", paged, None), Keyword("seqlens_k", paged, None), Keyword("tree_mask", paged_tree, None),
)
# The score keywords (README "Score modifiers"): a spec with any switch takes all four, None for those it lacks.
SCORE_KEYWORDS = (Keyword("window", switched, switch="window"), Keyword("softcap", switched, switch="softcap"),
                  Keyword("alibi_slopes", switched, switch="alibi"), Keyword("sinks", switched, switch="sinks"))
SWITCH_KEYWORD = {kw.switch: kw.name for kw in SCORE_KEYWORDS}  # "alibi" -> "alibi_slopes"
# A modded spec's: the captured values by the user's names, and a block mask (README "User mods").
MOD_KEYWORDS = (Keyword("mods", modded), Keyword("block_mask", mask_modded))
# An fp8 cache's scales (README "Serving"): a float, float32 [Hkv] or float32 per token each, 1.0 when left out.
KV_KEYWORDS = (Keyword("k_scale", fp8_cache), Keyword("v_scale", fp8_cache))

LISTS = {"op": OP, "op_bwd": OP_BWD, "op_scores": OP_SCORES, "op_layout": OP_LAYOUT, "op_mods": OP_MODS,
         "mod_keywords": MOD_KEYWORDS, "mask_keywords": MASK_KEYWORDS, "score_keywords": SCORE_KEYWORDS,
         "kv_keywords": KV_KEYWORDS, "op_kv": OP_KV, **THREADED}
