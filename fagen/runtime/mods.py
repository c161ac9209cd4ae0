"""User mods at call time: trace a score_mod / mask_mod once, then find the trace again by its code and the kinds of
what it closes over, and read the closure's current numbers and tensors, so a changed closure scalar is a new
argument, never a new trace or kernel.

[Note] Trace cache. Traces are kept per pair of code objects (score_mod's, mask_mod's), a few per pair, each with a
guard: a flat list of steps, made once from the traced functions, that walks what the tracer followed (closure
cells, defaults, kwdefaults, the globals the code reads, tuples and lists of functions) in the tracer's order and
checks each value it reaches:
  - a function: the same code object, the same globals dict, as many defaults and the same kwdefault names (then
    its own cells, defaults, kwdefaults and globals are walked in turn); one reached again (shared, recursive):
    the same object as before;
  - an int or float: the same type (its value is free: a runtime scalar); a bool, None, or any other object
    (whose attributes the trace read as constants): the same object;
  - a tensor: a tensor of the same dtype and rank (a tensor the trace reached twice: the same object again, as the
    trace made it one argument); a tuple or list: the same type and length (then its items);
  - a closure cell that two functions share at the trace (one scalar there): shared again.
The steps are compiled once into a Python function (`_compile`: its source names slots and holds integers only;
the code objects, dicts, types and names it compares with are constants of its namespace, never pasted), about
0.2-0.9 us a guard on a CPU. Every call runs the guard, whether its functions are the traced objects themselves (a
model that builds its mods once, a `nonlocal` or global number changed between calls) or new objects of the same
code (attention-gym's factories, `generate_sliding_window(w)` called per step), so the two cost the same; the
values the trace declared (runtime scalars, captured tensors) are read out of the walk by position. A step that
fails (a number changed type, a bool changed, a function or global replaced, another tensor dtype or rank) tries
the next trace of the pair, then traces again: a new trace gives new declarations or a new tree, so a new spec and
kernel, as it must. Not seen, as the tracer does not follow them either: a number or bool reached through an
object's attribute or a dict (a constant of the trace; the object itself is checked by identity), a module global
(`torch`) replaced, a global that shadows a builtin defined after the trace. Build a new function for those.
tests/test_mods_trace_cache.py breaks each check and counts the traces.
"""

from __future__ import annotations

import types
from typing import Any, NamedTuple

from fagen.mods.trace import Traced, trace

_MAX_KEYS = 512  # pairs of code objects; past it the cache is cleared (mods are few per model)
_PER_KEY = 8  # traces kept per pair (kinds or bools that differ), the most recent first
_FN = types.FunctionType


class Mods(NamedTuple):  # a tuple: built on every call, where a frozen dataclass costs about half a microsecond
    """One call's mods: the trace (its trees and declarations), the spec fields and the current captured values."""

    traced: Traced
    fields: tuple  # (score_mod text, mask_mod text, tensors, scalars): the KernelSpec's mod fields
    values: dict[str, Any]

    @property
    def key(self) -> tuple:
        return self.fields


class _Entry:
    __slots__ = ("guard", "names", "steps", "traced", "fields", "keep")

    def __init__(self, guard, names, steps, traced, fields, keep):
        self.guard, self.names, self.steps, self.traced, self.fields, self.keep = guard, names, steps, traced, \
            fields, keep


_CACHE: dict[tuple, list[_Entry]] = {}
TRACES = [0]  # how many traces this process ran (tests read it: a warm call traces nothing)
GUARDS = [0]  # how many guards were built (one per trace whose paths the guard found)


def clear() -> None:
    _CACHE.clear()


def prepare(score_mod=None, mask_mod=None) -> Mods:
    """The Mods of these functions: from the trace cache, or traced ([Note] Trace cache)."""
    key = (score_mod.__code__ if type(score_mod) is _FN else id(score_mod),  # another callable: by identity (kept alive)
           mask_mod.__code__ if type(mask_mod) is _FN else id(mask_mod))
    entries = _CACHE.get(key)
    if entries:
        for e in entries:
            got = e.guard(score_mod, mask_mod)
            if got is not None:
                return Mods(e.traced, e.fields, dict(zip(e.names, got)))
    traced = trace(score_mod=score_mod, mask_mod=mask_mod)
    TRACES[0] += 1
    fields = (traced.score_text, traced.mask_text, traced.tensors, traced.scalars)
    built = _build(score_mod, mask_mod, traced)
    if built is not None:  # else (a path the guard did not walk): not cached, traced on every call
        if entries is None:
            if len(_CACHE) >= _MAX_KEYS:
                _CACHE.clear()
            entries = _CACHE[key] = []
        steps, reads, keep = built
        guard = _compile(steps, tuple(slot for _, slot in reads))
        entries.insert(0, _Entry(guard, tuple(name for name, _ in reads), steps, traced, fields, keep))
        del entries[_PER_KEY:]
    return Mods(traced, fields, dict(traced.values))


