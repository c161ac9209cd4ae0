"""`fagen bench`: check and time fagen's kernels and the peers (SDPA backends, FlexAttention) on one case."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import statistics
import time
from typing import Any, Callable

import torch

from fagen import reference, verify
from fagen.enums import Direction, DType
from fagen.workload import (BWD_FACTOR, BenchCase, InputSet, flops, fwd_flops, kv_bytes, make_inputs,
                            set_bytes)

IMPLS = ("fagen", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex")
STATUSES = ("ok", "unsupported", "unavailable", "error", "skipped")
SET_BUDGET = 4 << 30  # bytes of rotating input sets on a GPU
RESTART_EXIT = 3  # a worker's exit status after a CUDA error poisoned its context (fagen.runner starts another)


class Unsupported(Exception):
    """An implementation cannot compute this case (a backend refuses the mask, a module has no backward)."""


class Unavailable(Exception):
    """An implementation cannot run here at all (needs CUDA, a package is missing)."""


class CaseContext:
    """What every implementation of one case shares: the device, the input sets, the dense mask, the reference."""

    def __init__(self, case: BenchCase, device: torch.device, n_sets: int, seed: int = 0):
        self.case, self.device = case, device
        if device.type == "cuda":
            n_sets = max(1, min(n_sets, SET_BUDGET // max(1, set_bytes(case))))
        self.sets = [make_inputs(case, device, seed + i) for i in range(n_sets)]
        self._dense: torch.Tensor | None = None
        self._refs: dict | None = None

    def dense_mask(self) -> torch.Tensor:
        """bool [B, Sq, Sk]: the visibility mask written out (for peers that need a dense mask)."""
        if self._dense is None:
            c, kw = self.case, self.sets[0].kwargs
            self._dense = reference.visible(c.mask, c.batch, c.seq_q, c.seq_k, seqlens_q=kw.get("seqlens_q"),
                                            seqlens_k=kw.get("seqlens_k"), tree_mask=kw.get("tree_mask"),
                                            device=self.device)
        return self._dense

    # [Note] Reference slices
    # The float64 reference of a whole 16k case does not fit in memory, but heads and batch entries are
    # independent: one KV group (its gqa query heads and its KV head) of one batch entry is a complete
    # sub-problem, gradients included. We check the first group of the first entry and the last of the last.
    def slices(self) -> list[tuple[int, int]]:
        c = self.case
        return sorted({(0, 0), (c.batch - 1, c.heads_kv - 1)})

    def slice_of(self, s: InputSet, b: int, g: int) -> tuple[torch.Tensor, ...]:
        G = self.case.gqa
        return s.q[b:b + 1, g * G:(g + 1) * G], s.k[b:b + 1, g:g + 1], s.v[b:b + 1, g:g + 1]

    def reference_fits(self) -> bool:
        c = self.case
        elems = c.gqa * c.seq_q * c.seq_k
        need = elems * 8 * (16 if c.direction is Direction.BWD else 12)  # float64 score-sized temporaries
        if self.device.type == "cuda":
            return need < 0.6 * torch.cuda.mem_get_info(self.device)[0]
        return need < (2 << 30)

    def references(self) -> dict:
        """{(b, g): (out, lse, grads or None)} in float64 for input set 0; computed once per case."""
        if self._refs is None:
            c, s = self.case, self.sets[0]
            self._refs = {}
            for b, g in self.slices():
                q, k, v = self.slice_of(s, b, g)
                kw = {name: t[b:b + 1] for name, t in s.kwargs.items()}
                if c.direction is Direction.BWD:
                    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
                    out, lse = reference.attention(q, k, v, mask=c.mask, **kw)
                    dout = s.dout[b:b + 1, g * c.gqa:(g + 1) * c.gqa].double()
                    grads = torch.autograd.grad(out, (q, k, v), dout)
                    self._refs[(b, g)] = (out.detach(), lse.detach(), grads)
                else:
                    out, lse = reference.attention(q, k, v, mask=c.mask, **kw)
                    self._refs[(b, g)] = (out, lse, None)
        return self._refs


# -- implementations ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Prepared:
    """An implementation ready to run one case: fn(input set) -> out, or (out, lse) when it gives lse."""

    fn: Callable[[InputSet], Any]
    context: Callable[[], Any] = contextlib.nullcontext  # entered around the check and the timing
    note: str = ""
    spec: str | None = None


def prepare_fagen(case: BenchCase, cc: CaseContext) -> Prepared:
    from fagen.runtime import load

    spec, note = case.spec()
    try:
        module = load(spec)
    except Exception as e:  # a template not written yet (say the backward) is not a crash of the bench
        raise Unavailable(f"cannot render/load {spec.name}: {_first_line(e)}") from None
    if case.direction is Direction.BWD:
        if not hasattr(module, "attention"):
            raise Unsupported(f"{spec.name} has no backward yet (module.attention missing)")
        return Prepared(lambda s: module.attention(s.q, s.k, s.v, **s.kwargs), note=note, spec=spec.name)
    return Prepared(lambda s: module.forward(s.q, s.k, s.v, **s.kwargs), note=note, spec=spec.name)


def preparers() -> dict[str, Callable[[BenchCase, CaseContext], Prepared]]:
    from fagen import peers

    return {"fagen": prepare_fagen, **{name: peers.sdpa_preparer(name) for name in peers.SDPA_BACKENDS},
            "flex": peers.prepare_flex}


def _out(result) -> torch.Tensor:
    return result[0] if isinstance(result, (tuple, list)) else result


def _first_line(e: BaseException, limit: int = 200) -> str:
    """The gist of an exception on one line (a wrapper's "... raised:" line is joined with the next)."""
    text = f"{type(e).__name__}: {e}".strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = lines[0] if lines else type(e).__name__
    if line.endswith(":") and len(lines) > 1:
        line += " " + lines[1]
    return line if len(line) <= limit else line[:limit - 3] + "..."


# -- checking ----------------------------------------------------------------------------------------
def _grad_compare(name: str, got: torch.Tensor, want: torch.Tensor, dtype: DType) -> float:
    """Gradients: verify.compare_grad (GRAD_TOLERANCE) when fagen's verify has it, else normwise with TOLERANCE.

    Normwise: max |got - want| <= atol + rtol * max |want|, the dtype's forward tolerance applied to the
    largest gradient entry (gradients sum over a whole sequence, so small entries carry absolute error).
    """
    if hasattr(verify, "compare_grad"):
        return verify.compare_grad(name, got, want, dtype)
    tol = verify.TOLERANCE[dtype]
    got64, want = got.detach().double(), want.detach().double()
    if not torch.isfinite(got64).all():
        raise verify.PropertyFailure(f"{name}: {int((~torch.isfinite(got64)).sum())} non-finite entries")
    err = (got64 - want).abs().max().item() if want.numel() else 0.0
    allowed = tol["atol"] + tol["rtol"] * (want.abs().max().item() if want.numel() else 0.0)
    if err > allowed:
        raise verify.PropertyFailure(f"{name}: max |err| {err:.3g} > {allowed:.3g} (normwise)")
    return err


def check(impl: str, prepared: Prepared, cc: CaseContext) -> tuple[str, str, float | None]:
    """(check status, message, max error) of one implementation's output on input set 0.

    fagen is held to the whole contract (zeros and -inf on rows that see nothing, lse, gradients); peers are
    compared on the rows that see at least one key, since what they put in empty rows is their own business.
    """
    c = cc.case
    if not cc.reference_fits():
        return "skipped", "too large for the float64 reference on this device", None
    try:
        refs = cc.references()
    except torch.cuda.OutOfMemoryError:
        cc._refs = None
        torch.cuda.empty_cache()
        return "skipped", "out of memory in the float64 reference", None
    s = cc.sets[0]
    grads = None
    if c.direction is Direction.BWD:
        leaves = [t.detach().clone().requires_grad_() for t in (s.q, s.k, s.v)]
        result = prepared.fn(dataclasses.replace(s, q=leaves[0], k=leaves[1], v=leaves[2]))
        grads = torch.autograd.grad(_out(result), leaves, s.dout)
    else:
        with torch.no_grad():  # as timed: a compiled peer must not compile twice (grad mode is guarded)
            result = prepared.fn(s)
    out = _out(result).detach()
    lse = result[1] if isinstance(result, (tuple, list)) and len(result) > 1 else None
    tol = verify.TOLERANCE[c.dtype]
    worst = 0.0
    G = c.gqa
    try:
        for (b, g), (ref_out, ref_lse, ref_grads) in refs.items():
            got = out[b:b + 1, g * G:(g + 1) * G]
            where = f"[batch {b}, heads {g * G}..{(g + 1) * G - 1}]"
            if impl == "fagen":
                worst = max(worst, verify.compare(f"out{where}", got, ref_out, **tol))
                if lse is not None:
                    verify.compare(f"lse{where}", lse[b:b + 1, g * G:(g + 1) * G], ref_lse,
                                   **verify.LSE_TOLERANCE)
                if grads is not None:
                    mine = (grads[0][b:b + 1, g * G:(g + 1) * G], grads[1][b:b + 1, g:g + 1],
                            grads[2][b:b + 1, g:g + 1])
                    for name, gg, rg in zip(("dq", "dk", "dv"), mine, ref_grads):
                        worst = max(worst, _grad_compare(f"{name}{where}", gg, rg, c.dtype))
            else:
                seen = torch.isfinite(ref_lse).unsqueeze(-1)  # rows that see at least one key
                got = torch.where(seen, got.double(), 0.0)
                worst = max(worst, verify.compare(f"out{where}", got, ref_out, **tol))
    except verify.PropertyFailure as e:
        return "fail", str(e), None
    return "ok", "", worst


# -- timing ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class BenchOptions:
    device: str = "cuda"
    impls: tuple[str, ...] = IMPLS
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    sets: int = 3
    check: bool = True
    seed: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def measure(call: Callable[[int], Any], n_sets: int, device: torch.device, warmup_ms: float, rep_ms: float) -> float:
    """Median milliseconds of call(i), rotating i over the input sets.

    CUDA: triton.testing.do_bench (CUDA events around each call, the L2 cache flushed between calls,
    warm-up first); the rotation means no two consecutive calls read the same tensors either. CPU: wall clock.
    """
    counter = itertools.count()

    def fn():
        return call(next(counter) % n_sets)

    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()  # warm-up (compiles, fills caches)
    times, start = [], time.perf_counter()  # at least one timed call, then until rep_ms is spent (at most 50)
    while not times or (time.perf_counter() - start) * 1e3 < rep_ms and len(times) < 50:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_prepared(prepared: Prepared, cc: CaseContext, opts: BenchOptions) -> dict:
    """{ms} of the forward, or {ms (backward alone), fwdbwd_ms} of a backward case."""
    c, sets = cc.case, cc.sets
    if c.direction is Direction.FWD:
        with torch.no_grad():
            return {"ms": measure(lambda i: prepared.fn(sets[i]), len(sets), cc.device, opts.warmup_ms, opts.rep_ms)}
    leaves = [[t.detach().clone().requires_grad_() for t in (s.q, s.k, s.v)] for s in sets]
    views = [dataclasses.replace(s, q=lv[0], k=lv[1], v=lv[2]) for s, lv in zip(sets, leaves)]
    outs = [_out(prepared.fn(vw)) for vw in views]  # graphs kept alive: backward alone is timed
    bwd = measure(lambda i: torch.autograd.grad(outs[i], leaves[i], sets[i].dout, retain_graph=True),
                  len(sets), cc.device, opts.warmup_ms, opts.rep_ms)
    outs.clear()  # free the kept graphs before timing forward + backward
    both = measure(lambda i: torch.autograd.grad(_out(prepared.fn(views[i])), leaves[i], sets[i].dout),
                   len(sets), cc.device, opts.warmup_ms, opts.rep_ms)
    return {"ms": bwd, "fwdbwd_ms": both}


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


def _test_crash(impl: str) -> str | None:
    """Tests only: FAGEN_BENCH_TEST_CRASH="impl:die,impl:cuda,impl:hang" makes that impl kill its process,
    raise the error of a kernel that poisoned the CUDA context, or hang, to exercise the recovery paths."""
    for item in os.environ.get("FAGEN_BENCH_TEST_CRASH", "").split(","):
        name, _, mode = item.partition(":")
        if name == impl:
            return mode
    return None


def _fatal_cuda(e: BaseException) -> bool:
    text = str(e)
    return any(s in text for s in ("illegal memory access", "device-side assert", "CUDA error: unspecified launch",
                                   "misaligned address", "an illegal instruction"))


def run_case(case: BenchCase, opts: BenchOptions, log: Callable[[str], None] = print,
             emit: Callable[[dict], None] | None = None, exit_on_fatal: bool = False) -> list[dict]:
    """Every requested implementation on one case: check, then time. Failures become records, never raise.

    `emit` sees each record as soon as it exists. After a CUDA error that poisons the context, the remaining
    impls are skipped, or with `exit_on_fatal` the process exits so that a fresh one can take over.
    """
    device = torch.device(opts.device)
    t_case = time.perf_counter()
    try:
        cc = CaseContext(case, device, opts.sets, opts.seed)
    except Exception as e:
        return [make_record(case, impl, "error", note=f"inputs: {_first_line(e)}") for impl in opts.impls]
    records, prep, lost = [], preparers(), None
    for impl in opts.impls:
        if lost is not None:
            records.append(make_record(case, impl, "skipped", note=f"CUDA context lost earlier ({lost})"))
            continue
        t0 = time.perf_counter()
        crash = _test_crash(impl)
        if crash == "die":
            os._exit(86)
        if crash == "hang":
            time.sleep(3600)
        try:
            if crash == "cuda":
                raise RuntimeError("CUDA error: an illegal memory access was encountered (FAGEN_BENCH_TEST_CRASH)")
            prepared = prep[impl](case, cc)
            with prepared.context():
                check_status, check_msg, err = ("skipped", "--no-check", None)
                if opts.check:
                    check_status, check_msg, err = check(impl, prepared, cc)
                elif case.direction is Direction.FWD:
                    with torch.no_grad():
                        prepared.fn(cc.sets[0])  # compile outside the timing
                setup_s = time.perf_counter() - t0
                times = time_prepared(prepared, cc, opts)
            note = "; ".join(x for x in (prepared.note, check_msg) if x)
            rec = make_record(case, impl, "ok", check=check_status, note=note, max_err=err, setup_s=setup_s,
                              spec=prepared.spec, **times)
        except Unsupported as e:
            rec = make_record(case, impl, "unsupported", note=str(e))
        except Unavailable as e:
            rec = make_record(case, impl, "unavailable", note=str(e))
        except Exception as e:  # noqa: BLE001 - one impl failing must not stop the run
            rec = make_record(case, impl, "error", note=_first_line(e))
            if _fatal_cuda(e):
                lost = impl
            if isinstance(e, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
        rec["wall_s"] = round(time.perf_counter() - t0, 2)
        records.append(rec)
        log(describe(rec))
        if emit is not None:
            emit(rec)
        if lost is not None and exit_on_fatal:
            log(f"  CUDA context lost in {impl}; this worker exits and a fresh one goes on")
            os._exit(RESTART_EXIT)
    del cc
    if device.type == "cuda" and lost is None:
        torch.cuda.empty_cache()
    log(f"  {case.name}: {time.perf_counter() - t_case:.1f} s")
    return records


def describe(rec: dict) -> str:
    """One progress line for a record."""
    if rec["status"] != "ok":
        return f"  {rec['impl']:<15} {rec['status']}: {rec['note']}"[:240]
    unit = {"tflops": "{:.4g} TF/s", "gbs": "{:.4g} GB/s", "ms": "{:.4g} ms"}[rec["metric"]]
    check_txt = rec["check"] + (f" (err {rec['max_err']:.1e})" if rec.get("max_err") is not None else "")
    ms = "" if rec["metric"] == "ms" else f"  {rec['ms']:.4g} ms"
    line = (f"  {rec['impl']:<15} {unit.format(rec[rec['metric']]):>12}{ms}  check {check_txt}  "
            f"setup {rec['setup_s']:.1f} s")
    return (line + (f"  [{rec['note']}]" if rec["note"] else ""))[:300]


