"""Device choice, once for every command: cuda, or the CPU through Triton's interpreter."""

from __future__ import annotations


class DeviceError(RuntimeError):
    """The requested device cannot run kernels in this process; the message says why and what to do."""


def prepare_device(device: str | None = None) -> str:
    """Pick the device ("cpu" or "cuda"; None or "auto": cuda when available) and set Triton's mode for it.
    Every command that runs kernels calls this once, before any kernel is loaded.

    [Note] Triton reads TRITON_INTERPRET when a @triton.jit function is defined, i.e. when a generated module
    is imported, and fagen memoises imported modules. So the variable is set here, first, and modules already
    imported in the other mode (by earlier code in this process) are refused rather than silently reused.
    """
    import os
    import sys

    import torch  # importing torch defines no Triton kernel, so the mode can still be chosen

    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    interpret = device == "cpu"
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    elif os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise DeviceError("TRITON_INTERPRET=1 is set, so kernels would run in the interpreter: unset it to run "
                          "on the GPU (or use --device cpu)")
    stale = [name for name, mod in list(sys.modules.items())
             if name.startswith("fagen_generated.") and getattr(mod, "_INTERPRET", interpret) != interpret]
    if interpret and "triton" in sys.modules and not sys.modules["triton"].knobs.runtime.interpret:
        stale.append("triton (its interpret knob was switched off in code)")
    if stale:
        raise DeviceError(f"--device {device}: this process already imported kernels in the other Triton mode "
                          f"({', '.join(stale[:3])}); run it in a fresh process")
    if not interpret and not torch.cuda.is_available():
        raise DeviceError(f"--device cuda: torch sees no CUDA device (torch {torch.__version__}); "
                          "use --device cpu to run kernels through Triton's interpreter")
    return device


_ARCHS: dict[int, str] = {}


def gpu_arch() -> str | None:
    """The arch whose tiles the current CUDA device takes (fagen.spec.targets.arch_of: 'sm_80' on an A100), or None
    where kernels run in Triton's interpreter or no GPU is visible."""
    import os

    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device()
    if index not in _ARCHS:
        from fagen.spec.targets import arch_of

        _ARCHS[index] = arch_of(torch.cuda.get_device_capability(index))
    return _ARCHS[index]
