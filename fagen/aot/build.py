"""Build many variants: every (spec, arch) pair, cache hits first, misses in parallel worker processes."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import multiprocessing
import multiprocessing.forkserver
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

from fagen import __version__
from fagen.aot import keys
from fagen import files as cache
from fagen.files import write_if_different
from fagen.aot.artifacts import ArchBuild, CompileError, compile_arch, lookup
from fagen.aot.export import export
from fagen.spec.kernel import KernelSpec


@dataclasses.dataclass(frozen=True)
class Failure:
    name: str
    arch: str
    message: str


@dataclasses.dataclass
class BuildReport:
    records: list[dict]  # one per built (variant, arch), in manifest order: the "variants" of manifest.json
    failures: list[Failure]
    not_started: int  # pairs never started because an earlier one failed (without keep_going)
    seconds: float
    pairs: int  # (variant, arch) pairs asked for, after each spec's unset tiles were resolved per arch


# Called once per finished pair: (spec, arch, build or None, failure or None).
Progress = Callable[[KernelSpec, str, "ArchBuild | None", "Failure | None"], None]


def build(specs: Iterable[KernelSpec], archs: Iterable[str], out_dir: Path, jobs: int | None = None,
          keep_going: bool = False, progress: Progress | None = None, manifest_path: Path | None = None,
          manifest: bool = True) -> BuildReport:
    """Compile every spec for every arch into out_dir, and write out_dir/manifest.json if `manifest`.

    A spec's unset launch fields are resolved for each arch (KernelSpec.for_arch), so one spec may build as two
    variants, each named by its tiles. Cache hits are served in this process; misses compile in up to `jobs`
    worker processes (Triton's compiler is CPU-bound and holds the GIL), after the cache and out_dir were found
    writable (a CacheError otherwise: nothing is compiled). Without keep_going the first failure stops new work
    from starting.
    """
    start = time.perf_counter()
    archs = tuple(archs)
    pairs = build_pairs(specs, archs)
    progress = progress or (lambda *a: None)
    done: dict[tuple[KernelSpec, str], ArchBuild] = {}
    failures: list[Failure] = []
    misses = []
    writable(out_dir, "the output folder", "choose a writable -o folder")
    for spec, arch in pairs:
        try:
            hit = lookup(spec, arch)
        except CompileError as e:  # cached, but over a limit
            failures.append(Failure(spec.name, arch, e.message))
            progress(spec, arch, None, failures[-1])
            continue
        if hit is None:
            misses.append((spec, arch))
        else:
            done[spec, arch] = hit
            progress(spec, arch, hit, None)

    def finish(spec, arch, result=None, error=None):
        if error is None:
            done[spec, arch] = result
            progress(spec, arch, result, None)
            return True
        failures.append(Failure(spec.name, arch, error))
        progress(spec, arch, None, failures[-1])
        return False

    if misses:
        writable(cache.cache_root() / "aot", "the kernel cache", "set FAGEN_CACHE_DIR to a writable folder")
    jobs = max(1, jobs or os.cpu_count() or 1)
    started = 0
    if misses and (min(jobs, len(misses)) == 1 and not _triton_interpreted()):
        for spec, arch in misses:  # one at a time here: no worker start-up cost
            started += 1
            if not finish(spec, arch, *_run_one(spec, arch)) and not keep_going:
                break
    elif misses:
        started = _run_pool(misses, min(jobs, len(misses)), keep_going, finish)

    records = []
    for spec in dict.fromkeys(spec for spec, _ in pairs):
        builds = [done[spec, arch] for arch in archs if (spec, arch) in done]
        if builds:
            records.extend(export(spec, builds, out_dir))
    if manifest:
        write_manifest(out_dir, records, failures, archs, manifest_path)
    return BuildReport(records, failures, len(misses) - started, time.perf_counter() - start, len(pairs))


def writable(folder: Path, what: str, fix: str) -> None:
    """Raise a one-line CacheError unless a file can be created in `folder` (made if missing): checked before a
    build compiles anything, not after minutes of work at the first write."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise cache.CacheError(f"{what} {folder} is not writable ({e.strerror or e}); {fix}. Nothing was compiled")\
            from None


def build_pairs(specs: Iterable[KernelSpec], archs: Iterable[str]) -> tuple[tuple[KernelSpec, str], ...]:
    """Every (spec resolved for arch, arch), in spec order, each once."""
    return tuple(dict.fromkeys((spec.for_arch(arch), arch) for spec in specs for arch in archs))


def _run_one(spec: KernelSpec, arch: str) -> tuple[ArchBuild | None, str | None]:
    try:
        return compile_arch(spec, arch), None
    except CompileError as e:
        return None, e.message
    except Exception as e:  # noqa: BLE001 - a compiler crash is reported against its variant, not raised
        return None, f"{type(e).__name__}: {e}"


def _run_pool(misses, workers: int, keep_going: bool, finish) -> int:
    """Compile `misses` in worker processes; returns how many were started."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with _clean_interpret():  # the fork server imports triton once: it must not be the interpreter's
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "fagen.aot.artifacts"])  # generated modules import torch: pay it once
        multiprocessing.forkserver.ensure_running()
    started = 0
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                                initargs=(env, os.getpid())) as pool:
        futures = {pool.submit(_run_one, spec, arch): (spec, arch) for spec, arch in misses}
        stop = False
        for future in concurrent.futures.as_completed(futures):
            spec, arch = futures[future]
            if future.cancelled():
                continue
            started += 1
            try:
                result, error = future.result()
            except concurrent.futures.process.BrokenProcessPool:
                result, error = None, "the worker process died (killed, or out of memory)"
            if not finish(spec, arch, result, error) and not keep_going and not stop:
                stop = True
                for other in futures:
                    other.cancel()  # those not started yet; running ones finish (and land in the cache)
    return started


def _init_worker(env: dict[str, str], build_pid: int) -> None:
    """Workers see the environment the build started with (cache dir, template dir, TRITON_* knobs)."""
    os.environ.clear()
    os.environ.update(env)
    threading.Thread(target=_exit_with, args=(build_pid,), daemon=True).start()


def _exit_with(build_pid: int) -> None:
    """A worker's parent is the fork server, so it would outlive a killed build: leave when the build is gone.
    Its locks are flock locks and die with it."""
    while True:
        time.sleep(0.5)
        try:
            os.kill(build_pid, 0)
        except ProcessLookupError:
            os._exit(1)
        except PermissionError:
            pass


class _clean_interpret:
    def __enter__(self):
        self.old = os.environ.pop("TRITON_INTERPRET", None)

    def __exit__(self, *exc):
        if self.old is not None:
            os.environ["TRITON_INTERPRET"] = self.old


def _triton_interpreted() -> bool:
    """True if triton was imported under TRITON_INTERPRET=1: its own @jit helpers are then the interpreter's,
    so this process cannot compile and a clean worker must."""
    import triton
    import triton.language.standard as std

    return not isinstance(std.cdiv, triton.runtime.JITFunction)


def write_manifest(out_dir: Path, records: list[dict], failures: list[Failure], archs: tuple[str, ...],
                   manifest_path: Path | None = None) -> Path:
    import triton

    data = {"fagen_version": __version__, "triton_version": triton.__version__, "cache_format": keys.FORMAT_VERSION,
            "manifest": str(manifest_path) if manifest_path else None, "archs": list(archs),
            "variants": records,
            "failures": [{"name": f.name, "arch": f.arch, "error": f.message} for f in failures]}
    path = out_dir / "manifest.json"
    write_if_different(path, json.dumps(data, indent=1) + "\n")
    return path


# -- presentation --------------------------------------------------------------------------------------------
def summary_table(records: list[dict], failures: list[Failure], title: str = "fagen build"):
    """A rich table: one row per (variant, arch); a variant with several kernels shows a/b/c per column."""
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD)
    table.add_column("variant", overflow="fold")
    for col, just in ( ("arch", "left"), ("regs", "right"), ("spills", "right"),
                      ("smem KB", "right"), ("compile s", "right"), ("cached", "center")):
        table.add_column(col, justify=just)
    for r in records:
        per = lambda f: "/".join(f(k) for k in r["kernels"])  # noqa: E731
        spills = per(lambda k: str(k["spills"]))
        table.add_row(r["name"], r["arch"], per(lambda k: str(k["registers"])),
                      f"[yellow]{spills}[/]" if any(k["spills"] for k in r["kernels"]) else spills,
                      per(lambda k: f"{k['shared'] / 1024:.0f}"), f"{r['seconds']:.1f}",
                      "[green]yes[/]" if r["cached"] else "no")
    for f in failures:
        table.add_row(f"[red]{f.name}[/]", f.arch, "", "", "", "", "[red]failed[/]")
    return table
