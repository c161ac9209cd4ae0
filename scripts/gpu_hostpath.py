"""Host time per call of fagen.attention with user mods against the plain call (issue 26: the modded path's host
time showed up in the mods bench's kernel times, since triton.testing.do_bench flushes L2 for ~80 us before each
call and a host path longer than that delays the next launch).

    PYTHONPATH=$PWD python3 scripts/gpu_hostpath.py            # H100: well under a minute; $OUT/hostpath.json if set
    GPU_HOSTPATH_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_hostpath.py   # CPU: tiny shapes under TRITON_INTERPRET=1

Rows, all without gradient (torch.no_grad), bf16 [1, 16, 8192, 128] (dry: [1, 2, 272, 64], fp32):
  causal     fagen.attention(q, k, v, mask="causal")
  document   mask_mod = attention-gym's document mask (the mods bench's row), block_mask = create_block_mask of it
  sliding    mask_mod = attention-gym's sliding window (1024) + causal, with its block mask
  softcap    score_mod = attention-gym's tanh softcap (30)
Columns:
  host us    host time per call: 50 calls back to back (no sync inside), the min over 5 runs of the mean (the
             GPU runs behind; the queue stays short of its limit). Dry run: the interpreter's launch stubbed out
             after a first real call, so only the host path is timed.
  no steps   the same with every loaded module's _STEPS keeping nothing ([Note] Forward steps): the general path
             of _launch_forward on every call, as the modded forward ran before it kept steps (the Gluon forward
             has no steps: its two columns agree)
  bench ms   triton.testing.do_bench of the call (L2 flushed before each call, as `fagen bench --suite mods`); GPU only
  check      max |out - ref| / max |ref| against SDPA on the mask's dense boolean form in float32 (causal: SDPA's
             is_causal; softcap: the float64 score_mod reference), at the timed shape's first 1024 queries (dry: all)

A second table, "changed closure scalar" (issue 26's target: host time within 1.2x of an unchanged call), at the
mods bench's changed-scalar shape bf16 [1, 16, 1024, 128] (dry: [1, 2, 80, 16] fp32), rows: attention-gym's
sliding window + causal (a closure int, 100 + i % 64) and tanh softcap (a closure float, 30 + i % 64), each with
mod lowering on (they become the window / softcap switch) and off (the modded kernels). Columns, host us per call:
  unchanged  one function object, its closure cell set to the same number before each call (each column the best
             of 5 passes of 200 calls, the columns interleaved)
  same obj   the same function object, its closure cell set to a new number before each call
  new obj    a new function object from attention-gym's factory per call (made before the loop), the mods bench's
             pattern
  ratios     same obj / unchanged and new obj / unchanged (target <= 1.2)
  prep new   fagen.runtime.mods.prepare alone on the new objects (the trace cache's lookup and closure read)
  gc off     new obj again with Python's garbage collector disabled around the loop (a diagnostic)
  check      max |out - ref| / max |ref| of two calls with two different numbers, each against its own float64
             reference (the mask's dense form / the score_mod reference), first 256 queries
"""

from __future__ import annotations

import json
import os
import sys
import time

DRY = os.environ.get("GPU_HOSTPATH_DRY") == "1"
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import fagen  # noqa: E402
from fagen.bench import gym_mods as g  # noqa: E402

DEVICE = "cpu" if DRY else "cuda"
B, H, S, D = (1, 2, 272, 64) if DRY else (1, 16, 8192, 128)
SCALAR_SHAPE = (1, 2, 80, 16) if DRY else (1, 16, 1024, 128)  # the mods bench's changed-scalar row (seq 1024)
DTYPE = torch.float32 if DRY else torch.bfloat16
CALLS, RUNS = 50, 5


def _doc_offsets():
    """The mods bench's packed documents (fagen/bench/mods.py cases(): random lengths 64 .. S/4, seed 0)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    lengths, left = [], S
    while left > 0:
        n = min(left, int(torch.randint(64, max(65, S // 4), (1,), generator=gen)))
        lengths.append(n)
        left -= n
    return g.length_to_offsets(lengths, DEVICE)


def rows():
    doc = g.generate_doc_mask_mod(g.causal_mask, _doc_offsets())
    sliding = g.generate_sliding_window(64 if DRY else 1024)
    softcap = g.generate_tanh_softcap(30.0)
    return [
        ("causal", dict(mask="causal"), None),
        ("document", dict(mask_mod=doc), doc),
        ("sliding", dict(mask_mod=sliding), sliding),
        ("softcap", dict(score_mod=softcap), None),
    ]


class _NoSteps(dict):
    """A module's _STEPS that keeps nothing: every call takes the general path of _launch_forward."""

    def __setitem__(self, key, value):
        pass


def host_us(call) -> float:
    best = float("inf")
    for _ in range(RUNS):
        if not DRY:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(CALLS):
            call()
        best = min(best, (time.perf_counter() - t0) / CALLS)
    if not DRY:
        torch.cuda.synchronize()
    return best * 1e6


