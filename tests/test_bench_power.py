"""The GPU's power over a timed row ([Note] Power-capped rows in fagen/bench/power.py).

The fields come from two reads of NVML's counters (the board's energy in mJ, the ns spent power-capped), before and
after the timing: on the CPU a fake NVML stands for the driver, whose counters advance by what the test says, so
the arithmetic and the report's note are the properties. On the GPU (H100) the real counters give a plausible
power over a real row."""

import types

import pytest
import torch

from _env import ON_GPU
from fagen.bench import power, report


class _FakeNVML:
    """Counters that advance on each read pair as a 700 W card at `watts` capped `share` of the time would."""
    NVML_FI_DEV_PERF_POLICY_POWER = 86

    def __init__(self, watts, share, clock, has_energy=True):
        self.watts, self.share, self.clock, self.has_energy = watts, share, clock, has_energy

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("gpu", i)

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 700_000  # mW

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        if not self.has_energy:
            raise RuntimeError("not supported")
        return int(self.watts * self.clock.t * 1e3)  # mJ

    def nvmlDeviceGetFieldValues(self, h, ids):
        assert ids == [self.NVML_FI_DEV_PERF_POLICY_POWER]
        v = types.SimpleNamespace(nvmlReturn=0, value=types.SimpleNamespace(ullVal=int(self.share * self.clock.t * 1e9)))
        return [v]


class _Time:
    t = 100.0

    def monotonic(self):
        return self.t


def _run(monkeypatch, watts, share, seconds, **kw):
    clock = _Time()
    nv = _FakeNVML(watts, share, clock, **kw)
    monkeypatch.setattr(power, "_nvml", lambda: nv)
    monkeypatch.setattr(power, "time", clock)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with power.window(torch.device("cuda", 0)) as out:
        clock.t += seconds
    return out


@pytest.mark.skipif(ON_GPU, reason="a fake NVML on the CPU")
@pytest.mark.parametrize("watts, share, seconds", [(697.3, 1.0, 0.8), (412.0, 0.0, 0.13), (650.5, 0.37, 2.5)])
def test_window_reads_average_power_and_capped_share(monkeypatch, watts, share, seconds):
    out = _run(monkeypatch, watts, share, seconds)
    assert out["watts"] == pytest.approx(watts, abs=0.1)
    assert out["power_capped"] == pytest.approx(share, abs=1e-3)
    assert out["power_limit_w"] == 700.0


@pytest.mark.skipif(ON_GPU, reason="a fake NVML on the CPU")
def test_window_leaves_out_what_the_driver_cannot_count(monkeypatch):
    out = _run(monkeypatch, 500.0, 0.5, 1.0, has_energy=False)
    assert "watts" not in out and out["power_capped"] == pytest.approx(0.5)
    monkeypatch.setattr(power, "_nvml", lambda: None)  # no pynvml: nothing at all
    with power.window(torch.device("cuda", 0)) as out:
        pass
    assert out == {}
    with power.window(torch.device("cpu")) as out:  # the CPU never asks NVML
        pass
    assert out == {}


def test_report_names_the_capped_rows_only():
    recs = [dict(case="fwd-fp8", impl="fagen", ms=1.0, tflops=900.0, gbs=None, status="ok", metric="tflops",
                 watts=697.4, power_capped=0.98, power_limit_w=700.0),
            dict(case="fwd-fp8", impl="cudnn-fp8", ms=1.0, tflops=950.0, gbs=None, status="ok", metric="tflops",
                 watts=699.0, power_capped=1.0, power_limit_w=700.0),
            dict(case="decode", impl="fagen", ms=0.2, tflops=1.0, gbs=2900.0, status="ok", metric="gbs",
                 watts=420.0, power_capped=0.0, power_limit_w=700.0)]
    notes = report.power_notes(recs)
    assert notes == ["power-capped for at least half the timing (700 W limit), where the clock falls with the "
                     "board's power (average W, share capped): fwd-fp8 fagen 697 W 98%; fwd-fp8 cudnn-fp8 699 W 100%"]
    assert notes[0] in report.markdown(recs)
    assert report.power_notes([{**r, "power_capped": 0.2} for r in recs]) == []
    assert report.power_notes([{k: v for k, v in r.items() if not k.startswith(("watts", "power"))} for r in recs]) == []


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_power_over_a_real_matmul_loop():
    pytest.importorskip("pynvml")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with power.window(torch.device("cuda")) as out:
        for _ in range(200):
            a @ a
        torch.cuda.synchronize()
    assert 50 < out["watts"] <= 1.2 * out.get("power_limit_w", 1000)
    assert 0.0 <= out.get("power_capped", 0.0) <= 1.0
