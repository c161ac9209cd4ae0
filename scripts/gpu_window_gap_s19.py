"""Why the mods suite reads the window row's backward slower than a script does (issue 26; docs/mods.md "The window
row's backward in the suite (nineteenth session)").

The eighteenth session's scripts read the sliding-window+causal row's backward (B1 H16 S8192 d128 bf16, attention-
gym's window 1024 + causal as a mask_mod, lowered to causal + window (1024, 0)) at 0.447 ms with
fagen.bench.timing.timed_calls (25 ms warm-up, 100 ms of calls, do_bench's zero flush), while `fagen bench --suite
mods` read the same kernels at 0.470 ms (rounds 0.4700-0.4712). This probe times one process's backward calls in
the ways that differ between the two, in shuffled passes:

  inputs      the suite's (fagen.bench.mods._inputs: CPU randn, block_mask= passed) or the script's (GPU randn,
              no block mask);
  loop        "tc": timed_calls 25 / 100 ms; "short": timed_calls 2 / 20 ms without a memo (each call re-estimates);
              "suite": the suite's rounds (fagen.bench.timing.measure with a memo kept across 5 rounds of 2 / 20 ms);
              "suite+flex": the same with Flex's backward timed between fagen's rounds, as the suite interleaves.

Gradients of the two input paths are compared bitwise where their inputs are the same tensors (block_mask= passed
or not: the lowering validates it and leaves it unused).

    PYTHONPATH=$PWD python3 scripts/gpu_window_gap_s19.py [--passes 5] [--no-flex] [--suite-rows]

--ws-sweep (next session's first probe): the row's backward timed with its kept workspace re-allocated, then its
inputs re-allocated, behind dummy buffers of 0-513 MB kept alive (the gradients compared bitwise each time).
--suite-rows first runs the suite's own row (fagen.bench.mods.mod_rows, the window row only, 5 rounds) with Flex,
without, and with again, in this process.
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import sys

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--ws-sweep", action="store_true", help="the window row's backward with its kept workspace "
                    "(or its inputs) re-allocated behind dummy buffers of growing size (then exit)")
    ap.add_argument("--after-rows", action="store_true", help="the window row fresh, after the suite's five rows "
                    "before it, after empty_cache, after 30 s idle (then exit)")
    ap.add_argument("--suite-rows", action="store_true", help="first the suite's own row (mod_rows), three times")
    ap.add_argument("--profile", choices=("alone", "after-suite"), help="(twentieth session) the window row's "
                    "backward under torch.profiler: kernel times, GPU idle inside a call, host time a call; "
                    "after-suite: first the suite's six rows (mod_rows, 5 rounds), as `fagen bench --suite mods` "
                    "runs them, then the window row's suite timing again, then the profile (then exit)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no GPU: nothing to time (this probe has no CPU rehearsal beyond importing)")
        return 0
    import fagen
    from fagen.bench import mods as M
    from fagen.bench.timing import _zero_flush, measure, timed_calls

    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    shape = M.ModsShape()
    if a.profile:
        return _profile(a.profile, M, shape, _zero_flush(dev))
    if a.ws_sweep:  # where the allocator puts the window backward's kept workspace, or the inputs (docs/mods.md)
        mm = M._gym().generate_sliding_window(1024)
        ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
        flush, keep = _zero_flush(dev), []

        def fresh_inputs():
            q, k, v, do = (t.detach().clone() for t in M._inputs(shape, "cuda", False))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            out = fagen.attention(q, k, v, mask_mod=mm)
            return lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), q

        f, q0 = fresh_inputs()
        ref = [t.clone() for t in f()]
        (m, ) = [x for n, x in list(sys.modules.items()) if "_win_" in n and hasattr(x, "_BWD_WS")]
        print("module", m.__name__.rpartition(".")[2][:70], flush=True)
        for mb in (0, 1, 3, 17, 64, 129, 257, 513):
            for what in ("workspace", "inputs"):
                if mb:
                    keep.append(torch.empty(mb << 20, dtype=torch.uint8, device="cuda"))
                if what == "workspace":  # a new kept buffer on the next call (the backward's thread included)
                    m._BWD_WS = type(m._BWD_WS)()
                else:
                    f, q0 = fresh_inputs()
                same = all(torch.equal(x, y) for x, y in zip(f(), ref))
                torch.cuda.synchronize()
                ms = sorted(statistics.median(timed_calls(f, flush, 10, 60, ev, torch.cuda.synchronize))
                            for _ in range(3))
                print(f"WS SWEEP +{mb:4d} MB {what:<9} ms {ms[1]:.4f} ({ms[0]:.4f}-{ms[2]:.4f}) q at "
                      f"{q0.data_ptr() % (1 << 30):#x} mod 1 GiB; grads bitwise {same}; reserved "
                      f"{torch.cuda.memory_reserved() / 2**30:.1f} GiB", flush=True)
        return 0
    if a.after_rows:  # the suite's five rows before the window row first, then the window row: as is, after
        import gc  # the allocator's cache is emptied, and after 30 s idle
        import time

        def window_row(label):
            (r, ) = M.mod_rows("cuda", shape, log=lambda *x, **y: None, only={"sliding-window+causal"}, rounds=5)
            print(f"AFTER ROWS {label}: fagen bwd ms rounds {r['fagen']['bwd_rounds_ms']}; flex bwd "
                  f"{r['flex']['bwd_rounds_ms']} bwd_x {r['bwd_x']:.3f}; reserved "
                  f"{torch.cuda.memory_reserved() / 2**30:.1f} GiB", flush=True)

        t0 = time.time()
        window_row("first, fresh process")
        M.mod_rows("cuda", shape, log=lambda *x, **y: None, rounds=1,
                   only={"relative-bias", "alibi", "softcap", "document+causal", "prefix-lm"})
        print(f"five rows done at {time.time() - t0:.0f} s", flush=True)
        window_row("after the five rows")
        gc.collect()
        torch.cuda.empty_cache()
        window_row("then empty_cache")
        time.sleep(30)
        window_row("then 30 s idle")
        return 0
    if a.suite_rows:  # the suite's own row, alone in this process: fagen.bench.mods.mod_rows as `fagen bench` runs it
        for flex in (True, False, True):
            (r, ) = M.mod_rows("cuda", shape, log=lambda *x, **y: None, flex=flex, only={"sliding-window+causal"},
                               rounds=5)
            print(f"SUITE ROW flex={flex}: fagen bwd ms rounds {r['fagen']['bwd_rounds_ms']} fwd "
                  f"{r['fagen']['fwd_rounds_ms']}" + (f"; flex bwd {r['flex']['bwd_rounds_ms']} bwd_x "
                                                      f"{r['bwd_x']:.3f}" if flex else ""), flush=True)
    g = M._gym()
    mm = g.generate_sliding_window(1024)
    q, k, v, do = M._inputs(shape, "cuda", True)
    bm = fagen.create_block_mask(mm, None, None, shape.seq, shape.seq, device="cuda")
    out_bm = fagen.attention(q, k, v, mask_mod=mm, block_mask=bm)
    out_nb = fagen.attention(q, k, v, mask_mod=mm)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q2, k2, v2, do2 = (torch.randn(1, 16, 8192, 128, generator=gen, device="cuda").bfloat16() for _ in range(4))
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q2, k2, v2))
    out2 = fagen.attention(ql, kl, vl, mask_mod=lambda b, h, qi, ki: (qi >= ki) & (qi - ki <= 1024))
    fns = {
        "suite inputs, block_mask": lambda: torch.autograd.grad(out_bm, (q, k, v), do, retain_graph=True),
        "suite inputs, no block_mask": lambda: torch.autograd.grad(out_nb, (q, k, v), do, retain_graph=True),
        "script inputs": lambda: torch.autograd.grad(out2, (ql, kl, vl), do2, retain_graph=True),
    }
    ga, gb = fns["suite inputs, block_mask"](), fns["suite inputs, no block_mask"]()
    print("BITWISE block_mask passed == not:", all(torch.equal(x, y) for x, y in zip(ga, gb)), flush=True)
    flex_grad = None
    if not a.no_flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        from fagen.bench.peers import configure_dynamo

        configure_dynamo()
        compiled = torch.compile(flex_attention, dynamic=False)
        fbm = create_block_mask(mm, None, None, shape.seq, shape.seq, device="cuda")
        fout = compiled(q, k, v, block_mask=fbm)
        flex_grad = lambda: torch.autograd.grad(fout, (q, k, v), do, retain_graph=True)  # noqa: E731
        flex_grad()
    for f in fns.values():
        f()
    torch.cuda.synchronize()
    flush = _zero_flush(dev)
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    sync = torch.cuda.synchronize
    res = collections.defaultdict(list)
    rng = random.Random(0)
    configs = [(n, loop) for n in fns for loop in ("tc", "short", "suite")]
    if flex_grad is not None:
        configs += [("suite inputs, block_mask", "suite+flex"), ("flex", "tc")]
    for p in range(a.passes):
        rng.shuffle(configs)
        for name, loop in configs:
            f = flex_grad if name == "flex" else fns[name]
            if loop == "tc":
                ms = statistics.median(timed_calls(f, flush, 25, 100, ev, sync))
            elif loop == "short":
                ms = statistics.median(timed_calls(f, flush, 2, 20, ev, sync))
            else:
                memo, fmemo, rounds = {}, {}, []
                for r in range(5):
                    if loop == "suite+flex" and r % 2 == 1:
                        measure(lambda i: flex_grad(), 1, dev, 2, 20, memo=fmemo)
                    rounds.append(measure(lambda i: f(), 1, dev, 2, 20, memo=memo))
                    if loop == "suite+flex" and r % 2 == 0:
                        measure(lambda i: flex_grad(), 1, dev, 2, 20, memo=fmemo)
                ms = statistics.median(rounds)
                res[(name, loop, "rounds")].append(" ".join(f"{x:.4f}" for x in rounds))
            res[(name, loop)].append(ms)
    print(f"{'inputs':<30} {'loop':<11} {'median ms':>9}  passes")
    for key in sorted(k for k in res if len(k) == 2):
        vals = res[key]
        print(f"{key[0]:<30} {key[1]:<11} {statistics.median(vals):9.4f}  " + " ".join(f"{x:.4f}" for x in vals))
    for key in sorted(k for k in res if len(k) == 3):
        print(f"  rounds of {key[0]} / {key[1]} (pass by pass): " + " | ".join(res[key]))
    return 0


def _profile(mode, M, shape, flush):
    """Where the suite's extra 0.03 ms a window backward goes (twentieth session): the kernels' own durations
    (torch.profiler, CUPTI), the GPU's idle time between a call's first and last kernel, and the host's time a call
    with the GPU kept busy. `after-suite` first runs the suite's rows up to the window row in this process."""
    import gc
    import time

    import fagen
    from fagen.bench.timing import timed_calls

    if mode == "after-suite":
        rows = M.mod_rows("cuda", shape, log=lambda *x, **y: None, rounds=5, only={
            "relative-bias", "alibi", "softcap", "document+causal", "prefix-lm", "sliding-window+causal"})
        for r in rows:
            print(f"SUITE {r['case']:<24} fagen bwd {r.get('fagen', {}).get('bwd_ms', float('nan')):.4f} ms; bwd_x "
                  f"{r.get('bwd_x', float('nan')):.3f}", flush=True)
        (r, ) = M.mod_rows("cuda", shape, log=lambda *x, **y: None, only={"sliding-window+causal"}, rounds=5)
        print(f"AGAIN window row: fagen bwd {r['fagen']['bwd_ms']:.4f} ms (rounds {r['fagen']['bwd_rounds_ms']}); "
              f"bwd_x {r['bwd_x']:.3f}", flush=True)
    print(f"gc objects {len(gc.get_objects())}, gc counts {gc.get_count()}, thresholds {gc.get_threshold()}", flush=True)
    mm = M._gym().generate_sliding_window(1024)
    q, k, v, do = M._inputs(shape, "cuda", True)
    bm = fagen.create_block_mask(mm, None, None, shape.seq, shape.seq, device="cuda")
    out = fagen.attention(q, k, v, mask_mod=mm, block_mask=bm)
    f = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
    for _ in range(20):
        f()
    torch.cuda.synchronize()
    # host time a call with the GPU busy (a long kernel queued first), and with gc disabled
    for label, off in (("gc on", False), ("gc off", True)):
        if off:
            gc.disable()
        host = []
        for _ in range(5):
            torch.cuda._sleep(200_000_000)
            t0 = time.perf_counter()
            for _ in range(20):
                f()
            host.append((time.perf_counter() - t0) / 20 * 1e3)
            torch.cuda.synchronize()
        gc.enable()
        print(f"HOST {label}: ms a call {statistics.median(host):.4f} ({min(host):.4f}-{max(host):.4f})", flush=True)
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    for label, off in (("gc on", False), ("gc off", True)):
        if off:
            gc.disable()
        ms = [statistics.median(timed_calls(f, flush, 10, 60, ev, torch.cuda.synchronize)) for _ in range(3)]
        gc.enable()
        print(f"TIMED {label}: timed_calls ms {' '.join(f'{x:.4f}' for x in ms)}", flush=True)
    try:
        _kernel_profile(f, flush)
    except Exception as e:  # noqa: BLE001 - the timings above stand; say what the profiler did
        print(f"PROFILE failed: {type(e).__name__}: {e}", flush=True)
    return 0


