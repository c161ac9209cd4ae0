"""Thirteenth session, docsuite: why the mods suite's document+causal forward reads half speed in the suite's process.

    PYTHONPATH=$PWD python3 scripts/gpu_docsuite_s13.py      # ~60 s on an H100

One phase (a child process with a timeout) times the bench's document+causal forward (fagen/bench/mods.py's row:
the same mask_mod, block mask, inputs and _time) at stages of a process's life, printing each stage's line as it
comes: fresh; after `import torch._dynamo` and configure_dynamo (what the suite's first Flex row does); after a
torch.compile'd flex_attention call ran (a small one). Each stage prints do_bench's median (the bench's number),
the same with the garbage collector off, the CUDA kernels one call launches and their summed device time
(torch.profiler), and the host time of one call (enqueued behind a GPU sleep, so the queue never waits on the GPU).
A float64 check of the output (head 0) comes first. A second phase runs the suite's three rows before the document
row (fagen forwards without gradient) in a fresh process and times the row again.
"""

from __future__ import annotations

import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for _phases
from _phases import child_env, run_phase as run_child  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup():
    import torch

    import fagen
    from fagen.bench import mods as M

    shape = M.ModsShape()
    rows = {c[0]: c for c in M.cases(shape, "cuda")}
    _, _, mm, _ = rows["document+causal"]
    q, k, v, do = M._inputs(shape, "cuda", True)
    bm = fagen.create_block_mask(mm, None, None, shape.seq, shape.seq, device="cuda")
    doc = mm.__closure__[[c for c in mm.__code__.co_freevars].index("document_id")].cell_contents
    lengths = torch.bincount(doc.long()).double()
    pairs = float((lengths * (lengths + 1) / 2).sum()) * shape.heads
    fl = 4.0 * shape.head_dim * pairs
    return torch, fagen, M, shape, mm, bm, q, k, v, doc, fl


def _check(torch, fagen, mm, bm, q, k, v, doc):
    with torch.no_grad():
        out = fagen.attention(q, k, v, mask_mod=mm, block_mask=bm)
        q0, k0, v0 = (t[0, 0].double() for t in (q, k, v))
        s = (q0 @ k0.T) / q0.shape[-1] ** 0.5
        i = torch.arange(q0.shape[0], device=q.device)
        keep = (doc[i][:, None] == doc[i][None, :]) & (i[:, None] >= i[None, :])
        ref = torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v0
        err = (out[0, 0].double() - ref).abs().max().item()
    print(f"check: document+causal fwd head 0 max |err| vs float64 {err:.2e} ({'ok' if err < 2e-2 else 'BAD'})",
          flush=True)


def _stage(label, torch, fagen, M, mm, bm, q, k, v, fl):
    from fagen.runtime import modded

    call = lambda: fagen.attention(q, k, v, mask_mod=mm, block_mask=bm)  # noqa: E731
    with torch.no_grad():
        call()
        torch.cuda.synchronize()
        ms = M._time(call, "cuda", 100.0)
        gc.disable()
        try:
            ms_nogc = M._time(call, "cuda", 100.0)
        finally:
            gc.enable()
        # host time: 50 calls enqueued while the GPU sleeps (the queue never waits on the device)
        torch.cuda._sleep(int(2e8))
        t0 = time.perf_counter()
        for _ in range(50):
            call()
        host_us = (time.perf_counter() - t0) / 50 * 1e6
        torch.cuda.synchronize()
        kern, dev_us = {}, float("nan")
        try:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    call()
                torch.cuda.synchronize()
            for e in prof.events():
                if e.device_type is not None and "CUDA" in str(e.device_type) and e.time_range.elapsed_us() > 0:
                    c, t = kern.get(e.name, (0, 0.0))
                    kern[e.name] = (c + 1, t + e.time_range.elapsed_us())
            dev_us = sum(t for _, t in kern.values()) / 3
        except Exception as e:  # the timing lines still print
            print(f"  profiler failed: {type(e).__name__}: {e}", flush=True)
    x = q[0, 0, :16]
    t0 = time.perf_counter()
    for _ in range(200):
        torch.empty_like(x)
        x.transpose(0, 0)
    ops_us = (time.perf_counter() - t0) / 200 * 1e6
    state = (f"two torch ops {ops_us:.2f} us; torch fn modes {torch._C._len_torch_function_stack()}, trace "
             f"{sys.gettrace() is not None}, profile {sys.getprofile() is not None}, gc counts {gc.get_count()}, "
             f"objects {len(gc.get_objects()) // 1000}k, allocated {torch.cuda.memory_allocated() >> 20} MB, "
             f"reserved {torch.cuda.memory_reserved() >> 20} MB")
    names = "; ".join(f"{n[:60]} x{c // 3}" for n, (c, _) in sorted(kern.items(), key=lambda x: -x[1][1]))
    print(f"{label:<22} do_bench {ms * 1e3:7.1f} us {fl / ms / 1e9:5.0f} TF/s | gc off {ms_nogc * 1e3:7.1f} us "
          f"{fl / ms_nogc / 1e9:5.0f} TF/s | device {dev_us:7.1f} us | host {host_us:6.1f} us | lowered "
          f"{modded.LOWERED[0]} | kernels: {names}", flush=True)
    print(f"  state: {state}", flush=True)
    return host_us


