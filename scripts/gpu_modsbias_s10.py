"""Issue 26's bias rows (docs/mods.md, "Bias rows (tenth session)"): float64 checks of the levers through
fagen.attention, then forward and backward TF/s of `fagen bench --suite mods`'s relative-bias and alibi rows (bf16,
d128, B1 H16 S8192) against FlexAttention's in one process.

    PYTHONPATH=$PWD python3 scripts/gpu_modsbias_s10.py [--rows a,b] [--drop row/dir/variant,...] [--no-bench]
    S10_ROUND=A ...: round A's lever checks and variants (PLAN_A; the levers were off by default then)

Levers (GluonBackend.variant, set for a variant's renders only; fagen.attention loads the lever render through a
patched modded.load): add1 = fwd_mod_add 1 (an additive score_mod as one FMA in the Gluon forward), add2 =
fwd_mod_add 2 (also `score + kv_idx * A` as float columns times A / ln 2), fixed = bwd_mod_fixed 1 (an additive
score_mod's deterministic dQ as fixed-point adds), fold = bwd_mod_fold 1 (P = exp2(fma(S, qk_scale, X / ln 2 - lse2))),
split = bwd_mod_split 1 (the clamp-free reads as one pointer per key plus the queries' offsets; stride 1 on the host:
MOD_FREE 2, the offsets the layout's constants). api = fagen.attention as the branch selects; nondet =
deterministic=False (the unordered adds: a ceiling, not a candidate); plain = fagen.attention without mods (the
plain kernels: the ceiling of a mod's row).
Phases (scripts/_phases.py): check (4 parts) and warm (compiles) at once, then time. $OUT/modsbias_s10.json holds the
records.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
DRY = bool(os.environ.get("GPU_MODSBIAS_DRY"))
LEVERS = {"api": {}, "nondet": {}, "add1": {"fwd_mod_add": 1}, "add2": {"fwd_mod_add": 2},
          "fixed": {"bwd_mod_fixed": 1}, "fold": {"bwd_mod_fold": 1}, "fixed-fold": {"bwd_mod_fixed": 1, "bwd_mod_fold": 1},
          "split": {"bwd_mod_split": 1}, "split-fold": {"bwd_mod_split": 1, "bwd_mod_fold": 1},
          "fixed-split-fold": {"bwd_mod_fixed": 1, "bwd_mod_split": 1, "bwd_mod_fold": 1}}
LEVERS.update({"off": {"fwd_mod_add": 0, "bwd_mod_fixed": 0, "bwd_mod_split": 0, "bwd_mod_fold": 0},
               "nofixed": {"bwd_mod_fixed": 0}})
# round A (levers off by default): PLAN_A; round B (fwd_mod_add 2, bwd_mod_fixed 2, bwd_mod_split 1 on): PLAN, with
# "off" the ninth session's kernels and the bench's own rows (fagen.bench.mods.mod_rows) after the table
PLAN_A = {("alibi", "fwd"): ["api", "add2", "add1"], ("alibi", "bwd"): ["api", "fixed", "fixed-fold"],
          ("relative-bias", "bwd"): ["api", "split", "split-fold", "fixed-split-fold"],
          ("relative-bias", "fwd"): ["api", "add1"], ("plain", "fwd"): ["api"], ("plain", "bwd"): ["api"]}
PLAN = {("alibi", "fwd"): ["api", "off"], ("alibi", "bwd"): ["api", "off"],
        ("relative-bias", "bwd"): ["api", "off", "nofixed"], ("relative-bias", "fwd"): ["api", "off"]}
BUDGET = 300.0 if DRY else 92.0  # seconds of the whole run (the runner stops it at 100)


def plan() -> dict:
    rows = [r for r in os.environ.get("S10_ROWS", "").split(",") if r]
    drop = set(os.environ.get("S10_DROP", "").split(","))
    chosen = PLAN_A if os.environ.get("S10_ROUND", "B") == "A" else PLAN
    return {k: [v for v in vs if f"{k[0]}/{k[1]}/{v}" not in drop] for k, vs in chosen.items()
            if not rows or k[0] in rows}


def dev() -> str:
    return "cpu" if DRY else "cuda"


def shape_of():
    import torch

    from fagen.bench.mods import ModsShape

    return ModsShape(1, 2, 96, 32, torch.float32) if DRY else ModsShape()


_DEFAULTS: dict = {}
_MEMO: dict = {}


def use(variant: str, mutate=None) -> None:
    """Render with LEVERS[variant] from now on: the variant keys set, the render and module memos cleared, and
    modded.load patched to import the lever render (the loader's render index is keyed by the spec, not the
    variant). mutate(src) -> src: a mutant's edit of each render."""
    from fagen import backends
    from fagen.codegen.render import render
    from fagen.runtime import hopper, loader, modded, resolve
    from fagen.runtime.device import gpu_arch

    var = backends.GLUON.variant
    if not _DEFAULTS:
        _DEFAULTS.update({k: var[k] for lever in LEVERS.values() for k in lever})
        _DEFAULTS["load"] = modded.load
    var.update({k: v for k, v in _DEFAULTS.items() if k != "load"})
    var.update(LEVERS[variant])
    render.cache_clear()
    for memo in (modded._GLUON_BWD, modded._FORWARD_ONLY, modded._MODULES, resolve._FAST):
        memo.clear()
    os.environ[hopper.ENV] = "1"
    if not LEVERS[variant] and mutate is None:
        modded.load = _DEFAULTS["load"]
        return
    tag = variant.replace("-", "_") + ("_mutant" if mutate else "")

    def lever_load(spec):
        spec = spec.for_arch(gpu_arch())
        key = (spec.hash, tag)
        if key not in _MEMO:
            src = render(spec).files[".py"]
            _MEMO[key] = loader.load_source(mutate(src) if mutate else src, f"{spec.name}_{tag}")
        return _MEMO[key]
    modded.load = lever_load


