"""The runtime's trace cache (fagen/runtime/mods.py): a warm call traces nothing, a changed closure number is
re-read (same spec fields, new value), a factory's new function object of the same shape reuses the trace, and a
changed kind traces again."""

import pytest
import torch

from fagen.bench import gym_mods as g
from fagen.runtime import mods


@pytest.fixture(autouse=True)
def _cold_cache():
    """Each test counts its own traces: start from an empty trace cache (other tests trace the same gym mods)."""
    mods.clear()


def test_the_same_functions_trace_once_and_changed_numbers_are_reread():
    window = [16]

    def make():
        w = window[0]

        def sliding(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx <= w) & (q_idx >= kv_idx)
        return sliding

    fn = make()
    before = mods.TRACES[0]
    first = mods.prepare(mask_mod=fn)
    again = mods.prepare(mask_mod=fn)
    assert mods.TRACES[0] == before + 1 and again.fields == first.fields and again.values == {"w": 16}
    fn.__closure__[0].cell_contents = 300  # a nonlocal rebinding: the same function object, a new number
    changed = mods.prepare(mask_mod=fn)
    assert mods.TRACES[0] == before + 1 and changed.fields == first.fields and changed.values == {"w": 300}


def test_a_factory_call_per_step_reuses_the_trace():
    before = mods.TRACES[0]
    a = mods.prepare(mask_mod=g.generate_sliding_window(3))
    for w in (5, 64, 65, 1000):
        b = mods.prepare(mask_mod=g.generate_sliding_window(w))
        assert b.fields == a.fields and b.values == {"window_size": w}
    assert mods.TRACES[0] == before + 1


def test_a_changed_kind_traces_again_and_changes_the_fields():
    before = mods.TRACES[0]
    a = mods.prepare(score_mod=g.generate_tanh_softcap(30))
    b = mods.prepare(score_mod=g.generate_tanh_softcap(30.5))  # int -> float: a new declaration
    assert mods.TRACES[0] == before + 2 and a.fields != b.fields
    bias = torch.randn(4, 9)
    c = mods.prepare(score_mod=g.generate_relative_bias(bias, 5))
    d = mods.prepare(score_mod=g.generate_relative_bias(bias.to(torch.float16), 5))  # a new dtype
    e = mods.prepare(score_mod=g.generate_relative_bias(torch.randn(4, 9), 5))  # a new tensor, same kind
    assert c.fields != d.fields and e.fields == c.fields and e.values["rel_bias"] is not bias
    assert mods.TRACES[0] == before + 4
