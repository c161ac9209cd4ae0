"""What every backend descriptor has: templates, launcher, limits, defaults, shared memory, checks, selection.

[Note] Backend descriptors
One class per backend holds every fact that differs between backends, as class data where it is data and as a
method where it is a rule, after tinygrad's renderers (`CStyleLanguage` keeps each difference between C-like
targets as class data, and the CUDA renderer is a short subclass). KernelBackend is the base: a backend that has
no opinion on something inherits the base's. Adding a backend is a new small class in fagen/backends/ and one
entry in fagen.backends.BACKENDS; KernelSpec, the renderer, the build and fagen.attention read only these.
"""

from __future__ import annotations

import enum
from typing import Callable, ClassVar

from fagen.spec import targets
from fagen.spec.axes import Backend, Kind, Layout, SpecError

LAUNCH_FIELDS = ("block_m", "block_n", "num_warps", "num_stages")
SCORE_SWITCHES = ("window", "softcap", "alibi", "sinks")


def fit(config: dict, need: Callable[[dict], int], limit: int, given: dict | None = None,
        floors: tuple = (("num_stages", 2), ("block_n", 32), ("block_m", 64), ("num_stages", 1))) -> dict:
    """`config` updated with `given`, its other stages and blocks lowered in the order of `floors` until
    need(config) <= limit (or nothing is left to lower: the spec's own check then names the field)."""
    config = {**config, **(given or {})}
    for field, floor in floors:
        while need(config) > limit and field not in (given or {}) and config[field] > floor:
            config[field] = config[field] - 1 if field == "num_stages" else config[field] // 2
    return config


class KernelBackend:
    """A backend's facts. Subclasses override the class data and the rules that differ."""

    backend: ClassVar[Backend]
    # The template that renders each kind this backend has (the direction is a switch inside it).
    templates: ClassVar[dict[Kind, str]] = {}
    # The Python module that loads and launches a compiled source, for a backend whose source is not Python.
    launcher: ClassVar[str | None] = None
    # The file suffix of a rendered source, and what variant names of this backend end with.
    suffix: ClassVar[str] = ".py"
    name_suffix: ClassVar[str] = ""
    # The memory layouts of q/k/v this backend renders (README "Layouts").
    layouts: ClassVar[tuple[Layout, ...]] = (Layout.DENSE,)
    # What compiles a rendered source ahead of time: "triton" (triton.compile for a target) or "nvcc".
    compiler: ClassVar[str] = "triton"
    # field -> (allowed values, why): what this backend supports beyond KernelSpec's own ranges.
    supported: ClassVar[dict[str, tuple[tuple, str]]] = {}
    # The score switches this backend has, and what to say for another one.
    switches: ClassVar[tuple[str, ...]] = SCORE_SWITCHES
    switches_why: ClassVar[str] = ""
    # The most shared memory a spec of this backend may need (None: the build checks it per arch), and the
    # message's tail when it needs more (formatted with the spec's fields and `limit`).
    smem_limit: ClassVar[int | None] = None
    smem_why: ClassVar[str] = ""
    # Why a spec of this backend has no ahead-of-time build (None: it has one).
    no_aot: ClassVar[str | None] = None

    def default_config(self, spec, arch: str, given: dict) -> dict:
        """block_m, block_n, num_warps and num_stages for the fields `spec` leaves unset, on `arch`; the fields in
        `given` (those the spec sets) stay."""
        raise NotImplementedError

    def template_for(self, spec) -> str:
        """The template that renders `spec` (its kind's, unless a backend tells more)."""
        return self.templates[spec.kind]

    def smem_bytes(self, spec) -> int:
        """The shared memory a block of this spec's kernels needs, by this backend's formula."""
        raise NotImplementedError

    def check(self, spec) -> None:
        """Raise SpecError, naming the field to change, unless this backend can build `spec`."""
        for name, (allowed, why) in self.supported.items():
            value = getattr(spec, name)
            if value not in allowed:
                raise SpecError(name, value.value if isinstance(value, enum.Enum) else value, why)
        for name in spec.switches:
            if name not in self.switches:
                raise SpecError(name, True, self.switches_why)
        self.check_more(spec)
        if self.smem_limit is not None and (need := self.smem_bytes(spec)) > self.smem_limit:
            raise SpecError("num_stages", spec.num_stages,
                            f"needs {need} bytes of shared memory with "
                            + self.smem_why.format(spec=spec, limit=self.smem_limit))

    def check_more(self, spec) -> None:
        """The rules of this backend that are not a table lookup."""

    def aot_missing(self, spec) -> str | None:
        """Why `spec` has no ahead-of-time build (`fagen build` leaves it out and counts it), or None."""
        return self.no_aot

    def tma_loads(self, spec) -> bool:
        """Whether the rendered kernel reads K/V through tensor descriptors (the templates' `tma`)."""
        return False

    def selected(self, spec) -> bool:
        """Whether the measured rule picks this backend for the case of `spec` in place of the default one
        (machine not considered: fagen/runtime/hopper.py adds the device)."""
        return False


def max_smem_limit() -> int:
    return max(targets.ARCH_SMEM_LIMIT.values())
