"""The trace cache's guards ([Note] Trace cache in fagen/runtime/mods.py): a changed closure number, on the same
function object or on a factory's new one, re-reads the number without tracing; a changed kind, bool, global,
nested function, kwdefault, tensor dtype or rank, or aliasing traces again. Each answer is checked against the
user's own functions in float64: the cached trace's tree, evaluated with the values the guard read
(fagen.verify.mods_eval), must equal them over a grid of indices (and, for a few, the kernels' output)."""

import types

import pytest
import torch

import fagen
from _env import DEVICE
from fagen.bench import gym_mods as g
from fagen.errors import SpecError
from fagen.runtime import mods
from fagen.verify.mods_eval import _function
from fagen.verify.mods_reference import mask_mod_visible, score_mod_scores

B, H, SQ, SK = 2, 3, 9, 13  # index grid of the float64 comparison (not multiples of anything)


@pytest.fixture(autouse=True)
def _cold_cache():
    mods.clear()


def _prepare(score_mod=None, mask_mod=None) -> tuple[mods.Mods, int]:
    """(the Mods, how many traces the call ran), checked against the functions in float64."""
    before = mods.TRACES[0]
    m = mods.prepare(score_mod=score_mod, mask_mod=mask_mod)
    _agrees(m, score_mod, mask_mod)
    return m, mods.TRACES[0] - before


def _agrees(m: mods.Mods, score_mod, mask_mod) -> None:
    if score_mod is not None:
        torch.manual_seed(0)
        s = torch.randn(B, H, SQ, SK, dtype=torch.float64)
        got = score_mod_scores(_function(m.traced.score_mod, m.values, True), s)
        assert torch.allclose(got, score_mod_scores(score_mod, s), rtol=1e-12, atol=1e-12), "score_mod differs"
    if mask_mod is not None:
        got = mask_mod_visible(_function(m.traced.mask_mod, m.values, False), B, H, SQ, SK)
        assert torch.equal(got, mask_mod_visible(mask_mod, B, H, SQ, SK)), "mask_mod differs"


def _number_cell(fn):
    """The first closure cell holding a number, through and_masks' tuple of functions."""
    for cell in fn.__closure__ or ():
        x = cell.cell_contents
        if type(x) in (int, float):
            return cell
        for inner in (x if isinstance(x, tuple) else (x,)):
            if isinstance(inner, types.FunctionType) and inner.__closure__:
                found = _number_cell(inner)
                if found is not None:
                    return found
    return None


def _no_trace(monkeypatch):
    """From here on a call must not trace, shape or build a guard: each raises."""
    def boom(*a, **k):
        raise AssertionError("traced or built a guard on a cache hit")
    monkeypatch.setattr(mods, "trace", boom)
    monkeypatch.setattr(mods, "_build", boom)
    monkeypatch.setattr(mods._Walk, "value", boom)


@pytest.mark.parametrize("kw, make, numbers", [
    ("mask_mod", g.generate_sliding_window, (5, 64, 65, 1, 1000)),
    ("score_mod", g.generate_tanh_softcap, (30.0, 2.5, 7.25, 1e3)),
    ("mask_mod", g.generate_prefix_lm_mask, (3, 0, 11)),
])
def test_a_changed_number_is_read_again_on_the_same_object_and_on_a_new_one(monkeypatch, kw, make, numbers):
    first, n = _prepare(**{kw: make(numbers[0])})
    assert n == 1
    one = make(numbers[0])
    _prepare(**{kw: one})
    cell = _number_cell(one)
    _no_trace(monkeypatch)
    for x in numbers[1:]:
        cell.cell_contents = x  # the same function object, a new number (a nonlocal rebinding)
        m, n = _prepare(**{kw: one})
        assert n == 0 and m.fields is first.fields and list(m.values.values()) == [x]
        m, n = _prepare(**{kw: make(x)})  # a new object of the same factory (attention-gym's pattern)
        assert n == 0 and m.fields is first.fields and list(m.values.values()) == [x]


