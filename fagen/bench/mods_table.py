"""The mods suite's lines and table (fagen/bench/mods.py)."""

from __future__ import annotations

TARGETS = {"fwd": 1.3, "bwd": 1.2, "builtin": 0.95, "cold_s": 3.0, "warm_s": 0.3, "host": 1.2}


def line(row: dict) -> str:
    """A row's progress line (and its result in the table of the other rows)."""
    if "error" in row:
        return f"{row['case']}: error {row['error']}"
    if row["kind"] == "mods":
        f = row["fagen"]
        text = f"{row['case']}: fagen fwd {f['fwd_TF/s']:.0f} TF/s, bwd {f['bwd_TF/s']:.0f} TF/s" + (
            f" (lowered to {row['lowered_to']})" if row.get("lowered_to") else "")
        if "flex" in row:
            text += (f"; flex fwd {row['flex']['fwd_TF/s']:.0f}, bwd {row['flex']['bwd_TF/s']:.0f}; "
                     f"fwd {row['fwd_x']:.2f}x (target {TARGETS['fwd']}), bwd {row['bwd_x']:.2f}x "
                     f"(target {TARGETS['bwd']}); max diff {row['max_diff_vs_flex']:.1e}")
        if "flex_error" in row:
            text += f"; flex failed ({row['flex_error'][:160]}); max diff vs float64 {row['max_diff_vs_float64']:.1e}"
        if "bias_grad_bitwise_repeatable" in row:
            text += f"; bias grad bitwise repeatable: {row['bias_grad_bitwise_repeatable']}"
        if "fagen_mask_ms" in row:
            text += f"; block mask {row['fagen_mask_ms']:.2f} ms" + (
                f" (flex {row['flex_mask_ms']:.2f} ms)" if row.get("flex_mask_ms") else "")
        return text
    if row["kind"] == "builtin-as-mod":
        return (f"{row['case']}: mod/switch time fwd {1 / row['fwd_ratio']:.3f}x, bwd {1 / row['bwd_ratio']:.3f}x "
                f"(target <= {1 / TARGETS['builtin']:.2f}x); max diff {row['max_diff']:.1e}; lowered to "
                f"{row['lowered_to'] or 'nothing'}")
    if row["kind"] == "cold":
        flex = (f"; flex {row['flex_cold_s']:.2f} s cold, {row['flex_warm_s']:.2f} s warm" if "flex_cold_s" in row
                else "")
        return (f"{row['case']}: a new mod's first call {row['cold_s']:.2f} s cold (target {TARGETS['cold_s']} s), "
                f"{row['warm_s']:.2f} s warm (target {TARGETS['warm_s']} s){flex}; from a process's start "
                f"{row['start_cold_s']:.2f} s cold, {row['start_warm_s']:.2f} s warm")
    text = (f"{row['case']}: {row['new_compiles']} new compiles (target 0); host {row['changed_us']:.0f} us against "
            f"{row['unchanged_us']:.0f} us unchanged ({row['host_ratio']:.2f}x, target {TARGETS['host']}x); lowered "
            f"to {row.get('lowered_to') or 'nothing'}")
    off = row.get("lowering_off")
    if off:
        text += (f"; lowering off: {off['new_compiles']} new compiles, host {off['changed_us']:.0f} us against "
                 f"{off['unchanged_us']:.0f} us ({off['host_ratio']:.2f}x)")
    return text


def table(records: list[dict]) -> str:
    """The suite's markdown table: fagen against Flex per mod, then the other rows against their targets."""
    def f(x, spec=".0f"):
        return "-" if x is None else format(x, spec)

    lines = ["| mod | fagen fwd TF/s | flex fwd | fwd x (>= 1.3) | fagen bwd TF/s | flex bwd | bwd x (>= 1.2) | "
             "block mask ms (fagen / flex) | lowered to |", "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r["kind"] != "mods":
            continue
        if "error" in r:
            lines.append(f"| {r['case']} | error: {r['error'][:80]} ||||||||")
            continue
        a, b = r["fagen"], r.get("flex", {})
        fx = "fails" if "flex_error" in r else None  # Flex's error: the row's line
        lines.append(f"| {r['case']} | {f(a['fwd_TF/s'])} | {fx or f(b.get('fwd_TF/s'))} | "
                     f"{f(r.get('fwd_x'), '.2f')} | "
                     f"{f(a['bwd_TF/s'])} | {fx or f(b.get('bwd_TF/s'))} | {f(r.get('bwd_x'), '.2f')} | "
                     f"{f(r.get('fagen_mask_ms'), '.2f')} / {f(r.get('flex_mask_ms'), '.2f')} | "
                     f"{r.get('lowered_to') or '-'} |")
    lines += rounds_note(records)
    lines += ["", "| row | result | target |", "|---|---|---|"]
    for r in records:
        if r["kind"] == "mods":
            continue
        result = f"error: {r['error'][:80]}" if "error" in r else line(r).split(": ", 1)[1]
        target = {"builtin-as-mod": "within 5%", "cold": "<= 3 s cold, <= 0.3 s warm",
                  "scalar": "0 compiles, host <= 1.2x"}[r["kind"]]
        lines.append(f"| {r['case']} | {result} | {target} |")
    return "\n".join(lines) + "\n"


def rounds_note(records: list[dict]) -> list[str]:
    """Below the mods table, for rows timed in interleaved rounds ([Note] Mods rounds in fagen/bench/mods.py): how
    many, and the widest spread of a cell's rounds (max / min - 1), naming it; and the ratios' spread over the
    rounds (each round's Flex ms over fagen's in that round)."""
    spread = [(side[f"{d}_ms_max"] / side[f"{d}_ms_min"] - 1, r["case"], f"{name} {d}") for r in records
              if r["kind"] == "mods" and r.get("rounds") for name in ("fagen", "flex") if name in r
              for side in [r[name]] for d in ("fwd", "bwd") if side.get(f"{d}_ms_min")]
    if not spread:
        return []
    widest, case, cell = max(spread)
    ratios = "; ".join(f"{r['case']} {d} {min(r[d + '_x_rounds']):.2f}-{max(r[d + '_x_rounds']):.2f}"
                       for r in records if r["kind"] == "mods" and r.get("rounds") for d in ("fwd", "bwd")
                       if r.get(d + "_x_rounds"))
    counts = "/".join(map(str, sorted({r["rounds"] for r in records if r.get("rounds")})))
    return ["", f"Timing: {counts} interleaved rounds (orders balanced), cells the median round; widest spread of a "
            f"cell's rounds {100 * widest:.1f}% ({case}, {cell})" + (f"; the x columns round by round: {ratios}"
                                                                     if ratios else "") + "."]