# -- guards ----------------------------------------------------------------------------------------------------------
# A step is (source slot, op, key, check, want): it reads a value from the source slot's value by op and key, checks
# it, and is the next slot (slot 0: score_mod, 1: mask_mod; step i: slot i + 2). _compile makes them a function.
_SELF, _CELL, _CELLOBJ, _GLOBAL, _DEFAULT, _KWDEFAULT, _ITEM = range(7)
_TYPE, _IS, _FUNC, _TENSOR, _SEQ, _SAME, _EMPTY, _ANY = range(8)
_ABSENT = object()  # a global the guard reads that is gone from its module (a miss)


def _compile(steps: tuple, read: tuple):
    """A guard's steps as one Python function (score_mod, mask_mod) -> the values at the slots `read`, or None where
    a check fails ([Note] Trace cache): a few times faster than a loop over the steps. Its source holds only our
    own names and integers; every value (code objects, dicts, types, names) is a constant of its namespace."""
    import torch

    ns = {"FN": _FN, "ABSENT": _ABSENT, "TENSOR": torch.Tensor}
    lines = []
    for i, (src, op, key, check, want) in enumerate(steps):
        s, x = f"s{int(src)}", f"s{i + 2}"
        if op == _CELL:
            read_x = f"{s}.__closure__[{int(key)}].cell_contents"
        elif op == _GLOBAL:
            ns[f"GD{i}"], ns[f"GN{i}"] = key
            read_x = f"GD{i}.get(GN{i}, ABSENT)"
        elif op == _ITEM:
            read_x = f"{s}[{int(key)}]"
        elif op == _SELF:
            read_x = s
        elif op == _DEFAULT:
            read_x = f"{s}.__defaults__[{int(key)}]"
        elif op == _KWDEFAULT:
            ns[f"KN{i}"] = key
            read_x = f"{s}.__kwdefaults__[KN{i}]"
        else:  # _CELLOBJ
            read_x = f"{s}.__closure__[{int(key)}]"
        lines.append(f"{x} = {read_x}")
        if check in (_TYPE, _IS):
            ns[f"W{i}"] = want
            lines.append(f"if {'type(' + x + ')' if check == _TYPE else x} is not W{i}: return None")
        elif check == _FUNC:
            ns[f"FC{i}"], ns[f"FG{i}"] = want[0], want[1]
            lines.append(f"if type({x}) is not FN or {x}.__code__ is not FC{i} or {x}.__globals__ is not FG{i}: "
                         "return None")
            lines.append(f"if len({x}.__defaults__ or ()) != {int(want[2])}: return None")
            if want[3] is None:
                lines.append(f"if {x}.__kwdefaults__: return None")
            else:
                ns[f"FK{i}"] = want[3]
                lines.append(f"if ({x}.__kwdefaults__ or {{}}).keys() != FK{i}: return None")
        elif check == _TENSOR:
            ns[f"TD{i}"] = want[1]
            lines.append(f"if not isinstance({x}, TENSOR) or {x}.dtype != TD{i} or {x}.dim() != {int(want[2])}: "
                         "return None")
        elif check == _SEQ:
            ns[f"ST{i}"] = want[0]
            lines.append(f"if type({x}) is not ST{i} or len({x}) != {int(want[1])}: return None")
        elif check == _SAME:
            lines.append(f"if {x} is not s{int(want)}: return None")
        elif check == _EMPTY:
            lines += ["try:", f"    {x}.cell_contents", "except ValueError:", "    pass", "else:", "    return None"]
    body = "".join(f"\n        {line}" for line in lines) or "\n        pass"
    source = (f"def guard(s0, s1):\n    try:{body}\n"
              "    except (AttributeError, IndexError, KeyError, TypeError, ValueError):\n        return None\n"
              f"    return ({''.join(f's{int(slot)}, ' for slot in read)})\n")
    exec(compile(source, "<fagen trace guard>", "exec"), ns)  # noqa: S102 - our own source ([Note] Trace cache)
    return ns["guard"]


def _build(score_mod, mask_mod, traced: Traced):
    """(steps, reads, keep) of a guard for these traced functions, or None where a traced path is not one of the
    walk's (then the trace is not cached)."""
    counts: dict[int, int] = {}
    _Walk(counts, frozenset()).roots(score_mod, mask_mod)  # first pass: the cells that functions share
    walk = _Walk(None, frozenset(c for c, n in counts.items() if n > 1))
    walk.roots(score_mod, mask_mod)
    reads = []
    for name, path in traced.paths.items():
        slot = walk.where.get(path)
        if slot is None:  # pragma: no cover - the walk follows the tracer's order ([Note] Trace cache)
            return None
        reads.append((name, slot))
    GUARDS[0] += 1
    return tuple(walk.steps), tuple(reads), walk.keep


