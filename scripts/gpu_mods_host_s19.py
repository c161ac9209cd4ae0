"""The mods suite's two host-bound rows, old host path against new in one process (issue 26; docs/mods.md "The mods
rows' host path (nineteenth session)"): the document+causal forward (no grad) and the sliding-window+causal backward
(torch.autograd.grad of a kept graph), each built as fagen/bench/mods.py builds it (cases(), _inputs(), fagen's
create_block_mask, block_mask= passed), B1 H16 S8192 d128 bf16.

The new path is switched by module flags (NEW_FLAGS below, each restored to its product default at the end):
alternating passes (order flipped every pass), each pass per mode:
  - HOST: host us a call with the GPU kept busy (torch.cuda._sleep first; the script checks the GPU was still busy);
  - TIMED: fagen.bench.timing.timed_calls (zero flush, events around each call, calls queued), median ms;
  - SUITE: the suite's own timer (fagen.bench.mods._time with a memo and rounds=5: a 1/5 share of 10 ms warm-up
    and 100 ms repetitions, as one round of `fagen bench --suite mods`), ms;
then ratios old/new per pass; and the host us and timed call again with a slower host (DRAGS: [Note] A slower
host). Checks first: the document forward's out against float64 (head 0), out and the
window's gradients bitwise equal old vs new. Then one breakdown pass per mode (wrappers on the host functions,
inclusive us a call). Exit 1 if a check fails.

    PYTHONPATH=$PWD python3 scripts/gpu_mods_host_s19.py [--passes 6] [--n 200]
    PYTHONPATH=$PWD:$PWD/tests python3 scripts/gpu_mods_host_s19.py --dry-run   # CPU: sm_90 builds + the CPU harness
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
FAILS: list = []
# (module attribute path, value of the new path); the old path is the value the module had at import
NEW_FLAGS = (("fagen.runtime.api", "DOC_MEMO", True), ("fagen.runtime.modded", "LOWER_MEMO", True),
             ("<varlen>", "_VARLEN_STEPS", True), ("<bwd>", "_BWD_LEAN", True))


# [Note] A slower host. The suite's document row read its kernel (0.177 ms) in some processes and up to 1.5x that in
# others, with the same kernel (docs/mods.md, "The document row in the suite (thirteenth session)"): the timed loop
# reads the host path wherever it outruns flush + kernel. To see each path in such a state, the timed loop also runs
# with sys.setprofile(drag(level)): every Python call and return goes through a profile function (level 0: a no-op;
# level k: a loop of k steps), which slows the host path by 2-3x on this repo's CPU machine
# (scripts/mods_host_cpu_s19.py), the torch calls (C calls) too, the GPU's work not at all.
DRAGS = {"doc fwd": (0, 10), "win bwd": (0, )}


def drag(level):
    def profile(frame, event, arg):
        for _ in range(level):
            pass
    return profile


def check(ok, text):
    print(f"CHECK {'PASS' if ok else 'FAIL'} {text}", flush=True)
    if not ok:
        FAILS.append(text)


def dry_run():
    """CPU: the rows' kernels built for sm_90 (the varlen causal forward, the window's Gluon backward), then the CPU
    harness (faked launches) of both rows, old against new."""
    from triton.backends.compiler import GPUTarget

    import fagen
    from fagen.aot.artifacts import compile_arch
    from fagen.runtime.loader import load_source
    from test_gluon_bwd_window_chain import WINDOW_SPEC, _source

    t0 = time.perf_counter()
    varlen = fagen.KernelSpec(head_dim=128, mask="causal", dtype="bf16", layout="varlen", direction="bwd")
    build = compile_arch(varlen, "sm_90")
    print(f"{varlen.name} built for sm_90 in {time.perf_counter() - t0:.1f} s: " + ", ".join(
        f"{a.name} {a.registers} regs {a.spills} spills" for a in build.kernels), flush=True)
    t0 = time.perf_counter()
    mod = load_source(_source(), f"{fagen.KernelSpec(**WINDOW_SPEC).name}_s19dry")
    k = mod.compile_backward_for(GPUTarget("cuda", 90, 128), seq_q=8192, seq_k=8192)
    print(f"window gluon bwd built for sm_90 in {time.perf_counter() - t0:.1f} s; shared "
          f"{getattr(getattr(k, 'metadata', None), 'shared', '?')}", flush=True)
    rc = subprocess.call([sys.executable, os.path.join(HERE, "mods_host_cpu_s19.py"), "--ab", "2", "--n", "300"])
    return rc or (1 if FAILS else 0)


def flags(bwd_module, varlen_module):
    """[(owner, name, old, new)] of the NEW_FLAGS present in this tree."""
    import importlib

    got = []
    for path, name, new in NEW_FLAGS:
        owner = {"<bwd>": bwd_module, "<varlen>": varlen_module}[path] if path[0] == "<" else \
            importlib.import_module(path)
        if owner is not None and hasattr(owner, name):
            got.append((owner, name, getattr(owner, name), new))
    return got


def use(switches, new):
    for owner, name, old, value in switches:
        setattr(owner, name, value if new else old)


def busy(ms):
    torch.cuda._sleep(int(2.0e6 * max(ms, 1.0) * 3))


def host_per_call(fn, n, est_ms):
    torch.cuda.synchronize()
    busy(n * est_ms)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    e = torch.cuda.Event()
    e.record()
    still = not e.query()
    torch.cuda.synchronize()
    return host, still


def reference_head0(q, k, v, doc_ids):
    """float64 out of head 0 under the document+causal mask."""
    qd, kd, vd = (t[0, 0].double() for t in (q, k, v))
    s = (qd @ kd.T) * q.shape[-1] ** -0.5
    i = torch.arange(q.shape[2], device=q.device)
    keep = (doc_ids[i][:, None] == doc_ids[i][None, :]) & (i[:, None] >= i[None, :])
    return torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ vd


TIMERS = {}


def wrap(owner, name, label):
    fn = getattr(owner, name, None)
    if fn is None:
        return None
    TIMERS[label] = [0, 0]

    def timed(*a, **kw):
        t0 = time.perf_counter_ns()
        try:
            return fn(*a, **kw)
        finally:
            TIMERS[label][0] += time.perf_counter_ns() - t0
            TIMERS[label][1] += 1

    setattr(owner, name, timed)
    return owner, name, fn


def breakdown(fn, n, est_ms, targets):
    """Inclusive host us a call of each target with the GPU busy; the wrappers removed after."""
    TIMERS.clear()
    undo = [w for w in (wrap(*t) for t in targets) if w is not None]
    for _ in range(5):
        fn()
    for t in TIMERS.values():
        t[0] = t[1] = 0
    host, still = host_per_call(fn, n, est_ms)
    for owner, name, real in undo:
        setattr(owner, name, real)
    rows = [(label, ns / n / 1e3, c / n) for label, (ns, c) in TIMERS.items()]
    return host, still, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=6)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args()
    if a.dry_run:
        return dry_run()
    import fagen
    from fagen.bench import mods as bench
    from fagen.bench.timing import _zero_flush, timed_calls
    from fagen.runtime import api, modded, resolve

    t_start = time.perf_counter()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    shape = bench.ModsShape()
    rows = {c[0]: c for c in bench.cases(shape, "cuda")}
    S = shape.seq
    # --- the document row (forward, no grad)
    _, _, doc_mm, _ = rows["document+causal"]
    doc_bm = fagen.create_block_mask(doc_mm, None, None, S, S, device="cuda")
    q, k, v, do = bench._inputs(shape, "cuda", True)

    def doc_fwd():
        with torch.no_grad():
            return fagen.attention(q, k, v, score_mod=None, mask_mod=doc_mm, block_mask=doc_bm)

    doc_fwd()
    print(f"document row lowered to {modded.LOWERED[0]}", flush=True)
    # --- the window row (backward of a kept graph)
    _, _, win_mm, _ = rows["sliding-window+causal"]
    win_bm = fagen.create_block_mask(win_mm, None, None, S, S, device="cuda")
    qw, kw, vw, dow = bench._inputs(shape, "cuda", True)
    with torch.no_grad():
        fagen.attention(qw, kw, vw, mask_mod=win_mm, block_mask=win_bm)
    out_w = fagen.attention(qw, kw, vw, mask_mod=win_mm, block_mask=win_bm)

    def win_bwd():
        return torch.autograd.grad(out_w, (qw, kw, vw), dow, retain_graph=True)

    win_bwd()
    torch.cuda.synchronize()
    print(f"window row lowered to {modded.LOWERED[0]}", flush=True)
    bwd_mods = [m for name, m in list(sys.modules.items()) if "_win_" in name and hasattr(m, "_BWD_MEMO")]
    bwd_mod = bwd_mods[0] if len(bwd_mods) == 1 else None
    print("bwd module", None if bwd_mod is None else bwd_mod.__name__.rpartition(".")[2][:72], flush=True)
    vmod = resolve.resolve_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), "causal")
    switches = flags(bwd_mod, vmod)
    print("switches (old -> new):", ", ".join(f"{getattr(o, '__name__', '?').rpartition('.')[2][:24]}.{n} "
                                               f"{old!r}->{new!r}" for o, n, old, new in switches) or "none",
          flush=True)
    print(f"setup {time.perf_counter() - t_start:.1f} s", flush=True)
    # --- checks
    outs, grads = {}, {}
    for new in (False, True):
        use(switches, new)
        outs[new] = [doc_fwd().clone() for _ in range(2)]
        grads[new] = [t.clone() for t in win_bwd()]
    use(switches, False)
    doc_ids = doc_mm.__closure__[[c for c in doc_mm.__code__.co_freevars].index("document_id")].cell_contents
    ref = reference_head0(q, k, v, doc_ids)
    err = (outs[True][0][0, 0].double() - ref).abs().max().item()
    check(err < 2e-2, f"document fwd (new path) head 0 vs float64: max err {err:.2e}")
    check(all(torch.equal(x, outs[False][0]) for x in outs[True] + outs[False]),
          "document fwd out bitwise old == new (2 calls each)")
    check(all(torch.equal(x, y) for x, y in zip(grads[True], grads[False])), "window dq, dk, dv bitwise old == new")
    del outs, grads, ref
    # --- timing: alternating passes
    dev = torch.device("cuda")
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    res = collections.defaultdict(list)
    for p in range(a.passes):
        for new in ((False, True) if p % 2 == 0 else (True, False)):
            use(switches, new)
            tag = "new" if new else "old"
            for row, fn, est in (("doc fwd", doc_fwd, 0.2), ("win bwd", win_bwd, 0.45)):
                fn()
                host, still = host_per_call(fn, a.n, est)
                res[(row, "host us", tag)].append(host)
                res[(row, "busy", tag)].append(still)
                res[(row, "timed ms", tag)].append(statistics.median(
                    timed_calls(fn, _zero_flush(dev), 25, 100, ev, torch.cuda.synchronize)))
                res[(row, "suite ms", tag)].append(bench._time(fn, "cuda", 100.0, {}, 5))
                for level in DRAGS[row]:  # a slower host: every Python call profiled ([Note] in the docstring)
                    sys.setprofile(drag(level))
                    try:
                        host, still = host_per_call(fn, a.n // 2, est)
                        ms = statistics.median(timed_calls(fn, _zero_flush(dev), 25, 100, ev,
                                                           torch.cuda.synchronize))
                    finally:
                        sys.setprofile(None)
                    res[(row, f"host us drag{level}", tag)].append(host)
                    res[(row, "busy", tag)].append(still)
                    res[(row, f"timed ms drag{level}", tag)].append(ms)
    use(switches, False)
    print(f"timed {a.passes} passes by {time.perf_counter() - t_start:.1f} s", flush=True)
    print("| row | measure | old median | new median | old/new median | old/new per pass (q1-q3) |")
    print("|---|---|---:|---:|---:|---|")
    for row in ("doc fwd", "win bwd"):
        check(all(res[(row, "busy", "old")] + res[(row, "busy", "new")]), f"{row}: GPU busy through every host pass")
        for m in ("host us", "timed ms", "suite ms") + tuple(f"{x} drag{d}" for d in DRAGS[row]
                                                          for x in ("host us", "timed ms")):
            o, n = res[(row, m, "old")], res[(row, m, "new")]
            r = [x / y for x, y in zip(o, n)]
            qs = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
            print(f"| {row} | {m} | {statistics.median(o):.4g} | {statistics.median(n):.4g} | "
                  f"{statistics.median(r):.3f} | {' '.join(f'{x:.3f}' for x in r)} ({qs[0]:.3f}-{qs[2]:.3f}) |")
    for row in ("doc fwd", "win bwd"):
        for m in ("timed ms", "suite ms") + tuple(f"timed ms drag{d}" for d in DRAGS[row]):
            for tag in ("old", "new"):
                print(f"  {row} {m} {tag} passes: " + " ".join(f"{x:.4f}" for x in res[(row, m, tag)]))
    # --- each lever alone: the document row's host us a call (3 passes, old and all interleaved)
    alone = collections.defaultdict(list)
    for _ in range(3):
        for label, on in [("old", [])] + [(n, [i]) for i, (_, n, _, _) in enumerate(switches)] + \
                [("all", list(range(len(switches))))]:
            use(switches, False)
            for i in on:
                owner, name, _, value = switches[i]
                setattr(owner, name, value)
            doc_fwd()
            alone[label].append(host_per_call(doc_fwd, a.n, 0.2)[0])
    use(switches, False)
    print("ALONE doc fwd host us a call (median of 3): " + ", ".join(
        f"{label} {statistics.median(v):.1f}" for label, v in alone.items()), flush=True)
    # --- breakdown, one pass a mode
    doc_targets = [(api, "_as_switches", "api._as_switches"), (modded, "prepare", "modded.prepare"),
                   (modded, "_lower", "modded._lower"), (modded, "_check_call_block_mask", "modded._check_bm"),
                   (api, "_document_forward", "api._document_forward"), (api, "resolve_varlen", "api.resolve_varlen"),
                   (vmod, "launch_forward", "varlen.launch_forward"), (vmod, "_check_qkv", "varlen._check_qkv"),
                   (vmod, "_check_layout", "varlen._check_layout"), (vmod, "_launch_forward", "varlen._launch_fwd"),
                   (vmod, "_kernel_views", "varlen._kernel_views"), (vmod, "_run", "varlen._run")]
    win_targets = [] if bwd_mod is None else [
        (bwd_mod, "_launch_backward", "bwd._launch_backward"), (bwd_mod, "_new_out", "bwd._new_out"),
        (bwd_mod, "_bwd_host", "bwd._bwd_host"), (bwd_mod, "_bwd_workspace", "bwd._bwd_workspace"),
        (bwd_mod, "_launch_entry", "bwd._launch_entry"), (bwd_mod, "_dense", "bwd._dense"),
        (bwd_mod, "_score_launch", "bwd._score_launch")]
    for new in (False, True):
        use(switches, new)
        for row, fn, est, targets in (("doc fwd", doc_fwd, 0.2, doc_targets), ("win bwd", win_bwd, 0.45, win_targets)):
            host, still, rows_ = breakdown(fn, a.n, est, targets)
            print(f"BREAKDOWN {row} {'new' if new else 'old'}: host {host:.1f} us a call (busy {still}); inclusive us "
                  "(calls) " + ", ".join(f"{lab} {us:.1f} ({c:.0f})" for lab, us, c in rows_ if c))
    use(switches, False)
    # torch baselines on this host
    x = torch.empty(S, 16, 128, device="cuda", dtype=torch.bfloat16)
    for name, f in (("empty_like 32MB", lambda: torch.empty_like(x)), ("transpose", lambda: x.transpose(0, 1)),
                    ("zero_ 4B", lambda: x[0, 0, :2].zero_())):
        t0 = time.perf_counter_ns()
        for _ in range(1000):
            f()
        print(f"BASE {name} {(time.perf_counter_ns() - t0) / 1000 / 1e3:.2f} us", flush=True)
    print(f"total {time.perf_counter() - t_start:.1f} s; {'FAILED: ' + '; '.join(FAILS) if FAILS else 'all checks pass'}")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main())
