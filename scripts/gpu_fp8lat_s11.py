"""MLA absorbed decode, eleventh session (issue 27 part 2): the fp8 latent decode at Hq 16 Sq 1 (>= 90% of copy
counted in the bytes read) beside FlashMLA's fp8 decode, and a profile (ncu) of the ninth session's lab kernel's step.

    FLASHMLA_DIR=/tmp/fm PYTHONPATH=$PWD python3 scripts/gpu_fp8lat_s11.py  # < 80 s on an H100; $OUTX/gpu_fp8lat_s11.md

Variants (VARIANTS): the product's Triton fp8 decode, the ninth session's lab fp8 swap-AB
(lab/gluon_mla_decode_fp8.py), the register-A scores kernel (lab/gluon_mla_decode_f8r.py, [Note] Lab register-A
scores) with its switches (F16, L_PART, PAGE_LATE), FlashMLA bf16 and fp8 (sglang-kernel 0.4.5, $FLASHMLA_DIR: q and
the cache in e4m3 with one descale a tensor). Round A's variants and what it dropped: the comment above VARIANTS and
docs/serving.md "MLA decode, eleventh session".
Phases, each a child process with a timeout (scripts/_phases.py):
1. check-* (beside the ncu phase): each variant against float64 on the dequantized cache at Hq 16 Sq 1, page 64,
   lengths 1000/77/513 (NaN past them, in the keys and their per-token scales), pages shuffled, the split rule and
   one split and three; the fp8 cache passed as float8_e4m3fn (read as fp8: a kernel reading it as bf16 fails).
   ncu: one launch each of the lab kernel, its variants, the Triton decode and FlashMLA fp8 at b128 kv4k under
   Nsight Compute (stall reasons, shared-memory and DRAM throughput, occupancy); the report under $OUTX.
2. time: a device copy, then each variant at b128 kv4k, b32 kv32k, b128 kv32k, b32 kv4k (Hq 16) and b32 kv8k (Hq 128
   Sq 2): % of copy over the bytes read (TF/s at Hq 128), 8 calls in a CUDA graph and eager back to back.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for _phases
from _phases import child_env, run_phase as run_child  # noqa: E402

DRY = os.environ.get("GPU_FP8LAT_S11_DRY") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D, DV, PAGE = (48, 32, 16) if DRY else (576, 512, 64)
# name -> (kv_dtype, scale form, backend, module kwargs, text replacements on the render)
# Round A (2026-11-27 13:48 UTC, results/fp8lat-A.txt) dropped: f8r bf16 without L_PART (57-62%, below the ninth
# session's kernel), EARLY (no change), the f8x ablations (no conversion 71-79%, no cross-warp max +3 points), the
# 656-byte FlashMLA cache (this build: "Dense FP8 decode is exposed via fwd_kvcache_mla_fp8"). Round B: L_PART 2 with
# F16, PAGE_LATE ([Note] Lab late page clamp), F16 per token ([Note] Lab warp max of the scales), FlashMLA
# fp8 with its (1,)-shaped descales.
VARIANTS = {  # in the order each shape times them (the phase may be cut at its limit)
    "e4m3/token triton (product)": ("fp8_e4m3", "token", "triton", {}, []),
    "e4m3/token lab s9 swap-AB": ("fp8_e4m3", "token", "lab", {}, []),  # lab/gluon_mla_decode_fp8.py
    "e4m3/tensor lab s9 f16": ("fp8_e4m3", "tensor", "lab", {"f16": True}, []),
    # lab/gluon_mla_decode_f8r.py
    "e4m3/tensor f8r f16": ("fp8_e4m3", "tensor", "f8r", {"f16": True}, []),
    "e4m3/tensor f8r f16 lmma": ("fp8_e4m3", "tensor", "f8r", {"f16": True, "l_part": 2}, []),
    "e4m3/tensor f8r f16 lmma late": ("fp8_e4m3", "tensor", "f8r", {"f16": True, "l_part": 2, "page_late": True}, []),
    "e4m3/tensor f8r f16 late": ("fp8_e4m3", "tensor", "f8r", {"f16": True, "page_late": True}, []),
    "e4m3/token f8r lpart": ("fp8_e4m3", "token", "f8r", {"l_part": 1}, []),
    "e4m3/token f8r lpart late": ("fp8_e4m3", "token", "f8r", {"l_part": 1, "page_late": True}, []),
    "e4m3/token f8r f16 lpart late": ("fp8_e4m3", "token", "f8r", {"f16": True, "l_part": 1, "page_late": True}, []),
    "e4m3/token f8r f16": ("fp8_e4m3", "token", "f8r", {"f16": True}, []),
    "e4m3/tensor f8r lmma late": ("fp8_e4m3", "tensor", "f8r", {"l_part": 2, "page_late": True}, []),
    "e4m3/tensor FlashMLA fp8 (q e4m3)": ("fp8_e4m3", "tensor", "flashmla8", {}, []),
    "bf16 FlashMLA": (None, None, "flashmla", {}, []),
    "e4m3/tensor triton": ("fp8_e4m3", "tensor", "triton", {}, []),
}
TIMING_ONLY = set()
ROWS_ONLY = set()
H128 = {"bf16 FlashMLA", "e4m3/token triton (product)", "e4m3/tensor triton", "e4m3/tensor FlashMLA fp8 (q e4m3)"}
CHECK_GROUPS = {"check-peer": ["bf16 FlashMLA", "e4m3/tensor FlashMLA fp8 (q e4m3)"],
                "check-fp8a": ["e4m3/token triton (product)", "e4m3/tensor triton"],
                "check-lab": ["e4m3/token lab s9 swap-AB", "e4m3/tensor lab s9 f16"],
                "check-f8r1": ["e4m3/tensor f8r f16", "e4m3/tensor f8r f16 lmma"],
                "check-f8r2": ["e4m3/tensor f8r f16 lmma late", "e4m3/tensor f8r f16 late"],
                "check-f8r3": ["e4m3/token f8r lpart", "e4m3/token f8r lpart late"],
                "check-f8r4": ["e4m3/tensor f8r lmma late"],
                "check-f8r5": ["e4m3/token f8r f16 lpart late", "e4m3/token f8r f16"]}
SHAPES = ((128, 4096, 16, 1), (32, 32768, 16, 1), (128, 32768, 16, 1), (32, 8192, 128, 2), (32, 4096, 16, 1)) \
    if not DRY else ((2, 96, 16, 1), (3, 64, 16, 1))
CHECK_LENS = [1000, 77, 513] if not DRY else [200, 7, 53]  # within 16 pages: the timed shapes' integer classes
LIMITS = dict(check=33, ncu=40, time=36) if not DRY else dict(check=900, ncu=900, time=900)
if DRY:  # the interpreter: tiny tiles; the gluon kernel has no interpreter (its sm_90 build is in the tests)
    VARIANTS = {k: (kv, f, be, {"block_n": 16}, tx) for k, (kv, f, be, _, tx) in VARIANTS.items()
                if be == "triton"}
    SHAPES = tuple(x for x in SHAPES if x[2] == 16)  # the gluon and lab kernels: sm_90 builds in the tests
    CHECK_GROUPS = {g: [v for v in vs if v in VARIANTS] for g, vs in CHECK_GROUPS.items()}
SCALE = 192 ** -0.5
T0 = T0P = time.time()


def emit(section, case, impl, value, ms, note):
    print("ROW " + json.dumps([section, case, impl, value, "" if ms is None else f"{ms:.4f}", note]), flush=True)


class FlashMLA:
    """FlashMLA (sglang-kernel 0.4.5, $FLASHMLA_DIR) as a decode module: forward(q, cache, None, ...) -> (out, None);
    its metadata computed once per lengths tensor (a serving engine computes it once a step for every layer).
    mode "bf16": the bf16 decode. "fp8": FlashMLA's fp8 decode (fwd_kvcache_mla_fp8: q and the cache e4m3, one
    descale a sequence each; q quantized here once per q tensor, outside the timing, as an engine's previous layer
    would hand it over), per-tensor k_scale only. "656": the 656-byte fp8 cache (512 e4m3, 4 float32 scales of 128
    values, 64 bf16 rope values a token) with a bf16 q, built once per cache from the e4m3 cache and its per-token
    scales (outside the timing)."""

    def __init__(self, causal, mode="bf16"):
        sys.path.insert(0, os.environ.get("FLASHMLA_DIR", "/tmp/fm"))
        from sgl_kernel import flash_mla
        if flash_mla._flashmla_import_error is not None:
            raise RuntimeError(f"flashmla_ops did not load: {flash_mla._flashmla_import_error}")
        self.fm, self.causal, self.mode, self.meta, self.prep = flash_mla, causal, mode, {}, {}

    def _q8(self, q):
        import torch
        key = ("q", q.data_ptr(), q.shape)
        if key not in self.prep:
            qf = q.transpose(1, 2).contiguous().float()
            dq = (qf.abs().amax() / 448.0).clamp(min=1e-12).reshape(1)  # this build: one descale a tensor, (1,)
            self.prep[key] = ((qf / dq).to(torch.float8_e4m3fn), dq.float().contiguous())
        return self.prep[key]

    def _c656(self, cache, k_scale):
        import torch
        key = ("c", cache.data_ptr(), cache.shape)
        if key not in self.prep:
            pages, page = cache.shape[:2]
            out = torch.empty(pages, page, 1, 656, dtype=torch.uint8, device=cache.device)
            out[..., :512] = cache.view(torch.uint8)[..., :512]
            ks = k_scale.float().reshape(pages, page, 1, 1).expand(pages, page, 1, 4).contiguous()
            out[..., 512:528] = ks.view(torch.uint8).reshape(pages, page, 1, 16)
            rope = (cache[..., 512:].float() * k_scale.float()[..., None]).bfloat16()
            out[..., 528:] = rope.view(torch.uint8).reshape(pages, page, 1, 128)
            self.prep[key] = out.view(torch.float8_e4m3fn)
        return self.prep[key]

    def forward(self, q, k, v, *, block_table, seqlens_k, scale, k_scale=None):
        import torch
        assert v is None
        b, hq, sq, _ = q.shape
        key = (seqlens_k.data_ptr(), hq * sq)
        if key not in self.meta:
            if self.mode == "fp8":
                self.meta[key] = self.fm.get_mla_metadata(seqlens_k, sq * hq, 1, is_fp8_kvcache=True)
            elif self.mode == "656":
                self.meta[key] = self.fm.get_mla_metadata(seqlens_k, sq * hq, 1, hq, is_fp8_kvcache=True)
            else:
                self.meta[key] = self.fm.get_mla_metadata(seqlens_k, sq * hq, 1)
        meta, splits = self.meta[key]
        if self.mode == "fp8":
            assert not isinstance(k_scale, torch.Tensor)
            q8, dq = self._q8(q)
            dk = self.prep.setdefault(("dk", float(k_scale)), torch.full((1, ), float(k_scale), dtype=torch.float32,
                                                                         device=q.device))
            out = self.fm.flash_mla_with_kvcache(q8, k, block_table, seqlens_k, DV, meta, splits, softmax_scale=scale,
                                                 causal=self.causal, descale_q=dq, descale_k=dk)[0]
        elif self.mode == "656":
            qf = q.transpose(1, 2).contiguous()
            out = self.fm.flash_mla_with_kvcache(qf, self._c656(k, k_scale), block_table, seqlens_k, DV, meta, splits,
                                                 softmax_scale=scale, causal=self.causal, is_fp8_kvcache=True)[0]
        else:
            assert k_scale is None
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
        if key not in mods and backend in ("lab", "f8x", "f8r"):
            sys.path.insert(0, ROOT)
            from lab import gluon_mla_decode_f8r, gluon_mla_decode_f8x, gluon_mla_decode_fp8
            mods[key] = {"lab": gluon_mla_decode_fp8, "f8x": gluon_mla_decode_f8x,
                         "f8r": gluon_mla_decode_f8r}[backend].Module(causal=mask == "causal", **tiles)
        if key not in mods and backend.startswith("flashmla"):
            mods[key] = FlashMLA(mask == "causal", {"flashmla": "bf16", "flashmla8": "fp8",
                                                    "flashmla656": "656"}[backend])
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

    if name.startswith("check"):
        for variant in CHECK_GROUPS[name]:
            hq, sq = (128, 2) if variant in ROWS_ONLY else (16, 1)
            peer = VARIANTS[variant][2].startswith("flashmla")
            q8 = VARIANTS[variant][2] == "flashmla8"  # q quantized to e4m3: its error reported, not judged
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
                        if q8:
                            err = (out[i:i + 1].double() / unit - want / unit).abs().max().item()
                            worst = max(worst, err if err == err else float("inf"))
                            continue
                        worst = max(worst, compare(f"out {i}", out[i:i + 1].double() / unit, want / unit,
                                                   **TOLERANCE["bf16"]))
                        if lse is not None:
                            compare(f"lse {i}", lse[i:i + 1].double(), wlse, **LSE_TOLERANCE)
                    if q8:
                        tol = TOLERANCE["bf16"]
                        emit("check", case, variant, "ok", None, f"err {worst:.1e} (q in e4m3: not judged; bf16's "
                             f"tolerance atol {tol['atol']}, rtol {tol['rtol']}); {time.time() - t:.1f} s")
                        continue
                    emit("check", case, variant, "ok", None, f"err {worst:.1e}; cache {cache.dtype} "
                         f"({cache.element_size()} B a value); {time.time() - t:.1f} s")
                except Exception as e:  # noqa: BLE001 - a failure is a row
                    import traceback
                    traceback.print_exc(file=sys.stdout)
                    emit("check", case, variant, "FAIL", None, f"ERROR {type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0][:150]}")
        return

    if name == "ncu":  # Nsight Compute over the ncu-target phase: metrics a kernel, then SASS-level stall samples
        ncu_phase()
        return

    if name == "ncu-target":  # one launch of each kernel under Nsight Compute (the ncu phase runs this)
        only = os.environ.get("FP8LAT_NCU_ONLY")
        sel = [v for v in NCU_VARIANTS if v in VARIANTS and (not only or v == only)]
        b, n = 128, 4096
        calls = []
        for variant in sel:
            try:
                q, cache, table, lens, kw = inputs(variant, b, n, [n] * b, 5)
                m = module(variant, "causal")
                fn = (lambda m=m, q=q, cache=cache, table=table, lens=lens, kw=kw:  # noqa: E731
                      m.forward(q, cache, None, block_table=table, seqlens_k=lens, scale=SCALE, **kw))
                fn()
                fn()
                calls.append((variant, fn))
            except Exception as e:  # noqa: BLE001
                print(f"ncu-target {variant}: {type(e).__name__}: {str(e).splitlines()[0][:150]}", flush=True)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for variant, fn in calls:
            fn()
            torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print("ncu-target launched: " + "; ".join(v for v, _ in calls), flush=True)
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
    skip = set(json.loads(os.environ.get("GPU_FP8LAT_S11_FAILED", "[]")))
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
                read = (b * n * 656 if VARIANTS[variant][2] == "flashmla656" else
                        b * n * D * cache.element_size() + (b * n * 4 if form == "token" else 0)) \
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


NCU_VARIANTS = ["e4m3/tensor lab s9 f16", "e4m3/tensor f8r f16 lmma late", "e4m3/tensor FlashMLA fp8 (q e4m3)"]
NCU = os.environ.get("NCU", "/usr/local/cuda/bin/ncu")
NCU_SECTIONS = ["SpeedOfLight", "LaunchStats", "Occupancy", "SchedulerStats", "WarpStateStats",
                "MemoryWorkloadAnalysis"]
NCU_KEYS = ["gpu__time_duration.sum", "launch__registers_per_thread", "launch__grid_size", "launch__block_size",
            "launch__shared_mem_per_block", "sm__warps_active.avg.pct_of_peak_sustained_active",
            "dram__throughput.avg.pct_of_peak_sustained_elapsed", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
            "smsp__issue_active.avg.pct_of_peak_sustained_active", "smsp__inst_executed.sum",
            "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
            "l1tex__throughput.avg.pct_of_peak_sustained_active"]


def _ncu_rows(text):
    import csv
    import io
    start = text.find('"ID"')
    if start < 0:
        return []
    return [r for r in csv.DictReader(io.StringIO(text[start:])) if r.get("ID", "").strip().isdigit()]


def _num(v):
    try:
        return float(str(v).replace(",", ""))
    except ValueError:
        return None


def ncu_phase():
    """ncu over `--phase ncu-target` (the NCU_VARIANTS at b128 kv4k, one launch each inside cudaProfilerStart/Stop):
    per kernel the NCU_KEYS and the 8 largest stall reasons (warps stalled per issued instruction); then for the
    ninth session's lab kernel the SASS lines with the most stall samples (SourceCounters). Raw files in $OUTX."""
    import subprocess
    out_dir = os.environ.get("OUTX") or "/tmp"
    env = child_env("/tmp/fagen-cache-gpu-fp8lat-s11", ROOT)
    target = [sys.executable, os.path.abspath(__file__), "--phase", "ncu-target"]
    t = time.time()
    raw = os.path.join(out_dir, "ncu_raw.csv")
    cmd = [NCU, "--profile-from-start", "off", "--clock-control", "none", "--csv", "--page", "raw"]
    for sec in NCU_SECTIONS:
        cmd += ["--section", sec]
    try:
        r = subprocess.run(cmd + target, env=env, capture_output=True, text=True, timeout=22)
    except subprocess.TimeoutExpired as e:
        print(f"ncu raw: timed out after 22 s; {str(e.stdout or '')[-300:]}", flush=True)
        r = subprocess.CompletedProcess(cmd, "timeout", "", "")
    with open(raw, "w") as f:
        f.write(r.stdout)
    print(f"ncu raw: rc {r.returncode}, {time.time() - t:.1f} s; " + " | ".join(
        x for x in (r.stderr + r.stdout).splitlines() if "ncu-target" in x or "==ERROR==" in x or "==WARNING==" in x)[:600],
        flush=True)
    for row in _ncu_rows(r.stdout):
        name = row.get("Kernel Name", "?")[:60]
        vals = {k.split(".")[0] if k != "gpu__time_duration.sum" else "us": row.get(k) for k in NCU_KEYS if k in row}
        if "us" in vals and _num(vals["us"]) is not None:
            vals["us"] = f"{_num(vals['us']) / 1e3:.1f}"
        stalls = sorted(((_num(v), k) for k, v in row.items() if "issue_stalled" in k and "per_issue_active" in k
                         and _num(v) is not None), reverse=True)[:8] or \
            sorted(((_num(v), k) for k, v in row.items() if "stalled" in k and _num(v) is not None), reverse=True)[:8]
        emit("ncu", "h16 sq1 b128 kv4k e4m3", name, vals.get("us", "-"), None,
             "; ".join(f"{k} {v}" for k, v in vals.items() if k != "us") + " || stalls: "
             + ", ".join(f"{k.split('stalled_')[-1].split('_per_issue')[0]} {v:.2f}" for v, k in stalls))
    for variant, kname in (("e4m3/tensor f8r f16 lmma late", "_mla_decode_f8r"), ):  # round A: the s9 kernel's
        left = LIMITS["ncu"] - 3 - (time.time() - T0P)
        if left < 6:
            print(f"ncu source {kname}: no time left", flush=True)
            continue
        ncu_source(variant, kname, env, target, out_dir, left)


