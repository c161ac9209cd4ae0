"""Backward tile sweep on a GPU: every candidate is checked against the float64 reference first, then timed.

    python3 scripts/bench_bwd.py --sweep [--jobs 12] [--baseline OLD_MODULE.py]   # per-kernel tiles, variants
    python3 scripts/bench_bwd.py --rounds 3 --baseline OLD.py --compare "label=OTHER.py" --variant two-streams \
        --gqa-baseline OLD_G4.py                             # the default against other modules and SDPA

OLD.py and friends are generated modules (say `git show REV:generated/attn_bwd_causal_d128_..._g1_bf16.py`).
Results of the runs behind the current default: docs/backward.md, "Speed (H100)". Without a GPU the script runs
on tiny shapes in Triton's interpreter, to test the script itself.

Shape: the standard suite's bwd-d128-causal-s16k (B 1, H 16, S 16384, D 128, bf16). Timings are medians of
triton.testing.do_bench (L2 flushed between calls). "bwd" is the backward alone through autograd (the graph is
kept, as `fagen bench` times it); "fwd+bwd" runs both. dK/dV and dQ are also timed alone (each with the
preprocess) through the module's _launch_backward, so the two kernels' tiles are chosen independently.
TF/s count FLOPs as `fagen bench` does: fwd = 4·B·H·S²·D / 2 (causal), bwd = 2.5 × fwd.

Candidates override the module globals that the launcher reads (DKDV_BLOCK_M, DKDV_BLOCK_N, DQ_BLOCK_M,
DQ_BLOCK_N, *_NUM_WARPS, *_NUM_STAGES); structural variants patch the generated source text. Before timing, each
candidate passes check_backward on ragged causal problems (Sq < Sk, Sq = Sk, Sq > Sk) and a bitwise determinism
check. Compiles run first in --jobs processes (Triton's on-disk cache then serves the timing loop).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fagen  # noqa: E402
from fagen.runtime import loader as runtime  # noqa: E402
from fagen.verify.strategies import Problem  # noqa: E402
from fagen.verify.properties import check_backward  # noqa: E402

SMOKE = not torch.cuda.is_available()  # CPU: the interpreter on tiny shapes, to test this script itself
DEVICE = "cpu" if SMOKE else "cuda"
B, H, S, D = (1, 2, 128, 128) if SMOKE else (1, 16, 16384, 128)
FWD_FLOP = 4 * B * H * S * S * D / 2
BWD_FLOP = 2.5 * FWD_FLOP
SPEC = dict(head_dim=128, mask="causal", dtype="bf16", direction="bwd")
FWD_CFG = dict(block_m=128, block_n=128, num_warps=8, num_stages=3)  # the forward's best (defaults.default_config)

# Source patches (generated text, bf16: no dot_precision) for structural A/B variants.
PATCHES = {
    "dq-natural-order": [("start_m = tl.num_programs(0) - 1 - tl.program_id(0)", "start_m = tl.program_id(0)")],
    # dK/dV on a side stream, dQ on the current one: the two kernels overlap (each one's tail fills with the other).
    "two-streams": [("    if need_dkdv:\n", """    _main = torch.cuda.current_stream(q.device)
    _side = _SIDE.setdefault(q.device, torch.cuda.Stream(device=q.device))
    _side.wait_stream(_main)
    torch.cuda.set_stream(_side)
    if need_dkdv:
"""), ("    if need_dq:\n", """    torch.cuda.set_stream(_main)
    if need_dq:
"""), ("    return dq, dk, dv\n", """    _main.wait_stream(_side)
    return dq, dk, dv
"""), ("def _launch_backward(", "_SIDE = {}\n\n\ndef _launch_backward(")],
    "dkdv-p-before-dp": [(
        """        qk_t = tl.dot(k, tl.trans(q))  # [BLOCK_N, BLOCK_M]: S^T
        dp_t = tl.dot(v, tl.trans(do))  # dP^T = V dO^T
        qk_t = qk_t * qk_scale  # the log2 domain
""", """        qk_t = tl.dot(k, tl.trans(q)) * qk_scale
"""), ("""        dv += tl.dot(p_t.to(do.dtype), do)  # dV = P^T dO
""", """        dv += tl.dot(p_t.to(do.dtype), do)  # dV = P^T dO
        dp_t = tl.dot(v, tl.trans(do))
