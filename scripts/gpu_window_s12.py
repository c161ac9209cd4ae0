"""Issue 26, twelfth session (helper window): the sliding-window row's backward (attention-gym's
generate_sliding_window(1024) lowered to causal + window (1024, 0), B1 H16 S8192 d128 bf16) on the one fast host path
that now serves the window render and the general fixed-point mode ([Note] The bound kernel in
fagen/templates/host/gluon_bwd_launch.py); docs/mods.md "The window's backward (twelfth session)".

    PYTHONPATH=$PWD python3 scripts/gpu_window_s12.py

Host paths of a mode-2 module (`path`): plain (_run_backward: the torch bound, fn[grid]), tb (the fast path with the
torch bound: the general fast path before this session), bk (the fast path with the bound kernel, _BWD_BOUND_KERNEL:
the product since round A), bl (the bound kernel's loop, _BWD_BOUND_LOOP: [Note] The bound kernel's loop).
Round A (window-A.txt) also timed the bound kernel's fill (bf), removed since; this file is round B's.
Phases (scripts/_phases.py; the warm ones at once, each a child, then `time` in one child):
  warm*  compile the module at the timed shape, then check at B1 H2 (GQA 4/2) S333 bf16 (lengths off the blocks;
         the window's left extents 37 and 130) against float64: every path's gradients, bk and bl twice (bitwise
         repeatable), paths compared bit for bit, row 0's dq exactly 0 (a single key: dS = 0); the product through
         fagen.attention (the window's mask_mod; causal d128 with the bound kernel's launches counted); a mutant
         that must fail: the bound kernel left out (KVB 0); the loop kernel's configurations on the device with a
         NaN in K and in V (+inf expected) against the one-tile kernel.
  time   passes in rotated orders, medians: the window row through fagen.attention (api: bk, api-bl, api-tb,
         api-nondet) against Flex in the same process, backward ms (autograd.grad of a kept output, do_bench
         median, L2 flushed) and the host's own ms a call (20 calls issued without a sync); d128 causal B1 H16
         deterministic at s16k and at S2048 (where the host bounds the call: also ms a call of 50 back to back),
         module.backward of the d128 default, tb / bk / bl, the s16k gradients compared bit for bit; the bound alone
         (one-tile kernel against the loop's configurations); the kernels' own ms (torch.profiler) of the window's.
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
import gpu_mods_bwd_s9 as s9  # noqa: E402  (shape_of, selection, lever_source, flex_call, row_mods, fagen_mask)

BUDGET = 66.0  # seconds of the whole run (the round kills it at 70)
SW = "sliding-window+causal"
WINDOW = (1024, 0)
ROUND_B = os.environ.get("S12_ROUND") == "b" or sys.argv[1:3] == ["--round", "b"]
LEVERS = {"nopfx": {"bwd_prefix_tma": 0}}
_MODS: dict = {}


def module(name: str, head_dim: int = 128, gqa: int = 1):
    """The bf16 causal Gluon bwd module `name`: "window" (the product's window render), "default" (the product's
    render of head_dim / gqa), "nopfx" (the d128 default without the prefix argument)."""
    import fagen
    from fagen.runtime.loader import load_source
    from fagen.spec.kernel import KernelSpec

    key = (name, head_dim, gqa)
    if key not in _MODS:
        spec = KernelSpec(backend="gluon", direction="bwd", head_dim=head_dim, dtype="bf16", mask="causal", gqa=gqa,
                          window=name == "window")
        if name in LEVERS:
            _MODS[key] = load_source(s9.lever_source(spec, LEVERS[name]), f"{spec.name}_{name}_s12")
        else:
            _MODS[key] = fagen.load(spec)
        mod = _MODS[key]
        assert mod.BWD_DET_MODE == 2 and mod.BWD_FIXED_TMA == 1, f"{name}: not a mode-2 render with TMA rows"
    return _MODS[key]


def host(mod, path):
    """mod with its host path set (module docstring's paths); returns mod."""
    mod._BWD_FAST_FIXED = path != "plain"
    mod._BWD_WINDOW_FAST = path != "plain"
    mod._BWD_BOUND_KERNEL = path in ("bk", "bl")
    mod._BWD_BOUND_LOOP = path == "bl"
    return mod


def small(h=2, hkv=None, s=333, d=128, seed=12):
    import torch

    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(1, h, s, d, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, hkv or h, s, d, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    return q, k, v, do


def grads(call, q, k, v, do):
    import torch

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    return [g.clone() for g in torch.autograd.grad(call(qg, kg, vg), (qg, kg, vg), do)]


def ref64(q, k, v, do, visible):
    """float64 dq, dk, dv from the semantics (GQA by repeat), no fagen code."""
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


def diff(a, b):
    """'bitwise' or the largest |difference| (and how many elements differ)."""
    if same(a, b):
        return "bitwise"
    n = sum(int((x != y).sum()) for x, y in zip(a, b))
    return f"max {max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b)):.1e} ({n} elements)"


def check_paths(name, head_dim=128, gqa=1):
    """module(name) at causal (the window's: left 37 and 130): the paths against float64 and each other."""
    import torch

    hq = 4 if gqa > 1 else 2
    q, k, v, do = small(hq, hq // gqa, d=head_dim)
    mod = module(name, head_dim, gqa)
    i, j = torch.arange(333, device="cuda")[:, None], torch.arange(333, device="cuda")[None, :]
    for left in ((37, 130) if name == "window" else (None, )):
        kw = {} if left is None else {"window": (left, 0)}
        vis = (j <= i) if left is None else (j <= i) & (i - j <= left)

        def run(kw=kw, vis=vis):
            runs = {p: grads(lambda a, b, c, p=p: host(mod, p).attention(a, b, c, **kw), q, k, v, do)
                    for p in ("plain", "tb", "bk", "bl")}
            again = {p: grads(lambda a, b, c, p=p: host(mod, p).attention(a, b, c, **kw), q, k, v, do)
                     for p in ("bk", "bl")}
            host(mod, "bk")
            e = {p: max(errs(g, ref64(q, k, v, do, vis))) for p, g in runs.items()}
            rep = same(runs["bk"], again["bk"]) and same(runs["bl"], again["bl"])
            zero = all(bool((g[0][:, :, 0] == 0).all()) for g in runs.values())
            ok = rep and zero and max(e.values()) < 3e-2 and same(runs["plain"], runs["tb"])
            errs_ = " ".join(f"{p} {x:.1e}" for p, x in e.items())
            return ok, (f"max |err| {errs_}; repeatable {rep}; row 0 dq == 0 {zero}; tb vs plain "
                        f"{diff(runs['tb'], runs['plain'])}; bk vs tb {diff(runs['bk'], runs['tb'])}; bl vs bk "
                        f"{diff(runs['bl'], runs['bk'])}")
        check(f"{name} d{head_dim} gqa {gqa}{'' if left is None else f' window ({left}, 0)'}", run)


def check_mutants():
    """The window module's mutant, must fail float64: the bound kernel left out (bk: KVB stays 0, the units
    overflow)."""
    import torch

    q, k, v, do = small()
    mod = module("window")
    i, j = torch.arange(333, device="cuda")[:, None], torch.arange(333, device="cuda")[None, :]
    ref = ref64(q, k, v, do, (j <= i) & (i - j <= 130))

    def caught(path):
        def run():
            for _ in range(2):
                got = grads(lambda a, b, c: host(mod, path).attention(a, b, c, window=(130, 0)), q, k, v, do)
            try:
                e = errs(got, ref)
            except AssertionError as ex:
                return True, f"caught ({str(ex).splitlines()[0][:100]})"
            return False, f"passed float64 (err {max(e):.1e})"
        return run

    real_bound = mod._fast_kv_bound
    mod._fast_kv_bound = type("NoBound", (), {"__getitem__": lambda self, grid: (lambda *a, **kw: None)})()
    check("mutant: no bound kernel", caught("bk"))
    mod._fast_kv_bound = real_bound
    host(mod, "bk")


def check_product():
    """fagen.attention at causal (the d128 default, floors at 0): float64, bitwise repeat, the bound kernel's
    launches counted (the flipped _BWD_BOUND_KERNEL)."""
    import torch

    import fagen
    from fagen.runtime import hopper

    hopper.BWD_MIN_WORK = 0
    s9.selection(True)
    q, k, v, do = small()
    mod = module("default")
    i, j = torch.arange(333, device="cuda")[:, None], torch.arange(333, device="cuda")[None, :]
    launched, real = [], mod._fast_kv_bound
    default = mod._BWD_BOUND_KERNEL is True and getattr(mod, "_BWD_BOUND_LOOP", False) is False  # before any host() call

    class Counted:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    def run():
        mod._fast_kv_bound = Counted()
        try:
            runs = [grads(lambda a, b, c: fagen.attention(a, b, c, mask="causal"), q, k, v, do) for _ in "ab"]
        finally:
            mod._fast_kv_bound = real
        e = max(errs(runs[0], ref64(q, k, v, do, j <= i)))
        zero = bool((runs[0][0][:, :, 0] == 0).all())
        return (same(*runs) and e < 3e-2 and zero and len(launched) == 2 and default,
                f"max |err| {e:.1e}; repeatable {same(*runs)}; row 0 dq == 0 {zero}; bound kernel launches "
                f"{len(launched)} of 2")
    check("product causal d128 (fagen.attention)", run)


def check_api():
    """fagen.attention with the window's mask_mod (floors at 0): float64 in both modes, bitwise repeat, the fast
    path's calls counted (mode 2 with the bound kernel, and with its loop)."""
    import torch

    import fagen
    from fagen.runtime import hopper

    hopper.BWD_MIN_WORK = hopper.BWD_WINDOW_MIN_WORK = 0
    s9.selection(True)
    q, k, v, do = small()
    mod = module("window")
    i, j = torch.arange(333, device="cuda")[:, None], torch.arange(333, device="cuda")[None, :]
    taken, real = [], mod._run_backward_fast
    mod._run_backward_fast = lambda *a, **kw: (taken.append(a[10]), real(*a, **kw))[1]

    def run():
        mm = lambda b, h, qi, ki: (qi >= ki) & (qi - ki <= 130)  # noqa: E731
        ref = ref64(q, k, v, do, (j <= i) & (i - j <= 130))
        out = {}
        for path in ("bk", "bl"):
            host(mod, path)
            runs = [grads(lambda a, b, c: fagen.attention(a, b, c, mask_mod=mm), q, k, v, do) for _ in "ab"]
            out[path] = (max(errs(runs[0], ref)), same(*runs), runs[0])
        nd = grads(lambda a, b, c: fagen.attention(a, b, c, mask_mod=mm, deterministic=False), q, k, v, do)
        host(mod, "bk")
        ok = all(r for _, r, _ in out.values()) and max(e for e, _, _ in out.values()) < 3e-2 \
            and taken == [2, 2, 2, 2, 1] and max(errs(nd, ref)) < 3e-2
        return ok, (f"bk err {out['bk'][0]:.1e} bl err {out['bl'][0]:.1e}; repeatable {out['bk'][1]} {out['bl'][1]}; "
                    f"bl vs bk {diff(out['bk'][2], out['bl'][2])}; fast-path modes {taken}")
    check("api window (130, 0) (fagen.attention)", run)
    mod._run_backward_fast = real


WARM = {"flex": ["flex"], "window": ["window", "api", "mutants"], "bound": ["bound"], "default": ["default"],
        "nopfx": ["nopfx"], "d64": ["d64"], "gqa": ["gqa"]}


def window_inputs():
    from fagen.bench.mods import _inputs

    return _inputs(s9.shape_of(), "cuda", True)


def big_inputs(seq=16384):
    import torch

    g = torch.Generator("cuda").manual_seed(0)
    return [torch.randn(1, 16, seq, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(4)]


def window_step(variant, tensors):
    """A zero-argument backward of a window-row variant on (q, k, v, do) (autograd.grad of a kept output)."""
    import torch

    import fagen

    q, k, v, do = tensors
    shape = s9.shape_of()
    sm, mm = s9.row_mods(SW, shape)
    mod = module("window")
    if variant == "flex":
        att = s9.flex_call(sm, mm, shape)
    elif variant == "mod":
        att = lambda a, b, c: host(mod, "bk").attention(a, b, c, window=WINDOW)  # noqa: E731
    else:
        path = {"api": "bk", "api-bl": "bl", "api-tb": "tb", "api-nondet": "bk"}[variant]
        bm = s9.fagen_mask(mm, shape)
        s9.selection(True)
        det = variant != "api-nondet"

        def att(a, b, c):
            host(mod, path)
            return fagen.attention(a, b, c, mask_mod=mm, block_mask=bm, deterministic=det)
    out = att(q, k, v)
    path = {"api-bl": "bl", "api-tb": "tb"}.get(variant, "bk")

    def step():
        host(mod, path)
        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    return step


def causal_step(path, tensors):
    mod = module("default")
    q, k, v, do = tensors
    out, lse = mod.forward(q, k, v)

    def step():
        return host(mod, path).backward(do, q, k, v, out, lse)
    return step


def phase_warm(name: str) -> None:
    import torch

    for item in WARM[name]:
        t0 = time.perf_counter()
        try:
            if item in ("flex", "window"):
                window_step("flex" if item == "flex" else "api", window_inputs())()
            elif item == "api":
                check_api()
            elif item == "mutants":
                check_mutants()
            elif item == "bound":
                print(f"warm bound: {bound_alone(*(t.detach() for t in window_inputs()[1:3]), time_it=False)}",
                      flush=True)
            elif item == "default":
                check_product()  # first: the module's own defaults (host() sets them below)
                causal_step("bl", big_inputs(2048))()
                causal_step("bk", big_inputs(2048))()
            torch.cuda.synchronize()
            print(f"warm {item}: {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - the time phase reports it again
            print(f"warm {item}: {type(e).__name__}: {str(e)[:160]}", flush=True)
        if item in ("window", "default", "nopfx"):
            check_paths(item)
        elif item == "d64":
            check_paths("default", 64, 1)
        elif item == "gqa":
            check_paths("default", 128, 2)


def kernel_ms(fn, n=3):
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
    top = sorted(per.items(), key=lambda x: -x[1])[:5]
    return sum(per.values()), [(k[:24], round(v, 3)) for k, v in top]


_W = ["flex", "api", "api-bl", "api-tb", "api-nondet"]
_C = ["c-tb", "c-bk", "c-bl"]
_H = ["h-tb", "h-bk", "h-bl"]


def passes():
    """[(group, variants)] in rotated orders."""
    out = []
    for p in range(4):
        out.append(("window", _W[p:] + _W[:p]))
        out.append(("s16k", _C[p % 3:] + _C[:p % 3]))
        out.append(("s2k", _H[p % 3:] + _H[:p % 3]))
    return out


LOOP_CONFIGS = [(32, 32, 4), (16, 32, 4), (64, 32, 4), (32, 64, 4), (32, 16, 2), (8, 32, 4), (32, 32, 8)]
# (programs a KV head, rows a tile, warps) of the bound kernel's loop


def bound_alone(k, v, time_it=True):
    """{name: ms} of the bound at the window row's K, V: the one-tile kernel (the product's, 64 x 4) and the loop's
    configurations, each checked: max|K| bit for bit, the V norms to 1e-6 and whether bit for bit, and with a NaN in
    K (head 0) and in V (the last head): +inf there, finite elsewhere. time_it=False: compile and check only."""
    import torch
    import triton.testing

    mod = module("window")
    b, h, sk, d = k.shape
    kvb = torch.zeros(2 * b * h, device="cuda")

    def rows(kk, vv, out):
        out.zero_()
        mod._bwd_kv_bound_rows[(-(-sk // 64), b * h)](kk, vv, out, sk, HEAD_DIM=d, BLOCK=64, num_warps=4)

    def loop(parts, block, warps, kk, vv, out):
        chunk = -(-(-(-sk // parts)) // block) * block
        out.zero_()
        mod._bwd_kv_bound_loop[(-(-sk // chunk), b * h)](kk, vv, out, sk, chunk, HEAD_DIM=d, BLOCK=block,
                                                         num_warps=warps)

    kn, vn = k.clone(), v.clone()
    kn[0, 0, 5, 3], vn[-1, -1, sk - 7, 1] = float("nan"), float("nan")
    rows(k, v, kvb)
    res = {}
    runs = [("one tile 64x4", lambda: rows(k, v, kvb))]
    for parts, block, warps in LOOP_CONFIGS:
        got, nan = torch.zeros_like(kvb), torch.zeros_like(kvb)
        loop(parts, block, warps, k, v, got)
        loop(parts, block, warps, kn, vn, nan)
        torch.cuda.synchronize()
        g, n = got.view(-1, 2), nan.view(-1, 2)
        ok = bool(torch.equal(g[:, 0], kvb.view(-1, 2)[:, 0])) and float(
            ((g[:, 1] - kvb.view(-1, 2)[:, 1]).abs() / kvb.view(-1, 2)[:, 1]).max()) < 1e-6
        nan_ok = bool(n[0, 0] == float("inf") and n[-1, 1] == float("inf") and torch.isfinite(n[1:, 0]).all()
                      and torch.isfinite(n[:-1, 1]).all())
        name = f"loop {parts}x{block}w{warps}"
        res[name + " ok"] = (ok, "bitwise" if torch.equal(g, kvb.view(-1, 2)) else "norms within 1e-6", nan_ok)
        runs.append((name, lambda p=parts, bl=block, w=warps, o=got: loop(p, bl, w, k, v, o)))
    if time_it:
        for name, fn in runs:
            res[name] = round(float(triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")), 4)
    return res


def phase_time() -> None:
    import torch

    from fagen.bench.mods import _visible_pairs
    from fagen.bench.timing import measure

    t_end = float(os.environ.get("S12_TIME_END", time.time() + 60))
    shape = s9.shape_of()
    _, mm = s9.row_mods(SW, shape)
    flops = {"window": 2.5 * 4.0 * 128 * _visible_pairs(s9.fagen_mask(mm, shape), mm, shape),
             "s16k": 2.5 * 4.0 * 128 * 16 * 16384 * 16385 / 2, "s2k": 2.5 * 4.0 * 128 * 16 * 2048 * 2049 / 2}
    tensors = {"window": window_inputs(), "s16k": big_inputs(), "s2k": big_inputs(2048)}
    steps, kept = {}, {}
    for group, items in passes():
        for item in items:
            rec = {"row": group, "variant": item}
            if time.time() > t_end:
                rec["error"] = "skipped: out of time"
                print("REC " + json.dumps(rec), flush=True)
                continue
            try:
                if item not in steps:
                    steps[item] = (window_step(item, tensors[group]) if group == "window"
                                   else causal_step(item[2:], tensors[group]))
                step = steps[item]
                got = step()
                if group == "s16k" and item not in kept:
                    kept[item] = [g.clone() for g in got]
                rec["ms"] = measure(lambda i: step(), 1, torch.device("cuda"), 10.0, 40.0 if group == "s16k" else 25.0)
                rec["tflops"] = flops[group] / rec["ms"] / 1e9
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(20):  # issued without a sync: the host's own time per call
                    step()
                rec["host_ms"] = (time.perf_counter() - t0) * 50.0
                torch.cuda.synchronize()
                if group == "s2k":  # back to back, then one sync: what a loop of calls sees
                    t0 = time.perf_counter()
                    for _ in range(50):
                        step()
                    torch.cuda.synchronize()
                    rec["loop_ms"] = (time.perf_counter() - t0) * 20.0
            except Exception as e:  # noqa: BLE001 - a row of the table
                rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            print("REC " + json.dumps(rec), flush=True)
        if len(kept) == 3:
            a, b, c = (kept[x] for x in _C)
            print(f"CHECK INFO s16k causal d128 (the first pass's gradients): bk vs tb {diff(b, a)}; bl vs bk "
                  f"{diff(c, b)}", flush=True)
            kept["done"] = True
    if time.time() < t_end:
        try:
            q, k, v, _ = tensors["window"]
            print("REC " + json.dumps({"row": "bound", "variant": "alone", "bound": bound_alone(k.detach(),
                                                                                                 v.detach())}),
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print("REC " + json.dumps({"row": "bound", "variant": "alone", "error": f"{type(e).__name__}: {e}"[:160]}))
    for item in ["api", "api-bl", "api-tb", "flex"]:
        if time.time() > t_end or item not in steps:
            continue
        try:
            ms, top = kernel_ms(steps[item])
            print("REC " + json.dumps({"row": "kernels", "variant": item, "kernel_ms": ms, "top": top}), flush=True)
        except Exception as e:  # noqa: BLE001
            print("REC " + json.dumps({"row": "kernels", "variant": item, "error": f"{type(e).__name__}"}))


def main() -> None:
    from _phases import child_env, run_phase

    t0 = time.time()
    env = child_env("/tmp/fagen-s12-window", ROOT)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    if ROUND_B:
        env["S12_ROUND"] = "b"
    script = os.path.abspath(__file__)
    lines: dict[str, list] = {}

    def go(name, limit, extra=()):
        rc, got = run_phase(script, name, limit, env, on_line=lambda s: print(s, end="", flush=True), extra=extra)
        lines.setdefault(name + "".join(extra), []).extend(got)
        if rc != 0:
            print(f"phase {name} {extra}: {rc}", flush=True)

    threads = [threading.Thread(target=go, args=("warm", 33.0, (w, ))) for w in WARM]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    left = BUDGET - (time.time() - t0)
    env["S12_TIME_END"] = str(time.time() + left - 5)
    print(f"compiled in {time.time() - t0:.0f} s; timing for {left:.0f} s", flush=True)
    go("time", max(5.0, left))
    recs = [json.loads(s[4:]) for s in lines.get("time", []) if s.startswith("REC ")]
    summary(recs)
    for s in [x for got in lines.values() for x in got if x.startswith("CHECK ")]:
        print(s[6:], end="")
    print(f"total {time.time() - t0:.0f} s")
    if os.environ.get("OUTX"):
        os.makedirs(os.environ["OUTX"], exist_ok=True)
        with open(os.path.join(os.environ["OUTX"], "window_s12.json"), "w") as f:
            json.dump({"records": recs, "lines": lines}, f, indent=1)


def summary(recs) -> None:
    by, host_ms, tf, loops = {}, {}, {}, {}
    for r in recs:
        if r.get("error"):
            print(f"ERROR {r['row']} {r['variant']}: {r['error']}")
        elif "ms" in r:
            by.setdefault((r["row"], r["variant"]), []).append(r["ms"])
            host_ms.setdefault((r["row"], r["variant"]), []).append(r["host_ms"])
            tf[(r["row"], r["variant"])] = r["tflops"] * r["ms"]
            if "loop_ms" in r:
                loops.setdefault((r["row"], r["variant"]), []).append(r["loop_ms"])
    med = {key: sorted(v)[len(v) // 2] for key, v in by.items()}
    flex = med.get(("window", "flex"))
    print("\n| row | variant | median ms | TF/s | x Flex | ms of each pass (run order) | host ms a call (median) | "
          "ms a call, 50 back to back (median) |")
    print("|---|---|---:|---:|---:|---|---:|---:|")
    for key, ms in by.items():
        x = f"{flex / med[key]:.2f}x" if flex and key[0] == "window" else ""
        h = sorted(host_ms[key])[len(host_ms[key]) // 2]
        loop = f"{sorted(loops[key])[len(loops[key]) // 2]:.3f}" if key in loops else ""
        print(f"| {key[0]} | {key[1]} | {med[key]:.3f} | {tf[key] / med[key]:.0f} | {x} | "
              f"{' / '.join(f'{m:.3f}' for m in ms)} | {h:.3f} | {loop} |")
    for r in recs:
        if r["row"] in ("bound", "kernels") and not r.get("error"):
            print(f"{r['row']} {r['variant']}: {r.get('bound') or (round(r['kernel_ms'], 3), r['top'])}")


if __name__ == "__main__":
    if "--phase" in sys.argv:
        name = sys.argv[sys.argv.index("--phase") + 1]
        if name == "time":
            phase_time()
        else:
            phase_warm(sys.argv[-1])
    else:
        main()
