"""Tiles of the modded kernels on one GPU: each row of `fagen bench --suite mods` (attention-gym's mods,
fagen/bench/mods.py) through fagen's modded kernels at the bench shape (bf16, d128, B1 H16 S8192), forward and
backward, over a few candidate tiles. FlexAttention is not timed here (`fagen bench --suite mods` does that).

    PYTHONPATH=$PWD python3 scripts/gpu_mods_tiles.py [--rows a,b] [--configs m128n64w8s2,...] [--rep-ms 40]

Phases:
  1. compile: worker processes (one per core, at most one per (row, config)) run each candidate once at the bench
     shape, which fills the Triton and fagen caches with exactly the kernels the timing phase launches;
  2. check: at the first config, each row's out, lse-free grads (dq, dk, dv of head 0 for 256 query rows spread over
     the sequence) against an fp32 torch reference of the same user functions; every other config's out and
     grads against the first config's (same inputs);
  3. time: one process, one candidate at a time: median ms of the forward (no grad) and of the backward
     (autograd.grad of out for q, k, v), CUDA events, L2 flushed (fagen.bench.timing.measure).

Table columns:
  mod     the bench row (fagen/bench/mods.py cases())
  dir     fwd, or bwd (the backward alone: preprocess + dK/dV + dQ kernels)
  config  mXnYwWsS: the spec's block_m, block_n, num_warps, num_stages. The forward runs BLOCK_M x BLOCK_N tiles;
          the backward's dK/dV program owns block_n keys and steps min(block_m, 64) queries, its dQ program owns
          block_m queries and steps min(block_n, 64) keys ([Note] Backward tiles)
  ms      median milliseconds per call
  TF/s    useful TF/s: 4 * D per visible (q, kv) pair forward, 2.5x that backward, pairs counted from the
          block mask as the bench counts them (same numbers as `fagen bench --suite mods`)
  regs/spill  registers and spilled 32-bit words per thread of the direction's kernels (fwd: _attn_fwd;
          bwd: the dK/dV kernel, then the dQ kernel), from the compiled cubins
  check   the check of phase 2 (max |diff| / max |ref|), "ok" under 2e-2 and 3e-2 (grads)
  best    `*` on the fastest config of the row and direction; `=` within 3% of it
Then a summary per mod class (the key of MODDED_TILES in fagen/runtime/modded.py: a mask_mod or a score_mod alone,
reading captured tensors or not): each config's geometric mean of (fwd + bwd ms) over the class's rows relative to
the current default, and the winner, to copy into MODDED_TILES. $OUT/mods_tiles.json (if $OUT is set) holds every
record.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Candidates (ptxas sm_90 on this branch, spilled words fwd / dK/dV / dQ over the 8 rows, 2026-11-26):
#   m128n128w8s3  the plain d128 tile (the default without loads): fwd 0-34, dK/dV 8-72; loads rows do not fit
#   m128n128w8s2  fwd 0-86, dK/dV 4-256 (the loads rows spill most)
#   m128n64w8s2   the default with loads: fwd 0-10, dK/dV 0-34, dQ 0-4
#   m128n64w8s3   Flex's H100 forward tile: fwd 0-8, dK/dV 0-84, dQ 0-24
#   m64n128w8s2   fwd 0-2, dK/dV 4-256, dQ 0
#   m128n32w8s3   no spill in any kernel of any row
#   m128n64w8s4, m128n32w8s4  deeper pipelines of the two above (the loads rows may not fit)
# m128n64w4s2 and m64n64w4s3 spilled 100-430 words in dQ or dK/dV and are left out.
CONFIGS = ["m128n128w8s3", "m128n128w8s2", "m128n64w8s2", "m128n64w8s3", "m64n128w8s2", "m128n32w8s3",
           "m128n64w8s4", "m128n32w8s4"]
SKIP_ROWS = ("learned-bias+grad",)
DEVICE = "cuda"  # a CPU smoke run of the check (tests, never timed) sets "cpu" and a small SHAPE
SHAPE = None  # None: the bench's ModsShape()  # its gradient workspaces (12.9 GB and a sort) would dominate the budget


def parse_config(text: str) -> dict:
    import re

    m = re.fullmatch(r"m(\d+)n(\d+)w(\d+)s(\d+)", text)
    if not m:
        raise SystemExit(f"--configs: {text!r} is not mXnYwWsS")
    return dict(zip(("block_m", "block_n", "num_warps", "num_stages"), map(int, m.groups())))


def setup(rows):
    """(shape, {row: (score_mod, mask_mod, mods, base spec)}) on cuda."""
    import torch

    from fagen.bench.mods import ModsShape, cases
    from fagen.runtime.mods import prepare
    from fagen.runtime.resolve import spec_for

    shape = SHAPE or ModsShape()
    q = torch.empty(1, shape.heads, 16, shape.head_dim, dtype=shape.dtype, device=DEVICE)
    base = spec_for(q, q, q)
    out = {}
    for name, sm, mm, _ in cases(shape, DEVICE):
        if name in rows:
            out[name] = (sm, mm, prepare(score_mod=sm, mask_mod=mm), base)
    return shape, out


def module_of(base, mods, config: str):
    from fagen.runtime.loader import load
    from fagen.runtime.modded import modded_spec

    return load(modded_spec(base, mods.fields, parse_config(config)))


def runner(module, mods, bm, q, k, v):
    kw = dict(mods=mods.values, **({"block_mask": bm} if mods.fields[1] is not None else {}))
    return (lambda: module.forward(q, k, v, **kw)[0]), (lambda: module.attention(q, k, v, **kw))


def inputs(shape, grad=True):
    from fagen.bench.mods import _inputs

    return _inputs(shape, DEVICE, grad)


def block_mask(shape, mm):
    import fagen

    return None if mm is None else fagen.create_block_mask(mm, None, None, shape.seq, shape.seq, device=DEVICE)


def warm(items):
    """Phase 1 (a worker): run each (row, config) once, forward and backward; errors come back as text."""
    import torch

    rows = sorted({r for r, _ in items})
    shape, setups = setup(rows)
    q, k, v, do = inputs(shape)
    masks = {r: block_mask(shape, setups[r][1]) for r in rows}
    done = []
    for row, config in items:
        sm, mm, mods, base = setups[row]
        t0 = time.perf_counter()
        try:
            fwd, att = runner(module_of(base, mods, config), mods, masks[row], q, k, v)
            with torch.no_grad():
                fwd()
            torch.autograd.grad(att(), (q, k, v), do)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            done.append((row, config, None, time.perf_counter() - t0))
        except Exception as e:  # noqa: BLE001 - recorded in the table
            done.append((row, config, _error(e), time.perf_counter() - t0))
    return done


def reference(shape, sm, mm, q, k, v, do, rows):
    """fp32 out and (dq rows, dk, dv) of head 0 for query rows `rows`, all keys, from the user's functions
    evaluated on broadcast index tensors (element-wise mods: the same values as the vmapped float64 reference)."""
    import torch

    q0, k0, v0 = (t[0, 0].float().detach().requires_grad_() for t in (q, k, v))
    qi = rows[:, None]
    ki = torch.arange(shape.seq, device=DEVICE)[None, :]
    b = torch.zeros((), dtype=torch.int64, device=DEVICE)
    h = torch.zeros((), dtype=torch.int64, device=DEVICE)
    s = (q0[rows] @ k0.T) / math.sqrt(shape.head_dim)
    if sm is not None:
        s = sm(s, b, h, qi, ki)
    if mm is not None:
        s = torch.where(mm(b, h, qi, ki).expand_as(s), s, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    out = p @ v0
    dq, dk, dv = torch.autograd.grad(out, (q0, k0, v0), do[0, 0, rows].float())
    return out.detach(), dq[rows], dk, dv


def check_values(fwd, att, q, k, v, do_check, rows):
    """(out, dq, dk, dv) of head 0 at `rows` (out, dq) and all keys (dk, dv), with dO zero outside those rows."""
    import torch

    with torch.no_grad():
        out = fwd()
    grads = torch.autograd.grad(att(), (q, k, v), do_check)
    return out[0, 0, rows], grads[0][0, 0, rows], grads[1][0, 0], grads[2][0, 0]


def check_inputs(shape, do):
    """The check's query rows (256 spread over the sequence) and its dO: zero outside those rows of head 0."""
    import torch

    rows = torch.linspace(0, shape.seq - 1, min(256, shape.seq), device=DEVICE).long().unique()
    do_check = torch.zeros_like(do)
    do_check[0, 0, rows] = do[0, 0, rows]
    return rows, do_check


