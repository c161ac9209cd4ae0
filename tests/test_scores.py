"""Score switches (window, softcap, ALiBi, sinks) against the float64 reference: every mask, GQA, forward,
backward (with the sinks' gradient) and decode; block skipping; input errors; spec names."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fagen
from fagen.codegen.render import generate
from fagen.runtime.loader import load_source
from fagen.spec.axes import Direction, DType, Kind, Mask
from fagen.spec.kernel import SpecError
from fagen.verify import reference
from fagen.verify.properties import BY_NAME, check_backward, check_forward
from fagen.verify.tolerances import PropertyFailure
from fagen.verify.strategies import GPU_HEAD_DIMS, Problem, decode_problems, problems, specs
from _env import DEVICE, ON_GPU, SCALE

HEAD_DIMS = GPU_HEAD_DIMS if ON_GPU else (16, 40)
BLOCKS = None if ON_GPU else (16, 32)
ON_OFF = (False, True)
SWITCHES = ("window", "softcap", "alibi", "sinks")


def switch_specs(mask, **kw):
    """Specs of `mask` with any subset of the score switches."""
    return specs(masks=[mask], head_dims=HEAD_DIMS, blocks=BLOCKS, gqas=(1, 2), window=ON_OFF, softcap=ON_OFF,
                 alibi=ON_OFF, sinks=ON_OFF, **kw)


def all_on(**fields):
    return fagen.KernelSpec(**{"head_dim": 32, "gqa": 2, "dtype": "fp32", "block_m": 16, "block_n": 16,
                               **{s: True for s in SWITCHES}, **fields})


def fixed_problem(mask, spec, window=(5, 2), seed=3, **kw):
    """Ragged lengths (Sq != Sk, no multiple of 16), a padded batch entry with one key, a forest."""
    mask = Mask(mask)
    sq, sk = (9, 46) if mask is Mask.TREE else (37, 53)
    return Problem(batch=2, heads_kv=1, seq_q=sq, seq_k=sk, seed=seed, magnitude=4.0,
                   seqlens_q=(37, 20) if mask.padded else None, seqlens_k=(53, 1) if mask.padded else None,
                   parents=((-1, 0, 1, 1, 0, 4, -1, 6, 2),) * 2 if mask is Mask.TREE else None,
                   window=window if spec.window else None, softcap=2.0 if spec.softcap else None,
                   alibi=spec.alibi, sinks=spec.sinks, **kw)


@pytest.mark.parametrize("mask", list(Mask))
@given(data=st.data())
def test_forward_matches_reference(mask, data):
    spec = data.draw(switch_specs(mask, dtypes=list(DType.portable())), label="spec")
    problem = data.draw(problems(spec, SCALE), label="problem")
    check_forward(fagen.load(spec), spec, problem, DEVICE)


@pytest.mark.parametrize("mask", list(Mask))
@given(data=st.data())
def test_backward_matches_reference(mask, data):
    spec = data.draw(switch_specs(mask, dtypes=[DType.FP32, DType.BF16], directions=[Direction.BWD]), label="spec")
    problem = data.draw(problems(spec, SCALE), label="problem")
    check_backward(fagen.load(spec), spec, problem, DEVICE)


@pytest.mark.parametrize("mask", list(Mask))
@given(data=st.data())
def test_decode_matches_reference(mask, data):
    spec = data.draw(switch_specs(mask, dtypes=[DType.FP32, DType.FP16], kinds=[Kind.DECODE]), label="spec")
    problem = data.draw(decode_problems(spec, SCALE), label="problem")
    splits = data.draw(st.one_of(st.none(), st.integers(1, 7)), label="num_splits")
    module = fagen.load(spec)
    check_forward(type("Split", (), {"forward": staticmethod(
        lambda *a, **kw: module.forward_split(*a, num_splits=splits, **kw))}), spec, problem, DEVICE)


@pytest.mark.parametrize("switch", [*SWITCHES, "all"])
@pytest.mark.parametrize("mask", list(Mask))
def test_each_switch_alone_and_all_forward_backward(mask, switch):
    """Fixed coverage: every mask x each switch alone (and all four), gqa 2, forward and backward (dsinks too)."""
    fields = {s: (switch in (s, "all")) for s in SWITCHES}
    spec = all_on(mask=mask, direction="bwd", **fields)
    for window in ((5, 2), (0, 0), (None, 17), (40, None)):
        check_backward(fagen.load(spec), spec, fixed_problem(mask, spec, window), DEVICE)
        if not spec.window:
            break


@pytest.mark.parametrize("mask", list(Mask))
def test_gqa_and_related_properties_hold_with_every_switch(mask):
    spec = all_on(mask=mask)
    module = fagen.load(spec)
    props = [p for p in ("gqa", "tree-chain", "padding-split", "padding-garbage", "nan-propagates")
             if BY_NAME[p].applies(spec, module)]
    assert "gqa" in props and "lse-merge" not in props
    for name in props:
        problem = fixed_problem(mask, spec, poison=mask.padded)
        if name == "tree-chain":
            problem = Problem(**{**problem.__dict__, "parents": (tuple(range(-1, 8)),) * 2})
        BY_NAME[name].check(module, spec, problem, DEVICE)


def test_sink_rows_that_see_no_key():
    """A valid row whose window holds no key gets out = 0 and lse = sink[h]; padding rows keep lse = -inf."""
    spec = all_on(mask="causal+padding", softcap=False, alibi=False)
    problem = Problem(batch=2, heads_kv=1, seq_q=20, seq_k=30, seqlens_q=(20, 7), seqlens_k=(30, 3), window=(0, 0),
                      sinks=True, seed=5)
    (q, k, v), kwargs = problem.inputs(spec, DEVICE)
    kwargs["window"] = (2, 0)  # rows of entry 1 with i_aligned = i - 4 < 0 see no key
    out, lse = fagen.load(spec).forward(q, k, v, **kwargs)
    sinks = kwargs["sinks"]
    assert (out[1, :, :4] == 0).all() and torch.equal(lse[1, :, :4], sinks.view(-1, 1).expand(-1, 4))
    assert (lse[1, :, 7:] == float("-inf")).all() and (out[1, :, 7:] == 0).all()
    ref_out, ref_lse = reference.attention(q, k, v, mask=spec.mask, **kwargs)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_window_never_loads_keys_outside_it(kind):
    """Block skipping: NaN in every key block wholly before the window never reaches the output (a loaded block,
    even fully masked, would carry NaN through p @ v)."""
    spec = all_on(mask="causal", kind=kind, softcap=False, alibi=False, sinks=False, gqa=1)
    sq, sk, left = 5, 200, 9
    problem = Problem(batch=1, heads_kv=1, seq_q=sq, seq_k=sk, window=(left, 0), seed=8)
    (q, k, v), kwargs = problem.inputs(spec, DEVICE)
    ref_out, ref_lse = reference.attention(q, k, v, mask="causal", **kwargs)
    first = (sk - sq - left) // 16 * 16  # the first key block any row's window touches
    k[:, :, :first], v[:, :, :first] = float("nan"), float("nan")
    module = fagen.load(spec)
    runs = [module.forward(q, k, v, **kwargs)]
    if kind == "decode":
        runs += [module.forward_split(q, k, v, num_splits=n, **kwargs) for n in (1, 3, 50)]
    for out, lse in runs:
        torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


# [Note] Approximate tanh (fagen/templates/triton/masks.j2): fp16/bf16 kernels compiled for CUDA take the softcap's
# tanh from the PTX tanh.approx.f32; fp32 kernels and the interpreter keep the exact exp2 form. On the GPU the tests
# below hold the approximation to the dtype tolerances (out, and lse at 1e-4) with caps that bite and that do not.
APPROX = 'tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x],'
KINDS = [("prefill", "fwd"), ("prefill", "bwd"), ("decode", "fwd")]


def softcap_spec(dtype, kind="prefill", direction="fwd", **kw):
    blocks = {} if ON_GPU else {"block_m": 16, "block_n": 16}
    return fagen.KernelSpec(head_dim=128 if ON_GPU else 32, mask="causal", gqa=2, dtype=dtype, kind=kind,
                            direction=direction, softcap=True, **blocks, **kw)


@pytest.mark.parametrize("kind, direction", KINDS)
@pytest.mark.parametrize("dtype", list(DType.portable()))
def test_approximate_tanh_only_in_half_precision_cuda_kernels(dtype, kind, direction):
    spec = softcap_spec(dtype, kind, direction)
    assert (APPROX in generate(spec)) == (dtype is not DType.FP32)
    assert bool(getattr(fagen.load(spec), "_TANH_APPROX", False)) == (ON_GPU and dtype is not DType.FP32)
    plain = fagen.KernelSpec(**{**spec.to_dict(), "softcap": False})
    assert "_tanh" not in generate(plain)


def approx_problems(spec):
    """Caps that saturate tanh (0.5 at magnitude 16), that sit in its bend and that barely bite; decode: Sq 3."""
    caps, magnitudes = ((0.5, 2.0, 5.0, 30.0), (1.0, 4.0, 16.0)) if ON_GPU else ((2.0, 30.0), (16.0,))
    sq, sk = (3 if spec.kind is Kind.DECODE else 257, 300) if ON_GPU else (3 if spec.kind is Kind.DECODE else 37, 53)
    return [Problem(batch=2, heads_kv=2, seq_q=sq, seq_k=sk, magnitude=m, softcap=cap, seed=i)
            for i, (cap, m) in enumerate((c, m) for c in caps for m in magnitudes)]


@pytest.mark.parametrize("kind, direction", KINDS)
@pytest.mark.parametrize("dtype", [DType.FP16, DType.BF16])
def test_approximate_tanh_matches_reference(dtype, kind, direction):
    spec = softcap_spec(dtype, kind, direction)
    module = fagen.load(spec)
    check = check_backward if direction == "bwd" else check_forward
    for problem in approx_problems(spec):
        check(module, spec, problem, DEVICE)


@pytest.mark.skipif(not ON_GPU, reason="the approximate tanh runs only in compiled CUDA kernels")
@pytest.mark.parametrize("dtype", [DType.FP16, DType.BF16])
def test_approximate_tanh_has_teeth(dtype):
    """The same checks catch an approximate tanh off by 1% (its input scaled by 1.01): they run the PTX path."""
    spec = softcap_spec(dtype)
    source = generate(spec)
    broken = source.replace(APPROX, APPROX.replace("[x]", "[x * 1.01]"))
    assert broken != source
    module = load_source(broken, f"{spec.name}_tanh_off_by_1pc")
    with pytest.raises(PropertyFailure):
        for problem in approx_problems(spec):
            check_forward(module, spec, problem, DEVICE)


@pytest.mark.parametrize("kwargs, message", [
    (dict(window=(3,)), "window: expected"),
    (dict(window=(-1, 0)), "left extent"),
    (dict(window=(0, 1.5)), "right extent"),
    (dict(softcap=0.0), "softcap: expected a positive"),
    (dict(softcap=float("inf")), "softcap: expected a positive"),
    (dict(alibi_slopes="x"), "alibi_slopes: expected a float32"),
    (dict(alibi_slopes=torch.ones(3)), r"alibi_slopes: expected a float32 tensor \[4\]"),
    (dict(sinks=torch.ones(4, dtype=torch.float64)), "sinks: expected a float32"),
    (dict(sinks=None), "sinks: this kernel"),
])
def test_bad_score_inputs_raise_clear_errors(kwargs, message):
    spec = all_on(mask="none")
    mod = fagen.load(spec)
    (q, k, v), good = Problem(batch=1, heads_kv=2, seq_q=3, seq_k=5, window=(1, 1), softcap=2.0, alibi=True,
                              sinks=True).inputs(spec, DEVICE)
    with pytest.raises(mod.InputError, match=message):
        mod.forward(q, k, v, **{**good, **kwargs})


def test_a_switch_the_spec_lacks_is_refused():
    spec = fagen.KernelSpec(head_dim=32, mask="causal", window=True, block_m=16, block_n=16)
    mod = fagen.load(spec)
    (q, k, v), _ = Problem(batch=1, heads_kv=1, seq_q=3, seq_k=5).inputs(spec, DEVICE)
    with pytest.raises(mod.InputError, match="softcap: this kernel .* is built without it"):
        mod.forward(q, k, v, window=(1, 0), softcap=3.0)
    plain = fagen.load(fagen.KernelSpec(head_dim=32, block_m=16, block_n=16))
    with pytest.raises(TypeError):
        plain.forward(q, k, v, window=(1, 0))


def test_spec_names_and_json():
    plain = fagen.KernelSpec(head_dim=64, mask="causal")
    assert "window" not in plain.to_json() and "_win" not in plain.name  # specs without switches are unchanged
    spec = fagen.KernelSpec(head_dim=64, mask="causal", window=True, sinks=True, gqa=8)
    assert "_g8_win_sink_fp16" in spec.name
    assert fagen.KernelSpec.from_json(spec.to_json()) == spec and '"sinks":true' in spec.to_json()
    with pytest.raises(SpecError, match="must be true or false"):
        fagen.KernelSpec(head_dim=64, softcap="yes")
    with pytest.raises(SpecError, match="cuda backend has the window and softcap switches only"):
        fagen.KernelSpec(head_dim=64, backend="cuda", alibi=True)


def test_windowed_d64_forwards_take_small_tiles():
    """[Note] Windowed d64 tiles (fagen/backends/triton.py): a windowed d64 prefill forward defaults to m64n32w4s3;
    every other spec keeps its tile, and explicit fields win."""
    tile = lambda s: (s.block_m, s.block_n, s.num_warps, s.num_stages)  # noqa: E731
    for layout in ("dense", "varlen"):
        for dtype in ("fp16", "bf16"):
            fields = dict(head_dim=64, mask="causal", gqa=8, sinks=True, dtype=dtype, layout=layout)
            assert tile(fagen.KernelSpec(window=True, **fields)) == (64, 32, 4, 3)
            assert tile(fagen.KernelSpec(**fields)) == (128, 128, 4, 3)
    assert fagen.KernelSpec(head_dim=64, mask="causal", window=True, sinks=True, gqa=8).name == \
        "attn_fwd_causal_d64_m64n32w4s3_g8_win_sink_fp16"
    for other in (dict(head_dim=128), dict(direction="bwd"), dict(kind="decode"), dict(dtype="fp32")):
        fields = {"head_dim": 64, "mask": "causal", **other}
        assert tile(fagen.KernelSpec(window=True, **fields)) == tile(fagen.KernelSpec(**fields))
    assert tile(fagen.KernelSpec(head_dim=64, window=True, block_m=128, block_n=64)) == (128, 64, 4, 3)


@pytest.mark.parametrize("kind, direction", [("prefill", "fwd"), ("prefill", "bwd"), ("decode", "fwd")])
def test_window_extents_are_never_specialised(kind, direction):
    """A window is a runtime argument (and a lowered mod's closure number): Triton must not compile a variant per
    value class of win_left / win_right (1, a multiple of 16, other), so every launched kernel taking them lists
    them in do_not_specialize."""
    import re

    from fagen.codegen.render import render

    spec = fagen.KernelSpec(head_dim=64, dtype="bf16", mask="causal", window=True, kind=kind, direction=direction)
    rendered = render(spec)
    src = str(getattr(rendered, "source", rendered))
    launched = set(re.findall(r"_fast\((\w+)\)", src)) | set(re.findall(r"\b(\w+)\[\(?grid", src))
    kernels = re.findall(r"(@triton\.jit[^\n]*)\ndef (\w+)\(([^)]*)\)", src)
    entries = [(jit, name) for jit, name, params in kernels if name in launched and re.search(r"\bwin_left\b", params)]
    assert entries, "no launched kernel takes the window"
    for jit, name in entries:
        assert '"win_left"' in jit and '"win_right"' in jit, (name, jit)
