"""The fagen command line: generate, and the stages built on it."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from fagen import __version__
from fagen.enums import Backend, Direction, DType, Kind, Mask
from fagen.spec import KernelSpec, SpecError, read_fields

_SPEC_FLAGS = ("head_dim", "mask", "gqa", "dtype", "direction", "backend", "kind",
               "block_m", "block_n", "num_warps", "num_stages")


def spec_options(fn):
    """The flags that mirror KernelSpec, plus --spec FILE. Shared by every command that takes one spec."""
    options = [
        click.option("--spec", "spec_file", type=click.Path(dir_okay=False, path_type=Path),
                     help="Read the spec from a .toml or .json file (flags given too override its fields)."),
        click.option("--head-dim", type=int, help="Head dim: a multiple of 8 from 16 to 256."),
        click.option("--mask", type=click.Choice(Mask.choices()), help="Attention mask."),
        click.option("--gqa", type=int, help="Query heads per KV head (1 = MHA)."),
        click.option("--dtype", type=click.Choice(DType.choices()), help="Element type of q, k, v and out."),
        click.option("--direction", type=click.Choice(Direction.choices()), help="fwd, or bwd for training."),
        click.option("--backend", type=click.Choice(Backend.choices()), help="Emitted language."),
        click.option("--kind", type=click.Choice(Kind.choices()), help="prefill, or decode for short queries."),
        click.option("--block-m", type=int, help="Query rows per program (power of two, 16..256)."),
        click.option("--block-n", type=int, help="Keys per inner step (power of two, 16..256)."),
        click.option("--num-warps", type=int, help="Warps per program."),
        click.option("--num-stages", type=int, help="Software pipelining depth."),
    ]
    return functools.reduce(lambda f, opt: opt(f), reversed(options), fn)


def spec_from_options(spec_file: Path | None, **flags) -> KernelSpec | None:
    """The spec the flags describe, or None when none was given. Errors name the flag or file."""
    given = {k: v for k, v in flags.items() if k in _SPEC_FLAGS and v is not None}
    if spec_file is None and not given:
        return None
    fields = {}
    if spec_file is not None:
        try:
            fields = read_fields(spec_file)
        except SpecError as e:
            raise click.ClickException(f"{spec_file}: {e}") from None
    fields.update(given)
    if "head_dim" not in fields:
        raise click.UsageError("--head-dim is required (or give --spec FILE)")
    try:
        return KernelSpec.from_dict(fields)
    except SpecError as e:
        if e.field in given:
            raise click.BadParameter(f"got {e.value!r}; {e.allowed}",
                                     param_hint=f"--{e.field.replace('_', '-')}") from None
        raise click.ClickException(str(e)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fagen")
def main():
    """fagen: generate specialized attention kernels from a small validated spec."""


@main.command()
@spec_options
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("generated"),
              show_default=True, help="Directory for the rendered sources.")
def generate(spec_file, out_dir, **flags):
    """Render kernel source. With no spec, renders the default catalog.

    \b
    Examples:
      fagen generate --head-dim 64 --mask causal --gqa 4 --dtype bf16 -o out/
      fagen generate --spec my_kernel.toml
      fagen generate            # the default catalog into generated/
    """
    from fagen.manifest import DEFAULT_CATALOG, ManifestError, load_manifest
    from fagen.render import generate as render
    from fagen.tables import SOURCE_SUFFIX
    from fagen.cache import write_if_different

    spec = spec_from_options(spec_file, **flags)
    if spec is None:
        try:
            specs = load_manifest(DEFAULT_CATALOG).specs
        except ManifestError as e:
            raise click.ClickException(str(e)) from None
    else:
        specs = (spec,)
    # Render everything before writing anything: a failure leaves no half-written output.
    rendered = [(out_dir / f"{s.name}{SOURCE_SUFFIX[s.backend]}", render(s)) for s in specs]
    changed = sum(write_if_different(path, text) for path, text in rendered)
    if len(rendered) == 1:
        click.echo(f"wrote {rendered[0][0]}" if changed else f"{rendered[0][0]} is up to date")
    else:
        click.echo(f"rendered {len(rendered)} variants into {out_dir}/ ({changed} changed)")


# -- bench and tune (issue 5) -------------------------------------------------------------------------------
def _shape_options(fn):
    """--batch/--heads/--seq-q/--seq-k: the problem a single spec is measured on."""
    options = [
        click.option("--batch", type=click.IntRange(min=1), help="Batch size (default: batch x seq = 16k)."),
        click.option("--heads", type=click.IntRange(min=1),
                     help="Query heads, a multiple of --gqa (default: 2048 / head_dim)."),
        click.option("--seq-q", type=click.IntRange(min=1), help="Queries per sequence (default 4096; tree: nodes)."),
        click.option("--seq-k", type=click.IntRange(min=1), help="Keys per sequence (default: --seq-q)."),
    ]
    return functools.reduce(lambda f, opt: opt(f), reversed(options), fn)


def _pick_device(device: str) -> str:
    import os

    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise click.BadParameter("CUDA is not available here; use --device cpu (runs kernels through Triton's "
                                 "interpreter, for smoke runs only)", param_hint="--device")
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when generated modules are imported
    return device


def _cases_from_options(suite, case_names, quick, spec_file, batch, heads, seq_q, seq_k, seed, flags):
    from fagen.workload import SUITES, case_from_spec

    spec = spec_from_options(spec_file, **flags)
    if suite and spec is not None:
        raise click.UsageError("give either --suite or spec flags (--head-dim ...), not both")
    if suite:
        if any(x is not None for x in (batch, heads, seq_q, seq_k)):
            raise click.UsageError("--batch/--heads/--seq-q/--seq-k shape one spec's case; a --suite has its own")
        cases = SUITES[suite](quick=quick)
        if case_names:
            names = [c.name for c in cases]
            unknown = [n for n in case_names if n not in names]
            if unknown:
                raise click.BadParameter(f"unknown case(s) {', '.join(unknown)}; the {suite} suite has: "
                                         + ", ".join(names), param_hint="--case")
            cases = [c for c in cases if c.name in case_names]
        return cases
    if spec is None:
        return None
    if case_names:
        raise click.UsageError("--case selects rows of a --suite")
    overrides = [(k, v) for k, v in flags.items() if k in _SPEC_FLAGS and k not in
                 ("head_dim", "mask", "gqa", "dtype", "direction") and v is not None]
    if quick:  # small defaults for what was not given
        tree, decode = spec.mask is Mask.TREE, spec.kind is Kind.DECODE
        seq_q = seq_q or (1 if decode else 24 if tree else 64)
        seq_k = seq_k or (seq_q + 40 if tree else 96 if decode else seq_q)
        batch, heads = batch or 1, heads or 2 * spec.gqa
    try:
        return [case_from_spec(spec, batch=batch, heads=heads, seq_q=seq_q, seq_k=seq_k, overrides=overrides,
                               seed=seed)]
    except (ValueError, SpecError) as e:
        raise click.UsageError(str(e)) from None


@main.command()
@spec_options
@_shape_options
@click.option("--suite", type=click.Choice(["standard"]), help="Run a named table of cases instead of one spec.")
@click.option("--case", "case_names", multiple=True, metavar="NAME", help="Only these rows of the suite (repeatable).")
@click.option("--quick", is_flag=True, help="Shrink every shape for a smoke run.")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--impl", "impls", multiple=True, type=click.Choice(["fagen", "sdpa-flash", "sdpa-cudnn",
              "sdpa-efficient", "flex"]), help="Only these implementations (repeatable; default all).")
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
@click.option("--sets", type=click.IntRange(1, 16), default=3, show_default=True,
              help="Input sets rotated through, so repeated calls do not hit the L2 cache.")
@click.option("--no-check", is_flag=True, help="Time without checking outputs against the float64 reference.")
@click.option("--seed", type=int, default=0, show_default=True)
def bench(spec_file, batch, heads, seq_q, seq_k, suite, case_names, quick, device, impls, skip_flex, json_path,
          plot_path, report_path, into_path, time_limit, case_timeout, isolate, warmup, rep, sets, no_check, seed, **flags):
    """Time fagen's kernel and the peers (SDPA flash/cudnn/efficient, FlexAttention) on the same inputs.

    Each implementation is first checked against the float64 reference, then timed (CUDA events, median,
    rotating input sets). The final table is printed last.

    \b
    Examples:
      fagen bench --suite standard --json benchmarks/h100.json --plot benchmarks/h100.png
      fagen bench --suite standard --case fwd-d128-causal-s16k --skip-flex
      fagen bench --head-dim 128 --mask causal --dtype bf16 --seq-q 8192
      fagen bench --report benchmarks/h100.json > table.md
      fagen bench --report benchmarks/h100.json --into benchmarks/README.md
    """
    from rich.console import Console

    from fagen import report, runner
    from fagen.bench import IMPLS, BenchOptions

    console = Console(width=200, highlight=False) if not Console().is_terminal else Console(highlight=False)
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
        from fagen.cache import write_if_different

        write_if_different(into_path, text)
        click.echo(f"wrote the table into {into_path}")
        return
    if into_path is not None:
        raise click.UsageError("--into goes with --report FILE")
    cases = _cases_from_options(suite, case_names, quick, spec_file, batch, heads, seq_q, seq_k, seed, flags)
    if cases is None:
        raise click.UsageError("give spec flags (--head-dim ...), --suite standard, or --report FILE")
    device = _pick_device(device)
    chosen = tuple(i for i in IMPLS if (not impls or i in impls) and not (skip_flex and i == "flex"))
    if not chosen:
        raise click.UsageError("--impl/--skip-flex leave no implementation to run")
    opts = BenchOptions(device=device, impls=chosen, warmup_ms=warmup, rep_ms=rep, sets=sets, check=not no_check,
                        seed=seed)
    if isolate is None:
        isolate = device == "cuda" and len(cases) > 1

    def log(line: str) -> None:
        console.print(line, markup=False, highlight=False)
        console.file.flush()

    meta, records = runner.run(cases, opts, json_path=json_path, isolate=isolate, time_limit=time_limit,
                               case_timeout=case_timeout, log=log, extra_meta={"quick": quick})
    if json_path is not None:
        log(f"wrote {json_path} ({len(records)} records)")
    if plot_path is not None:
        _plot(report, records, plot_path, json_path)
    where = f"{meta.get('gpu', device)}, torch {meta['torch']}, triton {meta['triton']}"
    report.print_table(records, console, title=f"fagen bench ({where}; {meta['total_s']:.0f} s)", meta=meta)
    console.file.flush()


def _plot(report, records, plot_path, json_path, err=False):
    try:
        report.plot(records, plot_path)
    except ImportError:
        again = f"fagen bench --report {json_path} --plot {plot_path}" if json_path else "rerun with --json FILE"
        click.echo(f"plot skipped: matplotlib is not installed (pip install 'fagen[plot]'); later: {again}",
                   err=err)
        return
    click.echo(f"wrote {plot_path}", err=err)


@main.command()
@spec_options
@_shape_options
@click.option("--suite", type=click.Choice(["standard"]),
              help="Tune every spec of a bench suite (the first case of each tuning key).")
@click.option("--quick", is_flag=True, help="Small shapes and a small search grid: a smoke run.")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--table", type=click.Path(dir_okay=False, path_type=Path),
              help="Tuned table to update (default: the package's fagen/tuned.json).")
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

    from rich.console import Console

    from fagen import tune as tuner
    from fagen import tuned
    from fagen.bench import BenchOptions

    console = Console(width=200, highlight=False) if not Console().is_terminal else Console(highlight=False)
    fixed = {k: flags[k] for k in ("block_m", "block_n", "num_warps", "num_stages") if flags.get(k) is not None}
    cases = _cases_from_options(suite, (), quick, spec_file, batch, heads, seq_q, seq_k, seed,
                                {k: v for k, v in flags.items() if k not in fixed})
    if cases is None:
        raise click.UsageError("give spec flags (--head-dim ...) or --suite standard")
    device = _pick_device(device)
    table = table or tuned.TUNED_PATH
    if device == "cpu" and not dry_run and table == tuned.TUNED_PATH:
        raise click.UsageError("tuning on the CPU times the interpreter: add --dry-run, or --table FILE to write "
                               "its results somewhere other than the shipped table")
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
        console.print(line, markup=False, highlight=False)
        console.file.flush()

    winners = []
    for case in tuner.unique_by_key(cases):
        spec, _ = case.spec()
        if not force and tuner.existing(table, arch, spec) is not None:
            log(f"{case.name}: {arch} already has an entry in {table} (--force to tune again)")
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
