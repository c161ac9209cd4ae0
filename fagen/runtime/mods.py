"""User mods at call time: trace a score_mod / mask_mod once, then find the trace again in a dict and re-read the
closure's current numbers and tensors, so a changed closure scalar is a new argument, never a new trace or kernel.

[Note] Trace cache. A call looks its functions up twice at most:
  1. by identity: the same function objects as an earlier call (a model that builds its mods once) cost one dict
     lookup, then `read_captures` walks the recorded paths to the current values (a cell whose number changed is
     read again, not traced again);
  2. by shape: a new function object of the same code, closing over values of the same kinds (the factory
     pattern, `generate_sliding_window(w)` called per step), matches an earlier trace whose paths then read the
     new function's values. The shape is the code objects, recursively through the closure cells, defaults,
     globals, tuples and lists the tracer follows, with each number replaced by its type, each bool by its value
     (it may steer the function), each tensor by (dtype, rank) and anything else by its identity.
A trace is redone only when a value changes kind (read_captures returns None: int to float, a tensor's dtype or
rank): the new kinds give a new declaration, so a new spec and kernel, as they must. Not seen: a bool or a number
reached through an attribute that changes after the first call on the same function object (they are constants of
the trace); build a new function for those.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

from fagen.mods.trace import Traced, read_captures, trace

_MAX = 512  # entries per level; past it the level is cleared (mods are few per model)


@dataclasses.dataclass(frozen=True)
class Mods:
    """One call's mods: the trace (its trees and declarations), the spec fields and the current captured values."""

    traced: Traced
    fields: tuple  # (score_mod text, mask_mod text, tensors, scalars): the KernelSpec's mod fields
    values: dict[str, Any]

    @property
    def key(self) -> tuple:
        return self.fields


_BY_ID: dict[tuple, tuple] = {}  # (score_mod, mask_mod) -> (traced, fields); keeps the functions alive
_BY_SHAPE: dict[tuple, tuple] = {}
TRACES = [0]  # how many traces this process ran (tests read it: a warm call traces nothing)


def prepare(score_mod=None, mask_mod=None) -> Mods:
    """The Mods of these functions: traced on first sight, then from the cache ([Note] Trace cache)."""
    hit = _BY_ID.get((score_mod, mask_mod))
    if hit is not None:
        values = read_captures(hit[0], score_mod=score_mod, mask_mod=mask_mod)
        if values is not None:
            return Mods(hit[0], hit[1], values)
    keep: list = []  # what the shape names by identity, kept alive with the entry so that no id is reused
    shape = (_shape(score_mod, 0, keep), _shape(mask_mod, 0, keep))
    hit = _BY_SHAPE.get(shape)
    if hit is not None:
        values = read_captures(hit[0], score_mod=score_mod, mask_mod=mask_mod)
        if values is not None:
            _remember(_BY_ID, (score_mod, mask_mod), hit[:2])
            return Mods(hit[0], hit[1], values)
    traced = trace(score_mod=score_mod, mask_mod=mask_mod)
    TRACES[0] += 1
    entry = (traced, (traced.score_text, traced.mask_text, traced.tensors, traced.scalars))
    _remember(_BY_ID, (score_mod, mask_mod), entry)
    _remember(_BY_SHAPE, shape, (*entry, keep))
    return Mods(traced, entry[1], dict(traced.values))


def _remember(level: dict, key, entry) -> None:
    if len(level) >= _MAX:
        level.clear()
    level[key] = entry


def _shape(value, depth: int, seen: list):
    """The trace-relevant shape of a captured value ([Note] Trace cache); `seen` keeps functions met on the way.
    Written for speed: a factory's new function object (a changed closure number) is shaped on every call."""
    if value is None or value is True or value is False:
        return value
    kind = type(value)
    if kind is int or kind is float:
        return _NUMBER[kind]
    if kind is types.FunctionType:
        if depth >= 16 or any(value is f for f in seen):
            return ("fn", id(value))
        seen.append(value)
        code, closure, defaults, kwdefaults = value.__code__, value.__closure__, value.__defaults__, \
            value.__kwdefaults__
        d = depth + 1
        cells = tuple([_cell(c, depth, seen) for c in closure]) if closure else ()
        defaults = tuple([_shape(x, d, seen) for x in defaults]) if defaults else ()
        kw = tuple(sorted((k, _shape(x, d, seen)) for k, x in kwdefaults.items())) if kwdefaults else ()
        names = _names(code)
        if names:
            g = value.__globals__
            glob = tuple([(n, _shape(g[n], d, seen)) for n in names
                          if n in g and type(g[n]) is not types.ModuleType])
        else:
            glob = ()
        return ("fn", code, cells, defaults, kw, glob)
    if isinstance(value, bool):  # a bool subclass (numpy's is not one): its value
        return bool(value)
    if isinstance(value, (int, float)):  # a subclass of int or float: its own type's name
        return kind.__name__
    if (kind is tuple or kind is list or isinstance(value, (tuple, list))) and len(value) <= 64 and depth < 16:
        return (kind.__name__ if kind in (tuple, list) else type(value).__name__,
                *[_shape(v, depth + 1, seen) for v in value])
    dtype = getattr(value, "dtype", None)
    if dtype is not None and hasattr(value, "dim") and kind.__module__.startswith("torch"):
        return ("tensor", dtype, value.dim())
    seen.append(value)
    return ("id", id(value))  # any other object: itself


_NUMBER = {int: "int", float: "float"}


def _cell(cell, depth: int, seen: list):
    try:
        return _shape(cell.cell_contents, depth + 1, seen)
    except ValueError:  # an empty cell
        return ("empty",)


_NAMES: dict = {}


def _names(code: types.CodeType) -> tuple:
    """The global names a code object (and the code nested in it) reads, sorted; memoised per code object."""
    names = _NAMES.get(code)
    if names is None:
        found, stack = set(), [code]
        while stack:
            c = stack.pop()
            found.update(c.co_names)
            stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
        names = _NAMES[code] = tuple(sorted(found))
    return names
