"""Paged fp8 KV-cache decode bandwidth (issue 27 part 2; docs/serving.md "Paged fp8 KV, ninth session"): the paged
fp8 decode against its candidates, the paged bf16 cache and the dense fp8 cache, each checked against float64.

    PYTHONPATH=$PWD python3 scripts/gpu_fp8kv_s9.py      # under ~70 s on an H100; one table; $OUT/gpu_fp8kv_s9.md
    GPU_FP8KV_S9_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_fp8kv_s9.py   # the CPU interpreter, tiny shapes

Phases, each in a child process with a timeout (a kernel that faults or hangs loses its phase, not the table):
1. check: d128 h32/8 paged (pages of 16 and 64), each candidate against the float64 reference on the dequantized
   cache (reference.dequantize), out within atol * max(1, T) + rtol * |o| (T: the reference on |V|), lse too, at
   lengths that are multiples of neither the page nor the key tile (1..1200); 28 sequences, so that the split rule
   takes one split as at the timed shapes and the check compiles the timed kernels. Per-head scales (1/8 .. 8) for
   every candidate, a per-tensor pair for the default; the kernel's result must FAIL against the reference on the
   cache's bytes read as bf16 and on the reference without the scales (so the check can fail).
2. paged: d128 h32/8 sq1, page 16 at b32 / b128 kv8192 and page 64 at b32 kv8192 / b128 kv4096: the paged bf16
   cache (vLLM's layout, and each page [H, page, D]), the dense fp8 cache, the paged fp8 candidates (per-head
   scales), and the default on three other arrangements of the same keys: pages [H, page, D] (a head's rows
   contiguous in a page), pages in order, and the dense cache viewed as pages (the dense kernel's bytes); GB/s of the bytes read (K and V, 1 byte an
   element for fp8) and % of a device copy (torch copy_ of 1 GB in the same process), timed back to back on two
   copies of the inputs (a decode loop: no L2 flush; the value) and under do_bench (the note; its flush costs
   ~17-21 us a call). Each row checks its last sequence against float64 first.
Candidates: text replacements on the render and tile fields ([Note] Paged prefetch (fp8, own V) in the decode
template). "before": the eighth session's paged default (m64n128w4s2, page numbers loaded in the step that uses
them, V converted in the operand).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for _phases
from _phases import child_env, run_phase as run_child  # noqa: E402

DRY = os.environ.get("GPU_FP8KV_S9_DRY") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
PHASES = {"check": 30, "paged": 40} if not DRY else {"check": 600, "paged": 600}
PF_OFF = [("PAGE_PREFETCH = tl.constexpr(True)", "PAGE_PREFETCH = tl.constexpr(False)")]
V_ON = [("V_ONCE = tl.constexpr(False and", "V_ONCE = tl.constexpr(True and")]
T = lambda n, w, s, m=64: dict(block_m=m, block_n=n, num_warps=w, num_stages=s)  # noqa: E731
# sm_90 ptxas (triton 3.6, ROWS 16, compiled on the CPU): before 168 registers, 40 KB; pf n128s2 168, 40 KB;
# pf n128s3 v 191, 104 KB; pf n128s2 v 190, 72 KB; pf n64s4 v 128, 70 KB (3 programs an SM fit); dense n128s3 v 168,
# 104 KB. pf n128s3 with V in the operand spills 8 bytes (left out).
# "u32": the row offsets as unsigned 32 x 32 -> 64-bit products (IMAD.WIDE.U32; valid while the strides fit 32 bits,
# as here): pf n128s3 v 191 -> 168 registers, 721 -> 693 SASS instructions a key step (the unmasked loop).
U32 = [("""            page = tl.minimum(tl.maximum(page_next, 0), num_pages - 1).to(tl.int64)  # [Note] Memory safety
            slot = (cols & ((1 << page_shift) - 1)).to(tl.int64)
            k_rows = page * stride_kb + slot * stride_kn
            v_rows = page * stride_vb + slot * stride_vn
