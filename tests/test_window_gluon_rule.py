"""[Note] Windows on the Gluon forward (fagen/runtime/api.py): a window call takes the Gluon forward from
WINDOW_MIN_WORK visited pairs, below hopper.MIN_WORK; calls without a window keep MIN_WORK."""

import pytest
import torch

import fagen
from fagen.runtime import api, hopper, resolve


@pytest.fixture
def as_if_hopper(monkeypatch):
    """Pretend the device is an sm_90 GPU with a Gluon-capable triton (as tests/test_hopper_selection.py)."""
    monkeypatch.setattr(hopper, "is_hopper", lambda device: True)
    monkeypatch.setattr(hopper, "gluon_missing", lambda: None)
    monkeypatch.delenv(hopper.ENV, raising=False)
    monkeypatch.setattr(resolve, "_FAST", {})
    monkeypatch.setattr(api, "_FAST", resolve._FAST)


@pytest.mark.skipif(torch.cuda.is_available(), reason="reads the Gluon module's refusal of CPU tensors")
def test_a_window_takes_the_gluon_forward_from_window_min_work(as_if_hopper, monkeypatch):
    q = torch.randn(1, 1, 64, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(api, "MIN_WORK", 64 * 64 + 1)  # no call here reaches it
    monkeypatch.setattr(api, "WINDOW_MIN_WORK", 64 * 40)  # a window (39, 0) visits 64 x 40 pairs
    with pytest.raises(ValueError, match="Gluon kernel"):  # the gluon module's InputError (CPU tensors)
        fagen.attention(q, q, q, mask="causal", window=(39, 0))
    assert fagen.attention(q, q, q, mask="causal", window=(38, 0)).shape == q.shape  # 64 x 39: the Triton one
    assert fagen.attention(q, q, q, mask="causal").shape == q.shape  # no window: MIN_WORK, the Triton one
    monkeypatch.setattr(api, "MIN_WORK", 64 * 40)
    monkeypatch.setattr(api, "WINDOW_MIN_WORK", 1 << 40)  # above MIN_WORK: MIN_WORK still counts
    resolve._FAST.clear()
    with pytest.raises(ValueError, match="Gluon kernel"):
        fagen.attention(q, q, q, mask="causal", window=(39, 0))
