"""Where fagen.attention takes the Gluon backward for mods and switches ([Note] Gluon backward selection in
fagen/runtime/hopper.py) and where it must keep the Triton one, and the host's clamp-free choice ([Note] Clamp-free
problems in fagen/mods/emit.py). sm_90 is faked (as_if_hopper) and the modules stubbed, so nothing runs a kernel:
scripts/gpu_mods_bwd_s9.py runs them against float64 on an H100."""

import random
import types

import numpy as np
import pytest
import torch

import fagen
from fagen.codegen.render import render
from fagen.runtime import hopper, modded
from fagen.runtime.loader import load
from fagen.spec.kernel import KernelSpec

from _env import ON_GPU
from test_hopper_selection import as_if_hopper  # noqa: F401 (a fixture)

RELBIAS = dict(score_mod="score + bias[h, q_idx - kv_idx + c]", mod_tensors=[["bias", "fp32", 2]],
               mod_scalars=[["c", "int"]])
pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU tensors with sm_90 faked: its Triton path needs the interpreter")


def bwd(**fields) -> KernelSpec:
    return KernelSpec(**{"head_dim": 128, "dtype": "bf16", "direction": "bwd", "mask": "none", **fields})


@pytest.mark.parametrize("fields,picked", [
    (RELBIAS, True), (dict(score_mod="score + kv_idx * s", mod_scalars=[["s", "float"]]), True),
    (dict(mask="causal", score_mod="where(score > 0.0, score, 0.5 * score)"), True), (dict(mask="causal"), True),
    (dict(head_dim=96, **RELBIAS), False), (dict(dtype="fp16", **RELBIAS), False),
    (dict(mask_mod="q_idx >= kv_idx"), False), (dict(alibi=True, **RELBIAS), False), (dict(sinks=True), False),
    (dict(mask="padding", **RELBIAS), False), (dict(layout="varlen", **RELBIAS), False),
    (dict(mask="causal", window=True), True),  # selected since the eleventh session (docs/mods.md)
    (dict(mask="none", window=True), False),
    (dict(mask="causal", window=True, gqa=4), False), (dict(mask="causal", window=True, **RELBIAS), False),
    (dict(softcap=True), False),  # not selected until timed
])
def test_the_twin_carries_the_score_mod_and_refuses_what_the_gluon_backward_must_not_take(
        as_if_hopper, fields, picked):  # noqa: F811
    spec = bwd(**fields)
    got = hopper.backward_spec(spec, torch.device("cuda"))
    if not picked:
        assert got is None
        return
    assert got.backend.value == "gluon" and got.direction.value == "bwd"
    for name in ("head_dim", "mask", "gqa", "dtype", "score_mod", "mod_tensors", "mod_scalars", "switches"):
        assert getattr(got, name) == getattr(spec, name), name


def test_the_listed_switch_sets_reach_the_twin(as_if_hopper, monkeypatch):  # noqa: F811
    from fagen import backends

    monkeypatch.setattr(type(backends.GLUON), "bwd_selected_switches", ((), ("window",), ("softcap",)))
    for fields in (dict(mask="causal", window=True), dict(softcap=True), dict(softcap=True, **RELBIAS)):
        got = hopper.backward_spec(bwd(**fields), torch.device("cuda"))
        assert got is not None and got.switches == bwd(**fields).switches and got.score_mod == fields.get("score_mod")
    assert hopper.backward_spec(bwd(window=True, softcap=True), torch.device("cuda")) is None  # not a listed set


@pytest.fixture
def stubbed(as_if_hopper, monkeypatch):  # noqa: F811
    """modded's module loads stubbed: each returns a module whose attention() records (backend, keywords)."""
    calls = []

    def fake_load(spec):
        def attention(q, k, v, **kw):
            calls.append((spec.backend.value, kw))
            return q.detach().clone().requires_grad_()
        return types.SimpleNamespace(attention=attention, MASK=str(spec.mask), GQA=spec.gqa, NAME=spec.name,
                                     backward_unordered_op=None)
    monkeypatch.setattr(modded, "load", fake_load)
    for name in ("_MODULES", "_MOD_SPECS", "_GLUON_BWD", "_FORWARD_ONLY"):
        monkeypatch.setattr(modded, name, {})
    monkeypatch.setattr(hopper, "BWD_MIN_WORK", 1000)
    monkeypatch.setattr(hopper, "BWD_WINDOW_MIN_WORK", 1000)
    return calls