def rel_err(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))


def kernel_resources(module) -> dict:
    """{kernel name: (registers, spilled words)} of the module's compiled kernels (the largest variant each)."""
    import triton

    res = {}
    for name in ("_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq"):
        fn = getattr(module, name, None)
        if not isinstance(fn, triton.runtime.jit.JITFunction):
            continue
        for cache in (getattr(fn, "device_caches", None) or {}).values():
            kernels = cache[0] if isinstance(cache, tuple) else cache
            for kern in kernels.values():
                try:
                    kern._init_handles()
                    regs, spills = kern.n_regs, kern.n_spills
                except Exception:  # noqa: BLE001 - an older triton: leave the column empty
                    continue
                old = res.get(name, (0, 0))
                res[name] = (max(old[0], regs), max(old[1], spills // 4))  # bytes of local memory -> words
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", help="comma-separated bench rows (default: all but " + ", ".join(SKIP_ROWS) + ")")
    ap.add_argument("--configs", help="comma-separated mXnYwWsS (default: " + ",".join(CONFIGS) + ")")
    ap.add_argument("--rep-ms", type=float, default=40.0)
    ap.add_argument("--time-limit", type=float, default=140.0,
                    help="seconds from the start after which no more (row, config) is timed (recorded as skipped)")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 4),
                    help="compile-phase processes; 0: compile in this process")
    ap.add_argument("--smoke", action="store_true", help="a CPU run through Triton's interpreter at a tiny shape "
                    "(checks this script, times nothing meaningful)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    if args.smoke:
        global DEVICE, SHAPE
        os.environ["TRITON_INTERPRET"] = "1"
        import torch

        from fagen.bench.mods import ModsShape

        DEVICE, SHAPE = "cpu", ModsShape(batch=1, heads=2, seq=160, head_dim=32, dtype=torch.float32)
        args.workers, args.rep_ms, args.time_limit = 0, 1.0, 1e9
    import torch

    from fagen.bench.mods import ModsShape, _visible_pairs, cases

    all_rows = [c[0] for c in cases(ModsShape(seq=256, heads=2), "cpu")]
    rows = args.rows.split(",") if args.rows else [r for r in all_rows if r not in SKIP_ROWS]
    configs = args.configs.split(",") if args.configs else CONFIGS
    for c in configs:
        parse_config(c)
    defaults = cpu_defaults(rows)
    configs += [c for c in dict.fromkeys(defaults.values()) if c not in configs]  # the summary's baseline
    unknown = set(rows) - set(all_rows)
    if unknown:
        raise SystemExit(f"--rows: unknown {sorted(unknown)}; rows: {all_rows}")

    # Phase 1: compile in workers (each (row, config) once, at the bench shape).
    items = [(r, c) for r in rows for c in configs]
    n = max(1, min(args.workers, len(items)))
    chunks = [items[i::n] for i in range(n)]
    errors = {}
    if args.workers == 0:
        results = [warm(items)]
    else:
        pool = mp.get_context("spawn").Pool(n)
        results = pool.imap_unordered(warm, chunks)
    for done in results:
        for row, config, err, _ in done:
            if err:
                errors[(row, config)] = err
    if args.workers:
        pool.close()
        pool.join()  # the workers' CUDA contexts are gone before anything is timed
    t_compiled = time.perf_counter()
    print(f"compiled {len(items)} (row, config) pairs in {t_compiled - t_start:.0f} s with {n} workers "
          f"({len(errors)} failed)", flush=True)

    # Phases 2 and 3, one process.
    shape, setups = setup(rows)
    q, k, v, do = inputs(shape)
    dev = torch.device(DEVICE)
    check_rows, do_check = check_inputs(shape, do)
    masks = {row: block_mask(shape, setups[row][1]) for row in rows}
    flops = {row: 4.0 * shape.head_dim * _visible_pairs(masks[row], setups[row][1], shape) for row in rows}
    first = {}
    # The defaults first, then the candidates, each over every row: a run cut by --time-limit keeps whole configs.
    order = [c for c in dict.fromkeys([*defaults.values(), *configs])]
    records = []
    for config in order:
        for row in rows:
            sm, mm, mods, base = setups[row]
            rec = {"mod": row, "config": config, "default": config == defaults[row]}
            if time.perf_counter() - t_start > args.time_limit:
                rec["error"] = f"skipped: past --time-limit {args.time_limit:.0f} s"
            elif (row, config) in errors and _compile_error(errors[(row, config)]):  # else: retried here
                rec["error"] = errors[(row, config)]
            else:
                time_one(rec, module_of, base, mods, masks[row], flops[row], first, row, sm, mm, shape,
                         (q, k, v, do, do_check, check_rows), dev, args.rep_ms)
            records.append(rec)
            print(_progress(rec), flush=True)
    print_table(records)
    summary = print_summary(records, setups)
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "mods_tiles.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
                       "triton": __import__("triton").__version__, "shape": str(shape),
                       "records": records, "summary": summary}, f, indent=1, default=str)
    print(f"total {time.perf_counter() - t_start:.0f} s (compile phase {t_compiled - t_start:.0f} s)")


