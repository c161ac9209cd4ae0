"""Tracing user mods: attention-gym's examples trace, print, parse back and differentiate; closure numbers are
runtime scalars (a changed one keeps the text); anything outside the whitelist names the operation and line."""

import pytest
import torch

from fagen.bench import gym_mods as gym
from fagen.mods import grad, ir
from fagen.mods.text import parse, to_text
from fagen.mods.trace import trace, trace_mask_mod, trace_score_mod
from fagen.errors import SpecError

_G = torch.Generator().manual_seed(0)
OFFSETS = gym.length_to_offsets([5, 9, 2, 17], "cpu")
REL = torch.randn(4, 2 * 64 - 1, generator=_G)
BIAS = torch.randn(2, 4, 32, 32, generator=_G)

SCORE_MODS = {
    "alibi": (lambda: gym.generate_alibi_bias(8), "score + (kv_idx - q_idx) * exp2(-((h + 1) * 8.0 / H))"),
    "softcap": (lambda: gym.generate_tanh_softcap(30), "soft_cap * tanh(score / soft_cap)"),
    "relative bias": (lambda: gym.generate_relative_bias(REL, 64), "score + rel_bias[h, q_idx - kv_idx + max_len - 1]"),
    "learned bias": (lambda: gym.generate_learned_bias(BIAS), "score + bias[b, h, q_idx, kv_idx]"),
}
MASK_MODS = {
    "document + causal": (lambda: gym.generate_doc_mask_mod(gym.causal_mask, OFFSETS),
                          "(document_id[q_idx] == document_id[kv_idx]) & "
                          "(q_idx - offsets[document_id[q_idx]] >= kv_idx - offsets[document_id[kv_idx]])"),
    "prefix-lm": (lambda: gym.generate_prefix_lm_mask(4), "(kv_idx < prefix_length) | (q_idx >= kv_idx)"),
    "sliding window + causal": (lambda: gym.generate_sliding_window(3),
                                "(q_idx - kv_idx <= window_size) & (q_idx >= kv_idx)"),
    "dilated": (lambda: gym.generate_dilated_sliding_window(4, 2),
                "(abs(q_idx - kv_idx) <= window_size) & (abs(q_idx - kv_idx) % dilation == 0)"),
    "causal": (lambda: gym.causal_mask, "q_idx >= kv_idx"),
    "natten": (lambda: gym.generate_natten(8, 6, 3, 3),
               "(abs(clamp(q_idx // canvas_w, kernel_w // 2, canvas_w - 1 - kernel_w // 2) - kv_idx // canvas_w) <= "
               "kernel_w // 2) & (abs(clamp(q_idx % canvas_w, kernel_h // 2, canvas_h - 1 - kernel_h // 2) - "
               "kv_idx % canvas_w) <= kernel_h // 2)"),
    "flamingo (rows of a captured tensor)": (
        lambda: gym.generate_vision_cross_attention_mask_mod(torch.tensor([[0, 7], [1, 7], [7, 12]],
                                                                          dtype=torch.int32), 6),
        "(q_idx >= intervals[image_boundaries[kv_idx], 0]) & (q_idx < intervals[image_boundaries[kv_idx], 1])"),
}


@pytest.mark.parametrize("name", SCORE_MODS)
def test_gym_score_mods_trace_print_parse_and_differentiate(name):
    make, text = SCORE_MODS[name]
    traced = trace_score_mod(make())
    assert traced.score_text == text
    assert parse(text, "score_mod", traced.tensors, traced.scalars) == traced.score_mod
    d = grad.d_score(traced.score_mod)
    assert d.type == ir.FLOAT
    if name != "softcap":
        assert d == grad.ONE  # additive mods: dS passes through unchanged
    for t in traced.tensors:
        if t.dtype == "fp32":
            (load, dbias), = grad.d_loads(traced.score_mod, t.name)
            assert dbias == grad.ONE


@pytest.mark.parametrize("name", MASK_MODS)
def test_gym_mask_mods_trace_print_and_parse(name):
    make, text = MASK_MODS[name]
    traced = trace_mask_mod(make())
    assert traced.mask_text == text
    assert parse(text, "mask_mod", traced.tensors, traced.scalars) == traced.mask_mod


def test_captured_tensors_are_typed_arguments():
    traced = trace(score_mod=gym.generate_relative_bias(REL, 64),
                   mask_mod=gym.generate_doc_mask_mod(gym.causal_mask, OFFSETS))
    assert traced.tensors == (("document_id", "i32", 1), ("offsets", "i64", 1), ("rel_bias", "fp32", 2))
    assert traced.scalars == (("max_len", "int"),)
    assert traced.values["rel_bias"] is REL and traced.values["offsets"] is OFFSETS and traced.values["max_len"] == 64
    assert traced.spec_fields()["mod_tensors"][2] == ["rel_bias", "fp32", 2]


