"""MLA absorbed bf16 decode and batch-invariant decode, twelfth session (issue 27 parts 1 and 3).

    FLASHMLA_DIR=/tmp/fm PYTHONPATH=$PWD python3 scripts/gpu_mladec_s12.py  # < 70 s on an H100

Phases, each a child process with a timeout (scripts/_phases.py); check-a, check-b, warm and warm2 side by side
(their compiles):
1. check-a/b: the gluon decode's swap-AB tile ([Note] Swap-AB tile, SWAP_AB_ROWS 16) and the seesaw's padded tile
   against float64 at Hq 16 Sq 1 (mask none, dense and paged, page 64, lengths 1000/77/513/0 with NaN past them,
   pages shuffled) and Hq 8 Sq 2 causal, the split rule, one split, three and batch_invariant (SAB_INVARIANT's and
   128-key chunks); invariance bitwise (sequence 2 alone against its row in the batch); bad pages and lengths (no
   fault, sequence 0 unchanged); fagen.attention on a dense Hq 16 cache.
2. warm, warm2 (beside the checks): the seesaw's builds the time phase takes, the d128 decode's the inv phase takes.
3. time: % of copy over the latent bytes read at Hq 16 Sq 1 b128 kv4k, b32 kv32k, b128 kv32k, b32 kv4k: the
   product (round B: the swap-AB tile, 128-column merge slices), fagen.attention on the dense cache (the bench's
   path), the session's start (the seesaw's padded tile, whole merge), FlashMLA bf16 (paged), in CUDA graphs of 8
   calls and under do_bench (the bench's method: L2 flushed between calls), the rows' order rotated, medians.
4. inv: what batch_invariant=True costs against False (do_bench and CUDA graph medians, order rotated): d128 h32/8
   dense b1/b32 kv4k/kv32k through fagen.attention (the serving bench's rows); MLA h16 b1/b32/b128 kv4k/kv32k through
   fagen.attention and the swap-AB tile's candidate rules (SAB_INVARIANT).
5. bench: `fagen bench --suite serving` on the absorbed bf16 rows (b128 kv4k, b32 kv32k), fagen only.
6. memcheck (beside the checks): compute-sanitizer memcheck over gpu_memcheck_fuzz.py's mla_gluon group at Hq 16.
Round A (2026-11-27 16:59 UTC, this script at 42fdd46) timed the swap-AB tile against the padded seesaw off by
default, two splits at b128, 128-column merge slices, the d128 grid (forward_split 8) and rules 1024/16, 4096/16,
and SAB_INVARIANT 512/16, 2048/8, 4096/1 (docs/serving.md, twelfth session).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _phases import child_env, run_phase  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMITS = {"check-a": 19, "check-b": 19, "warm": 19, "warm2": 19, "memcheck": 21, "time": 14, "inv": 16, "bench": 13}
D, DV, PAGE = 576, 512, 64
SCALE = 192 ** -0.5
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:5.1f}s]", *a, flush=True)


def gluon_mod(layout, hq, mask):
    import fagen
    return fagen.load(fagen.KernelSpec(head_dim=D, head_dim_v=DV, shared_kv=True, kind="decode", gqa=hq,
                                       dtype="bf16", mask=mask, layout=layout, backend="gluon"))


class Sab:
    """A module's forward with SWAP_AB_ROWS set for the call (0: the seesaw's padded tile; 16: the swap-AB tile)."""

    def __init__(self, m, rows):
        self.m, self.rows = m, rows

    def __getattr__(self, name):
        fn = getattr(self.m, name)

        def call(*a, **kw):
            old = self.m.SWAP_AB_ROWS
            self.m.SWAP_AB_ROWS = self.rows
            try:
                return fn(*a, **kw)
            finally:
                self.m.SWAP_AB_ROWS = old
        return call


class FlashMLA:
    def __init__(self, causal=False):
        sys.path.insert(0, os.environ.get("FLASHMLA_DIR", "/tmp/fm"))
        from sgl_kernel import flash_mla
        if flash_mla._flashmla_import_error is not None:
            raise RuntimeError(f"flashmla_ops did not load: {flash_mla._flashmla_import_error}")
        self.fm, self.causal, self.meta = flash_mla, causal, {}

    def forward(self, q, k, v, *, block_table, seqlens_k, scale):
        b, hq, sq, _ = q.shape
        key = (seqlens_k.data_ptr(), hq * sq)  # the caller clears meta between shapes (round A reused an address)
        if key not in self.meta:
            self.meta[key] = self.fm.get_mla_metadata(seqlens_k, sq * hq, 1)
        meta, splits = self.meta[key]
        qf = q.transpose(1, 2).contiguous()
        out = self.fm.flash_mla_with_kvcache(qf, k, block_table, seqlens_k, DV, meta, splits, softmax_scale=scale,
                                             causal=self.causal)[0]
        return out.transpose(1, 2), None


CHECKS = {"check-a": (("paged", 16, 1, "none"), ), "check-b": (("dense", 16, 1, "none"), ("paged", 8, 2, "causal"))}


def check_phase(name):
    import torch

    from fagen.verify import reference
    from fagen.verify.tolerances import PropertyFailure, TOLERANCE, compare
    from fagen.spec.axes import DType

    tol = TOLERANCE[DType.BF16]
    g = torch.Generator(device="cuda").manual_seed(12)
    lens_l = [1000, 77, 513, 0]
    worst = 0.0
    for layout, hq, sq, mask in CHECKS[name]:
        m = gluon_mod(layout, hq, mask)
        b = len(lens_l)
        pages = 17
        cache = torch.randn(b * pages, PAGE, 1, D, device="cuda", generator=g).bfloat16()
        table = torch.randperm(b * pages, device="cuda", generator=g).to(torch.int32).view(b, pages)
        lens = torch.tensor(lens_l, dtype=torch.int32, device="cuda")
        if layout == "dense":
            table = torch.arange(b * pages, device="cuda", dtype=torch.int32).view(b, pages)
            lens = torch.full((b, ), 1000, dtype=torch.int32, device="cuda")
        flat = cache.view(b, pages * PAGE, D)
        for i in range(b):  # NaN past each length (in the pages it owns)
            rows = flat.view(-1, PAGE, D)[table[i].long()].view(-1, D)
            rows[int(lens[i]):] = float("nan")
            flat.view(-1, PAGE, D)[table[i].long()] = rows.view(-1, PAGE, D)
        q = torch.randn(b, hq, sq, D, device="cuda", generator=g).bfloat16()
        if layout == "dense":
            k = cache.view(b, 1, pages * PAGE, D)[:, :, :1000]
            kw = {}
        else:
            k = cache
            kw = dict(block_table=table, seqlens_k=lens)
        want = []
        for i in range(b):
            n = int(lens[i])
            kk = cache.view(-1, PAGE, D)[table[i].long()].view(-1, D)[:n].view(1, 1, n, D)
            w, wl = reference.attention(q[i:i + 1].double(), kk.double(), None, head_dim_v=DV, scale=SCALE,
                                        mask=mask) if n else (torch.zeros(1, hq, sq, DV, dtype=torch.float64),
                                                              torch.full((1, hq, sq), float("-inf")))
            want.append((w, wl))
        for rows in ((0, 16) if (layout, hq) == ("paged", 16) else (16, )):
            mm = Sab(m, rows)
            for how in ("rule", 1, 3, "inv", "inv128", "3 cols128"):
                if how == "3 cols128":  # [Note] Merge column slices
                    out, lse = with_consts(m, dict(MERGE_COLS=128), mm.forward_split, q, k, None, scale=SCALE,
                                           num_splits=3, **kw)
                    o_ref, l_ref = mm.forward_split(q, k, None, scale=SCALE, num_splits=3, **kw)
                    log(f"MERGE COLS {layout} h{hq} {'swapAB' if rows else 'seesaw'}: sliced vs whole",
                        "same bits" if torch.equal(out, o_ref) and torch.equal(lse, l_ref) else "DIFFERENT")
                elif how == "inv":
                    out, lse = mm.forward(q, k, None, scale=SCALE, batch_invariant=True, **kw)
                elif how == "inv128":  # [Note] Swap-AB invariant chunks of 128 keys: up to 8 a sequence here
                    out, lse = with_consts(m, dict(SAB_INVARIANT=(128, 8)), mm.forward, q, k, None, scale=SCALE,
                                           batch_invariant=True, **kw)
                elif how == "rule":
                    out, lse = mm.forward(q, k, None, scale=SCALE, **kw)
                else:
                    out, lse = mm.forward_split(q, k, None, scale=SCALE, num_splits=how, **kw)
                torch.cuda.synchronize()
                errs = []
                for i in range(b):
                    w, wl = want[i]
                    if int(lens[i]) == 0:
                        ok = bool((out[i] == 0).all()) and bool(torch.isneginf(lse[i]).all())
                        errs.append(0.0 if ok else float("inf"))
                        continue
                    try:
                        errs.append(compare("out", out[i:i + 1], w, **tol))
                    except PropertyFailure as e:
                        log(f"  seq {i}: {str(e)[:160]}")
                        errs.append(float("inf"))
                    e = (lse[i].double() - wl[0].to(lse.device)).abs().max().item()
                    errs.append(0.0 if e < 1e-3 else float("inf"))
                err = max(errs)
                worst = max(worst, err)
                log(f"CHECK {layout} h{hq} sq{sq} {mask} {'swapAB' if rows else 'seesaw'} {how}: max err {err:.1e}",
                    "ok" if err < float("inf") else "FAIL")
            # invariance: the batch's sequence 2 alone (its own pages / keys) against its row
            for rule in ((1024, 8), (128, 8)):
                o, lse = with_consts(m, dict(SAB_INVARIANT=rule), mm.forward, q, k, None, scale=SCALE,
                                     batch_invariant=True, **kw)
                if layout == "dense":
                    o1, l1 = with_consts(m, dict(SAB_INVARIANT=rule), mm.forward, q[2:3].clone(), k[2:3].clone(),
                                         None, scale=SCALE, batch_invariant=True)
                else:
                    own = -(-int(lens[2]) // PAGE)
                    o1, l1 = with_consts(m, dict(SAB_INVARIANT=rule), mm.forward, q[2:3].clone(), cache, None,
                                         scale=SCALE, batch_invariant=True, block_table=table[2:3, :own].clone(),
                                         seqlens_k=lens[2:3].clone())
                same = torch.equal(o[2], o1[0]) and torch.equal(lse[2], l1[0])
                log(f"INVARIANT {layout} h{hq} sq{sq} {'swapAB' if rows else 'seesaw'} {rule}: alone vs batch",
                    "same bits" if same else "DIFFERENT")
            if layout == "paged":  # bad pages and lengths: no fault, sequence 0 keeps its bits
                bad_t, bad_l = table.clone(), lens.clone()
                bad_t[1, 0], bad_t[2, 3], bad_l[3] = -7, 10 ** 9, 10 ** 6
                o2, _ = mm.forward(q, k, None, scale=SCALE, block_table=bad_t, seqlens_k=bad_l)
                bad_l[3] = -5
                o3, _ = mm.forward(q, k, None, scale=SCALE, block_table=bad_t, seqlens_k=bad_l)
                torch.cuda.synchronize()
                o0, _ = mm.forward(q, k, None, scale=SCALE, **kw)
                log(f"BAD {layout} {'swapAB' if rows else 'seesaw'}: no fault; seq 0",
                    "unchanged" if torch.equal(o2[0], o0[0]) and torch.equal(o3[0], o0[0]) else "CHANGED")
    log(f"CHECKS {name} worst abs err {worst:.2e} (inf: a failure)")
    if name != "check-b":
        return
    # fagen.attention on a dense Hq 16 cache: which module, and its error
    import fagen
    from fagen.runtime import hopper
    q = torch.randn(128, 16, 1, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(128, 1, 2048, D, device="cuda", generator=g).bfloat16()
    out = fagen.attention(q, k, None, head_dim_v=DV, scale=SCALE)
    w, _ = reference.attention(q[:2].double(), k[:2].double(), None, head_dim_v=DV, scale=SCALE)
    log(f"fagen.attention h16 b128 kv2048 (2^22 pairs; LATENT_MIN_WORK {hopper.LATENT_MIN_WORK}): err",
        f"{compare('out', out[:2], w, **tol):.1e}")


def copy_gbs():
    import torch
    x = torch.empty(1 << 29, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        y.copy_(x)
    e.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 20 / (s.elapsed_time(e) * 1e-3) / 1e9


def graph_ms(fn, calls=8, total_ms=12.0):
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
    except Exception as e:  # noqa: BLE001 - a call that cannot be captured: no graph time
        log(f"graph capture failed: {type(e).__name__}: {str(e)[:160]}")
        torch.cuda.synchronize()
        return float("nan")
    g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    g.replay()
    torch.cuda.synchronize()
    n = max(2, min(100, int(total_ms / max((time.perf_counter() - t) * 1e3, 1e-3))))
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / (n * calls)


def time_phase():
    import torch
    from triton.testing import do_bench
    import fagen

    copy = copy_gbs()
    log(f"copy {copy:.0f} GB/s (read + write)")
    g = torch.Generator(device="cuda").manual_seed(5)
    paged = gluon_mod("paged", 16, "none")
    dense = gluon_mod("dense", 16, "none")
    try:
        fm = FlashMLA(False)
    except Exception as e:  # noqa: BLE001
        fm = None
        log(f"FlashMLA unavailable: {type(e).__name__}: {e}")
    table_rows = []
    for b, kv in ((128, 4096), (32, 32768), (128, 32768), (32, 4096)):
        if fm is not None:  # round A: a new lengths tensor at a freed one's address took its metadata
            fm.meta.clear()
        pages = kv // PAGE
        cache = torch.randn(b * pages, PAGE, 1, D, device="cuda", generator=g).bfloat16()
        table = torch.arange(b * pages, device="cuda", dtype=torch.int32).view(b, pages)
        lens = torch.full((b, ), kv, dtype=torch.int32, device="cuda")
        q = torch.randn(b, 16, 1, D, device="cuda", generator=g).bfloat16()
        kd = cache.view(b, 1, kv, D)  # the same bytes as a dense cache (the identity table)
        byts = b * kv * D * 2
        rows = {  # round B: the product's defaults (swap-AB, MERGE_COLS 128) against the session's start
            "product dense (swap-AB, merge cols 128)": lambda: dense.forward(q, kd, None, scale=SCALE),
            "fagen.attention dense (the bench's path)": lambda: (fagen.attention(q, kd, None, head_dim_v=DV,
                                                                                 scale=SCALE), None),
            "before: seesaw padded dense, merge whole": lambda: with_consts(
                dense, dict(SWAP_AB_ROWS=0, MERGE_COLS=DV), dense.forward, q, kd, None, scale=SCALE),
            "product paged": lambda: paged.forward(q, cache, None, scale=SCALE, block_table=table, seqlens_k=lens),
        }
        if fm is not None:
            rows["FlashMLA bf16 paged"] = lambda: fm.forward(q, cache, None, scale=SCALE, block_table=table,
                                                             seqlens_k=lens)
        ref = None
        for nm in list(rows):  # warm and agree
            try:
                o = rows[nm]()[0]
            except Exception as e:  # noqa: BLE001 - a row that fails is left out, the others go on
                log(f"ERROR {nm} b{b} kv{kv}: {type(e).__name__}: {str(e)[:200]}")
                del rows[nm]
                continue
            ref = o if ref is None else ref
            d = (o.float() - ref.float()).abs().max().item()
            if d > 0.02:
                log(f"DISAGREE {nm} b{b} kv{kv}: {d:.3g}")
        torch.cuda.synchronize()
        names = list(rows)
        res = {nm: ([], []) for nm in names}
        for p in range(3):
            order = names[p % len(names):] + names[:p % len(names)]
            for nm in order:
                res[nm][0].append(graph_ms(rows[nm]))
                res[nm][1].append(do_bench(rows[nm], warmup=3, rep=15, return_mode="median"))
        for nm in names:
            gm, bm = statistics.median(res[nm][0]), statistics.median(res[nm][1])
            table_rows.append((f"b{b} kv{kv // 1024}k", nm, gm, 100 * byts / gm / 1e6 / copy, bm,
                               byts / bm / 1e6, 100 * byts / bm / 1e6 / copy))
            log("TIME | " + " | ".join(str(x) if isinstance(x, str) else f"{x:.4g}" for x in table_rows[-1]))
        del cache, kd, q
        torch.cuda.empty_cache()
    print("\n| shape | kernel | graph ms | graph % copy | do_bench ms | do_bench GB/s | do_bench % copy |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in table_rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.4f} | {r[3]:.1f} | {r[4]:.4f} | {r[5]:.0f} | {r[6]:.1f} |")


def d128_inputs(b, kv):
    import torch
    g = torch.Generator(device="cuda").manual_seed(b + kv)
    q = torch.randn(b, 32, 1, 128, device="cuda", generator=g).bfloat16()
    k = torch.randn(b, 8, kv, 128, device="cuda", generator=g).bfloat16()
    v = torch.randn(b, 8, kv, 128, device="cuda", generator=g).bfloat16()
    return q, k, v


def warm_phase():
    """The seesaw's builds the time phase takes (dense and paged, one split and several)."""
    import torch
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, 16, 1, D, device="cuda", generator=g).bfloat16()
    cache = torch.randn(8, PAGE, 1, D, device="cuda", generator=g).bfloat16()
    table = torch.arange(8, device="cuda", dtype=torch.int32).view(2, 4)
    lens = torch.full((2, ), 256, dtype=torch.int32, device="cuda")
    for layout in ("dense", "paged"):
        m = Sab(gluon_mod(layout, 16, "none"), 0)
        kw = {} if layout == "dense" else dict(block_table=table, seqlens_k=lens)
        k = cache.view(2, 1, 256, D) if layout == "dense" else cache
        for ns in (1, 2):
            m.forward_split(q, k, None, scale=SCALE, num_splits=ns, **kw)
        m.forward(q, k, None, scale=SCALE, batch_invariant=True, **kw)
    import fagen  # the Triton latent decode fagen.attention takes below LATENT_MIN_WORK (eager)
    for b in (1, 32):
        qq = torch.randn(b, 16, 1, D, device="cuda", generator=g).bfloat16()
        kk = torch.randn(b, 1, 4096, D, device="cuda", generator=g).bfloat16()
        fagen.attention(qq, kk, None, head_dim_v=DV, scale=SCALE)
    torch.cuda.synchronize()
    log("warm done")


