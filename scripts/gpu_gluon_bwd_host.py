"""The Gluon backward's host path and its size rule (issue 28, hopper.BWD_MIN_WORK), on an H100/H200.

    PYTHONPATH=$PWD python3 scripts/gpu_gluon_bwd_host.py            # every phase, each in a child with a timeout
    python scripts/gpu_gluon_bwd_host.py --phase host                # one phase here (no child, no timeout)
    GPU_GLUON_BWD_HOST_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_gluon_bwd_host.py   # CPU: sm_90 builds only

Stage 1 runs warm-causal, warm-none, warm-gqa (one fwd+bwd per timed shape: every kernel built, or found in
triton's disk cache) and check (+ compile) in parallel; stage 2 runs host, cross, cross2 one at a time on the warm
caches (cross, cross2, host). Each phase's lines are printed when it ends ($OUT/gluon_bwd_host.json if $OUT is set):
  host   host us per fwd+bwd call (module.attention + torch.autograd.grad; 100 calls back to back, no sync inside,
         min over 4 runs of the mean) at B1 H8 S256 causal d128 bf16: the Triton bwd module, the Gluon bwd module
         on the plain host path (_BWD_FAST = False) and the fast one, both modes; the backward alone
         (module.backward on saved out/lse); then the same fwd+bwd captured in a CUDA graph: replay host us
  cross  per-call wall time of fwd+bwd (10 calls then a sync, min of 3: max(host, GPU) per call in a queue),
         Triton against Gluon (fast path) in both modes, d128 bf16, causal / none / GQA 32/8 causal, 2^22 .. 2^31
         pairs (B x Hq x Sq x Sk), and which one hopper's rule (bwd_wins) picks
  cross2 the same for none and GQA 32/8 causal
  check  (with compile) B1 H2 300x300 causal: the fast path's gradients bitwise the plain path's, relative error
         against float64 autograd (Triton's beside it), two deterministic runs bitwise equal; the fwd+bwd CUDA
         graph replayed on new inputs == eager
         fagen.attention under torch.compile(fullgraph=True) with gradients runs the Gluon backward (counted
         launches) and matches eager; the fp8 forward under torch.compile(fullgraph=True) == eager
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DRY = os.environ.get("GPU_GLUON_BWD_HOST_DRY") == "1"
# round A (every phase a child, one after another, 14-24 s each) timed out in every phase: cold builds
PHASE_TIMEOUT = {"stage1": 40, "host": 12, "cross": 12, "cross2": 10}  # round B: stage 1 took 37 s
# (label, B, Hq, Hkv, S, mask)
CROSS = [("warm-up", 1, 16, 16, 512, "causal"),
         ("c 2^22", 1, 16, 16, 512, "causal"), ("c 2^24", 1, 16, 16, 1024, "causal"),
         ("c 2^25", 2, 16, 16, 1024, "causal"), ("c 2^26", 1, 16, 16, 2048, "causal"),
         ("c 2^27", 2, 16, 16, 2048, "causal"), ("c 2^28", 1, 16, 16, 4096, "causal"),
         ("c 2^28 b8", 8, 32, 32, 1024, "causal"), ("c 2^29", 2, 16, 16, 4096, "causal"),
         ("c 2^31", 1, 32, 32, 8192, "causal")]
CROSS2 = [("warm-up", 1, 16, 16, 512, "none"), ("n 2^22", 1, 16, 16, 512, "none"),
          ("n 2^24", 1, 16, 16, 1024, "none"),
         ("n 2^26", 1, 16, 16, 2048, "none"), ("n 2^28", 1, 16, 16, 4096, "none"),
         ("warm-up", 1, 32, 8, 512, "causal"), ("g 2^23", 1, 32, 8, 512, "causal"), ("g 2^25", 1, 32, 8, 1024, "causal"),
         ("g 2^27", 1, 32, 8, 2048, "causal"), ("g 2^29", 2, 32, 8, 4096, "causal")]


def log(*parts):
    print(*parts, flush=True)


def modules(mask="causal", gqa=1):
    """(Triton bwd module, Gluon bwd module) of d128 bf16 `mask` `gqa`."""
    import fagen
    from fagen.spec.kernel import KernelSpec
    tri = fagen.load(KernelSpec(head_dim=128, mask=mask, gqa=gqa, dtype="bf16", direction="bwd"))
    glu = fagen.load(KernelSpec(head_dim=128, mask=mask, gqa=gqa, dtype="bf16", direction="bwd", backend="gluon"))
    return tri, glu


def inputs(b, hq, hkv, sq, sk, seed=0, grad=True):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn((b, hq, sq, 128), generator=g, device="cuda").bfloat16()
    k = torch.randn((b, hkv, sk, 128), generator=g, device="cuda").bfloat16()
    v = torch.randn((b, hkv, sk, 128), generator=g, device="cuda").bfloat16()
    do = torch.randn((b, hq, sq, 128), generator=g, device="cuda").bfloat16()
    return q.requires_grad_(grad), k.requires_grad_(grad), v.requires_grad_(grad), do


def step(mod, q, k, v, do, det=True):
    """One fwd+bwd through the module's autograd (what fagen.attention runs with gradients)."""
    import torch
    kw = {} if det else {"deterministic": False}
    return torch.autograd.grad(mod.attention(q, k, v, **kw), (q, k, v), do)


