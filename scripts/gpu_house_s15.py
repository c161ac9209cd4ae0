"""Fifteenth session, house: the bench's row order at the power cap ([Note] Interleaved rounds, fagen/bench/rounds.py).

The rows of `fagen bench --suite standard --impl fagen --impl sdpa-cudnn --impl cudnn-fp8 --case fwd-fp8-d128-full-s16k
--case fwd-d128-full-s16k --case bwd-d128-causal-s16k`, through the CLI's own path (fagen.bench.runner.run, in this
process: one import and one compile for every run), several times in one process:
  run 0: the earlier bench (rounds 1: each impl checked against the float64 reference, then timed, in turn);
  then, without the check, the MODES in turn ("new": interleaved rounds, --rounds ROUNDS; "newN": N rounds; "old":
  rounds 1) as long as the budget leaves time for one more run (--warmup 25 --rep 100 in all: the same timing
  budget a row); last (round B on), the brief's command itself through the CLI in this process, --no-check
  --no-isolate, --rounds 1 and --rounds ROUNDS, its table and JSON ($OUTX/cli-rounds*.json).
For each row and run it prints fagen / best peer (the table's column); for each mode, how far that ratio moves
between its runs (median, max - min, the largest change between two consecutive runs of the mode; run 0 is a mode
of its own, "old+check": the earlier bench checks each impl right before timing it); for the new runs also the
per-round ratio (a round's peer ms / fagen ms: median, min, max). The table is written to $OUTX/table.txt as it
grows, the records to $OUTX/runs.json.

    HOUSE_BUDGET=50 PYTHONPATH=$PWD python3 scripts/gpu_house_s15.py   # < 60 s on an H100 (no run starts that
                                                                       # would end past the budget)
    HOUSE_MODES=new,old HOUSE_CLI=0 ...                                # round A's plan
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

T0 = time.time()
CASES = tuple(os.environ.get("HOUSE_CASES", "fwd-fp8-d128-full-s16k,fwd-d128-full-s16k,bwd-d128-causal-s16k")
              .split(","))
IMPLS = ("fagen", "sdpa-cudnn", "cudnn-fp8")
MAX_RUNS = 19  # round A: a run took 1.3 s after the check run's 22 s (compiles included)
MODES = os.environ.get("HOUSE_MODES", "new,old").split(",")  # cycled after run 0; newN: N rounds (new: ROUNDS)
CLI = os.environ.get("HOUSE_CLI", "1") == "1"  # last, the brief's command through the CLI, --rounds 1 and ROUNDS
GUESS_S = 5.0  # a run without the check, before one was timed (s14: ~1 s of timing a row and impl, inputs, loads)
ROUNDS = int(os.environ.get("HOUSE_ROUNDS", 5))
BUDGET = float(os.environ.get("HOUSE_BUDGET", 50))  # seconds from the start: no run starts that would pass it
OUT = os.environ.get("OUTX") or "/tmp/house-s15"
DRY = os.environ.get("HOUSE_DRY") == "1"  # the CPU (TRITON_INTERPRET=1): --quick shapes, sdpa-flash, the flow only
IMPLS = ("fagen", "sdpa-flash") if DRY else IMPLS
LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "table.txt"), "w") as f:
        f.write("\n".join(LINES) + "\n")


def ratio(records: list[dict], case: str) -> tuple[float | None, str, list[float]]:
    """(fagen / best peer by median ms, the best peer, the per-round ratios against it where both have rounds)."""
    by = {r["impl"]: r for r in records if r["case"] == case and r["status"] == "ok" and r.get("check") != "fail"}
    peers = [i for i in by if i != "fagen"]
    if "fagen" not in by or not peers:
        return None, "-", []
    best = min(peers, key=lambda i: by[i]["ms"])
    mine, theirs = by["fagen"], by[best]
    per_round = [p / f for p, f in zip(theirs.get("rounds_ms") or [], mine.get("rounds_ms") or [])]
    return theirs["ms"] / mine["ms"], best, per_round


def main() -> None:
    from fagen.bench import runner
    from fagen.bench.cases import BenchOptions
    from fagen.bench.workloads import standard_suite

    cases = [c for c in standard_suite(quick=DRY) if c.name in CASES]
    say(f"# house s15: bench order (cases {', '.join(c.name for c in cases)}; impls {', '.join(IMPLS)}; "
        f"new = {ROUNDS} rounds; import {time.time() - T0:.1f} s)")
    runs: list[tuple[str, list[dict], float]] = []
    plan = ["old+check"]
    longest = 0.0
    while plan:
        mode = plan.pop(0)
        dry = dict(rep_ms=2, warmup_ms=1) if DRY else {}
        opts = BenchOptions(device="cpu" if DRY else "cuda", impls=IMPLS, **dry, check=mode.endswith("check"),
                            rounds=rounds_of(mode))
        t = time.time()
        log = print if mode.endswith("check") else (lambda _line: None)
        _, records = runner.run(cases, opts, log=log)
        took = time.time() - t
        runs.append((mode, records, took))
        if mode.endswith("check"):
            bad = [f"{r['case']}/{r['impl']}: {r['status']} {r.get('check')} {r.get('note', '')[:80]}"
                   for r in records if r["status"] != "ok" or r.get("check") == "fail"]
            say(f"check run ({took:.1f} s): " + ("all ok" if not bad else "; ".join(bad)))
        else:
            longest = max(longest, took)
        line = f"run {len(runs) - 1} {mode:<9} {took:5.1f} s:"
        for c in cases:
            r, best, per_round = ratio(records, c.name)
            line += f"  {c.name} {'-' if r is None else f'{r:.3f}x'} {best}"
            if per_round:
                line += (f" (rounds {statistics.median(per_round):.3f} "
                         f"[{min(per_round):.3f}, {max(per_round):.3f}])")
        say(line)
        with open(os.path.join(OUT, "runs.json"), "w") as f:
            json.dump([{"mode": m, "seconds": s, "records": recs} for m, recs, s in runs], f, indent=1)
        nxt = MODES[(len(runs) - 1) % len(MODES)]
        if len(runs) < MAX_RUNS and time.time() - T0 + 1.25 * (max(longest, 2.0) if longest else GUESS_S) \
                + CLI * CLI_S < BUDGET:
            plan.append(nxt)
    summary(cases, runs)
    if CLI:
        cli_runs(cases)


def rounds_of(mode: str) -> int:
    if mode.startswith("new"):
        return int(mode[3:]) if mode[3:] else ROUNDS
    return 1


CLI_S = 8.0  # the two CLI runs at the end (no check, in this process: ~1.5 s each, the tables)


def cli_runs(cases) -> None:
    """`cli.py bench --suite standard --impl ... --case ...` itself, in this process (no import, kernels loaded),
    --no-check --no-isolate, --rounds 1 then --rounds ROUNDS: fagen/best peer from each JSON."""
    from click.testing import CliRunner
    from fagen.cli import main as cli_main

    say("")
    for rounds in (1, ROUNDS):
        path = os.path.join(OUT, f"cli-rounds{rounds}.json")
        dry = ["--device", "cpu", "--quick", "--rep", "2", "--warmup", "1"] if DRY else []
        args = ["bench", "--suite", "standard", *[x for i in IMPLS for x in ("--impl", i)],
                *[x for c in cases for x in ("--case", c.name)], "--no-check", "--no-isolate",
                "--rounds", str(rounds), "--json", path, *dry]
        t = time.time()
        res = CliRunner().invoke(cli_main, args, catch_exceptions=True)
        took = time.time() - t
        if res.exit_code != 0 or not os.path.exists(path):
            say(f"cli --rounds {rounds}: exit {res.exit_code} {res.exception!r} {res.output[-300:]}")
            continue
        records = json.load(open(path))["records"]
        say(f"cli --rounds {rounds} ({took:.1f} s): " + "  ".join(
            f"{c.name} {'-' if r is None else f'{r:.3f}x'}" for c in cases for r in [ratio(records, c.name)[0]]))
        tail = [ln for ln in res.output.splitlines() if ln.startswith("|") or ln.startswith("  - timing")]
        for ln in tail:
            say("    " + ln)


def summary(cases, runs) -> None:
    say("")
    say("| case | mode | fagen/best peer, run by run | median | max - min | largest change between consecutive runs |")
    say("|---|---|---|---|---|---|")
    modes = list(dict.fromkeys(m for m, _, _ in runs))
    for c in cases:
        for mode in modes:
            vals = [ratio(recs, c.name)[0] for m, recs, _ in runs if m == mode]
            vals = [v for v in vals if v is not None]
            if not vals:
                continue
            steps = [abs(b - a) for a, b in zip(vals, vals[1:])]
            say(f"| {c.name} | {mode} | {' '.join(f'{v:.3f}' for v in vals)} | {statistics.median(vals):.3f} | "
                f"{max(vals) - min(vals):.3f} | {max(steps) if steps else float('nan'):.3f} |")
    say("")
    say("| case | impl | mode | TF/s run by run |")
    say("|---|---|---|---|")
    for c in cases:
        for impl in IMPLS:
            for mode in modes:
                vals = [r["tflops"] for m, recs, _ in runs if m == mode for r in recs
                        if r["case"] == c.name and r["impl"] == impl and r["status"] == "ok"]
                if vals:
                    say(f"| {c.name} | {impl} | {mode} | {' '.join(f'{v:.0f}' for v in vals)} |")
    say(f"total {time.time() - T0:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
