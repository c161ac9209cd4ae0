"""Which generated module serves fagen.attention's inputs: validated once per input kind, then one dict lookup."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from fagen.runtime import hopper
from fagen.runtime.loader import load
from fagen.spec import tables
from fagen.spec.axes import Direction, Kind, Layout, Mask
from fagen.spec.kernel import KernelSpec, SpecError

_DTYPES = {getattr(torch, name): dtype for dtype, name in tables.TORCH_DTYPE.items()}


class AttentionError(ValueError):
    """The inputs of fagen.attention fit no kernel fagen can generate; the message says what and how to fix it."""


# (dtype, head_dim, q heads, kv heads, mask, decode, switches, forward_only, device, v's head_dim, big_bwd) -> module; fagen.attention
# builds the same key inline (fagen/runtime/api.py), tests/test_launch.py checks a warm call resolves nothing.
_FAST: dict[tuple, ModuleType] = {}


def fast_key(q, k, v, mask, decode: bool, switches: tuple[str, ...], forward_only: bool,
             big_bwd: bool = False) -> tuple:
    return (q.dtype, q.shape[-1], q.shape[1], k.shape[1], mask, decode, switches, forward_only, q.device, v.shape[-1],
            big_bwd)


def resolve(q, k, v, mask, decode: bool, switches: tuple[str, ...] = (), forward_only: bool = False,
            big_bwd: bool = False, device: torch.device | None = None) -> ModuleType:
    """The module that serves these inputs, memoised in _FAST: the decode kernel, the bwd (differentiable) kernel,
    or, with forward_only (no gradient, not decode) on sm_90, the Gluon forward where it wins
    ([Note] Hopper selection in fagen/runtime/hopper.py; that module has forward() only); with big_bwd (gradients,
    at least hopper.BWD_MIN_WORK pairs) on sm_90, the gluon bwd module where its backward wins.
    switches: the score switches the call uses ("window", "softcap", "alibi", "sinks"); device: the device these
    choices read in place of q's (fagen/runtime/ops.py resolves for meta tensors while Dynamo traces)."""
    spec = spec_for(q, k, v, mask=mask, switches=switches)
    if decode:
        spec = KernelSpec(head_dim=spec.head_dim, head_dim_v=spec.head_dim_v, mask=spec.mask, gqa=spec.gqa,
                          dtype=spec.dtype, kind=Kind.DECODE, **{name: True for name in switches})
    elif forward_only:
        spec = hopper.forward_spec(spec, device or q.device) or spec
    elif big_bwd:
        spec = hopper.backward_spec(spec, device or q.device, big_bwd == 2) or spec  # 2: deterministic=False
    module = _module(spec)
    _FAST[fast_key(q, k, v, mask, decode, switches, forward_only, big_bwd)] = module
    return module


def resolve_varlen(q, k, v, mask, switches: tuple[str, ...] = ()) -> ModuleType:
    """The varlen bwd module for packed q [total_q, Hq, D], k/v [total_k, Hkv, D] (README "Layouts")."""
    key = ("varlen", q.dtype, q.shape[-1], q.shape[1], k.shape[1], mask, switches, v.shape[-1]) \
        if all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (q, k, v)) else None
    module = _FAST.get(key) if key is not None else None
    if module is None:
        module = _module(spec_for(q, k, v, mask=mask, switches=switches, layout=Layout.VARLEN))
        _FAST[key] = module
    return module


def spec_for(q, k, v, *, mask: Mask | str = "none", switches: tuple[str, ...] = (),
             layout: Layout = Layout.DENSE) -> KernelSpec:
    """The bwd (differentiable) spec whose kernel runs attention on these inputs."""
    dims = ("4 dims [batch, heads, seq, head_dim]" if layout is Layout.DENSE
            else "3 dims [total, heads, head_dim] (packed sequences)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise AttentionError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != (4 if layout is Layout.DENSE else 3):
            raise AttentionError(f"{name}: expected {dims}, got shape {tuple(t.shape)}")
    if q.dtype not in _DTYPES:
        raise AttentionError(f"q: dtype {q.dtype} is not supported; use torch.float16, torch.bfloat16 or "
                             "torch.float32")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise AttentionError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if k.shape[-1] != q.shape[-1]:
        raise AttentionError(f"head_dim: q has {q.shape[-1]} and k {k.shape[-1]}; they must agree (v's may differ: "
                             "out takes v's head dim)")
    hq, hkv = q.shape[-3 if layout is Layout.DENSE else -2], k.shape[-3 if layout is Layout.DENSE else -2]
    if hkv == 0 or hq % hkv:
        raise AttentionError(f"heads: q has {hq} heads and k/v have {hkv}; q's heads must be a multiple of k/v's "
                             "(gqa = q heads / kv heads)")
    try:
        mask = Mask(mask)
    except ValueError:
        raise AttentionError(f"mask: got {mask!r}; must be one of " + ", ".join(map(repr, Mask.choices()))) from None
    try:
        return _bwd_spec(q.shape[-1], v.shape[-1], mask, hq // hkv, _DTYPES[q.dtype], layout, tuple(switches))
    except SpecError as e:
        raise AttentionError(f"no kernel for these inputs: {e}") from None


@functools.lru_cache(maxsize=1024)
def _bwd_spec(head_dim: int, head_dim_v: int, mask: Mask, gqa: int, dtype, layout: Layout,
              switches: tuple[str, ...]) -> KernelSpec:
    """spec_for's spec, built (validated, tiles resolved) once per input kind: the modded path calls spec_for on
    every call to check its inputs, and a KernelSpec's validation is most of a warm call's host time."""
    return KernelSpec(head_dim=head_dim, head_dim_v=head_dim_v, mask=mask, gqa=gqa, dtype=dtype,
                      direction=Direction.BWD, layout=layout, **{name: True for name in switches})


@functools.lru_cache(maxsize=None)
def _module(spec: KernelSpec) -> ModuleType:
    return load(spec)  # load() also memoises, but first renders the spec to key it: this skips that per call
