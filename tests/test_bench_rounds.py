"""The bench's interleaved rounds ([Note] Interleaved rounds in fagen/bench/rounds.py): a case's implementations are
checked first and then timed round by round, round r in row r of a balanced Latin square; a record's ms is the
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
    assert [rounds.order(3, r) for r in range(4)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]]
    assert [rounds.order(4, r) for r in range(5)] == [[0, 1, 3, 2], [1, 2, 0, 3], [2, 3, 1, 0], [3, 0, 2, 1],
                                                      [0, 1, 3, 2]]
    assert [rounds.order(2, r) for r in range(3)] == [[0, 1], [1, 0], [0, 1]] and rounds.order(1, 7) == [0]
    seen = []
    results, failed, fatal = rounds.interleave(["a", "b", "c"], 3, lambda n, r: seen.append((r, n)) or {"ms": r})
    assert seen == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"), (2, "c"), (2, "a"), (2, "b")]
    assert results == {n: [{"ms": 0}, {"ms": 1}, {"ms": 2}] for n in "abc"} and failed == {} and fatal is None


@pytest.mark.parametrize("n", range(2, 8))
def test_over_a_period_every_place_and_every_predecessor_comes_equally_often(n):
    """[Note] Interleaved rounds: the rows of `order` over their period (n, or 2n for an odd n) are orders of all n
    implementations, each takes each place equally often, and each ordered pair (a right before b) occurs equally
    often: the bench never times one implementation always after the same other one."""
    period = n if n % 2 == 0 else 2 * n
    rows = [rounds.order(n, r) for r in range(period)]
    assert all(sorted(row) == list(range(n)) for row in rows)
    places = {(i, row[i]) for row in rows for i in range(n)}
    assert all(sum(row[i] == x for row in rows) == period // n for i in range(n) for x in range(n)) and places
    pairs = [(row[i], row[i + 1]) for row in rows for i in range(n - 1)]
    counts = {(a, b): pairs.count((a, b)) for a in range(n) for b in range(n) if a != b}
    assert len(set(counts.values())) == 1, counts


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


# The mods and layouts suites on the same rounds (fagen.bench.rounds.time_parts; [Note] Mods rounds in
# fagen/bench/mods.py, layouts.timed): fake sides and a fake timer.
def _fake_parts(log, given):
    """setups for impls a and b whose parts log (impl, part, memo) and hand out ms from given[impl][part]."""
    def timer(name, key):
        def t(memo):
            log.append((name, key, memo))
            return given[name][key][sum(1 for n, k, _ in log if (n, k) == (name, key)) - 1]
        return t

    def setup(name):
        def s():
            log.append((name, "setup", None))
            return {key: timer(name, key) for key in given[name]}
        return s
    return {name: setup(name) for name in given}


def test_time_parts_readies_all_then_rotates_and_keeps_a_memo_per_part():
    log, given = [], {"a": {"fwd_ms": [1.0, 2.0, 3.0], "bwd_ms": [4.0, 5.0, 6.0]}, "b": {"fwd_ms": [7.0, 8.0, 9.0]}}
    times, failed = rounds.time_parts(_fake_parts(log, given), 3)
    assert [(n, k) for n, k, _ in log] == [("a", "setup"), ("b", "setup"), ("a", "fwd_ms"), ("a", "bwd_ms"),
                                           ("b", "fwd_ms"), ("b", "fwd_ms"), ("a", "fwd_ms"), ("a", "bwd_ms"),
                                           ("a", "fwd_ms"), ("a", "bwd_ms"), ("b", "fwd_ms")]
    memos = [(n, k, id(m)) for n, k, m in log if k != "setup"]
    assert all(m is not None for n, k, m in log if k != "setup")
    assert len({i for _, _, i in memos}) == 3  # one memo per (impl, part), the same in every round
    assert times == {"a": [{"fwd_ms": v, "bwd_ms": w} for v, w in zip([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])],
                     "b": [{"fwd_ms": v} for v in (7.0, 8.0, 9.0)]} and failed == {}
    log.clear()
    times, _ = rounds.time_parts(_fake_parts(log, given), 1)  # one round: each readied and timed in turn, no memo
    assert log == [("a", "setup", None), ("a", "fwd_ms", None), ("a", "bwd_ms", None), ("b", "setup", None),
                   ("b", "fwd_ms", None)] and times["b"] == [{"fwd_ms": 7.0}]


def test_time_parts_reports_a_side_that_fails_to_get_ready():
    log, given = [], {"a": {"ms": [1.0, 2.0]}, "b": {"ms": [3.0, 4.0]}}
    setups = _fake_parts(log, given)
    setups["a"] = lambda: (_ for _ in ()).throw(RuntimeError("no compile"))
    times, failed = rounds.time_parts(setups, 2)
    assert list(failed) == ["a"] and str(failed["a"]) == "no compile" and times == {"b": [{"ms": 3.0}, {"ms": 4.0}]}


def test_summarize_names_the_rounds_of_any_timing_key():
    out = rounds.summarize([{"fwd_ms": 3.0, "bwd_ms": 1.0}, {"fwd_ms": 1.0, "bwd_ms": 5.0},
                            {"fwd_ms": 2.0, "bwd_ms": 2.0}], ("fwd_ms", "bwd_ms"), ("fwd_ms", "bwd_ms"))
    assert out == {"fwd_ms": 2.0, "fwd_rounds_ms": [3.0, 1.0, 2.0], "bwd_ms": 2.0, "bwd_rounds_ms": [1.0, 5.0, 2.0],
                   "fwd_ms_min": 1.0, "fwd_ms_max": 3.0, "bwd_ms_min": 1.0, "bwd_ms_max": 5.0}


def _fake_mods(monkeypatch, given):
    """mods.mod_rows on one fake row: the sides' setups replaced (their parts timed by the fake timer)."""
    from fagen.bench import mods

    log = []
    parts = _fake_parts(log, given)

    def side(name):
        def ready(row, got, *args):
            if name == "fagen":
                got.update(flops=4e9, out=None)
                row["lowered_to"] = "causal"
            else:
                row["max_diff_vs_flex"] = 0.0
            return parts[name]()
        return ready

    monkeypatch.setattr(mods, "cases", lambda shape, device: [("doc", None, lambda *a: True, [])])
    monkeypatch.setattr(mods, "_inputs", lambda shape, device, grad: (None,) * 4)
    monkeypatch.setattr(mods, "_fagen_side", side("fagen"))
    monkeypatch.setattr(mods, "_flex_side", side("flex"))
    return mods, log


