"""`fagen verify`: property-based verification of generated kernels, mutants and replays."""

from __future__ import annotations

from pathlib import Path

import click

from fagen.cli.common import console, pick_device, spec_from_options, spec_options
from fagen.spec.axes import Backend, Layout
from fagen.spec.kernel import KernelSpec, SpecError

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
    from fagen.spec.manifest import ManifestError, load_manifest

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


def _chosen_mutants(names):
    """The dense mutants `--mutant NAME` picks (all of them without the option), or a usage error naming the known."""
    from fagen.verify.mutants import MUTANTS

    known = {m.name: m for m in MUTANTS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise click.BadParameter(f"got {unknown[0]!r}; known: {', '.join(known)}", param_hint="--mutant")
    return [known[n] for n in dict.fromkeys(names)] if names else MUTANTS


@click.command("verify")
@spec_options
@click.argument("spec_files", nargs=-1, type=click.Path(exists=True, path_type=Path))
@click.option("--manifest", type=click.Path(dir_okay=False, path_type=Path),
              help="Verify every variant of a TOML manifest (e.g. fagen/spec/catalog.toml).")
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
                   "padding-garbage, nan-propagates, permutation, lse-merge, bwd-deterministic, bwd-masked-rows, "
                   "bwd-reference; for varlen and paged specs layout-reference, layout-bwd-reference.")
@click.option("--shrink-runs", type=click.IntRange(min=0), default=150, show_default=True,
              help="Kernel runs allowed for shrinking each failure to a minimal example.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write a JSON report.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or tables: only failures and the verdict.")
@click.option("--mutants", is_flag=True,
              help="Prove the suite has teeth: every deliberately broken variant must be caught.")
@click.option("--mutant", "mutant_names", multiple=True, metavar="NAME",
              help="Only this broken variant (repeatable; implies --mutants). `fagen verify --mutants` lists them.")
