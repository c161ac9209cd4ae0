"""The Gluon forward's persistent tile order (_SCHED 0-3, [Note] Tile schedule) on an H100/H200: correctness at edge
shapes against float64, then TF/s per order beside fagen.attention's pick and SDPA cuDNN, bf16 and fp8, one table.

    PYTHONPATH=$PWD python3 scripts/gpu_fwd_sched.py       # ~90 s on an H100; one table; $OUT/gpu_fwd_sched.md
    GPU_FWD_SCHED_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_fwd_sched.py   # any machine: renders, sm_90 builds

Every variant is the gluon module rendered with the tile schedule (GluonBackend.variant["tile_schedule_all"]) and
`_SCHED = n` patched in: 0 heavy first by batch, 1 paired, 2 a tile counter in global memory (FA3's dynamic
scheduler; the counter is cached per stream and zeroed by the launch's last take, [Note] Tile counter), 3 the counter
over L2 sections of heads. "plain" is the product's render without the schedule (the order before: heavy first by
batch in a for loop); "fagen.attention" is what the product runs for the case (its pick named in the note).

Phases, each in a child process with a timeout (a kernel that faults or hangs costs its phase, not the table):
  build  warm launches of every module in a pool of processes (fills triton's cache: the other phases load them);
  check  each _SCHED at edge shapes against the float64 reference (out and lse): Sq != Sk both ways, odd query-block
         counts, lengths not multiples of 128, GQA, window + softcap, batch > 1 with more tiles than SMs, fp8 (the
         checks of scripts/gpu_fp8.py), each called twice (the counter must be back at 0), and _SCHED 2 under CUDA
         graph replay;
  time   TF/s (do_bench median) of each order for bf16 d128 / d64 causal / full B1 H16 s16k, GQA 32/8 B4 s4k d128,
         fp8 d128 causal / full s16k, SDPA cuDNN bf16 in the same process; each out compared with cuDNN's; fp8 also
         with S's fp32 promotion every 32 / 64 products, with P's keys in order (_P_PERM 0, [Note] fp8 P
         permutation), and with 3 / 2 K/V slots; then the host cost of one small call (B1 H1 s256);
  bench  the standard suite's fp8 rows through fagen's bench (the check against the float64 slices, then TF/s).
fp8 checks also run with 0.1% outliers x10 (the lse failure of the first run), for the render and the S variants.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for _phases
from _phases import child_env, run_phase as run_child  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

DRY = os.environ.get("GPU_FWD_SCHED_DRY") == "1"
# MOCK (a test of this script, not of the kernels): the check and time phases on the CPU with tiny shapes and the
# float64 reference (fp8: gpu_fp8's e4m3 emulation) standing in for every module, so a slip in the phases' code
# shows before the GPU round.
MOCK = os.environ.get("GPU_FWD_SCHED_MOCK") == "1"
DEV = "cpu" if MOCK else "cuda"
SCHEDS = (0, 1, 2, 3)
PHASE_TIMEOUT = {"build": 75, "check": 100, "time": 110, "bench": 100}
T0 = time.time()

# Timed cases: (label, spec fields, B, Hq, Hkv, S)
TIME_CASES = (
    ("d128 causal s16k", dict(head_dim=128, mask="causal", dtype="bf16"), 1, 16, 16, 16384),
    ("d128 full s16k", dict(head_dim=128, mask="none", dtype="bf16"), 1, 16, 16, 16384),
    ("d64 causal s16k", dict(head_dim=64, mask="causal", dtype="bf16"), 1, 16, 16, 16384),
    ("d64 full s16k", dict(head_dim=64, mask="none", dtype="bf16"), 1, 16, 16, 16384),
    ("gqa32/8 causal b4 s4k", dict(head_dim=128, mask="causal", dtype="bf16", gqa=4), 4, 32, 8, 4096),
    ("gqa32/8 full b4 s4k", dict(head_dim=128, mask="none", dtype="bf16", gqa=4), 4, 32, 8, 4096),
    ("fp8 d128 causal s16k", dict(head_dim=128, mask="causal", dtype="fp8_e4m3"), 1, 16, 16, 16384),
    ("fp8 d128 full s16k", dict(head_dim=128, mask="none", dtype="fp8_e4m3"), 1, 16, 16, 16384),
)
# Edge checks (bf16): (label, spec fields, B, Hkv, Sq, Sk, forward kwargs)
EDGE_CASES = (
    ("causal sq1100 sk1537 b2 h3", dict(head_dim=128, mask="causal"), 2, 3, 1100, 1537, {}),
    ("causal sq1537 sk1000 b2 h3", dict(head_dim=128, mask="causal"), 2, 3, 1537, 1000, {}),
    ("causal s1100 b3 h16 (384+ tiles)", dict(head_dim=128, mask="causal"), 3, 16, 1100, 1100, {}),
    ("none d64 gqa4 sq700 sk900 b2", dict(head_dim=64, mask="none", gqa=4), 2, 2, 700, 900, {}),
    ("causal gqa2 window(300,0)+softcap b2 s1300", dict(head_dim=128, mask="causal", gqa=2, window=True,
                                                         softcap=True), 2, 3, 1300, 1300,
     dict(window=(300, 0), softcap=30.0)),
)
# fp8 with outliers (0.1% of entries x10): the lse check the first session's run failed (1.3e-2..3.8e-2 against
# 2e-3). l sums P in fp32 before P's e4m3 rounding, so lse reads only m and l: the P offset cannot move it; the
# scores can (the fp8 wgmma's fast accumulation). Each row: the render, and S with max_num_imprecise_acc in FP8_ACC.
FP8_OUTLIERS = ((128, "none", 1, 1, 4, 4096, 4096, False, None), (128, "causal", 1, 1, 4, 4096, 4096, False, None))
FP8_ACC = (32, )
FP8_STAGES = (3, )  # the fp8 K/V ring beside the default 4 slots (2 slots dropped to keep the run short)
# The standard suite's rows through fagen's bench (check against the float64 slices, then time), fagen and cuDNN.
BENCH_ROWS = ("fwd-d128-full-s16k", "fwd-d128-causal-s16k", "fwd-d64-causal-s16k", "fwd-gqa-d128-causal-s4k",
              "fwd-fp8-d128-causal-s16k", "fwd-fp8-d128-full-s16k")
FP8_EDGES = ((128, "causal", 1, 2, 8, 1100, 1100, False, None), (128, "none", 4, 2, 2, 1000, 1537, True, None))
if MOCK:
    TIME_CASES = tuple((lb, f, 1, hq // b, hkv // b, 256) for lb, f, b, hq, hkv, _ in TIME_CASES)
    EDGE_CASES = tuple((lb, f, 1, 1, sq // 10, sk // 10, kw) for lb, f, _, _, sq, sk, kw in EDGE_CASES)
    FP8_EDGES = tuple((d, m, g, 1, 1, 110, 150, ph, w) for d, m, g, _, _, _, _, ph, w in FP8_EDGES)
    FP8_OUTLIERS = tuple((d, m, g, 1, 1, 256, 256, ph, w) for d, m, g, _, _, _, _, ph, w in FP8_OUTLIERS)


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def emit(**row):
    """A table row, passed from a child phase to the parent on stdout."""
    print("ROW\t" + json.dumps(row), flush=True)


# -- modules ---------------------------------------------------------------------------------------------------
def spec_of(fields):
    import fagen
    return fagen.KernelSpec(backend="gluon", **{"dtype": "bf16", **fields})


class _StandIn:
    """MOCK: a module whose forward is the float64 reference (bf16) or gpu_fp8's e4m3 emulation (fp8)."""
    _COUNTERS: dict = {}

    def __init__(self, spec):
        self.NAME, self.spec = spec.name, spec

    def forward(self, q, k, v, out=None, lse=None, **kw):
        import torch
        from fagen.verify import reference
        if str(self.spec.dtype) == "fp8_e4m3":
            import gpu_fp8
            return gpu_fp8.emulated_forward(str(self.spec.mask), torch.float8_e4m3fn)(q, k, v, **kw)
        o, l = reference.attention(q.double(), k.double(), v.double(), mask=str(self.spec.mask), **kw)
        if out is not None:
            out.copy_(o), lse.copy_(l)
            return out, lse
        return o.to(q.dtype), l.float()


