"""The mods suite's two host-bound rows on the CPU, their launches faked (issue 26; docs/mods.md "The mods rows' host
path (nineteenth session)"):
  - doc fwd: fagen.attention(q, k, v, mask_mod=<attention-gym's document mask>, block_mask=bm) without gradients, B1
    H16 S8192 d128 bf16 CPU tensors, the bench's own mods (fagen/bench/mods.py cases()); the varlen causal module
    is the product's render with its kernel replaced by tests/test_launch.py's FakeTritonJIT (the first launch
    "compiles", later ones go through _run's launch entry to a recorder), and the block mask a BlockMask of the
    mask's text (its classes are only checked on this path; building the real one takes ~100 s in the interpreter);
  - win bwd: torch.autograd.grad of the window render's _Attention (scripts/window_host_cpu_s18.py's fakes).
Prints the host us a call of each (median of passes), with --ab N alternating passes of the old path (the levers
off) and the new (on), the launches recorded by both compared; --profile N cProfiles N calls of --row.

    PYTHONPATH=$PWD:$PWD/tests TRITON_INTERPRET=1 python3 scripts/mods_host_cpu_s19.py [--n 2000] [--ab 6]
        [--profile 2000 --row doc]

Levers (module flags): fagen.runtime.api.DOC_MEMO and fagen.runtime.modded.LOWER_MEMO (both removed from the product
in the nineteenth session's review; toggled only where present), the varlen module's _VARLEN_STEPS ([Note] Varlen steps).
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

os.environ.setdefault("TRITON_INTERPRET", "1")  # the varlen module's checks take CPU tensors only then

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
LEVERS = tuple((p, n) for p, n in (("fagen.runtime.api", "DOC_MEMO"), ("fagen.runtime.modded", "LOWER_MEMO"))
               if hasattr(__import__(p, fromlist=[n]), n))  # both removed in the nineteenth session's review
VARLEN = []  # the varlen module (its _VARLEN_STEPS: [Note] Varlen steps)


def use(new: bool):
    import importlib

    for path, name in LEVERS:
        setattr(importlib.import_module(path), name, new)
    for mod in VARLEN:
        mod._VARLEN_STEPS = new


def doc_row():
    """(call, recorder) of the document row: one forward without gradients a call."""
    import fagen
    from fagen.bench.mods import ModsShape, cases
    from fagen.runtime import resolve
    from fagen.runtime.block_mask import BlockMask
    from fagen.runtime.mods import prepare
    from test_launch import FakeTritonJIT

    shape = ModsShape()
    _, _, mm, _ = {c[0]: c for c in cases(shape, "cpu")}["document+causal"]
    s = shape.seq
    bm = BlockMask(prepare(mask_mod=mm).fields[1], s, s, 128, 128, torch.zeros(1, 1, s // 128, s // 128,
                                                                              dtype=torch.int8), 0.2)
    q, k, v = (torch.empty(1, shape.heads, s, shape.head_dim, dtype=shape.dtype) for _ in range(3))
    view = q.squeeze(0).transpose(0, 1)
    mod = resolve.resolve_varlen(view, view, view, "causal")
    fake = FakeTritonJIT(mod._attn_fwd)
    for name, value in (("_FAST_LAUNCH", True), ("_KERNELS", {}), ("_INTERPRET", True),
                        ("_raw_stream", lambda device: 77), ("_attn_fwd", fake)):
        setattr(mod, name, value)
    VARLEN.append(mod)

    def call():
        with torch.no_grad():
            return fagen.attention(q, k, v, score_mod=None, mask_mod=mm, block_mask=bm)

    return call, fake.launcher.calls


def win_row():
    """(call, recorder) of the window row: one backward of a kept graph a call."""
    import window_host_cpu_s18 as s18

    mod = s18.faked_module()
    return s18.scopes(mod)["autograd.grad"], mod._fakes["main"].launcher.raw


def per_call_us(fn, n, reps=5):
    passes = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        passes.append((time.perf_counter_ns() - t0) / n / 1e3)
    return statistics.median(passes), min(passes), max(passes)


def _same(old, new, stable):
    """Two recorded launches hand the launcher the same values: a tensor counts as its address (the launcher reads
    nothing else of it; a step passes the int), an address not in `stable` (the outputs, new each call) as "fresh"."""
    if isinstance(old, (tuple, list)):
        return isinstance(new, (tuple, list)) and len(old) == len(new) and all(
            _same(x, y, stable) for x, y in zip(old, new))
    if isinstance(old, torch.Tensor) or isinstance(new, torch.Tensor):
        a, b = (x.data_ptr() if isinstance(x, torch.Tensor) else x for x in (old, new))
        return type(a) is int and type(b) is int and (a == b or a not in stable and b not in stable)
    return type(old) is type(new) and old == new


def _addresses(args):
    """The addresses of the tensors in a recorded launch."""
    if isinstance(args, torch.Tensor):
        return {args.data_ptr()}
    if isinstance(args, (tuple, list)):
        return set().union(*(_addresses(x) for x in args)) if args else set()
    return set()


def _launches(fn, rec, new, calls=3):
    """The recorder's entries of `calls` warm calls in mode `new` (first a warm-up call)."""
    use(new)
    fn()
    rec.clear()
    for _ in range(calls):
        fn()
    got = list(rec)
    rec.clear()
    return got


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--ab", type=int, default=0, help="alternating passes, levers off / on")
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--row", default="doc", choices=("doc", "win"))
    ap.add_argument("--lines", type=int, default=32)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = {"doc": doc_row(), "win": win_row()}
    fails = 0
    for name, (fn, rec) in rows.items():
        old, new = _launches(fn, rec, False), _launches(fn, rec, True)
        stable = set.intersection(*(_addresses(x) for x in old)) if old else set()
        same = len(old) == len(new) > 0 and _same(old, new, stable)
        print(f"CHECK {'PASS' if same else 'FAIL'} {name}: the launches of 3 warm calls, old == new "
              f"({len(old)} recorded)", flush=True)
        fails += not same
    use(False)
    for new in (False, True) if a.profile else ():  # cProfile of --row, old path then new
        fn = rows[a.row][0]
        use(new)
        for _ in range(20):
            fn()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.profile):
            fn()
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumtime").print_stats(a.lines)
        print(f"PROFILE {a.row} {'new' if new else 'old'} ({a.profile} calls)\n{buf.getvalue()}")
        use(False)
    for name, (fn, rec) in rows.items():
        if a.ab:
            got = ([], [])
            for i in range(2 * a.ab):
                new = (i % 2 == 0) == (i // 2 % 2 == 0)  # off, on, on, off, off, on, ...
                use(new)
                for _ in range(20):
                    fn()
                rec.clear()
                got[new].append(per_call_us(fn, a.n, reps=1)[0])
            rec.clear()
            o, w = got
            ratios = [x / y for x, y in zip(o, w)]
            print(f"AB {name}: old {statistics.median(o):7.2f} us (passes {min(o):.2f}-{max(o):.2f}), new "
                  f"{statistics.median(w):7.2f} us (passes {min(w):.2f}-{max(w):.2f}), old/new per pass "
                  + " ".join(f"{r:.3f}" for r in ratios), flush=True)
        else:
            for new in (False, True):
                use(new)
                for _ in range(20):
                    fn()
                med, lo, hi = per_call_us(fn, a.n)
                rec.clear()
                print(f"HOST {name} {'new' if new else 'old'} {med:7.2f} us a call (passes {lo:.2f}-{hi:.2f}, "
                      f"n {a.n})", flush=True)
    use(False)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