def time_one(rec, module_of, base, mods, bm, fl, first, row, sm, mm, shape, tensors, dev, rep_ms) -> None:
    """Check one (row, config) (against the fp32 reference at the row's first config, else against that config's
    results), then time its forward and backward into rec."""
    import torch

    from fagen.bench.timing import measure

    q, k, v, do, do_check, check_rows = tensors
    try:
        module = module_of(base, mods, rec["config"])
        fwd, att = runner(module, mods, bm, q, k, v)
        got = check_values(fwd, att, q, k, v, do_check, check_rows)
        if row not in first:
            want = reference(shape, sm, mm, q, k, v, do_check, check_rows)
            rec["check_vs"] = "fp32 reference"
            first[row] = got
        else:
            want = first[row]
            rec["check_vs"] = "first config"
        errs = [rel_err(a, b) for a, b in zip(got, want)]
        rec["check"] = errs
        rec["check_ok"] = errs[0] < 2e-2 and max(errs[1:]) < 3e-2
        with torch.no_grad():
            rec["fwd_ms"] = measure(lambda i: fwd(), 1, dev, 10.0, rep_ms)
        out = att()
        rec["bwd_ms"] = measure(lambda i: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), 1, dev, 10.0,
                                rep_ms)
        rec["fwd_TF/s"] = fl / rec["fwd_ms"] / 1e9
        rec["bwd_TF/s"] = 2.5 * fl / rec["bwd_ms"] / 1e9
        rec["resources"] = kernel_resources(module)
    except Exception as e:  # noqa: BLE001 - recorded in the table
        rec["error"] = _error(e)