def _inputs(d=128, s=40, h=2):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, h, s, d, generator=g, dtype=torch.bfloat16).requires_grad_() for _ in range(3)]


def test_the_modded_gradient_path_takes_the_gluon_twin_with_its_mode(stubbed):
    q, k, v = _inputs()
    bias = torch.randn(2, 79)

    def rel(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + 39]
    fagen.attention(q, k, v, score_mod=rel)
    fagen.attention(q, k, v, score_mod=rel, deterministic=False)
    assert [c[0] for c in stubbed] == ["gluon", "gluon"]
    assert "deterministic" not in stubbed[0][1] and stubbed[1][1]["deterministic"] is False
    assert stubbed[0][1]["mods"]["bias"] is bias


def test_the_modded_gradient_path_keeps_triton_where_it_must(stubbed, monkeypatch):
    bias = torch.randn(2, 79)

    def rel(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + 39]
    q, k, v = _inputs()
    learned = bias.clone().requires_grad_()  # a learned bias: its gradient is the Triton backward's
    fagen.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + learned[h, qi - ki + 39])
    fagen.attention(*_inputs(d=96), score_mod=rel)  # no gluon backward at d96
    fagen.attention(*_inputs(s=20), score_mod=rel)  # 2 x 20 x 20 = 800 pairs: below the floor
    fagen.attention(q, k, v, score_mod=rel, alibi_slopes=torch.rand(2))  # the ALiBi switch: Triton only
    fagen.attention(q, k, v, score_mod=rel, mask_mod=lambda b, h, qi, ki: (qi - ki) % 3 == 0)  # a mask_mod
    monkeypatch.setattr(hopper, "is_hopper", lambda device: False)  # sm_80
    modded._GLUON_BWD.clear()
    fagen.attention(q, k, v, score_mod=rel)
    assert [c[0] for c in stubbed] == ["triton"] * 6


def test_the_prefix_split_gets_the_size_floor_from_fagen_attention(monkeypatch):
    """[Note] Split calls' backward: fagen.attention passes hopper.BWD_MIN_WORK, so each split call asks resolve
    for its own backward."""
    from fagen.mods import split

    seen = []
    real = split.run_split

    def recording(*args, **kw):
        seen.append(kw.get("bwd_min_work"))
        return real(*args, **kw)
    monkeypatch.setattr(split, "run_split", recording)
    q, k, v = _inputs(d=16, s=24)
    fagen.attention(q.float(), k.float(), v.float(), mask_mod=lambda b, h, qi, ki: (ki < 7) | (qi >= ki))
    assert seen == [hopper.BWD_MIN_WORK]


def _free_module():
    return load(bwd(backend="gluon", **RELBIAS))


