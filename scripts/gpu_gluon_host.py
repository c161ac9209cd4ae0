"""The Gluon (Hopper) forward's host path (issues 26, 28): fast launches against the plain JIT path, on an H100/H200.

    PYTHONPATH=$PWD python3 scripts/gpu_gluon_host.py            # every phase, each in a child with a timeout
    python scripts/gpu_gluon_host.py --phase host                # one phase here (no child, no timeout)
    GPU_GLUON_HOST_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_gluon_host.py   # CPU: sm_90 builds, Triton rows only

Phases (one table row per line, printed as it comes; $OUT/gluon_host.json if $OUT is set):
  check  the three Gluon modules (bf16 causal d128, fp8 causal d128, bf16 causal + window(100, 0) d128) at
         B2 H4 Sq 300 Sk 333: fast-path out/lse bitwise equal to the plain path's (fn[grid] with TensorDescriptors,
         _GLUON_FAST = False), max |out - ref| / max |ref| against the float64 reference; bf16 also under CUDA graph
         replay on new inputs (equal to eager) and torch.compile(fullgraph=True) (equal to eager)
  host   host us per call: 200 calls back to back, no sync inside, the min over 5 runs of the mean, at causal
         B1 H8 S128 D128 (the GPU idle-fast shape), fast and plain, beside the Triton forward fagen.attention takes
         below MIN_WORK (the bwd module's forward, fast launches); kernel ms (triton.testing.do_bench) at B1 H16
         S8192 (fp8: the same), fast and plain
         (interleaved, second pass); then the bf16 launch alone (fn[grid] with built descriptors, plain, fast)
  cross  per-call wall time (30 calls then a sync, min of 3, so max(host, GPU) per call in a queue): the Gluon
         forward (fast path) against the Triton one, d128 bf16, causal and none around MIN_WORK (B x Hq x Sq x Sk
         pairs), causal + window (left, 0) around WINDOW_MIN_WORK (pairs: B x Hq x Sq x (left + 1)); CROSS
  route  fagen.attention without gradient on either side of hopper.MIN_WORK / WINDOW_MIN_WORK: the module it took,
         its per-call wall time, and the other forward's (ok: within 5% of it or faster)
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
DRY = os.environ.get("GPU_GLUON_HOST_DRY") == "1"
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"
PHASE_TIMEOUT = {"host": 30, "cross": 25, "route": 20, "check": 30}  # round A: 44 s in all
CASES = {"bf16": dict(mask="causal", dtype="bf16"), "fp8": dict(mask="causal", dtype="fp8_e4m3"),
         "window": dict(mask="causal", dtype="bf16", window=True)}
# (label, B, H, S, window left or None, mask); pairs = B * H * S * (S or left + 1). Round A (0c6c5a6) crossed
# between 2^24 (1.56x) and 2^25 (0.83x) causal, windows won from 2^24 (0.75x); round B times around both rules.
CROSS = [("warm-up", 1, 16, 512, None, "causal"), ("2^24", 1, 16, 1024, None, "causal"),
         ("2^24.6", 1, 24, 1024, None, "causal"), ("2^25", 1, 32, 1024, None, "causal"),
         ("2^25 s2048", 1, 8, 2048, None, "causal"), ("2^26", 1, 16, 2048, None, "causal"),
         ("2^28", 1, 16, 4096, None, "causal"), ("none 2^24", 1, 16, 1024, None, "none"),
         ("none 2^25", 1, 32, 1024, None, "none"),
         ("w128 s2048", 1, 16, 2048, 128, "causal"), ("w256 s2048", 1, 16, 2048, 256, "causal"),
         ("w256 s4096 h8", 1, 8, 4096, 256, "causal"), ("w256 s4096", 1, 16, 4096, 256, "causal"),
         ("w512 s4096", 1, 16, 4096, 512, "causal"), ("w1024 s8192", 1, 16, 8192, 1024, "causal")]
# fagen.attention (no gradient) on either side of hopper.MIN_WORK / WINDOW_MIN_WORK: (label, H, S, window)
ROUTE = [("causal 2^24", 4, 2048, None), ("causal 2^25", 8, 2048, None),
         ("w(256,0) 2^23", 8, 4096, (256, 0)), ("w(256,0) 2^24", 16, 4096, (256, 0))]

def log(*parts):
    print(*parts, flush=True)


def gluon_module(name, mask="causal"):
    import fagen
    from fagen.spec.kernel import KernelSpec
    return fagen.load(KernelSpec(backend="gluon", head_dim=128, **dict(CASES[name], mask=mask)))


def triton_module(window=False, mask="causal"):
    """The module fagen.attention runs below MIN_WORK without gradients: the bwd spec's forward."""
    import torch

    import fagen
    from fagen.runtime import resolve
    q = torch.empty((1, 1, 16, 128), dtype=torch.bfloat16)
    return fagen.load(resolve.spec_for(q, q, q, mask=mask, switches=("window",) if window else ()))


