"""Where the Gluon forward is chosen: at use time on sm_90, never in the spec ([Note] Hopper selection in
fagen/runtime/hopper.py). The device is faked (as_if_hopper), so these run on any machine."""

import pytest
import torch

import fagen
from fagen.bench.workloads import BenchCase
from fagen.runtime import hopper, resolve
from fagen.spec.kernel import KernelSpec


def gluon(**fields) -> KernelSpec:
    return KernelSpec(backend="gluon", **{"head_dim": 128, "dtype": "bf16", **fields})


# -- selection (use time, never in the spec) ------------------------------------------------------------------
@pytest.fixture
def as_if_hopper(monkeypatch):
    """Pretend the device is an sm_90 GPU with a Gluon-capable triton."""
    monkeypatch.setattr(hopper, "is_hopper", lambda device: True)
    monkeypatch.setattr(hopper, "gluon_missing", lambda: None)
    monkeypatch.delenv(hopper.ENV, raising=False)
    from fagen.runtime import api  # imported before the patch: it binds resolve's _FAST at import
    monkeypatch.setattr(resolve, "_FAST", {})
    monkeypatch.setattr(api, "_FAST", resolve._FAST)


def test_a_spec_never_picks_gluon_by_itself():
    assert KernelSpec(head_dim=128, mask="causal", dtype="bf16").backend.value == "triton"


@pytest.mark.parametrize("fields,picked", [
    (dict(mask="none"), True), (dict(mask="causal", gqa=4), True),
    (dict(mask="causal"), True),  # MHA causal: with the tile counter order ([Note] Gluon tile order)
    (dict(mask="causal", head_dim=64), True),  # d64 MHA causal with S ahead (D64_S_AHEAD; H200, 23rd session)
    (dict(mask="none", head_dim=64), False), (dict(mask="causal", head_dim=64, gqa=2), False),  # Triton there
    (dict(mask="causal", dtype="fp16"), False),  # fp16: a tie
    (dict(mask="padding"), True), (dict(mask="causal+padding", gqa=4), True),  # H200, 22nd session (docs/hopper.md)
    (dict(mask="causal+padding", head_dim=64), False), (dict(mask="padding", dtype="fp16"), False),
    (dict(mask="tree"), False), (dict(mask="causal", direction="bwd"), False),
    (dict(mask="causal", kind="decode"), False), (dict(mask="none", head_dim=80), False),
])
def test_the_rule_picks_measured_wins_only(as_if_hopper, fields, picked):
    spec = KernelSpec(**{"head_dim": 128, "dtype": "bf16", **fields})
    assert hopper.selected(spec) == picked
    if spec.direction.value == "fwd":
        got = hopper.forward_spec(spec, torch.device("cuda"))
        assert got == (gluon(mask=spec.mask, gqa=spec.gqa, head_dim=spec.head_dim) if picked else None)


def test_mha_causal_is_picked_only_with_a_tile_order(as_if_hopper, monkeypatch):
    """[Note] Gluon tile order: the gluon forward beat the Triton one at MHA causal only with the tile counter; without
    an order the Triton forward keeps it (GQA causal is the gluon forward's either way)."""
    from fagen import backends
    monkeypatch.setitem(backends.GLUON.variant, "causal_order", None)
    assert not hopper.selected(KernelSpec(head_dim=128, mask="causal", dtype="bf16"))
    assert hopper.selected(KernelSpec(head_dim=128, mask="causal", dtype="bf16", gqa=4))


@pytest.mark.parametrize("fields,picked", [
    (dict(mask="causal", window=True), True), (dict(mask="causal", gqa=8, window=True), True),
    # the softcap: a tie lost on the H100 (470 vs 477 TF/s, fifteenth session); 1.12x per pass on the H200 (the suite's
    # row, 38 shuffled passes, twenty-second session: docs/hopper.md, "The softcap forward's exponentials")
    (dict(mask="causal", softcap=True), True), (dict(mask="causal", gqa=2, softcap=True), True),
    (dict(mask="none", softcap=True), False), (dict(mask="causal", softcap=True, head_dim=64), False),
    (dict(mask="causal", window=True, softcap=True), False),  # not measured
    (dict(mask="none", window=True), False), (dict(mask="causal", window=True, head_dim=64), False),
    (dict(mask="causal", window=True, sinks=True), False), (dict(mask="causal", alibi=True), False),
    (dict(mask="causal", window=True, direction="bwd"), False),
])
def test_the_rule_picks_the_causal_window_of_the_switches(as_if_hopper, fields, picked):
    """The gluon forward's window block skipping measured +9% over the Triton forward, its causal softcap +12% on the
    H200 (docs/hopper.md)."""
    spec = KernelSpec(**{"head_dim": 128, "dtype": "bf16", **fields})
    assert hopper.selected(spec) == picked
    if spec.direction.value == "fwd":
        got = hopper.forward_spec(spec, torch.device("cuda"))
        assert got == (gluon(mask=spec.mask, gqa=spec.gqa, window=spec.window, softcap=spec.softcap) if picked else None)


