"""The bench's interleaved rounds ([Note] Interleaved rounds in fagen/bench/rounds.py): a case's implementations are
checked first and then timed round by round, round r in the order rotated to start at r mod n; a record's ms is the
median of its rounds, and the JSON keeps the rounds and their spread. Fake implementations and a fake timer on the
CPU: the order of the timings and the numbers that reach the records are the properties."""

import json

import pytest
import torch

from fagen.bench import impls, report, rounds, runner
from fagen.bench.cases import BenchOptions, Prepared, Unsupported
from fagen.bench.workloads import case_from_spec
from fagen.spec import KernelSpec


def test_each_round_rotates_the_order_by_one():
    assert [rounds.order(3, r) for r in range(4)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    seen = []
    results, failed, fatal = rounds.interleave(["a", "b", "c"], 3, lambda n, r: seen.append((r, n)) or {"ms": r})
    assert seen == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"), (2, "c"), (2, "a"), (2, "b")]
    assert results == {n: [{"ms": 0}, {"ms": 1}, {"ms": 2}] for n in "abc"} and failed == {} and fatal is None


def test_a_failing_impl_leaves_the_later_rounds_and_a_fatal_one_stops_them():
    seen = []

    def one(name, r):
        seen.append((r, name))
        if name == "b" and r == 1:
            raise RuntimeError("boom")
        return {"ms": 1.0}

    results, failed, fatal = rounds.interleave(["a", "b", "c"], 3, one)
    assert (2, "b") not in seen and [n for r, n in seen if r == 2] == ["c", "a"]
    assert list(failed) == ["b"] and len(results["a"]) == 3 and len(results["b"]) == 1 and fatal is None
    seen.clear()
    _, failed, fatal = rounds.interleave(["a", "b", "c"], 3, one, fatal=lambda e: True)
    assert fatal == "b" and seen[-1] == (1, "b")  # nothing after the fatal error


def test_a_record_is_the_median_of_its_rounds_with_their_spread():
    out = rounds.summarize([{"ms": 1.0}, {"ms": 10.0}, {"ms": 2.0}])
    assert out == {"ms": 2.0, "rounds_ms": [1.0, 10.0, 2.0], "ms_min": 1.0, "ms_max": 10.0}
    both = rounds.summarize([{"ms": 3.0, "fwdbwd_ms": 5.0}, {"ms": 1.0, "fwdbwd_ms": 9.0},
                             {"ms": 2.0, "fwdbwd_ms": 4.0}])
    assert both["ms"] == 2.0 and both["fwdbwd_ms"] == 5.0 and both["fwdbwd_rounds_ms"] == [5.0, 9.0, 4.0]


def _fake_bench(monkeypatch):
    """Three impls that run nothing (one declines the case), and a timer that logs which impl it times and hands
    out ms from a per-impl list: (the log, the ms each impl gets, round by round)."""
    log, given = [], {"fagen": [5.0, 1.0, 4.0, 2.0, 3.0], "sdpa-flash": [2.0, 2.0, 9.0, 2.0, 2.0]}

    def prep(name):
        def prepare(case, cc):
            if name == "sdpa-efficient":
                raise Unsupported("not this one")
            return Prepared(lambda s: None, note=name, spec=name)
        return prepare

    def fake_time(prepared, cc, opts, memo=None):
        log.append(prepared.spec)
        return {"ms": given[prepared.spec][sum(x == prepared.spec for x in log) - 1]}

    monkeypatch.setattr(impls, "preparers", lambda: {n: prep(n) for n in ("fagen", "sdpa-flash", "sdpa-efficient")})
    monkeypatch.setattr(impls, "time_prepared", fake_time)
    return log, given


def _case():
    return case_from_spec(KernelSpec(head_dim=16, mask="causal"), batch=1, heads=2, seq_q=37, seq_k=37)


def test_run_case_times_the_impls_in_rotated_rounds_and_records_the_median(monkeypatch, tmp_path):
    log, given = _fake_bench(monkeypatch)
    opts = BenchOptions(device="cpu", impls=("fagen", "sdpa-flash", "sdpa-efficient"), rounds=5, check=False, sets=1)
    out = tmp_path / "b.json"
    meta, recs = runner.run([_case()], opts, json_path=out, log=lambda _: None)
    assert log == ["fagen", "sdpa-flash", "sdpa-flash", "fagen"] * 2 + ["fagen", "sdpa-flash"]
    data = json.loads(out.read_text())["records"]
    assert [r["impl"] for r in data] == ["fagen", "sdpa-flash", "sdpa-efficient"]  # the table's order, not the rounds'
    by = {r["impl"]: r for r in data}
    assert by["fagen"]["ms"] == 3.0 and by["sdpa-flash"]["ms"] == 2.0
    assert by["fagen"]["rounds_ms"] == given["fagen"] and by["fagen"]["rounds"] == 5
    assert (by["fagen"]["ms_min"], by["fagen"]["ms_max"]) == (1.0, 5.0)
    assert (by["sdpa-flash"]["ms_min"], by["sdpa-flash"]["ms_max"]) == (2.0, 9.0)
    assert by["fagen"]["tflops"] == pytest.approx(impls.make_record(_case(), "fagen", "ok", 3.0)["tflops"])
    assert by["sdpa-efficient"]["status"] == "unsupported" and "rounds_ms" not in by["sdpa-efficient"]
    for key in ("case", "impl", "ms", "tflops", "gbs", "status", "metric", "check", "note", "spec", "setup_s",
                "wall_s"):
        assert key in by["fagen"]
    assert meta["rounds"] == json.loads(out.read_text())["meta"]["rounds"] == 5
    notes = report.rows(data)[2]  # the table's footnote: the rounds and the widest spread (fagen's: 5 / 1)
    assert notes[-1].startswith("timing: 5 interleaved rounds") and f"400.0% ({_case().name}, fagen)" in notes[-1]


def test_one_round_is_the_earlier_bench(monkeypatch):
    log, _ = _fake_bench(monkeypatch)
    opts = BenchOptions(device="cpu", impls=("fagen", "sdpa-flash"), rounds=1, check=False, sets=1)
    recs = impls.run_case(_case(), opts, log=lambda _: None)
    assert log == ["fagen", "sdpa-flash"] and [r["ms"] for r in recs] == [5.0, 2.0]
    assert all("rounds_ms" not in r for r in recs)


def test_time_prepared_shares_the_budget_among_the_rounds(monkeypatch):
    """A round's measure gets 1/rounds of --warmup and --rep, and the round's memo (the estimate kept there)."""
    from fagen.bench import timing
    from fagen.bench.cases import CaseContext

    seen = []
    monkeypatch.setattr(timing, "measure", lambda call, n, dev, warm, rep, stream=None, memo=None:
                        seen.append((warm, rep, memo)) or 1.0)
    case = _case()
    cc = CaseContext(case, torch.device("cpu"), 1)
    prepared = Prepared(lambda s: None)
    opts = BenchOptions(device="cpu", warmup_ms=25, rep_ms=100, rounds=5)
    memo = {}
    timing.time_prepared(prepared, cc, opts, memo)
    timing.time_prepared(prepared, cc, opts)
    assert seen == [(5.0, 20.0, {}), (25, 100, None)] and seen[0][2] is memo["ms"]


def test_later_rounds_keep_the_first_rounds_estimate():
    """timed_calls with a memo: the first round makes do_bench's estimate (one call, 5 flushed calls) and keeps it;
    a later round starts at its warm-up, with the counts from the kept estimate."""
    from fagen.bench import timing
    from test_bench_timing import _Clock

    clock, memo = _Clock(0.5), {}
    first = timing.timed_calls(clock.fn, clock.flush, 5.0, 20.0, clock.event, lambda: None, memo)
    assert memo["ms"] == pytest.approx(0.585) and len(first) == int(20.0 / 0.585)
    clock.log.clear()
    later = timing.timed_calls(clock.fn, clock.flush, 5.0, 20.0, clock.event, lambda: None, memo)
    warm = int(5.0 / 0.585)
    assert clock.log[:warm] == ["fn"] * warm and clock.log[warm] == "flush" and len(later) == len(first)


def test_a_case_with_spec_flags_survives_the_trip_to_a_worker():
    """The isolated runner sends cases to its worker as JSON: a spec case's overrides (the CLI's flags, mod_tensors ()
    among them) come back as tuples, so the worker's spec is the parent's and hashable (it was unhashable, and fagen
    read `unavailable` in every isolated run of a spec with flags, --rounds or not)."""
    from fagen.bench.workloads import BenchCase

    case = case_from_spec(KernelSpec(head_dim=16, mask="causal"), batch=1, heads=2, seq_q=37,
                          overrides=(("block_m", 16), ("mod_tensors", ()), ("mod_scalars", ())))
    back = BenchCase.from_dict(json.loads(json.dumps(case.to_dict())))
    assert back == case and hash(back.spec("cpu")[0]) == hash(case.spec("cpu")[0])
