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
        raise click.ClickException(f"{spec_file}: {e}" if spec_file else str(e)) from None


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


# -- compile and build (issue 4) ------------------------------------------------------------------------------
def _parse_arch(ctx, param, value):
    from fagen.compile import ArchError, parse_archs

    try:
        return parse_archs(value)
    except ArchError as e:
        raise click.BadParameter(str(e)) from None


def _run_build(specs, archs, out_dir, jobs, keep_going, quiet, as_json, manifest_path=None, manifest=True):
    """Build with a progress bar, then print the summary table (or JSON); exit 1 naming every failure."""
    import json

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from fagen.build import build, summary_table

    err = Console(stderr=True)
    columns = (SpinnerColumn(), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}"))
    with Progress(*columns, console=err, disable=quiet or as_json) as bar:
        task = bar.add_task("checking the cache", total=len(specs) * len(archs))

        def progress(spec, arch, result, failure):
            state = "[red]failed[/]" if failure else ("cached" if result.cached else "compiled")
            bar.update(task, advance=1, description=f"{state} {spec.name} [{arch}]")

        report = build(specs, archs, out_dir, jobs=jobs, keep_going=keep_going, progress=progress,
                       manifest_path=manifest_path, manifest=manifest)
    if as_json:
        click.echo(json.dumps({"variants": report.records, "failures": [vars(f) for f in report.failures],
                               "skipped": report.skipped, "seconds": round(report.seconds, 3)}, indent=1))
    elif not quiet:
        out = Console()
        if not out.is_terminal:
            out = Console(width=160)  # piped or captured: print whole variant names, do not squeeze to 80
        out.print(summary_table(report.records, report.failures))
        cached = sum(r["cached"] for r in report.records)
        where = out_dir / "manifest.json" if manifest else out_dir / specs[0].name
        click.echo(f"{len(report.records)} built ({cached} cached, {len(report.records) - cached} compiled) "
                   f"in {report.seconds:.1f} s -> {where}")
    if report.failures:
        lines = [f"{len(report.failures)} of {len(specs) * len(archs)} variant builds failed:"]
        lines += [f"  {f.name} [{f.arch}]: {f.message}" for f in report.failures]
        if report.skipped:
            lines.append(f"  ({report.skipped} not started; use --keep-going to build the rest)")
        click.echo("\n".join(lines), err=True)
        raise SystemExit(1)


@main.command("compile")
@spec_options
@click.option("--arch", "archs", default="sm_80,sm_90", show_default=True, callback=_parse_arch,
              help="Comma-separated GPU archs: sm_80, sm_90.")
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("build"),
              show_default=True, help="Directory for <variant>/ with source, ptx, cubin and variant.json.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def compile_(spec_file, archs, out_dir, as_json, **flags):
    """Compile one spec ahead of time for each arch (no GPU needed): PTX, cubin, registers, spills, shared memory.

    \b
    Examples:
      fagen compile --head-dim 128 --mask causal --dtype bf16 --arch sm_80,sm_90 -o build/
      fagen compile --spec my_kernel.toml --arch sm_90
    """
    spec = spec_from_options(spec_file, **flags)
    if spec is None:
        raise click.UsageError("give a spec: --head-dim N [--mask ...] or --spec FILE")
    _run_build([spec], archs, out_dir, jobs=len(archs), keep_going=True, quiet=False, as_json=as_json,
               manifest=False)