@click.option("--reproduce", "blob", metavar="BLOB", help="Replay one failing example printed by an earlier run.")
@click.pass_context
def verify_command(ctx, spec_file, spec_files, manifest, examples, seed, time_budget, scale, device, properties,
                   shrink_runs, json_path, quiet, mutants, mutant_names, blob, **flags):
    """Property-based verification of generated kernels against a float64 reference.

    \b
    Examples:
      fagen verify --head-dim 64 --mask tree --gqa 4 --dtype fp16
      fagen verify --manifest fagen/spec/catalog.toml --device cuda --scale gpu
      fagen verify build/                         # every variant a `fagen build -o build/` wrote
      fagen verify --mutants                      # every broken variant must be caught
      fagen verify --mutant causal-off-by-one     # one of them
      fagen verify --reproduce <BLOB>             # replay a printed counterexample
    """
    specs = _verify_specs_from(spec_file, spec_files, manifest, flags)
    mutants = mutants or bool(mutant_names)
    chosen = _chosen_mutants(mutant_names) if mutants else []
    if blob is not None and (specs or mutants):
        raise click.UsageError("--reproduce replays one recorded example: give it no spec, manifest or --mutants")
    if blob is None and not specs and not mutants:
        raise click.UsageError("name the kernels to verify: spec flags (--head-dim 64 --mask causal ...), "
                               "spec files, or --manifest FILE (or use --mutants, or --reproduce BLOB)")
    from fagen.verify import engine, report as reports
    from fagen.verify.counterexamples import BlobError, Counterexample
    from fagen.verify.properties import BY_NAME

    device = pick_device(device)
    scale = scale or ("gpu" if device == "cuda" else "cpu")
    if any(str(s.dtype) == "fp8_e4m3" for s in specs):
        raise click.UsageError("dtype 'fp8_e4m3': fagen verify draws fp16/bf16/fp32 inputs and has no fp8 properties "
                               "yet; check the fp8 forward with `python scripts/gpu_fp8.py` on an H100/H200 (README "
                               "\"fp8 forward\")")
    if device == "cpu" and any(s.backend is Backend.GLUON for s in specs):
        raise click.UsageError("backend 'gluon' kernels run on an sm_90 GPU only (Gluon has no interpreter): verify "
                               "them with --device cuda on an H100/H200; `python -m pytest tests/test_hopper_compile.py` "
                               "compiles them for sm_90 without a GPU")

    from fagen.verify.layouts import LAYOUT_PROPERTIES

    unknown = [p for p in properties if p not in BY_NAME and p not in LAYOUT_PROPERTIES]
    if unknown:
        raise click.BadParameter(f"got {unknown[0]!r}; known: {', '.join([*BY_NAME, *LAYOUT_PROPERTIES])}",
                                 param_hint="--property")
    out = console()
    if blob is not None:
        try:
            example = Counterexample.from_blob(blob)
        except BlobError as e:
            raise click.BadParameter(str(e), param_hint="--reproduce") from None
        click.echo(f"spec:     {example.spec.to_json()}\nproblem:  {example.problem.to_json()}\n"
                   f"          ({reports.describe(example.problem)})\n"
                   f"property: {example.property}: {BY_NAME[example.property].what}")
        if example.mutant:
            click.echo(f"mutant:   {example.mutant}")
        message = engine.replay(example, device)
        click.echo(f"FAIL (reproduced): {message}" if message else "pass: this example no longer fails")
        ctx.exit(1 if message else 0)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    # Varlen and paged specs are searched by fagen.verify.layouts (the gathered dense reference), the rest by the engine.
    layout_specs = [s for s in specs if s.layout is not Layout.DENSE]
    specs = [s for s in specs if s.layout is Layout.DENSE]
    if mutants and layout_specs:
        raise click.UsageError("--mutants runs on dense specs; the layouts' mutants are caught by "
                               "`python -m pytest tests/test_layouts.py -k mutant`")
    # --property names either kind: dense specs run the registry's, varlen and paged specs the layouts'.
    dense_properties = [p for p in properties if p in BY_NAME] if properties else None
    layout_properties = [p for p in properties if p in LAYOUT_PROPERTIES] if properties else None
    if mutants and properties and not dense_properties:
        raise click.UsageError("--mutants runs dense properties; the layouts' mutants are caught by "
                               "`python -m pytest tests/test_layouts.py -k mutant`")
    options = dict(examples=examples, seed=seed, scale=scale, device=device, time_budget=time_budget,
                   properties=dense_properties, shrink_runs=shrink_runs)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console(stderr=True), disable=quiet, transient=True) as bar:
        task = bar.add_task("verifying", total=None)
        tick = lambda label, done, total: bar.update(task, description=label, completed=done, total=total)  # noqa: E731
        layout_verdicts = []
        for i, spec in enumerate(layout_specs):
            from fagen.verify.layouts import verify_layout_spec

            tick(f"{spec.name} (layout reference)", i, len(layout_specs))
            layout_verdicts += verify_layout_spec(spec, examples=examples or engine.DEFAULT_EXAMPLES[scale],
                                                  seed=seed, device=device, scale=scale, properties=layout_properties)
        if mutants:
            report, pairs = engine.verify_mutants(specs or engine.default_mutant_specs(scale),
                                                    mutants=chosen, progress=tick, **options)
        else:
            report = engine.verify_specs(specs, progress=tick, **options)
    if mutants:
        survived = [m.name for m, s in pairs if s is not None and engine.mutant_catch(report, m, s) is None]
        if not quiet:
            out.print(reports.mutant_table(report, pairs))
        for r in report.results:
            if r.failure:
                click.echo("\n".join(reports.failure_lines(r, device)))
        verdict = (f"{len(survived)} mutant(s) SURVIVED: {', '.join(survived)}" if survived else
                   f"all {sum(s is not None for _, s in pairs)} applicable mutants caught")
        failed = bool(survived)
    else:
        if not quiet and report.results:
            out.print(reports.summary_table(report))
            out.print(reports.dtype_table(report))
        if not quiet and layout_verdicts:
            out.print(reports.layout_table(layout_verdicts, report))
        for message in report.errors:
            click.echo(f"ERROR {message}")
        for r in report.results:
            if r.failure:
                click.echo("\n".join(reports.failure_lines(r, device)))
        for v in layout_verdicts:
            if v.failure:
                click.echo("\n".join(reports.layout_failure_lines(v)))
        bad = sum(not r.passed for r in report.results) + len(report.errors) + sum(not v.passed for v in layout_verdicts)
        total = len(report.results) + len(report.errors) + len(layout_verdicts)
        if total == 0 and properties:
            raise click.UsageError(f"--property {', '.join(properties)}: applies to none of the given specs "
                                   "(layout-* properties apply to varlen and paged specs, the others to dense ones)")
        verdict = f"{bad} of {total} checks FAILED" if bad else f"all {total} checks passed"
        failed = bad > 0
    if json_path is not None:
        import json

        from fagen.files import write_if_different

        data = report.to_dict()
        data["layouts"] = [v.to_dict() for v in layout_verdicts]
        if mutants:
            data["mutants"] = [{"mutant": m.name, "bug": m.what, "spec": s.name if s else None,
                                "caught_by": (hit.property if (hit := engine.mutant_catch(report, m, s)) else None)}
                               for m, s in pairs]
            data["passed"] = not failed
        write_if_different(json_path, json.dumps(data, indent=2) + "\n")
    seconds = report.seconds + (0.0 if mutants else sum(v.seconds for v in layout_verdicts))
    click.echo(f"{verdict} in {seconds:.1f}s" + (f"; report in {json_path}" if json_path else ""))
    ctx.exit(1 if failed else 0)