def row_mods(row, shape):
    from fagen.bench.mods import cases

    if row == "plain":
        return None, None
    return next((c[1], c[2]) for c in cases(shape, dev()) if c[0] == row)


def caller(row: str, variant: str, sm):
    import fagen

    det = variant != "nondet"
    use(variant)
    if row == "plain":
        return lambda q, k, v: fagen.attention(q, k, v, deterministic=det)
    return lambda q, k, v: fagen.attention(q, k, v, score_mod=sm, deterministic=det)


def flex_call(sm):
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    from fagen.bench.peers import configure_dynamo

    configure_dynamo()
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, score_mod=sm)


def phase_warm(items: list) -> None:
    import torch

    from fagen.bench.mods import _inputs

    shape = shape_of()
    q, k, v, do = _inputs(shape, dev(), True)
    for row, d, variant in items:
        t0 = time.perf_counter()
        try:
            sm, _ = row_mods(row, shape)
            att = flex_call(sm) if variant == "flex" else caller(row, variant, sm)
            if d == "fwd":
                with torch.no_grad():
                    att(q, k, v)
            else:
                torch.autograd.grad(att(q, k, v), (q, k, v), do)
            if dev() == "cuda":
                torch.cuda.synchronize()
            print(f"warm {row} {d} {variant}: {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - the time phase reports it again
            print(f"warm {row} {d} {variant}: {type(e).__name__}: {str(e)[:160]}", flush=True)


def reference(sm, q, k, v, do, causal=False):
    """float64 out and dq, dk, dv of the user's score_mod over broadcast index tensors (no fagen code), mask none
    or causal."""
    import torch

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    S, D = q.shape[2], q.shape[3]
    b = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=q.device)
    h = torch.arange(q.shape[1], device=q.device)[None, :, None, None]
    qi = torch.arange(S, device=q.device)[None, None, :, None]
    ki = torch.arange(k.shape[2], device=q.device)[None, None, None, :]
    s = sm((q64 @ k64.transpose(-1, -2)) / math.sqrt(D), b, h, qi, ki)
    if causal:
        s = torch.where(ki <= qi, s, float("-inf"))
    out = torch.softmax(s, -1) @ v64
    return (out.detach(), *torch.autograd.grad(out, (q64, k64, v64), do.double()))


