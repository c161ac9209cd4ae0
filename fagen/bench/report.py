"""Bench results as a rich table, a markdown table and a plot, all from the JSON records."""

from __future__ import annotations

from pathlib import Path

from fagen.bench.cases import IMPLS, shorten
from fagen.bench.workloads import MODE_TARGETS, RELATIVE_TARGETS, TARGETS

UNIT = {"tflops": "TF/s", "gbs": "GB/s", "ms": "ms"}
NOTE_CHARS = 170  # one terminal line per note
SHORT = {"unsupported": "n/a", "unavailable": "n/a", "error": "ERR", "skipped": "skip"}


def value(rec: dict) -> float | None:
    """The number a record's case shows: TF/s, GB/s, or ms."""
    return rec.get(rec["metric"]) if rec.get("status") == "ok" else None


def better(a: float, b: float, metric: str) -> bool:
    return a < b if metric == "ms" else a > b


def _fmt(v: float, metric: str) -> str:
    if metric == "ms":
        return f"{v:.3f}" if v < 100 else f"{v:.0f}"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 1 else f"{v:.2g}"


def rows(records: list[dict], targets: bool = True) -> tuple[list[str], list[list[str]], list[str]]:
    """(header, rows, notes) shared by the terminal and the markdown tables.

    A cell is the case's number, "n/a" when the impl cannot run the case, "ERR", or "skip"; a trailing "!"
    means the output check failed. The last columns compare fagen with the best peer and (when `targets`)
    with the issue's target. Notes say why cells are not numbers; one note covers every case it applies to.
    """
    impls = [i for i in IMPLS if any(r["impl"] == i for r in records)]
    impls += sorted({r["impl"] for r in records} - set(impls))
    cases = list(dict.fromkeys(r["case"] for r in records))
    by = {(r["case"], r["impl"]): r for r in records}
    header = ["case", "unit", *impls, "fagen/best peer"] + (["target"] if targets else [])
    table, grouped = [], {}
    for case in cases:
        metric = by_metric(records, case)
        cells = [case, UNIT[metric]]
        for impl in impls:
            rec = by.get((case, impl))
            if rec is None:
                cells.append("")
                continue
            v = value(rec)
            cell = _fmt(v, metric) if v is not None else SHORT.get(rec["status"], rec["status"])
            if rec.get("check") == "fail":
                cell += "!"
            cells.append(cell)
            if rec.get("note") and (rec["status"] != "ok" or rec.get("check") == "fail" or impl == "fagen"):
                status = rec["status"] + (", check FAILED" if rec.get("check") == "fail" else "")
                grouped.setdefault((impl, status, rec["note"]), []).append(case)
        mine_rec = by.get((case, "fagen"))
        mine = value(mine_rec) if mine_rec and mine_rec.get("check") != "fail" else None
        peers = [v for i in impls if not i.startswith("fagen") and i != "copy"  # fagen-nondet is fagen; copy a
                 # reference ([Note] Copy reference in fagen/bench/impls.py)
                 and (case, i) in by and by[(case, i)].get("check") != "fail"
                 and (v := value(by[(case, i)])) is not None]
        best = (min(peers) if metric == "ms" else max(peers)) if peers else None
        ratio = ""
        if mine is not None and best is not None:
            ratio = f"{(best / mine if metric == 'ms' else mine / best):.2f}x"
        row = cells + [ratio]
        if targets:
            target, target_txt = TARGETS.get(case), ""
            if case in RELATIVE_TARGETS:
                target_txt = relative_target(case, mine, by)
            elif target is not None:
                bound = "<=" if metric == "ms" else ">="
                met = mine is not None and not better(target, mine, metric)
                target_txt = f"{bound} {_fmt(target, metric)} " + ("met" if met else "-" if mine is None else "MISSED")
            row.append(target_txt)
        table.append(row)
    notes = []
    for (impl, status, note), where in grouped.items():
        scope = "all cases" if len(where) == len(cases) > 1 else ", ".join(where)
        notes.append(f"{impl} {status} ({scope}): {note}")
    return header, table, notes + rounds_note(records)


def rounds_note(records: list[dict]) -> list[str]:
    """One note for records timed in interleaved rounds ([Note] Interleaved rounds in fagen/bench/rounds.py): how
    many, and the widest spread of a cell's rounds (max / min - 1), naming it."""
    spread = [(r["ms_max"] / r["ms_min"] - 1, r["case"], r["impl"]) for r in records
              if r.get("status") == "ok" and r.get("ms_min") and r.get("ms_max")]
    if not spread:
        return []
    counts = sorted({r["rounds"] for r in records if r.get("rounds")})
    widest, case, impl = max(spread)
    return [f"timing: {'/'.join(map(str, counts))} interleaved rounds (orders balanced), cells the median round; widest "
            f"spread of a cell's rounds {100 * widest:.1f}% ({case}, {impl})"]