CAP = 20.0  # module globals the mods below read by name
FLIP = False


def _global_softcap(score, b, h, q_idx, kv_idx):
    s = -score if FLIP else score
    return CAP * torch.tanh(s / CAP)


def test_globals_a_number_is_read_again_a_bool_or_a_function_traces_again(monkeypatch):
    global CAP, FLIP
    saved = CAP, FLIP
    try:
        first, n = _prepare(score_mod=_global_softcap)
        assert n == 1 and first.values == {"CAP": 20.0}
        CAP = 3.5
        m, n = _prepare(score_mod=_global_softcap)
        assert n == 0 and m.values == {"CAP": 3.5}
        FLIP = True  # steers Python control flow: a constant of the trace, so another tree
        m, n = _prepare(score_mod=_global_softcap)
        assert n == 1 and m.fields != first.fields
        CAP = 4  # float -> int: another declaration
        m, n = _prepare(score_mod=_global_softcap)
        assert n == 1 and m.fields[3] != first.fields[3]
    finally:
        CAP, FLIP = saved


def _cap(score):
    return score * 2.0


def _tanh(score):
    return torch.tanh(score)


def _via(fn):
    def mod(score, b, h, q_idx, kv_idx):
        return fn(score) + q_idx
    return mod


def test_a_nested_function_replaced_traces_again():
    one = _via(_cap)
    first, n = _prepare(score_mod=one)
    assert n == 1
    one.__closure__[0].cell_contents = _tanh  # the same object now calls another function
    m, n = _prepare(score_mod=one)
    assert n == 1 and m.fields != first.fields
    m, n = _prepare(score_mod=_via(_cap))  # both traces are kept: either code hits
    assert n == 0 and m.fields is first.fields
    m, n = _prepare(score_mod=_via(_tanh))
    assert n == 0


_HELPER = _cap


def _global_helper(score, b, h, q_idx, kv_idx):
    return _HELPER(score) - kv_idx


def test_a_global_function_replaced_traces_again():
    global _HELPER
    first, n = _prepare(score_mod=_global_helper)
    assert n == 1
    try:
        _HELPER = _tanh
        m, n = _prepare(score_mod=_global_helper)
        assert n == 1 and m.fields != first.fields
    finally:
        _HELPER = _cap
    m, n = _prepare(score_mod=_global_helper)
    assert n == 0 and m.fields is first.fields


def test_a_default_number_is_read_again_and_its_type_traces_again():
    def mod(score, b, h, q_idx, kv_idx, bias=0.5):
        return score + bias * q_idx
    first, n = _prepare(score_mod=mod)
    assert n == 1 and first.values == {"bias": 0.5}
    mod.__defaults__ = (-2.0,)
    m, n = _prepare(score_mod=mod)
    assert n == 0 and m.values == {"bias": -2.0}
    mod.__defaults__ = (3,)
    m, n = _prepare(score_mod=mod)
    assert n == 1 and m.fields != first.fields


def test_a_kwdefault_number_is_read_again_and_its_type_traces_again():
    def mod(score, b, h, q_idx, kv_idx, *, cap=30.0):
        return cap * torch.tanh(score / cap)
    first, n = _prepare(score_mod=mod)
    assert n == 1
    mod.__kwdefaults__["cap"] = 4.0
    m, n = _prepare(score_mod=mod)
    assert n == 0 and m.values == {"cap": 4.0}
    mod.__kwdefaults__["cap"] = 4
    m, n = _prepare(score_mod=mod)
    assert n == 1 and m.fields != first.fields
    mod.__kwdefaults__ = {"cap": 4.0, "unused": 1}  # another set of names: traced again (then the float trace)
    m, n = _prepare(score_mod=mod)
    assert n == 1 and m.fields == first.fields


def _steered(flag, w):
    def mod(b, h, q_idx, kv_idx):
        if flag:
            return q_idx - kv_idx <= w
        return kv_idx - q_idx <= w
    return mod