def phase_check(part: tuple[int, int]) -> None:
    import torch

    import fagen
    from fagen.runtime import api, hopper, modded
    from fagen.spec.axes import DType
    from fagen.verify.tolerances import TOLERANCE, compare, compare_grad

    api.BWD_MIN_WORK = hopper.BWD_MIN_WORK = hopper.MIN_WORK = 0
    if hasattr(api, "MIN_WORK"):
        api.MIN_WORK = 0
    H, S, D = 2, 333, 128
    g = torch.Generator().manual_seed(10)
    wide, tight = (torch.randn(H, n, generator=g).to(dev()) * 0.5 for n in (767, 665))
    wide_t = (torch.randn(767, H, generator=g) * 0.5).to(dev()).t()  # stride(1) = H: MOD_FREE 1, not 2

    def rel_free_t(score, b, h, q_idx, kv_idx):
        return score + wide_t[h, q_idx - kv_idx + 383]

    def rel_free(score, b, h, q_idx, kv_idx):  # padded tiles reach q - kv in [-383, 383]: all inside
        return score + wide[h, q_idx - kv_idx + 383]

    def rel_tight(score, b, h, q_idx, kv_idx):  # real rows inside, padded tiles outside: clamped
        return score + tight[h, q_idx - kv_idx + 332]

    def alibi(score, b, h, q_idx, kv_idx):  # attention-gym's: fagen.attention runs it row-free
        return score + (kv_idx - q_idx) * torch.exp2(-((h + 1) * 8.0 / H))

    q, k, v, do = (torch.randn(1, H, S, D, generator=g).to(dev(), torch.bfloat16) for _ in range(4))
    tol = TOLERANCE[DType.BF16]

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def run(name, variant, sm, grad, mutant=None, repeat=False, mm=None):
        t0 = time.perf_counter()
        try:
            use(variant, mutant)
            ref = reference(sm, q, k, v, do, mm is not None)
            if grad:
                qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
                got = torch.autograd.grad(fagen.attention(qg, kg, vg, score_mod=sm, mask_mod=mm), (qg, kg, vg), do)
                errs = [compare_grad(n, a, r, DType.BF16) for n, a, r in zip(("dq", "dk", "dv"), got, ref[1:])]
                used = sorted({m.NAME for m in modded._GLUON_BWD.values() if m is not None})
                line = f"max |err| dq {errs[0]:.1e} dk {errs[1]:.1e} dv {errs[2]:.1e}"
                src = [m for m in modded._GLUON_BWD.values() if m is not None]
                assert src, "the Gluon backward did not serve"
                mode = getattr(src[0], "BWD_DET_MODE", "?")
                line += f" via {','.join(used)} (BWD_DET_MODE {mode})"
                mods = modded.prepare(score_mod=sm)
                free = getattr(src[0], "_mod_free", None)
                if free is not None and mods.fields[2]:
                    line += f", MOD_FREE {int(free(q, k, *[mods.values[t[0]] for t in mods.fields[2]], *[mods.values[x[0]] for x in mods.fields[3]]))}"
                if repeat:
                    twice = torch.autograd.grad(fagen.attention(qg, kg, vg, score_mod=sm, mask_mod=mm), (qg, kg, vg),
                                                do)
                    assert all(torch.equal(a, b) for a, b in zip(got, twice)), "two runs differ"
                    line += "; bitwise repeatable"
            else:
                with torch.no_grad():
                    out = fagen.attention(q, k, v, score_mod=sm)
                err = compare("out", out, ref[0], atol=tol["atol"], rtol=tol["rtol"])
                fwd = [m for m in modded._FORWARD_ONLY.values() if m is not None]
                line = f"max |err| out {err:.1e} via {','.join(sorted({m.NAME for m in fwd})) or '?'}"
                assert fwd and "gluon" in fwd[0].NAME, "the Gluon forward did not serve"
            ok = mutant is None
            line = f"{'PASS' if ok else 'FAIL'} {name} [{variant}]: {line}"
        except Exception as e:  # noqa: BLE001 - a line, never the end of the run
            ok = mutant is not None and isinstance(e, AssertionError)
            line = f"{'PASS' if ok else 'FAIL'} {name} [{variant}]: {'caught: ' if ok else ''}" \
                   f"{type(e).__name__}: {str(e)[:150]}"
        print(f"CHECK {line} ({time.perf_counter() - t0:.1f} s)", flush=True)

    def no_ln2(src):  # the column path's A without its 1 / ln 2
        old = "    xk = ("
        at = src.index(old)
        end = src.index("\n", at)
        assert src[:end].endswith(" * 1.4426950408889634"), src[at:end]
        return src[:end - len(" * 1.4426950408889634")] + src[end:]

    def half_bias(src):  # the clamp-free bias halved
        at = src.index("xadd = (", src.index("            if MOD_FREE:"))
        end = src.index("\n", at)
        assert src[:end].endswith("* 1.4426950408889634"), src[at:end]
        return src[:end] + " * 0.5" + src[end:]

    cases_a = [  # round A: the levers, rendered through the patched loader
        ("alibi fwd", "add2", alibi, False, {}),
        ("alibi bwd", "fixed-fold", alibi, True, dict(repeat=True)),
        ("relative bias inside bwd", "fixed-split-fold", rel_free, True, dict(repeat=True)),
        ("MUTANT relative bias split, bias halved", "split-fold", rel_free, True, dict(mutant=half_bias)),
        ("alibi fwd", "add1", alibi, False, {}),
        ("relative bias outside bwd (clamped)", "fixed-split-fold", rel_tight, True, dict(repeat=True)),
        ("relative bias inside bwd", "split", rel_free, True, {}),
        ("MUTANT alibi fwd, A without 1/ln2", "add2", alibi, False, dict(mutant=no_ln2)),
        ("alibi bwd", "fixed", alibi, True, {}),
        ("relative bias fwd", "add1", rel_tight, False, {}),
    ]
    cases = [  # one slice per check part (part i of n), the backward builds spread over the parts; round B: defaults
        ("alibi fwd", "api", alibi, False, {}),
        ("alibi bwd", "api", alibi, True, dict(repeat=True)),
        ("relative bias inside bwd", "api", rel_free, True, dict(repeat=True)),
        ("relative bias inside, causal, bwd", "api", rel_free, True, dict(repeat=True, mm=causal)),
        ("relative bias fwd", "api", rel_tight, False, {}),
        ("relative bias outside bwd (clamped)", "api", rel_tight, True, dict(repeat=True)),
        ("relative bias inside, bias [2, 767] with stride(1) 2, bwd", "api", rel_free_t, True, dict(repeat=True)),
        ("MUTANT relative bias split, bias halved", "api", rel_free, True, dict(mutant=half_bias)),
        ("MUTANT alibi fwd, A without 1/ln2", "api", alibi, False, dict(mutant=no_ln2)),
    ] if os.environ.get("S10_ROUND", "B") == "B" else cases_a
    for name, variant, sm, grad, kw in cases[part[0]::part[1]]:
        run(name, variant, sm, grad, **kw)


