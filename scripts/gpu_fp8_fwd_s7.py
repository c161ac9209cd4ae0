"""The fp8 (e4m3) Gluon forward's speed levers on an H100/H200 (issue 28, seventh and eighth sessions): each variant
checked against float64, then one table of TF/s at d128 B1 H16 s16k, causal and full, beside fagen's bf16 forward.

    PYTHONPATH=$PWD python3 scripts/gpu_fp8_fwd_s7.py          # < 90 s on an H100; one table; $OUT/gpu_fp8_fwd_s7.md
    GPU_FP8_FWD_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_fp8_fwd_s7.py   # any machine: sm_90 builds of every variant

Variants (VARIANTS: name -> None for the product's module, fagen.load of the default config, or a dict: `fields` of
the spec changed, `patch` (regex, replacement) pairs applied to the product's render, `diag` for a timing-only
diagnostic whose numerics are knowingly wrong: it is built and timed, never checked). Seventh session: warpgroup
turns (left the template) and the P rounding (the product's fp8_p_cvt 2); docs/hopper.md has the tables.

Phases, each in a child process with a timeout (a kernel that faults or hangs costs its phase, not the table):
  build  warm launches of every module in a pool of processes (fills triton's cache for the other phases);
  check  every variant but the diagnostics at small shapes whose lengths are not multiples of the blocks (causal
         Sq != Sk both ways, GQA with per-head descales, mask none) against float64 on the dequantized inputs, with
         scripts/gpu_fp8.py's check: RMSE within 1.5x the e4m3 emulation's, lse, the fingerprint (fails if P V ran
         in bf16), empty rows; each module called twice;
  time   TF/s (do_bench median, the whole forward() call: the V transpose included) at d128 B1 H16 s16k for causal
         and full: fagen's bf16 forward first, then each variant with its ratio to it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for _phases
from _phases import child_env, run_phase as run_child  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))  # sm90 (the dry run's ptxas)

DRY = os.environ.get("GPU_FP8_FWD_DRY") == "1"
# MOCK (a test of this script, not of the kernels): check and time on the CPU at tiny shapes, gpu_fp8's e4m3
# emulation standing in for every fp8 module and the float64 reference for bf16.
MOCK = os.environ.get("GPU_FP8_FWD_MOCK") == "1"
DEV = "cpu" if MOCK else "cuda"
PHASE_TIMEOUT = {"build": 40, "check": 25, "time": 30}
T0 = time.time()
MASKS = ("causal", "none")
# name -> None (the product: fagen.load's module) or {"fields": spec fields, "variant": GluonBackend.variant keys,
# "patch": ((regex, replacement), ...) on the render, "diag": True for a timing-only diagnostic (wrong numerics:
# built and timed, not checked)}
VARIANTS = {
    "product": None,
    # how much of a step the exponentials cost: P = the exp2's argument itself (no MUFU.EX2 in the step)
    "diag: no exp2": {"patch": ((r"p = gl\.exp2\((s_acc \* qk_scale - \(m_use - 8\.0\)\[:, None\])\)", r"p = \1"), ),
                      "diag": True},
    # the step without its softmax (no row max, exp2 or row sum; P = S): the matmuls, the barriers, P's rounding and
    # O's rescale, the ceiling of any softmax schedule
    "diag: no softmax": {"patch": ((r"m_new = gl\.maximum\(m_i, gl\.max\(s_acc, 1\) \* qk_scale\)", "m_new = m_i"),
                                   (r"p = gl\.exp2\(s_acc \* qk_scale - \(m_use - 8\.0\)\[:, None\]\)", "p = s_acc"),
                                   (r"l_i = l_i \* alpha \+ gl\.sum\(p, 1\)", "l_i = l_i * alpha")),
                         "diag": True},
}
# d64: the product's fp8 module (and any variant named here), ratios to the first
D64_VARIANTS = ("product", )
# checks: (mask, gqa, batch, kv_heads, sq, sk, per_head); CHECKS for every d128 variant (and D64_VARIANTS at d64),
# PRODUCT_CHECKS (GQA, the window: (..., window)) for the product's modules only
CHECKS = (
    ("causal", 1, 1, 3, 1100, 1537, False),
    ("causal", 1, 2, 5, 1537, 1000, True),  # 537 rows per head see no key; 130 tiles
    ("none", 1, 1, 2, 700, 1300, True),
)
PRODUCT_CHECKS = (
    ("causal", 4, 2, 2, 1537, 1000, True, None),
    ("none", 2, 1, 2, 700, 1300, True, None),
    ("causal", 2, 1, 4, 2000, 2000, False, (256, 0)),
)
TIME_SHAPE = (1, 2, 256, 128) if MOCK else (1, 16, 16384, 128)  # B, H, S, D


def log(msg):
    print(msg, flush=True)


def emit(**row):
    log("ROW " + json.dumps(row))


def spec_of(mask, dtype="fp8_e4m3", **fields):
    import fagen
    return fagen.KernelSpec(backend="gluon", **{"head_dim": 128, "mask": mask, "dtype": dtype, **fields})


def module(mask, name, head_dim=128, window=False, gqa=1):
    """The fp8 module of variant `name` for `mask` (head_dim, the window switch, gqa)."""
    import fagen
    from fagen.runtime.loader import load_source
    if MOCK:
        import types
        import gpu_fp8
        import torch
        emulated = gpu_fp8.emulated_forward(mask, torch.float8_e4m3fn)

        def forward(q, k, v, **kw):  # the module's own checks that the emulation lacks: head dim, gqa, window
            if q.shape[-1] != head_dim or q.shape[1] != gqa * k.shape[1] or ("window" in kw) != window:
                raise ValueError(f"mock: the module is d{head_dim} gqa{gqa} window {window}; got q {tuple(q.shape)}, "
                                 f"k {tuple(k.shape)}, {sorted(kw)}")
            return emulated(q, k, v, **kw)
        return types.SimpleNamespace(forward=forward, transpose_v=lambda v: v.transpose(-1, -2).contiguous())
    v = VARIANTS[name]
    if v is None:
        return fagen.load(spec_of(mask, head_dim=head_dim, window=window, gqa=gqa))
    sp = spec_of(mask, head_dim=head_dim, window=window, gqa=gqa, **v.get("fields", {}))
    source = render_with(sp, v.get("variant", {}))
    for pattern, repl in v.get("patch", ()):
        source, hits = re.subn(pattern, repl, source, flags=re.M)
        if not hits:
            raise RuntimeError(f"{sp.name}: variant {name!r}: no {pattern!r} in the render")
    tag = re.sub(r"\W+", "_", name).strip("_")
    return load_source(source, f"{sp.name}_{tag}")


def render_with(sp, changes):
    """The render of spec sp with GluonBackend.variant changed by `changes` for this render only."""
    import fagen
    from fagen import backends
    from fagen.codegen import render
    saved = dict(backends.GLUON.variant)
    backends.GLUON.variant.update(changes)
    render.render.cache_clear()
    try:
        return fagen.generate(sp)
    finally:
        backends.GLUON.variant.clear()
        backends.GLUON.variant.update(saved)
        render.render.cache_clear()


def jobs():
    out = [(mask, name, 128, False, 1) for name in VARIANTS for mask in MASKS]
    out += [(mask, name, d, w is not None, gqa) for name, d, (mask, gqa, *_), w in check_cases() if gqa > 1 or w]
    out += [(mask, name, 64, False, 1) for name in D64_VARIANTS for mask in MASKS]
    return list(dict.fromkeys(out))


def check_cases():
    """(variant, head_dim, CHECKS row, window) of every check."""
    cases = [(name, 128, c, None) for name in VARIANTS if not (VARIANTS[name] or {}).get("diag") for c in CHECKS]
    cases += [(name, 64, c, None) for name in D64_VARIANTS for c in CHECKS[:2]]
    return cases + [("product", 128, c[:-1], c[-1]) for c in PRODUCT_CHECKS]


# -- build -----------------------------------------------------------------------------------------------------
def _warm(job):
    mask, name, d, window, gqa = job
    name = f"{name}{' d64' if d == 64 else ''}{' window' if window else ''}{f' gqa{gqa}' if gqa > 1 else ''}"
    t = time.time()
    try:
        import torch
        m = module(mask, *job[1:])
        if DRY:
            import sm90
            ck = m.compile_for()
            res = sm90.ptxas(ck.asm["ptx"])[0]["_attn_fwd_hopper"]
            return (f"built {name:<10} {mask:>6}: shared {ck.metadata.shared} regs {res.registers} spills "
                    f"{res.spill_stores + res.spill_loads} ex2 {ck.asm['ptx'].count('ex2.approx')} "
                    f"({time.time() - t:.1f}s)")
        q, k, v = (torch.randn(1, h, 200, d, device="cuda").to(torch.float8_e4m3fn) for h in (gqa, 1, 1))
        m.forward(q, k, v, **({"window": (64, 0)} if window else {}))
        torch.cuda.synchronize()
        return f"built {name:<10} {mask:>6} in {time.time() - t:.1f}s"
    except Exception as e:  # noqa: BLE001
        return f"build ERROR {name} {mask}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _warm_bf16(mask):
    t = time.time()
    try:
        import torch
        import fagen
        m = fagen.load(spec_of(mask, "bf16"))
        q, k, v = (torch.randn(1, 1, 200, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        m.forward(q, k, v)
        torch.cuda.synchronize()
        return f"built bf16 {mask} in {time.time() - t:.1f}s"
    except Exception as e:  # noqa: BLE001
        return f"build ERROR bf16 {mask}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _job(job):
    return _warm_bf16(job[1]) if job[0] == "bf16" else _warm(job)


def phase_build():
    work = jobs() + ([] if DRY else [("bf16", m) for m in MASKS])
    log(f"== build: {len(work)} modules")
    procs = max(2, min(12, (os.cpu_count() or 4) - 1)) if not DRY else 2
    with mp.get_context("spawn").Pool(procs) as pool:
        for msg in pool.imap_unordered(_job, work):
            log(msg)


# -- check -----------------------------------------------------------------------------------------------------
def phase_check():
    import gpu_fp8
    log("== check: float64 on dequantized inputs (scripts/gpu_fp8.py's check: rmse <= 1.5 x the e4m3 emulation's, "
        "lse, fingerprint < 0.5 (P V in bf16 fails), empty rows), each module called twice")
    for name, d, (mask, gqa, b, hkv, sq, sk, per_head), window in check_cases():
        label = (f"{mask} gqa{gqa} b{b} h{gqa * hkv}/{hkv} sq{sq} sk{sk}{' per-head' if per_head else ''}"
                 f"{f' window{window}' if window else ''}")
        shown = f"{name}{' d64' if d == 64 else ''}{' window' if window else ''}"
        try:
            m = module(mask, name, d, window is not None, gqa)
            rows = [gpu_fp8.check(d, mask, gqa, b, hkv, sq, sk, False, per_head, window=window, seed=call,
                                  device=DEV, forward=m.forward)
                    for call in range(2)]
            ok = all(r["pass"] for r in rows)
            r = max(rows, key=lambda r: r["rmse"] / r["emu_rmse"])
            emit(section="check", variant=shown, case=label, value="PASS" if ok else "FAIL",
                 note=f"rmse {r['rmse']:.2e} (emu {r['emu_rmse']:.2e}) lse {r['lse_err']:.1e} "
                      f"finger {r['fingerprint']:.3f} empty {r['empty_rows']}")
        except Exception as e:  # noqa: BLE001
            emit(section="check", variant=shown, case=label, value="FAIL",
                 note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
            traceback.print_exc(limit=3)


# -- time ------------------------------------------------------------------------------------------------------
def phase_time():
    import torch
    import triton
    import fagen
    import gpu_fp8
    b, h, s, d = TIME_SHAPE
    g = torch.Generator(device=DEV).manual_seed(1)
    x = [torch.randn((b, h, s, d), generator=g, device=DEV, dtype=torch.bfloat16) for _ in range(3)]
    (q8, dq), (k8, dk), (v8, dv) = (gpu_fp8.quantize(t.float(), False) for t in x)
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")  # noqa: E731
    if MOCK:
        def bench(fn):
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
    log(f"== time: B{b} H{h} S{s} d{d}, TF/s from the do_bench median (4*B*H*S*S*D, halved causal); "
        f"{'cpu (mock)' if MOCK else torch.cuda.get_device_name()}")
    try:  # (round A timed fagen.load inside the lambda too: 263 us, mostly the host)
        transpose = module("none", "product").transpose_v
        ms = bench(lambda: transpose(v8))
        emit(section="time", variant="transpose_v alone", mask="-", value=round(ms * 1e3, 1), note="us")
    except Exception as e:  # noqa: BLE001
        emit(section="time", variant="transpose_v alone", mask="-", value="ERROR", note=repr(e)[:200])
    state = {}

    def run(name, mask, flops, fn):
        """Time fn; the row's note is its ratio to state["base"] (named state["ref"]) when set."""
        try:
            fn()
            if not MOCK:
                torch.cuda.synchronize()
            ms = bench(fn)
            tf = flops / ms / 1e9
            base = state.get("base")
            emit(section="time", variant=name, mask=mask, value=round(tf, 1), ms=round(ms, 4),
                 note="" if not base else f"{tf / base:.2f}x {state['ref']}")
            return tf
        except Exception as e:  # noqa: BLE001
            emit(section="time", variant=name, mask=mask, value="ERROR",
                 note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
            return None

    for mask in MASKS:
        flops = 4 * b * h * s * s * d / (2 if mask == "causal" else 1)
        if MOCK:
            from fagen.verify import reference
            bf16_fwd = lambda *t: reference.attention(*(y.double() for y in t), mask=mask)  # noqa: E731
        else:
            bf16_fwd = fagen.load(spec_of(mask, "bf16")).forward
        state.clear()
        state.update(base=run("fagen bf16 (product)", mask, flops, lambda: bf16_fwd(*x)), ref="bf16")
        for name in VARIANTS:
            m = module(mask, name)
            run(f"fp8 {name}", mask, flops, lambda m=m: m.forward(q8, k8, v8, q_descale=dq, k_descale=dk,
                                                                   v_descale=dv))
        if not MOCK:  # the product's kernel without the V transpose (Vt made once): what an in-kernel one could gain
            m = module(mask, "product")
            vt = m.transpose_v(v8)
            saved = m.transpose_v
            m.transpose_v = lambda v: vt
            try:
                run("fp8 product, kernel alone", mask, flops, lambda: m.forward(q8, k8, v8, q_descale=dq,
                                                                                 k_descale=dk, v_descale=dv))
            finally:
                m.transpose_v = saved
    # d64: D64_VARIANTS (fp8 only; same B, H, S), ratios to the first
    x = [torch.randn((b, h, s, 64), generator=g, device=DEV, dtype=torch.bfloat16) for _ in range(3)]
    (q8, dq), (k8, dk), (v8, dv) = (gpu_fp8.quantize(t.float(), False) for t in x)
    for mask in MASKS:
        flops = 4 * b * h * s * s * 64 / (2 if mask == "causal" else 1)
        state.clear()
        for name in D64_VARIANTS:
            m = module(mask, name, 64)
            tf = run(f"d64 fp8 {name}", mask, flops, lambda m=m: m.forward(q8, k8, v8, q_descale=dq, k_descale=dk,
                                                                            v_descale=dv))
            if "base" not in state:
                state.update(base=tf, ref=D64_VARIANTS[0])


# -- driver ----------------------------------------------------------------------------------------------------
def table(rows):
    out = ["| fp8 variant | causal TF/s | full TF/s |", "|---|---:|---:|"]
    times = [r for r in rows if r.get("section") == "time"]
    for name in dict.fromkeys(r["variant"] for r in times):
        cells = []
        for mask in MASKS:
            r = next((r for r in times if r["variant"] == name and r["mask"] in (mask, "-" if mask == MASKS[0] else mask)),
                     None)
            cells.append("" if r is None else f"{r['value']}{' (' + r['note'] + ')' if r.get('note') else ''}")
        out.append(f"| {name} | {cells[0]} | {cells[1]} |")
    checks = [r for r in rows if r.get("section") == "check"]
    for name in dict.fromkeys(r["variant"] for r in checks):
        mine = [r for r in checks if r["variant"] == name]
        out.append(f"check {name}: {sum(r['value'] == 'PASS' for r in mine)}/{len(mine)} PASS")
    return "\n".join(out)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        {"build": phase_build, "check": phase_check, "time": phase_time}[sys.argv[2]]()
        return
    env = child_env("/tmp/fagen-cache-gpu-fp8-fwd-s7")
    rows = []
    for name in (("build", ) if DRY else ("check", "time") if MOCK else PHASE_TIMEOUT):
        limit = PHASE_TIMEOUT[name] * (10 if DRY or MOCK else 1)
        log(f"#### phase {name} (timeout {limit}s, {time.time() - T0:.0f}s so far)")
        def on_line(line):
            print(line, end="", flush=True)
            if line.startswith("ROW "):
                rows.append(json.loads(line[4:]))
        rc, _ = run_child(__file__, name, limit, env, on_line)
        log(f"#### phase {name}: rc={rc}")
    text = table(rows)
    log(text)
    log(f"total {time.time() - T0:.0f}s")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "gpu_fp8_fwd_s7.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
