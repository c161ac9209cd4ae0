"""fp8 and MLA decode speed (issue 27; docs/serving.md "The conversion" and "An fp8 latent cache"): the decode
kernel with V converted once in its load layout ([Note] V converted once in the decode template) against the pure
conversion of before, and fp8 latent tiles, beside the bf16 cache, in one table.

    PYTHONPATH=$PWD python3 scripts/gpu_decode_s5.py               # under ~100 s on an H100; $OUT/gpu_decode_s5.md
    GPU_DECODE_S5_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_decode_s5.py   # the CPU interpreter, tiny shapes

Every variant is built first, in parallel worker processes (its launches at the timed shapes), then each is
checked against the float64 reference on the dequantized cache (the last sequence) before it is
timed; a variant that fails its check is a row with ERROR and is not timed. Variants are the module's render with
one text replaced (`V_ONCE` on or off; K converted once too).
1. MLA 576/512, Hq 16, Sq 1, page 64, causal, the split rule: b32 kv4k, b128 kv32k (then, after 2., b32 kv32k,
   b128 kv4k). The bf16 cache; e4m3 with
   per-token scales: the pure conversion (before), V once (m16n32w4s3, the default tile) and V once at other
   latent tiles; e5m2 per token, V once.
2. d128 h32/8 (gqa 4), dense, b32 kv8192 and b128 kv4096: bf16, e4m3 and e5m2 per-head scales, pure and V once,
   e4m3 with K converted once too, e4m3 V once at other tiles (n64w8s3, n32w4s4, n64w4s4).
GB/s of the bytes actually read (cache 2 or 1 bytes an element, per-token scales 4 bytes a token, q and out) and
% of a device copy (read + write) timed here. No new variant starts after BUDGET_S seconds.
"""

from __future__ import annotations

import os
import sys
import time

DRY = os.environ.get("GPU_DECODE_S5_DRY") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

from gpu_rows import ROWS, T0, guarded, log, row  # noqa: E402
from gpu_rows import bench as _bench  # noqa: E402

import fagen  # noqa: E402
from fagen.runtime.loader import load_source  # noqa: E402
from fagen.verify import reference  # noqa: E402
from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare  # noqa: E402

