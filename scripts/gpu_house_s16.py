"""Sixteenth session, house: the mods suite on interleaved rounds ([Note] Mods rounds in fagen/bench/mods.py).

`python3 cli.py bench --suite mods --case document+causal --case sliding-window+causal` through the CLI itself
(fagen.cli.main in one child process, its lines streamed: one import, and Flex's compiles shared by the runs),
several times:
  run 0: MODES[0] with everything cold (fagen's kernels and Flex compiled inside the run: 42 s in round A);
  then the MODES in turn ("new": --rounds ROUNDS, the default now; "old": --rounds 1, fagen then Flex each timed in
  its own loop, the earlier suite) as long as the budget leaves time for one more run.
The suite's `cases` is memoised in the child so every run hands Flex the same mod functions (Dynamo's guards hold:
no recompile per run); the rows, inputs and timing are the suite's. For each row and run: Flex / fagen forward and
backward (the table's x columns), TF/s, and for the new runs the per-round ratios (min-max). Then, per row,
direction and mode, how far the x moves between the runs (values, median, max - min). The table also goes to
$OUTX/table.txt as it grows; each run's JSON to $OUTX/run<i>-<mode>.json.

    HOUSE_BUDGET=55 PYTHONPATH=$PWD python3 scripts/gpu_house_s16.py     # < 60 s on an H100
    HOUSE_DRY=1 TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 scripts/gpu_house_s16.py   # the CPU: --quick, the flow
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for _phases
from _phases import child_env, run_phase  # noqa: E402

T0 = time.time()
CASES = tuple(os.environ.get("HOUSE_CASES", "document+causal,sliding-window+causal").split(","))
MODES = os.environ.get("HOUSE_MODES", "old,new").split(",")  # round A: a warm run took 2.5 s
ROUNDS = int(os.environ.get("HOUSE_ROUNDS", 5))
BUDGET = float(os.environ.get("HOUSE_BUDGET", 55))  # seconds from the start: no run starts that would pass it
DRY = os.environ.get("HOUSE_DRY") == "1"
OUT = os.environ.get("OUTX") or "/tmp/house-s16"
MAX_RUNS = 12
LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "table.txt"), "w") as f:
        f.write("\n".join(LINES) + "\n")


def rounds_of(mode: str) -> int:
    return ROUNDS if mode == "new" else int(mode[3:]) if mode.startswith("new") else 1


def child() -> None:
    """The runs, in this process; prints one JSON line per run ('RUN {...}')."""
    from fagen.bench import mods
    from fagen.cli import main as cli_main

    memo = {}
    real = mods.cases

    def cases(shape, device):  # the same mod functions every run: Flex's compiled graphs stay valid
        key = (shape, str(device))
        if key not in memo:
            memo[key] = real(shape, device)
        return memo[key]

    mods.cases = cases
    longest, runs = 0.0, 0
    while runs < MAX_RUNS:
        mode = MODES[runs % len(MODES)]
        if runs and time.time() - T0 + 1.2 * longest > BUDGET:
            break
        path = os.path.join(OUT, f"run{runs}-{mode}.json")
        args = ["bench", "--suite", "mods", *[x for c in CASES for x in ("--case", c)], "--rounds",
                str(rounds_of(mode)), "--json", path] + (["--quick", "--device", "cpu"] if DRY else [])
        t, error = time.time(), None
        print(f"-- run {runs} {mode}: cli.py {' '.join(args)}", flush=True)
        try:  # the CLI itself, its lines streamed (a run cut off by the budget still shows how far it got)
            cli_main.main(args, prog_name="fagen", standalone_mode=False)
        except BaseException as e:  # noqa: BLE001 - recorded in the table
            error = f"{type(e).__name__}: {e}"[:400]
        took = time.time() - t
        if runs:
            longest = max(longest, took)
        if error or not os.path.exists(path):
            print("RUN " + json.dumps({"mode": mode, "s": took, "error": error or "no JSON"}), flush=True)
            break
        records = json.load(open(path))["records"]
        print("RUN " + json.dumps({"mode": mode, "s": took, "records": records}), flush=True)
        runs += 1


def describe(i: int, run: dict) -> str:
    line = f"run {i} {run['mode']:<4} {run['s']:5.1f} s:"
    for r in run["records"]:
        if "error" in r:
            line += f"  {r['case']} error {r['error'][:120]}"
            continue
        f, x = r["fagen"], r.get("flex", {})
        line += (f"  {r['case']} fwd {r.get('fwd_x', float('nan')):.3f}x ({f['fwd_TF/s']:.0f}/"
                 f"{x.get('fwd_TF/s', 0):.0f}) bwd {r.get('bwd_x', float('nan')):.3f}x ({f['bwd_TF/s']:.0f}/"
                 f"{x.get('bwd_TF/s', 0):.0f})")
        if r.get("fwd_x_rounds"):
            line += (f" [rounds fwd {min(r['fwd_x_rounds']):.2f}-{max(r['fwd_x_rounds']):.2f}, bwd "
                     f"{min(r['bwd_x_rounds']):.2f}-{max(r['bwd_x_rounds']):.2f}]")
        if r.get("fagen_mask_ms") is not None:
            line += f" mask {r['fagen_mask_ms']:.2f}/{r.get('flex_mask_ms') or 0:.2f} ms"
    return line


def summary(runs: list[dict]) -> None:
    say("")
    say("| row | x | mode | Flex/fagen, run by run (* run 0: cold, in the median) | median | max - min |")
    say("|---|---|---|---|---|---|")
    for case in CASES:
        for d in ("fwd", "bwd"):
            for mode in dict.fromkeys(r["mode"] for r in runs):
                got = [(i, rec.get(f"{d}_x")) for i, r in enumerate(runs) if r["mode"] == mode
                       for rec in r.get("records", []) if rec["case"] == case and rec.get(f"{d}_x") is not None]
                vals = [v for _, v in got]
                if vals:
                    say(f"| {case} | {d} | {mode} | {' '.join(f'{v:.3f}' + ('*' if i == 0 else '') for i, v in got)} | "
                        f"{statistics.median(vals):.3f} | {max(vals) - min(vals):.3f} |")
                per = [statistics.median(rec[f"{d}_x_rounds"]) for i, r in enumerate(runs) if i and r["mode"] == mode
                       for rec in r.get("records", []) if rec["case"] == case and rec.get(f"{d}_x_rounds")]
                if per:  # the median of each run's per-round ratios (a round's clock cancels in its ratio)
                    say(f"| {case} | {d} | {mode}, per-round ratio | {' '.join(f'{v:.3f}' for v in per)} | "
                        f"{statistics.median(per):.3f} | {max(per) - min(per):.3f} |")


def main() -> None:
    say(f"# house s16: the mods suite, old (--rounds 1) against new (--rounds {ROUNDS}); cases {', '.join(CASES)}; "
        f"modes {'/'.join(MODES)} in turn")
    runs: list[dict] = []

    def on_line(line: str) -> None:
        if line.startswith("RUN "):
            run = json.loads(line[4:])
            runs.append(run)
            say(f"run {len(runs) - 1} {run['mode']}: {run['error']}" if "error" in run else
                describe(len(runs) - 1, run))
        else:
            print("  | " + line.rstrip(), flush=True)  # the CLI's own lines: stdout only

    env = child_env("/tmp/house-s16-cache")
    if DRY:
        env["TRITON_INTERPRET"] = "1"
    rc, _ = run_phase(__file__, "runs", BUDGET + 2.5 - (time.time() - T0), env, on_line)
    say(f"child: {rc}")
    summary(runs)
    say(f"total {time.time() - T0:.1f} s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--phase"]:
        child()
    else:
        main()
