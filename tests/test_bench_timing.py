"""How the bench times a row and what it divides by (docs/serving.md, "fp8 KV decode, twelfth session").

The timing loop ([Note] L2 flush in fagen/bench/timing.py): with L2_FLUSH = "read" the bench runs do_bench's loop
with its own flush, so each timed call must come right after a flush, with the flush outside the call's events, and
the loop must keep do_bench's counts (5 estimate calls, warm-up and repetitions from the estimate). Fake events on
the CPU: the order of what the device was asked to do is the property. The copy reference ([Note] Copy reference
in fagen/bench/impls.py): the rows whose target is a share of the copy run it on their own bytes and sets."""

import statistics

import pytest
import torch

from _env import ON_GPU
from fagen.bench import timing


class _Clock:
    """The device's work queue as a log; each call takes `ms`, each event records the queue's time."""

    def __init__(self, ms):
        self.ms, self.now, self.log = ms, 0.0, []

    def event(self):
        clock = self

        class Event:
            def record(self):
                self.t = clock.now
                clock.log.append(("record", id(self)))

            def elapsed_time(self, other):
                return other.t - self.t

        return Event()

    def fn(self):
        self.now += self.ms
        self.log.append("fn")

    def flush(self):
        self.now += 0.085  # outside the timed window, if the loop is right
        self.log.append("flush")


@pytest.mark.parametrize("ms", [0.19, 0.7])
def test_each_timed_call_follows_a_flush_and_excludes_it(ms):
    clock = _Clock(ms)
    times = timing.timed_calls(clock.fn, clock.flush, 25.0, 100.0, clock.event, lambda: None)
    estimate = (5 * (ms + 0.085)) / 5
    assert len(times) == int(100.0 / estimate) and statistics.median(times) == pytest.approx(ms)
    warm = int(25.0 / estimate)
    timed = clock.log[1 + 2 + 10 + warm:]  # one first call, the estimate's 2 records and 5 flush + fn pairs, warm-up
    assert clock.log[13:13 + warm] == ["fn"] * warm
    for i in range(len(times)):
        flush, start, call, end = timed[4 * i:4 * i + 4]
        assert flush == "flush" and start[0] == "record" and call == "fn" and end[0] == "record"


@pytest.mark.parametrize("ms", [0.19, 0.7])
def test_looped_calls_run_back_to_back_in_batches(ms):
    """L2_FLUSH "loop": batches of calls between two events, no flush, the time a call of each batch."""
    clock = _Clock(ms)
    times = timing.looped_calls(clock.fn, 12, 25.0, 100.0, clock.event, lambda: None)
    assert "flush" not in clock.log and len(times) == max(1, int(100.0 / (12 * ms)))
    assert times == pytest.approx([ms] * len(times))
    warm = int(25.0 / ms)
    timed = clock.log[1 + 2 + 12 + warm:]
    for i in range(len(times)):
        batch = timed[14 * i:14 * i + 14]
        assert batch[0][0] == batch[-1][0] == "record" and batch[1:-1] == ["fn"] * 12


def test_loop_times_back_to_back_only_the_copy_rows_whose_other_sets_outgrow_the_flush(monkeypatch):
    """A row that divides by the copy reference (its set bytes passed) whose other sets hold >= the flush's 256 MB
    between two calls on a set; the serving fp8 rows' 3 sets qualify, one set never does; time_prepared passes set
    bytes for those rows only (every other row keeps do_bench's loop and its history)."""
    from fagen.bench.inputs import set_bytes
    from fagen.bench.serving import serving_rows
    from fagen.bench.workloads import copy_relative, standard_suite

    rows = {c.name: c for c in serving_rows()}
    for name in ("decode-d128-kv8k-b32-fp8", "decode-d128-kv32k-b8-fp8", "decode-d128-kv8k-b32-fp8-paged16"):
        assert timing.streams(3, set_bytes(rows[name])) and not timing.streams(1, set_bytes(rows[name]))
    assert timing.streams(2, 256 << 20) and not timing.streams(2, (256 << 20) - 1) and not timing.streams(3, None)
    assert {c.name for c in serving_rows() + standard_suite() if copy_relative(c)} == {
        "decode-d128-kv8k-b32-fp8", "decode-d128-kv32k-b8-fp8", "decode-d128-kv8k-b32-fp8-paged16",
        *(f"decode-mla-absorbed-h16-{kv}{tag}" for kv in ("kv4k-b128", "kv32k-b32") for tag in ("", "-fp8"))}
    for name in ("decode-mla-absorbed-h16-kv4k-b128-fp8", "decode-mla-absorbed-h16-kv32k-b32"):  # MLA's too
        assert timing.streams(3, set_bytes(rows[name]))
    seen = []
    monkeypatch.setattr(timing, "measure", lambda *a: seen.append(a[-1]) or 1.0)
    for name in ("decode-d128-kv8k-b32-fp8", "decode-d128-kv8k-b32"):
        case = rows.get(name) or {c.name: c for c in standard_suite()}[name]
        cc = type("CC", (), dict(case=case, sets=[None] * 3, device=torch.device("cpu")))()
        timing.time_prepared(type("P", (), dict(fn=None))(), cc, type("O", (), dict(warmup_ms=0, rep_ms=0))())
    assert seen == [set_bytes(rows["decode-d128-kv8k-b32-fp8"]), None]  # the bf16 row (absolute target): do_bench


