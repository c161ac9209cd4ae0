"""Thirteenth session, docsuite round B: the document+causal forward's direct path (fagen/runtime/api.py,
DOCUMENT_FORWARD; [Note] Document forward's host path) against the split's path through fagen.attention, alone and
in a process in the suite's state.

    PYTHONPATH=$PWD python3 scripts/gpu_docsuite_s13b.py      # ~55 s on an H100

Phases (child processes with timeouts): "alone", a fresh process; "suite", a process that then imports Dynamo, runs
a torch.compile'd flex_attention call and the suite's three rows before the document row (fagen forwards), as the
mods suite's process has when it reaches the row. Each reading: the bench's _time (do_bench, L2 flushed, median)
of the bench's document+causal forward (same mask_mod, block mask, inputs), DOCUMENT_FORWARD 0, 1, 2 alternated
three times; the host time of a call (50 calls enqueued behind a GPU sleep, median of 3); the kernels' device time
(torch.profiler). First, both paths against float64 (head 0) and against each other (bitwise).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for _phases
from _phases import child_env, run_phase as run_child  # noqa: E402

import gpu_docsuite_s13 as a  # noqa: E402  round A's setup and check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _host(torch, call):
    got = []
    with torch.no_grad():
        for _ in range(3):
            torch.cuda._sleep(int(2e8))
            t0 = time.perf_counter()
            for _ in range(50):
                call()
            got.append((time.perf_counter() - t0) / 50 * 1e6)
            torch.cuda.synchronize()
    return statistics.median(got)


def _device(torch, call):
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            call()
        torch.cuda.synchronize()
    return sum(e.time_range.elapsed_us() for e in prof.events()
               if e.device_type is not None and "CUDA" in str(e.device_type)) / 3


def _readings(label, torch, fagen, M, mm, bm, q, k, v, fl):
    from fagen.runtime import api

    call = lambda: fagen.attention(q, k, v, mask_mod=mm, block_mask=bm)  # noqa: E731
    res = {0: [], 1: [], 2: []}
    with torch.no_grad():
        for on in res:
            api.DOCUMENT_FORWARD = on
            call()
        torch.cuda.synchronize()
        for _ in range(3):
            for on in res:
                api.DOCUMENT_FORWARD = on
                res[on].append(M._time(call, "cuda", 100.0))
    for on in res:
        api.DOCUMENT_FORWARD = on
        host, dev = _host(torch, call), _device(torch, call)
        ms = res[on]
        print(f"{label:<6} DOCUMENT_FORWARD={on} do_bench "
              f"{' / '.join(f'{x * 1e3:.1f}' for x in ms)} us = {' / '.join(f'{fl / x / 1e9:.0f}' for x in ms)} TF/s "
              f"| host {host:.1f} us a call | device {dev:.1f} us", flush=True)


def _checks(torch, fagen, mm, bm, q, k, v, doc):
    from fagen.runtime import api

    outs = []
    for on in (0, 1, 2):
        api.DOCUMENT_FORWARD = on
        print(f"DOCUMENT_FORWARD={on}: ", end="", flush=True)
        a._check(torch, fagen, mm, bm, q, k, v, doc)
        with torch.no_grad():
            outs.append(fagen.attention(q, k, v, mask_mod=mm, block_mask=bm))
    print(f"modes 0, 1, 2 bitwise equal: {torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])}", flush=True)


def alone_phase():
    torch, fagen, M, shape, mm, bm, q, k, v, doc, fl = a._setup()
    _checks(torch, fagen, mm, bm, q, k, v, doc)
    _readings("alone", torch, fagen, M, mm, bm, q, k, v, fl)


def suite_phase():
    torch, fagen, M, shape, mm, bm, q, k, v, doc, fl = a._setup()
    _readings("fresh", torch, fagen, M, mm, bm, q, k, v, fl)
    import torch._dynamo  # noqa: F401
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from fagen.bench.peers import configure_dynamo

    configure_dynamo()
    compiled = torch.compile(flex_attention, dynamic=False)
    qs = torch.randn(1, 4, 1024, 64, device="cuda", dtype=torch.bfloat16)
    fb = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 1024, 1024, device="cuda")
    with torch.no_grad():
        compiled(qs, qs, qs, block_mask=fb)
    rows = {c[0]: c for c in M.cases(shape, "cuda")}
    for name in ("relative-bias", "alibi", "softcap"):
        with torch.no_grad():
            M._time(lambda: fagen.attention(q, k, v, score_mod=rows[name][1]), "cuda", 30.0)
    print("  (the suite's state: Dynamo, a compiled Flex call, relative-bias, alibi and softcap forwards)", flush=True)
    _readings("suite", torch, fagen, M, mm, bm, q, k, v, fl)


PHASES = {"alone": (alone_phase, 24), "suite": (suite_phase, 42)}


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
