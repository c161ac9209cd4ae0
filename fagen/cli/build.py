"""`fagen compile` (one spec) and `fagen build` (a manifest): ahead-of-time builds with a progress bar and a summary."""

from __future__ import annotations

from pathlib import Path

import click

from fagen.cli.common import console, spec_from_options, spec_options

def _parse_arch(ctx, param, value):
    from fagen.spec.targets import ArchError, parse_archs

    try:
        return parse_archs(value)
    except ArchError as e:
        raise click.BadParameter(str(e)) from None


def _run_build(specs, archs, out_dir, jobs, keep_going, quiet, as_json, manifest_path=None, manifest=True,
               title="fagen build", skipped=()):
    """Build with a progress bar, then print the summary table (or JSON); exit 1 naming every failure.

    skipped: (variant, why) for each variant the manifest describes and this build leaves out; counted per
    reason on stderr (one line each) and in the JSON."""
    import json
    from collections import Counter

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from fagen.aot.build import build, build_pairs, summary_table

    err = console(stderr=True)
    reasons = Counter(why for _, why in skipped)
    if not quiet:
        for why, n in reasons.items():
            click.echo(f"left out {n} variant{'s' if n > 1 else ''}: {why}", err=True)
    columns = (SpinnerColumn(), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}"))
    with Progress(*columns, console=err, disable=quiet or as_json) as bar:
        task = bar.add_task("checking the cache", total=len(build_pairs(specs, archs)))

        def progress(spec, arch, result, failure):
            state = "[red]failed[/]" if failure else ("cached" if result.cached else "compiled")
            bar.update(task, advance=1, description=f"{state} {spec.name} [{arch}]")

        report = build(specs, archs, out_dir, jobs=jobs, keep_going=keep_going, progress=progress,
                       manifest_path=manifest_path, manifest=manifest)
    if as_json:
        click.echo(json.dumps({"variants": report.records, "failures": [vars(f) for f in report.failures],
                               "skipped": len(skipped), "skip_reasons": dict(reasons),
                               "not_started": report.not_started, "seconds": round(report.seconds, 3)}, indent=1))
    elif not quiet:
        out = console()
        out.print(summary_table(report.records, report.failures, title))
        spilling = [f"{r['name']} [{r['arch']}] ({'/'.join(str(k['spills']) for k in r['kernels'])} words)"
                    for r in report.records if any(k["spills"] for k in r["kernels"])]
        if spilling:
            click.echo(f"warning: {len(spilling)} variant build(s) spill registers to local memory, which is slow: "
                       + "; ".join(spilling) + ". Try fewer num_stages, a smaller block_m/block_n, or more "
                       "num_warps for those archs.", err=True)
        cached = sum(r["cached"] for r in report.records)
        where = out_dir / "manifest.json" if manifest else \
            ", ".join(str(out_dir / name) for name in dict.fromkeys(r["name"] for r in report.records))
        left_out = f", {len(skipped)} left out" if skipped else ""
        click.echo(f"{len(report.records)} built ({cached} cached, {len(report.records) - cached} compiled"
                   f"{left_out}) in {report.seconds:.1f} s -> {where}")
    if report.failures:
        lines = [f"{len(report.failures)} of {report.pairs} variant builds failed:"]
        lines += [f"  {f.name} [{f.arch}]: {f.message}" for f in report.failures]
        if report.not_started:
            lines.append(f"  ({report.not_started} not started; use --keep-going to build the rest)")
        click.echo("\n".join(lines), err=True)
        raise SystemExit(1)


@click.command("compile")
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
               manifest=False, title="fagen compile")


@click.command("build")
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
    from fagen.aot.artifacts import aot_missing
    from fagen.spec.manifest import ManifestError, load_manifest

    try:
        manifest = load_manifest(manifest_file)
    except ManifestError as e:
        raise click.ClickException(str(e)) from None
    if not manifest.specs:
        raise click.ClickException(f"{manifest_file}: describes no variants; add a [[kernel]] or [[sweep]]")
    skipped = [(fields, why) for fields, why in manifest.dropped]
    skipped += [(spec.name, why) for spec in manifest.specs if (why := aot_missing(spec))]
    specs = [spec for spec in manifest.specs if not aot_missing(spec)]
    if not specs:
        raise click.ClickException(f"{manifest_file}: none of its {len(manifest.specs)} variants has an "
                                   f"ahead-of-time build: {skipped[-1][1]}")
    _run_build(specs, manifest.archs, out_dir, jobs, keep_going, quiet, as_json, manifest_path=manifest_file,
               skipped=skipped)
    if verify_after:
        # A fresh process: the build imported the kernels for compiling, and Triton's mode (compiled or
        # interpreted) is fixed per process when a kernel is defined.
        import subprocess
        import sys

        args = [sys.executable, "-m", "fagen.cli", "verify", "--manifest", str(manifest_file)] + (["-q"] if quiet else [])
        code = subprocess.run(args).returncode
        if code:
            raise click.exceptions.Exit(code)