def sync():
    import torch
    if not MOCK:
        torch.cuda.synchronize()


def variant(fields, sched, acc=None):
    """The gluon module of `fields`: the product's render (sched None) or rendered with the tile schedule at _SCHED
    sched (GluonBackend.variant["tile_schedule_all"], a measurement variant). acc (fp8): S = Q K^T's wgmma with
    max_num_imprecise_acc=acc (fp32 promotion every acc products, triton's split; the render's default is none:
    the tensor core's fast fp8 accumulation)."""
    import fagen
    from fagen import backends
    from fagen.codegen import render as _render
    from fagen.runtime.loader import load_source
    s = spec_of(fields)
    if MOCK:
        return _StandIn(s)
    if sched is None and acc is None:
        return fagen.load(s)
    if sched == "loop":  # the persistent loop without a tile schedule (every non-MLA render before this session)
        saved = backends.GLUON.variant["causal_order"]
        backends.GLUON.variant["causal_order"] = None
        _render.render.cache_clear()
        try:
            source = fagen.generate(s)
        finally:
            backends.GLUON.variant["causal_order"] = saved
            _render.render.cache_clear()
        if "TileCounter" in source:
            raise RuntimeError(f"{s.name}: a tile schedule in the loop render")
        return load_source(source, f"{s.name}_loop")
    saved = backends.GLUON.variant["tile_schedule_all"]
    backends.GLUON.variant["tile_schedule_all"] = True
    _render.render.cache_clear()
    try:
        source = fagen.generate(s)
    finally:
        backends.GLUON.variant["tile_schedule_all"] = saved
        _render.render.cache_clear()
    if "_SCHED = " not in source:
        raise RuntimeError(f"{s.name}: no _SCHED in the render")
    import re
    if sched is not None:
        source = re.sub(r"^_SCHED = \d", f"_SCHED = {sched}", source, count=1, flags=re.M)
    else:  # the product's order: the schedule rendered as the product does (none for d128 bf16 today)
        source = fagen.generate(s)
    if acc == "inorder":  # fp8 P's keys in order ([Note] fp8 P permutation off): the conversion with shuffles
        if not re.search(r"^_P_PERM = 1", source, flags=re.M):
            raise RuntimeError(f"{s.name}: no _P_PERM in the render")
        source = re.sub(r"^_P_PERM = 1", "_P_PERM = 0", source, count=1, flags=re.M)
    elif acc is not None:
        if source.count("use_acc=False, is_async=True") != 2:
            raise RuntimeError(f"{s.name}: expected the two S matmuls")
        source = source.replace("use_acc=False, is_async=True", f"max_num_imprecise_acc={acc}, use_acc=False, "
                                                                "is_async=True")
    return load_source(source, f"{s.name}_sched{sched}_acc{acc}")


