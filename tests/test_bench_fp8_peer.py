"""The cudnn-fp8 bench peer (fagen/bench/peer_cudnn_fp8.py): where it runs, what it computes, how it refuses."""

import sys

import pytest
import torch

from fagen.bench import IMPLS, peer_cudnn_fp8, workloads
from fagen.bench.cases import CaseContext, Unavailable, Unsupported
from fagen.bench.impls import case_impls
from fagen.bench.report import relative_target


def _rows():
    return {c.name: c for c in workloads.standard_suite(quick=True)}


def test_the_peer_lists_only_on_the_fp8_forward_rows():
    rows = _rows()
    fp8 = [name for name, c in rows.items() if "cudnn-fp8" in case_impls(c, IMPLS)]
    assert fp8 == ["fwd-fp8-d128-causal-s16k", "fwd-fp8-d128-full-s16k"]
    assert case_impls(rows["fwd-fp8-d128-full-s16k"], IMPLS) == ("fagen", "cudnn-fp8")  # no SDPA peer takes fp8
    assert "cudnn-fp8" not in case_impls(rows["fwd-d128-full-s16k"], IMPLS)


def test_the_fp8_rows_target_cudnn_fp8():
    by = {("fwd-fp8-d128-full-s16k", "cudnn-fp8"): {"tflops": 800.0, "metric": "tflops", "status": "ok"},
          ("fwd-d128-full-s16k", "fagen"): {"tflops": 600.0, "metric": "tflops", "status": "ok"}}
    text = relative_target("fwd-fp8-d128-full-s16k", 880.0, by)
    assert text == "1.47x fwd-d128-full-s16k (>= 1.5 MISSED); 1.10x cudnn-fp8 (>= 1 met)"


def test_per_tensor_requantization_keeps_the_values():
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 3, 37, 16, generator=gen) * 40).to(torch.float8_e4m3fn)
    s = 0.5 + torch.rand(3, generator=gen)
    y, d = peer_cudnn_fp8._per_tensor(x, s)
    assert y.dtype == x.dtype and d.shape == (1, 1, 1, 1) and float(d) == pytest.approx(float(s.max()))
    want = x.double() * s.double().view(1, -1, 1, 1)
    got = y.double() * d.double()
    assert torch.allclose(got, want, rtol=2 ** -3, atol=2 ** -9 * float(s.max()))  # one more e4m3 rounding
    assert (got - want).abs().max() > 0  # the head with the largest scale is exact, the others rounded again
    top = int(s.argmax())
    assert torch.equal(got[:, top], want[:, top])


def test_without_the_frontend_the_peer_is_unavailable(monkeypatch):
    case = _rows()["fwd-fp8-d128-causal-s16k"]
    monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn raises ImportError
    cc = CaseContext.__new__(CaseContext)
    with pytest.raises(Unavailable, match="pip install nvidia-cudnn-frontend"):
        peer_cudnn_fp8.prepare_cudnn_fp8(case, cc)
    with pytest.raises(Unsupported, match="fp8 forward rows only"):
        peer_cudnn_fp8.prepare_cudnn_fp8(_rows()["fwd-d128-full-s16k"], cc)
