"""The modded forward's speed on one GPU (issue 26's forward target: >= 1.3x FlexAttention on every row): the seven
attention-gym rows of `fagen bench --suite mods` (fagen/bench/gym_mods.py via fagen/bench/mods.py cases()) through
fagen alone, at the bench shape (bf16, d128, B1 H16 S8192). No Flex here; the bench's Flex numbers are in
benchmarks/mods.md.

    PYTHONPATH=$PWD python3 scripts/gpu_mods_fwd.py [--rows a,b] [--configs m128n64w8s2,...] [--rep-ms 40]
                                                    # H100; about 1-2 minutes; $OUT/mods_fwd.json if $OUT is set

Phases:
  1. check: each row at a small shape (B1 H16 S1008: off the blocks, a multiple of 16
     like the heads, so that the timed shape's kernels are the ones checked) against fagen.verify's float64 reference
     of the same user functions: fagen.attention's forward without gradient (what the bench times), and for the
     mask rows every candidate tile's module (out and lse);
  2. time (CUDA events, L2 flushed, median): fagen.attention(q, k, v, score_mod=, mask_mod=, block_mask=) without
     gradient, exactly as the bench's fagen fwd column; for the mask rows also each candidate tile's forward module
     directly (the same block mask), and fagen.create_block_mask's build time.

Table columns:
  mod     the bench row; kernel: "attention" (fagen.attention's choice), "unsorted" (its kernel without the work
          order: query blocks in reverse, heads interleaved), "launch order" (its kernel walking the plain kernels'
          launch order: each head's query blocks in reverse, head after head), "LPT 8 heads" (heaviest first within
          groups of 8 heads) or a candidate tile mXnYwWsS
  ms      median milliseconds of one forward
  TF/s    useful TF/s: 4 * D per visible (q, kv) pair (counted from the elementwise mask, as the bench counts them)
  +mask   TF/s when the block mask is built on every call (its build time added), the attention row only
  mask ms fagen.create_block_mask at this shape
  check   max |diff| / max |ref| of out at the small shape (phase 1); "ok" within the bf16 tolerance
Flex's forward at this shape on the H100 (benchmarks/mods.md, second run) for the ratio column: relative-bias 218,
alibi 440, softcap 207, document+causal 190, prefix-lm 365, sliding-window+causal 283, dilated 69 TF/s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

FLEX_FWD = {"relative-bias": 218, "alibi": 440, "softcap": 207, "document+causal": 190, "prefix-lm": 365,
            "sliding-window+causal": 283, "dilated": 69}  # TF/s, benchmarks/mods.md (H100, second run)
ROWS = tuple(FLEX_FWD)
# Forward tiles of the mask rows (ptxas sm_90, forward kernel, spilled words over document / prefix-LM / sliding window /
# dilated): m128n128w8s3 -/0/0/0 (the plain tile; document's needs 228 KB of shared memory), m128n64w8s2 0 (document's
# default), m128n64w8s3 (Flex's H100 forward tile) 12/0/0/0, m64n64w4s2 0 and m64n64w4s3 10/0/0/0 (two CTAs per SM:
# 128 threads, 84/117 KB). m128n128w8s2 (document 46) and m64n128w4s2 spill more and are left out.
CONFIGS = ["m128n128w8s3", "m128n64w8s2", "m128n64w8s3", "m64n64w4s2", "m64n64w4s3"]
T0 = time.time()
DEVICE = "cuda"  # --cpu-smoke (tests of the script, never timed): "cpu" under TRITON_INTERPRET=1, tiny shapes


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def parse_config(text: str) -> dict:
    import re

    m = re.fullmatch(r"m(\d+)n(\d+)w(\d+)s(\d+)", text)
    if not m:
        raise SystemExit(f"--configs: {text!r} is not mXnYwWsS")
    return dict(zip(("block_m", "block_n", "num_warps", "num_stages"), map(int, m.groups())))


def row_cases(shape, rows):
    from fagen.bench.mods import cases

    return [(n, sm, mm) for n, sm, mm, _ in cases(shape, DEVICE) if n in rows]


def tile_module(shape, sm, mm, config):
    """The forward module of these mods at one candidate tile (a fwd-direction spec, as the no-grad path takes)."""
    from fagen.runtime.loader import load
    from fagen.runtime.modded import modded_spec
    from fagen.runtime.mods import prepare
    from fagen.runtime.resolve import spec_for

    q = torch.empty(shape.batch, shape.heads, 16, shape.head_dim, dtype=shape.dtype, device=DEVICE)
    base = spec_for(q, q, q)
    mods = prepare(score_mod=sm, mask_mod=mm)
    return load(modded_spec(base, mods.fields, parse_config(config))), mods


def per_head_order(q, k, v, mm, bm, chunk):
    """The module and a kernel form of this block mask expanded to every query head (H' = H), whose work order
    ([Note] Work order) is any order of (head, query block) pairs: chunk 0, the launch order without a block mask
    (each head's query blocks in reverse, head after head); chunk G, heaviest first within each group of G heads
    (heads interleaved by rank), the groups in turn."""
    from fagen.runtime.modded import module_for
    from fagen.runtime.mods import prepare

    mods = prepare(mask_mod=mm)
    module, _ = module_for(q, k, v, "none", (), mods)
    tile_m, tile_n = (max(getattr(module, f"{p}BLOCK_{x}", 0) for p in ("", "DQ_", "DKDV_")) for x in "MN")
    cls, lists, lists_t, gm, gn = bm.kernel_form(q.device, tile_m, tile_n)
    heads = q.shape[1]
    b, _, qb, kb = cls.shape
    cls, lists, lists_t = (t.expand(b, heads, *t.shape[2:]).contiguous() for t in (cls, lists, lists_t))
    work = (3 * (cls[0] == 1).sum(-1) + 2 * (cls[0] == 2).sum(-1) + 2).tolist()  # [H][QB]
    if chunk == 0:
        order = [h * qb + i for h in range(heads) for i in reversed(range(qb))]
    else:
        order = []
        for h0 in range(0, heads, chunk):
            hs = range(h0, min(heads, h0 + chunk))
            ranks = sorted(range(qb), key=lambda i: (-work[h0][i], i))
            order += [h * qb + i for i in ranks for h in hs]
    assert sorted(order) == list(range(heads * qb)), "not a permutation of the (head, query block) pairs"
    lists[..., 4 * kb + 2] = torch.tensor(order, dtype=torch.int32, device=q.device).view(heads, qb)
    return module, mods, (cls, lists, lists_t, gm, gn)


def unsorted(q, k, v, mm, bm):
    """fagen.attention's module for this mask_mod and its block mask's kernel form with the work order ([Note] Work
    order in fagen/runtime/block_mask.py) replaced by query blocks in reverse (the launch order without a block
    mask, the heads interleaved): the control of that order."""
    from fagen.runtime.modded import module_for
    from fagen.runtime.mods import prepare

    mods = prepare(mask_mod=mm)
    module, _ = module_for(q, k, v, "none", (), mods)
    tile_m, tile_n = (max(getattr(module, f"{p}BLOCK_{x}", 0) for p in ("", "DQ_", "DKDV_")) for x in "MN")
    cls, lists, lists_t, gm, gn = bm.kernel_form(q.device, tile_m, tile_n)
    lists = lists.clone()
    b, h, qb, kb = cls.shape
    lists[..., 4 * kb + 2] = (h * qb - 1 - torch.arange(h * qb, device=q.device, dtype=torch.int32)).view(h, qb)
    return module, mods, (cls, lists, lists_t, gm, gn)


def inputs(shape, seed=1):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(shape.batch, shape.heads, shape.seq, shape.head_dim, generator=gen).to(DEVICE, shape.dtype)
            for _ in range(3)]


def visible_pairs(mm, shape) -> int:
    """Visible (q, kv) pairs over B x H: the mask evaluated at every element (the bench counts the same)."""
    if mm is None:
        return shape.batch * shape.heads * shape.seq * shape.seq
    from fagen.verify.mods_reference import mask_mod_visible

    total, step = 0, 1024
    for r0 in range(0, shape.seq, step):  # rows in chunks: mask_mod_visible over [1, 1, step, S]
        vis = mask_mod_visible(lambda b, h, qi, ki: mm(b, h, qi + r0, ki), 1, 1, min(step, shape.seq - r0),
                               shape.seq, DEVICE)
        total += int(vis.sum())
    return total * shape.batch * shape.heads


def rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))


def check_row(name, sm, mm, configs, small, tol) -> dict:
    """{kernel label: rel err of out (lse checked to be within 1e-3 absolute)} at the small shape."""
    import fagen
    from fagen.verify import reference

    q, k, v = inputs(small, seed=2)
    want, want_lse = reference.attention(q, k, v, score_mod=sm, mask_mod=mm)
    res = {}
    bm = None if mm is None else fagen.create_block_mask(mm, None, None, small.seq, small.seq, device=DEVICE)
    with torch.no_grad():
        out = fagen.attention(q, k, v, score_mod=sm, mask_mod=mm, block_mask=bm)
    res["attention"] = rel(out, want)
    if mm is not None:
        for config in configs:
            try:
                module, mods = tile_module(small, sm, mm, config)
                out, lse = module.forward(q, k, v, mods=mods.values, block_mask=bm)
            except Exception as e:  # noqa: BLE001 - a tile that does not build (shared memory) is reported, not failed
                res[config] = f"no build: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:80]}"
                continue
            err = rel(out, want)
            fin = torch.isfinite(want_lse)
            lse_err = float((lse[fin] - want_lse[fin]).abs().max()) if fin.any() else 0.0
            if not bool((torch.isneginf(lse) == ~fin).all()):
                lse_err = math.inf
            res[config] = err if lse_err < 1e-3 else math.inf
    for label, err in res.items():
        assert isinstance(err, str) or err <= tol, f"{name} {label}: out error {err:.2e} > {tol}"
    return res


def time_ms(fn, rep_ms) -> float:
    from fagen.bench.timing import measure

    return measure(lambda i: fn(), 1, torch.device(DEVICE), 10.0, rep_ms)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--rep-ms", type=float, default=40.0)
    ap.add_argument("--cpu-smoke", action="store_true", help="the interpreter at tiny shapes (a test of the script)")
    a = ap.parse_args()
    global DEVICE
    if a.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        DEVICE = "cpu"
    rows = [r for r in a.rows.split(",") if r]
    configs = [c for c in a.configs.split(",") if c]
    import fagen
    from fagen.bench.mods import ModsShape

    shape, small = ModsShape(), ModsShape(heads=16, seq=1008)
    if a.cpu_smoke:
        shape, small = ModsShape(heads=1, seq=256, head_dim=32), ModsShape(heads=1, seq=200, head_dim=32)
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)"
    log(f"{device_name}, torch {torch.__version__}; fagen {fagen.__file__}")
    checks = {}
    for name, sm, mm in row_cases(small, rows):
        try:
            checks[name] = check_row(name, sm, mm, configs, small, 2e-2)
            log(f"PASS check {name}: " + ", ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}"
                                                   for k, v in checks[name].items()))
        except Exception as e:  # noqa: BLE001 - a failed check is reported and its row still timed
            checks[name] = {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"}
            log(f"FAIL check {name}: {checks[name]['error']}")
            traceback.print_exc(file=sys.stderr)
    torch.cuda.empty_cache()

    q, k, v = inputs(shape)
    records = []
    for name, sm, mm in row_cases(shape, rows):
        rec = {"mod": name, "check": checks.get(name, {}), "kernels": {}}
        try:
            pairs = visible_pairs(mm, shape)
            flops = 4.0 * shape.head_dim * pairs
            rec["pairs"] = pairs
            bm = None
            if mm is not None:
                bm = fagen.create_block_mask(mm, None, None, shape.seq, shape.seq, device=DEVICE)
                rec["mask_ms"] = time_ms(lambda: fagen.create_block_mask(mm, None, None, shape.seq, shape.seq,
                                                                         device=DEVICE), a.rep_ms)
            with torch.no_grad():
                ms = time_ms(lambda: fagen.attention(q, k, v, score_mod=sm, mask_mod=mm, block_mask=bm), a.rep_ms)
                rec["kernels"]["attention"] = {"ms": ms, "TF/s": flops / ms / 1e9}
                if mm is not None:
                    rec["kernels"]["attention"]["+mask TF/s"] = flops / (ms + rec["mask_ms"]) / 1e9
                    base_out = fagen.attention(q, k, v, mask_mod=mm, block_mask=bm)
                    for label, chunk in (("launch order", 0), ("LPT 8 heads", 8)):
                        try:  # controls of the work order through a per-head block mask (no recompile)
                            module, mods, form = per_head_order(q, k, v, mm, bm, chunk)
                            run = lambda: module.forward(q, k, v, mods=mods.values, block_mask=form)  # noqa: E731
                            same = rel(run()[0], base_out)  # the same kernel in another order: the same values
                            ms = time_ms(run, a.rep_ms)
                            rec["kernels"][label] = {"ms": ms, "TF/s": flops / ms / 1e9}
                            rec["check"][label] = f"={same:.0e}" if same < 1e-2 else f"DIFFERS {same:.1e}"
                        except Exception as e:  # noqa: BLE001
                            rec["kernels"][label] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
                    try:  # the control: the same kernel walking query blocks in reverse, heads interleaved
                        module, mods, form = unsorted(q, k, v, mm, bm)
                        run = lambda: module.forward(q, k, v, mods=mods.values, block_mask=form)  # noqa: E731
                        ms = time_ms(run, a.rep_ms)
                        rec["kernels"]["unsorted"] = {"ms": ms, "TF/s": flops / ms / 1e9}
                    except Exception as e:  # noqa: BLE001
                        rec["kernels"]["unsorted"] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
                    for config in configs:
                        try:
                            module, mods = tile_module(shape, sm, mm, config)
                            run = lambda: module.forward(q, k, v, mods=mods.values, block_mask=bm)  # noqa: E731
                            run()
                            ms = time_ms(run, a.rep_ms)
                            rec["kernels"][config] = {"ms": ms, "TF/s": flops / ms / 1e9}
                        except Exception as e:  # noqa: BLE001
                            rec["kernels"][config] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
            log(f"timed {name}")
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            log(f"FAIL time {name}: {rec['error']}")
            traceback.print_exc(file=sys.stderr)
        records.append(rec)
        torch.cuda.empty_cache()

    print()
    print(f"{'mod':<22} {'kernel':<13} {'ms':>7} {'TF/s':>6} {'vs Flex':>7} {'+mask':>6} {'mask ms':>7}  check")
    for rec in records:
        if "error" in rec:
            print(f"{rec['mod']:<22} ERROR {rec['error']}")
            continue
        best = max((r["TF/s"] for r in rec["kernels"].values() if "TF/s" in r), default=0)
        for label, r in rec["kernels"].items():
            if "error" in r:
                print(f"{rec['mod']:<22} {label:<13} ERROR {r['error']}")
                continue
            chk = rec["check"].get(label, rec["check"].get("error", "-"))
            chk = f"ok {chk:.1e}" if isinstance(chk, float) else str(chk)
            plus = f"{r['+mask TF/s']:6.0f}" if "+mask TF/s" in r else ""
            mask_ms = f"{rec['mask_ms']:7.3f}" if label == "attention" and "mask_ms" in rec else ""
            star = " *" if r["TF/s"] == best and len(rec["kernels"]) > 1 else ""
            print(f"{rec['mod']:<22} {label:<13} {r['ms']:7.3f} {r['TF/s']:6.0f} {r['TF/s'] / FLEX_FWD[rec['mod']]:6.2f}x "
                  f"{plus:>6} {mask_ms:>7}  {chk}{star}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "mods_fwd.json"), "w") as f:
            json.dump({"device": device_name, "records": records}, f, indent=1, default=str)
    failed = [n for n, c in checks.items() if "error" in c]
    log(f"done; checks failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