def inputs(name, b, h, sq, sk, seed=0):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn((b, h, s, 128), generator=g, device="cuda") for s in (sq, sk, sk))
    dtype = torch.float8_e4m3fn if name == "fp8" else torch.bfloat16
    return q.to(dtype), k.to(dtype), v.to(dtype)


def call(mod, name, q, k, v, left=100, **kw):
    return mod.forward(q, k, v, window=(left, 0), **kw) if name == "window" else mod.forward(q, k, v, **kw)


def fast_entries(mod):
    """How many kept fast-launch entries the module's Gluon kernel has (0: every call went through fn[grid])."""
    return sum(1 for key, e in mod._KERNELS.items() if key[0] is mod._attn_fwd_hopper and e is not None)


def rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# -- phases --------------------------------------------------------------------------------------------------
def phase_check(results):
    import torch

    from fagen.verify import reference
    for name in CASES:
        mod = gluon_module(name)
        q, k, v = inputs(name, 2, 4, 300, 333)
        mod._GLUON_FAST = False
        plain = call(mod, name, q, k, v)
        mod._GLUON_FAST = True
        for _ in range(3):  # the first compiles (or finds the kernel) through fn[grid]; then the fast path
            fast = call(mod, name, q, k, v)
        torch.cuda.synchronize()
        same = torch.equal(plain[0], fast[0]) and torch.equal(plain[1], fast[1])
        want, want_lse = reference.attention(q.double(), k.double(), v.double(), mask="causal",
                                             window=(100, 0) if name == "window" else None)
        err = rel(fast[0], want)
        lerr = (fast[1].double() - want_lse).abs().max().item()
        ok = same and err < (6e-2 if name == "fp8" else 2e-2) and lerr < 5e-2
        log(f"check {name:7s} fast entries {fast_entries(mod)}  bitwise fast==plain {same}  rel out {err:.2e}  "
            f"lse abs {lerr:.2e}  {'PASS' if ok else 'FAIL'}")
        results.append(dict(phase="check", case=name, entries=fast_entries(mod), bitwise=same, rel=err,
                            lse=lerr, ok=ok))
    # CUDA graph: capture the fast path, replay on new inputs copied into the static ones, compare with eager
    mod = gluon_module("bf16")
    q, k, v = inputs("bf16", 2, 4, 300, 333, seed=1)
    sq, sk, sv = q.clone(), k.clone(), v.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            mod.forward(sq, sk, sv)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = mod.forward(sq, sk, sv)
    graph_ok = True
    for seed in (2, 3):
        nq, nk, nv = inputs("bf16", 2, 4, 300, 333, seed=seed)
        sq.copy_(nq), sk.copy_(nk), sv.copy_(nv)
        graph.replay()
        eager = mod.forward(nq, nk, nv)
        torch.cuda.synchronize()
        graph_ok &= torch.equal(static[0], eager[0]) and torch.equal(static[1], eager[1])
    log(f"check graph   capture + 2 replays on new inputs == eager: {graph_ok}  {'PASS' if graph_ok else 'FAIL'}")
    results.append(dict(phase="check", case="graph", ok=graph_ok))
    compiled = torch.compile(lambda a, b, c: mod.forward(a, b, c), fullgraph=True)
    got = compiled(q, k, v)
    eager = mod.forward(q, k, v)
    torch.cuda.synchronize()
    comp_ok = torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])
    log(f"check compile torch.compile(fullgraph=True) == eager: {comp_ok}  {'PASS' if comp_ok else 'FAIL'}")
    results.append(dict(phase="check", case="compile", ok=comp_ok))


def host_us(fn, calls=200, runs=5):
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


