"""The content-addressed cache as a user meets it: truncated entries, read-only caches, file modes, its location."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import fagen
from fagen import files
from fagen.runtime import loader

SPEC = fagen.KernelSpec(head_dim=16, mask="causal", block_m=16, block_n=16)


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _load_in_a_fresh_process(cache_dir: Path) -> subprocess.CompletedProcess:
    code = ("import fagen; m = fagen.load(fagen.KernelSpec(head_dim=16, mask='causal', block_m=16, block_n=16)); "
            "print(callable(m.forward))")
    env = {**os.environ, "FAGEN_CACHE_DIR": str(cache_dir), "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_a_truncated_cached_source_is_rebuilt(own_cache):
    """Issue 18: a truncated source used to fail every load (AttributeError / SyntaxError) until deleted by hand."""
    path = loader.write_source(SPEC)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 3])
    done = _load_in_a_fresh_process(own_cache)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr
    assert path.read_bytes() == whole


def test_a_warm_read_only_cache_serves_loads(own_cache, monkeypatch):
    """Issue 18: even a fully cached load failed on a read-only cache (its lock files went into cache/locks)."""
    loader.write_source(SPEC)
    real_mkdir, real_mkstemp = Path.mkdir, files.tempfile.mkstemp

    def no_writes_under_cache(path, *args, **kwargs):
        if str(path).startswith(str(own_cache)):
            raise PermissionError(13, "Permission denied", str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", no_writes_under_cache)
    monkeypatch.setattr(files.tempfile, "mkstemp", lambda *a, dir=None, **k: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied", str(dir))) if str(dir).startswith(str(own_cache))
        else real_mkstemp(*a, dir=dir, **k))
    assert loader.write_source(SPEC).exists()  # equal bytes: nothing written, no lock taken
    with pytest.raises(files.CacheError, match="cannot write .*set FAGEN_CACHE_DIR to a writable folder"):
        loader.write_source(fagen.KernelSpec(head_dim=24, block_m=16, block_n=16))  # a miss needs a write


def test_files_honour_the_umask(tmp_path):
    """Issue 18: every file fagen wrote was mode 0600 (mkstemp), whatever the umask."""
    old = os.umask(0o022)
    try:
        files.write_if_different(tmp_path / "a.txt", "x")
        assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o644
        os.umask(0o077)
        files.write_if_different(tmp_path / "b.txt", "x")
        assert stat.S_IMODE((tmp_path / "b.txt").stat().st_mode) == 0o600
    finally:
        os.umask(old)


@pytest.mark.parametrize("xdg, expected", [
    ("", "~/.cache/fagen"), ("relative/dir", "~/.cache/fagen"), ("~/xdg", "~/xdg/fagen"), ("/abs/xdg", "/abs/xdg/fagen"),
])
def test_the_cache_location(monkeypatch, xdg, expected):
    monkeypatch.delenv("FAGEN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    assert files.cache_root() == Path(expected).expanduser()
    monkeypatch.setenv("FAGEN_CACHE_DIR", "~/mine")
    assert files.cache_root() == Path("~/mine").expanduser()
