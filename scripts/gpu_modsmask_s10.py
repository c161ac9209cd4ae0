"""Issue 26, tenth session: the backward of the mods bench's mask rows (sliding-window+causal, prefix-LM) against
FlexAttention's (docs/mods.md, "The mask rows' backward (tenth session)").

    PYTHONPATH=$PWD python3 scripts/gpu_modsmask_s10.py [--round b] [--rows a,b]

Round b (VARIANTS_B, WARM_B): the product after the prefix flip through fagen.attention (checks: prefix P 83 / 300
in one launch, counted, beside a softcap and at GQA 4/2 in two calls, float64 and bitwise repeats; the plain causal
path bitwise the bwd_prefix 0 render's), timed against the two calls, the one launch with the chain, the render
before the flip; the window's variants with host_ms, the host's own time per call (10 calls issued, no sync).

Phases (scripts/_phases.py; the "warm" ones at once, then "time"):
  warm   (WARM) each (row, variant) of a group of variants sharing modules once at the bench shape (B1 H16 S8192),
         then in the same child (the kernels compiled once) its checks: float64 (the user's own functions) at B1 H2
         S333 d128 bf16 of the window's Gluon module on the fast host path ([Note] Switches on the fast backward
         path) in each dQ mode at windows (37, 0) and (130, 0); the prefix split over Gluon modules, two calls and
         one ([Note] Prefix rows in one backward; P 83, 128, 300: inside, on and across a key block's edge), the
         bwd_prefix render's plain causal path against the default render bit for bit; bitwise repeats of every
         deterministic one.
  time   per row Flex, then each variant: backward ms (autograd.grad of a kept output, do_bench median) and TF/s
         (2.5 * 4 * D per visible pair), and the kernels' own time per call from torch.profiler (sum of the device
         kernels of 3 calls / 3) with the three largest kernels named: host-bound rows show a gap.
Window variants: api (what fagen.attention runs: the Triton backward); g-<mode>[-fast][-g1]: the window switch's
Gluon bwd module (causal, window (1024, 0)), mode desc (the chain over descending query blocks), unord
(deterministic=False), fixed (fixed-point dQ, bwd_window_fixed 1); -fast: _BWD_FAST_SWITCHES on; -g1: one program
per tile. Prefix variants: api; gg / gfixed: the split's _Prefix over two Gluon modules (none, causal), the default
render / the fixed-point render (bwd_fixed 1); one / one-fixed: the same with the backward in one launch of the
causal module rendered with bwd_prefix 1. Row causal: the plain causal backward (module.attention) of the default
render and of the bwd_prefix render (P = 0).
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
import gpu_mods_bwd_s9 as s9  # noqa: E402  (window_module, lever_source, reference, flex_call, row_mods, ...)

WINDOW = (1024, 0)
P_BENCH = 2048
BUDGET = 88.0
VARIANTS = {"sliding-window+causal": ["flex", "api", "g-desc-fast", "g-unord-fast", "g-fixed", "g-fixed-fast",
                                      "g-fixed-fast-g1"],
            "prefix-lm": ["flex", "api", "gg", "gfixed", "one", "one-fixed"],
            "causal": ["plain", "pfx"]}  # the plain causal backward: the default render, the bwd_prefix one (P = 0)


SW, PL = "sliding-window+causal", "prefix-lm"
# warm phases: (row, variant) items sharing modules, and the check groups (phase_check) run after them in the same
# child, on the kernels it compiled
WARM = [([[SW, "flex"]], []), ([[PL, "flex"]], []), ([[SW, "api"], [PL, "api"]], []), ([[SW, "g-desc-fast"]], [2]),
        ([[SW, "g-unord-fast"]], [1]), ([[SW, "g-fixed"], [SW, "g-fixed-fast"], [SW, "g-fixed-fast-g1"]], [0]),
        ([[PL, "gg"], ["causal", "plain"]], [3]), ([[PL, "gfixed"]], []), ([[PL, "one"], ["causal", "pfx"]], [4]),
        ([[PL, "one-fixed"]], [5])]


# round B (--round b): the product after the prefix flip (bwd_prefix 2, PREFIX_ONE_BWD), against what it replaced,
# and the window's host time beside its kernels' (host_ms: 10 calls issued without a sync)
VARIANTS_B = {SW: ["flex", "api", "g-unord-fast", "g-desc-fast", "g-fixed-fast"],
              PL: ["flex", "api", "api-two", "one-chain"],
              "causal": ["api", "prev", "fixed"]}
WARM_B = [([[SW, "flex"]], []), ([[PL, "flex"]], []), ([[SW, "api"]], []), ([[SW, "g-unord-fast"]], []),
          ([[SW, "g-desc-fast"]], []), ([[SW, "g-fixed-fast"]], []), ([[PL, "api"], [PL, "api-two"]], []),
          ([], [10]), ([], [12]), ([[PL, "one-chain"]], []),
          ([["causal", "api"], ["causal", "prev"], ["causal", "fixed"]], [11])]
ROUND_B = os.environ.get("S10_ROUND") == "b" or sys.argv[1:3] == ["--round", "b"]  # the parent reads argv
if ROUND_B:
    VARIANTS, WARM = VARIANTS_B, WARM_B


def plan() -> dict:
    rows = [r for r in os.environ.get("S10_ROWS", "").split(",") if r] or list(VARIANTS)
    return {r: VARIANTS[r] for r in rows}


def gluon_window(mode: str, fast: bool, g1: bool):
    """(q, k, v, window) -> out of the window switch's Gluon bwd module in a dQ mode."""
    module = s9.window_module(mode == "desc", mode == "fixed")
    det = mode != "unord"

    def call(q, k, v, w=WINDOW):  # the flags set per call: variants share a module
        module._BWD_FAST_SWITCHES = fast
        module._NUM_SMS.clear()
        if g1:  # one program per tile (the grid is min(tiles, SMs))
            module._NUM_SMS.update({i: 1 << 30 for i in range(8)})
        return module.attention(q, k, v, window=w, deterministic=det)
    return call