@main.command("build")
@click.argument("manifest_file", metavar="MANIFEST.toml", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("build"),
              show_default=True, help="Output directory: <variant>/ folders and manifest.json.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None, help="Worker processes [default: CPU count].")
@click.option("--keep-going", is_flag=True, help="Build every other variant after a failure, then exit 1.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or table; only errors.")
@click.option("--json", "as_json", is_flag=True, help="Print the build record as JSON instead of a table.")
@click.option("--verify", "verify_after", is_flag=True,
              help="Then verify every variant with the property suite (as fagen verify --manifest MANIFEST).")
def build_(manifest_file, out_dir, jobs, keep_going, quiet, as_json, verify_after):
    """Compile every variant x arch a manifest describes, in parallel, through the content-addressed cache.

    \b
    Examples:
      fagen build kernels.toml -o build/ -j 8
      fagen build kernels.toml -o build/ --keep-going --json > build.json
    """
    from fagen.manifest import ManifestError, load_manifest

    try:
        manifest = load_manifest(manifest_file)
    except ManifestError as e:
        raise click.ClickException(str(e)) from None
    if not manifest.specs:
        raise click.ClickException(f"{manifest_file}: describes no variants; add a [[kernel]] or [[sweep]]")
    _run_build(list(manifest.specs), manifest.archs, out_dir, jobs, keep_going, quiet, as_json,
               manifest_path=manifest_file)
    if verify_after:
        # A fresh process: the build imported the kernels for compiling, and Triton's mode (compiled or
        # interpreted) is fixed per process when a kernel is defined.
        import subprocess
        import sys

        args = [sys.executable, "-m", "fagen.cli", "verify", "--manifest", str(manifest_file)] + (["-q"] if quiet else [])
        code = subprocess.run(args).returncode
        if code:
            raise click.exceptions.Exit(code)
# -- fagen verify ----------------------------------------------------------------------------------------

def _specs_of_build_dir(path: Path) -> list[KernelSpec]:
    """The variants a `fagen build -o DIR` wrote into DIR/manifest.json."""
    import json

    record = path / "manifest.json"
    if not record.is_file():
        raise click.ClickException(f"{path}: a folder must be a build directory holding manifest.json "
                                   "(from `fagen build MANIFEST -o DIR`)")
    try:
        variants = json.loads(record.read_text())["variants"]
        return [KernelSpec.from_dict(v["spec"]) for v in variants]
    except (ValueError, KeyError, TypeError) as e:
        raise click.ClickException(f"{record}: not a fagen build record ({e})") from None


def _verify_specs_from(spec_file, spec_files, manifest, flags) -> list[KernelSpec]:
    from fagen.manifest import ManifestError, load_manifest

    found = []
    spec = spec_from_options(spec_file, **flags)
    if spec is not None:
        found.append(spec)
    for path in spec_files:
        try:
            found += _specs_of_build_dir(path) if path.is_dir() else [KernelSpec.from_file(path)]
        except SpecError as e:
            raise click.ClickException(f"{path}: {e}") from None
    if manifest is not None:
        try:
            found += load_manifest(manifest).specs
        except ManifestError as e:
            raise click.ClickException(str(e)) from None
    return list(dict.fromkeys(found))  # in order, without repeats


@main.command("verify")
@spec_options
@click.argument("spec_files", nargs=-1, type=click.Path(exists=True, path_type=Path))
@click.option("--manifest", type=click.Path(dir_okay=False, path_type=Path),
              help="Verify every variant of a TOML manifest (e.g. fagen/catalog.toml).")
@click.option("--examples", type=click.IntRange(min=1),
              help="Examples per variant and property [default: 20 at --scale cpu, 50 at gpu].")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the example search; vary to explore.")
@click.option("--time-budget", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
              help="Stop exploring after this long in all (shared evenly; a failure is still shrunk).")
@click.option("--scale", type=click.Choice(["cpu", "gpu"]),
              help="Shape scale: small for the interpreter, realistic (up to 4096) for a GPU [default: by device].")
@click.option("--device", type=click.Choice(["cpu", "cuda"]),
              help="cpu runs kernels through Triton's interpreter [default: cuda when available].")
@click.option("--property", "properties", multiple=True, metavar="NAME",
              help="Only this property (repeatable): reference, gqa, tree-chain, tree-star, padding-split, "
                   "padding-garbage, permutation, lse-merge, bwd-deterministic, bwd-masked-rows, bwd-reference.")
@click.option("--shrink-runs", type=click.IntRange(min=0), default=150, show_default=True,
              help="Kernel runs allowed for shrinking each failure to a minimal example.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write a JSON report.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or tables: only failures and the verdict.")
@click.option("--mutants", is_flag=True,
              help="Prove the suite has teeth: every deliberately broken variant must be caught.")
@click.option("--reproduce", "blob", metavar="BLOB", help="Replay one failing example printed by an earlier run.")
@click.pass_context
def verify_command(ctx, spec_file, spec_files, manifest, examples, seed, time_budget, scale, device, properties,
                   shrink_runs, json_path, quiet, mutants, blob, **flags):
    """Property-based verification of generated kernels against a float64 reference.

    \b
    Examples:
      fagen verify --head-dim 64 --mask tree --gqa 4 --dtype fp16
      fagen verify --manifest fagen/catalog.toml --device cuda --scale gpu
      fagen verify build/                         # every variant a `fagen build -o build/` wrote
      fagen verify --mutants                      # every broken variant must be caught
      fagen verify --reproduce <BLOB>             # replay a printed counterexample
    """
    specs = _verify_specs_from(spec_file, spec_files, manifest, flags)
    if blob is not None and (specs or mutants):
        raise click.UsageError("--reproduce replays one recorded example: give it no spec, manifest or --mutants")
    if blob is None and not specs and not mutants:
        raise click.UsageError("name the kernels to verify: spec flags (--head-dim 64 --mask causal ...), "
                               "spec files, or --manifest FILE (or use --mutants, or --reproduce BLOB)")
    from rich.console import Console

    from fagen import verifier

    try:
        device = verifier.prepare_device(device)
    except verifier.DeviceError as e:
        raise click.ClickException(str(e)) from None
    scale = scale or ("gpu" if device == "cuda" else "cpu")

    unknown = [p for p in properties if p not in verifier.BY_NAME]
    if unknown:
        raise click.BadParameter(f"got {unknown[0]!r}; known: {', '.join(verifier.BY_NAME)}", param_hint="--property")
    console = Console()
    if not console.is_terminal:  # a log or a pipe: wide enough for variant names, never wrapped mid-row
        console = Console(width=200)
    if blob is not None:
        try:
            example = verifier.Counterexample.from_blob(blob)
        except verifier.BlobError as e:
            raise click.BadParameter(str(e), param_hint="--reproduce") from None
        click.echo(f"spec:     {example.spec.to_json()}\nproblem:  {example.problem.to_json()}\n"
                   f"          ({verifier.describe(example.problem)})\n"
                   f"property: {example.property}: {verifier.BY_NAME[example.property].what}")
        if example.mutant:
            click.echo(f"mutant:   {example.mutant}")
        message = verifier.replay(example, device)
        click.echo(f"FAIL (reproduced): {message}" if message else "pass: this example no longer fails")
        ctx.exit(1 if message else 0)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    options = dict(examples=examples, seed=seed, scale=scale, device=device, time_budget=time_budget,
                   properties=properties or None, shrink_runs=shrink_runs)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), disable=quiet, transient=True) as bar:
        task = bar.add_task("verifying", total=None)
        tick = lambda label, done, total: bar.update(task, description=label, completed=done, total=total)  # noqa: E731
        if mutants:
            report, pairs = verifier.verify_mutants(specs or verifier.default_mutant_specs(scale),
                                                    progress=tick, **options)
        else:
            report = verifier.verify_specs(specs, progress=tick, **options)
    if mutants:
        survived = [m.name for m, s in pairs if s is not None and verifier.mutant_catch(report, m, s) is None]
        if not quiet:
            console.print(verifier.mutant_table(report, pairs))
        for r in report.results:
            if r.failure:
                click.echo("\n".join(verifier.failure_lines(r, device)))
        verdict = (f"{len(survived)} mutant(s) SURVIVED: {', '.join(survived)}" if survived else
                   f"all {sum(s is not None for _, s in pairs)} applicable mutants caught")
        failed = bool(survived)
    else:
        if not quiet and report.results:
            console.print(verifier.summary_table(report))
            console.print(verifier.dtype_table(report))
        for message in report.errors:
            click.echo(f"ERROR {message}")
        for r in report.results:
            if r.failure:
                click.echo("\n".join(verifier.failure_lines(r, device)))
        bad = sum(not r.passed for r in report.results) + len(report.errors)
        verdict = (f"{bad} of {len(report.results) + len(report.errors)} checks FAILED" if bad else
                   f"all {len(report.results)} checks passed")
        failed = bad > 0
    if json_path is not None:
        import json

        from fagen.cache import write_if_different

        data = report.to_dict()
        if mutants:
            data["mutants"] = [{"mutant": m.name, "bug": m.what, "spec": s.name if s else None,
                                "caught_by": (hit.property if (hit := verifier.mutant_catch(report, m, s)) else None)}
                               for m, s in pairs]
            data["passed"] = not failed
        write_if_different(json_path, json.dumps(data, indent=2) + "\n")
    click.echo(f"{verdict} in {report.seconds:.1f}s" + (f"; report in {json_path}" if json_path else ""))
    ctx.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
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