def test_a_changed_closure_number_keeps_the_text():
    """(Reading it without tracing: tests/test_mods_trace_cache.py, the runtime's guards.)"""
    a, b = gym.generate_sliding_window(3), gym.generate_sliding_window(300)
    ta, tb = trace_mask_mod(a), trace_mask_mod(b)
    assert ta.mask_text == tb.mask_text and ta.scalars == tb.scalars
    assert (ta.values, tb.values) == ({"window_size": 3}, {"window_size": 300})
    assert ta.paths == tb.paths and ta.paths["window_size"][0] == "mask_mod"  # where the guards read it
    soft = [trace_score_mod(gym.generate_tanh_softcap(c)) for c in (20.0, 50.0)]
    assert soft[0].score_text == soft[1].score_text


CAP = 2.0


def test_defaults_and_globals_are_runtime_scalars_literals_are_constants():
    def mod(score, b, h, q_idx, kv_idx, shift=0.5):
        return score * CAP + shift - 1.5

    traced = trace_score_mod(mod)
    assert traced.score_text == "score * CAP + shift - 1.5"
    assert traced.values == {"CAP": 2.0, "shift": 0.5}


def test_names_are_unique_and_bools_steer_tracing():
    def gen(window, causal):
        def m(b, h, q_idx, kv_idx):
            near = kv_idx >= q_idx - window
            return near & (kv_idx <= q_idx) if causal else near
        return m

    from torch.nn.attention.flex_attention import and_masks
    traced = trace_mask_mod(and_masks(gen(8, True), gen(4, False)))
    assert traced.mask_text == "(kv_idx >= q_idx - window) & (kv_idx <= q_idx) & (kv_idx >= q_idx - window_1)"
    assert traced.values == {"window": 8, "window_1": 4}


def _line_of(fn, marker):
    import inspect
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if marker in line)


def test_refusals_name_the_operation_and_the_line():
    def pow_mod(score, b, h, q_idx, kv_idx):
        s = score * 2.0
        return s ** 2  # marker-pow

    def cos_mod(score, b, h, q_idx, kv_idx):
        return torch.cos(score)  # marker-cos

    def if_mod(score, b, h, q_idx, kv_idx):
        if q_idx > kv_idx:  # marker-if
            return score
        return score * 2.0

    def attr_mod(score, b, h, q_idx, kv_idx):
        return score + score.shape[0]  # marker-attr

    def made_mod(score, b, h, q_idx, kv_idx):
        return score + torch.ones(3)[0]  # marker-made

    def bad_index(score, b, h, q_idx, kv_idx):
        return score + REL[h, :]  # marker-slice

    for fn, op, marker in [(pow_mod, "`**`", "marker-pow"), (cos_mod, "torch.cos", "marker-cos"),
                           (if_mod, "Python `if`", "marker-if"), (attr_mod, ".shape", "marker-attr"),
                           (made_mod, "made inside the function", "marker-made"),
                           (bad_index, "no slices", "marker-slice")]:
        with pytest.raises(SpecError) as e:
            trace_score_mod(fn)
        msg = str(e.value)
        assert op in msg and f"line {_line_of(fn, marker)} of test_mods_trace.py" in msg and "\n" not in msg, msg


def test_return_types_are_checked():
    with pytest.raises(SpecError, match="returns a bool"):
        trace_mask_mod(lambda b, h, q_idx, kv_idx: q_idx - kv_idx)
    with pytest.raises(SpecError, match="returns a float score"):
        trace_score_mod(lambda score, b, h, q_idx, kv_idx: q_idx >= kv_idx)
    with pytest.raises(SpecError, match="TypeError"):
        trace_mask_mod(lambda score, b, h, q_idx, kv_idx: score)  # the wrong signature


def test_outside_the_whitelist_in_attention_gym():
    """attention-gym mods that cannot trace, and why: MLA's rope score_mod takes a vector dot product of captured
    rows (torch.dot); the morton NATTEN mask uses bit shifts; SVG's masks use math.floor."""
    rope = torch.randn(1, 2, 8, 4)

    def mla_rope_score_mod(score, b, h, q_idx, kv_idx):  # attn_gym/mods/latent_attention.py, in spirit
        return score + 0.5 * torch.dot(rope[b, h, q_idx], rope[b, h, kv_idx])

    with pytest.raises(SpecError, match="torch.dot"):
        trace_score_mod(mla_rope_score_mod)

    def morton(b, h, q_idx, kv_idx):
        return (q_idx >> 1) == (kv_idx >> 1)

    with pytest.raises(SpecError, match="`>>`"):
        trace_mask_mod(morton)


def test_text_of_traced_and_parsed_trees_agree_on_constants():
    traced = trace_score_mod(lambda score, b, h, q_idx, kv_idx: torch.where(q_idx >= kv_idx, score, -float("inf")))
    assert traced.score_text == "where(q_idx >= kv_idx, score, -inf)"
    assert to_text(parse(traced.score_text)) == traced.score_text