def phase_host(results):
    import torch
    from triton.testing import do_bench
    tri, tri_w = triton_module(), triton_module(window=True)
    for name in CASES:
        mod = gluon_module(name)
        q, k, v = inputs(name, 1, 8, 128, 128)
        row = {}
        for fast in (False, True, False, True):  # interleaved: the second pass of each counts
            mod._GLUON_FAST = fast
            row["fast" if fast else "plain"] = host_us(lambda: call(mod, name, q, k, v))
        t = tri_w if name == "window" else tri
        tq, tk, tv = inputs("bf16", 1, 8, 128, 128)
        row["triton"] = host_us(lambda: call(t, name, tq, tk, tv))
        bq, bk, bv = inputs(name, 1, 16, 8192, 8192)
        for fast in (False, True, False, True):  # interleaved: the second pass of each counts
            mod._GLUON_FAST = fast
            row["ms fast" if fast else "ms plain"] = do_bench(lambda: call(mod, name, bq, bk, bv), rep=100)
        log(f"host  {name:7s} plain {row['plain']:7.1f} us  fast {row['fast']:7.1f} us  "
            f"triton fwd {row['triton']:6.1f} us  | kernel B1 H16 S8192: plain {row['ms plain']:.3f} ms  "
            f"fast {row['ms fast']:.3f} ms  (fast entries {fast_entries(mod)})")
        results.append(dict(phase="host", case=name, **row))
    launch_only(results)