""")],
}


def cfg_globals(dkdv=None, dq=None) -> dict:
    """Module globals for a (step, owned, warps, stages) dK/dV tile and an (owned, step, warps, stages) dQ tile."""
    g = {}
    if dkdv:
        g.update(DKDV_BLOCK_M=dkdv[0], DKDV_BLOCK_N=dkdv[1], DKDV_NUM_WARPS=dkdv[2], DKDV_NUM_STAGES=dkdv[3])
    if dq:
        g.update(DQ_BLOCK_M=dq[0], DQ_BLOCK_N=dq[1], DQ_NUM_WARPS=dq[2], DQ_NUM_STAGES=dq[3])
    return g


def load_variant(patch: str | None = None, glob: dict | None = None, spec_cfg: dict | None = None,
                 source_path: str | None = None):
    spec = fagen.KernelSpec(**SPEC, **(spec_cfg or FWD_CFG))
    if source_path:
        mod = runtime.load_source(open(source_path).read(), "bench_bwd_baseline")
    elif patch:
        src = fagen.generate(spec)
        for old, new in PATCHES[patch]:
            if old not in src:
                raise RuntimeError(f"patch {patch}: text not found: {old[:60]!r}")
            src = src.replace(old, new)
        mod = runtime.load_source(src, f"bench_bwd_{patch.replace('-', '_')}")
    elif glob:  # a module of its own: the globals below must not leak into fagen.load's shared module
        tag = "_".join(f"{k}{v}" for k, v in sorted(glob.items())).lower()
        mod = runtime.load_source(fagen.generate(spec), f"bench_bwd_{tag}")
    else:
        mod = fagen.load(spec)
    for k, v in (glob or {}).items():
        if not hasattr(mod, k):
            raise RuntimeError(f"module has no {k}")
        setattr(mod, k, v)
    return spec, mod


PROBLEMS = [Problem(batch=2, heads_kv=2, seq_q=333, seq_k=461, seed=5),
            Problem(batch=1, heads_kv=2, seq_q=1000, seq_k=1000, seed=6),
            Problem(batch=1, heads_kv=1, seq_q=700, seq_k=300, seed=7)]
if SMOKE:
    PROBLEMS = [Problem(batch=1, heads_kv=1, seq_q=37, seq_k=161, seed=5)]


def check(spec, mod) -> str:
    """'' if the candidate matches the reference on every problem and is bitwise deterministic, else why not."""
    try:
        for p in PROBLEMS:
            check_backward(mod, spec, p, DEVICE)
        (q, k, v), kw = PROBLEMS[0].inputs(spec, DEVICE)
        out, lse = mod.forward(q, k, v)
        do = torch.randn_like(out)
        g1 = mod.backward(do, q, k, v, out, lse)
        g2 = mod.backward(do, q, k, v, out, lse)
        if not all(torch.equal(a, b) for a, b in zip(g1, g2)):
            return "not bitwise deterministic"
        return ""
    except Exception as e:  # noqa: BLE001 - a failing candidate is reported, not fatal
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"


def inputs(seed=0, s=S):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, s, D, device=DEVICE, dtype=torch.bfloat16, generator=g) for _ in range(4))
    return q, k, v, do


def bench(fn) -> float:
    if SMOKE:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def time_kernels(mod, tensors) -> dict:
    q, k, v, do = tensors
    out, lse = mod.forward(q, k, v)
    scale = D ** -0.5
    res = {}
    res["dkdv_ms"] = bench(lambda: mod._launch_backward(do, q, k, v, out, lse, scale, None, None, None, need_dq=False))
    res["dq_ms"] = bench(lambda: mod._launch_backward(do, q, k, v, out, lse, scale, None, None, None, need_dkdv=False))
    res["pre_ms"] = bench(lambda: mod._launch_backward(do, q, k, v, out, lse, scale, None, None, None, need_dq=False,
                                                       need_dkdv=False))
    return res


def time_autograd(attn, tensors) -> dict:
    """attn(q, k, v) -> out: backward alone (graph kept) and forward + backward."""
    q, k, v, do = tensors
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = attn(*leaves)
    bwd = bench(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True))
    del out
    both = bench(lambda: torch.autograd.grad(attn(*leaves), leaves, do))
    return {"bwd_ms": bwd, "fwdbwd_ms": both, "bwd_tflops": BWD_FLOP / bwd / 1e9,
            "fwdbwd_tflops": (FWD_FLOP + BWD_FLOP) / both / 1e9}


def sdpa(backend):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def attn(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return attn


def grads_vs_flash(mod, tensors) -> float:
    """max |fagen - sdpa flash| / max |flash| over dq, dk, dv at the timed shape (a sanity check, not the proof)."""
    from torch.nn.attention import SDPBackend
    q, k, v, do = tensors
    res = []
    for attn in (lambda a, b, c: mod.attention(a, b, c), sdpa(SDPBackend.FLASH_ATTENTION)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        res.append(torch.autograd.grad(attn(*leaves), leaves, do))
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(*res))


# -- candidates --------------------------------------------------------------------------------------------------
DKDV = [  # (queries per step, keys per program, warps, stages)
    (64, 128, 8, 3), (64, 128, 8, 2), (64, 128, 8, 4), (32, 128, 8, 3), (32, 128, 8, 4), (32, 128, 8, 5),
    (64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 8, 3), (16, 128, 8, 4),
]
DQ = [  # (queries per program, keys per step, warps, stages)
    (128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 32, 8, 3), (128, 32, 8, 4), (128, 32, 8, 5),
    (64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 8, 3), (128, 128, 8, 2),
]
# (label, patch, dkdv, dq): structural variants at a few tiles.
STRUCT = [
    ("dkdv-p-before-dp", "dkdv-p-before-dp", (64, 128, 8, 3), (128, 64, 8, 3)),
    ("dkdv-p-before-dp", "dkdv-p-before-dp", (32, 128, 8, 3), (128, 32, 8, 3)),
    ("dkdv-p-before-dp", "dkdv-p-before-dp", (64, 64, 4, 3), (64, 64, 4, 3)),
    ("dq-natural-order", "dq-natural-order", (64, 128, 8, 3), (128, 64, 8, 3)),
    ("dq-natural-order", "dq-natural-order", (64, 64, 4, 3), (64, 64, 4, 3)),
]


def candidates(args) -> list[dict]:
    out = []
    n = max(len(DKDV), len(DQ))
    for i in range(n):  # dK/dV and dQ tiles are paired only to share compiles and checks; they are timed apart
        out.append(dict(label="tiles", patch=None, dkdv=DKDV[i % len(DKDV)], dq=DQ[i % len(DQ)]))
    for label, patch, dkdv, dq in STRUCT:
        out.append(dict(label=label, patch=patch, dkdv=dkdv, dq=dq))
    if not SMOKE:  # the side-stream variant needs CUDA streams: checked here, timed only as a combination
        out.append(dict(label="two-streams", patch="two-streams", dkdv=(64, 128, 8, 3), dq=(128, 64, 8, 3)))
    return out[:2] + out[-2:] if SMOKE else out


def _prepare(c: dict) -> dict:
    """Worker: compile (ragged shapes via the checks, the timed shape's specialisation via a small launch)."""
    t0 = time.time()
    try:
        spec, mod = load_variant(c["patch"], cfg_globals(c["dkdv"], c["dq"]))
        why = check(spec, mod)
        if not SMOKE:
            q, k, v, do = inputs(s=1024)  # divisible like the timed shape: the same Triton specialisation
            out, lse = mod.forward(q, k, v)
            mod.backward(do, q, k, v, out, lse)
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        why = f"{type(e).__name__}: {str(e)[:200]}"
    return {**c, "check": why or "ok", "prep_s": round(time.time() - t0, 1)}


def fmt_tile(t):
    return f"m{t[0]}n{t[1]}w{t[2]}s{t[3]}"


def show(name, r, note=""):
    if r is None:
        line = f"{name:66s} {note}"
    else:
        k = (f"{r['dkdv_ms'] - r['pre_ms']:6.3f} {r['dq_ms'] - r['pre_ms']:6.3f} {r['pre_ms']:6.3f}"
             if "dkdv_ms" in r else " " * 20)
        line = (f"{name:66s} {r['bwd_ms']:7.3f} {r['bwd_tflops']:5.0f} {r['fwdbwd_ms']:7.3f} "
                f"{r['fwdbwd_tflops']:5.0f}  {k} {note}")
    print(line, flush=True)
    return line


HEADER = f"{'impl':66s} {'bwd ms':>7s} {'TF/s':>5s} {'f+b ms':>7s} {'TF/s':>5s}  {'dkdv':>6s} {'dq':>6s} {'pre':>6s}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--baseline", help="a generated module (.py) to time as the baseline")
    ap.add_argument("--compare", action="append", default=[], help="LABEL=PATH of another generated module to time")
    ap.add_argument("--variant", action="append", default=[],
                    help="a PATCHES name, or dkdv=M,N,W,S / dq=M,N,W,S: the default spec so changed, timed beside it")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds of the default and the peers")
    ap.add_argument("--gqa-baseline", help="a generated gqa-4 module (.py): timed against the gqa-4 default")
    ap.add_argument("--deadline", type=float, default=380.0, help="seconds; later timings are skipped")
    args = ap.parse_args()
    start = time.time()
    print(f"torch {torch.__version__}, {'smoke (CPU)' if SMOKE else torch.cuda.get_device_name()}", flush=True)
    table = []
    tensors = inputs()

    prepared = []
    if args.sweep:
        import multiprocessing as mp
        t0 = time.time()
        with mp.get_context("spawn").Pool(args.jobs) as pool:
            prepared = pool.map(_prepare, candidates(args), chunksize=1)
        print(f"prepared {len(prepared)} candidates in {time.time() - t0:.0f}s", flush=True)

    # 1. The comparison that matters most first: the default spec, other modules (--compare) and the peers, timed
    #    in --rounds interleaved rounds (median of the rounds), so that clock drift hits every row alike.
    print(HEADER, flush=True)
    spec = fagen.KernelSpec(**SPEC)
    mod = fagen.load(spec)
    why = check(spec, mod)
    impls = [(f"default {spec.name}", lambda a, b, c: mod.attention(a, b, c), mod,
              f"check {why or 'ok'}" + ("" if SMOKE else f"; grad vs flash {grads_vs_flash(mod, tensors):.1e}"))]
    for label, path in [("baseline (main)", args.baseline)] * bool(args.baseline) + [
            tuple(c.split("=", 1)) for c in args.compare]:
        try:
            _, other = load_variant(source_path=path)
            impls.append((label, (lambda m: lambda a, b, c: m.attention(a, b, c))(other), other, ""))
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    for v in args.variant:  # "PATCH" or "dkdv=M,N,W,S" / "dq=M,N,W,S": the default spec, patched or re-tiled
        try:
            if "=" in v:
                which, tile = v.split("=")
                glob = cfg_globals(**{which: tuple(int(x) for x in tile.split(","))})
                vspec, vmod = load_variant(None, glob, spec_cfg={})
            else:
                vspec, vmod = load_variant(v, None, spec_cfg={})
            vwhy = check(vspec, vmod)
            impls.append((f"variant {v}", (lambda m: lambda a, b, c: m.attention(a, b, c))(vmod), vmod,
                          f"check {vwhy or 'ok'}"))
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    from torch.nn.attention import SDPBackend
    peers = (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION))
    impls += [(name, sdpa(backend), None, "") for name, backend in (() if SMOKE else peers)]
    runs = {name: [] for name, *_ in impls}
    for rnd in range(args.rounds):
        for name, attn, _, _ in impls:
            try:
                runs[name].append(time_autograd(attn, tensors))
                r = runs[name][-1]
                print(f"  round {rnd} {name:60s} bwd {r['bwd_ms']:.3f} ms  fwd+bwd {r['fwdbwd_ms']:.3f} ms", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  round {rnd} {name}: failed {str(e)[:80]}", flush=True)
    for name, _, module, note in impls:
        if not runs[name]:
            table.append(show(name, None, "failed"))
            continue
        med = {k: sorted(r[k] for r in runs[name])[len(runs[name]) // 2] for k in runs[name][0]}
        if module is not None:
            med.update(time_kernels(module, tensors))
        spread = max(r["bwd_ms"] for r in runs[name]) / min(r["bwd_ms"] for r in runs[name]) - 1
        table.append(show(name, med, f"{note} (bwd spread {100 * spread:.1f}% over {len(runs[name])} rounds)"))

    # 2. Per-kernel tiles and variants, each timed alone.
    results = []
    for c in prepared:
        tag = f"{c['label']:18s} dkdv {fmt_tile(c['dkdv']):12s} dq {fmt_tile(c['dq']):12s}"
        if c["check"] != "ok":
            print(f"{tag} CHECK FAILED: {c['check']}", flush=True)
            continue
        if time.time() - start > args.deadline:
            print(f"{tag} skipped (deadline)", flush=True)
            continue
        try:
            _, mod = load_variant(c["patch"], cfg_globals(c["dkdv"], c["dq"]))
            r = time_kernels(mod, tensors)
        except Exception as e:  # noqa: BLE001
            print(f"{tag} ERROR {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        results.append({**c, **r})
        print(f"{tag} dkdv {r['dkdv_ms'] - r['pre_ms']:6.3f} ms  dq {r['dq_ms'] - r['pre_ms']:6.3f} ms  "
              f"pre {r['pre_ms']:.3f} ms  ({c['prep_s']}s prep)", flush=True)
    if results:
        with open(os.path.join(os.environ.get("OUT", "/tmp"), "bwd_sweep.jsonl"), "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")

    # 3. The best dK/dV and dQ tiles together, through autograd, with and without the structural variants.
    plain = [r for r in results if r["patch"] is None]
    if plain:
        best_dkdv = min(plain, key=lambda r: r["dkdv_ms"])["dkdv"]
        best_dq = min(plain, key=lambda r: r["dq_ms"])["dq"]
        combos = [("best tiles", None)] + [(f"best + {p}", p) for p in PATCHES]
        for name, patch in combos:
            if time.time() - start > args.deadline:
                break
            try:
                _, mod = load_variant(patch, cfg_globals(best_dkdv, best_dq))
                r = time_autograd(lambda a, b, c: mod.attention(a, b, c), tensors)
                err = "" if SMOKE else f"grad vs flash {grads_vs_flash(mod, tensors):.1e}"
                table.append(show(f"{name}: dkdv {fmt_tile(best_dkdv)} dq {fmt_tile(best_dq)}", r, err))
            except Exception as e:  # noqa: BLE001
                print(f"{name} ERROR {type(e).__name__}: {str(e)[:160]}", flush=True)

    if args.gqa_baseline and not SMOKE:  # gqa 4 (Hq 16, Hkv 4), S 8192: the flat head x block loop of dK/dV
        try:
            g = torch.Generator(device=DEVICE).manual_seed(1)
            sq = 8192
            q, do = (torch.randn(1, 16, sq, D, device=DEVICE, dtype=torch.bfloat16, generator=g) for _ in range(2))
            k, v = (torch.randn(1, 4, sq, D, device=DEVICE, dtype=torch.bfloat16, generator=g) for _ in range(2))
            flop = 4 * 16 * sq * sq * D / 2
            spec4 = fagen.KernelSpec(**SPEC, gqa=4)
            mod4 = fagen.load(spec4)
            why = check(spec4, mod4)
            for name, m in ((f"gqa4 S8k default {spec4.name} (check {why or 'ok'})", mod4),
                            ("gqa4 S8k baseline (main)", runtime.load_source(open(args.gqa_baseline).read(),
                                                                             "bench_bwd_baseline_g4"))):
                r = time_autograd(lambda a, b, c: m.attention(a, b, c), (q, k, v, do))
                r["bwd_tflops"], r["fwdbwd_tflops"] = 2.5 * flop / r["bwd_ms"] / 1e9, 3.5 * flop / r["fwdbwd_ms"] / 1e9
                table.append(show(name, r))
        except Exception:  # noqa: BLE001
            traceback.print_exc()

    print(f"\n== B{B} H{H} S{S} D{D} causal bf16, {time.time() - start:.0f}s; TF/s: bwd = 2.5 x fwd FLOPs ==")
    print(HEADER)
    print("\n".join(table))


if __name__ == "__main__":
    main()