def test_a_mods_row_times_fagen_and_flex_in_rotated_rounds_with_the_median_and_the_rounds(monkeypatch):
    given = {"fagen": {"mask_ms": [0.5, 0.4, 0.6], "fwd_ms": [1.0, 3.0, 2.0], "bwd_ms": [4.0, 4.0, 5.0]},
             "flex": {"mask_ms": [3.0, 2.0, 4.0], "fwd_ms": [2.0, 3.0, 2.0], "bwd_ms": [6.0, 4.0, 5.0]}}
    mods, log = _fake_mods(monkeypatch, given)
    row, = mods.mod_rows("cuda", mods.ModsShape(), log=lambda _: None, rounds=3)
    assert [n for n, k, _ in log if k == "fwd_ms"] == ["fagen", "flex", "flex", "fagen", "fagen", "flex"]
    assert [k for n, k, _ in log if n == "fagen"][:4] == ["setup", "mask_ms", "fwd_ms", "bwd_ms"]
    f, x = row["fagen"], row["flex"]
    assert (f["fwd_ms"], f["bwd_ms"], x["fwd_ms"], x["bwd_ms"]) == (2.0, 4.0, 2.0, 5.0)
    assert (row["fagen_mask_ms"], row["flex_mask_ms"]) == (0.5, 3.0)  # the fields of the earlier suite, medians
    assert f["fwd_TF/s"] == pytest.approx(4e9 / 2.0 / 1e9) and x["bwd_TF/s"] == pytest.approx(2.5 * 4e9 / 5.0 / 1e9)
    assert row["fwd_x"] == 1.0 and row["bwd_x"] == 1.25 and row["rounds"] == 3
    assert f["fwd_rounds_ms"] == [1.0, 3.0, 2.0] and (f["fwd_ms_min"], f["fwd_ms_max"]) == (1.0, 3.0)
    assert f["mask_rounds_ms"] == [0.5, 0.4, 0.6] and x["bwd_rounds_ms"] == [6.0, 4.0, 5.0]
    assert row["fwd_x_rounds"] == [2.0, 1.0, 1.0] and row["bwd_x_rounds"] == [1.5, 1.0, 1.0]
    assert row["lowered_to"] == "causal" and row["max_diff_vs_flex"] == 0.0 and "error" not in row
    note = mods.table([row])
    assert "3 interleaved rounds" in note and "widest spread of a cell's rounds 200.0% (doc, fagen fwd)" in note
    assert "doc fwd 1.00-2.00; doc bwd 1.00-1.50" in note


