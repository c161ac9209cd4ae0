"""The mods suite's slow window backward, twenty-first session's probe (issue 26; docs/mods.md "The window row's
backward in the suite").

The twentieth session found that `_attn_bwd_hopper` of the sliding-window+causal row runs 437.9 us in a process
that first ran the suite's five rows before it (5 rounds each, with Flex) and 406.2 us alone, on the same inputs;
not the host, not the workspace's or the inputs' addresses. This probe runs each state in its own child process
and, in each, the same measurements: the window row's kernels under torch.profiler (CUPTI, 30 calls), the
compiled kernels' identity (module, hash, registers, spills, shared memory), the SM / memory clocks and throttle
reasons sampled while 1000 calls run, and the allocator's state.

  alone      a fresh process: the window row (`mod_rows`, rounds 5, no Flex), then the measurements;
  preload    the same after 256 extra CUDA modules loaded first (a small cubin, loaded again and again): whether
             where the driver places the window kernels' code matters;
  after      the suite's six rows up to the window row (`mod_rows`, rounds 5) WITHOUT Flex, then the measurements,
             then the same after gc + empty_cache + fresh inputs (a fresh allocator state in the slow process);
  flex       (round A) the same six rows WITH Flex, as the suite runs them, then the measurements; the processes
             holding a CUDA context (nvidia-smi) and this process's children; then again after inductor's compile
             workers are shut down, then after torch._dynamo.reset() + gc + empty_cache + fresh inputs.

    PYTHONPATH=$PWD python3 scripts/gpu_window_gap_s21.py [--only alone,after] [--timeout 150]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

ROWS = ("relative-bias", "alibi", "softcap", "document+causal", "prefix-lm", "sliding-window+causal")


def _identity():
    """The loaded window module's compiled kernels: name, hash, registers, spills, shared memory."""
    out = []
    for name, m in sorted(sys.modules.items()):
        if "_win_" not in name or not hasattr(m, "_BWD_KERNELS"):
            continue
        out.append(f"module {name.rpartition('.')[2][:80]}")
        for kname in ("_attn_bwd_hopper", "_attn_bwd_hopper_u", "_dq_convert_chain", "_bwd_preprocess"):
            fn = getattr(m, kname, None)
            for dev, caches in getattr(fn, "device_caches", {}).items():
                for key, ck in caches[0].items():
                    md = ck.metadata
                    out.append(f"  {kname} dev{dev} hash {ck.hash[:16]} regs {ck.n_regs} spills {ck.n_spills} "
                               f"shared {md.shared} warps {md.num_warps} loaded {ck.module is not None}")
    return out


def _clocks(f, n=1000):
    """SM / memory clocks, temperature, power and throttle reasons, sampled while n calls of f run."""
    for _ in range(n):
        f()
    time.sleep(0.05)
    q = "clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_event_reasons.active"
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001 - report, the timings stand
        r = f"nvidia-smi failed: {e}"
    torch.cuda.synchronize()
    return r


def _measure(label, f, flush, kernel_profile):
    from fagen.bench.timing import timed_calls

    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    for _ in range(10):
        f()
    torch.cuda.synchronize()
    ms = [statistics.median(timed_calls(f, flush, 10, 60, ev, torch.cuda.synchronize)) for _ in range(3)]
    print(f"[{label}] timed_calls ms {' '.join(f'{x:.4f}' for x in ms)}", flush=True)
    print(f"[{label}] clocks while running: {_clocks(f)}", flush=True)
    s = torch.cuda.memory_stats()
    print(f"[{label}] allocator: reserved {s.get('reserved_bytes.all.current', 0) / 2**20:.0f} MiB, segments "
          f"{s.get('segment.all.current', 0)}, active blocks {s.get('active.all.current', 0)}, allocs so far "
          f"{s.get('allocation.all.allocated', 0)}", flush=True)
    print(f"[{label}] kernel profile:", flush=True)
    kernel_profile(f, flush)


