"""`fagen bench`: check and time fagen's kernels and the peers (SDPA backends, FlexAttention) on one case."""

from __future__ import annotations

import os
import time
from typing import Callable

import torch

from fagen.bench.cases import (IMPLS, RESTART_EXIT, STATUSES, BenchOptions, CaseContext, Prepared, Unavailable,
                               Unsupported, first_line, shorten)
from fagen.bench.check import check
from fagen.bench.rounds import interleave, summarize
from fagen.bench.timing import time_prepared
from fagen.bench.workloads import BWD_FACTOR, BenchCase, copy_relative, flops, fwd_flops, kv_bytes
from fagen.spec.axes import Direction, DType

__all__ = ["IMPLS", "STATUSES", "RESTART_EXIT", "BenchOptions", "run_case", "make_record", "describe", "preparers",
           "prepare_fagen"]


def prepare_fagen(case: BenchCase, cc: CaseContext) -> Prepared:
    from fagen.runtime.loader import load

    spec, note = case.spec(cc.device)
    try:
        module = load(spec)
    except Exception as e:  # a template not written yet (say the backward) is not a crash of the bench
        raise Unavailable(f"cannot render/load {spec.name}: {first_line(e)}") from None
    if case.direction is Direction.BWD:
        if not hasattr(module, "attention"):
            raise Unsupported(f"{spec.name} has no backward yet (module.attention missing)")
        return Prepared(lambda s: module.attention(s.q, s.k, s.v, **s.kwargs, **s.scores), note=note,
                        spec=spec.name)
    if case.dtype is DType.FP8_E4M3:  # k_scale / v_scale (make_inputs) are the fp8 forward's descales; q's is 1.
        def fp8(s):  # out only: the fp8 wgmma's accumulation puts lse ~1e-2 off (H100: 8e-3 on these rows), past
            # LSE_TOLERANCE; scripts/gpu_fp8.py checks it (docs/hopper.md, "fp8 lse with outliers")
            scores = {name: t for name, t in s.scores.items() if name not in ("k_scale", "v_scale")}
            return module.forward(s.q, s.k, s.v, k_descale=s.scores["k_scale"], v_descale=s.scores["v_scale"],
                                  **s.kwargs, **scores)[0]
        return Prepared(fp8, note=note, spec=spec.name)
    if case.page_size is not None:  # the paged caches of make_inputs (the reference reads the dense k, v)
        return Prepared(lambda s: module.forward(s.q, s.paged["k_cache"], s.paged["v_cache"], **s.kwargs,
                                                 block_table=s.paged["block_table"], seqlens_k=s.paged["seqlens_k"],
                                                 **s.scores), note=note, spec=spec.name)
    return Prepared(lambda s: module.forward(s.q, s.k, s.v, **s.kwargs, **s.scores), note=note, spec=spec.name)


def prepare_fagen_nondet(case: BenchCase, cc: CaseContext) -> Prepared:
    """fagen.attention(deterministic=False)'s backward: the gluon backward's unordered dQ adds where the rule gives
    them (fagen.runtime.hopper.unordered); n/a elsewhere, where the default kernel serves both modes."""
    from fagen.runtime import hopper
    from fagen.runtime.loader import load

    spec, note = case.spec(cc.device)
    module = load(spec) if case.direction is Direction.BWD else None
    if module is None or not hopper.unordered(module):
        raise Unsupported(f"deterministic=False runs {spec.name}, the kernel of column fagen")
    return Prepared(lambda s: module.attention(s.q, s.k, s.v, deterministic=False, **s.kwargs, **s.scores),
                    note="gluon Hopper backward, unordered dQ adds", spec=spec.name)


# [Note] Copy reference
# Issue 27 sets decode targets as a share of the device's copy bandwidth ("% of copy", over the bytes the kernel
# reads). The copy is timed here as the row's implementations are: the same measure (the same L2 flush, warm-up and
# median), its own buffers per input set (rotated as the row's inputs are), and the row's bytes, kv_bytes: half read
# and half written, counted as kv_bytes. Rows whose RELATIVE_TARGETS name "copy" run it; its column is a reference,
# never a peer (report.rows leaves it out of "fagen/best peer"). Before, the scripts divided by a 1 GB copy timed
# apart (docs/serving.md, "fp8 KV decode, twelfth session").
COPY = "copy"


def prepare_copy(case: BenchCase, cc: CaseContext) -> Prepared:
    if not (case.decode and copy_relative(case)):
        raise Unsupported("the copy reference runs the decode rows whose target is a share of it")
    half = kv_bytes(case) // 2
    bufs = {id(s): (torch.ones(half, dtype=torch.uint8, device=cc.device),
                    torch.empty(half, dtype=torch.uint8, device=cc.device)) for s in cc.sets}
    return Prepared(lambda s: bufs[id(s)][1].copy_(bufs[id(s)][0]),
                    note="torch copy_ of the row's bytes (half read, half written), timed as the row")