def _error(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[-1][:160] if text else ''}"


def _compile_error(text: str) -> bool:
    """Whether a compile-phase error is the config's own (too much shared memory, no compile), not a worker's."""
    return any(word in text for word in ("OutOfResources", "CompilationError", "shared memory", "CompileError"))


def cpu_defaults(rows) -> dict:
    """{row: the config the runtime picks today on sm_90 (MODDED_TILES)}, traced on the CPU."""
    import torch

    from fagen.bench.mods import ModsShape, cases
    from fagen.runtime.modded import modded_spec
    from fagen.runtime.mods import prepare
    from fagen.runtime.resolve import spec_for

    shape = ModsShape()
    q = torch.empty(1, shape.heads, 16, shape.head_dim, dtype=shape.dtype)
    base = spec_for(q, q, q)
    out = {}
    for name, sm, mm, _ in cases(shape, "cpu"):
        if name in rows:
            spec = modded_spec(base, prepare(score_mod=sm, mask_mod=mm).fields, arch="sm_90").for_arch("sm_90")
            out[name] = f"m{spec.block_m}n{spec.block_n}w{spec.num_warps}s{spec.num_stages}"
    return out


def _progress(rec) -> str:
    if "error" in rec:
        return f"  {rec['mod']} {rec['config']}: error {rec['error']}"
    return (f"  {rec['mod']} {rec['config']}: fwd {rec['fwd_ms']:.3f} ms {rec['fwd_TF/s']:.0f} TF/s, "
            f"bwd {rec['bwd_ms']:.3f} ms {rec['bwd_TF/s']:.0f} TF/s, check {max(rec['check']):.1e}")


