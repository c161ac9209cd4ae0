"""Issue 26's forward rows that miss >= 1.3x Flex (alibi, sliding-window + causal) and relative-bias, against
FlexAttention in the same process, with the variants this session decides, and host us per call.

    PYTHONPATH=$PWD python3 scripts/gpu_mods_fwd_s6.py        # H100, < 90 s; $OUT/mods_fwd_s6.json if set
    GPU_MODS_FWD_S6_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_mods_fwd_s6.py   # CPU interpreter, tiny, no Flex

bf16 d128 B1 H16 S8192 (the mods bench's shape, fagen/bench/mods.py ModsShape). Each phase runs in a child
process with a timeout (a faulting kernel loses its phase, not the table), in the order host, sliding window,
alibi, alibi+causal, relative-bias, within BUDGET_S for the run (a phase that would start too late is SKIPPED);
each row prints as its phase ends. Every variant's output is checked
against the reference (Flex's output on the GPU, the float64 reference in the dry run; max |diff| / max |ref| <=
2e-2) before it is timed; (n/c): not compared (another function). TF/s counts visible pairs (4 * D per pair).
Rows / variants:
  alibi          attention   fagen.attention(score_mod=gym ALiBi) (what the bench times; on this branch the mod
                             left is `score + kv_idx * S`, [Note] ALiBi without its row term)
                 as-written  the same with mod lowering off: the gym mod as written (the Gluon modded forward)
  alibi+causal   attention   gym ALiBi with mask_mod = causal (flex: the same with its block mask)
                 switch      fagen.attention(mask="causal", alibi_slopes=slopes): the ALiBi switch kernel
                 switch-fcols the switch kernel with |j - i| from float row / column vectors (a template variant)
                 switch-fstart the same with the columns as float(start_n) + a float arange (a template variant)
                 plain       mask="causal" alone (the ceiling: what the switch costs over it)
  sliding-window+causal attention (lowered: causal + window(1024, 0); this branch's WINDOW_MIN_WORK picks the
                 forward), triton / gluon (the thresholds set to force each)
  relative-bias  attention
  host           host us/call (50 calls back to back, min of 5 passes; gpu_hostpath.py's method) and do_bench ms
                 of the window switch call (attention's own pick, Triton forced, Gluon forced) at B1 H16 S8192, S4096
                 and S2048, window (1024, 0)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DRY = os.environ.get("GPU_MODS_FWD_S6_DRY", "0") == "1"
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"
PHASES = ("host", "sliding-window+causal", "alibi", "alibi+causal", "relative-bias")
BUDGET_S = 85.0  # the whole run (round A's 150 s run was killed before its table): later phases get what is left
TOL = 2e-2
T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def emit(**row):
    print("ROW " + json.dumps(row), flush=True)


def gluon_forced(fn, work=0):
    """fn with fagen.attention's Gluon thresholds (MIN_WORK, and WINDOW_MIN_WORK where this branch has it) set to
    `work` pairs: 0 forces the Gluon forward, 1 << 62 the Triton one."""
    from fagen.runtime import api

    def run(*a):
        old = api.MIN_WORK, getattr(api, "WINDOW_MIN_WORK", None)
        api.MIN_WORK = work
        if old[1] is not None:
            api.WINDOW_MIN_WORK = work
        try:
            return fn(*a)
        finally:
            api.MIN_WORK = old[0]
            if old[1] is not None:
                api.WINDOW_MIN_WORK = old[1]
    return run


# The ALiBi switch's per-element distance as float vectors (one conversion per row and per column, not per score):
# a template variant rendered from an edited copy of fagen/templates ($FAGEN_TEMPLATE_DIR), loaded beside the product.
FCOLS = ("triton/masks.j2",
         "{{ qk }} = {{ qk }} - {{ slope }} * tl.abs({{ cols }}[None, :] - {{ rows }}[:, None] - wshift).to(tl.float32)",
         "{{ qk }} = {{ qk }} - {{ slope }} * tl.abs({{ cols }}.to(tl.float32)[None, :] - ({{ rows }} + wshift)"
         ".to(tl.float32)[:, None])")
FSTART = (FCOLS[0], FCOLS[1],  # the columns as start_n + a hoisted float arange: one conversion per block
          "{{ qk }} = {{ qk }} - {{ slope }} * tl.abs((offs_n.to(tl.float32) + (start_n + 0.0))[None, :] - "
          "({{ rows }} + wshift).to(tl.float32)[:, None])")


def switch_variant_fn(q, edits, mask, **kw):
    import shutil
    import tempfile

    import torch

    from fagen.codegen import render as R
    from fagen.runtime import loader
    from fagen.runtime.device import gpu_arch
    from fagen.spec.kernel import KernelSpec

    root = os.path.join(tempfile.mkdtemp(prefix="fagen-tpl-"), "templates")
    shutil.copytree(R.TEMPLATE_DIR, root)
    for rel, old, new in edits:
        path = os.path.join(root, rel)
        text = open(path).read()
        assert old in text, f"the template no longer has {old[:60]!r}"
        open(path, "w").write(text.replace(old, new))
    spec = KernelSpec(head_dim=q.shape[-1], mask=mask, dtype={torch.bfloat16: "bf16", torch.float32: "fp32"}[q.dtype],
                      alibi=True, direction="fwd")
    if not DRY:
        spec = spec.for_arch(gpu_arch())
    os.environ["FAGEN_TEMPLATE_DIR"] = root
    try:
        module = loader.import_module(loader.source_path(spec).with_suffix(".py"))
    finally:
        del os.environ["FAGEN_TEMPLATE_DIR"]
    return lambda q, k, v: module.forward(q, k, v, **kw)[0]


def as_written(fn):
    """fn with mod lowering off: the mods run as written (the modded kernels)."""
    from fagen.mods import lower

    def run(*a):
        lower.ENABLED = False
        try:
            return fn(*a)
        finally:
            lower.ENABLED = True
    return run


def time_ms(fn, dev, rep_ms=15.0):
    from fagen.bench.timing import measure

    return measure(lambda i: fn(), 1, dev, 10.0, rep_ms)


def host_us(call, calls=50, runs=5):
    import torch

    best = float("inf")
    for _ in range(runs):
        if not DRY:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls if not DRY else 2):
            call()
        best = min(best, (time.perf_counter() - t0) / (calls if not DRY else 2))
    if not DRY:
        torch.cuda.synchronize()
    return best * 1e6


def phase(name):
    import torch

    import fagen
    from fagen.bench import gym_mods as g
    from fagen.bench.mods import ModsShape, cases

    dev = torch.device("cpu" if DRY else "cuda")
    shape = ModsShape(heads=2, seq=200, head_dim=32, dtype=torch.float32) if DRY else ModsShape()
    h, s, d = shape.heads, shape.seq, shape.head_dim
    gen = torch.Generator(device="cpu").manual_seed(1)
    q, k, v = (torch.randn(1, h, s, d, generator=gen).to(dev, shape.dtype) for _ in range(3))
    slopes = torch.exp2(-((torch.arange(h, dtype=torch.float32) + 1) * 8.0 / h)).to(dev)
    w = 64 if DRY else 1024

    def causal_pairs():
        return h * s * (s + 1) / 2

    def window_pairs():
        return h * sum(min(i, w) + 1 for i in range(s))

    if name == "host":
        for seq in ((s, 96) if DRY else (s, 4096, 2048)):  # 16 x S x 1025 pairs: about 2**27, 2**26, 2**25
            x = [t[:, :, :seq].contiguous() for t in (q, k, v)]
            pairs = h * sum(min(i, w) + 1 for i in range(seq))
            call = lambda: fagen.attention(*x, mask="causal", window=(w, 0))  # noqa: E731
            for label, fn in (("attention", call), ("triton", gluon_forced(call, 1 << 62)),
                              ("gluon", gluon_forced(call))):
                with torch.no_grad():
                    fn()
                    us = host_us(fn)
                    ms = None if DRY else time_ms(fn, dev)
                emit(row=f"window host S{seq}", variant=label, ms=ms, flops=4.0 * d * pairs, flex_ms=None,
                     check=f"host {us:.1f} us/call")
        return
    flex = None
    full = h * s * s
    if name == "alibi":
        sm, mm, pairs = g.generate_alibi_bias(h), None, full
        vs = [("attention", lambda: fagen.attention(q, k, v, score_mod=sm), True),
              ("as-written", as_written(lambda: fagen.attention(q, k, v, score_mod=sm)), True)]
    elif name == "alibi+causal":
        sm, mm, pairs = g.generate_alibi_bias(h), g.causal_mask, causal_pairs()
        vs = [("attention", lambda: fagen.attention(q, k, v, score_mod=sm, mask_mod=mm), True),
              ("switch", lambda: fagen.attention(q, k, v, mask="causal", alibi_slopes=slopes), True),
              ("plain", lambda: fagen.attention(q, k, v, mask="causal"), False)]
        try:
            fc = switch_variant_fn(q, [FCOLS], "causal", alibi_slopes=slopes)
            vs.insert(1, ("switch-fcols", lambda: fc(q, k, v), True))
            fs = switch_variant_fn(q, [FSTART], "causal", alibi_slopes=slopes)
            vs.insert(2, ("switch-fstart", lambda: fs(q, k, v), True))
        except Exception as e:  # noqa: BLE001
            emit(row=name, variant="switch-fcols", ms=None, flops=0, flex_ms=None, check=f"ERROR {e}"[:100])
    elif name == "sliding-window+causal":
        sm, mm, pairs = None, g.generate_sliding_window(w), window_pairs()
        bm = fagen.create_block_mask(mm, None, None, s, s, device=dev)
        call = lambda: fagen.attention(q, k, v, mask_mod=mm, block_mask=bm)  # noqa: E731
        vs = [("attention", call, True), ("triton", gluon_forced(call, 1 << 62), True),
              ("gluon", gluon_forced(call), True)]
    elif name == "relative-bias":
        _, sm, mm, _ = next(c for c in cases(shape, dev) if c[0] == "relative-bias")
        pairs = full
        vs = [("attention", lambda: fagen.attention(q, k, v, score_mod=sm), True)]
    with torch.no_grad():
        if DRY:
            from fagen.verify import reference

            want = reference.attention(q, k, v, score_mod=sm, mask_mod=mm)[0].to(q.dtype)
            flex_ms = None
        else:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            from fagen.bench.peers import configure_dynamo

            configure_dynamo()
            compiled = torch.compile(flex_attention, dynamic=False)
            fbm = None if mm is None else create_block_mask(mm, None, None, s, s, device=dev)
            flex = lambda: compiled(q, k, v, score_mod=sm, block_mask=fbm)  # noqa: E731
            want = flex()
            flex_ms = time_ms(flex, dev)
        flops = 4.0 * d * pairs
        emit(row=name, variant="flex", ms=flex_ms, flops=flops, flex_ms=None, check="-")
        for label, fn, compare in vs:
            try:
                got = fn()
                err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
                from fagen.runtime import modded

                note = f" [{modded.LOWERED[0]}]" if label == "attention" and modded.LOWERED else ""
                if compare and not err <= TOL:
                    emit(row=name, variant=label, ms=None, flops=flops, flex_ms=flex_ms, check=f"FAIL {err:.1e}")
                    continue
                ms = None if DRY else time_ms(fn, dev)
                us = host_us(fn) if label in ("attention", "gluon", "triton", "slopes", "as-written") else None
                emit(row=name, variant=label, ms=ms, flops=flops, flex_ms=flex_ms,
                     check=f"{err:.1e}" + ("" if compare else " (n/c)") + note
                     + ("" if us is None else f" host {us:.0f} us"))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                emit(row=name, variant=label, ms=None, flops=flops, flex_ms=flex_ms,
                     check=f"ERROR {type(e).__name__}: {(str(e).splitlines() or [''])[0][:90]}")


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        phase(sys.argv[2])
        return 0
    rows = []
    print(f"{'row':<24} {'variant':<12} {'ms':>7} {'TF/s':>6} {'vs Flex':>7}  check", flush=True)

    def show(r):  # each row as its phase ends: a run cut short keeps what it printed
        ms, fl, fx = r["ms"], r["flops"], r["flex_ms"]
        print(f"{r['row']:<24} {r['variant']:<12} {'' if ms is None else f'{ms:7.3f}':>7} "
              f"{'' if not ms else f'{fl / ms / 1e9:6.0f}':>6} {f'{fx / ms:6.2f}x' if ms and fx else '':>7}  "
              f"{r['check']}", flush=True)
    for name in PHASES:
        left = (600.0 if DRY else BUDGET_S) - (time.time() - T0)
        if left < 8:
            rows.append(dict(row=name, variant="phase", ms=None, flops=0, flex_ms=None, check="SKIPPED (budget)"))
            show(rows[-1])
            continue
        got = []
        try:
            res = subprocess.run([sys.executable, os.path.abspath(__file__), "--phase", name], capture_output=True,
                                 text=True, timeout=min(left, 600.0 if DRY else 40.0), env=os.environ.copy())
            got = [json.loads(line[4:]) for line in res.stdout.splitlines() if line.startswith("ROW ")]
            if res.returncode != 0 or not got:
                got.append(dict(row=name, variant="phase", ms=None, flops=0, flex_ms=None,
                                check=f"rc {res.returncode}: {(res.stderr.strip().splitlines() or [''])[-1][:100]}"))
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            got = [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]
            got.append(dict(row=name, variant="phase", ms=None, flops=0, flex_ms=None, check="TIMEOUT"))
        for r in got:
            show(r)
        rows += got
        log(f"done {name}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "mods_fwd_s6.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
