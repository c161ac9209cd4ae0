"""`fagen bench`: fagen against the peers on the same inputs; reports and plots of earlier runs."""

from __future__ import annotations

from pathlib import Path

import click

from fagen.bench import IMPLS
from fagen.bench.rounds import ROUNDS, SUITE_ROUNDS
from fagen.cli.common import cases_from_options, console, pick_device, shape_options, spec_options

@click.command()
@spec_options
@shape_options
@click.option("--suite", type=click.Choice(["standard", "scores", "serving", "latency", "cp", "layouts", "mods"]),
              help="A named table of cases instead of one spec. scores: the score-switch rows of the standard suite "
                   "with fagen-only baselines; serving: MLA 192/128, the fp8 KV cache and the cost of batch-invariant "
                   "decode (docs/serving.md); latency: host time per call against SDPA; cp: ring "
                   "attention on 1 and N GPUs (torchrun; --seq-q, --batch, --heads, --head-dim, --dtype, --mask shape it, "
                   "--device and --quick pass on); layouts: "
                   "paged decode and varlen prefill against fagen's dense kernels and the peers; mods: attention-gym's "
                   "score_mod/mask_mod against FlexAttention, builtin-as-mod, cold first call, changed closure scalar.")
@click.option("--case", "case_names", multiple=True, metavar="NAME", help="Only these rows of the suite (repeatable).")
@click.option("--quick", is_flag=True, help="Shrink every shape for a smoke run.")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--impl", "impls", multiple=True, type=click.Choice(IMPLS),
              help="Only these implementations (repeatable; default all; fagen-nondet: deterministic=False).")
@click.option("--skip-flex", is_flag=True, help="Leave FlexAttention out (saves its torch.compile time).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the records here (rewritten after every case).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Draw fagen against the peers into this PNG (needs matplotlib).")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="Run nothing: print the markdown table of a bench JSON file (and --plot it).")
@click.option("--into", "into_path", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="With --report: write the table between the report markers of this file (a README).")
@click.option("--time-limit", type=click.FloatRange(min=1), metavar="SECONDS",
              help="Start no case after this; the rest are recorded as skipped.")
@click.option("--case-timeout", type=click.FloatRange(min=1), default=300, show_default=True, metavar="SECONDS",
              help="With --isolate: a case running longer is killed and recorded as an error.")
@click.option("--isolate/--no-isolate", default=None,
              help="Run the cases in a worker process that is restarted after a crash (default: on for CUDA).")
@click.option("--warmup", type=click.FloatRange(min=0), default=25, show_default=True, help="Warm-up, ms.")
@click.option("--rep", type=click.FloatRange(min=1), default=100, show_default=True, help="Timed repetitions, ms.")
@click.option("--rounds", type=click.IntRange(1, 50), default=ROUNDS, show_default=True,
              help="Time a case's implementations in this many interleaved rounds, the order rotated each round, "
                   "--warmup and --rep shared among them (1: one after another; the layouts and mods suites' default: "
                   f"{SUITE_ROUNDS}).")
@click.option("--sets", type=click.IntRange(1, 16), default=3, show_default=True,
              help="Input sets rotated through, so repeated calls do not hit the L2 cache.")