def test_a_closure_bool_steering_the_function_traces_again():
    first, n = _prepare(mask_mod=_steered(True, 3))
    assert n == 1
    m, n = _prepare(mask_mod=_steered(False, 3))  # a new object, the other branch
    assert n == 1 and m.fields != first.fields
    one = _steered(True, 4)
    m, n = _prepare(mask_mod=one)
    assert n == 0 and m.fields is first.fields
    one.__closure__[0].cell_contents = False  # the same object, flipped
    m, n = _prepare(mask_mod=one)
    assert n == 0 and m.fields != first.fields  # the other branch's trace, kept from above


def _scaled(w):
    def mod(score, b, h, q_idx, kv_idx):
        return score * w
    return mod


def test_a_number_that_becomes_a_tensor_or_another_number_type_traces_again():
    first, n = _prepare(score_mod=_scaled(2))
    assert n == 1 and first.fields[3][0][1] == "int"
    m, n = _prepare(score_mod=_scaled(2.5))
    assert n == 1 and m.fields[3][0][1] == "float"
    m, n = _prepare(score_mod=_scaled(torch.tensor(1.5, dtype=torch.float64).float()))
    assert n == 1 and m.fields[2] and not m.fields[3]
    one = _scaled(3)
    m, n = _prepare(score_mod=one)
    assert n == 0 and m.fields is first.fields
    one.__closure__[0].cell_contents = 3.0  # int -> float on the same object
    m, n = _prepare(score_mod=one)
    assert n == 0 and m.fields[3][0][1] == "float" and m.values == {"w": 3.0}  # the float trace, kept


def test_a_captured_tensor_of_another_dtype_or_rank_traces_again():
    torch.manual_seed(1)
    bias = torch.randn(H, 2 * SK)
    first, n = _prepare(score_mod=g.generate_relative_bias(bias, SK))
    assert n == 1
    m, n = _prepare(score_mod=g.generate_relative_bias(torch.randn(H, 2 * SK), SK))  # same kind: read again
    assert n == 0 and m.fields is first.fields and m.values["rel_bias"] is not bias
    with pytest.raises(SpecError, match="float64"):  # traced again, and refused there
        mods.prepare(score_mod=g.generate_relative_bias(bias.double(), SK))
    m, n = _prepare(score_mod=g.generate_relative_bias(bias.half(), SK))
    assert n == 1 and m.fields[2] != first.fields[2]
    with pytest.raises(SpecError, match="rank"):  # rank 3 indexed by two: traced again, and refused there
        mods.prepare(score_mod=g.generate_relative_bias(torch.randn(H, 2 * SK, 2), SK))


def _two_biases(t1, t2):
    def mod(score, b, h, q_idx, kv_idx):
        return score + t1[h] - 2.0 * t2[h]
    return mod


def test_one_tensor_captured_twice_is_one_argument_and_two_tensors_trace_again():
    torch.manual_seed(2)
    t, u = torch.randn(H), torch.randn(H)
    first, n = _prepare(score_mod=_two_biases(t, t))
    assert n == 1 and len(first.fields[2]) == 1
    m, n = _prepare(score_mod=_two_biases(u, u))
    assert n == 0 and m.fields is first.fields
    m, n = _prepare(score_mod=_two_biases(t, u))  # two tensors where the trace had one argument
    assert n == 1 and len(m.fields[2]) == 2
    m, n = _prepare(score_mod=_two_biases(u, u))  # the newest trace (two arguments) serves the shared case too
    assert n == 0


