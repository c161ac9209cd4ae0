"""Presenting verification results: one-line problems, actionable failures, and the rich tables."""

from __future__ import annotations

from fagen.verify.engine import PropertyResult, Report, mutant_catch
from fagen.verify.layouts import LAYOUT_PROPERTIES, LayoutVerdict
from fagen.verify.properties import BY_NAME
from fagen.verify.strategies import Problem
from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE


def describe(problem: Problem) -> str:
    """A one-line summary of a problem: shapes, lengths, tree, seed."""
    parts = [f"B={problem.batch} Hkv={problem.heads_kv} Sq={problem.seq_q} Sk={problem.seq_k}"]
    if problem.seqlens_q is not None:
        parts.append(f"seqlens_q={list(problem.seqlens_q)} seqlens_k={list(problem.seqlens_k)}")
    if problem.parents is not None:
        trees = [list(p) if len(p) <= 40 else f"[{len(p)} nodes]" for p in problem.parents]
        parts.append(f"parents={trees[0] if len(set(map(str, trees))) == 1 else trees}")
    if problem.magnitude != 1.0:
        parts.append(f"magnitude={problem.magnitude:g}")
    if problem.poison:
        parts.append("NaN padding")
    parts.append(f"seed={problem.seed}")
    return " ".join(parts)


def failure_lines(result: PropertyResult, device: str) -> list[str]:
    """A failure as lines a person can act on: what broke, on what, and the one command that replays it."""
    f = result.failure
    title = f"FAIL {result.spec.name} · {f.property}" + (f" · mutant {f.mutant}" if f.mutant else "")
    return [title,
            f"  property: {f.property}: {BY_NAME[f.property].what}",
            f"  message:  {f.message}",
            f"  spec:     {f.spec.to_json()}",
            f"  problem:  {f.problem.to_json()}",
            f"            ({describe(f.problem)}; found at example {result.examples}, "
            f"shrunk in {result.shrink_runs} runs)",
            f"  replay:   {f.command(device)}"]


def summary_table(report: Report):
    """A rich table: one row per variant and property, then the worst error per dtype."""
    from rich.table import Table

    table = Table(title=f"fagen verify: {report.device}, {report.scale} scale, seed {report.seed}, "
                        f"up to {report.examples} examples each", title_justify="left")
    for col, kw in (("variant", {}), ("property", {}), ("examples", dict(justify="right")),
                    ("result", {}), ("bound", {}), ("worst |Δout|", dict(justify="right")),
                    ("worst |Δlse|", dict(justify="right")), ("time", dict(justify="right"))):
        table.add_column(col, **kw)
    for r in report.results:
        verdict = "[green]pass[/]" if r.passed else "[bold red]FAIL[/]"
        if r.out_of_time and r.passed:
            verdict += " [yellow](time)[/]"
        table.add_row(r.spec.name, r.property, str(r.examples), verdict, BY_NAME[r.property].bound, f"{r.max_err:.2e}",
                      f"{r.max_lse_err:.2e}", f"{r.seconds:.1f}s")
    return table


def dtype_table(report: Report):
    from rich.table import Table

    table = Table(title="worst error against float64 per dtype (tol = its tolerance)", title_justify="left")
    for col in ("dtype", "worst |Δout|", "out atol / rtol", "worst |Δlse|", "lse atol / rtol"):
        table.add_column(col)
    for dtype, (err, lse_err) in report.worst_by_dtype().items():
        tol, lt = TOLERANCE[dtype], LSE_TOLERANCE
        table.add_row(str(dtype), f"{err:.2e}", f"{tol['atol']:g} / {tol['rtol']:g}", f"{lse_err:.2e}",
                      f"{lt['atol']:g} / {lt['rtol']:g}")
    return table


def mutant_table(report: Report, pairs):
    from rich.table import Table

    table = Table(title="mutants: each deliberately broken variant must be caught", title_justify="left")
    for col in ("mutant", "bug", "spec", "caught by", "shrunk problem"):
        table.add_column(col)
    for mutant, spec in pairs:
        hit = mutant_catch(report, mutant, spec)
        if spec is None:
            row = ("-", "[yellow]n/a[/] (no spec with a matching mask/gqa)", "")
        elif hit is None:
            row = (spec.name, "[bold red]SURVIVED[/]", "")
        else:
            row = (spec.name, f"[green]{hit.property}[/] at example {hit.examples}", describe(hit.failure.problem))
        table.add_row(mutant.name, mutant.what, *row)
    return table


def layout_table(verdicts: list[LayoutVerdict], report: Report):
    """A rich table of the varlen and paged specs' results (fagen/verify/layouts.py): one row per variant and
    property. Their failures are described in words by layout_failure_lines."""
    from rich.table import Table

    table = Table(title=f"varlen and paged specs: {report.device}, seed {report.seed}, each sequence against its "
                        "dense float64 reference", title_justify="left")
    for col, kw in (("variant", {}), ("property", {}), ("examples", dict(justify="right")), ("result", {}),
                    ("time", dict(justify="right"))):
        table.add_column(col, **kw)
    for v in verdicts:
        table.add_row(v.spec.name, v.property, str(v.examples), "[green]pass[/]" if v.passed else "[bold red]FAIL[/]",
                      f"{v.seconds:.1f}s")
    return table


def layout_failure_lines(verdict: LayoutVerdict) -> list[str]:
    """A layout failure as lines: what broke, on which spec, and the shrunk case (in the message)."""
    return [f"FAIL {verdict.spec.name} · {verdict.property}",
            f"  property: {verdict.property}: {LAYOUT_PROPERTIES[verdict.property]}",
            f"  message:  {verdict.failure}",
            f"  spec:     {verdict.spec.to_json()}",
            f"            (after {verdict.examples} examples)"]
