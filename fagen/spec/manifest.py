"""Manifests: TOML files that describe many variants through explicit kernels and cartesian sweeps."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import tomllib
from pathlib import Path
from typing import Any, Callable

from fagen.spec.targets import ARCHS, ArchError, parse_archs
from fagen.spec.kernel import KernelSpec, SpecError

log = logging.getLogger(__name__)

DEFAULT_CATALOG = Path(__file__).with_name("catalog.toml")
_SECTIONS = {"defaults", "kernel", "sweep"}
_BUILD_KEYS = {"arch"}  # manifest keys that shape the build, not the spec


class ManifestError(ValueError):
    """A manifest is malformed; the message names the file, the entry and the problem."""


@dataclasses.dataclass(frozen=True)
class Manifest:
    path: Path
    specs: tuple[KernelSpec, ...]
    archs: tuple[str, ...]
    dropped: tuple[tuple[dict, str], ...]  # (fields, why) for each variant a predicate dropped


def keep(fields: dict[str, Any]) -> str | None:
    """Why a swept variant is dropped, or None to keep it. Sweeps may cross axes that don't combine."""
    if fields.get("kind") == "decode" and fields.get("direction") == "bwd":
        return "decode kernels are forward-only"
    return None


def _expand(entry: dict[str, Any], where: str) -> list[dict[str, Any]]:
    axes = {k: (v if isinstance(v, list) else [v]) for k, v in entry.items()}
    for k, v in axes.items():
        if not v:
            raise ManifestError(f"{where}: {k} is an empty list")
    return [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())]


def load_manifest(path: str | Path, predicate: Callable[[dict], str | None] = keep) -> Manifest:
    """Parse a manifest; every variant is validated, so a bad entry fails before anything is built."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise ManifestError(f"{path}: cannot be read ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ManifestError(f"{path}: not valid TOML ({e})") from None
    unknown = set(data) - _SECTIONS
    if unknown:
        raise ManifestError(f"{path}: unknown section(s) {sorted(unknown)}; use [defaults], [[kernel]], [[sweep]]")
    defaults = dict(data.get("defaults", {}))
    archs = defaults.pop("arch", ["sm_90"])
    try:
        archs = parse_archs(archs if isinstance(archs, list) else [archs])
    except (ArchError, AttributeError):
        raise ManifestError(f"{path}: [defaults] arch = {archs!r}; use a list of {', '.join(ARCHS)}") from None
    specs: dict[KernelSpec, None] = {}
    dropped = []
    for section in ("kernel", "sweep"):
        entries = data.get(section, [])
        if not isinstance(entries, list):
            raise ManifestError(f"{path}: [{section}] must be an array of tables: write [[{section}]]")
        for n, entry in enumerate(entries):
            where = f"{path}: [[{section}]] #{n + 1}"
            merged = {**defaults, **entry}
            if set(merged) & _BUILD_KEYS:
                raise ManifestError(f"{where}: 'arch' belongs in [defaults]")
            variants = _expand(merged, where) if section == "sweep" else [merged]
            for fields in variants:
                if section == "kernel" and any(isinstance(v, list) for v in fields.values()):
                    raise ManifestError(f"{where}: a [[kernel]] takes single values; use [[sweep]] for lists")
                why = predicate(fields)
                if why:
                    log.info("dropped %s: %s", fields, why)
                    dropped.append((fields, why))
                    continue
                try:
                    specs[KernelSpec.from_dict(fields)] = None
                except SpecError as e:
                    raise ManifestError(f"{where}: {e}") from None
    return Manifest(path=path, specs=tuple(specs), archs=archs, dropped=tuple(dropped))