""", """            page = tl.minimum(tl.maximum(page_next, 0), num_pages - 1).to(tl.uint32, bitcast=True).to(tl.uint64)
            slot = (cols & ((1 << page_shift) - 1)).to(tl.uint32, bitcast=True).to(tl.uint64)
            k_rows = (page * stride_kb.to(tl.uint32, bitcast=True).to(tl.uint64)
                      + slot * stride_kn.to(tl.uint32, bitcast=True).to(tl.uint64)).to(tl.int64, bitcast=True)
            v_rows = (page * stride_vb.to(tl.uint32, bitcast=True).to(tl.uint64)
                      + slot * stride_vn.to(tl.uint32, bitcast=True).to(tl.uint64)).to(tl.int64, bitcast=True)
            page = page.to(tl.int64, bitcast=True)
            slot = slot.to(tl.int64, bitcast=True)
""")]
# Round A (H100, 06:22 UTC; % of copy back to back at p16 b32 kv8k / p16 b128 kv8k / p64 b32 kv8k / p64 b128 kv4k):
# before 82 / 87 / 85 / 87, pf n128s2 (default) 84 / 88 / 86 / 88, pf n128s3 v 81 / 85 / 89 / 90, pf n128s2 v 80 /
# 85 / 83 / 85, pf n64s4 v 89 / 85 / 91 / 84 (3 programs an SM: 1024 programs at b128 are 2.6 waves), pf n128s3 v
# u32 81 / 85 / 89 / 91; dense fp8 96 / 101 / 96 / 99, bf16 paged 99 / 100 / 99 / 99; the default on the dense
# cache's bytes 90 / 93 / 90 / 91. Round B: 64-key blocks at 2 programs an SM (s5: 86 KB, s6: 102 KB; 128 registers)
# and 8 warps (sm_90 ptxas: n64s5 w8 101 registers, 86 KB; n128s3 w8 100, 104 KB: 16 warps an SM).
CANDS = {"before": (PF_OFF, T(128, 4, 2)), "default": ([], {}), "pf n64s5 v": (V_ON, T(64, 4, 5)),
         "pf n64s6 v": (V_ON, T(64, 4, 6)), "pf n64s5 w8 v": (V_ON, T(64, 8, 5)),
         "pf n128s3 w8 v": (V_ON, T(128, 8, 3)), "pf n128s3 v u32": (V_ON + U32, T(128, 4, 3))}
SHAPES = ((32, 8192, 16), (128, 8192, 16), (32, 32768, 16), (32, 8192, 64), (128, 4096, 64))  # (batch, keys, page)
# Round A's layout rows (the default on pages [H, page, D], on pages in order, on the dense cache's bytes; the bf16
# cache on pages [H, page, D]) are out of round B: LAYOUT_ROWS = [("fp8_e4m3", "paged hnd", "default"), ...].
LAYOUT_ROWS = []
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def phase(name):  # noqa: C901 - one phase in this process
    import torch

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from gpu_rows import T0, row
    from gpu_rows import bench as _bench

    import fagen
    from fagen.runtime.loader import load_source
    from fagen.verify import reference
    from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare

    dev = "cpu" if DRY else "cuda"
    E4M3 = torch.float8_e4m3fn
    HD, HKV, G = (32, 2, 4) if DRY else (128, 8, 4)

    def emit(section, case, impl, value, unit, ms, note=""):
        row(section, case, impl, value, unit, ms, note)
        print("ROW " + json.dumps([section, case, impl, "-" if value is None else f"{value:.1f} {unit}",
                                   "" if ms is None else f"{ms:.4f}", note]), flush=True)

    def guarded(section, case, impl, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a failure is a row, never the end of the phase
            import traceback
            emit(section, case, impl, None, "", None, f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:150]}")
            traceback.print_exc(file=sys.stdout)

    def bench(fn):
        return _bench(fn, DRY, warmup=10, rep=40)

    def loop(fns, total_ms=25.0):
        """ms a call, back to back with no L2 flush, alternating between the fns (each on its own copy of the
        inputs, larger than the L2): what a decode loop sees."""
        if DRY:
            return bench(fns[0])
        for f in fns:
            f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        fns[0]()
        torch.cuda.synchronize()
        n = max(8, min(400, int(total_ms / max((time.perf_counter() - t) * 1e3, 1e-3))))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(n):
            fns[i % len(fns)]()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n

    mods = {}

    def module(spec_kw, text):
        """The module of this spec with `text` ((old, new) replacements on the render) applied."""
        key = (json.dumps(spec_kw, sort_keys=True), tuple(text))
        if key not in mods:
            spec = fagen.KernelSpec(**spec_kw)
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

    def spec_kw(kv, layout, **tiles):
        return dict(head_dim=HD, gqa=G, dtype="bf16", kind="decode", kv_dtype=kv, layout=layout,
                    **({"block_n": 16} if DRY else tiles))

    def scales(shape, gen):
        return torch.exp2(torch.rand(shape, device=dev, generator=gen) * 6 - 3)  # log-uniform 1/8 .. 8

    def to_pages(x, page, order="", gen=None):
        """[B, H, S, D] (S a multiple of page) -> pages [B*S/page, page, H, D] and the table [B, S/page]: the pages
        in a random order, unless `order` has "in order" (page j of sequence i is page i*S/page + j); with "hnd" in
        `order` each page is stored [H, page, D] and viewed [page, H, D] (a head's rows contiguous in a page); "dense
        bytes": the dense cache viewed as pages."""
        b, h, s, d = x.shape
        n = s // page
        if order == "dense bytes":  # the dense cache itself as pages: page i*h*n + j is keys [j*page, (j+1)*page) of
            # sequence i, head 0; the head stride s*d reaches the other heads' rows (the same bytes, the same order)
            x = x.clone()  # each copy its own bytes
            cache = x.as_strided((b * h * n - (h - 1) * n, page, h, d), (page * d, d, s * d, 1))
            table = (torch.arange(b, device=dev)[:, None] * h * n + torch.arange(n, device=dev)).to(torch.int32)
            return cache, table
        perm = torch.arange(b * n, device=dev) if "in order" in order else torch.randperm(b * n, device=dev,
                                                                                          generator=gen)
        inv = perm.argsort()
        if "hnd" in order:
            cache = x.view(b, h, n, page, d).permute(0, 2, 1, 3, 4).reshape(b * n, h, page, d)[inv].transpose(1, 2)
        else:
            cache = x.view(b, h, n, page, d).permute(0, 2, 3, 1, 4).reshape(b * n, page, h, d)[inv]
        return cache, perm.to(torch.int32).view(b, n)

    def gathered(cache, table, i, n):
        """Sequence i's first n keys of a paged cache as [1, H, n, D] (float64 when cache is)."""
        return cache[table[i].long()].reshape(-1, cache.shape[2], cache.shape[3])[:n].transpose(0, 1)[None]

    def misread_bf16(x):
        """x's bytes read two at a time as bf16 (each value twice, to keep the width): a kernel reading the cache
        as bf16."""
        return x.view(torch.uint8).view(torch.bfloat16).double().nan_to_num(0.0).clamp(-1e4, 1e4)\
            .repeat_interleave(2, -1)

    def check(cand, page, form):
        b = 3 if DRY else 28  # 28 x 8 KV heads: one split, as at the timed shapes (the same kernels)
        gen = torch.Generator(device=dev).manual_seed(page)
        lens = torch.randint(1, (100 if DRY else 1200) + 1, (b,), device=dev, generator=gen, dtype=torch.int32)
        lens[0], lens[1] = (100, 7) if DRY else (1000, 77)  # neither a multiple of a page nor of a key tile
        width = -(-int(lens.max()) // page) + 1
        q = torch.randn(b, HKV * G, 1, HD, device=dev, generator=gen).mul(2).bfloat16()
        kc = torch.randn(b * width + 3, page, HKV, HD, device=dev, generator=gen).to(E4M3)
        vc = torch.randn(b * width + 3, page, HKV, HD, device=dev, generator=gen).to(E4M3)
        table = torch.randperm(b * width + 3, device=dev, generator=gen)[:b * width].to(torch.int32).view(b, width)
        ks, vs = (0.7, 1.6) if form == "tensor" else (scales((HKV,), gen), scales((HKV,), gen))
        m = module(spec_kw("fp8_e4m3", "paged", **CANDS[cand][1]), CANDS[cand][0])
        out, lse = m.forward(q, kc, vc, block_table=table, seqlens_k=lens, k_scale=ks, v_scale=vs)
        kd, vd = reference.dequantize(kc, ks, head_dim_axis=2), reference.dequantize(vc, vs, head_dim_axis=2)
        worst, far = 0.0, []
        for i in (0, 1, 2, b - 1):
            n = int(lens[i])
            k, v = gathered(kd, table, i, n), gathered(vd, table, i, n)
            want, wlse = reference.attention(q[i:i + 1].double(), k, v)
            terms, _ = reference.attention(q[i:i + 1].double(), k, v.abs())
            unit = terms.clamp(min=1.0)
            got = out[i:i + 1].double() / unit
            worst = max(worst, compare(f"out {i}", got, want / unit, **TOLERANCE["bf16"]))
            compare(f"lse {i}", lse[i:i + 1], wlse, **LSE_TOLERANCE)
            if i == 0:  # the check can fail: the cache read as bf16, or its scales dropped, is far from the result
                kb, vb = gathered(misread_bf16(kc), table, i, n), gathered(misread_bf16(vc), table, i, n)
                for what, (k2, v2) in (("read as bf16", (kb, vb)),
                                       ("no scales", (gathered(kc.double(), table, i, n),
                                                      gathered(vc.double(), table, i, n)))):
                    wrong, _ = reference.attention(q[i:i + 1].double(), k2, v2)
                    try:
                        compare(what, got, wrong / unit, **TOLERANCE["bf16"])
                    except AssertionError:
                        far.append(what)
                    else:
                        raise AssertionError(f"the result also matches the reference on the cache {what}")
        return worst, far

    if name == "check":
        runs = [("before", 16, "head"), ("default", 16, "head"), ("default", 16, "tensor"), ("default", 64, "head")] \
            + [(c, 16, "head") for c in CANDS if c not in ("before", "default")]
        for cand, page, form in runs:
            case = f"d128 h32/8 b28 paged page{page} e4m3 per-{form} scales, lengths 1..1200"

            def run():
                err, far = check(cand, page, form)
                emit("check", case, cand, None, "", None, f"ok, err {err:.1e}; fails as {' and as '.join(far)}")
            guarded("check", case, cand, run)
        return

    x = torch.empty(1 << (20 if DRY else 30), dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    peak = (2 * x.numel() / bench(lambda: y.copy_(x)) / 1e6, 2 * x.numel() / loop([lambda: y.copy_(x)]) / 1e6)
    del x, y
    emit(name, "device copy (read + write)", "torch copy_", peak[1], "GB/s", None,
         f"back to back; do_bench {peak[0]:.1f} GB/s")
    # layouts: dense, "paged" (shuffled pages [page, H, D]), "hnd" (a head's rows contiguous in a page), "in order"
    # (the pages of a sequence consecutive), "dense bytes" (the dense cache viewed as pages: the paged kernel on the
    # dense kernel's bytes, in its order): what the page table, the order of the pages and their layout cost
    rows = [("bf16", "paged", "default"), ("fp8_e4m3", "dense", "default")] \
        + [("fp8_e4m3", "paged", c) for c in CANDS] + [(kv, lay, c) for kv, lay, c in LAYOUT_ROWS]
    for b, sk, page in SHAPES:
        b, sk = (2, 128) if DRY else (b, sk)
        case = f"d128 h32/8 b{b} kv{sk} page{page}"
        gen = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(b, HKV * G, 1, HD, device=dev, generator=gen).mul(3).bfloat16()
        kb = torch.randn(b, HKV, sk, HD, device=dev, generator=gen, dtype=torch.bfloat16)
        vb = torch.randn(b, HKV, sk, HD, device=dev, generator=gen, dtype=torch.bfloat16)
        sc = dict(k_scale=scales((HKV,), gen), v_scale=scales((HKV,), gen))
        caches = {"bf16": (kb, vb, {}), "fp8_e4m3": (kb.to(E4M3), vb.to(E4M3), sc)}
        del kb, vb
        lens = torch.full((b,), sk, dtype=torch.int32, device=dev)
        calls = {}  # (kv, layout) -> [(args, keywords)] x 2 copies of the inputs (back to back: alternating)
        for kv, layout, _ in rows:
            k, v, kw = caches[kv]
            if layout == "dense":
                calls[kv, layout] = [((q, k, v), kw), ((q, k.clone(), v.clone()), kw)]
            elif (kv, layout) not in calls:
                order = layout[len("paged "):]
                pk = []
                for seed in (1, 2):  # two copies, each its own page order
                    g = torch.Generator(device=dev).manual_seed(seed)
                    kc, table = to_pages(k, page, order, g)
                    vc, _ = to_pages(v, page, order, g.manual_seed(seed))
                    pk.append(((q, kc, vc), dict(kw, block_table=table, seqlens_k=lens)))
                calls[kv, layout] = pk
        for kv, layout, cand in rows:
            impl = f"{'fp8 ' if kv != 'bf16' else 'bf16 '}{layout} {cand}"
            if time.time() - T0 > PHASES[name] - 3:
                emit(name, case, impl, None, "", None, "skipped: time budget")
                continue

            def run():
                k, v, kw = caches[kv]
                tx, tiles = CANDS[cand] if kv != "bf16" and layout.startswith("paged") else ([], {})
                m = module(spec_kw(None if kv == "bf16" else kv, layout.split()[0], **tiles), tx)
                (a, w), _ = calls[kv, layout]
                out, _ = m.forward(*a, **w)
                ref, _ = reference.attention(q[-1:, :G].double(),
                                             reference.dequantize(k[-1:, :1], kw["k_scale"][:1] if kw else None),
                                             reference.dequantize(v[-1:, :1], kw["v_scale"][:1] if kw else None))
                err = compare("out", out[-1:, :G], ref, **TOLERANCE["bf16"])
                read = k.numel() * k.element_size() + v.numel() * v.element_size()
                fns = [lambda a=a, w=w: m.forward(*a, **w) for a, w in calls[kv, layout]]
                ms_loop, ms = loop(fns), bench(fns[0])
                emit(name, case, impl, read / ms_loop / 1e6, "GB/s", ms_loop,
                     f"{100 * read / ms_loop / 1e6 / peak[1]:.0f}% of copy back to back; do_bench {ms:.4f} ms, "
                     f"{100 * read / ms / 1e6 / peak[0]:.0f}%; err {err:.1e}")
            guarded(name, case, impl, run)
        del caches, calls


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        phase(sys.argv[2])
        return
    t0 = time.time()
    env = child_env("/tmp/fagen-cache-gpu-fp8kv-s9", ROOT)
    if "TRITON_INTERPRET" in os.environ:  # a dry run keeps its interpreter
        env["TRITON_INTERPRET"] = os.environ["TRITON_INTERPRET"]
    rows, logs = [], []
    for name, limit in PHASES.items():
        print(f"[{time.time() - t0:6.1f}s] #### phase {name} (timeout {limit}s)", flush=True)
        rc, lines = run_child(os.path.abspath(__file__), name, limit, env,
                              lambda line: line.startswith("ROW ") or print(line, end="", flush=True))
        rows += [json.loads(line[4:]) for line in lines if line.startswith("ROW ")]
        logs += lines
        print(f"[{time.time() - t0:6.1f}s] #### phase {name}: rc={rc}", flush=True)
        if rc != 0:
            rows.append([name, "(phase)", "-", "-", "", f"ERROR rc={rc}"])
    text = "\n".join(["| section | case | impl | value | ms | note |", "|---|---|---|---|---|---|"]
                     + ["| " + " | ".join(r) + " |" for r in rows])
    print("\n" + text, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_fp8kv_s9.md"), "w") as f:
            f.write(text + "\n\n" + "".join(logs))
    failed = [r for r in rows if "ERROR" in r[5]]
    print(f"done in {time.time() - t0:.0f} s; {len(failed)} failures", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