def phase_time() -> None:
    import torch

    from fagen.bench.mods import _inputs
    from fagen.bench.timing import measure

    shape = shape_of()
    q, k, v, do = _inputs(shape, dev(), True)
    t_end = float(os.environ.get("S10_TIME_END", time.time() + 60))
    fl = 4.0 * shape.head_dim * shape.batch * shape.heads * shape.seq * shape.seq
    rep = 30.0 if not DRY else 1.0
    todo = plan()
    for (row, d), variants in todo.items():
        sm, _ = row_mods(row, shape)
        for variant in (["flex"] if not DRY and row != "plain" else []) + variants:
            rec = {"row": row, "dir": d, "variant": variant}
            if time.time() > t_end:
                rec["error"] = "skipped: out of time"
            else:
                try:
                    att = flex_call(sm) if variant == "flex" else caller(row, variant, sm)
                    if d == "fwd":
                        with torch.no_grad():
                            att(q, k, v)
                            rec["ms"] = measure(lambda i: att(q, k, v), 1, torch.device(dev()), 10.0, rep)
                        rec["tflops"] = fl / rec["ms"] / 1e9
                    else:
                        out = att(q, k, v)
                        torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
                        rec["ms"] = measure(lambda i: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                                            1, torch.device(dev()), 10.0, rep)
                        rec["tflops"] = 2.5 * fl / rec["ms"] / 1e9
                        del out
                except Exception as e:  # noqa: BLE001 - a row of the table
                    rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            print("REC " + json.dumps(rec), flush=True)