def _kernel_profile(f, flush):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(30):
            flush()
            torch.cuda._sleep(1000)  # a marker kernel: the call's kernels follow it
            f()
        torch.cuda.synchronize()
    gpu = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    flush_name = gpu[0].name if gpu else ""
    calls, cur = [], None
    for e in gpu:
        if "spin" in e.name.lower():
            cur = []
            calls.append(cur)
        elif e.name != flush_name and cur is not None:
            cur.append(e)
    per = collections.defaultdict(list)
    for c in calls:
        for e in c:
            per[e.name].append(e.time_range.end - e.time_range.start)
    print(f"KERNELS of a call (flush {flush_name[:50]!r} left out): calls, median us, name", flush=True)
    for name, ts in sorted(per.items(), key=lambda kv: -sum(kv[1]))[:10]:
        print(f"  {len(ts):4d} {statistics.median(ts):9.1f}  {name[:100]}", flush=True)
    spans = [c[-1].time_range.end - c[0].time_range.start for c in calls if c]
    busy = [sum(e.time_range.end - e.time_range.start for e in c) for c in calls if c]
    if spans:
        print(f"CALL SPAN us median {statistics.median(spans):.1f}, kernels busy {statistics.median(busy):.1f}, "
              f"idle inside {statistics.median([s - b for s, b in zip(spans, busy)]):.1f} ({len(spans)} calls)",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
