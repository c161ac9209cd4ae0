"""Fourteenth session, house round A: the document+causal forward's host path through the varlen module's public
launch_forward() (fagen/runtime/api.py, [Note] Document forward's host path) against the thirteenth session's
private reach-in (its DOCUMENT_FORWARD 2: _check_qkv, _check_scale, _launch_forward) and forward(check=False).

    PYTHONPATH=$PWD python3 scripts/gpu_house_s14.py      # ~60 s on an H100

Phase "host" (a child process with a timeout): the mods bench's document+causal inputs (B1 H16 S8192 d128 bf16,
fagen/bench/mods.py; scripts/gpu_docsuite_s13.py's _setup and float64 check of head 0), then bitwise: the direct
path's out against the two older entries' and the autograd path's (with gradients: run_split and the module's
attention()). Then, after one untimed pass of each, three rounds, the entries' order rotated (each first once), for
each entry: the host time of fagen.attention (50 calls enqueued
behind a GPU sleep, so no call waits on the device; median of 3), the host time of the module call alone (the
entry itself, 200 calls), and the bench's _time (do_bench, L2 flushed, median; TF/s). Phase "bench": `cli.py bench
--suite mods --case document+causal --skip-flex` in what time is left (the suite's row, fagen's forward and
backward).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for _phases
from _phases import child_env, run_phase as run_child  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T0 = time.time()


def _entries(api):
    """The document forward's module call by entry: (name, f(module, q, k, v, cu, longest, scale) -> out)."""
    def public(m, q, k, v, cu, longest, scale):
        return m.launch_forward(q, k, v, scale=scale, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                max_seqlen_k=longest)[0]

    def private(m, q, k, v, cu, longest, scale):  # the thirteenth session's DOCUMENT_FORWARD 2
        m._check_qkv(q, k, v)
        return m._launch_forward(q, k, v, m._check_scale(scale), cu, cu, None, longest, longest)[0]

    def forward(m, q, k, v, cu, longest, scale):
        return m.forward(q, k, v, scale=scale, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                         max_seqlen_k=longest, check=False)[0]
    return {"public": public, "private": private, "forward": forward}


def _install(api, entry):
    """api._document_forward with `entry` as its module call (the rest of the host path unchanged)."""
    def doc(q, k, v, runs, scale, check):
        cu, longest = runs
        q, k, v = q.squeeze(0).transpose(0, 1), k.squeeze(0).transpose(0, 1), v.squeeze(0).transpose(0, 1)
        module = api.resolve_varlen(q, k, v, "causal")
        return entry(module, q, k, v, cu, longest, scale).transpose(0, 1).unsqueeze(0)
    api._document_forward = doc


def _host(torch, call, n=50):
    got = []
    for _ in range(3):
        torch.cuda._sleep(int(2e8))
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        got.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(got)


def host_phase(rounds=3):
    import gpu_docsuite_s13 as a  # the thirteenth session's setup and float64 check

    torch, fagen, M, shape, mm, bm, q, k, v, doc, fl = a._setup()
    from fagen.runtime import api

    real = api._document_forward
    entries = _entries(api)
    a._check(torch, fagen, mm, bm, q, k, v, doc)
    call = lambda: fagen.attention(q, k, v, mask_mod=mm, block_mask=bm)  # noqa: E731
    with torch.no_grad():
        outs = {"direct": call()}
        for name, entry in entries.items():
            _install(api, entry)
            outs[name] = call()
        api._document_forward = real
    grad = call()  # q, k, v require grad: run_split and the module's autograd Function
    outs["autograd"] = grad.detach()
    del grad
    print("bitwise equal to the direct path: " + ", ".join(
        f"{n} {torch.equal(o, outs['direct'])}" for n, o in outs.items() if n != "direct"), flush=True)
    # the entry alone, on the module's views and the split's runs
    from fagen.runtime import modded

    views = [t.detach().squeeze(0).transpose(0, 1) for t in (q, k, v)]
    module = api.resolve_varlen(*views, "causal")
    got = {}

    def keep(q_, k_, v_, runs_, scale, check):
        got["runs"] = runs_
        return real(q_, k_, v_, runs_, scale, check)
    api._document_forward = keep
    with torch.no_grad():
        call()
    api._document_forward = real
    cu, longest = got["runs"]
    print(f"runs: {cu.numel() - 1} documents, longest {longest}; lowered {modded.LOWERED[0]}", flush=True)
    res = {n: [] for n in entries}
    with torch.no_grad():
        for name, entry in entries.items():  # one untimed pass each (round A's round 0 read ~200 us for all three)
            _install(api, entry)
            _host(torch, call)
        for rnd in range(rounds):
            names = list(entries)
            for name in names[rnd % 3:] + names[:rnd % 3]:  # rotated: each entry first in one round (round A:
                entry = entries[name]  # whichever ran first read 190-210 us, the rest 112-130)
                _install(api, entry)
                h = _host(torch, call)
                e = _host(torch, lambda: entry(module, *views, cu, longest, None), 200)
                ms = M._time(call, "cuda", 60.0)
                res[name].append((h, e, ms))
                print(f"[{time.time() - T0:5.1f}s] round {rnd} {name:<8} fagen.attention host {h:6.1f} us | entry "
                      f"alone {e:5.1f} us | do_bench {ms * 1e3:6.1f} us = {fl / ms / 1e9:4.0f} TF/s", flush=True)
        api._document_forward = real
    print(f"| entry | fagen.attention host us (median of {rounds} rounds) | entry alone us | do_bench us | TF/s |")
    print("|---|---|---|---|---|")
    for name, rows in res.items():
        h, e, ms = (statistics.median(r[i] for r in rows) for i in range(3))
        print(f"| {name} | {h:.1f} | {e:.1f} | {ms * 1e3:.1f} | {fl / ms / 1e9:.0f} |", flush=True)


PHASES = {"host": (host_phase, 34)}
BENCH_FLAGS = ("--skip-flex",)  # FlexAttention's compiles would not fit the round's 70 s


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        PHASES[sys.argv[2]][0]()
        return
    import tempfile

    env = child_env(os.path.join(tempfile.gettempdir(), "fagen-house-s14"), ROOT)
    for name, (_, limit) in PHASES.items():
        print(f"[{time.time() - T0:5.1f}s] #### phase {name} (timeout {limit}s)", flush=True)
        rc, _ = run_child(os.path.abspath(__file__), name, limit, env)
        print(f"[{time.time() - T0:5.1f}s] #### phase {name}: rc={rc}", flush=True)
    left = 67 - (time.time() - T0)
    cmd = [sys.executable, os.path.join(ROOT, "cli.py"), "bench", "--suite", "mods", "--case", "document+causal",
           *BENCH_FLAGS]
    print(f"[{time.time() - T0:5.1f}s] #### phase bench: {' '.join(cmd[2:])} (timeout {left:.0f}s)", flush=True)
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    threading.Thread(target=lambda: [print(line, end="", flush=True) for line in proc.stdout], daemon=True).start()
    try:
        rc = proc.wait(timeout=max(left, 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = f"killed after {left:.0f}s"
    time.sleep(0.5)
    print(f"[{time.time() - T0:5.1f}s] #### phase bench: rc={rc}", flush=True)

if __name__ == "__main__":
    main()
