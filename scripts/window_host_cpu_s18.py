"""The window row's backward host path on the CPU, its launches faked (issue 26; docs/mods.md "The window row's host
path (eighteenth session)"). The product's window render (bf16 d128 causal, variant bwd_window: the store chain with
the dependent conversion) is loaded as tests/test_gluon_bwd_window_chain.py loads it, its kernels replaced by the
tests' fakes (_JIT: the first call compiles, later ones go through _gluon_run's launch entry to a recorder), the
TMA encoder by test_hostpath's _Fill, the stream by a constant, and its _launch_forward by a stub returning kept
(out, lse): then torch.autograd.grad of `_Attention.apply(...)` runs exactly the host code of one backward of the
mods suite's window row (B1 H16 S8192 d128, window (1024, 0): CPU tensors at the real shapes; the host code only
reads their shapes, strides and addresses). Prints the median host time a call of three scopes (autograd.grad,
_Attention.backward with a stand-in ctx, _launch_backward) and a cProfile of the _launch_backward scope.

    PYTHONPATH=$PWD:$PWD/tests python3 scripts/window_host_cpu_s18.py [--n 2000] [--profile 20] [--ab 6]

$FAGEN_BWD_MEMO=0 (or --ab's off passes) takes the path without the launch memo ([Note] Launch memo).

CPU caveats: torch.empty of the three gradients is the CPU allocator's (a malloc, not the CUDA caching allocator's
free-list lookup), and the recorder replaces the C launch (cuLaunchKernelEx: a few us each on the GPU machine).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import types

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

B, H, S, D, LEFT = 1, 16, 8192, 128, 1024


def faked_module():
    """The product's window render with its launches faked (test_gluon_bwd_window_chain.store_fast's fakes, the
    dependent conversion as test_gluon_bwd_window_pdl's), its forward a stub."""
    import fagen
    from fagen.runtime.loader import load_source
    from test_gluon_bwd_host import MAIN_META, _JIT
    from test_gluon_bwd_window_chain import WINDOW_SPEC, _source
    from test_hostpath import _Fill

    mod = load_source(_source(), f"{fagen.KernelSpec(**WINDOW_SPEC).name}_host_s18")
    assert mod.BWD_WIN_CHAIN == 2 and mod.BWD_WIN_PDL == 1 and mod.BWD_DET_MODE == 0, "not the product's render"
    real, epi_tma = mod._BWD_KERNELS[0]
    pre, conv = _JIT(mod._bwd_preprocess, (7, 12)), _JIT(mod._dq_convert, (5, 8))
    chain = _JIT(mod._dq_convert_chain, 9)
    main = _JIT(real, 21, MAIN_META + ([dict(MAIN_META[0])] * 2 if epi_tma else []))
    fast_main = mod._gluon(main)
    for name, value in (("_FAST_LAUNCH", True), ("_KERNELS", {}), ("_BWD_WS", type(mod._BWD_WS)()),
                        ("_GLUON_FAST", True), ("_raw_stream", lambda device: 77),
                        ("_bwd_preprocess", pre), ("_dq_convert", conv), ("_dq_convert_chain", chain),
                        ("_BWD_KERNELS", {0: (main, epi_tma), 1: (main, epi_tma)}),
                        ("_fast_bwd_preprocess", mod._gluon(pre)), ("_fast_dq_convert", mod._gluon(conv)),
                        ("_fast_dq_convert_chain", mod._gluon(chain)),
                        ("_fast_bwd_kernels", {0: (fast_main, epi_tma), 1: (fast_main, epi_tma)})):
        setattr(mod, name, value)
    mod._NUM_SMS[-1] = 132
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.current_device = lambda: -1
    triton.runtime.driver._active = _Fill()
    mod._fakes = {"pre": pre, "main": main, "chain": chain, "conv": conv}
    return mod


