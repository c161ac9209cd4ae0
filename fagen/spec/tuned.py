"""The tuned launch configs: the shipped table (fagen/spec/tuned.json) under the user's own; load, validate, look up,
update."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from fagen.spec.axes import BLOCK_SIZES, HEAD_DIMS, NUM_STAGES, NUM_WARPS, Direction, DType, Kind, Mask

TUNED_PATH = Path(__file__).with_name("tuned.json")
FORMAT = 1
# [Note] Deterministic specs
# A spec's resolved block sizes must not depend on the machine it is built on, so KernelSpec reads the entries of
# DEFAULT_ARCH unless it is given an arch: KernelSpec(..., arch="sm_80"), spec.for_arch(arch). Those who name one
# are the tuner, `fagen build`/`fagen compile` (each target arch) and fagen.load on a GPU (the GPU's arch); the
# interpreter keeps DEFAULT_ARCH's.
DEFAULT_ARCH = "sm_90"
KEY_FIELDS = ("arch", "head_dim", "mask", "dtype", "direction", "kind")
CONFIG_FIELDS = ("block_m", "block_n", "num_warps", "num_stages")


class TunedTableError(ValueError):
    """The tuned table is malformed; the message names the file, the entry and the field."""


def _key(arch: str, head_dim: int, mask, dtype, direction, kind) -> tuple:
    return (str(arch), int(head_dim), Mask(mask).value, DType(dtype).value, Direction(direction).value,
            Kind(kind).value)


def validate_entry(entry: Any, where: str) -> dict:
    """An entry with every key and config field checked; extra fields (timings, shapes) pass through."""
    if not isinstance(entry, dict):
        raise TunedTableError(f"{where}: expected an object, got {type(entry).__name__}")
    missing = [f for f in KEY_FIELDS + CONFIG_FIELDS if f not in entry]
    if missing:
        raise TunedTableError(f"{where}: missing field(s) {', '.join(missing)}")
    allowed = {"head_dim": HEAD_DIMS, "block_m": BLOCK_SIZES, "block_n": BLOCK_SIZES, "num_warps": NUM_WARPS,
               "num_stages": NUM_STAGES}
    for field, values in allowed.items():
        v = entry[field]
        if isinstance(v, bool) or not isinstance(v, int) or v not in values:
            raise TunedTableError(f"{where}: {field} = {v!r} is not allowed")
    for field, enum_cls in (("mask", Mask), ("dtype", DType), ("direction", Direction), ("kind", Kind)):
        if entry[field] not in enum_cls.choices():
            raise TunedTableError(f"{where}: {field} = {entry[field]!r}; must be one of {enum_cls.choices()}")
    if not isinstance(entry["arch"], str) or not entry["arch"]:
        raise TunedTableError(f"{where}: arch must be a name such as 'sm_90', got {entry['arch']!r}")
    return entry


def read_table(path: Path) -> list[dict]:
    """Every entry of a tuned table, validated. A missing file is an empty table."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TunedTableError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), list):
        raise TunedTableError(f"{path}: expected {{\"format\": {FORMAT}, \"entries\": [...]}}")
    entries = [validate_entry(e, f"{path} entry {i}") for i, e in enumerate(data["entries"])]
    seen: dict[tuple, int] = {}
    for i, e in enumerate(entries):
        k = _key(*(e[f] for f in KEY_FIELDS))
        if k in seen:
            raise TunedTableError(f"{path}: entries {seen[k]} and {i} share the key {dict(zip(KEY_FIELDS, k))}")
        seen[k] = i
    return entries


@functools.cache
def _index(path: str) -> dict[tuple, dict]:
    return {_key(*(e[f] for f in KEY_FIELDS)): {f: e[f] for f in CONFIG_FIELDS} for e in read_table(Path(path))}


def user_table_path() -> Path:
    """The user's tuned table, tuned.json in fagen's cache root ($FAGEN_CACHE_DIR, else ~/.cache/fagen): where
    `fagen tune` writes without --table (never into the installed package), read by lookup() over the shipped
    table."""
    from fagen.files import cache_root

    return cache_root() / "tuned.json"


def lookup(head_dim: int, mask, dtype, direction, kind, arch: str = DEFAULT_ARCH,
           path: Path | None = None) -> dict | None:
    """The tuned config {block_m, block_n, num_warps, num_stages} for this key, or None when there is none.
    Without `path`: the user's table (user_table_path) where it has the key, else the shipped table."""
    if mask is None:
        return None
    key = _key(arch, head_dim, mask, dtype, direction, kind)
    found = _index(str(path)).get(key) if path else \
        _index(str(user_table_path())).get(key) or _index(str(TUNED_PATH)).get(key)
    return dict(found) if found is not None else None


def upsert(path: Path, entry: dict) -> None:
    """Insert or replace one entry (matched on the key fields); written atomically, sorted for stable diffs."""
    from fagen.files import write_if_different

    path = Path(path)
    entry = validate_entry(dict(entry), "new entry")
    key = _key(*(entry[f] for f in KEY_FIELDS))
    entries = [e for e in read_table(path) if _key(*(e[f] for f in KEY_FIELDS)) != key] + [entry]
    entries.sort(key=lambda e: _key(*(e[f] for f in KEY_FIELDS)))
    text = json.dumps({"format": FORMAT, "entries": entries}, indent=1, sort_keys=True) + "\n"
    write_if_different(path, text)
    _index.cache_clear()
