"""KernelSpec: the small, validated description of one attention kernel variant."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import tomllib
from functools import cached_property
from pathlib import Path
from typing import Any

from fagen.spec import defaults, tables, targets
from fagen.spec.axes import (BLOCK_SIZES, HEAD_DIMS, MAX_GQA, NUM_STAGES, NUM_WARPS, Backend, Direction, DType, Kind,
                             Mask)


class SpecError(ValueError):
    """A spec value is invalid. Carries the field, the value given and what is allowed."""

    def __init__(self, field: str, value: Any, allowed: str):
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{field}: got {value!r}; {allowed}")


def _int_field(name: str, value: Any, ok, allowed: str) -> int:
    # bool is an int subclass; True is never a head dim.
    if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
        raise SpecError(name, value, allowed)
    return value


def _enum_field(name: str, value: Any, enum_cls) -> Any:
    if isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(value)
    except ValueError:
        raise SpecError(name, value, "must be one of " + ", ".join(repr(c) for c in enum_cls.choices())) from None


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One kernel variant. Frozen; every field is validated and defaults resolved on construction.

    Fields reach templates only as enums and integers, so no user text is pasted into source.
    """

    head_dim: int
    mask: Mask = Mask.NONE
    gqa: int = 1
    dtype: DType = DType.FP16
    direction: Direction = Direction.FWD
    backend: Backend = Backend.TRITON
    kind: Kind = Kind.PREFILL
    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self) -> None:
        put = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass
        put("head_dim", _int_field("head_dim", self.head_dim, lambda d: d in HEAD_DIMS,
                                   "must be a multiple of 8 from 16 to 256 (for example 64, 80, 128)"))
        put("mask", _enum_field("mask", self.mask, Mask))
        put("dtype", _enum_field("dtype", self.dtype, DType))
        put("direction", _enum_field("direction", self.direction, Direction))
        put("backend", _enum_field("backend", self.backend, Backend))
        put("kind", _enum_field("kind", self.kind, Kind))
        put("gqa", _int_field("gqa", self.gqa, lambda g: 1 <= g <= MAX_GQA,
                              f"must be an integer from 1 (MHA) to {MAX_GQA}: query heads per KV head"))
        if self.kind is Kind.DECODE and self.direction is not Direction.FWD:
            raise SpecError("direction", str(self.direction),
                            "decode kernels are forward-only: use direction 'fwd', or kind 'prefill' for a backward")
        if (self.backend, self.kind) not in tables.TEMPLATE:
            have = ", ".join(f"{b}/{k}" for b, k in tables.TEMPLATE)
            raise SpecError("backend", f"{self.backend}/{self.kind}",
                            f"no templates for this backend and kind yet; available: {have}")
        if self.backend is Backend.CUDA:
            config = defaults.cuda_default_config(self.head_dim, self.dtype, self.direction, self.kind)
        elif self.backend is Backend.GLUON:
            config = defaults.gluon_default_config(self.head_dim)
        else:
            config = defaults.default_config(self.head_dim, self.dtype, self.direction, self.kind, mask=self.mask)
        for name, allowed, desc in (
            ("block_m", BLOCK_SIZES, "must be a power of two from 16 to 256"),
            ("block_n", BLOCK_SIZES, "must be a power of two from 16 to 256"),
            ("num_warps", NUM_WARPS, "must be one of 1, 2, 4, 8, 16"),
            ("num_stages", NUM_STAGES, "must be an integer from 1 to 8"),
        ):
            value = getattr(self, name)
            put(name, config[name] if value is None else _int_field(name, value, lambda v: v in allowed, desc))
        if self.backend is Backend.CUDA:
            self._check_cuda()
        elif self.backend is Backend.GLUON:
            self._check_gluon()

    def _check_cuda(self) -> None:
        """The cuda backend's own limits (defaults.CUDA_SUPPORTED); the message names the field to change."""
        for name, (allowed, why) in defaults.CUDA_SUPPORTED.items():
            value = getattr(self, name)
            if value not in allowed:
                raise SpecError(name, value.value if isinstance(value, enum.Enum) else value, why)
        rows = self.block_m // self.num_warps
        if self.block_m % self.num_warps or rows not in defaults.CUDA_ROWS_PER_WARP:
            ok = ", ".join(str(self.block_m // r) for r in defaults.CUDA_ROWS_PER_WARP)
            raise SpecError("num_warps", self.num_warps,
                            f"the cuda backend gives each warp 16 or 32 query rows: with block_m {self.block_m} "
                            f"use num_warps {ok}")
        smem = targets.cuda_smem_bytes(self.head_dim, self.dtype, self.block_m, self.block_n, self.num_stages)
        limit = max(targets.ARCH_SMEM_LIMIT.values())
        if smem > limit:
            raise SpecError("num_stages", self.num_stages,
                            f"needs {smem} bytes of shared memory with block_m {self.block_m}, block_n "
                            f"{self.block_n}, head_dim {self.head_dim}; no GPU gives a block more than {limit}: "
                            "use fewer stages or a smaller block_n/block_m")

    def _check_gluon(self) -> None:
        """The gluon backend's own limits (defaults.GLUON_SUPPORTED) and its shared memory on sm_90."""
        for name, (allowed, why) in defaults.GLUON_SUPPORTED.items():
            value = getattr(self, name)
            if value not in allowed:
                raise SpecError(name, value.value if isinstance(value, enum.Enum) else value, why)
        smem = targets.smem_bytes(self)
        limit = targets.ARCH_SMEM_LIMIT["sm_90"]
        if smem > limit:
            raise SpecError("num_stages", self.num_stages,
                            f"needs {smem} bytes of shared memory with block_n {self.block_n}, head_dim "
                            f"{self.head_dim}; sm_90 gives a block at most {limit}: use fewer stages or block_n 64")

    # -- names ---------------------------------------------------------------------------
    @cached_property
    def name(self) -> str:
        """Readable, unique per spec: ``attn_fwd_causal_d128_m128n64w8s3_g4_bf16``."""
        prefix = "attn" if self.kind is Kind.PREFILL else "decode"
        suffix = "" if self.backend is Backend.TRITON else f"_{self.backend}"
        return (f"{prefix}_{self.direction}_{tables.MASK_SHORT[self.mask]}_d{self.head_dim}"
                f"_m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"
                f"_g{self.gqa}_{self.dtype}{suffix}")

    @cached_property
    def hash(self) -> str:
        """Content hash of the canonical JSON form (first 16 hex digits of sha256)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    # -- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {f.name: (v.value if isinstance(v := getattr(self, f.name), enum.Enum) else v)
                for f in dataclasses.fields(self)}

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, no whitespace. Equal specs give equal bytes."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def to_toml(self) -> str:
        return "".join(f"{k} = {json.dumps(v)}\n" for k, v in self.to_dict().items())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KernelSpec:
        if not isinstance(data, dict):
            raise SpecError("spec", data, "must be a table/object of spec fields")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = [key for key in data if key not in known]
        if len(unknown) == 1:
            raise SpecError(unknown[0], data[unknown[0]], "unknown spec field; known fields: " + ", ".join(sorted(known)))
        if unknown:
            raise SpecError("spec", ", ".join(unknown), "unknown spec fields; known fields: " + ", ".join(sorted(known)))
        if "head_dim" not in data:
            raise SpecError("head_dim", None, "is required")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> KernelSpec:
        return cls.from_dict(parse_fields(text, "json"))

    @classmethod
    def from_toml(cls, text: str) -> KernelSpec:
        return cls.from_dict(parse_fields(text, "toml"))

    @classmethod
    def from_file(cls, path: str | Path) -> KernelSpec:
        """Read a spec from a .toml or .json file."""
        return cls.from_dict(read_fields(path))


def parse_fields(text: str, fmt: str) -> dict[str, Any]:
    """The raw field table of a JSON or TOML spec, not yet validated. Anything but a table/object is a SpecError."""
    try:
        data = json.loads(text) if fmt == "json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        # The parser's message names line and column; the text itself is not echoed (it may be a whole file).
        raise SpecError("spec", f"<{fmt.upper()} text of {len(text)} characters>", f"is not valid {fmt.upper()}: {e}") \
            from None
    if not isinstance(data, dict):
        raise SpecError("spec", data, f"must be a {'JSON object' if fmt == 'json' else 'TOML table'} of spec fields "
                                      "such as {\"head_dim\": 64, \"mask\": \"causal\"}")
    return data


def read_fields(path: str | Path) -> dict[str, Any]:
    """The raw field table of a .toml or .json spec file."""
    path = Path(path)
    if path.suffix not in (".json", ".toml"):
        raise SpecError("spec", str(path), "must be a .toml or .json file")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise SpecError("spec", str(path), f"cannot be read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise SpecError("spec", str(path), f"is not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") \
            from None
    return parse_fields(text, path.suffix[1:])