def row_inputs(mod):
    torch.manual_seed(0)
    q, k, v = (torch.empty(B, H, S, D, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    out, lse = torch.empty(B, H, S, D, dtype=torch.bfloat16), torch.empty(B, H, S)
    mod._launch_forward = lambda *a: (torch.empty_like(out), lse)
    return q, k, v, torch.empty(B, H, S, D, dtype=torch.bfloat16)


def scopes(mod):
    """{name: callable} of the three scopes, each one backward of the row."""
    q, k, v, do = row_inputs(mod)
    # attention()'s checks refuse CPU inputs: its one call after them (forward only; the backward checks nothing)
    o = mod._Attention.apply(q, k, v, D ** -0.5, None, None, None, LEFT, 0, None, None, None, True)
    saved = (q.detach(), k.detach(), v.detach(), torch.empty_like(do), torch.empty(B, H, S), None, None, None, None,
             None)
    ctx = types.SimpleNamespace(saved_tensors=saved, needs_input_grad=(True, ) * 3 + (False, ) * 10, scale=D ** -0.5,
                                window_left=LEFT, window_right=0, softcap=None, deterministic=True)
    args = saved[:5] + (D ** -0.5, None, None, None, LEFT, 0, None, None, None)
    return {
        "autograd.grad": lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
        "_Attention.backward": lambda: mod._Attention.backward(ctx, do),
        "_launch_backward": lambda: mod._launch_backward(do, *args),
    }


def per_call_us(fn, n, reps=5):
    """Median over `reps` passes of the mean host time a call over n calls, in us."""
    passes = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        passes.append((time.perf_counter_ns() - t0) / n / 1e3)
    return statistics.median(passes), min(passes), max(passes)


def measure(mod, n):
    results = {}
    for name, fn in scopes(mod).items():
        for _ in range(20):
            fn()
        for fake in mod._fakes.values():
            fake.launcher.raw.clear()
        results[name] = per_call_us(fn, n)
    assert sum(len(f.compiles) for f in mod._fakes.values()) == 3, "a warm call went through fn[grid]"
    return results


def memo_entries(mod):
    """Launch memos kept over the module's workspaces ([Note] Launch memo): one a distinct set of addresses."""
    return sum(len(views[-1]) if type(views[-1]) is dict else 0 for kept in mod._BWD_WS.__dict__.values() for views in kept[1].values())


def ab(mod, n, passes):
    """Alternating passes with the launch memo on and off: {scope: ([on us], [off us])}."""
    results = {}
    for name, fn in scopes(mod).items():
        got = ([], [])
        for i in range(2 * passes):
            mod._BWD_MEMO = i % 2 == 0
            for _ in range(20):
                fn()
            got[i % 2].append(per_call_us(fn, n, reps=1)[0])
        results[name] = got
    mod._BWD_MEMO = True
    return results


def profile(mod, n, scope="_launch_backward", lines=28):
    fn = scopes(mod)[scope]
    for _ in range(20):
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(lines)
    return buf.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--profile", type=int, default=0, help="cProfile this many calls of _launch_backward")
    ap.add_argument("--scope", default="_launch_backward")
    ap.add_argument("--ab", type=int, default=0, help="this many alternating passes, the launch memo on / off")
    a = ap.parse_args()
    torch.set_num_threads(1)
    mod = faked_module()
    if a.ab:
        for name, (on, off) in ab(mod, a.n, a.ab).items():
            print(f"AB {name:22s} memo on {statistics.median(on):8.2f} us (passes {min(on):.2f}-{max(on):.2f}), "
                  f"off {statistics.median(off):8.2f} us (passes {min(off):.2f}-{max(off):.2f})")
        print(f"MEMO entries kept {memo_entries(mod)}")
        return
    for name, (med, lo, hi) in measure(mod, a.n).items():
        print(f"HOST {name:22s} {med:8.2f} us a call (passes {lo:.2f}-{hi:.2f}, n {a.n})")
    print(f"MEMO entries kept {memo_entries(mod)} (launch memo {'on' if getattr(mod, '_BWD_MEMO', False) else 'off'})")
    if a.profile:
        print(profile(mod, a.profile, a.scope))


if __name__ == "__main__":
    main()