def reference(q, k, v, do, causal):
    """float64 autograd gradients; bottom-right causal."""
    import torch
    gqa = q.shape[1] // k.shape[1]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    kk, vv = (t.repeat_interleave(gqa, dim=1) for t in (k64, v64))
    s = (q64 @ kk.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    out = torch.softmax(s, -1).nan_to_num(0.0) @ vv
    return torch.autograd.grad(out, (q64, k64, v64), do.double())


def rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def host_us(fn, calls=100, runs=4):
    import torch
    fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(runs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    torch.cuda.synchronize()
    return best * 1e6


def wall_ms(fn, calls=10, runs=3):
    import torch
    fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(runs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e3


def graph_of(fn):
    """(graph, static outputs) of fn captured after two warm-up calls on a side stream."""
    import torch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()
    return graph, static


# -- phases --------------------------------------------------------------------------------------------------
def phase_host(results):
    import torch
    tri, glu = modules()
    q, k, v, do = inputs(1, 8, 8, 256, 256)
    row = {"triton": host_us(lambda: step(tri, q, k, v, do))}
    for fast in (False, True, False, True):  # interleaved: the second pass of each counts
        glu._BWD_FAST = fast
        row["fast" if fast else "plain"] = host_us(lambda: step(glu, q, k, v, do))
    row["fast unord"] = host_us(lambda: step(glu, q, k, v, do, det=False))
    log(f"host  fwd+bwd B1 H8 S256 causal: triton {row['triton']:6.1f} us  gluon plain {row['plain']:6.1f} us  "
        f"gluon fast {row['fast']:6.1f} us  fast unordered {row['fast unord']:6.1f} us")
    results.append(dict(phase="host", case="fwd+bwd", **row))
    qd, kd, vd = (t.detach() for t in (q, k, v))
    saved = {m: m.forward(qd, kd, vd) for m in (tri, glu)}
    bw = {"triton": host_us(lambda: tri.backward(do, qd, kd, vd, *saved[tri]))}
    for fast in (False, True):
        glu._BWD_FAST = fast
        bw["fast" if fast else "plain"] = host_us(lambda: glu.backward(do, qd, kd, vd, *saved[glu]))
    log(f"host  bwd alone: triton {bw['triton']:6.1f} us  gluon plain {bw['plain']:6.1f} us  "
        f"gluon fast {bw['fast']:6.1f} us")
    results.append(dict(phase="host", case="bwd", **bw))
    out, lse = saved[glu]
    split = {"_launch_backward": lambda: glu._launch_backward(do, qd, kd, vd, out, lse, 0.0884, None, None, None),
             "_run_backward_fast": lambda: glu._run_backward_fast(do, qd, kd, vd, out, lse, 0.0884,
                                                                  *(torch.empty_like(t) for t in (qd, kd, vd)), 0),
             "_bwd_workspace": lambda: glu._bwd_workspace(1, 8, 256, 0, qd),
             "empty x3": lambda: [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (qd, kd, vd)],
             "checks": lambda: (glu._check_qkv(qd, kd, vd), glu._check_saved(do, out, lse, qd),
                                glu._check_device(qd))}
    times = {name: host_us(fn, runs=3) for name, fn in split.items()}
    log("split gluon bwd fast: " + "  ".join(f"{name} {t:.1f} us" for name, t in times.items()))
    results.append(dict(phase="split", **times))
    rep = {}
    for name, mod in (("triton", tri), ("gluon", glu)):
        graph, _ = graph_of(lambda: step(mod, q, k, v, do))
        rep[name] = host_us(graph.replay)
        rep[name + " gpu"] = wall_ms(graph.replay, calls=50) * 1e3
    log(f"graph fwd+bwd replay: triton host {rep['triton']:6.1f} us (per call in a queue {rep['triton gpu']:6.1f} "
        f"us)  gluon host {rep['gluon']:6.1f} us (in a queue {rep['gluon gpu']:6.1f} us)")
    results.append(dict(phase="host", case="graph", **rep))


def phase_cross(results, cases=CROSS):
    from fagen.runtime import hopper
    mods = {}
    for label, b, hq, hkv, s, mask in cases:
        key = (mask, hq // hkv)
        if key not in mods:
            mods[key] = modules(mask, hq // hkv)
        tri, glu = mods[key]
        q, k, v, do = inputs(b, hq, hkv, s, s)
        t = wall_ms(lambda: step(tri, q, k, v, do))
        g = wall_ms(lambda: step(glu, q, k, v, do))
        u = wall_ms(lambda: step(glu, q, k, v, do, det=False))
        pairs = b * hq * s * s
        rule = getattr(hopper, "bwd_wins", None)
        picks = ("gluon" if rule(b, hq, hkv, s, s, mask) else "triton") if rule else \
            ("gluon" if pairs >= hopper.BWD_MIN_WORK else "triton")
        if label == "warm-up":
            continue
        log(f"cross {label:10s} B{b} H{hq}/{hkv} S{s:5d} {mask:6s} 2^{math.log2(pairs):5.2f}  triton {t:7.3f} ms  "
            f"gluon det {g:7.3f} ms ({g / t:4.2f}x)  unord {u:7.3f} ms ({u / t:4.2f}x)  rule: {picks}")
        results.append(dict(phase="cross", case=label, b=b, hq=hq, hkv=hkv, s=s, mask=mask, pairs=pairs,
                            triton=t, det=g, unordered=u, picks=picks))


def phase_check(results):
    import torch

    for mask, sq, sk in (("causal", 300, 300), ):
        tri, glu = modules(mask)
        q, k, v, do = inputs(1, 2, 2, sq, sk, seed=3)
        want = reference(q, k, v, do, mask == "causal")
        glu._BWD_FAST = False
        plain = step(glu, q, k, v, do)
        glu._BWD_FAST = True
        fast = [step(glu, q, k, v, do) for _ in range(3)]
        unord = step(glu, q, k, v, do, det=False)
        base = step(tri, q, k, v, do)
        torch.cuda.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(plain, fast[0]))
        rep = all(torch.equal(a, b) for f in fast[1:] for a, b in zip(f, fast[0]))
        errs = [rel(a, b) for a, b in zip(fast[0], want)]
        uerr = [rel(a, b) for a, b in zip(unord, want)]
        terr = [rel(a, b) for a, b in zip(base, want)]
        ok = same and rep and max(errs) < 2 * max(terr) + 1e-3 and max(uerr) < 2 * max(terr) + 1e-3
        log(f"check {mask:6s} {sq}x{sk}: fast==plain bitwise {same}  det runs bitwise {rep}  rel dq/dk/dv "
            f"{'/'.join(f'{e:.2e}' for e in errs)} (unordered {max(uerr):.2e}, triton {max(terr):.2e})  "
            f"{'PASS' if ok else 'FAIL'}")
        results.append(dict(phase="check", case=mask, bitwise=same, repeat=rep, rel=errs, unordered=uerr,
                            triton=terr, ok=ok))
    tri, glu = modules("causal")
    q, k, v, do = inputs(1, 2, 2, 300, 300, seed=4)
    sq, sk, sv, sdo = (t.detach().clone().requires_grad_(t.requires_grad) for t in (q, k, v, do))
    graph, static = graph_of(lambda: step(glu, sq, sk, sv, sdo))
    graph_ok = True
    for seed in (5, 6):
        nq, nk, nv, ndo = inputs(1, 2, 2, 300, 300, seed=seed)
        with torch.no_grad():
            sq.copy_(nq), sk.copy_(nk), sv.copy_(nv), sdo.copy_(ndo)
        graph.replay()
        eager = step(glu, nq, nk, nv, ndo)
        torch.cuda.synchronize()
        graph_ok &= all(torch.equal(a, b) for a, b in zip(static, eager))
    log(f"check graph  fwd+bwd capture + 2 replays on new inputs == eager (bitwise): {graph_ok}  "
        f"{'PASS' if graph_ok else 'FAIL'}")
    results.append(dict(phase="check", case="graph", ok=graph_ok))


def phase_compile(results):
    """torch.compile(fullgraph=True, Inductor): fagen.attention with gradients takes the Gluon backward (the size
    floor lifted to reach it at a small shape)."""
    import torch

    import fagen
    from fagen.runtime import api, hopper
    hopper.BWD_MIN_WORK = api.BWD_MIN_WORK = 0
    _, glu = modules("causal")
    q, k, v, do = inputs(1, 2, 2, 300, 300, seed=4)
    calls = []
    launch = glu._launch_backward
    glu._launch_backward = lambda *a, **kw: (calls.append(1), launch(*a, **kw))[1]

    def f(a, b, c):
        return fagen.attention(a, b, c, mask="causal")

    try:
        compiled = torch.compile(f, fullgraph=True)
        got = torch.autograd.grad(compiled(q, k, v), (q, k, v), do)
        eager = step(glu, q, k, v, do)
        torch.cuda.synchronize()
        comp_ok = bool(calls) and all(torch.equal(a, b) for a, b in zip(got, eager))
        log(f"check compile torch.compile(fullgraph=True) fwd+bwd: gluon backward ran {len(calls)}x, == eager "
            f"gluon: {comp_ok}  {'PASS' if comp_ok else 'FAIL'}")
    except Exception as e:  # noqa: BLE001 - a graph break or a failure is the result
        comp_ok = False
        log(f"check compile FAIL: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    results.append(dict(phase="check", case="compile", ok=comp_ok))
    # the fp8 forward's operator ([Note] fp8 operator): forward() under torch.compile(fullgraph=True) == eager
    from fagen.spec.kernel import KernelSpec
    fp8 = fagen.load(KernelSpec(backend="gluon", head_dim=128, mask="causal", dtype="fp8_e4m3"))
    q8, k8, v8 = (t.detach().to(torch.float8_e4m3fn) for t in (q, k, v))
    kd = torch.tensor([0.5, 2.0], device="cuda")
    try:
        got = torch.compile(lambda a, b, c: fp8.forward(a, b, c, k_descale=kd), fullgraph=True,
                            backend="aot_eager")(q8, k8, v8)
        want = fp8.forward(q8, k8, v8, k_descale=kd)
        torch.cuda.synchronize()
        ok = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        log(f"check fp8 op torch.compile(fullgraph=True) fp8 forward == eager: {ok}  {'PASS' if ok else 'FAIL'}")
    except Exception as e:  # noqa: BLE001 - a graph break or a failure is the result
        ok = False
        log(f"check fp8 op FAIL: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    results.append(dict(phase="check", case="fp8 op", ok=ok))


def phase_warm(results, group):
    """Build (first call: compile, or find in triton's disk cache) every kernel specialisation the timed phases
    launch: one fwd+bwd per shape of the group, Triton and Gluon, both modes."""
    import torch
    cases = {"causal": [("host", 1, 8, 8, 256, "causal")] + CROSS[1:],
             "none": CROSS2[1:5], "gqa": CROSS2[6:]}[group]
    mods = {}
    for label, b, hq, hkv, s, mask in cases:
        t = time.time()
        key = (mask, hq // hkv)
        if key not in mods:
            mods[key] = modules(mask, hq // hkv)
        tri, glu = mods[key]
        q, k, v, do = inputs(b, hq, hkv, s, s)
        step(tri, q, k, v, do), step(glu, q, k, v, do), step(glu, q, k, v, do, det=False)
        torch.cuda.synchronize()
        log(f"warm  {group:6s} {label:10s} built ({time.time() - t:4.1f} s)")
    results.append(dict(phase="warm", case=group, ok=True))


def phase_dry(results):
    """CPU: render each Gluon bwd module of the script and build its kernels for sm_90 (no launch)."""
    for mask, gqa in (("causal", 1), ("none", 1), ("causal", 4)):
        t = time.time()
        _, glu = modules(mask, gqa)
        for det in (True, False):
            glu.compile_backward_for(deterministic=det)
        log(f"dry   {mask:6s} gqa {gqa}: sm_90 builds of both modes ok ({time.time() - t:.1f} s); fast host "
            f"path {'on' if glu._BWD_FAST else 'off'}")
    results.append(dict(phase="dry", ok=True))


PHASES = {"host": phase_host, "cross": phase_cross, "cross2": lambda results: phase_cross(results, CROSS2),
          "check": lambda results: (phase_check(results), phase_compile(results)), "dry": phase_dry,
          "warm-causal": lambda results: phase_warm(results, "causal"),
          "warm-none": lambda results: phase_warm(results, "none"),
          "warm-gqa": lambda results: phase_warm(results, "gqa")}


def run_phase(name):
    results = []
    try:
        PHASES[name](results)
    except Exception:  # noqa: BLE001 - a phase's failure is printed, the table keeps the other rows
        log(f"phase {name} FAILED:\n{traceback.format_exc()}")
    log("RESULTS " + json.dumps(results))


def start_phase(name, env):
    """A child running one phase, its stdout in a temporary file (kept whole if the child is killed)."""
    import tempfile
    out = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, __file__, "--phase", name], env=env, stdout=out,
                            stderr=subprocess.STDOUT, text=True)
    return name, proc, out


def finish_phase(child, deadline, everything):
    """Wait for a child until `deadline` (time.time()), kill it past that; print its lines, keep its results."""
    name, proc, out = child
    try:
        proc.wait(timeout=max(1.0, deadline - time.time()))
        status = f"rc={proc.returncode}"
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        status = "TIMED OUT"
    out.seek(0)
    log(f"== phase {name}: {status}")
    for line in out.read().splitlines():
        if line.startswith("RESULTS "):
            everything += json.loads(line[8:])
        else:
            log(line)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=sorted(PHASES))
    args = parser.parse_args()
    if args.phase:
        return run_phase(args.phase)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    everything, start = [], time.time()
    # Stage 1, in parallel: the builds of every timed shape (cold on a fresh machine: ~10 s a Gluon module) and
    # the checks (their own shapes; torch.compile). Stage 2, one at a time on warm caches: the timings.
    stage1 = ["dry"] if DRY else ["warm-causal", "warm-none", "warm-gqa", "check"]
    children = [start_phase(name, env) for name in stage1]
    for child in children:
        finish_phase(child, start + PHASE_TIMEOUT["stage1"], everything)
    log(f"== stage 1 done at {time.time() - start:.0f} s")
    # round B (65 s limit) ended in cross2: the rule's phases first now
    for name in ([] if DRY else ["cross", "cross2", "host"]):
        finish_phase(start_phase(name, env), time.time() + PHASE_TIMEOUT[name], everything)
    log(f"== done in {time.time() - start:.0f} s")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gluon_bwd_host.json").write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
