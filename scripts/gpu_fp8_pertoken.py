"""GPU checks and timings of per-token fp8 scales for the KV cache (README "fp8 KV cache", docs/serving.md
"Per-token scales", issue 27: MLA's latent cache in fp8 with one scale per token, as FlashMLA's fp8 variant and
vLLM's fp8_ds_mla take it).

    PYTHONPATH=$PWD python3 scripts/gpu_fp8_pertoken.py                # about 1.5 minutes on an H100; one table
    GPU_FP8_PERTOKEN_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_fp8_pertoken.py   # the CPU interpreter, tiny shapes

Writes one file, $OUT/gpu_fp8_pertoken.md (when OUT is set).

1. Checks against the float64 reference on the dequantized cache (x.double() * scale of its token): MLA 576/512
   e4m3 and e5m2, paged (page 64) and dense, Sq 1 and 2, scales log-uniform in [1/8, 8]; then one shape called with
   per-tensor, per-token, per-head and per-token scales in turn (the decode steps must not replay one form's kernel
   for another: [Note] Decode steps); a CUDA graph of plan(...).run with per-token scales, replayed after the
   scales change in place; a d128 h32/8 cache with separate k and v per-token scales. A wrong-token check: the
   reference with the scales shifted by one token must be far from the kernel's result.
2. Timing, MLA decode Hq 16 Sq 1 page 64 (causal, the split rule) at b32/b128 x kv 4k/32k: the bf16 cache, fp8
   e4m3 per tensor, fp8 e4m3 per token. GB/s of the bytes actually read (cache 2 or 1 bytes an element, per-token
   scales 4 bytes a token, q and out) and % of copy bandwidth; each row checked (the last sequence) first.
3. While the first 90 s last: e4m3 per token at b32 kv32k and b128 kv4k converted in registers (the asm marked
   impure), and with other latent tiles (block_n, warps, stages) beside the default m16n32w4s3.
"""

from __future__ import annotations

import os
import sys
import time

DRY = os.environ.get("GPU_FP8_PERTOKEN_DRY") == "1"
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
TILE = dict(block_n=16) if DRY else {}
BUDGET_S = 90  # the optional tile rows start only before this
# fp8 latent tiles beside the default m16n32w4s3 (chosen for the bf16 cache; [Note] Latent decode tiles): fp8 reads
# half the bytes a key, so longer key blocks or deeper pipelines may pay
FP8_TILES = ((64, 4, 3), (64, 8, 3), (32, 8, 4), (128, 8, 2), (64, 4, 4)) if not DRY else ((32, 4, 2),)


def bench(fn) -> float:
    return _bench(fn, DRY, warmup=25, rep=100)  # ms, median