def test_a_mods_row_in_one_round_is_the_earlier_suite(monkeypatch):
    given = {"fagen": {"mask_ms": [0.5], "fwd_ms": [1.0], "bwd_ms": [4.0]},
             "flex": {"mask_ms": [3.0], "fwd_ms": [2.0], "bwd_ms": [6.0]}}
    mods, log = _fake_mods(monkeypatch, given)
    row, = mods.mod_rows("cuda", mods.ModsShape(), log=lambda _: None, rounds=1)
    assert [(n, k) for n, k, _ in log] == [("fagen", "setup"), ("fagen", "mask_ms"), ("fagen", "fwd_ms"),
                                           ("fagen", "bwd_ms"), ("flex", "setup"), ("flex", "mask_ms"),
                                           ("flex", "fwd_ms"), ("flex", "bwd_ms")]
    assert all(m is None for _, _, m in log)
    assert row["fagen"] == {"fwd_ms": 1.0, "bwd_ms": 4.0, "fwd_TF/s": 4.0, "bwd_TF/s": 2.5}
    assert (row["fwd_x"], row["bwd_x"], row["fagen_mask_ms"]) == (2.0, 1.5, 0.5)
    assert "rounds" not in row and "fwd_x_rounds" not in row and "interleaved" not in mods.table([row])


def test_a_layouts_row_times_its_impls_in_rounds_with_a_share_of_the_budget(monkeypatch):
    from fagen.bench import layouts

    seen, given = [], {"one": [3.0, 1.0, 2.0], "two": [5.0, 5.0, 4.0]}

    def fake_measure(call, n, device, warm, rep, stream=None, memo=None):
        name = call(0)
        seen.append((name, warm, rep, memo is None))
        return given[name][sum(1 for s in seen if s[0] == name) - 1]

    monkeypatch.setattr(layouts, "measure", fake_measure)
    row = {}
    got = layouts.timed({"one": lambda: "one", "two": lambda: "two"}, "cpu", 300.0, 3, row)
    assert [s[0] for s in seen] == ["one", "two", "two", "one", "one", "two"]
    assert all(s[1:] == (25.0 / 3, 100.0, False) for s in seen)
    assert got["one"] == {"ms": 2.0, "rounds_ms": [3.0, 1.0, 2.0], "ms_min": 1.0, "ms_max": 3.0}
    assert got["two"]["ms"] == 5.0 and row == {"rounds": 3}
    seen.clear()
    row = {}
    got = layouts.timed({"one": lambda: "one", "two": lambda: "two"}, "cpu", 300.0, 1, row)
    assert seen == [("one", 25.0, 300.0, True), ("two", 25.0, 300.0, True)]
    assert got == {"one": {"ms": 3.0}, "two": {"ms": 5.0}} and row == {}