def reference(q, k, v, kw, mask_fn):
    """float32 SDPA (float64 on the CPU) of the row on q's first rows."""
    n = min(q.shape[2], 1024)
    dt = torch.float64 if DRY else torch.float32
    qr, kr, vr = q[:, :, :n].to(dt), k.to(dt), v.to(dt)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if "score_mod" in kw:
        s = (qr @ kr.transpose(-1, -2)) / q.shape[-1] ** 0.5
        s = 30.0 * torch.tanh(s / 30.0)
        return torch.softmax(s, -1) @ vr, n
    if mask_fn is None:  # causal, bottom-right aligned; Sq = Sk here
        return sdpa(qr, kr, vr, is_causal=True), n
    from fagen.verify.mods_reference import mask_mod_visible

    visible = mask_mod_visible(mask_fn, 1, 1, q.shape[2], k.shape[2], DEVICE)[:, :, :n]
    return sdpa(qr, kr, vr, attn_mask=visible), n


def main() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device=DEVICE, dtype=DTYPE) for _ in range(3))
    torch.set_grad_enabled(False)
    calls = []
    for name, kw, mask_fn in rows():  # phase 1: the first call of each row (compiles; dry: runs interpreted), checked
        if mask_fn is not None:
            kw = {**kw, "block_mask": fagen.create_block_mask(mask_fn, None, None, S, S, device=DEVICE)}

        def call(kw=kw):
            return fagen.attention(q, k, v, **kw)
        out = call()
        ref, n = reference(q, k, v, kw, mask_fn)
        err = float((out[:, :, :n].to(ref.dtype) - ref).abs().max() / ref.abs().max())
        check = f"{err:.1e}" + (" ok" if err < (2e-2 if DTYPE == torch.bfloat16 else 1e-4) else " BAD")
        calls.append((name, call, check))
    scalar_checked = scalar_first_calls()
    if DRY:  # from here on the interpreter launches nothing: the host path alone is timed
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run = lambda self, *a, **kw: None
    table = []
    for name, call, check in calls:  # phase 2: warm calls, timed
        call()
        host = host_us(call)
        kept = [m for n, m in list(sys.modules.items()) if n.startswith("fagen_generated.") and hasattr(m, "_STEPS")]
        saved = [m._STEPS for m in kept]
        for m in kept:  # the general path on every call, as before the modded forward kept steps
            m._STEPS = _NoSteps()
        general = host_us(call)
        for m, steps in zip(kept, saved):
            m._STEPS = steps
        bench = "-"
        if not DRY:
            import triton

            bench = f"{triton.testing.do_bench(call, warmup=25, rep=100):.3f}"
        table.append((name, host, general, bench, check))
        print(f"{name:9s} host {host:7.1f} us  no steps {general:7.1f} us  bench {bench} ms  check {check}", flush=True)
    print()
    print(f"fagen.attention host time per call, no grad, {tuple(q.shape)} {str(DTYPE)[6:]} on "
          f"{torch.cuda.get_device_name() if not DRY else 'CPU (dry run, launches stubbed)'}")
    print(f"{'row':9s} {'host us':>8s} {'no steps':>9s} {'bench ms':>9s}  check")
    for name, host, general, bench, check in table:
        print(f"{name:9s} {host:8.1f} {general:9.1f} {bench:>9s}  {check}")
    scalar = scalar_table(scalar_checked)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "hostpath.json"), "w") as f:
            json.dump({"rows": [dict(row=r, host_us=h, no_steps_us=n, bench_ms=b, check=c)
                                for r, h, n, b, c in table], "changed_scalar": scalar}, f, indent=1)


# -- a changed closure scalar ---------------------------------------------------------------------------------------
SCALAR_ROWS = (  # (row, the factory, keyword, the first number)
    ("sliding", lambda x: g.generate_sliding_window(int(x)), "mask_mod", 100),
    ("softcap", lambda x: g.generate_tanh_softcap(float(x)), "score_mod", 30.0),
)


def _number_cell(fn):
    """The closure cell holding fn's number (through and_masks' tuple of functions)."""
    for cell in fn.__closure__ or ():
        x = cell.cell_contents
        if type(x) in (int, float):
            return cell
        for inner in (x if isinstance(x, tuple) else (x,)):
            if callable(inner) and getattr(inner, "__closure__", None):
                found = _number_cell(inner)
                if found is not None:
                    return found
    return None


def _scalar_inputs():
    torch.manual_seed(1)
    return [torch.randn(*SCALAR_SHAPE, device=DEVICE, dtype=DTYPE) for _ in range(3)]