def all_modules():
    """(fields, sched) of every module the phases launch."""
    out = []
    for _, fields, *_ in TIME_CASES:
        out += [(fields, None), (fields, "loop")] + [(fields, n) for n in SCHEDS]
    for _, fields, *_ in EDGE_CASES:
        out += [(fields, n) for n in (None, ) + SCHEDS]
    for d, mask, gqa, *_ in FP8_EDGES:
        out += [(dict(head_dim=d, mask=mask, gqa=gqa, dtype="fp8_e4m3"), n) for n in (None, ) + SCHEDS]
        out += [(dict(head_dim=d, mask=mask, gqa=gqa, dtype="fp8_e4m3"), None, "inorder")]
    for _, fields, *_ in TIME_CASES:
        if fields.get("dtype") == "fp8_e4m3":
            out += [(fields, None, acc) for acc in FP8_ACC + ("inorder",)]
            out += [({**fields, "num_stages": st}, n) for st in FP8_STAGES for n in (None, 2)]
    seen, uniq = set(), []
    for f, n, *acc in out:
        f = {"dtype": "bf16", **f}
        key = (json.dumps(f, sort_keys=True), n, *acc)
        if key not in seen:
            seen.add(key)
            uniq.append((f, n, *acc))
    return uniq


def _warm(job):
    """Build one module and launch it once on tiny inputs (fills triton's cache for the other phases)."""
    fields, sched, *acc = job
    t = time.time()
    try:
        import torch
        m = variant(fields, sched, *acc)
        fields = {"dtype": "bf16", **fields}
        d, gqa = fields["head_dim"], fields.get("gqa", 1)
        kw = {}
        if fields.get("window"):
            kw["window"] = (64, 0)
        if fields.get("softcap"):
            kw["softcap"] = 30.0
        q, k, v = (torch.randn(1, h, 200, d, device=DEV).bfloat16() for h in (gqa, 1, 1))
        if fields["dtype"] == "fp8_e4m3":
            q, k, v = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
        m.forward(q, k, v, **kw)
        torch.cuda.synchronize()
        return f"built {m.NAME} _SCHED {sched} acc {acc} in {time.time() - t:.1f}s"
    except Exception as e:  # noqa: BLE001
        return f"build ERROR {fields} _SCHED {sched}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _warm_attention(job):
    """fagen.attention once at the timed case's batch and heads, 256 long (its Triton kernel's int specializations
    as at s16k: divisible by 16, not 1), so the time phase does not compile it."""
    _, fields, b, hq, hkv = job
    t = time.time()
    try:
        import torch
        import fagen
        q = torch.randn(b, hq, 256, fields["head_dim"], device=DEV, dtype=torch.bfloat16)
        k, v = (torch.randn(b, hkv, 256, fields["head_dim"], device=DEV, dtype=torch.bfloat16) for _ in range(2))
        with torch.no_grad():
            fagen.attention(q, k, v, mask=fields["mask"])
        torch.cuda.synchronize()
        return f"built fagen.attention {fields} b{b} h{hq}/{hkv} in {time.time() - t:.1f}s"
    except Exception as e:  # noqa: BLE001
        return f"build ERROR fagen.attention {fields}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _job(job):
    return _warm_attention(job) if job[0] == "attention" else _warm(job)