class _Walk:
    """What the tracer follows (fagen/mods/trace.py, _Tracer.capture / rebind), in its order and to its depth."""

    def __init__(self, counts: dict | None, shared: frozenset):
        self.counts, self.shared = counts, shared
        self.steps: list[tuple] = []
        self.n = 2  # slots 0 and 1: the roots
        self.where: dict[tuple, int] = {}  # a traced path -> its slot
        self.seen: dict[int, int] = {}  # id of a function or tensor met -> its slot
        self.cells: dict[int, int] = {}  # id of a shared cell -> the slot of the cell object
        self.globs: set = set()  # (id of a globals dict, name) read
        self.keep: list = []  # what the checks name by identity, kept alive with the entry

    def step(self, src: int, op: int, key, check: int, want, path: tuple | None) -> int:
        self.steps.append((src, op, key, check, want))
        slot = self.n
        self.n += 1
        if path is not None:
            self.where.setdefault(path, slot)
        return slot

    def roots(self, score_mod, mask_mod) -> None:
        for slot, field, fn in ((0, "score_mod", score_mod), (1, "mask_mod", mask_mod)):
            if fn is not None:
                self.value(slot, _SELF, None, fn, (field,), 0)

    def value(self, src: int, op: int, key, value, path: tuple, depth: int) -> None:
        """The steps that read `value` (src's op/key) and check it, then what the tracer follows inside it."""
        import torch

        if value is None or value is True or value is False:
            self.step(src, op, key, _IS, value, path)
            return
        kind = type(value)
        if kind is _FN or isinstance(value, torch.Tensor):
            first = self.seen.get(id(value))
            if first is not None:  # reached again: the same object (one argument, one rebinding)
                self.step(src, op, key, _SAME, first, path)
                return
        if isinstance(value, (int, float)):  # a runtime scalar: its type
            self.step(src, op, key, _TYPE, kind, path)
        elif isinstance(value, torch.Tensor):
            self.keep.append(value)
            self.seen[id(value)] = self.step(src, op, key, _TENSOR, (torch.Tensor, value.dtype, value.dim()), path)
        elif kind is _FN and depth < 16:
            self.function(src, op, key, value, path, depth + 1)
        elif isinstance(value, (tuple, list)) and len(value) <= 64 and depth < 16:
            slot = self.step(src, op, key, _SEQ, (kind, len(value)), path)
            for i, item in enumerate(value):
                self.value(slot, _ITEM, i, item, path + (("item", i),), depth + 1)
        else:  # anything else (a function past the depth, a callable object): itself
            self.keep.append(value)
            self.step(src, op, key, _IS, value, path)

    def function(self, src: int, op: int, key, fn, path: tuple, depth: int) -> None:
        self.keep.append(fn)
        code, g = fn.__code__, fn.__globals__
        kw = fn.__kwdefaults__
        slot = self.step(src, op, key, _FUNC, (code, g, len(fn.__defaults__ or ()), frozenset(kw) if kw else None),
                         path)
        self.seen[id(fn)] = slot
        for name in _names(code):  # the tracer's order: globals (sorted), cells, defaults, kwdefaults
            if (id(g), name) in self.globs or name not in g or type(g[name]) is types.ModuleType:
                continue  # as the tracer: a name the module lacks (a builtin, an attribute's name), a module
            self.globs.add((id(g), name))
            self.value(slot, _GLOBAL, (g, name), g[name], path + (("global", name),), depth)
        for i, cell in enumerate(fn.__closure__ or ()):
            if self.counts is not None:
                self.counts[id(cell)] = self.counts.get(id(cell), 0) + 1
            if id(cell) in self.shared:
                first = self.cells.get(id(cell))
                if first is not None:  # a cell the trace met before: the same cell (one scalar)
                    self.step(slot, _CELLOBJ, i, _SAME, first, None)
                    continue
                self.keep.append(cell)
                self.cells[id(cell)] = self.step(slot, _CELLOBJ, i, _ANY, None, None)
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell (a variable not yet assigned): stays empty
                self.step(slot, _CELLOBJ, i, _EMPTY, None, None)
                continue
            self.value(slot, _CELL, i, content, path + (("cell", i),), depth)
        for i, d in enumerate(fn.__defaults__ or ()):
            self.value(slot, _DEFAULT, i, d, path + (("default", i),), depth)
        for name, d in (kw or {}).items():
            self.value(slot, _KWDEFAULT, name, d, path + (("kwdefault", name),), depth)


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
