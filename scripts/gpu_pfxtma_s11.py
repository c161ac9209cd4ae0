"""Issue 26, eleventh session (helper pfxtma): the prefix-LM backward in one launch of the d128 default render (its
qmul rows by TMA, variant bwd_prefix_tma) and the fixed-point mode's fast host path (_BWD_FAST_FIXED, [Note]
Fixed-point dQ on the fast path in fagen/templates/host/gluon_bwd_launch.py), on an H100 (docs/mods.md and
docs/hopper.md, "(eleventh session)").

    PYTHONPATH=$PWD python3 scripts/gpu_pfxtma_s11.py            # every phase, each in a child with a timeout
    python3 scripts/gpu_pfxtma_s11.py --phase time               # one phase here (no child, no timeout)
    GPU_PFXTMA_DRY=1 python3 scripts/gpu_pfxtma_s11.py           # any machine: the renders and their constants only

Modules (each rendered with its variant keys set, whatever the defaults): `nopfx` the d128 causal default without
the prefix (bwd_prefix_tma 0: the product before this session's flip), `tma` the same with the prefix argument
(bwd_prefix_tma 1), `s10` the tenth session's one-launch render (the chain's render with bwd_prefix 2: mode 2
without TMA rows, beside the chain). Host paths: -plain (_BWD_FAST_FIXED off: mode 2 through _run_backward) and
-fast (on).
Phases (scripts/_phases.py; the warm ones at once in children, then `time` in one child):
  warm*  each compiles its modules at the timed shapes, then checks at B1 H2 S333 d128 bf16 (lengths off the blocks)
         against float64: the prefix split in one launch (P 83, 300: inside and across a key block) on both host
         paths, bitwise repeatable and the two paths bitwise equal; the plain causal call (P = 0) on both paths,
         row 0's dq exactly zero; d64 causal and GQA 4/2 causal (the d64 / GQA defaults' mode 2) fast against plain;
         fagen.attention's prefix-LM (the product: how many one-launch backwards it ran).
  time   prefix-LM B1 H16 S8192 P 2048 (the mods bench's row): Flex, the product (api; api-two: its split in two
         calls, PREFIX_ONE_BWD off), s10, tma-plain, tma-fast:
         backward ms (autograd.grad of a kept output, do_bench median, L2 flushed), TF/s, x Flex, the kernels' own
         ms per call (torch.profiler); causal B1 H16 s16k d128 deterministic (module.backward): nopfx / tma x plain /
         fast / late (_BWD_ZERO_LATE), and u-tma-fast / -late (deterministic=False), TF/s, the gradients of tma-fast
         and tma-late bitwise those of nopfx-plain; host B1 H16 S2048 causal: wall ms (do_bench), the host's own ms
         per call (20 calls issued without a sync) and ms per call of 50 back to back. Round B (the branch with
         bwd_prefix_tma 1: `api` is the one launch now, `api-two` the split's two calls) runs the prefix rows twice
         and the causal rows three times in rotated orders (round A's first variant of each group ran fastest), then
         a table of medians per variant.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_mods_bwd_s9 as s9  # noqa: E402  (shape_of, selection, lever_source, flex_call, row_mods, reference, ...)

DRY = bool(os.environ.get("GPU_PFXTMA_DRY"))
BUDGET = 74.0  # seconds of the whole run (the round kills it at 80)
PL = "prefix-lm"
P_BENCH = 2048
LEVERS = {"nopfx": {"bwd_prefix_tma": 0}, "tma": {"bwd_prefix_tma": 1}, "s10": {"bwd_d128": {}, "bwd_prefix": 2}}
_MODS: dict = {}


def module(name: str, mask: str = "causal", head_dim: int = 128, gqa: int = 1):
    """The bf16 Gluon bwd module `name` (LEVERS; "default": the product's render of mask / head_dim / gqa)."""
    from fagen.runtime.loader import load_source
    from fagen.spec.kernel import KernelSpec

    key = (name, mask, head_dim, gqa)
    if key not in _MODS:
        spec = KernelSpec(backend="gluon", direction="bwd", head_dim=head_dim, dtype="bf16", mask=mask, gqa=gqa)
        src = s9.lever_source(spec, LEVERS.get(name, {}))
        want = {"nopfx": ("BWD_PREFIX = 0", "BWD_FIXED_TMA = 1"), "tma": ("BWD_PREFIX = 1", "BWD_FIXED_TMA = 1"),
                "s10": ("BWD_PREFIX = 1", "BWD_FIXED_TMA = 0", "BWD_PREFIX_MODE = 2")}.get(name, ())
        assert all(w in src for w in want), f"{name} did not render as expected"
        _MODS[key] = load_source(src, f"{spec.name}_{name}_s11")
    return _MODS[key]


def host(mod, path):
    """mod with its host path set: "plain" (mode 2 through _run_backward), "fast" (_BWD_FAST_FIXED), "late" (and
    _BWD_ZERO_LATE: the accumulator's fill after the preprocess); True / False: fast / plain."""
    path = {True: "fast", False: "plain"}.get(path, path)
    mod._BWD_FAST_FIXED = path != "plain"
    mod._BWD_ZERO_LATE = path == "late"  # removed from the launcher after round B: "late" now times the fast path
    return mod


def prefix_call(name: str, fast: bool):
    """(q, k, v[, p]) -> out of the split's _Prefix with its backward in one launch of module `name`."""
    from fagen.mods import split

    top, low = module("default", "none"), module(name)

    def call(q, k, v, p=P_BENCH):
        split.PREFIX_ONE_BWD = True  # read by the forward
        host(low, fast)
        return split._Prefix.apply(q, k, v, p, (top, low), {})
    return call


def api_prefix(mm, bm, one=True):
    """fagen.attention's prefix-LM (the product); one=False: its split in two calls (PREFIX_ONE_BWD off)."""
    import fagen
    from fagen.mods import split

    s9.selection(True)

    def call(q, k, v):
        split.PREFIX_ONE_BWD = one  # read by the forward
        try:
            return fagen.attention(q, k, v, mask_mod=mm, block_mask=bm)
        finally:
            split.PREFIX_ONE_BWD = True
    return call


def pfx_mask(p):
    return lambda b, h, q_idx, kv_idx: (kv_idx < p) | (q_idx >= kv_idx)


def small(h=2, hkv=None, s=333, d=128, seed=10):
    import torch

    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(1, h, s, d, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, hkv or h, s, d, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    return q, k, v, do


def grads(call, q, k, v, do):
    import torch

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    return torch.autograd.grad(call(qg, kg, vg), (qg, kg, vg), do)


def ref64(q, k, v, do, visible):
    """float64 dq, dk, dv (GQA by repeat)."""
    import torch

    r = q.shape[1] // k.shape[1]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    s_ = (q64 @ k64.repeat_interleave(r, 1).transpose(-1, -2)) / q.shape[-1] ** 0.5
    o = torch.softmax(s_.masked_fill(~visible, float("-inf")), -1) @ v64.repeat_interleave(r, 1)
    return torch.autograd.grad(o, (q64, k64, v64), do.double())


def check(name, fn):
    t0 = time.perf_counter()
    try:
        ok, text = fn()
        line = f"{'PASS' if ok else 'FAIL'} {name}: {text}"
    except Exception as e:  # noqa: BLE001 - a line, never the end of the run
        line = f"FAIL {name}: {type(e).__name__}: {str(e)[:200]}"
    print(f"CHECK {line} ({time.perf_counter() - t0:.1f} s)", flush=True)


def errs(got, ref):
    from fagen.spec.axes import DType
    from fagen.verify.tolerances import compare_grad

    return [compare_grad(n, a, r, DType.BF16) for n, a, r in zip(("dq", "dk", "dv"), got, ref)]


def same(a, b):
    import torch

    return all(torch.equal(x, y) for x, y in zip(a, b))


def check_prefix(name):
    """The split in one launch of module `name`: float64 at P 83 / 300, each host path twice, all four bitwise."""
    import torch

    q, k, v, do = small()
    i, j = torch.arange(333, device="cuda")[:, None], torch.arange(333, device="cuda")[None, :]
    for p in (83, 300):
        def one(p=p):
            runs = [grads(lambda a, b, c: prefix_call(name, fast)(a, b, c, p), q, k, v, do)
                    for fast in (True, True, False, False)]
            e = errs(runs[0], ref64(q, k, v, do, (j < p) | (j <= i)))
            rep, paths = same(runs[0], runs[1]) and same(runs[2], runs[3]), same(runs[0], runs[2])
            return (rep and paths and max(e) < 3e-2,
                    f"max |err| dq {e[0]:.1e} dk {e[1]:.1e} dv {e[2]:.1e}; repeatable {rep}; fast == plain {paths}")
        check(f"prefix P {p} one launch ({name})", one)


def check_causal(name, head_dim=128, gqa=1):
    """module(name).attention at causal (P = 0 where it takes a prefix): float64, row 0's dq == 0, fast twice and
    plain, bitwise."""
    import torch

    hq = 4 if gqa > 1 else 2
    q, k, v, do = small(hq, hq // gqa, d=head_dim)
    mod = module(name, "causal", head_dim, gqa)
    i, j = torch.arange(333, device="cuda")[:, None], torch.arange(333, device="cuda")[None, :]

    def run():
        runs = [grads(lambda a, b, c: host(mod, fast).attention(a, b, c), q, k, v, do) for fast in (True, True, False)]
        e = errs(runs[0], ref64(q, k, v, do, j <= i))
        zero = all(bool((r[0][:, :, 0] == 0).all()) for r in runs)
        rep, paths = same(runs[0], runs[1]), same(runs[0], runs[2])
        return (rep and paths and zero and max(e) < 3e-2 and mod.BWD_DET_MODE == 2,
                f"mode {mod.BWD_DET_MODE} TMA rows {mod.BWD_FIXED_TMA}; max |err| dq {e[0]:.1e} dk {e[1]:.1e} "
                f"dv {e[2]:.1e}; row 0 dq == 0 {zero}; repeatable {rep}; fast == plain {paths}")
    check(f"causal {name} d{head_dim} gqa {gqa}", run)


def check_product():
    """fagen.attention's causal backward (the product's default render, P = 0) bitwise module nopfx's, float64."""
    import torch

    import fagen
    from fagen.runtime import hopper

    hopper.BWD_MIN_WORK = 0
    s9.selection(True)
    q, k, v, do = small()
    i, j = torch.arange(333, device="cuda")[:, None], torch.arange(333, device="cuda")[None, :]

    def run():
        got = grads(lambda a, b, c: fagen.attention(a, b, c, mask="causal"), q, k, v, do)
        want = grads(lambda a, b, c: host(module("nopfx"), "plain").attention(a, b, c), q, k, v, do)
        e = errs(got, ref64(q, k, v, do, j <= i))
        low = fagen.load(fagen.KernelSpec(backend="gluon", direction="bwd", head_dim=128, dtype="bf16", mask="causal"))
        return (same(got, want) and max(e) < 3e-2,
                f"BWD_PREFIX {low.BWD_PREFIX}; bitwise the render without the prefix {same(got, want)}; "
                f"max |err| {max(e):.1e}; row 0 dq == 0 {bool((got[0][:, :, 0] == 0).all())}")
    check("api causal (the product)", run)


def check_api():
    """fagen.attention's prefix-LM (the product's defaults): float64, bitwise repeat, one-launch backwards run."""
    import torch

    import fagen
    from fagen.mods import split
    from fagen.runtime import hopper

    hopper.BWD_MIN_WORK = hopper.BWD_WINDOW_MIN_WORK = 0
    s9.selection(True)
    q, k, v, do = small()
    i, j = torch.arange(333, device="cuda")[:, None], torch.arange(333, device="cuda")[None, :]
    calls, one = [], split._one_backward

    def counted(*a):
        calls.append(a[0])
        return one(*a)
    split._one_backward = counted

    def run():
        runs = [grads(lambda a, b, c: fagen.attention(a, b, c, mask_mod=pfx_mask(83)), q, k, v, do) for _ in "ab"]
        e = errs(runs[0], ref64(q, k, v, do, (j < 83) | (j <= i)))
        low = calls[0] if calls else None
        what = (f"one launch x{len(calls)} (BWD_FIXED_TMA {low.BWD_FIXED_TMA}, _BWD_FAST_FIXED "
                f"{low._BWD_FAST_FIXED})" if low else "two calls")
        return same(*runs) and max(e) < 3e-2, f"{what}; max |err| {max(e):.1e}; repeatable {same(*runs)}"
    check("api prefix P 83 (the product)", run)
    split._one_backward = one


# warm children: (items to compile at the timed shapes, checks), all at once
WARM = {"flex": (["flex"], []), "api": (["api"], ["api"]), "s10": (["s10"], ["prefix:s10"]),
        "tma": (["tma-fast"], ["prefix:tma"]), "tmac": (["c-tma-fast", "h-tma-fast", "u-tma-fast"], ["causal:tma"]),
        "nopfx": (["c-nopfx-fast", "h-nopfx-fast"], ["causal:nopfx", "product"]),
        "d64": ([], ["causal:default:64:1"]), "gqa": ([], ["causal:default:128:2"])}


def bench_inputs(seq):
    import torch

    g = torch.Generator("cuda").manual_seed(0)  # on the device: CPU randn takes seconds at s16k
    return [torch.randn(1, 16, seq, 128, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
            for _ in range(4)]


def variant_step(item, tensors):
    """A zero-argument callable running one backward of timing item `item` on tensors (q, k, v, do)."""
    import torch

    q, k, v, do = tensors
    if item in ("flex", "api", "api-two", "s10") or item.startswith("tma-"):
        shape = s9.shape_of()
        sm, mm = s9.row_mods(PL, shape)
        if item == "flex":
            att = s9.flex_call(sm, mm, shape)
        elif item.startswith("api"):
            att = api_prefix(mm, s9.fagen_mask(mm, shape), item == "api")
        else:
            att = prefix_call(item.split("-")[0], item != "tma-plain")
        out = att(q, k, v)
        return lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    kind, name, path = item.split("-")  # c-/h-/u-<module>-<path>: module.backward at causal (u-: unordered)
    mod = module(name)
    out, lse = mod.forward(q.detach(), k.detach(), v.detach())
    qd, kd, vd, dd = (t.detach() for t in (q, k, v, do))
    return lambda: host(mod, path).backward(dd, qd, kd, vd, out, lse, deterministic=kind != "u")


def shape_seq(item):
    return 16384 if item[:2] in ("c-", "u-") else 2048 if item.startswith("h-") else 8192


def phase_warm(name: str) -> None:
    import torch

    items, checks = WARM[name]
    for item in items:
        t0 = time.perf_counter()
        try:
            variant_step(item, bench_inputs(shape_seq(item)))()
            torch.cuda.synchronize()
            print(f"warm {item}: {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - the time phase reports it again
            print(f"warm {item}: {type(e).__name__}: {str(e)[:160]}", flush=True)
    for c in checks:
        kind, *rest = c.split(":")
        if kind == "api":
            check_api()
        elif kind == "product":
            check_product()
        elif kind == "prefix":
            check_prefix(rest[0])
        else:
            check_causal(rest[0], *(int(x) for x in rest[1:]))


def kernel_ms(fn, n=3):
    """(kernels' ms per call, [(name, ms)] of the largest three) from torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    per = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t:
            per[e.key] = per.get(e.key, 0.0) + t / 1e3 / n
    top = sorted(per.items(), key=lambda x: -x[1])[:3]
    return sum(per.values()), [(k[:28], round(v, 3)) for k, v in top]


# round B: passes in rotated orders (round A's first variant of each group ran fastest: the clocks?)
_C = ["c-nopfx-plain", "c-tma-plain", "c-tma-fast", "c-tma-late", "u-tma-fast", "u-tma-late"]
TIME = [("prefix-lm 1", ["flex", "api", "api-two", "tma-plain", "tma-fast"]),
        ("causal s16k 1", _C),
        ("host s2k", ["h-nopfx-plain", "h-tma-plain", "h-tma-fast", "h-tma-late"]),
        ("prefix-lm 2", ["flex", "tma-fast", "tma-plain", "api-two", "api"]),
        ("causal s16k 2", _C[3:] + _C[:3]),
        ("causal s16k 3", _C[::-1])]


def phase_time() -> None:
    import torch

    from fagen.bench.mods import _visible_pairs
    from fagen.bench.timing import measure

    t_end = float(os.environ.get("S11_TIME_END", time.time() + 60))
    shape = s9.shape_of()
    _, mm = s9.row_mods(PL, shape)
    flops = {8192: 2.5 * 4.0 * 128 * _visible_pairs(s9.fagen_mask(mm, shape), mm, shape),
             16384: 2.5 * 4.0 * 128 * 16 * 16384 * 16385 / 2, 2048: 2.5 * 4.0 * 128 * 16 * 2048 * 2049 / 2}
    inputs = {}
    kept = {}
    for row, items in TIME:
        for item in items:
            rec = {"row": row, "variant": item}
            if time.time() > t_end:
                rec["error"] = "skipped: out of time"
                print("REC " + json.dumps(rec), flush=True)
                continue
            try:
                seq = shape_seq(item)
                if seq not in inputs:  # kept: each size's inputs made once (CPU randn, seconds at s16k)
                    inputs[seq] = bench_inputs(seq)
                step = variant_step(item, inputs[seq])
                got = step()
                if item in ("c-nopfx-plain", "c-tma-fast", "c-tma-late") and row.endswith(" 1"):
                    kept[item] = [g.clone() for g in got]
                rec["ms"] = measure(lambda i: step(), 1, torch.device("cuda"), 10.0, 50.0 if seq == 16384 else 25.0)
                rec["tflops"] = flops[seq] / rec["ms"] / 1e9
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(20):  # issued without a sync: the host's own time per call
                    step()
                rec["host_ms"] = (time.perf_counter() - t0) * 50.0
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(50 if seq < 16384 else 0):  # back to back, then one sync: what a loop of calls sees
                    step()
                torch.cuda.synchronize()
                rec["loop_ms"] = (time.perf_counter() - t0) * 20.0
                if seq == 8192 and row.endswith(" 1"):
                    try:
                        rec["kernel_ms"], rec["top"] = kernel_ms(step)
                    except Exception as e:  # noqa: BLE001 - the timing stands without it
                        rec["top"] = f"profiler: {type(e).__name__}"
            except Exception as e:  # noqa: BLE001 - a row of the table
                rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            print("REC " + json.dumps(rec), flush=True)
        if len(kept) == 3:
            a, b, c = kept.values()
            ok = same(a, b) and same(a, c)
            print(f"CHECK {'PASS' if ok else 'FAIL'} causal s16k: tma-fast and tma-late (P = 0) bitwise "
                  f"nopfx-plain's: {same(a, b)} {same(a, c)}", flush=True)
            kept.clear()


def dry() -> None:
    for name in LEVERS:
        mod = module(name)
        print(name, {k: getattr(mod, k) for k in ("BWD_PREFIX", "BWD_PREFIX_MODE", "BWD_DET_MODE", "BWD_FIXED_TMA",
                                                   "BWD_FIXED_FAST", "_BWD_FAST_FIXED")})
    for hd, g in ((64, 1), (128, 2)):
        mod = module("default", "causal", hd, g)
        print(f"default d{hd} gqa {g}", mod.BWD_DET_MODE, mod.BWD_FIXED_TMA, mod.BWD_FIXED_FAST)


def main() -> None:
    from _phases import child_env, run_phase

    t0 = time.time()
    env = child_env("/tmp/fagen-s11-pfxtma", ROOT)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    script = os.path.abspath(__file__)
    lines: dict[str, list] = {}

    def go(name, limit, extra=()):
        rc, got = run_phase(script, name, limit, env, on_line=lambda s: print(s, end="", flush=True), extra=extra)
        lines.setdefault(name, []).extend(got)
        if rc != 0:
            print(f"phase {name} {extra}: {rc}", flush=True)

    threads = [threading.Thread(target=go, args=("warm", 38.0, (w, ))) for w in WARM]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    left = BUDGET - (time.time() - t0)
    env["S11_TIME_END"] = str(time.time() + left - 4)
    print(f"compiled in {time.time() - t0:.0f} s; timing for {left:.0f} s", flush=True)
    go("time", max(5.0, left))
    recs = [json.loads(s[4:]) for s in lines.get("time", []) if s.startswith("REC ")]
    flex = {}
    print("\n| row | variant | ms | TF/s | x Flex | host ms | loop ms | kernels ms | top kernels |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for r in recs:
        if r.get("error"):
            print(f"| {r['row']} | {r['variant']} | - | - | {r['error'][:90]} | | | | |")
            continue
        if r["variant"] == "flex":
            flex[r["row"]] = r["ms"]
        x = f"{flex[r['row']] / r['ms']:.2f}x" if flex.get(r["row"]) else ""
        print(f"| {r['row']} | {r['variant']} | {r['ms']:.3f} | {r['tflops']:.0f} | {x} | {r['host_ms']:.3f} | "
              f"{r['loop_ms']:.3f} | {r.get('kernel_ms', 0):.3f} | {r.get('top', '')} |")
    by = {}
    for r in recs:
        if not r.get("error"):
            by.setdefault((r["row"].rstrip(" 0123456789"), r["variant"]), []).append(r["ms"])
    print("\n| row | variant | passes | median ms | TF/s | ms of each pass |\n|---|---|---:|---:|---:|---|")
    for (row, variant), ms in by.items():
        med = sorted(ms)[len(ms) // 2]
        tf = next(r["tflops"] * r["ms"] for r in recs if r["variant"] == variant and not r.get("error")) / med
        print(f"| {row} | {variant} | {len(ms)} | {med:.3f} | {tf:.0f} | {' / '.join(f'{x:.3f}' for x in ms)} |")
    for s in [x for got in lines.values() for x in got if x.startswith("CHECK ")]:
        print(s[6:], end="")
    print(f"total {time.time() - t0:.0f} s")
    if os.environ.get("OUTX"):
        os.makedirs(os.environ["OUTX"], exist_ok=True)
        with open(os.path.join(os.environ["OUTX"], "pfxtma_s11.json"), "w") as f:
            json.dump({"records": recs, "lines": lines}, f, indent=1)


if __name__ == "__main__":
    if DRY:
        dry()
    elif "--phase" in sys.argv:
        name = sys.argv[sys.argv.index("--phase") + 1]
        if name == "time":
            phase_time()
        else:
            phase_warm(sys.argv[-1])
    else:
        main()