def prefix_modules(fixed: bool, one: bool = False):
    """(none, causal) Gluon bwd modules; fixed: the fixed-point renders (bwd_fixed 1); one: the causal one with
    variant bwd_prefix 1 ([Note] Prefix rows in the backward)."""
    import fagen
    from fagen.runtime.loader import load_source
    from fagen.spec.kernel import KernelSpec

    mods = []
    for mask in ("none", "causal"):
        spec = KernelSpec(backend="gluon", direction="bwd", head_dim=128, dtype="bf16", mask=mask)
        lever = {"bwd_fixed": 1} if fixed else {}
        if one and mask == "causal":
            lever["bwd_prefix"] = 1
        if lever:
            src = s9.lever_source(spec, lever)
            assert ("BWD_DET_MODE = 2" in src) == fixed, "bwd_fixed did not render"
            assert ("BWD_PREFIX = 1" in src) == ("bwd_prefix" in lever), "bwd_prefix did not render"
            mods.append(load_source(src, spec.name + "_fixed" * fixed + "_prefix" * ("bwd_prefix" in lever)))
        else:
            mods.append(fagen.load(spec))
    return tuple(mods)


def gluon_prefix(fixed: bool, one: bool = False):
    """The split's _Prefix over Gluon modules; one: its backward in one launch (PREFIX_ONE_BWD)."""
    from fagen.mods import split

    mods = prefix_modules(fixed, one)

    def call(q, k, v, p=P_BENCH):
        split.PREFIX_ONE_BWD = one  # read by the forward
        return split._Prefix.apply(q, k, v, p, mods, {})
    return call