def d128_mod():
    import fagen
    return fagen.load(fagen.KernelSpec(head_dim=128, kind="decode", gqa=4, dtype="bf16"))


def with_consts(m, consts, fn, *a, **kw):
    """fn(*a, **kw) with module m's constants set for the call."""
    old = {n: getattr(m, n) for n in consts}
    for n, v in consts.items():
        setattr(m, n, v)
    try:
        return fn(*a, **kw)
    finally:
        for n, v in old.items():
            setattr(m, n, v)


D128_RULES = ()  # round A: (1024, 16) +3.2%, (4096, 16) +0.6% at b32 kv4k (docs/serving.md, twelfth session)
SAB_RULES = ((1024, 8), (1024, 16), (1024, 24), (1024, 32))  # round A also (512, 16), (2048, 8), (4096, 1)


def warm2_phase():
    """The d128 decode builds the inv phase times."""
    import torch
    import fagen
    m = d128_mod()
    for b, kv in ((1, 4096), (32, 4096)):
        q, k, v = d128_inputs(b, kv)
        for inv in (False, True):
            fagen.attention(q, k, v, batch_invariant=inv)
        m.forward(q, k, v, batch_invariant=True)
        m.forward(q, k, v, batch_invariant=False)
        torch.cuda.synchronize()
    log("warm2 done")