def phase_build():
    jobs = [("attention", f, b, hq, hkv) for _, f, b, hq, hkv, _ in TIME_CASES if f.get("dtype") != "fp8_e4m3"]
    jobs += all_modules()
    log(f"== build: {len(jobs)} modules")
    with mp.get_context("spawn").Pool(max(2, min(15, (os.cpu_count() or 4) - 1))) as pool:
        for msg in pool.imap_unordered(_job, jobs):
            log(msg)


# -- checks ----------------------------------------------------------------------------------------------------
def phase_check():
    import torch
    from fagen.spec.axes import DType
    from fagen.verify import reference
    from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare
    tol = TOLERANCE[DType.BF16]
    g = torch.Generator(device=DEV).manual_seed(0)
    for label, fields, b, hkv, sq, sk, kw in EDGE_CASES:
        gqa = fields.get("gqa", 1)
        d = fields["head_dim"]
        q = torch.randn(b, hkv * gqa, sq, d, device=DEV, generator=g).bfloat16()
        k, v = (torch.randn(b, hkv, sk, d, device=DEV, generator=g).bfloat16() for _ in range(2))
        want, want_lse = reference.attention(q.double(), k.double(), v.double(), mask=fields["mask"], **kw)
        for n in (None, ) + SCHEDS:  # the product's render, then each order
            try:
                m = variant(fields, n)
                errs = []
                for call in range(2):  # twice: the counter must be back at 0 after a launch
                    out, lse = m.forward(q, k, v, **kw)
                    errs.append(compare(f"out (call {call})", out, want, **tol))
                    seen = want_lse > float("-inf")
                    compare(f"lse (call {call})", lse.where(seen, 0), want_lse.where(seen, 0), **LSE_TOLERANCE)
                    assert bool((lse[~seen] == float("-inf")).all()) and bool((out[~seen.unsqueeze(-1).expand_as(out)] == 0).all())
                sync()
                left = [int(c.item()) for c in getattr(m, "_COUNTERS", {}).values()]
                assert all(c == 0 for c in left), f"counter left at {left}"
                emit(section="check", case=label, impl="product" if n is None else f"_SCHED {n}", value="PASS",
                     note=f"max err {max(errs):.1e}")
            except Exception as e:  # noqa: BLE001
                emit(section="check", case=label, impl="product" if n is None else f"_SCHED {n}", value="FAIL",
                     note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
                traceback.print_exc()
    # CUDA graph replay of the counter order: new inputs copied in, two replays, each against the eager result
    try:
        if MOCK:
            raise RuntimeError("no CUDA graphs on the CPU (mock)")
        fields = dict(head_dim=128, mask="causal")
        m = variant(fields, 2)
        q, k, v = (torch.randn(3, 16, 1100, 128, device=DEV, generator=g).bfloat16() for _ in range(3))
        out, lse = torch.empty_like(q), torch.empty(3, 16, 1100, device=DEV)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            m.forward(q, k, v, out=out, lse=lse)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            m.forward(q, k, v, out=out, lse=lse)
        errs = []
        for i in range(2):
            for x in (q, k, v):
                x.copy_(torch.randn(x.shape, device=DEV, generator=g).bfloat16())
            graph.replay()
            graph.replay()  # twice on the same inputs: a counter not back at 0 would skip tiles
            want, want_lse = m.forward(q.clone(), k.clone(), v.clone())
            torch.cuda.synchronize()
            errs.append((out.float() - want.float()).abs().max().item())
        assert max(errs) == 0.0, f"graph replay differs from eager by {max(errs)}"
        emit(section="check", case="graph replay b3 h16 s1100 causal", impl="_SCHED 2", value="PASS",
             note="bitwise equal to eager, 2 input sets x 2 replays")
    except Exception as e:  # noqa: BLE001
        emit(section="check", case="graph replay", impl="_SCHED 2", value="FAIL",
             note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
        traceback.print_exc()
    # fp8: scripts/gpu_fp8.py's checks (float64 on the dequantized inputs, emulation, fingerprint), no outliers
    import gpu_fp8
    for d, mask, gqa, b, hkv, sq, sk, per_head, window in FP8_EDGES:
        for n in (None, "inorder") + SCHEDS:  # the product's render (P permuted), P in order, the tile orders
            label = f"fp8 {mask} gqa{gqa} sq{sq} sk{sk} b{b}"
            try:
                m = variant(dict(head_dim=d, mask=mask, gqa=gqa, dtype="fp8_e4m3"), *((None, n) if n == "inorder"
                                                                                     else (n, )))
                r = [gpu_fp8.check(d, mask, gqa, b, hkv, sq, sk, False, per_head, window, seed=c, device=DEV,
                                   forward=m.forward) for c in range(2)]
                ok = all(x["pass"] for x in r)
                emit(section="check", case=label, impl={None: "plain", "inorder": "plain, P in order"}.get(
                    n, f"_SCHED {n}"), value="PASS" if ok else "FAIL",
                     note=f"rmse {max(x['rmse'] for x in r):.2e} (emu {r[0]['emu_rmse']:.2e}) lse "
                          f"{max(x['lse_err'] for x in r):.1e} finger {max(x['fingerprint'] for x in r):.2f}")
            except Exception as e:  # noqa: BLE001
                emit(section="check", case=label, impl=f"_SCHED {n}", value="FAIL",
                     note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
                traceback.print_exc()
    for d, mask, gqa, b, hkv, sq, sk, per_head, window in FP8_OUTLIERS:
        for acc in (None,) + FP8_ACC:
            label = f"fp8 outliers {mask} s{sq}"
            try:
                m = variant(dict(head_dim=d, mask=mask, gqa=gqa, dtype="fp8_e4m3"), None, acc)
                r = gpu_fp8.check(d, mask, gqa, b, hkv, sq, sk, True, per_head, window, device=DEV, forward=m.forward)
                emit(section="check", case=label, impl=f"S imprecise acc {acc or 'fast'}",
                     value="PASS" if r["pass"] else "FAIL",
                     note=f"lse err {r['lse_err']:.1e} (bound {gpu_fp8.LSE_BOUND}) rmse {r['rmse']:.2e} "
                          f"(emu {r['emu_rmse']:.2e}) finger {r['fingerprint']:.2f}")
            except Exception as e:  # noqa: BLE001
                emit(section="check", case=label, impl=f"S imprecise acc {acc}", value="FAIL",
                     note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
                traceback.print_exc()


# -- timing ----------------------------------------------------------------------------------------------------
def phase_time():
    import torch
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fagen
    from fagen.runtime import hopper
    from gpu_rows import bench as _bench
    bench = lambda fn: _bench(fn, MOCK, warmup=10, rep=80, return_mode="median")  # noqa: E731
    log(f"== time: {'mock' if MOCK else torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"triton {triton.__version__}")
    for label, fields, b, hq, hkv, s in TIME_CASES:
        fields = {"dtype": "bf16", **fields}
        d, mask, fp8 = fields["head_dim"], fields["mask"], fields["dtype"] == "fp8_e4m3"
        flops = 4 * b * hq * s * s * d / (2 if mask == "causal" else 1)
        g = torch.Generator(device=DEV).manual_seed(1)
        q = torch.randn(b, hq, s, d, device=DEV, generator=g, dtype=torch.bfloat16)
        k, v = (torch.randn(b, hkv, s, d, device=DEV, generator=g, dtype=torch.bfloat16) for _ in range(2))
        if fp8:
            import gpu_fp8
            (q8, dq), (k8, dk), (v8, dv) = (gpu_fp8.quantize(t.float(), False) for t in (q, k, v))
            args, kw = (q8, k8, v8), dict(q_descale=dq, k_descale=dk, v_descale=dv)
        else:
            args, kw = (q, k, v), {}
        kv_sdpa, how = (k, v), "native GQA" if hkv != hq else ""

        def cudnn():
            with sdpa_kernel(SDPBackend.MATH if MOCK else SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, *kv_sdpa, is_causal=mask == "causal",
                                                      enable_gqa=kv_sdpa[0].shape[1] != hq)
        try:
            ref = cudnn().float()
        except RuntimeError:  # no native GQA in this cuDNN path: KV repeated to every query head
            kv_sdpa, how = tuple(t.repeat_interleave(hq // hkv, dim=1) for t in (k, v)), "KV expanded"
            ref = cudnn().float()
        try:
            ms = bench(cudnn)
            emit(section="time", case=label, impl="SDPA cuDNN bf16", value=f"{flops / ms / 1e9:.1f}", ms=ms, note=how)
        except Exception as e:  # noqa: BLE001
            emit(section="time", case=label, impl="SDPA cuDNN bf16", value="ERROR", note=str(e)[:120])

        def run(impl, make, note=""):
            try:
                fn = make()
                out = fn()
                out = out[0] if isinstance(out, tuple) else out
                err = (out.float() - ref).abs().max().item()
                ms = bench(fn)
                emit(section="time", case=label, impl=impl, value=f"{flops / ms / 1e9:.1f}", ms=ms,
                     note=f"{note}max |out - cuDNN| {err:.1e}")
            except Exception as e:  # noqa: BLE001
                emit(section="time", case=label, impl=impl, value="ERROR",
                     note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
                traceback.print_exc()

        if not fp8:
            case = fagen.KernelSpec(head_dim=d, mask=mask, gqa=hq // hkv, dtype="bf16")
            pick = None if MOCK else hopper.forward_spec(case, q.device)
            work = b * hq * s * s >= hopper.MIN_WORK
            name = "gluon" if pick is not None and work else "triton"
            attend = (lambda: variant(fields, None).forward(q, k, v)) if MOCK else \
                (lambda: fagen.attention(q, k, v, mask=mask))
            with torch.no_grad():
                run("fagen.attention", lambda: attend, f"picks {name}; ")

        def gluon(sched, acc=None):
            m = variant(fields, sched, acc)
            return lambda: m.forward(*args, **kw)
        run("gluon plain (the product's render)", lambda: gluon(None))
        run("gluon loop (no tile schedule)", lambda: gluon("loop"))
        for n in SCHEDS:
            run(f"gluon _SCHED {n}", lambda n=n: gluon(n))
        if fp8:
            for acc in FP8_ACC:
                run(f"gluon plain, S acc {acc}", lambda acc=acc: gluon(None, acc))
            run("gluon plain, P keys in order (_P_PERM 0)", lambda: gluon(None, "inorder"))
            for tag in (None, "inorder"):  # the V transpose alone (in the rows above): keys permuted / in order
                try:
                    m = variant(fields, None, tag)
                    ms = bench(lambda m=m: m.transpose_v(args[2]))
                    emit(section="time", case=label, impl=f"transpose_v alone{', keys in order' if tag else ''}",
                         value=f"{ms * 1e3:.1f} us", ms=ms)
                except Exception as e:  # noqa: BLE001
                    emit(section="time", case=label, impl="transpose_v alone", value="ERROR", note=str(e)[:120])
            for stages in FP8_STAGES:
                run(f"gluon plain s{stages}", lambda stages=stages: (
                    lambda m=variant({**fields, "num_stages": stages}, None): lambda: m.forward(*args, **kw))())
                run(f"gluon _SCHED 2 s{stages}", lambda stages=stages: (
                    lambda m=variant({**fields, "num_stages": stages}, 2): lambda: m.forward(*args, **kw))())
        q = k = v = args = kv_sdpa = ref = None
        if not MOCK:
            torch.cuda.empty_cache()
    # host cost of a small call: wall time per call of a loop (the kernel is tiny: the host path dominates)
    q, k, v = (torch.randn(1, 1, 256, 128, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    for impl, m in (("gluon plain", variant(dict(head_dim=128, mask="causal"), None)),
                    ("gluon _SCHED 2", variant(dict(head_dim=128, mask="causal"), 2))):
        calls = 3 if MOCK else 300
        for _ in range(20 if not MOCK else 1):
            m.forward(q, k, v)
        sync()
        t = time.perf_counter()
        for _ in range(calls):
            m.forward(q, k, v)
        sync()
        us = (time.perf_counter() - t) / calls * 1e6
        emit(section="host", case="b1 h1 s256 d128 causal", impl=impl, value=f"{us:.1f} us/call")


def phase_bench():
    """BENCH_ROWS as `fagen bench --suite standard --impl fagen --impl sdpa-cudnn --case ...` runs them (one input
    set): the fp8 rows' check (descales, the fp8 tolerance) and their ratio to the bf16 rows."""
    from fagen.bench.cases import BenchOptions
    from fagen.bench.impls import run_case
    from fagen.bench.workloads import RELATIVE_TARGETS, standard_suite
    by = {c.name: c for c in standard_suite(quick=MOCK)}
    opts = BenchOptions(device=DEV, impls=("fagen", "sdpa-cudnn"), sets=1, rep_ms=100.0)
    got = {}
    for name in BENCH_ROWS:
        for rec in run_case(by[name], opts, log=lambda line: print(line, flush=True)):
            got[(name, rec["impl"])] = rec.get("tflops")
            emit(section="bench", case=name, impl=rec["impl"], value=f"{rec['tflops']:.1f}" if rec.get("tflops")
                 else rec["status"], note=f"check {rec.get('check')} {rec.get('note', '')}"[:160])
    for name, refs in RELATIVE_TARGETS.items():
        if name in BENCH_ROWS:
            for ref, bound in refs:
                mine, theirs = got.get((name, "fagen")), got.get((ref, "fagen"))
                if mine and theirs:
                    emit(section="bench", case=name, impl=f"/ {ref}", value=f"{mine / theirs:.2f}x",
                         note=f"target >= {bound}x: {'met' if mine / theirs >= bound else 'MISSED'}")


# -- dry run ---------------------------------------------------------------------------------------------------
def dry_run():
    """Any machine: render every module and build one per spec (the counter order) for sm_90."""
    ok = True
    mods = all_modules()
    for fields, sched, *acc in mods:
        m = variant(fields, sched, *acc)
        if sched == 2:
            ck = m.compile_for()
            atomics = ck.asm["ptx"].count("atom.global")
            log(f"{m.NAME:<58} _SCHED 2: shared {ck.metadata.shared}, {atomics} global atomics in the PTX")
            ok &= atomics >= 2  # the take and the reset
        if acc:
            ck = m.compile_for()
            log(f"{m.NAME:<58} S acc {acc[0]}: shared {ck.metadata.shared}, "
                f"{ck.asm['ptx'].count('wgmma.mma_async')} wgmma in the PTX")
    log(f"rendered {len(mods)} modules; dry run {'OK' if ok else 'FAILED'}")
    return ok


# -- driver ----------------------------------------------------------------------------------------------------
def table(rows):
    lines = ["| section | case | impl | value | ms | note |", "|---|---|---|---:|---:|---|"]
    for r in rows:
        ms = f"{r['ms']:.3f}" if isinstance(r.get("ms"), float) else ""
        lines.append(f"| {r['section']} | {r['case']} | {r['impl']} | {r['value']} | {ms} | {r.get('note', '')} |")
    return "\n".join(lines)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        {"build": phase_build, "check": phase_check, "time": phase_time, "bench": phase_bench}[sys.argv[2]]()
        return
    if DRY:
        sys.exit(0 if dry_run() else 1)
    import torch
    if not MOCK and (not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0)):
        sys.exit("gpu_fwd_sched.py needs an sm_90 GPU (GPU_FWD_SCHED_DRY=1 rehearses it on the CPU)")
    env = child_env("/tmp/fagen-cache-gpu-fwd-sched", os.pathsep.join([str(ROOT), str(ROOT / "scripts")]))
    rows = []
    for name, limit in PHASE_TIMEOUT.items():
        if MOCK and name == "build":
            continue
        log(f"#### phase {name} (timeout {limit}s)")
        def on_line(line):
            if line.startswith("ROW\t"):
                rows.append(json.loads(line[4:]))
                r = rows[-1]
                log(f"{r['section']} | {r['case']} | {r['impl']} | {r['value']} | {r.get('note', '')}")
            elif not line.startswith("  File ") and "Traceback" not in line:
                print(line, end="", flush=True)
        rc, _ = run_child(__file__, name, limit, env, on_line)
        log(f"#### phase {name}: rc={rc}")
        if rc != 0:
            rows.append(dict(section=name, case="phase", impl="-", value=f"rc {rc}", note="see the log above"))
    text = table(rows)
    print("\n" + text, flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "gpu_fwd_sched.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
