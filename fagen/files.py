"""Files fagen writes: the cache root, content digests, per-path locks and atomic writes that skip equal bytes.

The lowest layer of the package (the standard library and filelock only), so that every stage, the spec's tuned
table included, may write through it. Files are written with the permissions the umask allows (shared caches and
shipped artifacts stay readable), and a warm cache that is read-only still serves reads: nothing is written, and
no lock is taken, for equal bytes."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from filelock import FileLock


class CacheError(OSError):
    """A file fagen must write cannot be written; the message names the path and what to do."""


def cache_root() -> Path:
    """$FAGEN_CACHE_DIR, else $XDG_CACHE_HOME/fagen, else ~/.cache/fagen. "~" is expanded; an empty or relative
    XDG_CACHE_HOME is ignored, as the XDG base-directory spec says. A relative FAGEN_CACHE_DIR is resolved once, at
    first use, against the working directory of that moment, and written back to the environment as that absolute
    path: a later chdir, and every child process (build workers, torchrun ranks), keep the same folder."""
    env = os.environ.get("FAGEN_CACHE_DIR")
    if env:
        path = Path(env).expanduser()
        if not path.is_absolute():
            path = path.absolute()
            os.environ["FAGEN_CACHE_DIR"] = str(path)
        return path
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg).expanduser() if xdg and Path(xdg).expanduser().is_absolute() else Path.home() / ".cache"
    return base / "fagen"


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _writable_dir(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK | os.X_OK)


def digest(*parts: str | bytes) -> str:
    """sha256 over length-prefixed parts, so ("ab", "c") and ("a", "bc") differ."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def lock_for(path: Path) -> FileLock:
    """A lock for one path, kept under the cache root so output folders hold no lock files.

    A read-only cache (a warm cache shipped in a container, say) keeps its locks in the temp folder instead.
    """
    for locks in (cache_root() / "locks", Path(tempfile.gettempdir()) / f"fagen-locks-{os.getuid()}"):
        if _writable_dir(locks):
            return FileLock(str(locks / (digest(str(path.resolve()))[:32] + ".lock")), mode=0o666 & ~_umask())
    raise CacheError(f"no folder for lock files: neither {cache_root() / 'locks'} nor the temp folder is writable; "
                     "set FAGEN_CACHE_DIR to a writable folder")


def write_if_different(path: Path, data: bytes | str) -> bool:
    """Write atomically (temp file + rename) unless the file already holds these bytes. True if written.

    A per-file lock serialises concurrent writers; FileLock releases on process death (flock), so a
    killed build never leaves it held.
    """
    data = data.encode() if isinstance(data, str) else data
    path = Path(path)
    try:  # renames are atomic, so an unlocked read sees a whole file: equal bytes need no lock
        if path.read_bytes() == data:
            return False
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as e:
        raise CacheError(f"cannot read {path}: {e.strerror}") from None
    try:
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
                os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; the file gets what the umask allows
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
    except CacheError:
        raise
    except OSError as e:
        hint = ("set FAGEN_CACHE_DIR to a writable folder" if _inside(path, cache_root())
                else "choose a writable output folder")
        raise CacheError(f"cannot write {path}: {e.strerror or e}; {hint}") from None
    return True


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False
