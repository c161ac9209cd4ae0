"""Render the block-classification kernel of a mask_mod (templates/triton/block_mask.py.j2) from its tree."""

from __future__ import annotations

import functools

from fagen import __version__, files
from fagen.codegen.mod_args import ModArgs
from fagen.codegen.render import environment
from fagen.mods import ir
from fagen.mods.emit import TRITON_HELPERS, to_triton
from fagen.mods.text import canonical, parse

# to_triton's names for the mask's inputs inside _block_classes
_INPUTS = {"b": "off_b", "h": "off_h", "q_idx": "rows[:, None]", "kv_idx": "cols[None, :]"}


@functools.lru_cache(maxsize=256)
def block_mask_source(mask_mod: str, tensors: tuple = (), scalars: tuple = ()) -> str:
    """The source of a module with `_block_classes` for this mask_mod text (validated as a spec's fields are).
    tensors / scalars: the declarations of what the mask reads, as in a KernelSpec."""
    _, text, tensors, scalars = canonical(None, mask_mod, tensors, scalars)
    tree = parse(text, "mask_mod", tensors, scalars)
    args = ModArgs(tensors, scalars)
    expr = to_triton(tree, {**_INPUTS, **args.refs()})
    if isinstance(tree, ir.Const):  # a constant mask (noop_mask): broadcast it over the tile
        expr = f"tl.full([BLOCK_M, BLOCK_N], {expr}, tl.int1)"
    return environment().get_template("triton/block_mask.py.j2").render(
        version=__version__, digest=files.digest(text, repr(tensors), repr(scalars))[:12], text=text,
        legend=args.legend(), helpers=TRITON_HELPERS, params=args.params(),
        no_specialize=['"%s"' % p for p in args.no_specialize()], expr=expr)


def reads(mask_mod: str, tensors: tuple = (), scalars: tuple = ()) -> frozenset:
    """The inputs (b, h, q_idx, kv_idx) the mask reads: a mask without b or h is evaluated once for all of them."""
    _, text, tensors, scalars = canonical(None, mask_mod, tensors, scalars)
    return frozenset(n.name for n in ir.walk(parse(text, "mask_mod", tensors, scalars)) if isinstance(n, ir.Input))