def causal_mode2():
    """(q, k, v) -> out whose backward is the default causal Gluon module's fixed-point mode (BWD_PREFIX_MODE 2)
    with prefix 0, through split._one_backward: the plain causal mask's gradients, deterministic."""
    import torch

    import fagen
    from fagen.mods import split
    from fagen.spec.kernel import KernelSpec

    module = fagen.load(KernelSpec(backend="gluon", direction="bwd", head_dim=128, dtype="bf16", mask="causal"))
    assert module.BWD_PREFIX_MODE == 2

    class Mode2(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = module.forward(q, k, v)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, do):
            return split._one_backward(module, do, *ctx.saved_tensors, 0, {})[:3]
    return Mode2.apply


def prev_causal():
    """The plain causal Gluon bwd module as rendered before the prefix flip (bwd_prefix 0)."""
    from fagen.runtime.loader import load_source
    from fagen.spec.kernel import KernelSpec

    spec = KernelSpec(backend="gluon", direction="bwd", head_dim=128, dtype="bf16", mask="causal")
    src = s9.lever_source(spec, {"bwd_prefix": 0})
    assert "BWD_PREFIX = 0" in src
    return load_source(src, spec.name + "_noprefix")


def caller(row: str, variant: str, sm, mm, bm):
    import fagen

    if ROUND_B and row == "causal":
        if variant == "fixed":  # the default module's mode 2 (bwd_prefix 2) with P = 0: the plain causal mask
            return causal_mode2()
        if variant == "prev":
            module = prev_causal()
            return lambda q, k, v: module.attention(q, k, v)
        s9.selection(True)
        return lambda q, k, v: fagen.attention(q, k, v, mask="causal")
    if ROUND_B and row == PL and variant == "one-chain":
        return gluon_prefix(False, True)
    if ROUND_B and row == PL and variant in ("api", "api-two"):
        from fagen.mods import split

        s9.selection(True)

        def call(q, k, v):
            split.PREFIX_ONE_BWD = variant == "api"  # read by the forward
            return fagen.attention(q, k, v, score_mod=sm, mask_mod=mm, block_mask=bm)
        return call
    if row.startswith("sliding") and variant.startswith("g-"):
        parts = variant.split("-")
        return gluon_window(parts[1], "fast" in parts, "g1" in parts)
    if row == "causal":  # the module's public path: the bwd_prefix render passes P = 0
        module = prefix_modules(False, variant == "pfx")[1]
        return lambda q, k, v: module.attention(q, k, v)
    if row == "prefix-lm" and variant in ("gg", "gfixed", "one", "one-fixed"):
        return gluon_prefix(variant.endswith("fixed"), variant.startswith("one"))
    s9.selection(True)
    return lambda q, k, v: fagen.attention(q, k, v, score_mod=sm, mask_mod=mm, block_mask=bm)


def row_mods(row, shape):
    return (None, None) if row == "causal" else s9.row_mods(row, shape)


def row_flops(row, bm, mm, shape):
    from fagen.bench.mods import _visible_pairs

    if row == "causal":
        return 2.5 * 4.0 * shape.head_dim * shape.batch * shape.heads * shape.seq * (shape.seq + 1) / 2
    return 2.5 * 4.0 * shape.head_dim * _visible_pairs(bm, mm, shape)


