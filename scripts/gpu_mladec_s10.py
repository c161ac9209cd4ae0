"""MLA absorbed decode, tenth session (issue 27): the fp8 latent decode at Hq 16 Sq 1 (>= 90% of copy counted in the
fp8 bytes read) and Hq 128 Sq 2, and the host cost of the eager b32 kv4k call.

    PYTHONPATH=$PWD python3 scripts/gpu_mladec_s10.py  # ~95 s on an H100; $OUTX/gpu_mladec_s10.md

Variants (VARIANTS): the product's bf16 gluon decode (padded tile) and Triton fp8 decode, the ninth session's lab fp8
swap-AB (lab/gluon_mla_decode_fp8.py), the TMA-ring fp8 lab kernel (lab/gluon_mla_decode_tma8.py, [Note] Lab fp8 TMA
ring: warps and ring depth), FlashMLA (bf16; $FLASHMLA_DIR, scripts/gpu_flashmla_peer.py).
Phases, each a child process with a timeout (scripts/_phases.py); the check phases run at once (they compile):
1. check-*: each variant against float64 (on the dequantized cache for fp8) at Hq 16 Sq 1 (and Hq 128 Sq 2 for the
   rows variants), page 64, lengths 1000/77/513 (NaN past them, in the keys and their per-token scales), pages
   shuffled, the split rule and one split and three; the fp8 cache is passed as float8_e4m3fn (read as fp8).
2. time: a device copy, then each variant at b32/b128 x kv4096/kv32768 (Hq 16) and b32 kv8192 (Hq 128 Sq 2): GB/s
   of the bytes read as % of copy (TF/s at Hq 128), 8 calls in a CUDA graph and eager back to back.
3. host: the eager b32 kv4k bf16 call through fagen.attention (Triton and the padded gluon tile) and the module's
   forward: host time a call (no sync) and a cProfile of the gluon path's calls.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for _phases
from _phases import child_env, run_phase as run_child  # noqa: E402

DRY = os.environ.get("GPU_MLADEC_S10_DRY") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D, DV, PAGE = (48, 32, 16) if DRY else (576, 512, 64)
# name -> (kv_dtype, scale form, backend, spec tiles, text replacements on the render)
# Round A (2026-11-27 06:21 UTC, results/mladec-A.txt) dropped: Triton tiles n64w8s3 (bf16) and n64w8s2 (e4m3), more
# splits (PROGRAMS_PER_SM 4), the lab's fp16 dots per tensor (no faster than per token's). Round B: CUDA-graph timing
# (b32 kv4k was host time in every column: ~50 us of GPU work a call) and the lab's page prefetch.
# Round A (09:57 UTC, results/mladec-A.txt) dropped: tma8 w8s2 and w8s3 with O split by rows (M), 43-48% of copy;
# tma8 nq32 at Hq 128 (155-164 TF/s). Round B: two score chains ([Note] Lab two score chains) in the lab kernels,
# tma8 with one warpgroup (w4, round A's best tma8), and fagen.attention under capture ([Note] Latent decode under
# capture).
VARIANTS = {
    "bf16 gluon pad64 (product)": (None, None, "gluon", {}, []),
    "bf16 FlashMLA": (None, None, "flashmla", {}, []),
    "e4m3/token triton (product)": ("fp8_e4m3", "token", "triton", {}, []),
    "e4m3/tensor triton": ("fp8_e4m3", "tensor", "triton", {}, []),
    "e4m3/token lab s9 swap-AB": ("fp8_e4m3", "token", "lab", {}, []),  # lab/gluon_mla_decode_fp8.py
    "e4m3/token lab s9 2 chains": ("fp8_e4m3", "token", "lab", {"s_accs": 2}, []),
    "e4m3/tensor lab s9 2 chains": ("fp8_e4m3", "tensor", "lab", {"s_accs": 2}, []),
    "e4m3/token lab s9 2 chains f16": ("fp8_e4m3", "token", "lab", {"s_accs": 2, "f16": True}, []),
    # lab/gluon_mla_decode_tma8.py
    "e4m3/token tma8 w4s2": ("fp8_e4m3", "token", "tma8", {"stages": 2, "warps": 4}, []),
    "e4m3/token tma8 w4s2 2 chains": ("fp8_e4m3", "token", "tma8", {"stages": 2, "warps": 4, "s_accs": 2}, []),
    "e4m3/token tma8 w4s3 2 chains": ("fp8_e4m3", "token", "tma8", {"stages": 3, "warps": 4, "s_accs": 2}, []),
    "e4m3/token tma8 w4s3 2 chains f16": ("fp8_e4m3", "token", "tma8", {"stages": 3, "warps": 4, "s_accs": 2,
                                                                         "f16": True}, []),
    "e4m3/token tma8 w8s3 f16": ("fp8_e4m3", "token", "tma8", {"f16": True}, []),
    "e4m3/token tma8 nq64 w8s2": ("fp8_e4m3", "token", "tma8", {"nq": 64, "stages": 2}, []),  # Hq 128 Sq 2 only
    "e4m3/token tma8 nq64 w8s2 2 chains": ("fp8_e4m3", "token", "tma8", {"nq": 64, "stages": 2, "s_accs": 2}, []),
}
# timed at Hq 128 Sq 2 only
ROWS_ONLY = {"e4m3/token tma8 nq64 w8s2", "e4m3/token tma8 nq64 w8s2 2 chains"}
H128 = {"bf16 gluon pad64 (product)", "bf16 FlashMLA", "e4m3/token triton (product)", "e4m3/tensor triton",
        *ROWS_ONLY}
CHECK_GROUPS = {"check-glu": ["bf16 gluon pad64 (product)", "bf16 FlashMLA"],
                "check-fp8a": ["e4m3/token triton (product)", "e4m3/tensor triton"],
                "check-lab": ["e4m3/token lab s9 swap-AB", "e4m3/token lab s9 2 chains"],
                "check-lab2": ["e4m3/tensor lab s9 2 chains", "e4m3/token lab s9 2 chains f16"],
                "check-t8a": ["e4m3/token tma8 w4s2", "e4m3/token tma8 w4s2 2 chains"],
                "check-t8b": ["e4m3/token tma8 w4s3 2 chains", "e4m3/token tma8 w8s3 f16"],
                "check-t8d": ["e4m3/token tma8 w4s3 2 chains f16"],
                "check-t8c": ["e4m3/token tma8 nq64 w8s2", "e4m3/token tma8 nq64 w8s2 2 chains"]}
SHAPES = ((128, 4096, 16, 1), (32, 32768, 16, 1), (32, 8192, 128, 2), (32, 4096, 16, 1), (128, 32768, 16, 1)) \
    if not DRY else ((2, 96, 16, 1), (3, 64, 16, 1))
CHECK_LENS = [1000, 77, 513] if not DRY else [200, 7, 53]  # within 16 pages: the timed shapes' integer classes
LIMITS = dict(check=29, time=42, host=15) if not DRY else dict(check=900, time=900, host=900)
if DRY:  # the interpreter: tiny tiles; the gluon kernel has no interpreter (its sm_90 build is in the tests)
    VARIANTS = {k: (kv, f, be, {"block_n": 16}, tx) for k, (kv, f, be, _, tx) in VARIANTS.items()
                if be == "triton"}
    SHAPES = tuple(x for x in SHAPES if x[2] == 16)  # the gluon and lab kernels: sm_90 builds in the tests
    CHECK_GROUPS = {g: [v for v in vs if v in VARIANTS] for g, vs in CHECK_GROUPS.items()}
SCALE = 192 ** -0.5
T0 = time.time()


def emit(section, case, impl, value, ms, note):
    print("ROW " + json.dumps([section, case, impl, value, "" if ms is None else f"{ms:.4f}", note]), flush=True)


class FlashMLA:
    """FlashMLA (sglang-kernel 0.4.5, $FLASHMLA_DIR) as a decode module: forward(q, cache, None, ...) -> (out, None);
    its metadata computed once per lengths tensor (a serving engine computes it once a step for every layer)."""

    def __init__(self, causal):
        sys.path.insert(0, os.environ.get("FLASHMLA_DIR", "/tmp/fm"))
        from sgl_kernel import flash_mla
        if flash_mla._flashmla_import_error is not None:
            raise RuntimeError(f"flashmla_ops did not load: {flash_mla._flashmla_import_error}")
        self.fm, self.causal, self.meta = flash_mla, causal, {}

    def forward(self, q, k, v, *, block_table, seqlens_k, scale, **kw):
        assert v is None and not kw
        b, hq, sq, _ = q.shape
        key = (seqlens_k.data_ptr(), hq * sq)
        if key not in self.meta:
            self.meta[key] = self.fm.get_mla_metadata(seqlens_k, sq * hq, 1)
        meta, splits = self.meta[key]
        qf = q.transpose(1, 2).contiguous()  # FlashMLA: q [b, sq, hq, d]
        out = self.fm.flash_mla_with_kvcache(qf, k, block_table, seqlens_k, DV, meta, splits, softmax_scale=scale,
                                             causal=self.causal)[0]
        return out.transpose(1, 2), None


def phase(name):  # noqa: C901 - one phase in this process
    import torch

    import fagen
    from fagen.runtime.loader import load_source
    from fagen.verify import reference
    from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare

    dev = "cpu" if DRY else "cuda"
    mods = {}

    def module(variant, mask, hq=16):
        kv, _, backend, tiles, text = VARIANTS[variant]
        key = (variant, mask, hq)
        if key not in mods and backend in ("lab", "tma8"):
            sys.path.insert(0, ROOT)
            from lab import gluon_mla_decode_fp8, gluon_mla_decode_tma8
            mods[key] = (gluon_mla_decode_fp8 if backend == "lab" else gluon_mla_decode_tma8).Module(
                causal=mask == "causal", **tiles)
        if key not in mods and backend == "flashmla":
            mods[key] = FlashMLA(mask == "causal")
        if key not in mods:
            spec = fagen.KernelSpec(head_dim=D, head_dim_v=DV, shared_kv=True, kind="decode", gqa=hq, dtype="bf16",
                                    mask=mask, layout="paged", backend=backend, **({"kv_dtype": kv} if kv else {}),
                                    **tiles)
            if not text:
                mods[key] = fagen.load(spec)
            else:
                src = fagen.generate(spec)
                for old, new in text:
                    if old not in src:
                        raise RuntimeError(f"{old!r} not in the render")
                    src = src.replace(old, new)
                mods[key] = load_source(src, f"{spec.name}_{abs(hash(tuple(text))) % 10**8}")
        return mods[key]

    def inputs(variant, b, n_max, lens, seed, shuffle=True, tails=False, hq=16, sq=1):
        kv, form = VARIANTS[variant][:2]
        gen = torch.Generator(device=dev).manual_seed(seed)
        pages = b * -(-n_max // PAGE)
        q = torch.randn(b, hq, sq, D, device=dev, generator=gen).bfloat16()
        cache = torch.randn(pages, PAGE, 1, D, device=dev, generator=gen)
        cache = cache.to(torch.float8_e4m3fn) if kv else cache.bfloat16()
        perm = torch.randperm(pages, device=dev, generator=gen) if shuffle else torch.arange(pages, device=dev)
        table = perm.to(torch.int32).view(b, -1)
        kw = {}
        if form == "token":
            kw["k_scale"] = torch.exp2(torch.rand(cache.shape[:-1], device=dev, generator=gen) * 6 - 3)
        elif form == "tensor":
            kw["k_scale"] = 0.7
        if tails:  # keys past each length hold NaN (fp8: the byte 0x7f), their per-token scales too
            for i, n in enumerate(lens):
                for p in range(table.shape[1]):
                    if n - p * PAGE < PAGE:
                        pg, lo = int(table[i, p]), max(0, n - p * PAGE)
                        if kv:
                            cache.view(torch.uint8)[pg, lo:] = 0x7F
                        else:
                            cache[pg, lo:] = float("nan")
                        if form == "token":
                            kw["k_scale"][pg, lo:] = float("nan")
        return q, cache, table, torch.tensor(lens, dtype=torch.int32, device=dev), kw

    if name == "bench":  # the serving bench's absorbed rows (fagen/bench/serving.py) through the bench's fagen column
        from fagen.bench.cases import BenchOptions
        from fagen.bench.impls import run_case
        from fagen.bench.serving import serving_rows
        rows = sorted((c for c in serving_rows(quick=DRY) if c.shared_kv), key=lambda c: (c.heads_q, c.kv_dtype or ""))
        for c in rows:
            t = time.time()
            r = run_case(c, BenchOptions(device=dev, impls=("fagen", ), rep_ms=20, warmup_ms=5, sets=1),
                         log=lambda *_: None)[0]
            value = "-" if r["ms"] is None else \
                (f"{r['gbs']:.0f} GB/s" if c.metric == "gbs" else f"{r['tflops']:.1f} TF/s")
            emit("bench", c.name, "fagen (bench)", value, r["ms"], f"{r['status']}, check {r['check']}; "
                 f"{r.get('note') or ''} {r.get('spec') or ''}; {time.time() - t:.1f} s (beside the check phases)")
        return
    if name.startswith("check"):
        for variant in CHECK_GROUPS[name]:
            hq, sq = (128, 2) if variant in ROWS_ONLY else (16, 1)
            peer = VARIANTS[variant][2] == "flashmla"
            for form in (("rule", ) if peer else ("rule", "s1", "s3")):
                case = "h%d sq%d page%d lens %s %s" % (hq, sq, PAGE, "/".join(map(str, CHECK_LENS)), form)
                try:
                    t = time.time()
                    m = module(variant, "causal", hq)
                    q, cache, table, lens, kw = inputs(variant, len(CHECK_LENS), 16 * PAGE,
                                                       CHECK_LENS, 3, tails=not peer, hq=hq, sq=sq)
                    call = dict(block_table=table, seqlens_k=lens, scale=SCALE, **kw)
                    if form == "rule":
                        out, lse = m.forward(q, cache, None, **call)
                    else:
                        out, lse = m.forward_split(q, cache, None, num_splits=int(form[1:]), **call)
                    keys_all = reference.dequantize(cache, kw.get("k_scale"))  # NaN past the lengths: unread
                    worst = 0.0
                    for i, n in enumerate(CHECK_LENS):
                        keys = keys_all[table[i].long()].reshape(-1, 1, D)[:n].transpose(0, 1)[None]
                        qi = q[i:i + 1].double()
                        want, wlse = reference.attention(qi, keys, None, head_dim_v=DV, mask="causal", scale=SCALE)
                        terms, _ = reference.attention(qi, keys, keys[..., :DV].abs(), mask="causal", scale=SCALE)
                        unit = terms.clamp(min=1.0)
                        worst = max(worst, compare(f"out {i}", out[i:i + 1].double() / unit, want / unit,
                                                   **TOLERANCE["bf16"]))
                        if lse is not None:
                            compare(f"lse {i}", lse[i:i + 1].double(), wlse, **LSE_TOLERANCE)
                    emit("check", case, variant, "ok", None, f"err {worst:.1e}; cache {cache.dtype} "
                         f"({cache.element_size()} B a value); {time.time() - t:.1f} s")
                except Exception as e:  # noqa: BLE001 - a failure is a row
                    import traceback
                    traceback.print_exc(file=sys.stdout)
                    emit("check", case, variant, "FAIL", None, f"ERROR {type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0][:150]}")
        if name == "check-glu" and not DRY:  # fagen.attention on a dense cache at Hq 16 Sq 1 ([Note] Latent padded
            try:  # tiles: the padded gluon tile where LATENT_PAD_SELECTED), against float64
                from fagen.runtime import hopper
                hopper.LATENT_PAD_SELECTED, hopper.LATENT_MIN_WORK = True, 1
                gen = torch.Generator(device=dev).manual_seed(11)
                qd = torch.randn(3, 16, 1, D, device=dev, generator=gen).bfloat16()
                kd = torch.randn(3, 1, 777, D, device=dev, generator=gen).bfloat16()
                with torch.no_grad():
                    out = fagen.attention(qd, kd, None, head_dim_v=DV, scale=SCALE)
                twin = hopper.latent_decode_spec(fagen.KernelSpec(head_dim=D, head_dim_v=DV, shared_kv=True,
                                                                  kind="decode", gqa=16, dtype="bf16", mask="none"),
                                                 qd.device, 16)
                served = "triton"
                if twin is not None and torch.equal(fagen.load(twin).forward(qd, kd, None, scale=SCALE)[0], out):
                    served = "gluon (padded tile)"
                worst = 0.0
                for i in range(3):
                    want, _ = reference.attention(qd[i:i + 1].double(), kd[i:i + 1].double(), None, head_dim_v=DV,
                                                  scale=SCALE)
                    worst = max(worst, compare(f"out {i}", out[i:i + 1].double(), want, **TOLERANCE["bf16"]))
                emit("check", "fagen.attention dense h16 sq1 sk777", "fagen.attention", "ok", None,
                     f"err {worst:.1e}; served by {served}")
            except Exception as e:  # noqa: BLE001
                import traceback
                traceback.print_exc(file=sys.stdout)
                emit("check", "fagen.attention dense h16 sq1 sk777", "fagen.attention", "FAIL", None,
                     f"ERROR {type(e).__name__}: {(str(e).splitlines() or [''])[0][:150]}")
        return

    if name == "host":  # [lever 2] the eager b32 kv4k bf16 call: where its host time goes
        import cProfile
        import pstats

        from fagen.runtime import hopper
        gen = torch.Generator(device=dev).manual_seed(7)
        b, n = 32, 4096
        qd = torch.randn(b, 16, 1, D, device=dev, generator=gen).bfloat16()
        kd = torch.randn(b, 1, n, D, device=dev, generator=gen).bfloat16()
        spec = fagen.KernelSpec(head_dim=D, head_dim_v=DV, shared_kv=True, kind="decode", gqa=16, dtype="bf16",
                                mask="none")
        glu = fagen.load(hopper.latent_decode_spec(spec, qd.device, 16))
        tri = fagen.load(spec)
        calls = {"fagen.attention (rule)": lambda: fagen.attention(qd, kd, None, head_dim_v=DV, scale=SCALE),
                 "fagen.attention (min work 1: gluon)": lambda: fagen.attention(qd, kd, None, head_dim_v=DV,
                                                                               scale=SCALE),
                 "gluon module.forward": lambda: glu.forward(qd, kd, None, scale=SCALE),
                 "triton module.forward": lambda: tri.forward(qd, kd, None, scale=SCALE)}
        read = b * n * D * 2
        with torch.no_grad():
            for label, fn in calls.items():
                hopper.LATENT_MIN_WORK = 1 if "min work 1" in label else 1 << 22
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(30):
                    fn()
                host = (time.perf_counter() - t) / 30 * 1e6
                torch.cuda.synchronize()
                st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                st.record()
                for _ in range(100):
                    fn()
                en.record()
                torch.cuda.synchronize()
                ms = st.elapsed_time(en) / 100
                emit("host", f"h16 sq1 b{b} kv{n} dense bf16", label, f"{host:.1f} us host", ms,
                     f"eager back to back {ms * 1e3:.1f} us a call, {read / ms / 1e6:.0f} GB/s")
            want = {"gluon pad64": glu.forward(qd, kd, None, scale=SCALE)[0], "triton": tri.forward(qd, kd, None,
                                                                                               scale=SCALE)[0]}
            hopper.LATENT_MIN_WORK = 1 << 22
            for flag in (None, 1 << 21):  # [Note] Latent decode under capture
                hopper.LATENT_CAPTURED_MIN_WORK = flag
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    calls["fagen.attention (rule)"]()
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                outs = []
                with torch.cuda.graph(g):
                    for _ in range(8):
                        outs.append(calls["fagen.attention (rule)"]())
                g.replay()
                torch.cuda.synchronize()
                served = [k for k, v in want.items() if torch.equal(outs[0], v)] or ["neither (differs)"]
                st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                st.record()
                for _ in range(20):
                    g.replay()
                en.record()
                torch.cuda.synchronize()
                ms = st.elapsed_time(en) / 160
                emit("host", f"h16 sq1 b{b} kv{n} dense bf16, 8 calls in a CUDA graph",
                     f"fagen.attention, LATENT_CAPTURED_MIN_WORK {flag}", f"{read / ms / 1e6 / 3008 * 100:.1f}%", ms,
                     f"{read / ms / 1e6:.0f} GB/s (of a 3008 GB/s copy); served by {served[0]}")
                g = outs = None
            hopper.LATENT_CAPTURED_MIN_WORK = None
            try:  # what this FlashMLA build offers for an fp8 cache (its wrapper's signature), and whether ncu is here
                import inspect
                import shutil
                fm = FlashMLA(True).fm
                print("FlashMLA flash_mla_with_kvcache" + str(inspect.signature(fm.flash_mla_with_kvcache))[:400],
                      "; ncu:", shutil.which("ncu"), flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"FlashMLA signature: {type(e).__name__}: {e}", flush=True)
            t = time.perf_counter()
            for _ in range(200):
                fagen.KernelSpec(head_dim=D, head_dim_v=DV, shared_kv=True, kind="decode", gqa=16, dtype="bf16",
                                 mask="none")
            emit("host", "KernelSpec(...) of the latent case", "(no GPU)",
                 f"{(time.perf_counter() - t) / 200 * 1e6:.1f} us host", None,
                 "built once a case since api._latent_spec")
            hopper.LATENT_MIN_WORK = 1
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(200):
                calls["fagen.attention (min work 1: gluon)"]()
            pr.disable()
            torch.cuda.synchronize()
            import io
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(18)
            print("cProfile, 200 calls of fagen.attention (gluon padded tile), by tottime:\n" + buf.getvalue()[-4000:],
                  flush=True)
        return

    from triton.testing import do_bench

    def bench(fn):
        if DRY:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return do_bench(fn, warmup=2, rep=10)

    def graph(fns, calls=8, total_ms=15.0):
        """ms a call of `calls` calls captured in one CUDA graph (alternating between fns) and replayed back to
        back: the GPU's time with no host time between calls (a serving engine's decode step); None if capture
        fails."""
        if DRY:
            return None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for f in fns:
                f()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                for i in range(calls):
                    fns[i % len(fns)]()
        except Exception as e:  # noqa: BLE001 - a path that cannot be captured: eager timings only
            print(f"graph capture failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
            torch.cuda.synchronize()
            return None
        g.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        n = max(3, min(200, int(total_ms / max((time.perf_counter() - t) * 1e3, 1e-3))))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / (n * calls)

    def loop(fns, total_ms=20.0):
        """ms a call, back to back with no L2 flush, alternating between fns on their own copies of the inputs."""
        if DRY:
            return bench(fns[0])
        for f in fns:
            f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        fns[0]()
        torch.cuda.synchronize()
        n = max(8, min(300, int(total_ms / max((time.perf_counter() - t) * 1e3, 1e-3))))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(n):
            fns[i % len(fns)]()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n

    x = torch.empty(1 << (20 if DRY else 30), dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    peak = (2 * x.numel() / bench(lambda: y.copy_(x)) / 1e6, 2 * x.numel() / loop([lambda: y.copy_(x)]) / 1e6)
    x = y = None  # free the copy buffers
    emit("time", "device copy (read + write)", "torch copy_", f"{peak[1]:.0f} GB/s", None,
         f"back to back; do_bench {peak[0]:.0f} GB/s")
    skip = set(json.loads(os.environ.get("GPU_MLADEC_S10_FAILED", "[]")))
    for b, n, hq, sq in SHAPES:
        case = f"h{hq} sq{sq} page{PAGE} b{b} kv{n}"
        ref_out, made = {}, {}
        for variant in VARIANTS:
            if (hq == 16 and variant in ROWS_ONLY) or (hq != 16 and variant not in H128):
                continue
            if variant in skip:
                emit("time", case, variant, "-", None, "not timed: its check failed")
                continue
            try:
                kv, form = VARIANTS[variant][:2]
                if (kv, form) not in made:  # one set of inputs (and a copy of the cache) a cache form and shape
                    made[(kv, form)] = (*inputs(variant, b, n, [n] * b, 5, hq=hq, sq=sq), None)
                    made[(kv, form)] = (*made[(kv, form)][:5], made[(kv, form)][1].clone())
                q, cache, table, lens, kw, cache2 = made[(kv, form)]
                m = module(variant, "causal", hq)
                c1 = lambda: m.forward(q, cache, None, block_table=table, seqlens_k=lens, scale=SCALE, **kw)  # noqa
                c2 = lambda: m.forward(q, cache2, None, block_table=table, seqlens_k=lens, scale=SCALE, **kw)  # noqa
                out = c1()[0]
                dkey = (kv, form)
                diff = "" if dkey not in ref_out else \
                    f"; max |diff| to {ref_out[dkey][0]} {(out.float() - ref_out[dkey][1]).abs().max().item():.1e}"
                ref_out.setdefault(dkey, (variant, out.float()))
                read = b * n * D * cache.element_size() + (b * n * 4 if form == "token" else 0) \
                    + q.numel() * 2 * (1 + DV / D)
                flops = 2 * (D + DV) * hq * b * (sq * n - sq * (sq - 1) // 2)
                ms_loop, ms_graph = loop([c1, c2]), graph([c1, c2])
                ms = ms_graph if ms_graph is not None else ms_loop
                value = f"{100 * read / ms / 1e6 / peak[1]:.1f}%" if hq == 16 else f"{flops / ms / 1e9:.0f} TF/s"
                emit("time", case, variant, value, ms,
                     ("CUDA graph" if ms_graph is not None else "eager (no graph)")
                     + f", {read / ms / 1e6:.0f} GB/s; eager back to back {ms_loop:.4f} ms "
                     f"{100 * read / ms_loop / 1e6 / peak[1]:.1f}% ({flops / ms_loop / 1e9:.0f} TF/s){diff}")
                q = cache = cache2 = table = lens = kw = c1 = c2 = None  # free the inputs before the next
            except Exception as e:  # noqa: BLE001
                import traceback
                traceback.print_exc(file=sys.stdout)
                emit("time", case, variant, "-", None, f"ERROR {type(e).__name__}: "
                     f"{(str(e).splitlines() or [''])[0][:150]}")
        del ref_out, made
        if not DRY:
            torch.cuda.empty_cache()


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        phase(sys.argv[2])
        return
    env = child_env("/tmp/fagen-cache-gpu-mladec-s10", ROOT)
    if "TRITON_INTERPRET" in os.environ:
        env["TRITON_INTERPRET"] = os.environ["TRITON_INTERPRET"]
    rows, logs, rcs = [], [], {}
    lock = threading.Lock()

    def on_line(line):
        with lock:
            logs.append(line)
            if line.startswith("ROW "):
                rows.append(json.loads(line[4:]))
                print(" | ".join(rows[-1]), flush=True)
            else:
                print(line, end="", flush=True)

    def run(name, limit):
        print(f"[{time.time() - T0:6.1f}s] #### phase {name} (timeout {limit}s)", flush=True)
        rc, _ = run_child(os.path.abspath(__file__), name, limit, env, on_line)
        rcs[name] = rc
        print(f"[{time.time() - T0:6.1f}s] #### phase {name}: rc={rc}", flush=True)

    threads = [threading.Thread(target=run, args=(g, LIMITS["check"])) for g in [*CHECK_GROUPS, "bench"]
               if g == "bench" or CHECK_GROUPS[g]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = sorted({r[2] for r in rows if r[0] == "check" and r[3] != "ok"}
                    | {v for g, vs in CHECK_GROUPS.items() if rcs.get(g) not in (0, None) for v in vs
                       if not any(r[0] == "check" and r[2] == v for r in rows)})
    env["GPU_MLADEC_S10_FAILED"] = json.dumps(failed)
    run("time", LIMITS["time"])
    run("host", LIMITS["host"])
    for n, rc in rcs.items():
        if rc != 0:
            rows.append([n, "(phase)", "-", "-", "", f"{'stopped' if n == 'bench' else 'ERROR'} rc={rc}"])
    text = "\n".join(["| section | case | impl | value | ms | note |", "|---|---|---|---|---|---|"]
                     + ["| " + " | ".join(r) + " |" for r in rows])
    print("\n" + text, flush=True)
    if os.environ.get("OUTX"):
        with open(os.path.join(os.environ["OUTX"], "gpu_mladec_s10.md"), "w") as f:
            f.write(text + "\n\n" + "".join(logs))
    bad = [r for r in rows if "ERROR" in r[5] or r[3] == "FAIL"]
    print(f"done in {time.time() - T0:.0f} s; {len(bad)} failures", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
