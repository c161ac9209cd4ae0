"""GPU checks and timings of the fp8 KV cache (docs/serving.md "An fp8 KV cache", issue 27): the decode kernel's
fp8 conversion ([Note] fp8 conversion in the decode template) and MLA's fp8 latent cache.

    PYTHONPATH=$PWD python3 scripts/gpu_fp8kv.py              # about 2 minutes on an H100; one table; $OUT/gpu_fp8kv.md
    GPU_FP8KV_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_fp8kv.py   # the same code on the CPU interpreter, tiny shapes

1. The conversion on the device: all 256 bytes of e4m3 and e5m2 through the module's _fp8_to into bf16 and fp16
   (e4m3 into bf16: the asm; the others: Triton's cast), bitwise against torch's .to() (finite values), and what
   the specials read as.
2. Decode d128 h32/8 (gqa 4) at b32 kv8192, b8 kv32768, b128 kv4096: the bf16 cache, e4m3 and e5m2, and e4m3 with
   Triton's cast (.to() on the tile: `_FP8_ASM` off) in the same run; GB/s of the bytes actually read (k and v, 1
   byte an element for fp8) and % of copy. Each is checked
   against the float64 reference on the dequantized cache (one batch entry, one KV group). While the first minute
   lasts, at b32 kv8192: fp16 queries, e4m3 tiles beside the default m64n64w4s3, and a paged e4m3 cache (page
   16) beside a paged bf16 one.
3. MLA's fp8 latent cache (576/512, V = the cache's first 512 columns, one scale): k_scale 0.7, then a per-head
   tensor, then 0.7 again on one shape (e4m3 dense, e5m2 paged), a tree mask on an e5m2 paged cache with
   both scale forms; each call against the reference. Then the same with the decode steps' key of before (which
   did not hold the scales' form: [Note] Decode steps) on the float-then-tensor order, which must be wrong (a
   tensor-then-float replay would load through a null pointer, so it is not run). Timing at h16 sq1 b32 kv4096
   page64: bf16, e4m3, e5m2.
"""

from __future__ import annotations

import os
import sys
import time

DRY = os.environ.get("GPU_FP8KV_DRY") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from gpu_rows import ROWS, T0, guarded, log, row  # noqa: E402
from gpu_rows import bench as _bench  # noqa: E402

import fagen  # noqa: E402
from fagen.runtime.loader import load_source  # noqa: E402
from fagen.spec.axes import DType  # noqa: E402
from fagen.verify import reference  # noqa: E402
from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare  # noqa: E402

