"""`fagen tune`: search launch configs on a GPU and store the winners in the tuned table."""

from __future__ import annotations

from pathlib import Path

import click

from fagen.cli.common import cases_from_options, console, pick_device, shape_options, spec_options

@click.command()
@spec_options
@shape_options
@click.option("--suite", type=click.Choice(["standard"]),
              help="Tune every spec of a bench suite (the first case of each tuning key).")
@click.option("--quick", is_flag=True, help="Small shapes and a small search grid: a smoke run.")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--table", type=click.Path(dir_okay=False, path_type=Path),
              help="Tuned table to update (default: your own, tuned.json in the cache root, which specs read over "
                   "the shipped fagen/spec/tuned.json).")
@click.option("--dry-run", is_flag=True, help="Search and report, write nothing.")
@click.option("--force", is_flag=True, help="Tune keys that already have an entry too.")
@click.option("--time-limit", type=click.FloatRange(min=1), metavar="SECONDS",
              help="Try no candidate after this; what was tuned so far is kept.")
@click.option("--rep", type=click.FloatRange(min=1), default=50, show_default=True, help="Timed repetitions, ms.")
@click.option("--jobs", type=click.IntRange(min=1), default=8, show_default=True,
              help="Processes that compile the candidates in parallel before the timing loop (CUDA only).")
@click.option("--seed", type=int, default=0, show_default=True)
def tune(spec_file, batch, heads, seq_q, seq_k, suite, quick, device, table, dry_run, force, time_limit, rep, jobs,
         seed, **flags):
    """Search block sizes, warps and stages on the GPU and store the fastest verified config per
    (arch, head_dim, mask, dtype, direction, kind) in the tuned table that specs read their defaults from.

    Every candidate is checked against the float64 reference on a small ragged problem before it is timed.
    Flags such as --block-m 128 pin that axis of the search.

    \b
    Examples:
      fagen tune --head-dim 128 --mask causal --dtype bf16
      fagen tune --suite standard --time-limit 540      # resumable: tuned keys are skipped
      fagen tune --device cpu --quick --head-dim 32 --dry-run
    """
    import time as _time

    from fagen.bench import tune as tuner
    from fagen.bench.cases import BenchOptions
    from fagen.spec import tuned

    out = console()
    fixed = {k: flags[k] for k in ("block_m", "block_n", "num_warps", "num_stages") if flags.get(k) is not None}
    cases = cases_from_options(suite, (), quick, spec_file, batch, heads, seq_q, seq_k, seed,
                                {k: v for k, v in flags.items() if k not in fixed})
    if cases is None:
        raise click.UsageError("give spec flags (--head-dim ...) or --suite standard")
    device = pick_device(device)
    own = table is None  # the user's table: existing entries are looked up through it and the shipped one
    table = table or tuned.user_table_path()
    if device == "cpu" and not dry_run and own:
        raise click.UsageError(f"tuning on the CPU times the interpreter: add --dry-run, or --table FILE to write "
                               f"its results somewhere other than your tuned table ({table}), which sets your specs' "
                               "default tiles")
    try:
        tuned.read_table(table)
    except tuned.TunedTableError as e:
        raise click.ClickException(str(e)) from None
    import torch

    dev = torch.device(device)
    arch = tuner.device_arch(dev)
    opts = BenchOptions(device=device, impls=("fagen",), rep_ms=rep, seed=seed)
    search = tuner.QUICK_SEARCH if quick else tuner.SEARCH
    deadline = None if time_limit is None else _time.monotonic() + time_limit

    def log(line: str) -> None:
        out.print(line, markup=False, highlight=False)
        out.file.flush()

    winners = []
    for case in tuner.unique_by_key(cases):
        spec, _ = case.spec(hopper=False)
        if not spec.deterministic:  # its tiles would land on the deterministic spec's key (tuned.json has no mode)
            log(f"{case.name}: deterministic=False is not tuned (the tuned table's keys have no mode); tune the "
                "deterministic spec, or pin deterministic=False tiles with --block-m/--block-n/...")
            continue
        if not force and tuner.existing(None if own else table, arch, spec) is not None:
            where = f"{table} or the shipped {tuned.TUNED_PATH.name}" if own else table
            log(f"{case.name}: {arch} already has an entry in {where} (--force to tune again)")
            continue
        if deadline is not None and _time.monotonic() > deadline:
            log(f"{case.name}: skipped (time limit)")
            continue
        trials, entry = tuner.tune_case(case, dev, opts, search, fixed, log, deadline, jobs=jobs)
        if entry is None:
            log(f"{case.name}: the table is unchanged for this key")
            continue
        winners.append(entry)
        if not dry_run:
            tuned.upsert(table, entry)
        ranked = sorted((t for t in trials if t.ms is not None), key=lambda t: t.ms)
        for t in ranked[:3]:
            log(f"  top: {' '.join(f'{k}={v}' for k, v in t.config.items())}  {t.ms:.4g} ms")
    for e in winners:
        what = f"{e['arch']} d{e['head_dim']} {e['mask']} {e['dtype']} {e['direction']} {e['kind']}"
        cfg = f"m{e['block_m']} n{e['block_n']} w{e['num_warps']} s{e['num_stages']}"
        log(f"winner {what}: {cfg}  {e['ms']:.4g} ms" + ("" if dry_run else f"  -> {table}"))
    if not winners:
        log("nothing tuned")
    elif not dry_run:
        log(f"wrote {len(winners)} entr{'y' if len(winners) == 1 else 'ies'} to {table}"
            + (" (your tuned table: specs read it over the shipped one; --table FILE writes elsewhere)" if own else ""))