def inv_phase():
    import torch
    from triton.testing import do_bench
    import fagen

    out_rows = []

    def measure(label, fns, byts, passes=4):
        for nm in list(fns):
            try:
                fns[nm]()
            except Exception as e:  # noqa: BLE001
                log(f"ERROR {label} {nm}: {type(e).__name__}: {str(e)[:200]}")
                del fns[nm]
        names = list(fns)
        torch.cuda.synchronize()
        ts = {nm: [] for nm in names}
        gs = {nm: [] for nm in names}
        for p in range(passes):
            for nm in names[p % len(names):] + names[:p % len(names)]:
                ts[nm].append(do_bench(fns[nm], warmup=2, rep=8, return_mode="median"))
                gs[nm].append(graph_ms(fns[nm], total_ms=6.0))
        base = statistics.median(ts[names[0]])
        gbase = statistics.median(gs[names[0]])
        for nm in names:
            ms, gm = statistics.median(ts[nm]), statistics.median(gs[nm])
            out_rows.append((label, nm, ms, byts / ms / 1e6, 100 * (ms / base - 1), gm, 100 * (gm / gbase - 1)))
            log("INV | " + " | ".join(str(x) if isinstance(x, str) else f"{x:.4g}" for x in out_rows[-1]))

    m = d128_mod()
    for b, kv in ((32, 4096), (1, 4096), (32, 32768), (1, 32768)):
        q, k, v = d128_inputs(b, kv)
        fns = {"split rule (fagen.attention)": lambda: fagen.attention(q, k, v, batch_invariant=False),
               "invariant (fagen.attention)": lambda: fagen.attention(q, k, v, batch_invariant=True)}
        if b == 32 and kv == 4096:  # where the cost is: the grid, the merge, the chunk
            for r in D128_RULES:
                fns[f"invariant {r[0]}/{r[1]}"] = lambda r=r: with_consts(
                    m, dict(INVARIANT_MIN_CHUNK=r[0], INVARIANT_SPLITS=r[1]), m.forward, q, k, v, batch_invariant=True)
        measure(f"d128 h32/8 dense b{b} kv{kv // 1024}k", fns, b * 8 * kv * 256 * 2)
        del q, k, v
    g = torch.Generator(device="cuda").manual_seed(3)
    mla = gluon_mod("dense", 16, "none")
    for b, kv in ((32, 4096), (1, 4096), (32, 32768), (1, 32768), (128, 4096)):
        q = torch.randn(b, 16, 1, D, device="cuda", generator=g).bfloat16()
        k = torch.randn(b, 1, kv, D, device="cuda", generator=g).bfloat16()
        measure(f"MLA h16 dense b{b} kv{kv // 1024}k, fagen.attention", {
            "split rule (fagen.attention)": lambda: fagen.attention(q, k, None, head_dim_v=DV, scale=SCALE),
            "invariant (fagen.attention)": lambda: fagen.attention(q, k, None, head_dim_v=DV, scale=SCALE,
                                                                   batch_invariant=True)}, b * kv * D * 2, passes=3)
        fns = {"swap-AB split rule": lambda: Sab(mla, 16).forward(q, k, None, scale=SCALE, batch_invariant=False)}
        for r in SAB_RULES:
            fns[f"swap-AB invariant {r[0]}/{r[1]}"] = lambda r=r: with_consts(
                mla, dict(SWAP_AB_ROWS=16, SAB_INVARIANT=r), mla.forward, q, k, None, scale=SCALE, batch_invariant=True)
        measure(f"MLA h16 dense b{b} kv{kv // 1024}k", fns, b * kv * D * 2, passes=3)
        del q, k
    print("\n| shape | mode | do_bench ms | GB/s | cost | graph ms | cost in a graph |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in out_rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.4f} | {r[3]:.0f} | {r[4]:+.1f}% | {r[5]:.4f} | {r[6]:+.1f}% |")


