"""Where the serving bench's fp8 decode rows lose their points, twelfth session (issue 27; docs/serving.md "fp8 KV
decode, twelfth session"): the same calls timed under do_bench's L2 flush (a 256 MB zero_, which leaves the L2 full
of dirty lines), under a flush that leaves the L2 clean (a 256 MB read), and back to back; beside a copy of the same
bytes and a read-only kernel of the same bytes, measured the same ways.

    PYTHONPATH=$PWD python3 scripts/gpu_fp8kv_s12.py      # ~60 s on an H100; one table; $OUTX/gpu_fp8kv_s12.md
    GPU_FP8KV_S12_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_fp8kv_s12.py   # the CPU interpreter, tiny shapes

Phases, each in a child process with a timeout (a kernel that faults or hangs loses its phase, not the table):
1. check: the paged fp8 default (page 16) against float64 on the dequantized cache at 28 sequences of 1..1200 keys
   (no multiple of a page or a key tile), per-head scales; it must FAIL against the reference on the cache's bytes
   read as bf16 and on the cache without its scales. Warms the builds of the modes phase.
2. modes: the serving bench's rows (its make_inputs, prepare_fagen and float64 check, as `fagen bench` runs them):
   decode-d128-kv8k-b32-fp8, -kv32k-b8-fp8, -kv8k-b32-fp8-paged16 (1 set, as before, and the bench's 3 now that
   a paged set holds its pages only), and b32 kv32k
   (the same kernel, 4x the keys: the per-call fixed cost is (4 t8k - t32k) / 3); a copy of the kv8k-b32 row's bytes
   (half read, half written), the scripts' usual 1 GB copy, and a read-only Triton kernel over the row's bytes.
   Modes: "bench" fagen.bench.timing.measure itself (triton's do_bench, sets rotated); "bench read" measure with
   L2_FLUSH = "read" (do_bench's loop, the flush a 256 MB torch sum: [Note] L2 flush); "bench loop" measure with
   L2_FLUSH = "loop" (back to back in batches over the rotated sets, the row's bytes as its set's); "zero" the same
   loop written
   out (zero_ flush, events around each call); "clean" that loop with the flush a 256 MB read (the L2 holds no dirty
   line when the call starts); "b2b" back to back (events around n calls, sets alternating, no flush). PASSES passes,
   the rows' order rotated between passes; medians.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for _phases
from _phases import child_env, run_phase as run_child  # noqa: E402

DRY = os.environ.get("GPU_FP8KV_S12_DRY") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
PHASES = {"check": 16, "modes": 48} if not DRY else {"check": 1800, "modes": 1800}
if os.environ.get("GPU_FP8KV_S12_PHASES"):  # "name:seconds,..."
    PHASES = {n: float(t) for n, t in (p.split(":") for p in os.environ["GPU_FP8KV_S12_PHASES"].split(","))}
PASSES = 1 if DRY else 5
PASSES_B = 1 if DRY else 2
MODES = ("bench", "bench read", "bench loop", "zero", "clean", "b2b")
if os.environ.get("GPU_FP8KV_S12_MODES"):  # a subset, "bench loop,zero,b2b" (round B)
    MODES = tuple(os.environ["GPU_FP8KV_S12_MODES"].split(","))
FLUSHES = ("zero", "read", "loop")  # the bench phase's L2_FLUSH values
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def emit(section, case, impl, value, ms, note=""):
    print("ROW " + json.dumps([section, case, impl, value, "" if ms is None else f"{ms:.4f}", note]), flush=True)


def check_phase():
    import torch

    import fagen
    from fagen.verify import reference
    from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare

    dev = "cpu" if DRY else "cuda"
    HD, HKV, G = (32, 4, 4) if DRY else (128, 8, 4)
    page = 16
    b = 3 if DRY else 28
    gen = torch.Generator(device=dev).manual_seed(12)
    lens = torch.randint(1, (100 if DRY else 1200) + 1, (b,), device=dev, generator=gen, dtype=torch.int32)
    lens[0], lens[1] = (100, 7) if DRY else (1000, 77)
    width = -(-int(lens.max()) // page) + 1
    q = torch.randn(b, HKV * G, 1, HD, device=dev, generator=gen).mul(2).bfloat16()
    kc = torch.randn(b * width + 3, page, HKV, HD, device=dev, generator=gen).to(torch.float8_e4m3fn)
    vc = torch.randn(b * width + 3, page, HKV, HD, device=dev, generator=gen).to(torch.float8_e4m3fn)
    table = torch.randperm(b * width + 3, device=dev, generator=gen)[:b * width].to(torch.int32).view(b, width)
    ks = torch.exp2(torch.rand(HKV, device=dev, generator=gen) * 6 - 3)
    vs = torch.exp2(torch.rand(HKV, device=dev, generator=gen) * 6 - 3)
    m = fagen.load(fagen.KernelSpec(head_dim=HD, gqa=G, dtype="bf16", kind="decode", kv_dtype="fp8_e4m3",
                                    layout="paged", **(dict(block_n=16) if DRY else {})))
    out, lse = m.forward(q, kc, vc, block_table=table, seqlens_k=lens, k_scale=ks, v_scale=vs)

    def gathered(cache, i, n):
        return cache[table[i].long()].reshape(-1, cache.shape[2], cache.shape[3])[:n].transpose(0, 1)[None]

    def misread(x):
        return x.view(torch.uint8).view(torch.bfloat16).double().nan_to_num(0.0).clamp(-1e4, 1e4) \
            .repeat_interleave(2, -1)

    kd, vd = reference.dequantize(kc, ks, head_dim_axis=2), reference.dequantize(vc, vs, head_dim_axis=2)
    worst, far = 0.0, []
    for i in (0, 1, 2, b - 1):
        n = int(lens[i])
        want, wlse = reference.attention(q[i:i + 1].double(), gathered(kd, i, n), gathered(vd, i, n))
        terms, _ = reference.attention(q[i:i + 1].double(), gathered(kd, i, n), gathered(vd, i, n).abs())
        unit = terms.clamp(min=1.0)
        got = out[i:i + 1].double() / unit
        worst = max(worst, compare(f"out {i}", got, want / unit, **TOLERANCE["bf16"]))
        compare(f"lse {i}", lse[i:i + 1], wlse, **LSE_TOLERANCE)
        if i == 0:
            for what, k2, v2 in (("read as bf16", gathered(misread(kc), i, n), gathered(misread(vc), i, n)),
                                 ("no scales", gathered(kc.double(), i, n), gathered(vc.double(), i, n))):
                wrong, _ = reference.attention(q[i:i + 1].double(), k2, v2)
                try:
                    compare(what, got, wrong / unit, **TOLERANCE["bf16"])
                except AssertionError:
                    far.append(what)
                else:
                    raise AssertionError(f"the result also matches the reference on the cache {what}")
    emit("check", f"d128 h32/8 b{b} paged page16 e4m3 per-head scales, lengths 1..1200", "default", "-", None,
         f"ok, err {worst:.1e}; fails as {' and as '.join(far)}")


def modes_phase():  # noqa: C901 - one phase
    import torch
    import triton
    import triton.language as tl

    from fagen.bench import cases as bench_cases
    from fagen.bench.cases import BenchOptions, CaseContext
    from fagen.bench.check import check
    from fagen.bench.impls import prepare_fagen
    from fagen.bench.serving import serving_rows
    from fagen.bench import timing
    from fagen.bench.timing import measure
    from fagen.bench.workloads import kv_bytes, make_case

    T0 = time.time()
    dev = torch.device("cpu" if DRY else "cuda")
    opts = BenchOptions(device=str(dev))

    @triton.jit
    def _read(X, Out, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        """Read the n int32 words, ITERS blocks a program; one word a program out (nothing optimised away)."""
        base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for i in range(ITERS):
            o = base + i * BLOCK + offs
            acc += tl.load(X + o)  # n is a multiple of BLOCK * ITERS (reader): 16-byte loads
        tl.store(Out + tl.program_id(0), tl.sum(acc, 0))

    def reader(x):
        words = x.view(torch.int32).reshape(-1)
        blk, it = 4096, 16
        assert words.numel() % (blk * it) == 0, words.numel()
        grid = (words.numel() // (blk * it),)
        out = torch.empty(grid[0], dtype=torch.int32, device=dev)
        if DRY:  # the interpreter's pointers overflow its int32 arithmetic here: torch reads the words instead
            return lambda: out.copy_(words.view(grid[0], -1).sum(1, dtype=torch.int32))
        return lambda: _read[grid](words, out, words.numel(), BLOCK=blk, ITERS=it, num_warps=8)

    flush_buf = torch.empty((1 if DRY else 256) << 20, dtype=torch.uint8, device=dev)
    read_flush = reader(flush_buf)

    def flush_zero():
        flush_buf.zero_()

    def per_call(fns, flush, reps):
        """Median ms of fns[i % n]() with flush() before each call and CUDA events around the call alone."""
        if DRY:
            t = time.perf_counter()
            fns[0]()
            return (time.perf_counter() - t) * 1e3
        for f in fns:
            f()
        s = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        e = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            flush()
            s[i].record()
            fns[i % len(fns)]()
            e[i].record()
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in zip(s, e))

    def b2b(fns, n):
        if DRY:
            return per_call(fns, None, 1)
        for f in fns:
            f()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(n):
            fns[i % len(fns)]()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / n

    rows = {c.name: c for c in serving_rows(quick=DRY)}
    d8 = rows["decode-d128-kv8k-b32-fp8"]
    b32k = make_case("decode-d128-kv32k-b32-fp8", head_dim=128, mask="none", heads_q=32, heads_kv=8, seq_q=1,
                     batch=d8.batch, seq_k=4 * d8.seq_k, kv_dtype="fp8_e4m3", peers=False)
    entries = []  # (name, bytes counted, [fns], ms per call estimate)

    def add_case(label, case, sets=None):
        if time.time() - T0 > PHASES["modes"] - 9:
            emit("modes", label, "setup", "-", None, "skipped: time budget")
            return
        old = bench_cases.SET_BUDGET
        if sets:
            bench_cases.SET_BUDGET = 64 << 30
        try:
            cc = CaseContext(case, dev, sets or opts.sets)
        finally:
            bench_cases.SET_BUDGET = old
        prep = prepare_fagen(case, cc)
        status, message, err = check("fagen", prep, cc)
        if status != "ok":
            raise AssertionError(f"{label}: check {status}: {message}")
        with torch.no_grad():
            fns = [lambda s=s: prep.fn(s) for s in cc.sets]
            entries.append((label, kv_bytes(case), fns, cc))
        emit("modes", label, "check", "-", None, f"ok, err {err:.1e}; {len(cc.sets)} sets; {prep.spec}")

    for label, case, sets in (("fp8 dense b32 kv8k (bench row)", d8, None),
                              ("fp8 dense b32 kv32k", b32k, 2),
                              ("fp8 dense b8 kv32k (bench row)", rows["decode-d128-kv32k-b8-fp8"], None),
                              ("fp8 paged16 b32 kv8k (bench row), 1 set (before)",
                               rows["decode-d128-kv8k-b32-fp8-paged16"], 1),
                              ("fp8 paged16 b32 kv8k (bench row), the bench's sets (now)",
                               rows["decode-d128-kv8k-b32-fp8-paged16"], None)):
        try:
            add_case(label, case, sets)
        except Exception as e:  # noqa: BLE001
            import traceback
            emit("modes", label, "setup", "-", None, f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:150]}")
            traceback.print_exc(file=sys.stdout)
    nb = kv_bytes(d8)
    srcs = [torch.randint(0, 255, (nb // 2,), dtype=torch.uint8, device=dev) for _ in range(3)]
    dsts = [torch.empty_like(x) for x in srcs]
    same, whole = "copy, the kv8k-b32 row's bytes (half read, half written)", "copy 1 GB (the scripts' reference)"
    entries.append((same, nb,
                    [lambda i=i: dsts[i].copy_(srcs[i]) for i in range(3)], None))
    big = (1 if DRY else 1024) << 20
    gx, gy = torch.randint(0, 255, (big,), dtype=torch.uint8, device=dev), torch.empty(big, dtype=torch.uint8,
                                                                                         device=dev)
    entries.append((whole, 2 * big, [lambda: gy.copy_(gx)], None))
    rd = [torch.randint(0, 255, (nb,), dtype=torch.uint8, device=dev) for _ in range(3)]
    entries.append(("read-only kernel, the kv8k-b32 row's bytes", nb, [reader(x) for x in rd], None))
    rd4 = torch.randint(0, 255, (4 * nb,), dtype=torch.uint8, device=dev)  # 4x: the reader's own fixed cost a call
    entries.append(("read-only kernel, 4x the row's bytes", 4 * nb, [reader(rd4)], None))
    results = {}  # (label, mode) -> [ms]
    default_flush = timing.L2_FLUSH
    for p in range(PASSES):
        order = entries[p % len(entries):] + entries[:p % len(entries)]
        for label, nbytes, fns, cc in order:
            if time.time() - T0 > PHASES["modes"] - 4:
                break
            with torch.no_grad():
                est = per_call(fns, flush_zero, 3)
                reps = max(8, min(60, int(12.0 / max(est, 1e-3))))
                modes = MODES[p % len(MODES):] + MODES[:p % len(MODES)]
                for mode in modes:
                    if mode.startswith("bench"):  # the bench's own measure, under L2_FLUSH zero, read or loop
                        timing.L2_FLUSH = mode.split()[1] if " " in mode else "zero"
                        two = fns if len(fns) > 1 else fns * 2  # one buffer (> the L2): as two sets for "loop"
                        ms = measure(lambda i: two[i % len(two)](), len(two), dev, 5.0, 12.0, nbytes)
                        timing.L2_FLUSH = default_flush
                    elif mode == "zero":
                        ms = per_call(fns, flush_zero, reps)
                    elif mode == "clean":
                        ms = per_call(fns, read_flush, reps)
                    else:
                        ms = b2b(fns, reps)
                    results.setdefault((label, mode), []).append(ms)
    copy_same = {m: nb / statistics.median(results.get((same, m), [float("nan")])) / 1e6 for m in MODES}
    copy_big = {m: 2 * big / statistics.median(results.get((whole, m), [float("nan")])) / 1e6 for m in MODES}
    emit("modes", "L2_FLUSH default", default_flush, "-", None, "")
    for label, nbytes, fns, cc in entries:
        cells = []
        for m in MODES:
            got = results.get((label, m))
            if not got:
                cells.append(f"{m} -")
                continue
            ms = statistics.median(got)
            gbs = nbytes / ms / 1e6
            cells.append(f"{m} {ms:.4f} ms {gbs:.0f} GB/s {100 * gbs / copy_same[m]:.1f}%/"
                         f"{100 * gbs / copy_big[m]:.1f}%"
                         f" (n{len(got)})")
        emit("modes", label, f"{nbytes / 1e6:.0f} MB", "; ".join(cells[:1]), None, "; ".join(cells[1:]))
    emit("modes", "legend", "", "-", None, "% of copy: of the same-bytes copy in the same mode / of the 1 GB copy in "
         "the same mode; medians over passes (n); bench = fagen.bench.timing.measure")


def bench_phase():
    """The serving bench itself (fagen.bench.impls.run_case: its inputs, check and timing, warm-up 25 ms and 100 ms
    of calls as `fagen bench` runs) on the fp8 rows, fagen and the copy reference ([Note] Copy reference), under
    L2_FLUSH "zero", "read" and "loop" ([Note] L2 flush), the flushes' order rotating between rows and passes,
    PASSES_B passes."""
    from fagen.bench import report, timing
    from fagen.bench.cases import BenchOptions
    from fagen.bench.impls import run_case
    from fagen.bench.serving import serving_rows

    T0 = time.time()
    dev = "cpu" if DRY else "cuda"
    default_flush = timing.L2_FLUSH
    emit("bench", "L2_FLUSH default", default_flush, "-", None, "")
    names = ("decode-d128-kv8k-b32-fp8", "decode-d128-kv32k-b8-fp8", "decode-d128-kv8k-b32-fp8-paged16")
    rows = {c.name: c for c in serving_rows(quick=DRY)}
    opts = BenchOptions(device=dev, impls=("fagen", "copy"), **(dict(rep_ms=1) if DRY else {}))
    got = {}
    for p in range(PASSES_B):
        for j, name in enumerate(names):
            k = (p + j) % len(FLUSHES)
            for flush in FLUSHES[k:] + FLUSHES[:k]:
                if time.time() - T0 > PHASES["bench"] - 5:
                    emit("bench", name, flush, "-", None, "skipped: time budget")
                    continue
                timing.L2_FLUSH = flush
                try:
                    recs = run_case(rows[name], opts, log=lambda _: None)
                finally:
                    timing.L2_FLUSH = default_flush
                by = {r["impl"]: r for r in recs}
                bad = [r for r in recs if r["status"] != "ok" or r["check"] == "fail"]
                if bad:
                    emit("bench", name, flush, "-", None, f"ERROR {bad[0]['impl']} {bad[0]['status']} "
                         f"{bad[0]['check']}: {bad[0]['note'][:150]}")
                    continue
                header, table, _ = report.rows(recs)
                target = dict(zip(header, table[0])).get("target", "")
                got.setdefault((name, flush), []).append((by["fagen"]["gbs"], by["copy"]["gbs"], by["fagen"]["ms"],
                                                         by["copy"]["ms"], target, by["fagen"]["max_err"]))
    for name in names:
        for flush in FLUSHES:
            runs = got.get((name, flush))
            if not runs:
                continue
            f, c = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
            emit("bench", name, f"L2_FLUSH {flush}", f"{f:.0f} GB/s", statistics.median(r[2] for r in runs),
                 f"copy {c:.0f} GB/s ({statistics.median(r[3] for r in runs):.4f} ms); fagen/copy {f / c:.3f}; "
                 f"passes {[round(r[0] / r[1], 3) for r in runs]}; target cell '{runs[-1][4]}'; check ok, err "
                 f"{max(r[5] for r in runs):.1e}")


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        {"check": check_phase, "modes": modes_phase, "bench": bench_phase}[sys.argv[2]]()
        return
    t0 = time.time()
    env = child_env("/tmp/fagen-cache-gpu-fp8kv-s12", ROOT)
    if "TRITON_INTERPRET" in os.environ:
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
    out = os.environ.get("OUTX") or os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_fp8kv_s12.md"), "w") as f:
            f.write(text + "\n\n" + "".join(logs))
    failed = [r for r in rows if "ERROR" in r[5]]
    print(f"done in {time.time() - t0:.0f} s; {len(failed)} failures", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