def relative_target(case: str, mine: float | None, by: dict) -> str:
    """The row's relative targets ([Note] Score-switch rows in fagen/bench/workloads.py), as
    "1.52x flex (>= 1.3 met); 0.95x fwd-d128-causal-s32k (>= 0.9 met)"; "-" where a number is missing; then the
    targets of another mode's column (MODE_TARGETS) where the run has it: "fagen-nondet 1.02x sdpa-cudnn (>= 1 met)"."""
    def ok(rec):
        return value(rec) if rec is not None and rec.get("check") != "fail" else None

    def verdict(label, mine, theirs, ref, bound):  # "[label ]0.95x ref (>= 0.9 met)", "[label ]>= 0.9x ref -"
        if mine is None or theirs is None:
            return f"{label}>= {bound:g}x {ref} -"
        ratio = mine / theirs
        return f"{label}{ratio:.2f}x {ref} (>= {bound:g} {'met' if ratio >= bound else 'MISSED'})"

    parts = [verdict("", mine, ok(by.get((case, ref)) if ref in IMPLS else by.get((ref, "fagen"))), ref, bound)
             for ref, bound in RELATIVE_TARGETS[case]]
    parts += [verdict(f"{impl} ", ok(by[(case, impl)]), ok(by.get((case, ref))), ref, bound)
              for impl, ref, bound in MODE_TARGETS.get(case, ()) if (case, impl) in by]  # where the run has it
    return "; ".join(parts)


def shows_targets(meta: dict | None) -> bool:
    """Targets are H100 numbers: shown for full-size CUDA runs only."""
    meta = meta or {}
    return not meta.get("quick") and str(meta.get("device", "cuda")).startswith("cuda")


def print_table(records: list[dict], console, title: str = "fagen bench", meta: dict | None = None) -> None:
    from rich import box
    from rich.table import Table

    header, table, notes = rows(records, shows_targets(meta))
    t = Table(title=title, box=box.ASCII, show_lines=False, pad_edge=False)  # ASCII: the GPU log keeps 12 KB
    for i, h in enumerate(header):
        t.add_column(h, justify="left" if i < 2 else "right", no_wrap=True)
    for row in table:
        t.add_row(*row)
    console.print(t)
    for line in notes:
        console.print(shorten(f"  - {line}", NOTE_CHARS), markup=False, highlight=False, soft_wrap=True)


def markdown(records: list[dict], meta: dict | None = None) -> str:
    """The results as a markdown table with notes (what benchmarks/README.md shows)."""
    header, table, notes = rows(records, shows_targets(meta))
    out = []
    if meta:
        what = [meta.get("gpu") or meta.get("device") or "?"]
        what += [f"{k} {meta[k]}" for k in ("torch", "triton") if meta.get(k)]
        when = f", {meta['date']}" if meta.get("date") else ""
        out += [f"Measured on {what[0]}" + (f" ({', '.join(what[1:])})" if what[1:] else "") + f"{when}.", ""]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "|".join("---" if i < 2 else "---:" for i in range(len(header))) + "|")
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in table]
    out += ["", "Cells: TF/s (padding, tree and windows count only visible pairs), GB/s of K+V read (decode), or ms "
            "(lower is better); n/a = the implementation cannot compute the case; ERR = it failed; "
            "a trailing ! = its output disagreed with the float64 reference."]
    if notes:
        out += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(out).strip() + "\n"


def plot(records: list[dict], path: Path, title: str = "fagen vs peers") -> None:
    """Grouped bars per case, one panel per unit; fagen in a strong colour. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    header, _, _ = rows(records, targets=False)
    impls = header[2:-1]
    cases = list(dict.fromkeys(r["case"] for r in records))
    by = {(r["case"], r["impl"]): r for r in records}
    metrics = [m for m in UNIT if any(r["metric"] == m and r["case"] in cases for r in records)]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 + 1.6 * len(cases), 4.8), squeeze=False,
                             gridspec_kw={"width_ratios": [sum(1 for c in cases if by_metric(records, c) == m)
                                                           for m in metrics]})
    colours = {"fagen": "#d62728", "sdpa-flash": "#9ecae1", "sdpa-cudnn": "#3182bd", "sdpa-efficient": "#c6dbef",
               "cudnn-fp8": "#08519c", "flex": "#74c476"}
    width = 0.8 / max(1, len(impls))
    for ax, metric in zip(axes[0], metrics):
        mine = [c for c in cases if by_metric(records, c) == metric]
        for j, impl in enumerate(impls):
            xs = [i + (j - (len(impls) - 1) / 2) * width for i in range(len(mine))]
            ys = [value(by[(c, impl)]) or 0.0 if (c, impl) in by else 0.0 for c in mine]
            ax.bar(xs, ys, width, label=impl, color=colours.get(impl))
        ax.set_xticks(range(len(mine)))
        ax.set_xticklabels(mine, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(UNIT[metric] + (" (lower is better)" if metric == "ms" else ""))
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def by_metric(records: list[dict], case: str) -> str:
    return next(r["metric"] for r in records if r["case"] == case)


BEGIN, END = "<!-- fagen bench --report: begin -->", "<!-- fagen bench --report: end -->"


def splice(document: str, table: str) -> str:
    """`document` with the text between the BEGIN and END markers replaced by `table`."""
    if document.count(BEGIN) != 1 or document.count(END) != 1 or document.index(BEGIN) > document.index(END):
        raise ValueError(f"needs exactly one {BEGIN} line followed by one {END} line")
    head, rest = document.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{table.rstrip()}\n{END}{tail}"