def copy_bandwidth() -> float:
    x = torch.empty(1 << (20 if DRY else 30), dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e6


def mla_spec(kv, layout="paged", mask="causal", gqa=16, tiles=None):
    return fagen.KernelSpec(head_dim=D, head_dim_v=DV, shared_kv=True, kind="decode", gqa=gqa, dtype="bf16",
                            mask=mask, layout=layout, kv_dtype=kv, **(TILE if tiles is None else tiles))


def log_uniform(shape, gen):
    """Scales from 1/8 to 8, log-uniform: never all ones, far from 1 on most tokens."""
    return torch.exp2(torch.rand(shape, device=DEV, generator=gen) * 6 - 3)


def mla_inputs(kv, b, hq, sq, n, layout, seed=0):
    """q, an fp8 (or bf16) latent cache with its per-token scales, the layout's keywords, and a function giving
    sequence i's float64 keys [1, 1, n, D] dequantized with given scales (the cache's own by default)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, hq, sq, D, device=DEV, generator=gen).bfloat16()
    dtype = FP8[kv] if kv else torch.bfloat16
    if layout == "dense":
        cache = torch.randn(b, 1, n, D, device=DEV, generator=gen).to(dtype)
        scales = log_uniform((b, 1, n), gen)
        lkw = {}

        def keys(i, s=None):
            s = scales if s is None else s
            return cache[i:i + 1].double() * s[i:i + 1].double()[..., None]
        return q, cache, scales, lkw, keys
    pages = -(-n // PAGE)
    cache = torch.randn(b * pages, PAGE, 1, D, device=DEV, generator=gen).to(dtype)
    scales = log_uniform((b * pages, PAGE, 1), gen)
    table = torch.randperm(b * pages, device=DEV, generator=gen).to(torch.int32).view(b, pages)
    lens = torch.full((b,), n, dtype=torch.int32, device=DEV)

    def keys(i, s=None):
        s = scales if s is None else s
        rows = cache[table[i].long()].double() * s[table[i].long()].double()[..., None]  # [pages, PAGE, 1, D]
        return rows.reshape(-1, 1, D)[:n].transpose(0, 1)[None]
    return q, cache, scales, dict(block_table=table, seqlens_k=lens), keys


def compare_terms(name, got, want, terms, dtype="bf16"):
    """|got - want| <= atol * max(1, terms) + rtol * |want| elementwise, where `terms` is the reference's output on
    |V| (the softmax-weighted mean of the values' magnitudes): P @ V rounds P to q's type, an error relative to the
    terms, not to a result they cancel to. Per-token scales from 1/8 to 8 make some outputs a near cancellation of
    terms 64x apart, where bf16's absolute atol (made for terms of about 1) is too tight (docs/serving.md, "Per-token
    scales"). Returns the largest plain |error|."""
    unit = terms.clamp(min=1.0)
    compare(f"{name} (over max(1, terms))", got.double() / unit, want / unit, **TOLERANCE[dtype])
    return (got.double() - want).abs().max().item()


def check_rows(out, lse, q, keys, mask, which, scales=None):
    """Sequences `which` against the reference on their dequantized keys; the largest out error."""
    worst = 0.0
    for i in which:
        k = keys(i, scales)
        want, want_lse = reference.attention(q[i:i + 1].double(), k, None, head_dim_v=DV, mask=mask)
        terms, _ = reference.attention(q[i:i + 1].double(), k, k[..., :DV].abs(), mask=mask)
        worst = max(worst, compare_terms(f"out {i}", out[i:i + 1], want, terms))
        compare(f"lse {i}", lse[i:i + 1], want_lse, **LSE_TOLERANCE)
    return worst


def calibrate(q, cache, scales, lkw, keys, out, layout):
    """The same problem through the bf16 kernel on the dequantized cache rounded to bf16 (what a kernel without
    per-token scales would be given): its errors against the plain bf16 tolerance beside the per-token kernel's."""
    m = fagen.load(mla_spec(None, layout))
    deq = (cache.double() * scales.double()[..., None]).bfloat16()
    ob, _ = m.forward(q, deq, None, **lkw)
    notes = []
    for name, o in (("fp8 per-token", out), ("bf16 kernel on bf16(dequantized)", ob)):
        over, worst = 0, 0.0
        for i in range(q.shape[0]):
            want, _ = reference.attention(q[i:i + 1].double(), keys(i), None, head_dim_v=DV, mask="causal")
            e = (o[i:i + 1].double() - want).abs()
            over += int((e > TOLERANCE["bf16"]["atol"] + TOLERANCE["bf16"]["rtol"] * want.abs()).sum())
            worst = max(worst, e.max().item())
        notes.append(f"{name}: max err {worst:.2e}, {over} of {o.numel()} over the plain bf16 tolerance")
    row("check", "calibration (same problem)", "per-token vs dequantize-then-bf16", None, "", None, "; ".join(notes))


def mla_checks():
    for kv, layout, sq in (("fp8_e4m3", "paged", 1), ("fp8_e4m3", "paged", 2), ("fp8_e5m2", "paged", 2),
                           ("fp8_e4m3", "dense", 2), ("fp8_e5m2", "dense", 1)):
        n = S(1000) + 37  # not a multiple of the key block or the page
        case = f"{kv} {layout} b3 h16 sq{sq} kv{n}"

        def run():
            m = fagen.load(mla_spec(kv, layout))
            q, cache, scales, lkw, keys = mla_inputs(kv, 3, 16, sq, n, layout)
            out, lse = m.forward(q, cache, None, k_scale=scales, **lkw)
            err = check_rows(out, lse, q, keys, "causal", range(3))
            shifted = torch.roll(scales, 1, dims=2 if layout == "dense" else 1)  # each token takes its neighbour's
            try:
                check_rows(out, lse, q, keys, "causal", range(1), shifted)
                note = "NOT DISCRIMINATING: the shifted scales pass too"
            except AssertionError:
                note = "the shifted scales fail, as they must"
            row("check", case, "per-token k_scale", None, "", None, f"ok, err {err:.1e}; {note}")
            if kv == "fp8_e4m3" and layout == "paged" and sq == 2:
                calibrate(q, cache, scales, lkw, keys, out, layout)
        guarded("check", case, "per-token k_scale", run)
    case = f"fp8_e4m3 paged b3 h16 sq2 kv{S(700)}"

    def forms():  # one shape, the scale forms in turn: each step key holds its form ([Note] Decode steps)
        m = fagen.load(mla_spec("fp8_e4m3"))
        q, cache, scales, lkw, keys = mla_inputs("fp8_e4m3", 3, 16, 2, S(700), "paged", seed=1)
        errs = []
        for form in (0.7, scales, torch.tensor([1.3], device=DEV), scales, 0.7):
            out, lse = m.forward(q, cache, None, k_scale=form, **lkw)
            if isinstance(form, torch.Tensor) and form.dim() == 3:
                errs.append(check_rows(out, lse, q, keys, "causal", range(3)))
            else:
                full = form if isinstance(form, float) else float(form)
                errs.append(check_rows(out, lse, q, keys, "causal", range(3), torch.full_like(scales, full)))
        row("check", case, "forms 0.7, token, [1.3], token, 0.7", None, "", None,
            "ok; errs " + ", ".join(f"{e:.1e}" for e in errs))
    guarded("check", case, "scale forms", forms)
    case = f"fp8_e4m3 paged b4 h16 sq1 kv{S(900)} CUDA graph"

    def graph():
        m = fagen.load(mla_spec("fp8_e4m3"))
        q, cache, scales, lkw, keys = mla_inputs("fp8_e4m3", 4, 16, 1, S(900), "paged", seed=2)
        p = m.plan(4, 16, 1, lkw["block_table"].shape[1] * PAGE, device=DEV)
        out, lse = m.forward(q, cache, None, k_scale=scales, **lkw)
        if DRY:
            o, l_ = p.run(q, cache, None, k_scale=scales, **lkw)
            err = max(check_rows(out, lse, q, keys, "causal", range(4)), check_rows(o, l_, q, keys, "causal", range(4)))
            row("check", case, "forward, plan.run (no graph on the CPU)", None, "", None, f"ok, err {err:.1e}")
            return
        o, l_ = torch.empty_like(out), torch.empty_like(lse)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            p.run(q, cache, None, k_scale=scales, out=o, lse=l_, **lkw)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            p.run(q, cache, None, k_scale=scales, out=o, lse=l_, **lkw)
        scales.mul_(0.5).add_(0.1)  # new scales in place: the graph must read them
        g.replay()
        torch.cuda.synchronize()
        err = check_rows(o, l_, q, keys, "causal", range(4))
        row("check", case, "graph of plan.run, scales changed in place", None, "", None, f"ok, err {err:.1e}")
    guarded("check", case, "CUDA graph", graph)
    case = f"d128 h32/8 fp8_e4m3 b3 kv{S(1000) + 37} dense and paged"

    def separate():  # a cache with its own v: k and v per-token scales apart, and k per token with v per head
        n, errs = S(1000) + 37, []
        for layout in ("dense", "paged"):
            spec = fagen.KernelSpec(head_dim=128, gqa=4, dtype="bf16", kind="decode", kv_dtype="fp8_e4m3",
                                    mask="causal", layout=layout, **TILE)
            m = fagen.load(spec)
            gen = torch.Generator(device=DEV).manual_seed(4)
            q = torch.randn(3, 32, 1, 128, device=DEV, generator=gen).bfloat16()
            k, v = (torch.randn(3, 8, n, 128, device=DEV, generator=gen).to(FP8["fp8_e4m3"]) for _ in range(2))
            ks, vs = log_uniform((3, 8, n), gen), log_uniform((3, 8, n), gen)
            head = log_uniform((8,), gen)
            for v_form in (vs, head):
                kd = k.double() * ks.double()[..., None]
                vd = v.double() * (vs.double()[..., None] if v_form is vs else head.double()[None, :, None, None])
                want, want_lse = reference.attention(q.double(), kd, vd, mask="causal")
                terms, _ = reference.attention(q.double(), kd, vd.abs(), mask="causal")
                if layout == "dense":
                    out, lse = m.forward(q, k, v, k_scale=ks, v_scale=v_form)
                else:  # pages of PAGE keys in order, one sequence after another; scales as [pages, PAGE, Hkv]
                    pages = -(-n // PAGE)
                    pad = pages * PAGE - n

                    def paged(t):
                        t = torch.nn.functional.pad(t, (0, 0, 0, pad)) if t.dim() == 4 else \
                            torch.nn.functional.pad(t, (0, pad))
                        return t.view(3, 8, pages, PAGE, *t.shape[3:]).transpose(1, 2).transpose(2, 3) \
                            .reshape(3 * pages, PAGE, 8, *t.shape[3:])
                    kc, vc = paged(k.view(torch.uint8)).view(k.dtype), paged(v.view(torch.uint8)).view(v.dtype)
                    table = torch.arange(3 * pages, device=DEV, dtype=torch.int32).view(3, pages)
                    lens = torch.full((3,), n, dtype=torch.int32, device=DEV)
                    out, lse = m.forward(q, kc, vc, block_table=table, seqlens_k=lens, k_scale=paged(ks),
                                         v_scale=paged(vs) if v_form is vs else head)
                errs.append(compare_terms("out", out, want, terms))
                compare("lse", lse, want_lse, **LSE_TOLERANCE)
        row("check", case, "k per token; v per token, per head", None, "", None,
            "ok; errs " + ", ".join(f"{e:.1e}" for e in errs))
    guarded("check", case, "separate k/v", separate)


def mla_timing(peak):
    for b, n in ((32, 4096), (32, 32768), (128, 4096), (128, 32768)):
        b, n = B(b), S(n)
        case = f"h16 sq1 b{b} kv{n} page{PAGE}"
        for kv, form in ((None, "-"), ("fp8_e4m3", "tensor"), ("fp8_e4m3", "token")):
            impl = f"fagen {kv or 'bf16'}" + ("" if kv is None else f" per {form}")

            def run():
                m = fagen.load(mla_spec(kv, mask="causal"))
                q, cache, scales, lkw, keys = mla_inputs(kv, b, 16, 1, n, "paged", seed=5)
                kw = {} if kv is None else dict(k_scale=scales if form == "token" else 0.8)
                out, lse = m.forward(q, cache, None, **lkw, **kw)
                s = scales if form == "token" else torch.full_like(scales, 0.8 if kv else 1.0)
                err = check_rows(out, lse, q, keys, "causal", (b - 1,), s)
                ms = bench(lambda: m.forward(q, cache, None, **lkw, **kw))
                read = b * n * D * cache.element_size() + q.numel() * 2 + b * 16 * DV * 2
                if form == "token":
                    read += b * n * 4  # one float32 scale a token
                row("mla", case, impl, read / ms / 1e6, "GB/s", ms,
                    f"{100 * read / ms / 1e6 / peak:.0f}% of copy; {b / (ms * 1e-3):.0f} seq-steps/s; err {err:.1e}")
                del q, cache, scales
            guarded("mla", case, impl, run)
        if not DRY:
            torch.cuda.empty_cache()


def in_registers(spec):
    """The default tile with the e4m3 asm marked impure, so Triton converts each tile in registers after its load
    and keeps the bf16 tile in shared memory (no byte-wise reads of the 512-wide V operand); measured worse at d128
    (docs/serving.md, "The conversion"), not yet at MLA's width. The interpreter runs no asm: the same values."""
    source = fagen.generate(spec)
    if "is_pure=True" not in source:
        raise RuntimeError("is_pure=True not in the render")
    return load_source(source.replace("is_pure=True", "is_pure=False"), f"{spec.name}_inregs")


def fp8_tiles(peak):
    """Optional, while the budget lasts: e4m3 per token at b32 kv32k and b128 kv4k with other latent tiles."""
    for b, n in ((32, 32768), (128, 4096)):
        b, n = B(b), S(n)
        case = f"h16 sq1 b{b} kv{n} page{PAGE}"
        for bn, w, st in ((None, None, None),) + FP8_TILES:
            impl = "fagen fp8_e4m3 per token, converted in registers" if bn is None \
                else f"fagen fp8_e4m3 per token n{bn}w{w}s{st}"
            if time.time() - T0 > BUDGET_S:
                row("tiles", case, impl, None, "", None, "skipped: time budget")
                continue

            def run():
                tiles = dict(block_m=16, block_n=bn, num_warps=w, num_stages=st)
                m = in_registers(mla_spec("fp8_e4m3", tiles=TILE)) if bn is None else \
                    fagen.load(mla_spec("fp8_e4m3", tiles=tiles))
                q, cache, scales, lkw, keys = mla_inputs("fp8_e4m3", b, 16, 1, n, "paged", seed=5)
                out, lse = m.forward(q, cache, None, k_scale=scales, **lkw)
                err = check_rows(out, lse, q, keys, "causal", (b - 1,))
                ms = bench(lambda: m.forward(q, cache, None, k_scale=scales, **lkw))
                read = b * n * (D + 4) + q.numel() * 2 + b * 16 * DV * 2
                row("tiles", case, impl, read / ms / 1e6, "GB/s", ms,
                    f"{100 * read / ms / 1e6 / peak:.0f}% of copy; err {err:.1e}")
            guarded("tiles", case, impl, run)


def main() -> None:
    if not torch.cuda.is_available() and not DRY:
        sys.exit("gpu_fp8_pertoken.py needs a CUDA GPU (GPU_FP8_PERTOKEN_DRY=1 rehearses it on the CPU)")
    name = "CPU rehearsal" if DRY else torch.cuda.get_device_name()
    log(f"{name}  torch {torch.__version__}  triton {triton.__version__}  fagen {fagen.__file__}")
    peak = copy_bandwidth()
    row("mla", "device copy (read + write)", "torch copy_", peak, "GB/s", None)
    mla_checks()
    mla_timing(peak)
    fp8_tiles(peak)
    lines = ["| section | case | impl | value | ms | note |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in ROWS]
    text = "\n".join(lines)
    print("\n" + text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_fp8_pertoken.md"), "w") as f:
            f.write(text + "\n")
    # an optional tile that does not fit (shared memory) is a row, not a failure
    failed = [r for r in ROWS if r[0] != "tiles" and ("ERROR" in r[5] or "NOT DISCRIMINATING" in r[5])]
    log(f"done in {time.time() - T0:.0f} s; {len(failed)} failures")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