@pytest.mark.parametrize("suite", ["layouts", "mods"])
def test_the_cli_passes_rounds_to_the_suites_and_their_json(monkeypatch, tmp_path, suite):
    import importlib

    from click.testing import CliRunner

    from fagen.cli import main

    # The process's own device: on a GPU machine a `--device cpu` run is refused once a test of this worker has imported
    # GPU-mode kernels (the interpreter's mode is per process); `run` is faked, so the device only has to be accepted.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mod, seen = importlib.import_module(f"fagen.bench.{suite}"), []
    monkeypatch.setattr(mod, "run", lambda device, log=None, quick=False, rounds=None, **kw: seen.append(rounds) or [])
    out = tmp_path / "s.json"
    res = CliRunner().invoke(main, ["bench", "--suite", suite, "--device", device, "--rounds", "3", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert seen == [3] and json.loads(out.read_text())["meta"]["rounds"] == 3
    res = CliRunner().invoke(main, ["bench", "--suite", suite, "--device", device, "--json", str(out)])
    assert res.exit_code == 0 and seen[-1] == rounds.SUITE_ROUNDS  # without --rounds: the suites' own default
    assert json.loads(out.read_text())["meta"]["rounds"] == rounds.SUITE_ROUNDS


def test_a_mods_row_keeps_fagens_side_where_flex_fails_and_checks_it_against_float64(monkeypatch):
    """The learned bias's row: Flex's backward fails to compile on sm_90 (233 KB of shared memory), so the row
    keeps fagen's times and names Flex's error; fagen's output is then checked against float64 instead."""
    given = {"fagen": {"mask_ms": [0.5], "fwd_ms": [1.0], "bwd_ms": [4.0]}}
    mods, log = _fake_mods(monkeypatch, given)

    def flex_fails(*args):
        raise RuntimeError("No valid triton configs. OutOfMemoryError: out of resource\nmore")
    monkeypatch.setattr(mods, "_flex_side", flex_fails)
    monkeypatch.setattr(mods, "_float64_diff", lambda out, *a: 1.5e-3)
    row, = mods.mod_rows("cuda", mods.ModsShape(), log=lambda _: None, rounds=1)
    assert "error" not in row and "flex" not in row and "fwd_x" not in row
    assert row["fagen"]["fwd_ms"] == 1.0 and row["max_diff_vs_float64"] == 1.5e-3
    assert row["flex_error"] == "RuntimeError: No valid triton configs. OutOfMemoryError: out of resource"
    table = mods.table([row])
    assert "| doc | 4 | fails | - | 2 | fails | - |" in table, table
    from fagen.bench.mods_table import line
    assert "flex failed (RuntimeError: No valid" in line(row) and "vs float64 1.5e-03" in line(row)

    monkeypatch.setattr(mods, "_fagen_side", flex_fails)  # fagen's own failure still fails the row
    row, = mods.mod_rows("cuda", mods.ModsShape(), log=lambda _: None, rounds=1)
    assert row["error"].startswith("RuntimeError: No valid triton configs")


def test_the_float64_check_of_a_mods_row_reads_the_reference_of_the_same_mods():
    import torch

    from fagen.bench import gym_mods as g
    from fagen.bench import mods
    from fagen.verify import reference

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 70, 16, generator=gen) for _ in range(3))
    bias = torch.randn(2, 139, generator=gen) * 0.1
    score_mod = g.generate_relative_bias(bias, 70)
    want, _ = reference.attention(q.double(), k.double(), v.double(), score_mod=score_mod, mask_mod=g.causal_mask)
    assert mods._float64_diff(want.float(), q, k, v, score_mod, g.causal_mask) < 1e-6
    assert mods._float64_diff(want.float(), q, k, v, None, g.causal_mask) > 1e-3  # the mod dropped: seen
