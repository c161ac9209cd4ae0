"""The modded backward on one GPU (issue 26's backward target): attention-gym's seven mods of `fagen bench --suite
mods` (bf16, d128, B1 H16 S8192) through fagen's modded kernels, beside the plain causal and full backward.
FlexAttention is not run here (its compiles are slow; `fagen bench --suite mods` times it).

    PYTHONPATH=$PWD python3 scripts/gpu_mods_bwd.py [--rows a,b] [--configs m128n128w8s3,...] [--rep-ms 40]

Phases:
  1. compile: worker processes (one per core) run each (row, config) once at the bench shape, filling the Triton
     and fagen caches with the kernels the later phases launch (the check's shape specialises the same way);
  2. check: each (row, config) at a small shape (B1 H2 S2048) against float64 (the user's own functions over
     broadcast index tensors, autograd for dq, dk, dv): max |diff| / max |ref| of out, dq, dk, dv;
  3. time: the backward alone (autograd.grad of out for q, k, v: preprocess + dK/dV + dQ) and the forward, median
     ms over CUDA events with L2 flushed (fagen.bench.timing.measure), at the bench shape.

Table: per row and config (mXnYwWsS, the spec's tiles; `(default)` marks what fagen.attention picks on sm_90,
MODDED_TILES in fagen/runtime/modded.py): bwd ms, useful bwd TF/s (2.5 * 4 * D per visible pair, pairs from the
block mask as the bench counts them), the ratio to the plain backward (causal rows against plain causal, the rest
against plain full), fwd TF/s, registers/spilled words of the dK/dV and dQ kernels, and the check. A summary per
MODDED_TILES key then names the config with the least geometric-mean fwd+bwd time. $OUT/mods_bwd.json (if $OUT is
set) holds every record.
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
for p in (ROOT, os.path.join(ROOT, "scripts")):
    if p not in sys.path:
        sys.path.insert(0, p)

import gpu_mods_tiles as tiles  # noqa: E402  (the tile sweep's setup, runner, block mask and resource helpers)

ROWS = ["relative-bias", "alibi", "softcap", "document+causal", "prefix-lm", "sliding-window+causal", "dilated"]
PLAIN = {"plain-causal": "causal", "plain-full": "none"}
CAUSAL_ROWS = ("document+causal", "prefix-lm", "sliding-window+causal", "plain-causal")
# Candidates besides each row's default. The H100 run of 2026-11-26 (docs/mods.md, "The backward") timed these three
# on every row it reached and kept each MODDED_TILES default (m128n128w8s3 fails to fit the gathers' rows).
CONFIGS: list[str] = []
CHECK_SHAPE = dict(batch=1, heads=2, seq=2048)  # the bench shape's specialisations (block-mask rows of 16 blocks)


def _plain_run(mask, q, k, v):
    import fagen

    return (lambda: fagen.attention(q, k, v, mask=mask)), (lambda: fagen.attention(q, k, v, mask=mask))


def warm(items):
    """Phase 1 (a worker): run each (row, config) once at the bench shape, forward and backward."""
    import torch

    shape, setups = tiles.setup([r for r, _ in items if r not in PLAIN])
    q, k, v, do = tiles.inputs(shape)
    done = []
    for row, config in items:
        t0 = time.perf_counter()
        try:
            if row in PLAIN:
                fwd, att = _plain_run(PLAIN[row], q, k, v)
            else:
                sm, mm, mods, base = setups[row]
                fwd, att = tiles.runner(tiles.module_of(base, mods, config), mods, tiles.block_mask(shape, mm),
                                        q, k, v)
            with torch.no_grad():
                fwd()
            torch.autograd.grad(att(), (q, k, v), do)
            if tiles.DEVICE == "cuda":
                torch.cuda.synchronize()
            done.append((row, config, None, time.perf_counter() - t0))
        except Exception as e:  # noqa: BLE001 - recorded in the table
            done.append((row, config, tiles._error(e), time.perf_counter() - t0))
    return done


def reference64(sm, mm, q, k, v, do):
    """float64 out, dq, dk, dv of [B, H, S, D] inputs from the user's functions over broadcast index tensors."""
    import torch

    B, H, S, D = q.shape
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    dev = q.device
    b = torch.arange(B, device=dev)[:, None, None, None]
    h = torch.arange(H, device=dev)[None, :, None, None]
    qi = torch.arange(S, device=dev)[None, None, :, None]
    ki = torch.arange(S, device=dev)[None, None, None, :]
    s = (q64 @ k64.transpose(-1, -2)) / math.sqrt(D)
    if sm is not None:
        s = sm(s, b, h, qi, ki)
    if mm is not None:
        s = torch.where(mm(b, h, qi, ki).expand_as(s), s, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    out = p @ v64
    return (out.detach(), *torch.autograd.grad(out, (q64, k64, v64), do.double()))


def check_small(row, config, base_of):
    """(errors of out, dq, dk, dv, ok) of one (row, config) at CHECK_SHAPE against float64."""
    import torch

    from fagen.bench.mods import ModsShape, cases
    from fagen.runtime.mods import prepare

    shape = ModsShape(**CHECK_SHAPE) if tiles.SHAPE is None else tiles.SHAPE
    gen = torch.Generator(device="cpu").manual_seed(2)
    q, k, v, do = (torch.randn(shape.batch, shape.heads, shape.seq, shape.head_dim, generator=gen)
                   .to(tiles.DEVICE, shape.dtype) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if row in PLAIN:
        import fagen

        att = lambda: fagen.attention(q, k, v, mask=PLAIN[row])  # noqa: E731
        sm, mm = None, (lambda b, h, i, j: i >= j) if PLAIN[row] == "causal" else None
    else:
        sm, mm = next((c[1], c[2]) for c in cases(shape, tiles.DEVICE) if c[0] == row)
        mods = prepare(score_mod=sm, mask_mod=mm)
        module = tiles.module_of(base_of(), mods, config)
        _, att = tiles.runner(module, mods, tiles.block_mask(shape, mm), q, k, v)
    out = att()
    got = (out.detach(), *torch.autograd.grad(out, (q, k, v), do))
    want = reference64(sm, mm, q, k, v, do)
    errs = [float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-6)) for a, b in zip(got, want)]
    return errs, errs[0] < 2e-2 and max(errs[1:]) < 3e-2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", help="comma-separated rows (default: the seven gym rows)")
    ap.add_argument("--configs", help="comma-separated mXnYwWsS candidates besides each row's default (default: "
                    "none; the sweep of 2026-11-26 took m128n128w8s3,m128n128w8s2,m128n64w8s2)")
    ap.add_argument("--rep-ms", type=float, default=40.0)
    ap.add_argument("--time-limit", type=float, default=130.0,
                    help="seconds from the start after which no more (row, config) is timed")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 4))
    ap.add_argument("--smoke", action="store_true", help="a CPU run through Triton's interpreter at a tiny shape "
                    "(checks this script, times nothing meaningful)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        import torch

        from fagen.bench.mods import ModsShape

        tiles.DEVICE, tiles.SHAPE = "cpu", ModsShape(batch=1, heads=2, seq=160, head_dim=32, dtype=torch.float32)
        args.workers, args.rep_ms, args.time_limit = 0, 1.0, 1e9
    import torch

    from fagen.bench.mods import _visible_pairs
    from fagen.bench.timing import measure
    from fagen.runtime.modded import mods_class

    rows = args.rows.split(",") if args.rows else ROWS
    configs = args.configs.split(",") if args.configs else list(CONFIGS)
    for c in configs:
        tiles.parse_config(c)
    defaults = tiles.cpu_defaults(rows)
    items = [(p, None) for p in PLAIN]
    items += [(r, c) for r in rows for c in dict.fromkeys([defaults[r], *configs])]

    # Phase 1: compile in workers.
    n = max(1, min(args.workers, len(items)))
    errors = {}
    if args.workers:
        with mp.get_context("spawn").Pool(n) as pool:
            results = list(pool.imap_unordered(warm, [items[i::n] for i in range(n)]))
    else:
        results = [warm(items)]
    for done in results:
        for row, config, err, _ in done:
            if err:
                errors[(row, config)] = err
    t_compiled = time.perf_counter()
    print(f"compiled {len(items)} (row, config) pairs in {t_compiled - t_start:.0f} s with {n} workers "
          f"({len(errors)} failed)", flush=True)

    # Phases 2 and 3.
    shape, setups = tiles.setup(rows)
    q, k, v, do = tiles.inputs(shape)
    dev = torch.device(tiles.DEVICE)
    masks, flops = {}, {}  # per row: the bench shape's block mask and useful flops (counted once)
    base_of = lambda: next(iter(setups.values()))[3]  # noqa: E731  (the plain spec of the bench shape)
    full = 4.0 * shape.head_dim * shape.batch * shape.heads * shape.seq * shape.seq
    records = []
    for row, config in items:
        rec = {"row": row, "config": config or "-", "default": config is None or config == defaults.get(row)}
        records.append(rec)
        if time.perf_counter() - t_start > args.time_limit:
            rec["error"] = f"skipped: past --time-limit {args.time_limit:.0f} s"
            continue
        if (row, config) in errors and tiles._compile_error(errors[(row, config)]):
            rec["error"] = errors[(row, config)]
            continue
        try:
            rec["check"], rec["check_ok"] = check_small(row, config, base_of)
            if row in PLAIN:
                fwd, att = _plain_run(PLAIN[row], q, k, v)
                fl = full / (2.0 if PLAIN[row] == "causal" else 1.0)
                module = None
            else:
                sm, mm, mods, base = setups[row]
                if row not in masks:
                    masks[row] = tiles.block_mask(shape, mm)
                    flops[row] = 4.0 * shape.head_dim * _visible_pairs(masks[row], mm, shape)
                bm, fl = masks[row], flops[row]
                module = tiles.module_of(base, mods, config)
                fwd, att = tiles.runner(module, mods, bm, q, k, v)
            with torch.no_grad():
                rec["fwd_ms"] = measure(lambda i: fwd(), 1, dev, 10.0, args.rep_ms)
            out = att()
            rec["bwd_ms"] = measure(lambda i: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), 1, dev,
                                    10.0, args.rep_ms)
            rec["fwd_TF/s"], rec["bwd_TF/s"] = fl / rec["fwd_ms"] / 1e9, 2.5 * fl / rec["bwd_ms"] / 1e9
            rec["resources"] = tiles.kernel_resources(module) if module is not None else {}
        except Exception as e:  # noqa: BLE001 - recorded in the table
            rec["error"] = tiles._error(e)
        print("  " + json.dumps({k: rec[k] for k in rec if k != "resources"}, default=str), flush=True)

    plain = {r["row"]: r.get("bwd_TF/s") for r in records if r["row"] in PLAIN}
    gpu = torch.cuda.get_device_name() if tiles.DEVICE == "cuda" else "cpu (smoke)"
    print(f"\n{gpu}, torch {torch.__version__}, triton {__import__('triton').__version__}; "
          f"{str(shape.dtype).split('.')[-1]} d{shape.head_dim} B{shape.batch} H{shape.heads} S{shape.seq}")
    print("| row | config | bwd ms | bwd TF/s | vs plain | fwd TF/s | dK/dV regs/spill | dQ regs/spill | check "
          "(out, dq, dk, dv vs float64) |")
    print("|---|---|---:|---:|---:|---:|---|---|---|")
    for r in records:
        cfg = r["config"] + (" (default)" if r["default"] and r["row"] not in PLAIN else "")
        if "error" in r:
            print(f"| {r['row']} | {cfg} | - | - | - | - | - | - | error: {r['error'][:90]} |")
            continue
        ref = plain["plain-causal" if r["row"] in CAUSAL_ROWS else "plain-full"]
        vs = f"{r['bwd_TF/s'] / ref:.2f}x" if ref else "-"
        res = r.get("resources", {})
        rs = [("%d/%d" % res[n]) if n in res else "-" for n in ("_attn_bwd_dkdv", "_attn_bwd_dq")]
        check = ("ok " if r["check_ok"] else "FAIL ") + " ".join(f"{e:.1e}" for e in r["check"])
        print(f"| {r['row']} | {cfg} | {r['bwd_ms']:.3f} | {r['bwd_TF/s']:.0f} | {vs} | {r['fwd_TF/s']:.0f} | "
              f"{rs[0]} | {rs[1]} | {check} |")

    # Per MODDED_TILES key: geometric mean of fwd + bwd ms (and of bwd alone) per config, relative to the default.
    print("\n| MODDED_TILES key | rows | config | fwd+bwd vs default | bwd vs default |")
    print("|---|---|---|---:|---:|")
    summary = {}
    for row in rows:
        summary.setdefault(mods_class(setups[row][2].fields), []).append(row)
    for key, members in summary.items():
        base = {r["row"]: r for r in records if r["row"] in members and r["default"] and "error" not in r}
        for config in dict.fromkeys(r["config"] for r in records if r["row"] in members):
            mine = [r for r in records if r["row"] in members and r["config"] == config and "error" not in r
                    and r["row"] in base]
            if len(mine) < len(members) or not all(r.get("check_ok") for r in mine):
                continue
            both = math.exp(sum(math.log((r["fwd_ms"] + r["bwd_ms"]) / (base[r["row"]]["fwd_ms"]
                                                                          + base[r["row"]]["bwd_ms"])) for r in mine)
                            / len(mine))
            bwd = math.exp(sum(math.log(r["bwd_ms"] / base[r["row"]]["bwd_ms"]) for r in mine) / len(mine))
            print(f"| {key} | {','.join(members)} | {config} | {both:.3f}x | {bwd:.3f}x |")
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "mods_bwd.json"), "w") as f:
            json.dump({"gpu": gpu, "records": records}, f, indent=1, default=str)
    print(f"total {time.perf_counter() - t_start:.0f} s (compile phase {t_compiled - t_start:.0f} s)")


if __name__ == "__main__":
    main()
