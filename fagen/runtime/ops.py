"""fagen.attention under torch.compile: the generated module picked while tracing, then traced like a direct call.

Dynamo traces fagen.attention into the module's own operators (fagen::<module>_fwd, _fwd_out, _bwd; [Note] Operators
in fagen/templates/host/ops.py.j2) with that module's autograd around them: no graph break, and no recompile when a
sequence length changes (the operators' fake outputs follow the input shapes).

[Note] One autograd, also under torch.compile. The module a call needs depends on values Dynamo holds as constants
(dtype, head dims, head counts, mask, decode, the score switches), but finding it renders, compiles or reads a cache,
which Dynamo cannot trace. _module_name runs that search once per trace, outside the trace
(torch.compiler.assume_constant_result), and returns the module's name, a str constant; the module itself is then a
lookup in _MODULES that Dynamo traces and guards. The call goes on as an eager one does: module.attention(), whose
autograd.Function (_Attention, [Note] One autograd in templates/triton/backward.py.j2) is the only autograd, or
module.forward() for decode. Up to commit da5a5b3 this was a custom operator fagen::attention with an autograd of
its own (its backward resolved the module again at run time), because returning the module itself from
assume_constant_result fails inside Dynamo on torch 2.13 (InternalTorchDynamoError: NotImplementedError, from the
constant's guard); a str constant has a guard Dynamo can build. The arguments must be Python constants too: see
_static for the symbolic ints of torch.compile(dynamic=True).

[Note] Gluon backward under torch.compile. An eager call with gradients takes the gluon bwd module on an H100/H200
from hopper.BWD_MIN_WORK pairs ([Note] Hopper selection). The traced call makes the same choice: fagen.attention
computes big_bwd from the traced sizes (a Python bool: with symbolic sizes a guard on B x Hq x Sq x Sk, so a
length that crosses the floor retraces), and _module_name resolves with it on the inputs' device (meta tensors
carry none). The gluon module's operators (fagen::<module>_fwd, _bwd, _bwd_unordered) then trace like the Triton
module's; deterministic=False reaches module.attention only where hopper.unordered says the unordered adds won, as
in eager mode. _module_name also runs the module's device check once, outside the trace, so the traced check reads
its kept capability instead of querying the device.
"""

from __future__ import annotations

from types import ModuleType

import torch

from fagen.codegen.args import SWITCH_KEYWORD
from fagen.runtime import hopper
from fagen.runtime.resolve import resolve
from fagen.spec.axes import DECODE_BATCH_INVARIANT
from fagen.spec.kernel import SCORE_SWITCHES

_MODULES: dict[str, ModuleType] = {}  # module name -> module, for traced calls ([Note] One autograd, ...)
_UNORDERED: set[str] = set()  # the names of modules that take deterministic=False (hopper.unordered)


@torch.compiler.assume_constant_result
def _module_name(dtype: torch.dtype, head_dim: int, head_dim_v: int, heads_q: int, heads_kv: int, mask: str,
                 decode: bool, switches: tuple[str, ...], big_bwd: bool = False, device: str = "meta") -> str:
    """resolve() for inputs of these static properties (meta tensors stand in; big_bwd and `device` as resolve()
    takes them: [Note] Gluon backward under torch.compile); the module's name, kept in _MODULES."""
    def meta(heads, dim):
        return torch.empty((1, heads, 1, dim), dtype=dtype, device="meta")

    module = resolve(meta(heads_q, head_dim), meta(heads_kv, head_dim), meta(heads_kv, head_dim_v), mask, decode,
                     switches, big_bwd=big_bwd and not decode, device=torch.device(device))
    if hopper.unordered(module):
        _UNORDERED.add(module.__name__)
    if big_bwd and hasattr(module, "_check_device") and device.startswith("cuda"):
        module._check_device(torch.empty(0, device=device))  # reads (and keeps) the capability outside the trace
    _MODULES[module.__name__] = module
    return module.__name__


def _static(n) -> int:
    """n as a Python int while Dynamo traces: formatting a symbolic int specializes it (a guard n == value), where
    int(n) would stay symbolic and assume_constant_result refuses it. Head dims and head counts pick the kernel, so a
    new value retraces anyway."""
    return int(f"{n}")


def attention(q, k, v, mask: str, scale, seqlens_q, seqlens_k, tree_mask, decode: bool, window=None, softcap=None,
              alibi_slopes=None, sinks=None, batch_invariant: bool = DECODE_BATCH_INVARIANT, big_bwd: bool = False,
              deterministic: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of fagen.attention while Dynamo traces it; window is [left, right] with -1 for an unbounded side;
    big_bwd, deterministic: fagen.attention's choice of the gluon backward and its keyword."""
    scores = {name: value for name, value in (("softcap", softcap), ("alibi_slopes", alibi_slopes), ("sinks", sinks))
              if value is not None}
    if window is not None:
        scores["window"] = tuple(None if w < 0 else w for w in window)
    switches = tuple(name for name in SCORE_SWITCHES if SWITCH_KEYWORD[name] in scores)
    decode = True if decode else False  # a branch makes a symbolic bool (prefers_decode of dynamic lengths) a constant
    dims = (_static(n) for n in (q.shape[-1], v.shape[-1], q.shape[1], k.shape[1]))
    name = _module_name(q.dtype, *dims, mask, decode, switches, big_bwd, str(q.device) if big_bwd else "meta")
    module = _MODULES[name]
    kw = dict(scale=scale, seqlens_q=seqlens_q, seqlens_k=seqlens_k, tree_mask=tree_mask, **scores)
    if decode:  # the module's operator carries the mode (num_splits: [Note] Batch-invariant splits in decode.py.j2)
        return module.forward(q, k, v, batch_invariant=batch_invariant, **kw)
    if deterministic is False and name in _UNORDERED:  # the gluon backward's unordered dQ adds, where they won
        return module.attention(q, k, v, deterministic=False, **kw), None
    out = module.attention(q, k, v, **kw)
    return out, None  # fagen.attention returns out only; the bwd module's attention() keeps lse for its backward

