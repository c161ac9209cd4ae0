"""Run bench cases in order, in-process or in restartable worker processes; records reach the JSON as made."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from fagen import __version__
from fagen.bench.cases import RESTART_EXIT, BenchOptions
from fagen.bench.impls import case_impls, make_record, run_case
from fagen.bench.workloads import BenchCase, describe_case
from fagen.runtime.device import prepare_device

DEADLINE_MARGIN_S = 20.0  # a case is not started with less time than this left
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding fagen/
POLL_S = 0.5


def environment_meta(device: str) -> dict:
    import triton

    meta = {"fagen": __version__, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "device": device, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(["fagen"] + sys.argv[1:])}
    if device.startswith("cuda") and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        meta.update(gpu=torch.cuda.get_device_name(), arch=f"sm_{major}{minor}")
    return meta


def write_json(path: Path | None, meta: dict, records: list[dict]) -> None:
    if path is not None:
        from fagen.files import write_if_different

        write_if_different(Path(path), json.dumps({"meta": meta, "records": records}, indent=1) + "\n")


def read_json(path: Path) -> tuple[dict, list[dict]]:
    """(meta, records) of a bench JSON file (a bare list of records is accepted too)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if isinstance(data, list):
        data = {"records": data}
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise ValueError(f"{path}: expected {{\"meta\": ..., \"records\": [...]}}")
    for i, rec in enumerate(data["records"]):
        missing = [k for k in ("case", "impl", "ms", "tflops", "gbs", "status", "metric") if k not in rec]
        if missing:
            raise ValueError(f"{path}: record {i} lacks {', '.join(missing)}")
    return data.get("meta", {}), data["records"]


def run(cases: list[BenchCase], opts: BenchOptions, *, json_path: Path | None = None, isolate: bool = False,
        time_limit: float | None = None, case_timeout: float = 300.0, log: Callable[[str], None] = print,
        extra_meta: dict | None = None) -> tuple[dict, list[dict]]:
    """(meta, records) of every case x impl, in order. Never raises for a failing impl or case."""
    meta, records = {**environment_meta(opts.device), "rounds": opts.rounds, **(extra_meta or {})}, []
    start = time.monotonic()
    deadline = None if time_limit is None else start + time_limit

    def keep(rec: dict) -> None:
        records.append(rec)
        write_json(json_path, meta, records)

    if isolate:
        # SIGTERM (a wall-clock limit around this run) becomes SystemExit, so the worker is ended on the way out.
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            _run_workers(cases, opts, deadline, case_timeout, log, keep)
        finally:
            signal.signal(signal.SIGTERM, previous)
    else:
        for n, case in enumerate(cases, 1):
            if deadline is not None and time.monotonic() > deadline - DEADLINE_MARGIN_S:
                for impl in case_impls(case, opts.impls):
                    keep(make_record(case, impl, "skipped", note=f"--time-limit {time_limit:.0f} s reached"))
                log(f"[{n}/{len(cases)}] {case.name}: skipped (time limit)")
                continue
            log(f"[{n}/{len(cases)}] {case.name} ({describe_case(case)}) at {time.monotonic() - start:.0f} s")
            run_case(case, opts, log, emit=keep)
    meta["total_s"] = round(time.monotonic() - start, 1)
    write_json(json_path, meta, records)
    log(f"{len(cases)} case(s) in {meta['total_s']:.0f} s")
    return meta, records


# [Note] Worker protocol
# The parent starts `python -m fagen.bench.runner JOB` with the pending (case, impls) items. The worker appends JSON
# lines to an events file: {"start": i}, then {"record": ...} per impl, then {"end": i}. When the worker dies
# (a kernel poisoned the CUDA context, a segfault) or a case outlives --case-timeout, the impl that was running
# gets an error record and a fresh worker takes the rest: its case's remaining impls, then the later cases.
def _run_workers(cases, opts, deadline, case_timeout, log, keep) -> None:
    pending = [(n, case, list(case_impls(case, opts.impls))) for n, case in enumerate(cases, 1)]
    while pending:
        if deadline is not None and time.monotonic() > deadline - DEADLINE_MARGIN_S:
            break
        done, running, reason = _one_worker(pending, len(cases), opts, deadline, case_timeout, log, keep)
        finished = [item for item in pending if item[0] in done]
        if running is None:
            if not finished and not reason:  # it stopped cleanly for lack of time
                break
            if not finished:  # it died before any case: do not loop forever
                for n, case, impls in pending:
                    for impl in impls:
                        keep(make_record(case, impl, "error", note=f"worker failed: {reason}"))
                return
            pending = [item for item in pending if item[0] not in done]
            continue
        n, case, impls, recorded = running
        left = [i for i in impls if i not in recorded]
        if not reason:  # the worker left on purpose after a CUDA error it recorded: a fresh one takes the rest
            pending = ([(n, case, left)] if left else []) + [item for item in pending if item[0] > n]
            continue
        if left:
            keep(make_record(case, left[0], "error", note=reason))
            log(f"  {left[0]:<15} error: {reason}")
        timed_out = "timed out" in reason
        rest = [] if timed_out else left[1:]
        if timed_out:
            for impl in left[1:]:
                keep(make_record(case, impl, "skipped", note="its case timed out"))
        pending = ([(n, case, rest)] if rest else []) + [item for item in pending if item[0] > n]
    for n, case, impls in pending:
        for impl in impls:
            keep(make_record(case, impl, "skipped", note="--time-limit reached"))
        log(f"[{n}/{len(cases)}] {case.name}: skipped (time limit)")