DEV = "cpu" if DRY else "cuda"
S = (lambda n: max(48, n // 256)) if DRY else (lambda n: n)
B = (lambda n: min(n, 2)) if DRY else (lambda n: n)
D, DV = (48, 32) if DRY else (576, 512)  # MLA
PAGE = 16 if DRY else 64
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
BUDGET_S = 60  # the optional rows (fp16 queries, tiles) start only before this


def bench(fn) -> float:
    return _bench(fn, DRY, warmup=25, rep=100)  # ms, median


def patched(spec, old, new, tag):
    """The spec's module with one text replaced (a variant of the render measured beside it)."""
    source = fagen.generate(spec)
    if old not in source:
        raise RuntimeError(f"{tag}: {old!r} not in the render")
    return load_source(source.replace(old, new), f"{spec.name}_{tag}")


def without_asm(spec):
    """The module with the conversion of before: x.to(q's type) on the tile ([Note] fp8 conversion)."""
    return patched(spec, "_FP8_ASM = tl.constexpr(not _INTERPRET)", "_FP8_ASM = tl.constexpr(False)", "to")


def old_step_key(spec):
    """The module whose decode steps' key does not hold the scales' form ([Note] Decode steps), as before."""
    return patched(spec, ", k_scales is None, v_scales is None, k_tokens", ", k_tokens", "oldkey")


def copy_bandwidth() -> float:
    x = torch.empty(1 << (20 if DRY else 30), dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e6


# -- 1. the conversion on the device ------------------------------------------------------------------------------
@triton.jit
def _convert(X, Y, FN: tl.constexpr):
    """A [32, 128] tile of bytes (each of the 256 values 16 times) through FN, as the decode kernel's tiles go."""
    offs = tl.arange(0, 32)[:, None] * 128 + tl.arange(0, 128)[None, :]
    tl.store(Y + offs, FN(tl.load(X + offs)))


def conversion():
    for kv in FP8:
        for qdt in ("bf16", "fp16"):
            case = f"all 256 bytes {kv} -> {qdt}"

            def run():
                m = fagen.load(fagen.KernelSpec(head_dim=128, gqa=4, dtype=qdt, kind="decode", kv_dtype=kv))
                qtype = getattr(torch, "bfloat16" if qdt == "bf16" else "float16")
                x = torch.arange(256, dtype=torch.uint8, device=DEV).repeat(16).view(FP8[kv])
                y = torch.empty(4096, dtype=qtype, device=DEV)
                _convert[(1,)](x, y, m._fp8_to, num_warps=4)
                want = x.to(qtype)
                finite = torch.isfinite(want)
                exact = torch.equal(y[finite].view(torch.int16), want[finite].view(torch.int16))
                specials = sorted({f"{v:g}" for v in y[~finite].float().abs().tolist()})
                row("convert", case, "fagen _fp8_to", None, "", None,
                    f"{'bit-exact' if exact else 'NOT EXACT'} on {int(finite.sum()) // 16} finite values; "
                    f"specials read as |x| in {specials}")
                if not exact:
                    raise AssertionError(f"{case}: the conversion differs from torch's .to()")
            guarded("convert", case, "fagen _fp8_to", run)


# -- 2. fp8 decode, d128 ---------------------------------------------------------------------------------------------
def decode_inputs(b, hq, hkv, sk, d, kv_dtype, qtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, hq, 1, d, device=DEV, generator=gen).mul(3).to(qtype)
    k = torch.randn(b, hkv, sk, d, device=DEV, generator=gen)
    v = torch.randn(b, hkv, sk, d, device=DEV, generator=gen)
    if kv_dtype is None:
        return q, k.to(qtype), v.to(qtype), {}
    kw = dict(k_scale=(0.5 + torch.rand(hkv, device=DEV, generator=gen)),
              v_scale=(0.5 + torch.rand(hkv, device=DEV, generator=gen)))
    return q, k.to(FP8[kv_dtype]), v.to(FP8[kv_dtype]), kw


def check_decode(m, q, k, v, kw, dtype):
    g = q.shape[1] // k.shape[1]
    ref, ref_lse = reference.attention(q[-1:, :g], k[-1:, :1], v[-1:, :1],
                                       **{n: (t[:1] if isinstance(t, torch.Tensor) else t) for n, t in kw.items()})
    out, lse = m.forward(q, k, v, **kw)
    compare("lse", lse[-1:, :g], ref_lse, **LSE_TOLERANCE)
    return compare("out", out[-1:, :g], ref, **TOLERANCE[dtype])


def fp8_decode(peak):
    shapes = ((32, 8192), (8, 32768), (128, 4096))
    for i, (b, sk) in enumerate(shapes):
        b, sk = B(b), S(sk)
        case = f"d128 h32/8 b{b} kv{sk}"
        impls = [(None, "bf16", False, {}), ("fp8_e4m3", "bf16", False, {}), ("fp8_e5m2", "bf16", False, {}),
                 ("fp8_e4m3", "bf16", True, {})]
        if i == 0:  # optional rows, while the budget lasts: fp16 queries, and tiles beside the default m64n64w4s3
            impls += [("fp8_e4m3", "fp16", False, {}), ("fp8_e5m2", "fp16", False, {}), (None, "fp16", False, {})]
            impls += [("fp8_e4m3", "bf16", False, dict(block_n=bn, num_warps=w, num_stages=st))
                      for bn, w, st in ((64, 8, 3), (128, 8, 2), (32, 4, 4), (64, 4, 2))]
        for kv, qdt, old, tiles in impls:
            impl = f"fagen {kv or qdt}" + (" .to()" if old else "") + (" q fp16" if qdt == "fp16" and kv else "")
            impl += " n{block_n}w{num_warps}s{num_stages}".format(**tiles) if tiles else ""
            if (qdt == "fp16" or tiles) and time.time() - T0 > BUDGET_S:
                row("fp8", case, impl, None, "", None, "skipped: time budget")
                continue

            def run():
                spec = fagen.KernelSpec(head_dim=128, gqa=4, dtype=qdt, kind="decode", kv_dtype=kv, **tiles)
                m = without_asm(spec) if old else fagen.load(spec)
                qtype = torch.bfloat16 if qdt == "bf16" else torch.float16
                q, k, v, kw = decode_inputs(b, 32, 8, sk, 128, kv, qtype)
                err = check_decode(m, q, k, v, kw, spec.dtype)
                ms = bench(lambda: m.forward(q, k, v, **kw))
                read = k.numel() * k.element_size() + v.numel() * v.element_size()
                row("fp8", case, impl, read / ms / 1e6, "GB/s", ms,
                    f"{100 * read / ms / 1e6 / peak:.0f}% of copy; {b / (ms * 1e-3):.0f} seq-steps/s; err {err:.1e}")
            guarded("fp8", case, impl, run)


def paged_decode(peak):
    """Optional: a paged fp8 cache (page 16, the paged default tile n128w4s2) beside a paged bf16 one."""
    b, sk, page = B(32), S(8192), 16
    case = f"d128 h32/8 b{b} kv{sk} page{page}"
    for kv in (None, "fp8_e4m3"):
        impl = f"fagen paged {kv or 'bf16'}"
        if time.time() - T0 > BUDGET_S:
            row("fp8", case, impl, None, "", None, "skipped: time budget")
            continue

        def run():
            spec = fagen.KernelSpec(head_dim=128, gqa=4, dtype="bf16", kind="decode", kv_dtype=kv, layout="paged")
            m = fagen.load(spec)
            q, k, v, kw = decode_inputs(b, 32, 8, sk, 128, kv)
            pages = sk // page
            perm = torch.randperm(b * pages, device=DEV).to(torch.int32)
            kc, vc = (t.view(b, 8, pages, page, 128).permute(0, 2, 3, 1, 4).reshape(b * pages, page, 8, 128)
                      [perm.argsort().long()] for t in (k, v))
            table = perm.view(b, pages)
            lens = torch.full((b,), sk, dtype=torch.int32, device=DEV)
            out, _ = m.forward(q, kc, vc, block_table=table, seqlens_k=lens, **kw)
            ref, _ = reference.attention(q[-1:, :4], k[-1:, :1], v[-1:, :1],
                                         **{n: (t[:1] if isinstance(t, torch.Tensor) else t) for n, t in kw.items()})
            err = compare("out", out[-1:, :4], ref, **TOLERANCE[spec.dtype])
            ms = bench(lambda: m.forward(q, kc, vc, block_table=table, seqlens_k=lens, **kw))
            read = kc.numel() * kc.element_size() * 2
            row("fp8", case, impl, read / ms / 1e6, "GB/s", ms,
                f"{100 * read / ms / 1e6 / peak:.0f}% of copy; err {err:.1e}")
        guarded("fp8", case, impl, run)


# -- 3. MLA's fp8 latent cache ---------------------------------------------------------------------------------------
def mla_spec(kv, mask="causal", layout="paged", gqa=16):
    return fagen.KernelSpec(head_dim=D, head_dim_v=DV, shared_kv=True, kind="decode", gqa=gqa, dtype="bf16",
                            mask=mask, layout=layout, kv_dtype=kv)


def mla_inputs(kv, b, hq, sq, n, layout, seed=0):
    """q, a latent cache (dense [b, 1, n, D], or pages of PAGE keys shuffled) in fp8 and each sequence's keys."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, hq, sq, D, device=DEV, generator=gen).bfloat16()
    if layout == "dense":
        cache = torch.randn(b, 1, n, D, device=DEV, generator=gen).to(FP8[kv] if kv else torch.bfloat16)
        return q, cache, {}, [cache[i:i + 1] for i in range(b)]
    pages = -(-n // PAGE)
    cache = torch.randn(b * pages, PAGE, 1, D, device=DEV, generator=gen).to(FP8[kv] if kv else torch.bfloat16)
    table = torch.randperm(b * pages, device=DEV, generator=gen).to(torch.int32).view(b, pages)
    lens = torch.full((b,), n, dtype=torch.int32, device=DEV)
    keys = [cache[table[i].long()].reshape(-1, 1, D)[:n].transpose(0, 1)[None] for i in range(b)]
    return q, cache, dict(block_table=table, seqlens_k=lens), keys


def mla_check(m, q, cache, layout_kw, keys, mask, k_scale, tree=None):
    """Each of the first two sequences against the float64 reference on the dequantized cache; the largest error."""
    extra = {} if tree is None else dict(tree_mask=tree)
    out, lse = m.forward(q, cache, None, k_scale=k_scale, **layout_kw, **extra)
    worst = 0.0
    for i in range(min(2, q.shape[0])):
        ks = k_scale.cpu() if isinstance(k_scale, torch.Tensor) else k_scale
        want, want_lse = reference.attention(q[i:i + 1].cpu(), keys[i].cpu(), None, head_dim_v=DV, mask=mask,
                                             k_scale=ks, **({} if tree is None else dict(tree_mask=tree[i:i + 1].cpu())))
        worst = max(worst, compare(f"out {i}", out[i:i + 1].cpu(), want, **TOLERANCE[DType.BF16]))
        compare(f"lse {i}", lse[i:i + 1].cpu(), want_lse, **LSE_TOLERANCE)
    return worst


def mla_checks():
    head = torch.tensor([1.3], device=DEV)
    for kv, layout in (("fp8_e4m3", "dense"), ("fp8_e5m2", "paged")):
        case = f"{kv} {layout} b3 h16 sq2 kv{S(700)}"

        def run():
            m = fagen.load(mla_spec(kv, layout=layout))
            q, cache, lkw, keys = mla_inputs(kv, 3, 16, 2, S(700), layout)
            errs = [mla_check(m, q, cache, lkw, keys, "causal", s) for s in (0.7, head, 0.7, head)]
            row("mla-check", case, "k_scale 0.7, [1.3], 0.7, [1.3]", None, "", None,
                "ok; errs " + ", ".join(f"{e:.1e}" for e in errs))
        guarded("mla-check", case, "scales", run)
    case = f"fp8_e5m2 paged tree b3 h16 sq5 kv{S(300)}"

    def tree():
        m = fagen.load(mla_spec("fp8_e5m2", mask="tree"))
        q, cache, lkw, keys = mla_inputs("fp8_e5m2", 3, 16, 5, S(300), "paged", seed=3)
        parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3], [-1, -1, 0, 1, 1]], dtype=torch.int32,
                               device=DEV)
        errs = [mla_check(m, q, cache, lkw, keys, "tree", s, tree=parents) for s in (head, 0.7, head, 0.5)]
        row("mla-check", case, "tree, scales [1.3], 0.7, [1.3], 0.5", None, "", None,
            "ok; errs " + ", ".join(f"{e:.1e}" for e in errs))
    guarded("mla-check", case, "tree", tree)
    case = f"fp8_e4m3 paged b3 h16 sq2 kv{S(700)}"

    def old_key():  # the diagnosis: a step replayed with per-head scales into a kernel built for a float
        m = old_step_key(mla_spec("fp8_e4m3"))
        q, cache, lkw, keys = mla_inputs("fp8_e4m3", 3, 16, 2, S(700), "paged")
        mla_check(m, q, cache, lkw, keys, "causal", 0.7)
        try:
            err = mla_check(m, q, cache, lkw, keys, "causal", head)
            note = f"passed (err {err:.1e}): the old key is not the cause"
        except AssertionError as e:
            note = f"wrong as expected: {str(e).splitlines()[0][:100]}"
        row("mla-check", case, "old step key: 0.7 then [1.3]", None, "", None, note)
    if not DRY:  # the interpreter has no decode steps
        guarded("mla-check", case, "old step key", old_key)


def mla_timing(peak):
    b, n, hq = B(32), S(4096), 16
    case = f"h{hq} sq1 b{b} kv{n} page{PAGE}"
    for kv in (None, "fp8_e4m3", "fp8_e5m2"):
        def run():
            m = fagen.load(mla_spec(kv, mask="none"))
            q, cache, lkw, keys = mla_inputs(kv, b, hq, 1, n, "paged", seed=5)
            ks = {} if kv is None else dict(k_scale=0.8)
            out, _ = m.forward(q, cache, None, **lkw, **ks)
            want, _ = reference.attention(q[-1:], keys[-1], None, head_dim_v=DV, **ks)
            err = compare("out", out[-1:], want, **TOLERANCE[DType.BF16])
            ms = bench(lambda: m.forward(q, cache, None, **lkw, **ks))
            read = b * n * D * cache.element_size() + q.numel() * 2 * (1 + DV / D)
            row("mla", case, f"fagen {kv or 'bf16'}", read / ms / 1e6, "GB/s", ms,
                f"{100 * read / ms / 1e6 / peak:.0f}% of copy; err {err:.1e}")
        guarded("mla", case, f"fagen {kv or 'bf16'}", run)


def main() -> None:
    if not torch.cuda.is_available() and not DRY:
        sys.exit("gpu_fp8kv.py needs a CUDA GPU (GPU_FP8KV_DRY=1 rehearses it on the CPU)")
    name = "CPU rehearsal" if DRY else torch.cuda.get_device_name()
    log(f"{name}  torch {torch.__version__}  triton {triton.__version__}  fagen {fagen.__file__}")
    peak = copy_bandwidth()
    row("fp8", "device copy (read + write)", "torch copy_", peak, "GB/s", None)
    if not DRY:  # the interpreter runs no asm: the device conversion is the GPU's to check
        conversion()
    fp8_decode(peak)
    mla_checks()
    paged_decode(peak)
    mla_timing(peak)
    lines = ["| section | case | impl | value | ms | note |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in ROWS]
    text = "\n".join(lines)
    print("\n" + text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_fp8kv.md"), "w") as f:
            f.write(text + "\n")
    failed = [r for r in ROWS if "ERROR" in r[5] or "NOT EXACT" in r[5]]
    log(f"done in {time.time() - T0:.0f} s; {len(failed)} failures")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