def _lo_factory():
    w = 0

    def lo(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= w
    return lo


_LO = _lo_factory().__code__


def _pair(first_cell, second_cell):
    """and_masks of two functions over one code, each closing over a given cell for its variable w."""
    return g.and_masks(types.FunctionType(_LO, globals(), "lo", None, (first_cell,)),
                       types.FunctionType(_LO, globals(), "lo", None, (second_cell,)))


def test_a_cell_two_functions_share_is_one_scalar_and_two_cells_trace_again():
    shared = types.CellType(4)
    first, n = _prepare(mask_mod=_pair(shared, shared))
    assert n == 1 and len(first.fields[3]) == 1
    shared.cell_contents = 7
    m, n = _prepare(mask_mod=_pair(shared, shared))
    assert n == 0 and m.values == {"w": 7}
    m, n = _prepare(mask_mod=_pair(types.CellType(2), types.CellType(9)))  # two cells, two numbers
    assert n == 1 and len(m.fields[3]) == 2


def _late(flag):
    def mod(b, h, q_idx, kv_idx):
        if flag:
            return q_idx >= kv_idx
        return q_idx - kv_idx <= late
    if flag is None:
        late = 0
    return mod


def test_an_empty_cell_stays_empty_and_a_filled_one_traces_again():
    one = _late(True)  # `late` is an empty cell, never read on this branch
    _, n = _prepare(mask_mod=one)
    assert n == 1
    _, n = _prepare(mask_mod=_late(True))
    assert n == 0
    one.__closure__[one.__code__.co_freevars.index("late")].cell_contents = 5
    _, n = _prepare(mask_mod=one)
    assert n == 1


@pytest.mark.parametrize("kw, make, numbers", [
    ("mask_mod", g.generate_sliding_window, (4, 17, 5)),
    ("score_mod", g.generate_tanh_softcap, (2.0, 0.75, 9.5)),
])
def test_changed_numbers_reach_the_kernel_on_the_same_object_and_on_new_ones(monkeypatch, kw, make, numbers):
    """The modded kernels (lowering off) get each call's number, through the same object and through new ones, with
    no new trace and no new module; each output against the float64 reference of that number."""
    from fagen.mods import lower
    from fagen.runtime import loader
    from fagen.verify import reference

    monkeypatch.setattr(lower, "ENABLED", False)
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 37, 16, device=DEVICE) for _ in range(3))
    one = make(numbers[0])
    cell = _number_cell(one)
    with torch.no_grad():
        fagen.attention(q, k, v, **{kw: one})
        traces, modules = mods.TRACES[0], len(loader._loaded)
        outs = {}
        for x in numbers[1:]:
            cell.cell_contents = x
            same = fagen.attention(q, k, v, **{kw: one})
            new = fagen.attention(q, k, v, **{kw: make(x)})
            want = reference.attention(q.double(), k.double(), v.double(), **{kw: make(x)})[0]
            assert torch.equal(same, new)
            assert (same.double() - want).abs().max().item() < 1e-4
            outs[x] = same
    assert mods.TRACES[0] == traces and len(loader._loaded) == modules
    a, b = outs.values()
    assert (a - b).abs().max().item() > 1e-3  # the two numbers gave two answers


def test_a_call_that_keeps_its_mods_looks_them_up_once(monkeypatch):
    """fagen.attention asks the lowering first (as_switches); a mod that stays reaches the modded path with the
    Mods already prepared: one trace-cache lookup per call. Lowering off: the document mask would otherwise become
    varlen switch calls (fagen/mods/split.py), and the point here is a mod that stays."""
    from fagen.mods import lower as lowering
    from fagen.runtime import modded

    monkeypatch.setattr(lowering, "ENABLED", False)

    mask_mod = g.generate_doc_mask_mod(g.causal_mask, g.length_to_offsets([5, 9, 6], DEVICE))
    torch.manual_seed(4)
    q, k, v = (torch.randn(1, 2, 20, 16, device=DEVICE) for _ in range(3))
    with torch.no_grad():
        first = fagen.attention(q, k, v, mask_mod=mask_mod)
        calls = []
        real = mods.prepare
        monkeypatch.setattr(modded, "prepare", lambda **kw: calls.append(kw) or real(**kw))
        assert torch.equal(fagen.attention(q, k, v, mask_mod=mask_mod), first)
    assert len(calls) == 1 and modded.LOWERED[0] is None