def _cprofile(label, fagen, torch, mm, bm, q, k, v):
    import cProfile
    import io
    import pstats

    with torch.no_grad():
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(50):
            fagen.attention(q, k, v, mask_mod=mm, block_mask=bm)
        pr.disable()
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(8)
    body = [ln for ln in buf.getvalue().splitlines() if ln.strip() and ("(" in ln or "ncalls" in ln)]
    print(f"  cProfile {label} (50 calls), top tottime:", flush=True)
    for ln in body[:10]:
        print("   ", ln.strip()[:150], flush=True)


def stages_phase():
    torch, fagen, M, shape, mm, bm, q, k, v, doc, fl = _setup()
    print(f"setup: doc ids {doc.dtype} {tuple(doc.shape)}, {int(doc.max()) + 1} documents, sparsity "
          f"{bm.sparsity():.3f}, useful GF {fl / 1e9:.1f}", flush=True)
    _check(torch, fagen, mm, bm, q, k, v, doc)
    _stage("fresh", torch, fagen, M, mm, bm, q, k, v, fl)
    _cprofile("fresh", fagen, torch, mm, bm, q, k, v)
    import torch._dynamo  # noqa: F401

    from fagen.bench.peers import configure_dynamo

    configure_dynamo()
    _stage("dynamo imported", torch, fagen, M, mm, bm, q, k, v, fl)
    _cprofile("dynamo imported", fagen, torch, mm, bm, q, k, v)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    s = 1024
    qs = torch.randn(1, 4, s, 64, device="cuda", dtype=torch.bfloat16)
    fb = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, s, s, device="cuda")
    t0 = time.perf_counter()
    with torch.no_grad():
        compiled(qs, qs, qs, block_mask=fb)
    torch.cuda.synchronize()
    print(f"  (flex compiled and ran in {time.perf_counter() - t0:.1f} s)", flush=True)
    _stage("after a flex call", torch, fagen, M, mm, bm, q, k, v, fl)
    _cprofile("after a flex call", fagen, torch, mm, bm, q, k, v)


def rows_phase():
    """The suite's rows before document+causal (fagen only, forwards without gradient), then the row again."""
    torch, fagen, M, shape, mm, bm, q, k, v, doc, fl = _setup()
    _stage("fresh (2nd process)", torch, fagen, M, mm, bm, q, k, v, fl)
    rows = {c[0]: c for c in M.cases(shape, "cuda")}
    for name in ("relative-bias", "alibi", "softcap"):
        _, sm, _, _ = rows[name]
        t0 = time.perf_counter()
        with torch.no_grad():
            ms = M._time(lambda: fagen.attention(q, k, v, score_mod=sm), "cuda", 50.0)
        print(f"  ran {name} fwd ({ms * 1e3:.0f} us a call; {time.perf_counter() - t0:.1f} s)", flush=True)
    _stage("after 3 rows' fwd", torch, fagen, M, mm, bm, q, k, v, fl)


PHASES = {"stages": (stages_phase, 40), "rows": (rows_phase, 24)}


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        PHASES[sys.argv[2]][0]()
        return
    import tempfile

    env = child_env(os.path.join(tempfile.gettempdir(), "fagen-docsuite-s13"), ROOT)
    t0 = time.time()
    for name, (_, limit) in PHASES.items():
        print(f"[{time.time() - t0:5.1f}s] #### phase {name} (timeout {limit}s)", flush=True)
        rc, _ = run_child(os.path.abspath(__file__), name, limit, env)
        print(f"[{time.time() - t0:5.1f}s] #### phase {name}: rc={rc}", flush=True)


if __name__ == "__main__":
    main()