DEV = "cpu" if DRY else "cuda"
S = (lambda n: max(40, n // 512)) if DRY else (lambda n: n)
B = (lambda n: min(n, 2)) if DRY else (lambda n: n)
D, DV = (48, 32) if DRY else (576, 512)  # MLA
PAGE = 16 if DRY else 64
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
BUDGET_S = 85
MLA_TILE = dict(block_n=16) if DRY else {}
# fp8 latent tiles beside the default m16n32w4s3, V once (sm_90 ptxas: n64w8s3 221 registers, 157 KB; n64w4s2
# spills 10 words)
MLA_TILES = ((64, 8, 3), (32, 8, 3)) if not DRY else ((32, 4, 2),)

ON = "V_ONCE = tl.constexpr(True and not _INTERPRET)"
OFF = "V_ONCE = tl.constexpr(False and not _INTERPRET)"


def bench(fn) -> float:
    return _bench(fn, DRY, warmup=25, rep=100)  # ms, median


def copy_bandwidth() -> float:
    x = torch.empty(1 << (20 if DRY else 30), dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e6


def variant(spec, form):
    """The spec's module as rendered ("default"), or with V converted once ("once") or not ("pure"), or with K
    converted once too ("kv once")."""
    source = fagen.generate(spec)
    if form == "default" or spec.kv_dtype is None:
        return fagen.load(spec)
    if ON not in source and OFF not in source:
        raise RuntimeError("V_ONCE not in the render")
    source = source.replace(ON, OFF) if form == "pure" else source.replace(OFF, ON)
    if form == "kv once":
        old = "        k = _fp8_to(k)\n"
        if old not in source:
            raise RuntimeError(f"{old!r} not in the render")
        source = source.replace(old, "        k = _fp8_v(k)\n")
    return load_source(source, f"{spec.name}_{form.replace(' ', '')}")


def over_budget(section, case, impl):
    if time.time() - T0 > BUDGET_S:
        row(section, case, impl, None, "", None, "skipped: time budget")
        return True
    return False


# -- 1. MLA -------------------------------------------------------------------------------------------------------
def mla_spec(kv, tiles=None):
    return fagen.KernelSpec(head_dim=D, head_dim_v=DV, shared_kv=True, kind="decode", gqa=16, dtype="bf16",
                            mask="causal", layout="paged", kv_dtype=kv, **(MLA_TILE if tiles is None else tiles))


def mla_inputs(kv, b, n, seed=5):
    """q, a paged latent cache (shuffled pages) with per-token scales in [1/8, 8], the layout's keywords, and
    sequence i's float64 keys [1, 1, n, D], dequantized."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, 16, 1, D, device=DEV, generator=gen).bfloat16()
    pages = -(-n // PAGE)
    cache = torch.randn(b * pages, PAGE, 1, D, device=DEV, generator=gen).to(FP8[kv] if kv else torch.bfloat16)
    scales = torch.exp2(torch.rand((b * pages, PAGE, 1), device=DEV, generator=gen) * 6 - 3)
    table = torch.randperm(b * pages, device=DEV, generator=gen).to(torch.int32).view(b, pages)
    lens = torch.full((b,), n, dtype=torch.int32, device=DEV)

    def keys(i):
        rows = cache[table[i].long()].double()
        if kv:
            rows = rows * scales[table[i].long()].double()[..., None]
        return rows.reshape(-1, 1, D)[:n].transpose(0, 1)[None]
    return q, cache, scales, dict(block_table=table, seqlens_k=lens), keys


def mla_check(out, lse, q, keys):
    """The last sequence against the reference, out within atol * max(1, T) + rtol * |o| (T: the reference on |V|,
    as scripts/gpu_fp8_pertoken.py bounds per-token scales' near cancellations); the largest |error|."""
    i = q.shape[0] - 1
    k = keys(i)
    want, want_lse = reference.attention(q[i:i + 1].double(), k, None, head_dim_v=DV, mask="causal")
    terms, _ = reference.attention(q[i:i + 1].double(), k, k[..., :DV].abs(), mask="causal")
    unit = terms.clamp(min=1.0)
    compare("out (over max(1, terms))", out[i:i + 1].double() / unit, want / unit, **TOLERANCE["bf16"])
    compare("lse", lse[i:i + 1], want_lse, **LSE_TOLERANCE)
    return (out[i:i + 1].double() - want).abs().max().item()


MLA_SHAPES = ((32, 4096), (128, 32768), (32, 32768), (128, 4096))
MLA_IMPLS = [(None, "default", None), ("fp8_e4m3", "pure", None), ("fp8_e4m3", "once", None)]
MLA_IMPLS += [("fp8_e4m3", "once", dict(block_m=16, block_n=bn, num_warps=w, num_stages=s)) for bn, w, s in MLA_TILES]
MLA_IMPLS += [("fp8_e5m2", "once", None)]


def mla_impl(kv, form, tiles):
    impl = f"{kv or 'bf16'}" + ("" if kv is None else f" per token, {form}")
    return impl + (" n{block_n}w{num_warps}s{num_stages}".format(**tiles) if tiles else "")


def mla(peak, shapes):
    for b, n in shapes:
        b, n = B(b), S(n)
        case = f"MLA h16 sq1 b{b} kv{n} page{PAGE}"
        for kv in (None, "fp8_e4m3", "fp8_e5m2"):
            inputs = None
            for kv_, form, tiles in MLA_IMPLS:
                impl = mla_impl(kv_, form, tiles)
                if kv_ != kv or over_budget("mla", case, impl):
                    continue

                def run():
                    nonlocal inputs
                    m = variant(mla_spec(kv, tiles), form)
                    if inputs is None:
                        inputs = mla_inputs(kv, b, n)
                    q, cache, scales, lkw, keys = inputs
                    kw = dict(k_scale=scales) if kv else {}
                    out, lse = m.forward(q, cache, None, **lkw, **kw)
                    err = mla_check(out, lse, q, keys)
                    ms = bench(lambda: m.forward(q, cache, None, **lkw, **kw))
                    read = b * n * D * cache.element_size() + q.numel() * 2 + b * 16 * DV * 2 + (b * n * 4 if kv else 0)
                    row("mla", case, impl, read / ms / 1e6, "GB/s", ms,
                        f"{100 * read / ms / 1e6 / peak:.0f}% of copy; err {err:.1e}")
                guarded("mla", case, impl, run)
            inputs = None
            if not DRY:
                torch.cuda.empty_cache()


# -- 2. d128 ------------------------------------------------------------------------------------------------------
def d128_inputs(b, sk, kv, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, 32, 1, 128, device=DEV, generator=gen).mul(3).bfloat16()
    k = torch.randn(b, 8, sk, 128, device=DEV, generator=gen)
    v = torch.randn(b, 8, sk, 128, device=DEV, generator=gen)
    if kv is None:
        return q, k.bfloat16(), v.bfloat16(), {}
    kw = dict(k_scale=(0.5 + torch.rand(8, device=DEV, generator=gen)),
              v_scale=(0.5 + torch.rand(8, device=DEV, generator=gen)))
    return q, k.to(FP8[kv]), v.to(FP8[kv]), kw


D128_SHAPES = ((32, 8192), (128, 4096))
# (cache, form, tile): the default tile m64n64w4s3, then V once at other tiles (sm_90 ptxas, e4m3 V once: n64w8s3
# 80 registers, 55 KB; n32w4s4 93, 38 KB; n64w4s4 126, 71 KB; the default 126, 55 KB)
D128_IMPLS = [(None, "default", None), ("fp8_e4m3", "pure", None), ("fp8_e4m3", "once", None),
              ("fp8_e4m3", "kv once", None), ("fp8_e5m2", "pure", None), ("fp8_e5m2", "once", None)]
D128_IMPLS += [("fp8_e4m3", "once", dict(block_m=64, block_n=bn, num_warps=w, num_stages=s))
               for bn, w, s in ((64, 8, 3), (32, 4, 4), (64, 4, 4))]


def d128_spec(kv, tiles):
    return fagen.KernelSpec(head_dim=128, gqa=4, dtype="bf16", kind="decode", kv_dtype=kv, **(tiles or {}))


def d128(peak):
    for b, sk in D128_SHAPES:
        b, sk = B(b), S(sk)
        case = f"d128 h32/8 b{b} kv{sk}"
        for kv, form, tiles in D128_IMPLS:
            impl = f"{kv or 'bf16'}" + ("" if kv is None else f" per head, {form}")
            impl += " n{block_n}w{num_warps}s{num_stages}".format(**tiles) if tiles else ""
            if over_budget("d128", case, impl):
                continue

            def run():
                m = variant(d128_spec(kv, tiles), form)
                q, k, v, kw = d128_inputs(b, sk, kv)
                ref, ref_lse = reference.attention(
                    q[-1:, :4], k[-1:, :1], v[-1:, :1],
                    **{n: (t[:1] if isinstance(t, torch.Tensor) else t) for n, t in kw.items()})
                out, lse = m.forward(q, k, v, **kw)
                compare("lse", lse[-1:, :4], ref_lse, **LSE_TOLERANCE)
                err = compare("out", out[-1:, :4], ref, **TOLERANCE["bf16"])
                del ref, ref_lse
                ms = bench(lambda: m.forward(q, k, v, **kw))
                read = k.numel() * k.element_size() + v.numel() * v.element_size() + 2 * q.numel() * 2
                row("d128", case, impl, read / ms / 1e6, "GB/s", ms,
                    f"{100 * read / ms / 1e6 / peak:.0f}% of copy; err {err:.1e}")
            guarded("d128", case, impl, run)


def _warm(job):
    """One variant's kernels built for every launch its timed shapes take (the same shapes, uninitialised
    caches: values do not change what compiles), in a worker process: the timing pass then finds them in
    Triton's cache. Returns None or the error's first line (the timing pass reports it as its row)."""
    try:
        section, kv, form, tiles = job
        if section == "mla":
            m = variant(mla_spec(kv, tiles), form)
            for b, n in MLA_SHAPES:
                b, n = B(b), S(n)
                pages = -(-n // PAGE)
                q = torch.zeros(b, 16, 1, D, device=DEV, dtype=torch.bfloat16)
                cache = torch.zeros(b * pages, PAGE, 1, D, device=DEV, dtype=torch.uint8 if kv else torch.bfloat16)
                cache = cache.view(FP8[kv]) if kv else cache
                lkw = dict(block_table=torch.arange(b * pages, device=DEV, dtype=torch.int32).view(b, pages),
                           seqlens_k=torch.full((b,), n, dtype=torch.int32, device=DEV))
                kw = dict(k_scale=torch.ones(b * pages, PAGE, 1, device=DEV)) if kv else {}
                m.forward(q, cache, None, **lkw, **kw)
                del q, cache
        else:
            m = variant(d128_spec(kv, tiles), form)
            for b, sk in D128_SHAPES:
                b, sk = B(b), S(sk)
                q, k, v, kw = d128_inputs(b, sk, kv)
                m.forward(q, k, v, **kw)
                del q, k, v
        if not DRY:
            torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def warm():
    """Every variant built in parallel worker processes first (a build takes seconds, a timing a fraction)."""
    import concurrent.futures
    import multiprocessing
    jobs = [("mla", kv, form, tiles) for kv, form, tiles in MLA_IMPLS]
    jobs += [("d128", kv, form, tiles) for kv, form, tiles in D128_IMPLS]
    with concurrent.futures.ProcessPoolExecutor(max_workers=2 if DRY else min(len(jobs), 16),
                                                mp_context=multiprocessing.get_context("spawn")) as pool:
        for job, err in zip(jobs, pool.map(_warm, jobs)):
            if err:
                log(f"warm {job}: {err}")
    log("warm: built")


def main() -> None:
    if not torch.cuda.is_available() and not DRY:
        sys.exit("gpu_decode_s5.py needs a CUDA GPU (GPU_DECODE_S5_DRY=1 rehearses it on the CPU)")
    name = "CPU rehearsal" if DRY else torch.cuda.get_device_name()
    log(f"{name}  torch {torch.__version__}  triton {triton.__version__}  fagen {fagen.__file__}")
    warm()
    peak = copy_bandwidth()
    row("copy", "device copy (read + write)", "torch copy_", peak, "GB/s", None)
    mla(peak, MLA_SHAPES[:2])
    d128(peak)
    mla(peak, MLA_SHAPES[2:])
    lines = ["| section | case | impl | value | ms | note |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in ROWS]
    text = "\n".join(lines)
    print("\n" + text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_decode_s5.md"), "w") as f:
            f.write(text + "\n")
    failed = [r for r in ROWS if "ERROR" in r[5]]
    log(f"done in {time.time() - T0:.0f} s; {len(failed)} failures")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
