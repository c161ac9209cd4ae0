"""A spec's mods as Python functions for the float64 reference, and the captured values a verify problem draws.

`fagen verify` has the spec's text, not the user's functions, so the reference runs functions built here from the
parsed trees: each node is one torch operation on 0-dim tensors (vmapped by fagen.verify.mods_reference, as the
user's own functions are). Nothing here touches the Triton emitter. A captured tensor is read as the contract says
(README "User mods"): torch's indexing for -n <= i < n, the nearest end outside it.
"""

from __future__ import annotations

import torch

from fagen.mods import ir
from fagen.mods.text import ModScalar, ModTensor, parse

_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "i64": torch.int64,
                 "i32": torch.int32, "i16": torch.int16, "i8": torch.int8, "u8": torch.uint8, "bool": torch.bool}
_UNARY = {"neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "exp2": torch.exp2, "log": torch.log,
          "tanh": torch.tanh, "sigmoid": torch.sigmoid, "sqrt": torch.sqrt}
_BINARY = {"+": torch.add, "-": torch.sub, "*": torch.mul, "/": torch.true_divide, "//": torch.floor_divide,
           "%": torch.remainder, "&": torch.bitwise_and, "|": torch.bitwise_or, "<": torch.lt, "<=": torch.le,
           ">": torch.gt, ">=": torch.ge, "==": torch.eq, "!=": torch.ne, "minimum": torch.minimum,
           "maximum": torch.maximum}


class ModValues(dict):
    """The captured values by name (what a modded module's `mods=` takes), with the spec's mods as functions over
    them (what the reference's score_mod= / mask_mod= take)."""

    score_mod = None
    mask_mod = None
    positions = "row"  # the reference's mod_positions: "absolute" for a decode spec's values


def _function(tree: ir.Node, values: dict, score: bool):
    def value(n: ir.Node, env: dict):
        if isinstance(n, ir.Input):
            return env[n.name]
        if isinstance(n, ir.Const):
            return torch.tensor(n.value, dtype=torch.float64 if n.type == ir.FLOAT else
                                torch.bool if n.type == ir.BOOL else torch.int64)
        if isinstance(n, ir.Scalar):
            return torch.tensor(values[n.name], dtype=torch.float64 if n.type == ir.FLOAT else torch.int64)
        if isinstance(n, ir.Load):
            t = values[n.name]
            for idx in n.index:  # torch's indexing where defined, the nearest end outside it
                size = t.shape[0]
                i = value(idx, env).long()
                t = t.to(i.device)  # the reference runs where q is (the kernels' device on a GPU); values kept on cpu
                i = torch.where(i < 0, i + size, i).clamp(0, size - 1)
                t = torch.index_select(t, 0, i.reshape(1)).squeeze(0)
            return t.double() if n.type == ir.FLOAT else t.long() if n.type == ir.INT else t.bool()
        if isinstance(n, ir.Where):
            return torch.where(value(n.cond, env), *(_as(value(c, env), n.type) for c in (n.a, n.b)))
        if isinstance(n, ir.Clamp):
            x, lo, hi = (_as(value(c, env), n.type) for c in (n.x, n.lo, n.hi))
            return torch.minimum(torch.maximum(x, lo), hi)
        if isinstance(n, ir.Unary):
            x = value(n.x, env)
            if n.op == "invert":
                return ~x if n.type != ir.FLOAT else None
            return _UNARY[n.op](_as(x, n.type) if n.op not in ("neg", "abs") else x)
        want = ir.FLOAT if n.op == "/" else n.type
        a, b = value(n.a, env), value(n.b, env)
        if n.op in ir.COMPARE:
            common = ir.FLOAT if ir.FLOAT in (n.a.type, n.b.type) else ir.INT
            return _BINARY[n.op](_as(a, common), _as(b, common))
        return _BINARY[n.op](_as(a, want), _as(b, want))

    if score:
        return lambda s, b, h, q_idx, kv_idx: value(tree, dict(score=s, b=b, h=h, q_idx=q_idx, kv_idx=kv_idx))
    return lambda b, h, q_idx, kv_idx: value(tree, dict(b=b, h=h, q_idx=q_idx, kv_idx=kv_idx))


def _as(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == ir.FLOAT:
        return x.double()
    if kind == ir.INT:
        return x.long()
    return x


def mod_values(spec, seed: int, max_seq: int, heads: int, batch: int, device) -> ModValues:
    """Captured values for a modded spec, drawn from `seed`: float tensors normal (x 0.5), int tensors sorted
    non-negative ids and lengths below max_seq (document ids, prefix lengths), bools at random; each dimension of
    1 to 2 max_seq + 1 entries; int scalars in [0, max_seq], float scalars in [0.5, 8]. With the functions of the
    spec's trees over them."""
    gen = torch.Generator().manual_seed(seed * 7919 + 1)
    tensors = tuple(ModTensor(*t) for t in spec.mod_tensors)
    scalars = tuple(ModScalar(*s) for s in spec.mod_scalars)
    out = ModValues()
    for t in tensors:
        shape = [int(torch.randint(1, 2 * max_seq + 2, (1,), generator=gen)) for _ in range(t.rank)]
        dtype = _TORCH_DTYPES[t.dtype]
        if dtype.is_floating_point:
            x = torch.randn(shape, generator=gen) * 0.5
        elif dtype == torch.bool:
            x = torch.rand(shape, generator=gen) < 0.5
        else:
            top = min(max_seq + 1, 127 if dtype in (torch.int8,) else 255 if dtype == torch.uint8 else max_seq + 1)
            x = torch.randint(0, max(top, 1), shape, generator=gen)
            x = x.sort(-1).values if t.rank else x
        out[t.name] = x.to(dtype).to(device)
    for s in scalars:
        out[s.name] = int(torch.randint(0, max_seq + 1, (1,), generator=gen)) if s.type == ir.INT else \
            float(torch.empty(1).uniform_(0.5, 8.0, generator=gen))
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}
    if spec.score_mod is not None:
        out.score_mod = _function(parse(spec.score_mod, "score_mod", tensors, scalars), cpu, True)
    if spec.mask_mod is not None:
        out.mask_mod = _function(parse(spec.mask_mod, "mask_mod", tensors, scalars), cpu, False)
    return out