def preparers() -> dict[str, Callable[[BenchCase, CaseContext], Prepared]]:
    from fagen.bench import peer_cudnn_fp8, peers

    return {"fagen": prepare_fagen, "fagen-nondet": prepare_fagen_nondet,
            **{name: peers.sdpa_preparer(name) for name in peers.SDPA_BACKENDS},
            peer_cudnn_fp8.NAME: peer_cudnn_fp8.prepare_cudnn_fp8, "flex": peers.prepare_flex, COPY: prepare_copy}


def case_impls(case: BenchCase, impls) -> tuple[str, ...]:
    """The implementations that run a case: all asked for, or fagen alone on a baseline row (case.peers False);
    cudnn-fp8 runs the fp8 forward rows and nothing else; copy the rows whose target is a share of it."""
    from fagen.bench.peer_cudnn_fp8 import applies

    fp8_fwd = applies(case)
    return tuple(i for i in impls if (copy_relative(case) if i == COPY else (
        (case.peers or i == "fagen" or (fp8_fwd and i == "cudnn-fp8"))
        and (i != "fagen-nondet" or case.direction is Direction.BWD) and (i != "cudnn-fp8" or fp8_fwd))))


def make_record(case: BenchCase, impl: str, status: str, ms: float | None = None, **extra) -> dict:
    """One JSON record: {case, impl, ms, tflops, gbs} plus status, check, note and details."""
    rec = {"case": case.name, "impl": impl, "ms": ms, "tflops": None, "gbs": None, "status": status,
           "metric": case.metric, "direction": case.direction.value, "check": None, "note": ""}
    if ms is not None and ms > 0:
        rec["tflops"] = flops(case) / ms / 1e9  # FLOP / (ms * 1e-3) / 1e12
        if case.decode:
            rec["gbs"] = kv_bytes(case) / ms / 1e6  # bytes / (ms * 1e-3) / 1e9
    if extra.get("fwdbwd_ms"):
        extra["fwdbwd_tflops"] = fwd_flops(case) * (1 + BWD_FACTOR) / extra["fwdbwd_ms"] / 1e9
    rec.update(extra)
    return rec


def _fatal_cuda(e: BaseException) -> bool:
    text = str(e)
    return any(s in text for s in ("illegal memory access", "device-side assert", "CUDA error: unspecified launch",
                                   "misaligned address", "an illegal instruction"))


def run_case(case: BenchCase, opts: BenchOptions, log: Callable[[str], None] = print,
             emit: Callable[[dict], None] | None = None, exit_on_fatal: bool = False) -> list[dict]:
    """Every requested implementation on one case: check, then time. Failures become records, never raise.

    `emit` sees each record as soon as it exists. After a CUDA error that poisons the context, the remaining
    impls are skipped, or with `exit_on_fatal` the process exits so that a fresh one can take over. With
    opts.rounds > 1 every impl is checked first and then all are timed in interleaved rounds ([Note] Interleaved
    rounds in fagen/bench/rounds.py); with 1 each is checked and timed in turn.
    """
    device = torch.device(opts.device)
    t_case = time.perf_counter()
    try:
        cc = CaseContext(case, device, opts.sets, opts.seed)
    except Exception as e:
        return [make_record(case, impl, "error", note=f"inputs: {first_line(e)}")
                for impl in case_impls(case, opts.impls)]
    records, prep, lost = [], preparers(), None

    def keep(rec: dict, wall_s: float, fatal: bool = False) -> None:
        rec["wall_s"] = round(wall_s, 2)
        records.append(rec)
        log(describe(rec))
        if emit is not None:
            emit(rec)
        if fatal and exit_on_fatal:
            log(f"  CUDA context lost in {rec['impl']}; this worker exits and a fresh one goes on")
            os._exit(RESTART_EXIT)

    held = {}  # with rounds: impl -> its record (a failure) or (prepared, record fields), kept in impl order at the end
    for impl in case_impls(case, opts.impls):
        if lost is not None:
            records.append(make_record(case, impl, "skipped", note=f"CUDA context lost earlier ({lost})"))
            continue
        t0 = time.perf_counter()
        try:
            prepared, fields = _set_up(impl, prep, cc, opts)
            if opts.rounds > 1:
                held[impl] = (prepared, fields), time.perf_counter() - t0
                continue
            with prepared.context():
                times = time_prepared(prepared, cc, opts)
            rec = make_record(case, impl, "ok", **fields, **times)
        except Exception as e:  # noqa: BLE001 - one impl failing must not stop the run
            rec, lost = _failed(case, impl, e, lost)
        if opts.rounds > 1 and lost is None:
            held[impl] = rec, time.perf_counter() - t0
            continue
        keep(rec, time.perf_counter() - t0, lost is not None)
    if held and lost is None:
        timed, lost = _time_rounds(case, cc, opts, {i: h for i, h in held.items() if isinstance(h[0], tuple)})
        held.update(timed)
        for impl, (rec, wall_s) in held.items():  # the one that lost the context first: a worker exits on it
            if lost == impl:
                keep(rec, wall_s, True)
        for impl, (rec, wall_s) in held.items():
            if lost != impl:
                keep(rec if lost is None or rec["status"] != "ok" else
                     make_record(case, impl, "skipped", note=f"CUDA context lost earlier ({lost})"), wall_s)
    elif held:
        records += [make_record(case, impl, "skipped", note=f"CUDA context lost earlier ({lost})")
                    if isinstance(h[0], tuple) else h[0] for impl, h in held.items()]
    del cc
    if device.type == "cuda" and lost is None:
        torch.cuda.empty_cache()
    log(f"  {case.name}: {time.perf_counter() - t_case:.1f} s")
    return records