def ncu_source(variant, kname, env, target, out_dir, limit):
    """The SASS lines of one kernel with the most stall samples (ncu's SourceCounters, one launch)."""
    import csv
    import subprocess
    t = time.time()
    src = [NCU, "--profile-from-start", "off", "--clock-control", "none", "-k", f"regex:{kname}",
           "--launch-count", "1", "--section", "SourceCounters", "--section", "WarpStateStats", "--csv", "--page",
           "source", "--print-source", "sass"]
    env = dict(env, FP8LAT_NCU_ONLY=variant)
    try:
        r = subprocess.run(src + target, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        print(f"ncu source {kname}: timed out", flush=True)
        return
    with open(os.path.join(out_dir, f"ncu_source{kname}.csv"), "w") as f:
        f.write(r.stdout)
    lines = r.stdout.splitlines()
    head = next((i for i, x in enumerate(lines) if "Source" in x and "," in x and "Address" in x), None)
    print(f"ncu source {kname}: rc {r.returncode}, {time.time() - t:.1f} s, {len(lines)} lines", flush=True)
    if head is None:
        print("\n".join(lines[:8] + r.stderr.splitlines()[-4:])[:1500], flush=True)
        return
    table = list(csv.reader(lines[head:]))
    cols = table[0]
    pick = [i for i, c in enumerate(cols) if "Stall Sampling (All" in c or "Warp Stall Sampling" in c]
    if not pick:
        print("ncu source columns: " + "; ".join(cols)[:1500], flush=True)
        return
    k = pick[0]
    body = [x for x in table[1:] if len(x) > k and _num(x[k]) is not None]
    total = sum(_num(x[k]) for x in body) or 1
    src_col = next((i for i, c in enumerate(cols) if c == "Source"), 1)
    print(f"ncu source {kname}: {len(body)} SASS lines, {total:.0f} stall samples; the 24 largest:", flush=True)
    for x in sorted(body, key=lambda x: -_num(x[k]))[:24]:
        print(f"  {100 * _num(x[k]) / total:5.1f}%  {x[0][:8]}  {x[src_col][:110]}", flush=True)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        phase(sys.argv[2])
        return
    env = child_env("/tmp/fagen-cache-gpu-fp8lat-s11", ROOT)
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

    threads = [threading.Thread(target=run, args=(g, LIMITS["check"])) for g in CHECK_GROUPS if CHECK_GROUPS[g]]
    if not DRY:
        threads.append(threading.Thread(target=run, args=("ncu", LIMITS["ncu"])))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = sorted({r[2] for r in rows if r[0] == "check" and r[3] != "ok"}
                    | {v for g, vs in CHECK_GROUPS.items() if rcs.get(g) not in (0, None) for v in vs
                       if not any(r[0] == "check" and r[2] == v for r in rows)})
    env["GPU_FP8LAT_S11_FAILED"] = json.dumps(failed)
    run("time", LIMITS["time"])
    for n, rc in rcs.items():
        if rc != 0:
            rows.append([n, "(phase)", "-", "-", "", f"{'stopped' if n == 'ncu' else 'ERROR'} rc={rc}"])
    text = "\n".join(["| section | case | impl | value | ms | note |", "|---|---|---|---|---|---|"]
                     + ["| " + " | ".join(r) + " |" for r in rows])
    print("\n" + text, flush=True)
    if os.environ.get("OUTX"):
        with open(os.path.join(os.environ["OUTX"], "gpu_fp8lat_s11.md"), "w") as f:
            f.write(text + "\n\n" + "".join(logs))
    bad = [r for r in rows if "ERROR" in r[5] or r[3] == "FAIL"]
    print(f"done in {time.time() - T0:.0f} s; {len(bad)} failures", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
