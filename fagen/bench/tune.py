"""`fagen tune`: search block sizes, warps and stages on the GPU; the winners go into fagen/spec/tuned.json."""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from fagen.bench.cases import BenchOptions, CaseContext, Prepared, Unavailable, Unsupported, first_line, out_of
from fagen.bench.check import check
from fagen.bench.impls import prepare_fagen
from fagen.bench.timing import time_prepared
from fagen.bench.workloads import BenchCase, describe_case, flops, kv_bytes, make_case
from fagen.spec import tuned
from fagen.spec.kernel import KernelSpec
from fagen.backends.triton import smem_bytes as triton_smem_bytes
from fagen.spec.axes import Direction
from fagen.spec.targets import DEFAULT_SMEM_LIMIT

SEARCH = {"block_m": (64, 128), "block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4)}
QUICK_SEARCH = {"block_m": (16, 32), "block_n": (16, 32), "num_warps": (4,), "num_stages": (2,)}
def smem_limit(device: torch.device) -> int:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(getattr(props, "shared_memory_per_block_optin", DEFAULT_SMEM_LIMIT))
    return DEFAULT_SMEM_LIMIT  # the interpreter has no limit; filter as for the H100


def device_arch(device: torch.device) -> str:
    """"sm_90" for an H100; "cpu" for the interpreter, whose entries no spec ever reads."""
    if device.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def candidates(spec: KernelSpec, fixed: dict, search: dict, limit: int) -> tuple[list[dict], list[tuple[dict, str]]]:
    """(configs to try, [(config, why dropped)]): the search grid with the `fixed` axes pinned."""
    axes = {k: (fixed[k],) if k in fixed else v for k, v in search.items()}
    kept, dropped = [], []
    for values in itertools.product(*axes.values()):
        cfg = dict(zip(axes, values))
        need = triton_smem_bytes(dataclasses.replace(spec, **cfg))
        if need > limit:
            dropped.append((cfg, f"needs ~{need // 1024} KB of shared memory > {limit // 1024} KB"))
        else:
            kept.append(cfg)
    return kept, dropped


def verify_case(case: BenchCase, device: torch.device) -> BenchCase:
    """A small ragged problem of the same spec, checked against the float64 reference before any timing.

    Lengths are not multiples of any block size, so every candidate's tail handling is exercised.
    """
    big = device.type == "cuda"
    nodes = min(case.seq_q, 37)
    if case.mask.name == "TREE":
        seq_q, seq_k = nodes, nodes + (300 if big else 40)
    elif case.decode:
        seq_q, seq_k = case.seq_q, 461 if big else 53
    else:
        seq_q, seq_k = (333, 461) if big else (37, 53)
        if case.mask.padded:
            seq_k = seq_q
    return make_case(f"verify-{case.name}", head_dim=case.head_dim, mask=case.mask, batch=2, heads_q=2 * case.gqa,
                     heads_kv=2, seq_q=seq_q, seq_k=seq_k, seed=7, dtype=case.dtype, direction=case.direction,
                     overrides=case.overrides, metric=case.metric)


@dataclasses.dataclass
class Trial:
    config: dict
    status: str  # "ok", "rejected" (wrong output), "error" (did not compile or run)
    ms: float | None = None
    note: str = ""


def _warm(prepared: Prepared, cc: CaseContext) -> None:
    """One call, forward or forward + backward, so that every kernel of the config is compiled."""
    s = cc.sets[0]
    if cc.case.direction is Direction.BWD:
        leaves = [t.detach().clone().requires_grad_() for t in (s.q, s.k, s.v)]
        out = out_of(prepared.fn(dataclasses.replace(s, q=leaves[0], k=leaves[1], v=leaves[2])))
        torch.autograd.grad(out, leaves, s.dout)
    else:
        with torch.no_grad():
            prepared.fn(s)


# [Note] Parallel compilation
# Compiling dominates tuning (about 60 compiles per key, the small verify shape and the timed shape specialise
# differently), and Triton compiles on one core. So `jobs` processes first call every candidate once on both
# shapes; Triton's on-disk cache then serves the sequential verify-and-time loop, whose timings stay undisturbed.
def precompile(case: BenchCase, configs: list[dict], device: torch.device, jobs: int, seed: int,
               log: Callable[[str], None], deadline: float | None = None) -> None:
    if device.type != "cuda" or jobs <= 1 or len(configs) <= 1:
        return
    from fagen.bench.runner import kill, worker_env

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fagen-tune-") as tmp:
        procs = []
        for i in range(min(jobs, len(configs))):
            job = Path(tmp) / f"job{i}.json"
            job.write_text(json.dumps({"case": case.to_dict(), "configs": configs[i::jobs], "seed": seed,
                                       "device": device.type}))
            procs.append(subprocess.Popen([sys.executable, "-m", "fagen.bench.tune", str(job)], env=worker_env(),
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True))
        try:
            for proc in procs:
                left = None if deadline is None else max(1.0, deadline - time.monotonic())
                proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            log("  precompiling ran into the time limit")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    kill(proc)
    log(f"  precompiled {len(configs)} candidates in {len(procs)} processes ({time.monotonic() - t0:.0f} s)")


def _precompile_main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    case, device = BenchCase.from_dict(job["case"]), torch.device(job["device"])
    small = verify_case(case, device)
    contexts = [(small, CaseContext(small, device, 1, job["seed"])), (case, CaseContext(case, device, 1, job["seed"]))]
    for cfg in job["configs"]:
        for c, cc in contexts:
            try:
                _warm(prepare_fagen(dataclasses.replace(c, overrides=tuple({**dict(c.overrides), **cfg}.items())), cc),
                      cc)
            except Exception:  # noqa: BLE001 - the sequential loop records what fails
                pass


def tune_case(case: BenchCase, device: torch.device, opts: BenchOptions, search: dict, fixed: dict,
              log: Callable[[str], None] = print, deadline: float | None = None,
              jobs: int = 1) -> tuple[list[Trial], dict | None]:
    """Every candidate: verify on a small case, then time on `case`. Returns (trials, winning entry or None)."""
    spec, _ = case.spec(hopper=False)
    kept, dropped = candidates(spec, fixed, search, smem_limit(device))
    log(f"{case.name}: {len(kept)} candidates ({len(dropped)} dropped by the shared-memory filter)")
    precompile(case, kept, device, jobs, opts.seed, log, deadline)
    small = verify_case(case, device)
    cc_small, cc = CaseContext(small, device, 1, opts.seed), CaseContext(case, device, opts.sets, opts.seed)
    base = dict(case.overrides)
    trials: list[Trial] = []
    for n, cfg in enumerate(kept, 1):
        if deadline is not None and time.monotonic() > deadline:
            log("  time limit reached before the search was complete: nothing is stored for this key")
            return trials, None
        overrides = tuple({**base, **cfg}.items())
        t0 = time.monotonic()
        try:
            c_small = dataclasses.replace(small, overrides=overrides)
            status, msg, _ = check("fagen", prepare_fagen(c_small, cc_small), cc_small)
            if status != "ok":
                trial = Trial(cfg, "rejected", note=msg or status)
            else:
                times = time_prepared(prepare_fagen(dataclasses.replace(case, overrides=overrides), cc), cc, opts)
                trial = Trial(cfg, "ok", ms=times["ms"])
        except (Unsupported, Unavailable) as e:
            log(f"  cannot tune {case.name}: {e}")
            return trials, None
        except Exception as e:  # noqa: BLE001 - out of resources, a compile failure: the next config goes on
            trial = Trial(cfg, "error", note=first_line(e))
            if isinstance(e, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
        trials.append(trial)
        cfg_txt = " ".join(f"{k}={v}" for k, v in cfg.items())
        result = f"{trial.ms:.4g} ms" if trial.ms is not None else f"{trial.status}: {trial.note}"
        log(f"  [{n}/{len(kept)}] {cfg_txt}: {result} ({time.monotonic() - t0:.1f} s)"[:220])
    best = choose(trials, {k: getattr(spec, k) for k in kept[0]} if kept else {})
    if best is None:
        return trials, None
    if best.note:
        log(f"  {best.note}")
    entry = {"arch": device_arch(device), "head_dim": spec.head_dim, "mask": spec.mask.value,
             "dtype": spec.dtype.value, "direction": spec.direction.value, "kind": spec.kind.value, **best.config,
             "ms": round(best.ms, 5), "shape": describe_case(case), "verified_on": describe_case(small),
             "candidates": len(kept), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
             **({"note": best.note} if best.note else {})}
    rate = kv_bytes(case) / best.ms / 1e6 if case.decode else flops(case) / best.ms / 1e9  # GB/s or TFLOP/s
    entry["gbs" if case.decode else "tflops"] = float(f"{rate:.4g}")
    if device.type == "cuda":
        entry["gpu"] = torch.cuda.get_device_name(device)
    return trials, entry


# A new winner replaces the config specs have today only if it is faster by more than this: run-to-run spread on
# the H100 is a few percent, and a config change renames catalog kernels (2026-11-25: a 0.25% win).
KEEP_MARGIN = 0.01


def choose(trials: list[Trial], incumbent: dict, margin: float = KEEP_MARGIN) -> Trial | None:
    """The fastest verified trial, unless the incumbent (the config specs get today, timed in the same search) is
    within `margin` of it: then the incumbent, with a note saying so. None when no trial passed."""
    ok = [t for t in trials if t.status == "ok"]
    if not ok:
        return None
    best = min(ok, key=lambda t: t.ms)
    same = [t for t in ok if t.config == incumbent]
    if same and same[0] is not best and same[0].ms <= best.ms * (1 + margin):
        cfg = " ".join(f"{k}={v}" for k, v in best.config.items())
        note = (f"kept the incumbent: the fastest ({cfg}, {best.ms:.4g} ms) is within {margin:.0%} of it "
                f"({same[0].ms:.4g} ms)")
        return dataclasses.replace(same[0], note=note)
    return best


def unique_by_key(cases: list[BenchCase]) -> list[BenchCase]:
    """The first case of each tuning key (head_dim, mask, dtype, direction, kind); gqa is not part of the key."""
    seen, out = set(), []
    for case in cases:
        spec, _ = case.spec(hopper=False)
        key = (spec.head_dim, spec.mask, spec.dtype, spec.direction, spec.kind)
        if key not in seen:
            seen.add(key)
            out.append(case)
    return out


def existing(table, arch: str, spec: KernelSpec) -> dict | None:
    """The entry of `table` for this spec's key on `arch`; table None: the user's table over the shipped one."""
    return tuned.lookup(spec.head_dim, spec.mask, spec.dtype, spec.direction, spec.kind, arch=arch, path=table)


if __name__ == "__main__":
    _precompile_main(sys.argv[1])