def print_table(records) -> None:
    print("\n| mod | dir | config | ms | TF/s | regs/spill | check | best |")
    print("|---|---|---|---:|---:|---|---|---|")
    for row in dict.fromkeys(r["mod"] for r in records):
        for d in ("fwd", "bwd"):
            mine = [r for r in records if r["mod"] == row]
            ok = [r for r in mine if "error" not in r]
            best = min((r[f"{d}_ms"] for r in ok), default=None)
            for r in mine:
                cfg = r["config"] + (" (default)" if r["default"] else "")
                if "error" in r:
                    print(f"| {row} | {d} | {cfg} | - | - | - | error: {r['error'][:70]} | |")
                    continue
                res = r.get("resources", {})
                names = ["_attn_fwd"] if d == "fwd" else ["_attn_bwd_dkdv", "_attn_bwd_dq"]
                rs = " ".join(f"{res[n][0]}/{res[n][1]}" for n in names if n in res) or "-"
                e = r["check"][0] if d == "fwd" else max(r["check"][1:])
                mark = "*" if r[f"{d}_ms"] == best else ("=" if r[f"{d}_ms"] <= best * 1.03 else "")
                check = f"{'ok' if r['check_ok'] else 'FAIL'} {e:.1e}"
                print(f"| {row} | {d} | {cfg} | {r[f'{d}_ms']:.3f} | {r[f'{d}_TF/s']:.0f} | {rs} | {check} | {mark} |")


def print_summary(records, setups) -> dict:
    """Per class (MODDED_TILES's key: a mask_mod or a score_mod alone, reading captured tensors or not): each
    config's geometric mean of (fwd + bwd) ms over the class's rows, relative to the row's current default; the
    winner goes into MODDED_TILES."""
    from fagen.runtime.modded import mods_class

    summary = {}
    print("\n| MODDED_TILES key | config | fwd+bwd time vs default (geomean) | fwd | bwd | rows |")
    print("|---|---|---:|---:|---:|---|")
    classes = {}
    for row, s in setups.items():
        classes.setdefault(mods_class(s[2].fields), []).append(row)
    for (kind, loads), rows in classes.items():
        key = f'("sm_90", "{kind}", {loads})'
        scores = {}
        for config in dict.fromkeys(r["config"] for r in records):
            rel = {"sum": [], "fwd": [], "bwd": []}
            for row in rows:
                mine = {r["config"]: r for r in records if r["mod"] == row and "error" not in r}
                ref = next((r for r in mine.values() if r["default"]), None)
                if config not in mine or ref is None:
                    break
                r = mine[config]
                rel["sum"].append((r["fwd_ms"] + r["bwd_ms"]) / (ref["fwd_ms"] + ref["bwd_ms"]))
                rel["fwd"].append(r["fwd_ms"] / ref["fwd_ms"])
                rel["bwd"].append(r["bwd_ms"] / ref["bwd_ms"])
            else:
                g = {k: math.exp(sum(map(math.log, v)) / len(v)) for k, v in rel.items()}
                scores[config] = g
                print(f"| {key} | {config} | {g['sum']:.3f} | {g['fwd']:.3f} | {g['bwd']:.3f} | {', '.join(rows)} |")
        if scores:
            win = min(scores, key=lambda c: scores[c]["sum"])
            summary[key] = {"winner": win, "tiles": parse_config(win), "scores": scores, "rows": rows}
            print(f"| {key} | winner: {win} -> MODDED_TILES[{key}] = {parse_config(win)} | | | | |")
    return summary


if __name__ == "__main__":
    main()