def launch_only(results):
    """The bf16 kernel's launch alone (arguments built once, as _launch_forward passes them): fn[grid] with four
    TensorDescriptors (the JIT dispatch), _gluon_run's plain path (descriptors built per call, then fn[grid]) and
    its fast path."""
    import torch
    mod = gluon_module("bf16")
    q, k, v = inputs("bf16", 1, 8, 128, 128)
    o, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda")
    n_m = -(-128 // (2 * mod.BLOCK_M))
    args = [mod._descriptor(q, mod.BLOCK_M), mod._descriptor(k, mod.BLOCK_N), mod._descriptor(v, mod.BLOCK_N),
            mod._descriptor(o, mod.BLOCK_M), lse, 0.125, n_m * 8, n_m, 8, 128, 128]
    if "TileCounter" in mod._attn_fwd_hopper.arg_names:
        args.append(torch.zeros(1, dtype=torch.int32, device="cuda"))
    consts = dict(HEAD_DIM=128, BLOCK_M=mod.BLOCK_M, BLOCK_N=mod.BLOCK_N, STAGES=mod.STAGES, GQA=mod.GQA,
                  CAUSAL=mod.CAUSAL, CONSUMER_REGS=mod.CONSUMER_REGS, LOADER_REGS=mod.LOADER_REGS, num_warps=4)
    grid = (n_m * 8, )
    descs = mod._plain_args(args)
    row = {"jit": host_us(lambda: mod._attn_fwd_hopper[grid](*descs, **consts))}
    for fast in (False, True):
        mod._GLUON_FAST = fast
        row["fast" if fast else "plain"] = host_us(lambda: mod._gluon_run(mod._attn_fwd_hopper, grid, args, consts))
    log(f"launch bf16 alone: fn[grid] with built descriptors {row['jit']:6.1f} us  plain path {row['plain']:6.1f} us"
        f"  fast path {row['fast']:6.1f} us")
    results.append(dict(phase="launch", case="bf16", **row))
    # where the rest of a fast call goes (bf16, the same shape): the whole call, _launch_forward (no checks), pieces
    split = {"forward": lambda: mod.forward(q, k, v),
             "_launch_forward": lambda: mod._launch_forward(q, k, v, 0.0883, None, None, None),
             "checks": lambda: (mod._check_qkv(q, k, v), mod._check_device(q)),
             "allocs": lambda: (mod._new_out(q), mod._new_lse(q)),
             "_tma_ready x4": lambda: [mod._tma_ready(t) for t in (q, k, v, o)]}
    if hasattr(mod, "_tile_counter"):
        split["_tile_counter"] = lambda: mod._tile_counter(q.device)
    times = {name: host_us(fn, runs=3) for name, fn in split.items()}
    log("split bf16 fast: " + "  ".join(f"{name} {t:.1f} us" for name, t in times.items()))
    results.append(dict(phase="split", case="bf16", **times))


def wall_ms(fn, calls=30, runs=3):
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


def phase_cross(results):
    mods = {}
    for label, b, h, s, left, mask in CROSS:
        name = "bf16" if left is None else "window"
        if (name, mask) not in mods:
            mods[(name, mask)] = (gluon_module(name, mask), triton_module(left is not None, mask))
        glu, tri = mods[(name, mask)]
        q, k, v = inputs("bf16", b, h, s, s)
        pairs = b * h * s * (s if left is None else min(s, left + 1))
        g = wall_ms(lambda: call(glu, name, q, k, v, left=left))
        t = wall_ms(lambda: call(tri, name, q, k, v, left=left))
        log(f"cross {label:14s} {mask:6s} pairs 2^{math.log2(pairs):5.2f}  gluon {g:7.3f} ms  triton {t:7.3f} ms  "
            f"gluon/triton {g / t:5.2f}")
        results.append(dict(phase="cross", case=label, mask=mask, pairs=pairs, gluon=g, triton=t))


def phase_route(results):
    """fagen.attention without gradient on either side of the size rules: which module served, and its per-call
    wall time beside the other module's (called directly)."""
    import torch

    import fagen
    from fagen.runtime import hopper, resolve
    log(f"route MIN_WORK 2^{math.log2(hopper.MIN_WORK):.0f}, WINDOW_MIN_WORK "
        f"2^{math.log2(getattr(hopper, 'WINDOW_MIN_WORK', hopper.MIN_WORK)):.0f}")
    for label, h, s, window in ROUTE:
        name = "bf16" if window is None else "window"
        q, k, v = inputs("bf16", 1, h, s, s)
        kw = {} if window is None else {"window": window}
        with torch.no_grad():
            fagen.attention(q, k, v, mask="causal", **kw)
            served = [m for key, m in resolve._FAST.items() if key[0] == q.dtype and key[2] == h
                      and key[6] == (() if window is None else ("window", ))]
            gluon = any(m.NAME.endswith("_gluon") for m in served)
            a = wall_ms(lambda: fagen.attention(q, k, v, mask="causal", **kw))
        other = triton_module(window is not None) if gluon else gluon_module(name)
        left = None if window is None else window[0]
        o = wall_ms(lambda: call(other, name, q, k, v, left=left))
        log(f"route {label:14s} fagen.attention took {'Gluon ' if gluon else 'Triton'} {a:7.3f} ms; the "
            f"{'Triton' if gluon else 'Gluon '} forward {o:7.3f} ms  {'ok' if a <= o * 1.05 else 'WORSE'}")
        results.append(dict(phase="route", case=label, gluon=gluon, attention=a, other=o))


def phase_dry(results):
    """CPU: render and build each Gluon module for sm_90 (no launch), the Triton rows under the interpreter."""
    import torch
    for name in CASES:
        t = time.time()
        kernel = gluon_module(name).compile_for()
        log(f"dry   {name:7s} sm_90 build ok ({time.time() - t:.1f} s), {len(kernel.metadata.tensordesc_meta)} "
            "TMA descriptors")
    tri = triton_module()
    q = torch.randn((1, 2, 40, 128)).bfloat16()
    t = time.perf_counter()
    for _ in range(3):
        tri.forward(q, q, q)
    log(f"dry   triton forward under the interpreter: {(time.perf_counter() - t) / 3 * 1e3:.1f} ms a call")
    results.append(dict(phase="dry", ok=True))


PHASES = {"check": phase_check, "host": phase_host, "cross": phase_cross, "route": phase_route,
          "dry": phase_dry}


def run_phase(name):
    results = []
    try:
        PHASES[name](results)
    except Exception:  # noqa: BLE001 - a phase's failure is printed, the table keeps the other rows
        log(f"phase {name} FAILED:\n{traceback.format_exc()}")
    log("RESULTS " + json.dumps(results))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=sorted(PHASES))
    args = parser.parse_args()
    if args.phase:
        return run_phase(args.phase)
    phases = ["dry"] if DRY else ["host", "cross", "route", "check"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    everything, start = [], time.time()
    for name in phases:
        log(f"== phase {name} (timeout {PHASE_TIMEOUT.get(name, 120)} s)")
        try:
            proc = subprocess.run([sys.executable, __file__, "--phase", name], env=env, capture_output=True,
                                  text=True, timeout=PHASE_TIMEOUT.get(name, 120))
            out = proc.stdout
            if proc.returncode:
                log(f"phase {name} exited {proc.returncode}: {proc.stderr[-2000:]}")
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            log(f"phase {name} TIMED OUT")
        for line in out.splitlines():
            if line.startswith("RESULTS "):
                everything += json.loads(line[8:])
            else:
                log(line)
    log(f"== done in {time.time() - start:.0f} s")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gluon_host.json").write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