def scalar_first_calls() -> dict:
    """Each row's first calls (compiles; dry: interpreted), lowering on and off, checked at two numbers."""
    from fagen.mods import lower
    from fagen.verify.mods_reference import mask_mod_visible, score_mod_scores

    q, k, v = _scalar_inputs()
    n = min(256, q.shape[2])
    checks = {}
    for name, make, kw, base in SCALAR_ROWS:
        for low in (True, False):
            lower.ENABLED = low
            worst = 0.0
            try:
                for x in (base, base + 37):
                    fn = make(x)
                    out = fagen.attention(q, k, v, **{kw: fn})
                    qr, kr, vr = q[:, :, :n].double(), k.double(), v.double()
                    s = (qr @ kr.transpose(-1, -2)) / q.shape[-1] ** 0.5
                    if kw == "score_mod":
                        s = score_mod_scores(fn, s)
                    else:
                        s = s.masked_fill(~mask_mod_visible(fn, 1, 1, q.shape[2], k.shape[2], DEVICE)[:, :, :n],
                                          float("-inf"))
                    ref = torch.softmax(s, -1) @ vr
                    worst = max(worst, float((out[:, :, :n].double() - ref).abs().max() / ref.abs().max()))
            finally:
                lower.ENABLED = True
            checks[name, low] = f"{worst:.1e}" + (" ok" if worst < (2e-2 if DTYPE == torch.bfloat16 else 1e-4)
                                                  else " BAD")
    return checks


def scalar_table(checks: dict) -> list[dict]:
    import gc

    from fagen.mods import lower
    from fagen.runtime import modded
    from fagen.runtime.mods import prepare

    q, k, v = _scalar_inputs()
    calls = 200
    rows = []
    for name, make, kw, base in SCALAR_ROWS:
        numbers = [type(base)(base + i % 64) for i in range(calls)]
        for low in (True, False):
            lower.ENABLED = low
            try:
                one = make(base)
                cell = _number_cell(one)

                def unchanged(one=one, cell=cell):
                    cell.cell_contents = base
                    fagen.attention(q, k, v, **{kw: one})

                def same(one=one, cell=cell, it=iter(range(1 << 30))):
                    cell.cell_contents = numbers[next(it) % calls]
                    fagen.attention(q, k, v, **{kw: one})
                batches = []  # never-seen function objects: one list per timed run (and one for the warm-up)

                def fresh():
                    batches.append([make(x) for x in numbers])

                def timed(call, gc_off=False, new=False) -> float:
                    """Seconds of one pass of `call` (200 calls)."""
                    if new:
                        fresh()
                    if not DRY:
                        torch.cuda.synchronize()
                    if gc_off:
                        gc.disable()
                    t0 = time.perf_counter()
                    call()
                    took = time.perf_counter() - t0
                    gc.enable()
                    if not DRY:
                        torch.cuda.synchronize()
                    return took

                def loop(fn):
                    return lambda: [fn() for _ in range(calls)]

                def new_objects():
                    for fn in batches.pop():
                        fagen.attention(q, k, v, **{kw: fn})

                def prepare_new():
                    for fn in batches.pop():
                        prepare(**{kw: fn})
                for call in (unchanged, same):
                    call()
                fresh()
                new_objects()
                columns = {"unchanged_us": (loop(unchanged), False, False), "same_obj_us": (loop(same), False, False),
                           "new_obj_us": (new_objects, False, True), "prepare_new_us": (prepare_new, False, True),
                           "new_obj_gc_off_us": (new_objects, True, True)}
                best = dict.fromkeys(columns, float("inf"))
                for _ in range(RUNS):  # the columns interleaved, each its best pass: a busy host skews none of them
                    for col, (call, gc_off, new) in columns.items():
                        best[col] = min(best[col], timed(call, gc_off, new))
                row = dict(row=name, lowering=low, **{c: t / calls * 1e6 for c, t in best.items()},
                           lowered_to=modded.LOWERED[0], check=checks[name, low])
            finally:
                lower.ENABLED = True
            row["same_ratio"] = row["same_obj_us"] / row["unchanged_us"]
            row["new_ratio"] = row["new_obj_us"] / row["unchanged_us"]
            rows.append(row)
    print()
    print(f"changed closure scalar: host us per call, no grad, {SCALAR_SHAPE} {str(DTYPE)[6:]} on "
          f"{torch.cuda.get_device_name() if not DRY else 'CPU (dry run, launches stubbed)'} (target ratio <= 1.2)")
    print(f"{'row':8s} {'lowering':8s} {'unchanged':>9s} {'same obj':>9s} {'new obj':>8s} {'same/unch':>9s} "
          f"{'new/unch':>8s} {'prep new':>8s} {'gc off':>7s}  lowered to / check")
    for r in rows:
        print(f"{r['row']:8s} {'on' if r['lowering'] else 'off':8s} {r['unchanged_us']:9.1f} {r['same_obj_us']:9.1f} "
              f"{r['new_obj_us']:8.1f} {r['same_ratio']:9.2f} {r['new_ratio']:8.2f} {r['prepare_new_us']:8.1f} "
              f"{r['new_obj_gc_off_us']:7.1f}  {r['lowered_to']} / {r['check']}")
    return rows


if __name__ == "__main__":
    main()