def phase_warm(items: list) -> None:
    import torch

    from fagen.bench.mods import _inputs

    shape = s9.shape_of()
    q, k, v, do = _inputs(shape, "cuda", True)
    for row, variant in items:
        t0 = time.perf_counter()
        try:
            sm, mm = row_mods(row, shape)
            att = s9.flex_call(sm, mm, shape) if variant == "flex" else caller(row, variant, sm, mm,
                                                                                 s9.fagen_mask(mm, shape))
            torch.autograd.grad(att(q, k, v), (q, k, v), do)
            torch.cuda.synchronize()
            print(f"warm {row} {variant}: {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - the time phase reports it again
            print(f"warm {row} {variant}: {type(e).__name__}: {str(e)[:160]}", flush=True)


def phase_check(group: int) -> None:
    import torch

    from fagen.spec.axes import DType
    from fagen.verify.tolerances import compare_grad

    H, S, D = 2, 333, 128
    g = torch.Generator().manual_seed(10)
    q, k, v, do = (torch.randn(1, H, S, D, generator=g).to("cuda", torch.bfloat16) for _ in range(4))

    def win_mask(left):
        return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= left)

    def prefix(b, h, q_idx, kv_idx):
        return (kv_idx < 83) | (q_idx >= kv_idx)

    def prefix128(b, h, q_idx, kv_idx):
        return (kv_idx < 128) | (q_idx >= kv_idx)

    def prefix300(b, h, q_idx, kv_idx):
        return (kv_idx < 300) | (q_idx >= kv_idx)

    def run(name, call, mm, repeat):
        t0 = time.perf_counter()
        try:
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            got = torch.autograd.grad(call(qg, kg, vg), (qg, kg, vg), do)
            ref = s9.reference(None, mm, "none", q, k, v, do)
            errs = [compare_grad(n, a, r, DType.BF16) for n, a, r in zip(("dq", "dk", "dv"), got, ref)]
            note = ""
            if repeat:
                twice = torch.autograd.grad(call(qg, kg, vg), (qg, kg, vg), do)
                assert all(torch.equal(a, b) for a, b in zip(got, twice)), "two runs differ"
                note = "; bitwise repeatable"
            line = f"PASS {name}: max |err| dq {errs[0]:.1e} dk {errs[1]:.1e} dv {errs[2]:.1e}{note}"
        except Exception as e:  # noqa: BLE001 - a line, never the end of the run
            line = f"FAIL {name}: {type(e).__name__}: {str(e)[:200]}"
        print(f"CHECK {line} ({time.perf_counter() - t0:.1f} s)", flush=True)

    def win(mode, fast, g1, left):
        call = gluon_window(mode, fast, g1)
        return (f"window ({left}, 0) {mode}{' fast' if fast else ''}{' g1' if g1 else ''}",
                lambda a, b, x: call(a, b, x, (left, 0)), win_mask(left), mode != "unord")

    chain, one, one_fixed = gluon_prefix(False), gluon_prefix(False, True), gluon_prefix(True, True)
    groups = [  # one group a check phase: each compiles one module's kernels (the warm phases compile at once)
        [win("fixed", True, False, 37), win("fixed", False, False, 37), win("fixed", True, False, 130),
         win("fixed", True, True, 130)],
        [win("unord", True, False, 37), win("unord", True, False, 130)],
        [win("desc", True, False, 37), win("desc", True, False, 130)],
        [("prefix P 83 gluon chain (both calls)", lambda a, b, x: chain(a, b, x, 83), prefix, True)],
        [("prefix P 83 one backward (bwd_prefix)", lambda a, b, x: one(a, b, x, 83), prefix, True),
         ("prefix P 128 one backward (bwd_prefix)", lambda a, b, x: one(a, b, x, 128), prefix128, True)],
        [("prefix P 83 one backward, fixed-point", lambda a, b, x: one_fixed(a, b, x, 83), prefix, True),
         ("prefix P 300 one backward, fixed-point", lambda a, b, x: one_fixed(a, b, x, 300), prefix300, True)],
    ]
    cases = groups[group] if group < 10 else []
    if group in (10, 12):
        check_b_prefix(q, k, v, do, prefix, group == 12)
    if group == 11:
        check_b_causal(q, k, v, do)
    for name, call, mm, rep in cases:
        run(name, call, mm, rep)
    if group == 4:  # the bwd_prefix render's public path (P = 0) against the default causal render: same bits
        t0 = time.perf_counter()
        try:
            grads = []
            for pfx in (False, True):
                module = prefix_modules(False, pfx)[1]
                qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
                grads.append(torch.autograd.grad(module.attention(qg, kg, vg), (qg, kg, vg), do))
            same = all(torch.equal(a, b) for a, b in zip(*grads))
            ref = s9.reference(None, None, "causal", q, k, v, do)
            errs = [compare_grad(n, a, r, DType.BF16) for n, a, r in zip(("dq", "dk", "dv"), grads[1], ref)]
            line = (f"{'PASS' if same else 'FAIL'} causal via the bwd_prefix render (P = 0): bitwise the default "
                    f"render's: {same}; max |err| {max(errs):.1e}")
        except Exception as e:  # noqa: BLE001
            line = f"FAIL causal via the bwd_prefix render: {type(e).__name__}: {str(e)[:200]}"
        print(f"CHECK {line} ({time.perf_counter() - t0:.1f} s)", flush=True)