def child(mode):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_window_gap_s19 import _kernel_profile

    import fagen
    from fagen.bench import mods as M
    from fagen.bench.timing import _zero_flush

    dev = torch.device("cuda")
    shape = M.ModsShape()
    flush = _zero_flush(dev)
    t0 = time.time()
    if mode == "preload":
        import triton
        import triton.language as tl

        @triton.jit
        def _dummy(x):
            tl.store(x + tl.arange(0, 128), tl.arange(0, 128).to(tl.float32))

        x = torch.empty(128, device="cuda")
        ck = _dummy[(1, )](x)
        utils = triton.runtime.driver.active.utils
        keep = [utils.load_binary(ck.name, ck.asm["cubin"], ck.metadata.shared, torch.cuda.current_device())
                for _ in range(256)]
        print(f"preloaded {len(keep)} modules of {len(ck.asm['cubin'])} B cubin", flush=True)
    if mode in ("after", "flex"):
        rows = M.mod_rows("cuda", shape, log=lambda *x, **y: None, flex=mode == "flex", rounds=5, only=set(ROWS))
        for r in rows:
            print(f"SUITE {r['case']:<24} fagen bwd {r.get('fagen', {}).get('bwd_ms', float('nan')):.4f} ms "
                  f"(rounds {r.get('fagen', {}).get('bwd_rounds_ms')})", flush=True)
    else:
        (r, ) = M.mod_rows("cuda", shape, log=lambda *x, **y: None, flex=False, rounds=5,
                           only={"sliding-window+causal"})
        print(f"ROW window fagen bwd {r['fagen']['bwd_ms']:.4f} ms (rounds {r['fagen']['bwd_rounds_ms']})",
              flush=True)
    print(f"rows done at {time.time() - t0:.0f} s", flush=True)
    for line in _identity():
        print(line, flush=True)
    mm = M._gym().generate_sliding_window(1024)

    def call():
        q, k, v, do = M._inputs(shape, "cuda", True)
        bm = fagen.create_block_mask(mm, None, None, shape.seq, shape.seq, device="cuda")
        out = fagen.attention(q, k, v, mask_mod=mm, block_mask=bm)
        return lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    f = call()
    _measure(mode, f, flush, _kernel_profile)
    if mode == "after":
        import gc

        _contexts("after")
        del f
        gc.collect()
        torch.cuda.empty_cache()
        _measure("after, empty_cache + fresh inputs", call(), flush, _kernel_profile)
    if mode == "flex":
        import gc

        _contexts("flex")
        try:
            from torch._inductor.async_compile import shutdown_compile_workers

            shutdown_compile_workers()
            time.sleep(2)
            _contexts("flex, workers shut down")
            _measure("flex, workers shut down", f, flush, _kernel_profile)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"shutdown_compile_workers failed: {type(e).__name__}: {e}", flush=True)
        del f
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        _measure("flex, dynamo reset + empty_cache + fresh inputs", call(), flush, _kernel_profile)
    return 0


def _contexts(label):
    """The processes holding a context on the GPU, and this process's children (inductor's compile workers)."""
    try:
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip().replace("\n", "; ")
    except Exception as e:  # noqa: BLE001
        apps = f"nvidia-smi failed: {e}"
    me = os.getpid()
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == me:
                        kids.append(d)
            except (OSError, ValueError, IndexError):
                pass
    print(f"[{label}] me {me}; GPU contexts: {apps}; children {len(kids)}: {' '.join(kids[:12])}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="alone,preload,after")
    ap.add_argument("--timeout", type=int, default=150)
    ap.add_argument("--child")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no GPU: nothing to probe")
        return 0
    if a.child:
        return child(a.child)
    rc = 0
    for mode in a.only.split(","):
        t0 = time.time()
        print(f"===== {mode}", flush=True)
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode], timeout=a.timeout)
            rc |= p.returncode
            print(f"===== {mode} exit {p.returncode} in {time.time() - t0:.0f} s", flush=True)
        except subprocess.TimeoutExpired:
            print(f"===== {mode} TIMED OUT after {a.timeout} s", flush=True)
            rc = 1
    print(json.dumps({"rc": rc}))
    return rc


if __name__ == "__main__":
    sys.exit(main())
