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
def build_(manifest_file, out_dir, jobs, keep_going, quiet, as_json):
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