def check_b_prefix(q, k, v, do, prefix, others):
    """Round B: prefix-LM through fagen.attention (the size floors at 0): one launch (counted) for MHA without a
    softcap; others: the two calls beside a softcap and for GQA; each against float64."""
    import torch

    import fagen
    from fagen.mods import split
    from fagen.runtime import hopper

    hopper.BWD_MIN_WORK = hopper.BWD_WINDOW_MIN_WORK = 0
    s9.selection(True)
    calls = []
    one = split._one_backward

    def counted(*a):
        calls.append(1)
        return one(*a)
    split._one_backward = counted
    split.PREFIX_ONE_BWD = True

    def p300(b, h, q_idx, kv_idx):
        return (kv_idx < 300) | (q_idx >= kv_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(score / 20.0)

    todo = [("P 83 + softcap", prefix, softcap, 0)] if others else [("P 83", prefix, None, 1), ("P 300", p300, None, 1)]
    for name, mm, sm, want in todo:
        calls.clear()
        t0 = time.perf_counter()
        try:
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            got = torch.autograd.grad(fagen.attention(qg, kg, vg, score_mod=sm, mask_mod=mm), (qg, kg, vg), do)
            twice = torch.autograd.grad(fagen.attention(qg, kg, vg, score_mod=sm, mask_mod=mm), (qg, kg, vg), do)
            ref = s9.reference(sm, mm, "none", q, k, v, do)
            from fagen.spec.axes import DType
            from fagen.verify.tolerances import compare_grad
            errs = [compare_grad(n, a, r, DType.BF16) for n, a, r in zip(("dq", "dk", "dv"), got, ref)]
            same = all(torch.equal(a, b) for a, b in zip(got, twice))
            ok = same and len(calls) == 2 * want
            line = (f"{'PASS' if ok else 'FAIL'} api prefix {name}: max |err| dq {errs[0]:.1e} dk {errs[1]:.1e} dv "
                    f"{errs[2]:.1e}; bitwise repeatable {same}; one-launch backwards {len(calls)} of 2")
        except Exception as e:  # noqa: BLE001
            line = f"FAIL api prefix {name}: {type(e).__name__}: {str(e)[:200]}"
        print(f"CHECK {line} ({time.perf_counter() - t0:.1f} s)", flush=True)
    if not others:
        return
    # GQA: 4 query heads on 2 KV heads, the two calls
    t0 = time.perf_counter()
    try:
        calls.clear()
        g = torch.Generator().manual_seed(11)
        qq, dd = (torch.randn(1, 4, 333, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
        kk, vv = (torch.randn(1, 2, 333, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
        qg, kg, vg = (t.clone().requires_grad_() for t in (qq, kk, vv))
        got = torch.autograd.grad(fagen.attention(qg, kg, vg, mask_mod=prefix), (qg, kg, vg), dd)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (qq, kk, vv))
        i, j = torch.arange(333, device="cuda")[:, None], torch.arange(333, device="cuda")[None, :]
        s_ = (q64 @ k64.repeat_interleave(2, 1).transpose(-1, -2)) / 128 ** 0.5
        o = torch.softmax(s_.masked_fill(~((j < 83) | (i >= j)), float("-inf")), -1) @ v64.repeat_interleave(2, 1)
        ref = torch.autograd.grad(o, (q64, k64, v64), dd.double())
        err = max(float((a.double() - r).abs().max()) for a, r in zip(got, ref))
        line = (f"{'PASS' if err < 3e-2 and not calls else 'FAIL'} api prefix GQA 4/2: max |err| {err:.1e}; "
                f"one-launch {len(calls)}")
    except Exception as e:  # noqa: BLE001
        line = f"FAIL api prefix GQA: {type(e).__name__}: {str(e)[:200]}"
    print(f"CHECK {line} ({time.perf_counter() - t0:.1f} s)", flush=True)


def check_b_causal(q, k, v, do):
    """Round B: the plain causal backward through fagen.attention (the bwd_prefix 2 render, P = 0) against the
    render before the flip, bit for bit, and float64."""
    import torch

    import fagen
    from fagen.runtime import hopper
    from fagen.spec.axes import DType
    from fagen.verify.tolerances import compare_grad

    hopper.BWD_MIN_WORK = 0
    s9.selection(True)
    t0 = time.perf_counter()
    try:
        grads = []
        for call in (lambda a, b, c: fagen.attention(a, b, c, mask="causal"), prev_causal().attention):
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            grads.append(torch.autograd.grad(call(qg, kg, vg), (qg, kg, vg), do))
        same = all(torch.equal(a, b) for a, b in zip(*grads))
        ref = s9.reference(None, None, "causal", q, k, v, do)
        errs = [compare_grad(n, a, r, DType.BF16) for n, a, r in zip(("dq", "dk", "dv"), grads[0], ref)]
        line = (f"{'PASS' if same else 'FAIL'} api causal: bitwise the bwd_prefix 0 render's {same}; "
                f"max |err| {max(errs):.1e}")
    except Exception as e:  # noqa: BLE001
        line = f"FAIL api causal: {type(e).__name__}: {str(e)[:200]}"
    print(f"CHECK {line} ({time.perf_counter() - t0:.1f} s)", flush=True)
    t0 = time.perf_counter()
    try:  # the mode-2 path with P = 0: float64 and a bitwise repeat
        call = causal_mode2()
        got = []
        for _ in range(2):
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            got.append(torch.autograd.grad(call(qg, kg, vg), (qg, kg, vg), do))
        same = all(torch.equal(a, b) for a, b in zip(*got))
        ref = s9.reference(None, None, "causal", q, k, v, do)
        errs = [compare_grad(n, a, r, DType.BF16) for n, a, r in zip(("dq", "dk", "dv"), got[0], ref)]
        line = (f"{'PASS' if same else 'FAIL'} causal mode 2 (P = 0): max |err| {max(errs):.1e}; "
                f"bitwise repeatable {same}")
    except Exception as e:  # noqa: BLE001
        line = f"FAIL causal mode 2: {type(e).__name__}: {str(e)[:200]}"
    print(f"CHECK {line} ({time.perf_counter() - t0:.1f} s)", flush=True)


def kernel_ms(fn, n=3):
    """(kernels' ms per call, [(name, ms per call)] of the three largest) from torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    per = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t:
            per[e.key] = per.get(e.key, 0.0) + t / 1e3 / n
    top = sorted(per.items(), key=lambda x: -x[1])[:3]
    return sum(per.values()), [(k[:40], round(v, 3)) for k, v in top]


def phase_time() -> None:
    import torch

    from fagen.bench.mods import _inputs
    from fagen.bench.timing import measure

    shape = s9.shape_of()
    q, k, v, do = _inputs(shape, "cuda", True)
    t_end = float(os.environ.get("S10_TIME_END", time.time() + 60))
    for row, variants in plan().items():
        sm, mm = row_mods(row, shape)
        bm = s9.fagen_mask(mm, shape)
        fl = row_flops(row, bm, mm, shape)
        for variant in variants:
            rec = {"row": row, "variant": variant}
            if time.time() > t_end:
                rec["error"] = "skipped: out of time"
            else:
                try:
                    att = s9.flex_call(sm, mm, shape) if variant == "flex" else caller(row, variant, sm, mm, bm)
                    out = att(q, k, v)
                    step = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
                    step()
                    rec["bwd_ms"] = measure(lambda i: step(), 1, torch.device("cuda"), 10.0, 25.0)
                    rec["tflops"] = fl / rec["bwd_ms"] / 1e9
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(10):  # issued without a sync: the host's own time per call
                        step()
                    rec["host_ms"] = (time.perf_counter() - t0) * 100.0
                    torch.cuda.synchronize()
                    try:
                        rec["kernel_ms"], rec["top"] = kernel_ms(step)
                    except Exception as e:  # noqa: BLE001 - the timing stands without it
                        rec["top"] = f"profiler: {type(e).__name__}: {str(e)[:80]}"
                    del out
                except Exception as e:  # noqa: BLE001 - a row of the table
                    rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            print("REC " + json.dumps(rec), flush=True)


def main() -> None:
    from _phases import child_env, run_phase

    t0 = time.time()
    env = child_env("/tmp/fagen-s10-modsmask", ROOT)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    script = os.path.abspath(__file__)
    lines: dict[str, list] = {}
    argv = dict(zip(sys.argv[1::2], sys.argv[2::2]))
    if argv.get("--round") == "b":
        env["S10_ROUND"] = "b"
    if "--rows" in argv:
        env["S10_ROWS"] = os.environ["S10_ROWS"] = argv["--rows"]
    todo = {(r, x) for r, vs in plan().items() for x in vs}
    groups = [(g, c) for g, c in WARM if c or any(tuple(i) in todo for i in g)]

    def go(name, limit, extra=()):
        rc, got = run_phase(script, name, limit, env, on_line=lambda s: print(s, end="", flush=True), extra=extra)
        lines.setdefault(name, []).extend(got)
        if rc != 0:
            print(f"phase {name}: {rc}", flush=True)

    args = [json.dumps([[x for x in g if tuple(x) in todo], c]) for g, c in groups]
    threads = [threading.Thread(target=go, args=(f"warm{i}", 45.0, (a,))) for i, a in enumerate(args)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    left = BUDGET - (time.time() - t0)
    env["S10_TIME_END"] = str(time.time() + left - 5)
    print(f"compiled in {time.time() - t0:.0f} s; timing for {left:.0f} s", flush=True)
    go("time", max(5.0, left))
    recs = [json.loads(s[4:]) for s in lines.get("time", []) if s.startswith("REC ")]
    flex = {r["row"]: r.get("bwd_ms") for r in recs if r["variant"] == "flex"}
    print("\n| row | variant | bwd ms | bwd TF/s | x Flex | kernels ms | host ms | top kernels |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for r in recs:
        if r.get("error"):
            print(f"| {r['row']} | {r['variant']} | - | - | {r['error'][:90]} | | |")
            continue
        x = f"{flex[r['row']] / r['bwd_ms']:.2f}x" if flex.get(r["row"]) else "-"
        print(f"| {r['row']} | {r['variant']} | {r['bwd_ms']:.3f} | {r['tflops']:.0f} | {x} | "
              f"{r.get('kernel_ms', 0):.3f} | {r.get('host_ms', 0):.3f} | {r.get('top')} |")
    for s in [x for got in lines.values() for x in got if x.startswith("CHECK ")]:
        print(s[6:], end="")
    print(f"total {time.time() - t0:.0f} s")
    if os.environ.get("OUTX"):
        os.makedirs(os.environ["OUTX"], exist_ok=True)
        with open(os.path.join(os.environ["OUTX"], "modsmask_s10.json"), "w") as f:
            json.dump({"records": recs, "lines": lines}, f, indent=1)


if __name__ == "__main__":
    if "--phase" in sys.argv:
        name = sys.argv[sys.argv.index("--phase") + 1]
        if name == "time":
            phase_time()
        else:  # warm its items at the bench shape, then its check groups (the kernels compiled once)
            items, checks = json.loads(sys.argv[-1])
            phase_warm([tuple(x) for x in items])
            for c in checks:
                phase_check(c)
    else:
        main()