def _one_worker(pending, total, opts, deadline, case_timeout, log, keep):
    """Run one worker over `pending`; returns (ended case numbers, (n, case, impls, recorded) or None, why)."""
    by_n = {n: (case, impls) for n, case, impls in pending}
    with tempfile.TemporaryDirectory(prefix="fagen-bench-") as tmp:
        job, events, err = Path(tmp) / "job.json", Path(tmp) / "events.jsonl", Path(tmp) / "stderr.txt"
        job.write_text(json.dumps({
            "items": [{"n": n, "total": total, "case": c.to_dict(), "impls": i} for n, c, i in pending],
            "options": opts.to_dict(), "events": str(events),
            "time_left": None if deadline is None else deadline - time.monotonic()}))
        sys.stdout.flush()
        with open(err, "w") as err_file:
            proc = subprocess.Popen([sys.executable, "-m", "fagen.bench.runner", str(job)], stderr=err_file, env=worker_env(),
                                    start_new_session=True)  # its own process group: compile workers die with it
            try:
                done, current, recorded, reason = _follow(proc, events, err, deadline, case_timeout, keep)
            finally:
                if proc.poll() is None:
                    kill(proc)
    if current is None:
        return done, None, reason
    case, impls = by_n[current]
    return done, (current, case, impls, recorded), reason


def _follow(proc, events: Path, err: Path, deadline, case_timeout, keep):
    """Read the worker's events until it exits or is killed: (ended cases, running case, its impls done, why)."""
    done, current, recorded, seen, started, reason = set(), None, [], 0, 0.0, ""
    while True:
        rc = proc.poll()
        text = events.read_text() if events.exists() else ""
        complete = text.split("\n")[:-1]  # lines end with a newline: what follows the last is half-written
        for line in complete[seen:]:
            event = json.loads(line)
            if "start" in event:
                current, recorded, started = event["start"], [], time.monotonic()
            elif "record" in event:
                keep(event["record"])
                recorded.append(event["record"]["impl"])
            elif "end" in event:
                done.add(event["end"])
                current = None
        seen = len(complete)
        if rc is not None:
            if rc == RESTART_EXIT:
                reason = ""
            elif rc != 0 or current is not None:
                tail = " | ".join(err.read_text().strip().splitlines()[-2:])[-200:]
                reason = f"worker died (exit {rc}){': ' + tail if tail else ''}"
            break
        if current is not None and time.monotonic() - started > case_timeout:
            kill(proc)
            reason = f"case timed out after {case_timeout:.0f} s (--case-timeout)"
            break
        if deadline is not None and time.monotonic() > deadline:
            kill(proc)
            reason = "timed out: --time-limit reached"
            break
        time.sleep(POLL_S)
    return done, current, recorded, reason


def worker_env() -> dict:
    """The environment of a worker process: this one's, with this fagen first on the import path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return env


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def kill(proc: subprocess.Popen) -> None:
    """End the worker this run started, and its process group (inductor's compile workers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _worker_main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    opts = BenchOptions(**{**job["options"], "impls": tuple(job["options"]["impls"])})
    prepare_device(opts.device)
    deadline = None if job["time_left"] is None else time.monotonic() + job["time_left"]
    start = time.monotonic()
    with open(job["events"], "a", buffering=1) as events:
        def emit(event: dict) -> None:
            events.write(json.dumps(event) + "\n")
            events.flush()

        for item in job["items"]:
            if deadline is not None and time.monotonic() > deadline - DEADLINE_MARGIN_S / 2:
                return  # the parent records the rest as skipped
            case = BenchCase.from_dict(item["case"])
            print(f"[{item['n']}/{item['total']}] {case.name} ({describe_case(case)}) "
                  f"at +{time.monotonic() - start:.0f} s in worker {os.getpid()}", flush=True)
            emit({"start": item["n"]})
            run_case(case, dataclasses.replace(opts, impls=tuple(item["impls"])),
                     lambda line: print(line, flush=True), emit=lambda r: emit({"record": r}), exit_on_fatal=True)
            emit({"end": item["n"]})


if __name__ == "__main__":
    _worker_main(sys.argv[1])