def test_the_host_picks_the_clamp_free_kernel_exactly_where_every_index_of_the_padded_tiles_is_inside():
    """_mod_free (the module's host test) against brute force over the rows and keys the kernel's tiles reach
    (64-row and 128-key blocks, the padding included), random sizes, offsets, head counts and bias layouts."""
    mod = _free_module()
    rnd = random.Random(4)
    hits = 0
    for _ in range(300):
        sq, sk, hq = rnd.choice((1, 63, 64, 65, 200, 256)), rnd.choice((1, 100, 128, 129, 256)), rnd.choice((1, 2, 3))
        c = rnd.randint(-10, 300)
        rows, cols = rnd.choice((1, 2, 3)), rnd.randint(1, 600)
        q, k = torch.empty(1, hq, sq, 8), torch.empty(1, 1, sk, 8)
        bias = torch.empty(rows, cols) if rnd.random() < 0.7 else torch.empty(cols, rows).t()
        qi = np.arange(-(-sq // 64) * 64)[:, None]
        ki = np.arange(-(-sk // 128) * 128)[None, :]
        idx = qi - ki + c
        want = hq <= rows and bool(np.all((idx >= 0) & (idx < cols)))
        unit = bias.stride(1) == 1  # [Note] Split offsets: 2 where the queries' stride is 1 (bwd_mod_split)
        assert mod._mod_free(q, k, bias, c) == ((2 if unit else 1) if want else 0), (sq, sk, hq, c, rows, cols)
        hits += want
    assert 20 < hits < 280, hits  # both answers drawn


def test_the_clamp_free_choice_refuses_offsets_past_int32():
    mod = _free_module()
    q = k = torch.empty(1, 1, 64, 8)
    ok = types.SimpleNamespace(shape=(1, 255), stride=lambda d: (255, 1)[d])
    far = types.SimpleNamespace(shape=(1, 255), stride=lambda d: (255, 1 << 24)[d])  # 254 * 2^24 > 2^31
    assert mod._mod_free(q, k, ok, 127) and not mod._mod_free(q, k, far, 127)


def test_the_clamp_free_kernel_is_a_constexpr_that_drops_the_clamped_read():
    """MOD_FREE's branch reads without _mod_index and the module passes it where _mod_free says so; a load whose
    index is not affine (a floor division) has neither, nor has a mod without loads."""
    src = render(bwd(backend="gluon", **RELBIAS)).files[".py"]
    branch = src.split("if MOD_FREE:", 1)[1].split("elif", 1)[0]
    assert "_mod_index" not in branch and "bias" not in branch and "mt0 +" in branch
    assert "mod_free=_mod_free(q, k, mt0, ms0)" in src and "MOD_FREE=mod_free" in src
    assert src.count(", MOD_FREE)),") == 2  # both compute warpgroups
    for fields in (dict(score_mod="score + bias[h, q_idx // 2]", mod_tensors=[["bias", "fp32", 2]]),
                   dict(score_mod="score + kv_idx * s", mod_scalars=[["s", "float"]]), {}):
        other = render(bwd(backend="gluon", **fields)).files[".py"]
        assert "MOD_FREE" not in other and "_mod_free" not in other


def test_an_unordered_only_switch_set_serves_deterministic_false_alone(as_if_hopper, monkeypatch):  # noqa: F811
    """bwd_unordered_switches: picked for deterministic=False only, and only where that mode is the unordered one
    (not GQA causal); fagen.attention carries the mode to resolve as big_bwd 2."""
    from fagen import backends
    from fagen.runtime import resolve

    monkeypatch.setattr(type(backends.GLUON), "bwd_selected_switches", ((),))
    monkeypatch.setattr(type(backends.GLUON), "bwd_unordered_switches", (("window",),))
    win, cuda = bwd(mask="causal", window=True), torch.device("cuda")
    assert hopper.backward_spec(win, cuda) is None and hopper.backward_spec(win, cuda, True).window
    assert hopper.backward_spec(bwd(mask="causal", window=True, gqa=4), cuda, True) is None
    q = torch.zeros(1, 2, 8, 128, dtype=torch.bfloat16)
    assert resolve.resolve(q, q, q, "causal", False, ("window",), False, big_bwd=2).NAME.endswith("_gluon")
    assert not resolve.resolve(q, q, q, "causal", False, ("window",), False, big_bwd=True).NAME.endswith("_gluon")
    monkeypatch.setattr(hopper, "BWD_WINDOW_MIN_WORK", 100)
    q, k, v = _inputs(s=24)
    with pytest.raises(ValueError, match="Gluon kernel"):  # the gluon module's device check: it was called
        fagen.attention(q, k, v, mask="causal", window=(5, 0), deterministic=False)
    assert fagen.attention(q, k, v, mask="causal", window=(5, 0)).shape == q.shape  # Triton, deterministic


def test_the_window_fixed_point_lever_renders_the_window_switch_s_deterministic_mode_only(monkeypatch):
    """variant bwd_window_fixed: a window switch's deterministic dQ as fixed-point adds (BWD_DET_MODE 2); not a
    plain spec's, not with a score_mod (its dS is outside the bound the unit comes from: [Note] Fixed-point dQ)."""
    from fagen import backends

    gluon = dict(backend="gluon", mask="causal")
    monkeypatch.setitem(backends.GLUON.variant, "bwd_window_fixed", 1)
    monkeypatch.setitem(backends.GLUON.variant, "bwd_d128", {})  # a plain d128 spec's own keys: bwd_d128
    monkeypatch.setitem(backends.GLUON.variant, "bwd_window", {})  # a window spec's own keys: bwd_window
    render.cache_clear()
    try:
        assert "BWD_DET_MODE = 2" in render(bwd(window=True, **gluon)).files[".py"]
        assert "BWD_DET_MODE = 0" in render(bwd(**gluon)).files[".py"]
        alibi = dict(score_mod="score + kv_idx * s", mod_scalars=[["s", "float"]])
        assert "BWD_DET_MODE = 0" in render(bwd(window=True, **gluon, **alibi)).files[".py"]
        monkeypatch.setitem(backends.GLUON.variant, "bwd_window_fixed", 0)
        render.cache_clear()
        assert "BWD_DET_MODE = 0" in render(bwd(window=True, **gluon)).files[".py"]
    finally:
        render.cache_clear()