@click.option("--no-check", is_flag=True, help="Time without checking outputs against the float64 reference.")
@click.option("--seed", type=int, default=0, show_default=True)
def bench(spec_file, batch, heads, seq_q, seq_k, suite, case_names, quick, device, impls, skip_flex, json_path,
          plot_path, report_path, into_path, time_limit, case_timeout, isolate, warmup, rep, rounds, sets, no_check,
          seed, **flags):
    """Time fagen's kernel and the peers (SDPA flash/cudnn/efficient, FlexAttention) on the same inputs.

    Each implementation is first checked against the float64 reference, then timed (CUDA events, median,
    rotating input sets). The final table is printed last.

    \b
    Examples:
      fagen bench --suite standard --json benchmarks/h100.json --plot benchmarks/h100.png
      fagen bench --suite standard --case fwd-d128-causal-s16k --skip-flex
      fagen bench --suite latency --json benchmarks/latency.json
      fagen bench --suite layouts --json benchmarks/layouts.json
      fagen bench --suite cp --seq-q 131072 --json benchmarks/cp/cp.json
      fagen bench --head-dim 128 --mask causal --dtype bf16 --seq-q 8192
      fagen bench --report benchmarks/h100.json > table.md
      fagen bench --report benchmarks/h100.json --into benchmarks/README.md
    """
    from fagen.bench import report, runner
    from fagen.bench.cases import IMPLS, BenchOptions

    out = console()
    if report_path is not None:
        try:
            meta, records = runner.read_json(report_path)
        except ValueError as e:
            raise click.ClickException(str(e)) from None
        if plot_path is not None:
            _plot(report, records, plot_path, report_path, err=True)
        table = report.markdown(records, meta)
        if into_path is None:
            click.echo(table, nl=False)
            return
        try:
            text = report.splice(into_path.read_text(), table)
        except ValueError as e:
            raise click.ClickException(f"{into_path}: {e}") from None
        from fagen.files import write_if_different

        write_if_different(into_path, text)
        click.echo(f"wrote the table into {into_path}")
        return
    if into_path is not None:
        raise click.UsageError("--into goes with --report FILE")
    if suite == "cp":
        from fagen.distributed.bench import launch_cp_bench

        raise click.exceptions.Exit(launch_cp_bench(_cp_args(pick_device(device), quick, batch, heads, seq_q,
                                                             json_path, flags)))
    if suite == "latency":
        return _latency(pick_device(device), json_path, out, quick)
    if suite in ("layouts", "mods"):  # [Note] Layout rows in fagen/bench/layouts.py, [Note] Mods rows in mods.py
        import importlib

        device, log = pick_device(device), _logger(out)
        run = importlib.import_module(f"fagen.bench.{suite}").run
        kw = {"names": case_names, "flex": not skip_flex} if suite == "mods" else {}
        if click.get_current_context().get_parameter_source("rounds") is click.core.ParameterSource.DEFAULT:
            rounds = SUITE_ROUNDS  # fagen.bench.rounds: these suites' default
        return _write(device, json_path, run(device, log=log, quick=quick, rounds=rounds, **kw), log,
                      {"rounds": min(rounds, 2) if quick else rounds})  # --quick: at most 2 (the suites' run)
    cases = cases_from_options(suite, case_names, quick, spec_file, batch, heads, seq_q, seq_k, seed, flags)
    if cases is None:
        raise click.UsageError("give spec flags (--head-dim ...), --suite standard, or --report FILE")
    device = pick_device(device)
    chosen = tuple(i for i in IMPLS if (not impls or i in impls) and not (skip_flex and i == "flex"))
    if not chosen:
        raise click.UsageError("--impl/--skip-flex leave no implementation to run")
    opts = BenchOptions(device=device, impls=chosen, warmup_ms=warmup, rep_ms=rep, sets=sets, check=not no_check,
                        seed=seed, rounds=rounds)
    if isolate is None:
        isolate = device == "cuda" and len(cases) > 1

    log = _logger(out)
    meta, records = runner.run(cases, opts, json_path=json_path, isolate=isolate, time_limit=time_limit,
                               case_timeout=case_timeout, log=log, extra_meta={"quick": quick})
    if json_path is not None:
        log(f"wrote {json_path} ({len(records)} records)")
    if plot_path is not None:
        _plot(report, records, plot_path, json_path)
    where = f"{meta.get('gpu', device)}, torch {meta['torch']}, triton {meta['triton']}"
    report.print_table(records, out, title=f"fagen bench ({where}; {meta['total_s']:.1f} s)", meta=meta)
    out.file.flush()


def _cp_args(device, quick, batch, heads, seq_q, json_path, flags) -> list[str]:
    """The flags of python -m fagen.distributed.bench that `fagen bench --suite cp` passes on (its --help)."""
    given = [("--device", device), ("--quick", quick), ("--batch", batch), ("--seq", seq_q), ("--heads", heads),
             ("--head-dim", flags.get("head_dim")), ("--dtype", flags.get("dtype")), ("--mask", flags.get("mask")),
             ("--json", json_path)]
    return [item for flag, value in given if value not in (None, False)
            for item in ((flag,) if value is True else (flag, str(value)))]


def _plot(report, records, plot_path, json_path, err=False):
    try:
        report.plot(records, plot_path)
    except ImportError:
        again = f"fagen bench --report {json_path} --plot {plot_path}" if json_path else "rerun with --json FILE"
        click.echo(f"plot skipped: matplotlib is not installed (pip install 'fagen[plot]'); later: {again}",
                   err=err)
        return
    click.echo(f"wrote {plot_path}", err=err)


def _logger(out):
    """One line to the console, flushed at once (the suites print progress as they go)."""
    def log(line: str) -> None:
        out.print(line, markup=False, highlight=False)
        out.file.flush()
    return log


def _write(device, json_path, records, log, meta=None) -> None:
    """A suite's records into --json (with the machine's description and `meta`), if given."""
    from fagen.bench import runner

    if json_path is not None:
        runner.write_json(json_path, {**runner.environment_meta(device), **(meta or {})}, records)
        log(f"wrote {json_path}")


def _latency(device, json_path, out, quick):
    """The latency suite ([Note] Host time in fagen/bench/latency.py), with a cProfile of fagen's loop."""
    import dataclasses

    from fagen.bench import latency

    log = _logger(out)
    if quick:  # a smoke run (the interpreter on the CPU): tiny shapes, few calls
        cases = [dataclasses.replace(c, heads_q=4, heads_kv=2, seq_k=min(c.seq_k, 64), seq_q=min(c.seq_q, 16),
                                     head_dim=32) for c in latency.CASES]
        records = latency.run(device, calls=3, rounds=1, log=log, profile=json_path is not None, cases=cases)
    else:
        records = latency.run(device, log=log, profile=json_path is not None)
    _write(device, json_path, records, log)