def test_measure_on_the_cpu_ignores_the_flush(monkeypatch):
    """The CPU path stays wall clock whatever L2_FLUSH says (the flush is a CUDA matter)."""
    monkeypatch.setattr(timing, "L2_FLUSH", "read")
    seen = []
    ms = timing.measure(lambda i: seen.append(i), 3, torch.device("cpu"), 0.0, 1.0)
    assert ms >= 0 and seen[:4] == [0, 1, 2, 0]


@pytest.mark.skipif(ON_GPU, reason="the CPU form: fagen's kernels on CPU tensors through the interpreter, which a GPU "
                    "process does not use (on a GPU `fagen bench --suite serving` runs the copy column)")
def test_copy_reference_runs_where_a_target_names_it_and_is_no_peer(tmp_path):
    """[Note] Copy reference (fagen/bench/impls.py): the fp8 decode rows whose target is a share of the copy run it
    beside fagen, on the row's bytes (half read, half written) and the row's input sets, timed by the same measure;
    the report's target reads fagen against it, and "fagen/best peer" leaves it out (it is no peer)."""
    from fagen.bench import IMPLS, report
    from fagen.bench.cases import BenchOptions, CaseContext
    from fagen.bench.impls import case_impls, prepare_copy, run_case
    from fagen.bench.serving import serving_rows
    from fagen.bench.workloads import kv_bytes

    rows = {c.name: c for c in serving_rows(quick=True)}
    named = [n for n, c in rows.items() if "copy" in case_impls(c, IMPLS)]
    assert named == ["decode-mla-absorbed-h16-kv4k-b128", "decode-mla-absorbed-h16-kv32k-b32",
                     "decode-mla-absorbed-h16-kv4k-b128-fp8", "decode-mla-absorbed-h16-kv32k-b32-fp8",
                     "decode-d128-kv8k-b32-fp8", "decode-d128-kv32k-b8-fp8", "decode-d128-kv8k-b32-fp8-paged16"]
    case = rows["decode-d128-kv8k-b32-fp8"]
    recs = run_case(case, BenchOptions(device="cpu", impls=("fagen", "copy"), rep_ms=1, sets=2), log=lambda _: None)
    by = {r["impl"]: r for r in recs}
    assert by["fagen"]["status"] == by["copy"]["status"] == "ok" and by["copy"]["check"] == "skipped"
    assert by["copy"]["gbs"] == pytest.approx(kv_bytes(case) / by["copy"]["ms"] / 1e6)
    cc = CaseContext(case, torch.device("cpu"), 2)
    copy = prepare_copy(case, cc)
    dst = [copy.fn(s) for s in cc.sets]  # copy_ returns its destination: one per input set, half the row's bytes
    assert [d.numel() for d in dst] == [kv_bytes(case) // 2] * 2 and dst[0].data_ptr() != dst[1].data_ptr()
    header, table, _ = report.rows(recs)
    row = dict(zip(header, table[0]))
    assert row["copy"] and row["fagen/best peer"] == ""  # no peer on this row: the copy is a reference
    ratio = by["fagen"]["gbs"] / by["copy"]["gbs"]
    assert row["target"].startswith(f"{ratio:.2f}x copy (>= 0.95 ")