def phase_bench() -> None:
    """The two rows as `fagen bench --suite mods` runs them (fagen.bench.mods.mod_rows: fagen.attention and Flex,
    forward and backward, the same inputs), at a shorter repeat."""
    from fagen.bench.mods import ModsShape, mod_rows

    mod_rows(dev(), ModsShape(), log=lambda line: print("BENCH " + line, flush=True), rep_ms=40.0,
             only={"relative-bias", "alibi"})


def main() -> None:
    from _phases import child_env, run_phase

    t0 = time.time()
    env = child_env("/tmp/fagen-s10-modsbias", ROOT)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    script = os.path.abspath(__file__)
    lines: dict[str, list] = {}
    argv = dict(zip(sys.argv[1::2], sys.argv[2::2]))
    for flag, name in (("--rows", "S10_ROWS"), ("--drop", "S10_DROP")):
        if flag in argv:
            env[name] = os.environ[name] = argv[flag]
    items = [(r, d, v) for (r, d), vs in plan().items() for v in (["flex"] if not DRY and r != "plain" else []) + vs
             if v != "nondet" or r == "plain"]
    items.sort(key=lambda item: item[2] != "flex")
    n = 1 if DRY else int(argv.get("--warm", 8))
    groups = [items[i::n] for i in range(n)]

    def go(name, limit, extra=()):
        rc, got = run_phase(script, name, limit, env, on_line=lambda s: print(s, end="", flush=True), extra=extra)
        lines.setdefault(name, []).extend(got)
        if rc != 0:
            print(f"phase {name}: {rc}", flush=True)

    parts = 1 if DRY else 4
    threads = [threading.Thread(target=go, args=("check", 42.0, (json.dumps([i, parts]),))) for i in range(parts)]
    threads += [threading.Thread(target=go, args=(f"warm{i}", 42.0, (json.dumps(g),))) for i, g in enumerate(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bench = 0.0 if DRY or "--no-bench" in sys.argv else 26.0  # seconds kept for the bench's own rows
    left = BUDGET - (time.time() - t0) - bench
    env["S10_TIME_END"] = str(time.time() + left - 5)
    print(f"compiled in {time.time() - t0:.0f} s; timing for {left:.0f} s", flush=True)
    go("time", max(5.0, left))
    if bench:
        go("bench", max(5.0, BUDGET - (time.time() - t0)))
    recs = [json.loads(s[4:]) for s in lines.get("time", []) if s.startswith("REC ")]
    flex = {(r["row"], r["dir"]): r.get("ms") for r in recs if r["variant"] == "flex"}
    print("\n| row | dir | variant | ms | TF/s | x Flex |\n|---|---|---|---:|---:|---:|")
    for r in recs:
        if r.get("error"):
            print(f"| {r['row']} | {r['dir']} | {r['variant']} | - | - | {r['error'][:90]} |")
            continue
        f = flex.get((r["row"], r["dir"]))
        x = f"{f / r['ms']:.2f}x" if f else "-"
        print(f"| {r['row']} | {r['dir']} | {r['variant']} | {r['ms']:.3f} | {r['tflops']:.0f} | {x} |")
    for s in lines.get("check", []):
        if s.startswith("CHECK "):
            print(s[6:], end="")
    for s in lines.get("bench", []):
        if s.startswith("BENCH "):
            print(s[6:], end="")
    print(f"total {time.time() - t0:.0f} s")
    out = os.environ.get("OUTX") or os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "modsbias_s10.json"), "w") as f:
            json.dump({"records": recs, "checks": lines.get("check", [])}, f, indent=1)


if __name__ == "__main__":
    if "--phase" in sys.argv:
        name = sys.argv[sys.argv.index("--phase") + 1]
        if DRY:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        if name == "check":
            phase_check(tuple(json.loads(sys.argv[-1])))
        elif name == "time":
            phase_time()
        elif name == "bench":
            phase_bench()
        else:
            phase_warm([tuple(x) for x in json.loads(sys.argv[-1])])
    else:
        main()
