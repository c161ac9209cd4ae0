"""The GPU's power while a row is timed: average watts and the share of the time it was held at its power cap.

[Note] Power-capped rows
An H100 SXM runs fp8 and bf16 attention at its 700 W limit: the driver lowers the SM clock (1.4-1.98 GHz seen in one
run) whenever the board's power reaches the limit, so a row's TF/s follows its energy per FLOP, the inputs' bits
(random inputs toggle more) and the card's temperature, not its kernel alone (docs/hopper.md, "fp8 forward: the full
mask and the spread (fourteenth session)": the same kernel read 5-15% apart between passes at clocks 1.5-1.98 GHz).
The bench records for each timed row the average power over the timing (the board's energy counter, read before and
after) and the share of that time the driver spent power-capped (NVML's `PERF_POLICY_POWER` counter, in ns), so a
reader sees which rows compare at the cap. Two NVML reads before and two after the timing: no thread, nothing
between the calls. Without NVML (`pip install nvidia-ml-py`, the `bench` extra), on the CPU, or where the driver
lacks a counter, the fields are absent.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Iterator

import torch


@functools.cache
def _nvml():
    """(pynvml module, its handle for each torch device index) or None: NVML is optional."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no package, no driver library, no permission: no power fields
        return None
    return pynvml


def _handle(nv, device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    # NVML numbers the physical devices; CUDA_VISIBLE_DEVICES may hide or reorder them (torch maps the index as its
    # own torch.cuda.power_draw does)
    with contextlib.suppress(Exception):
        index = torch.cuda._get_nvml_device_index(index)
    return nv.nvmlDeviceGetHandleByIndex(index)


def _read(nv, handle) -> tuple[float, int | None, int | None]:
    """(wall seconds, energy mJ, ns power-capped), None where the driver lacks the counter."""
    energy = capped = None
    with contextlib.suppress(Exception):
        energy = int(nv.nvmlDeviceGetTotalEnergyConsumption(handle))
    with contextlib.suppress(Exception):
        value = nv.nvmlDeviceGetFieldValues(handle, [nv.NVML_FI_DEV_PERF_POLICY_POWER])[0]
        if value.nvmlReturn == 0:
            capped = int(value.value.ullVal)
    return time.monotonic(), energy, capped


def fields(start: tuple, end: tuple, limit_w: float | None) -> dict:
    """{watts, power_capped (share 0..1), power_limit_w} from two _read()s; the fields a counter allows."""
    out = {}
    seconds = end[0] - start[0]
    if seconds <= 0:
        return out
    if start[1] is not None and end[1] is not None and end[1] >= start[1]:
        out["watts"] = round((end[1] - start[1]) / 1e3 / seconds, 1)
    if start[2] is not None and end[2] is not None and end[2] >= start[2]:
        out["power_capped"] = round(min(1.0, (end[2] - start[2]) / 1e9 / seconds), 3)
    if out and limit_w:
        out["power_limit_w"] = limit_w
    return out


@contextlib.contextmanager
def window(device: torch.device) -> Iterator[dict]:
    """Yields a dict that holds, after the block, the power fields of the GPU over the block (see fields()); the
    block must end with the device synchronised (the bench's timing does)."""
    result: dict = {}
    nv = _nvml() if device.type == "cuda" else None
    if nv is None:
        yield result
        return
    try:
        handle = _handle(nv, device)
        limit = None
        with contextlib.suppress(Exception):
            limit = nv.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3
        start = _read(nv, handle)
    except Exception:  # noqa: BLE001 - a device NVML cannot see: no power fields
        yield result
        return
    yield result
    result.update(fields(start, _read(nv, handle), limit))