def memcheck_phase():
    """compute-sanitizer memcheck over scripts/gpu_memcheck_fuzz.py's mla_gluon group at Hq 16 (the swap-AB tile and
    the padded seesaw: bad page indexes and lengths); prints the summary, failures and sanitizer errors only."""
    import shutil
    import subprocess
    san = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    cmd = [san, "--tool", "memcheck", "--error-exitcode", "1", sys.executable,
           os.path.join(ROOT, "scripts", "gpu_memcheck_fuzz.py"), "--group", "mla_gluon"]
    env = {**os.environ, "FUZZ_MLA_GLUON_HQ": "16"}
    import signal
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: a timeout kills the fuzz too
    try:
        out, _ = proc.communicate(timeout=LIMITS["memcheck"] - 3)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = "timeout"
    lines = (out or "").splitlines()
    keep = [ln for ln in lines if "summary" in ln or "FAIL" in ln or "ERROR SUMMARY" in ln or "Invalid" in ln]
    log(f"MEMCHECK rc {rc}, {len(lines)} lines; " + " | ".join(keep[:12]))


BENCH_CASES = ("decode-mla-absorbed-h16-kv4k-b128", "decode-mla-absorbed-h16-kv32k-b32")


def bench_phase():
    """The serving bench's own rows (fagen bench --suite serving, do_bench over rotated input sets) with the
    product's defaults."""
    import subprocess
    cmd = [sys.executable, "-m", "fagen", "bench", "--suite", "serving", "--impl", "fagen", "--no-isolate",
           "--device", "cuda", "--rep", "60", "--warmup", "10"]
    for c in BENCH_CASES:
        cmd += ["--case", c]
    subprocess.run(cmd, check=False)


def main():
    env = child_env(os.path.join(tempfile.gettempdir(), "fagen-mladec-s12"), ROOT)
    me = os.path.abspath(__file__)
    res = {}

    def go(name):
        res[name] = run_phase(me, name, LIMITS[name], env)[0]
    ts = [threading.Thread(target=go, args=(n, )) for n in ("warm", "warm2", "check-b", "memcheck")]
    for t in ts:
        t.start()
    go("check-a")
    for t in ts:
        t.join()
    go("time")
    go("inv")
    go("bench")
    log("phases:", res)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        phases = {"check-a": lambda: check_phase("check-a"), "check-b": lambda: check_phase("check-b"),
                  "warm": warm_phase, "bench": bench_phase, "memcheck": memcheck_phase, "warm2": warm2_phase,
                  "time": time_phase, "inv": inv_phase}
        phases[sys.argv[2]]()
    else:
        main()
