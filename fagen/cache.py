"""Content-addressed on-disk cache: keys over everything that shapes an artifact, atomic locked writes."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from filelock import FileLock


def cache_root() -> Path:
    """$FAGEN_CACHE_DIR, else $XDG_CACHE_HOME/fagen, else ~/.cache/fagen."""
    env = os.environ.get("FAGEN_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fagen"


def digest(*parts: str | bytes) -> str:
    """sha256 over length-prefixed parts, so ("ab", "c") and ("a", "bc") differ."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def lock_for(path: Path) -> FileLock:
    """A lock for one path, kept under the cache root so output folders hold no lock files."""
    locks = cache_root() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    return FileLock(str(locks / (digest(str(path.resolve()))[:32] + ".lock")))


def write_if_different(path: Path, data: bytes | str) -> bool:
    """Write atomically (temp file + rename) unless the file already holds these bytes. True if written.

    A per-file lock serialises concurrent writers; FileLock releases on process death (flock), so a
    killed build never leaves it held.
    """
    data = data.encode() if isinstance(data, str) else data
    path.parent.mkdir(parents=True, exist_ok=True)
    with lock_for(path):
        try:
            if path.read_bytes() == data:
                return False
        except FileNotFoundError:
            pass
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return True