def test_a_window_counts_its_own_pairs_toward_min_work(as_if_hopper, monkeypatch):
    """fagen.attention takes the gluon forward by the pairs a window visits, not Sq x Sk."""
    from fagen.runtime import api
    assert api._window_keys(32768, (4095, 0)) == 4096 and api._window_keys(100, (None, 0)) == 100
    assert api._window_keys(32768, (10, None)) == 32768 and api._window_keys(50, (10, 5)) == 16
    if torch.cuda.is_available():
        return
    q = torch.randn(1, 1, 64, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(api, "MIN_WORK", 64 * 40 + 1)  # a window (39, 0) visits 64 x 40 pairs, Sq x Sk is 64 x 64
    resolve._FAST.clear()
    with pytest.raises(ValueError, match="Gluon kernel"):  # the gluon module's InputError (CPU tensors)
        fagen.attention(q, q, q, mask="causal", window=(63, 0))
    assert fagen.attention(q, q, q, mask="causal", window=(39, 0)).shape == q.shape  # the Triton forward
    monkeypatch.setattr(api, "MIN_WORK", 64 * 40)
    resolve._FAST.clear()
    with pytest.raises(ValueError, match="Gluon kernel"):
        fagen.attention(q, q, q, mask="causal", window=(39, 0))
    resolve._FAST.clear()


def test_fagen_hopper_0_switches_it_off(as_if_hopper, monkeypatch):
    monkeypatch.setenv(hopper.ENV, "0")
    assert hopper.forward_spec(KernelSpec(head_dim=128, dtype="bf16"), torch.device("cuda")) is None


def test_no_selection_off_hopper(monkeypatch):
    monkeypatch.delenv(hopper.ENV, raising=False)
    assert not hopper.is_hopper(torch.device("cpu"))
    assert hopper.forward_spec(KernelSpec(head_dim=128, dtype="bf16"), torch.device("cpu")) is None


def test_bench_case_spec_picks_gluon_with_a_note(as_if_hopper):
    case = BenchCase("fwd-d128-full", 128, "none", 1, 16, 16, 1024, 1024)
    spec, note = case.spec("cuda")
    assert spec.backend.value == "gluon" and "gluon" in note and hopper.ENV in note
    assert case.spec("cuda", hopper=False)[0].backend.value == "triton"  # the tuner tunes Triton kernels
    pinned = BenchCase("fwd-d128-causal", 128, "causal", 1, 16, 16, 1024, 1024, overrides=(("block_n", 64),))
    assert pinned.spec("cuda")[0].backend.value == "triton"  # a pinned field keeps the Triton kernel
    bwd = BenchCase("bwd-d128-causal-fp16", 128, "causal", 1, 16, 16, 1024, 1024, direction="bwd", dtype="fp16")
    assert bwd.spec("cuda")[0].backend.value == "triton"  # the gluon backward: tests/test_gluon_bwd_selection.py
    fp16 = BenchCase("fwd-d128-causal-fp16", 128, "causal", 1, 16, 16, 1024, 1024, dtype="fp16")
    assert fp16.spec("cuda")[0].backend.value == "triton"


def test_fagen_attention_routes_forward_only_calls_to_gluon(as_if_hopper, monkeypatch):
    """No gradient: the gluon module (its forward refuses CPU tensors, which shows it was called); with a gradient
    below hopper.BWD_MIN_WORK: the Triton bwd module (the gluon backward's routing: test_gluon_bwd_selection.py)."""
    q = torch.zeros(1, 4, 8, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 8, 128, dtype=torch.bfloat16)
    fwd = resolve.resolve(q, k, k, "causal", False, forward_only=True)
    assert fwd.NAME.endswith("_gluon") and not hasattr(fwd, "attention")
    bwd = resolve.resolve(q, k, k, "causal", False)
    assert bwd.NAME.startswith("attn_bwd_") and not bwd.NAME.endswith("_gluon") and hasattr(bwd, "attention")
    assert not resolve.resolve(q, k, k, "none", False, switches=("window", )).NAME.endswith("_gluon")
    resolve._FAST.clear()
    if not torch.cuda.is_available():
        # fagen.attention takes the gluon forward from hopper.MIN_WORK query-key pairs on (its host path is slower)
        big_q = torch.zeros(1, 16, 2048, 128, dtype=torch.bfloat16)
        big_k = torch.zeros(1, 4, 2048, 128, dtype=torch.bfloat16)
        assert big_q.shape[1] * 2048 * 2048 == hopper.MIN_WORK
        with pytest.raises(ValueError, match="Gluon kernel"):  # the gluon module's InputError
            fagen.attention(big_q, big_k, big_k, mask="causal")
        assert fagen.attention(q, k, k, mask="causal").shape == q.shape  # small: the Triton forward serves