def _set_up(impl: str, prep: dict, cc: CaseContext, opts: BenchOptions) -> tuple[Prepared, dict]:
    """impl prepared for cc's case and checked: (prepared, the record's check, note, max_err, setup_s, spec)."""
    t0 = time.perf_counter()
    prepared = prep[impl](cc.case, cc)
    with prepared.context():
        check_status, check_msg, err = ("skipped", "--no-check", None)
        if opts.check:
            check_status, check_msg, err = check(impl, prepared, cc)
        elif cc.case.direction is Direction.FWD:
            with torch.no_grad():
                prepared.fn(cc.sets[0])  # compile outside the timing
    note = "; ".join(x for x in (prepared.note, check_msg) if x)
    return prepared, dict(check=check_status, note=note, max_err=err, setup_s=time.perf_counter() - t0,
                          spec=prepared.spec)


def _failed(case: BenchCase, impl: str, e: BaseException, lost: str | None) -> tuple[dict, str | None]:
    """The record of an impl that raised e, and the impl that lost the CUDA context (impl, if e did)."""
    if isinstance(e, Unsupported):
        return make_record(case, impl, "unsupported", note=str(e)), lost
    if isinstance(e, Unavailable):
        return make_record(case, impl, "unavailable", note=str(e)), lost
    if isinstance(e, torch.cuda.OutOfMemoryError):
        torch.cuda.empty_cache()
    return make_record(case, impl, "error", note=first_line(e)), impl if _fatal_cuda(e) else lost


def _time_rounds(case: BenchCase, cc: CaseContext, opts: BenchOptions, ready: dict) -> tuple[dict, str | None]:
    """Time the checked impls of `ready` ({impl: ((prepared, record fields), setup seconds)}) in opts.rounds
    interleaved rounds: ({impl: (record, wall seconds)}, the impl that lost the CUDA context or None)."""
    memos, wall = {impl: {} for impl in ready}, {impl: ready[impl][1] for impl in ready}

    def one(impl: str, r: int) -> dict:
        prepared, t0 = ready[impl][0][0], time.perf_counter()
        try:
            with prepared.context():
                return time_prepared(prepared, cc, opts, memos[impl])
        finally:
            wall[impl] += time.perf_counter() - t0

    times, failed, fatal = interleave(list(ready), opts.rounds, one, _fatal_cuda)
    out = {}
    for impl, ((_, fields), _) in ready.items():
        rec = (_failed(case, impl, failed[impl], None)[0] if impl in failed else
               make_record(case, impl, "ok", **fields, **summarize(times[impl]), rounds=opts.rounds))
        out[impl] = rec, wall[impl]
    return out, fatal


def describe(rec: dict) -> str:
    """One progress line for a record."""
    if rec["status"] != "ok":
        return shorten(f"  {rec['impl']:<15} {rec['status']}: {rec['note']}", 240)
    unit = {"tflops": "{:.4g} TF/s", "gbs": "{:.4g} GB/s", "ms": "{:.4g} ms"}[rec["metric"]]
    check_txt = rec["check"] + (f" (err {rec['max_err']:.1e})" if rec.get("max_err") is not None else "")
    ms = "" if rec["metric"] == "ms" else f"  {rec['ms']:.4g} ms"
    line = (f"  {rec['impl']:<15} {unit.format(rec[rec['metric']]):>12}{ms}  check {check_txt}  "
            f"setup {rec['setup_s']:.1f} s")
    return shorten(line + (f"  [{rec['note']}]" if rec["note"] else ""), 300)
