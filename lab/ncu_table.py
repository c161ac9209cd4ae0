"""One table from `ncu --csv --page raw` files (lab/ncu_bwd.sh): per kernel, its time, registers, tensor-pipe use,
shared and local (spill) traffic and its top stall reasons (warps stalled per issued instruction). Lab tool."""
import csv
import io
import sys
from pathlib import Path


def rows(path):
    text = Path(path).read_text(errors="replace")
    start = text.find('"ID"')
    if start < 0:
        return []
    table = list(csv.DictReader(io.StringIO(text[start:])))
    return [r for r in table if r.get("ID", "").strip().isdigit()]  # the second line holds the units


def num(r, key):
    try:
        return float(str(r.get(key, "")).replace(",", ""))
    except ValueError:
        return float("nan")


def main(paths):
    print("| impl | kernel | us | regs | grid x block | SM % | tensor % (gmma/hmma) | smem ld/st (M inst) | "
          "local ld/st (M inst) | top stalls (warps per issue) |")
    print("|---|---|---:|---:|---|---:|---|---|---|---|")
    for path in paths:
        impl = Path(path).stem.removeprefix("ncu-")
        for r in rows(path):
            stalls = sorted(((num(r, k), k.split("stalled_")[1].split("_per_issue")[0]) for k in r
                             if "issue_stalled_" in k), reverse=True)[:4]
            name = r.get("Kernel Name", "?")[:48]
            print(f"| {impl} | `{name}` | {num(r, 'gpu__time_duration.sum') / 1e3:.0f} | "
                  f"{num(r, 'launch__registers_per_thread'):.0f} | {r.get('launch__grid_size', '?')} x "
                  f"{r.get('launch__block_size', '?')} | {num(r, 'sm__throughput.avg.pct_of_peak_sustained_elapsed'):.0f} | "
                  f"{num(r, 'sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active'):.0f} / "
                  f"{num(r, 'sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active'):.0f} | "
                  f"{num(r, 'smsp__sass_inst_executed_op_shared_ld.sum') / 1e6:.1f} / "
                  f"{num(r, 'smsp__sass_inst_executed_op_shared_st.sum') / 1e6:.1f} | "
                  f"{num(r, 'smsp__sass_inst_executed_op_local_ld.sum') / 1e6:.2f} / "
                  f"{num(r, 'smsp__sass_inst_executed_op_local_st.sum') / 1e6:.2f} | "
                  + ", ".join(f"{k} {v:.2f}" for v, k in stalls) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
