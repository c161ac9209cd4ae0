"""The Gluon backward selected for mods and switches (issue 26; docs/mods.md, "The Gluon backward"): float64 checks of
the newly selected paths through fagen.attention, then the backward of four rows of `fagen bench --suite mods`
(bf16, d128, B1 H16 S8192) against FlexAttention's in one process.

    PYTHONPATH=$PWD python3 scripts/gpu_mods_bwd_s9.py [--rows a,b] [--drop row/variant,...] [--checks N] [--warm N]
    GPU_MODS_BWD_S9_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_mods_bwd_s9.py   # CPU: interpreter, sm_90 builds

Phases (scripts/_phases.py, each a child process under a time limit; "check" and the "warm" ones at once):
  check   fagen.attention with gradients at B1 H2 S333 d128 bf16, the size floors at 0 so the Gluon backward serves,
          against the float64 reference of the user's own functions: a relative bias whose indices are all inside
          (the clamp-free kernel, MOD_FREE: [Note] Clamp-free problems in fagen/mods/emit.py; its gradients must
          equal the clamped kernel's bit for bit), one whose padded tiles reach outside (the clamped kernel), ALiBi,
          prefix-LM (both split calls), the window's descending order (bwd_window_desc) in both dQ modes; and a
          mutant that must fail: the clamp-free branch's bias halved.
  warm-i  compile every (row, variant) once at the bench shape (Triton, Gluon and Inductor caches), in parallel.
  time    per row Flex (torch.compile'd flex_attention with create_block_mask, as fagen/bench/mods.py runs it), then
          each variant: backward ms (autograd.grad of a kept output) and TF/s (2.5 * 4 * D per visible pair).
Variants: triton = fagen.attention with $FAGEN_HOPPER=0 (the Triton backward: the sessions before this one);
api = fagen.attention as the branch selects; api-clamped = api with the host's clamp-free test answering no;
api-early = the selected module rendered with the clamp-free read before the S MMA's wait (bwd_mod_early 1);
api-nondet = deterministic=False; asc / desc (-nondet) = the window switch's Gluon bwd module (causal, window
(1024, 0)) with its steps in ascending / descending query blocks (variant bwd_window_desc); fixed / desc-fixed: its
deterministic dQ as fixed-point adds in any order (variant bwd_window_fixed 1). One table at the end;
$OUT/mods_bwd_s9.json holds the records.
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
DRY = bool(os.environ.get("GPU_MODS_BWD_S9_DRY"))
VARIANTS = {"sliding-window+causal": ["triton", "api", "desc", "asc-nondet", "asc", "desc-fixed", "desc-nondet"],
            "alibi": ["triton", "api", "api-nondet"], "prefix-lm": ["triton", "api"],
            "relative-bias": ["triton", "api", "api-clamped", "api-early"]}


def plan() -> dict:
    """The rows and variants of this run: VARIANTS, less the rows not in --rows and the row/variant pairs in --drop
    (main passes them to the phases as $S9_ROWS, $S9_DROP)."""
    rows = [r for r in os.environ.get("S9_ROWS", "").split(",") if r] or list(VARIANTS)
    drop = set(os.environ.get("S9_DROP", "").split(","))
    return {r: [v for v in VARIANTS[r] if f"{r}/{v}" not in drop] for r in rows}
WINDOW = (1024, 0)  # the sliding-window row, lowered (docs/mods.md, "Lowering")
BUDGET = 300.0 if DRY else 68.0  # seconds of the whole run (the runner stops it at 75)


def dev() -> str:
    return "cpu" if DRY else "cuda"


def shape_of():
    import torch

    from fagen.bench.mods import ModsShape

    return ModsShape(1, 2, 96, 32, torch.float32) if DRY else ModsShape()


def selection(on: bool) -> None:
    """The Gluon backward's selection on or off ($FAGEN_HOPPER, read per call), with the memoised choices cleared."""
    from fagen.runtime import hopper, modded, resolve

    os.environ[hopper.ENV] = "1" if on else "0"
    resolve._FAST.clear()
    modded._GLUON_BWD.clear()


def window_module(desc: bool, fixed: bool = False):
    """The Gluon bwd module of causal + window, its steps in descending query blocks where desc; fixed: its
    deterministic dQ as fixed-point adds in any order (variant bwd_window_fixed 1, [Note] Fixed-point dQ)."""
    import fagen
    from fagen.runtime.loader import load_source
    from fagen.spec.kernel import KernelSpec

    spec = KernelSpec(backend="gluon", direction="bwd", head_dim=128, dtype="bf16", mask="causal", window=True)
    if not desc and not fixed:
        return fagen.load(spec)
    src = lever_source(spec, {"bwd_window_desc": int(desc), "bwd_window_fixed": int(fixed)})
    assert ("GQA * steps - 1 - i" in src) == desc and ("BWD_DET_MODE = 2" in src) == fixed, "the levers did not render"
    return load_source(src, spec.name + "_desc" * desc + "_fixed" * fixed)


def lever_source(spec, lever: dict) -> str:
    """The module source of `spec` rendered with GluonBackend.variant keys set for this render only."""
    from fagen import backends
    from fagen.codegen.render import render

    saved = {name: backends.GLUON.variant[name] for name in lever}
    backends.GLUON.variant.update(lever)
    render.cache_clear()
    try:
        return render(spec).files[".py"]
    finally:
        backends.GLUON.variant.update(saved)
        render.cache_clear()


def early_module(sm):
    """(module, its mods keywords) of a score_mod's Gluon bwd module with the clamp-free read issued before the S
    MMA's wait (variant bwd_mod_early 1)."""
    from fagen.runtime import modded
    from fagen.runtime.loader import load_source
    from fagen.spec.kernel import KernelSpec

    m = modded.prepare(score_mod=sm)
    spec = KernelSpec(backend="gluon", direction="bwd", head_dim=128, dtype="bf16", score_mod=m.fields[0],
                      mod_tensors=[list(t) for t in m.fields[2]], mod_scalars=[list(x) for x in m.fields[3]])
    src = lever_source(spec, {"bwd_mod_early": 1})
    assert "xadd = xadd  # read above" in src, "bwd_mod_early did not render"
    return load_source(src, spec.name + "_early"), m.values


def caller(row: str, variant: str, sm, mm, bm):
    """The (q, k, v) -> out of a fagen variant."""
    import fagen

    if variant in ("asc", "desc", "fixed", "desc-fixed", "asc-nondet", "desc-nondet"):
        module = window_module(variant.startswith("desc"), variant.endswith("fixed"))
        det = not variant.endswith("nondet")
        return lambda q, k, v: module.attention(q, k, v, window=WINDOW, deterministic=det)
    if variant == "api-early":  # the module itself: fagen.attention would load the product's render
        module, values = early_module(sm)
        return lambda q, k, v: module.attention(q, k, v, mods=values)
    selection(variant != "triton")
    det = variant != "api-nondet"
    call = lambda q, k, v: fagen.attention(q, k, v, score_mod=sm, mask_mod=mm, block_mask=bm,  # noqa: E731
                                           deterministic=det)
    if variant != "api-clamped":
        return call

    def clamped(q, k, v):  # the forward loads the module; its backward (later) asks _mod_free
        from fagen.runtime import modded

        out = call(q, k, v)
        for m in modded._GLUON_BWD.values():
            if m is not None and hasattr(m, "_mod_free"):
                m._mod_free = lambda *a: False
        return out
    return clamped


def row_mods(row, shape):
    from fagen.bench.mods import cases

    return next((c[1], c[2]) for c in cases(shape, dev()) if c[0] == row)


def flex_call(sm, mm, shape):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from fagen.bench.peers import configure_dynamo

    configure_dynamo()
    compiled = torch.compile(flex_attention, dynamic=False)
    bm = None if mm is None else create_block_mask(mm, None, None, shape.seq, shape.seq, device=dev())
    return lambda q, k, v: compiled(q, k, v, score_mod=sm, block_mask=bm)


def fagen_mask(mm, shape):
    import fagen

    return None if mm is None else fagen.create_block_mask(mm, None, None, shape.seq, shape.seq, device=dev())


def phase_warm(items: list) -> None:
    import torch

    from fagen.bench.mods import _inputs

    shape = shape_of()
    q, k, v, do = _inputs(shape, dev(), True)
    for row, variant in items:
        t0 = time.perf_counter()
        try:
            sm, mm = row_mods(row, shape)
            att = flex_call(sm, mm, shape) if variant == "flex" else caller(row, variant, sm, mm,
                                                                             fagen_mask(mm, shape))
            torch.autograd.grad(att(q, k, v), (q, k, v), do)
            if dev() == "cuda":
                torch.cuda.synchronize()
            print(f"warm {row} {variant}: {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - the time phase reports it again
            print(f"warm {row} {variant}: {type(e).__name__}: {str(e)[:160]}", flush=True)


def reference(sm, mm, mask, q, k, v, do):
    """float64 dq, dk, dv of the user's functions over broadcast index tensors (no fagen code)."""
    import torch

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    S, D = q.shape[2], q.shape[3]
    b = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=q.device)
    h = torch.arange(q.shape[1], device=q.device)[None, :, None, None]
    qi = torch.arange(S, device=q.device)[None, None, :, None]
    ki = torch.arange(k.shape[2], device=q.device)[None, None, None, :]
    s = (q64 @ k64.transpose(-1, -2)) / math.sqrt(D)
    if sm is not None:
        s = sm(s, b, h, qi, ki)
    vis = (ki <= qi + k.shape[2] - S) if mask == "causal" else torch.ones_like(ki, dtype=torch.bool)
    if mm is not None:
        vis = vis & mm(b, h, qi, ki)
    out = torch.softmax(torch.where(vis.expand_as(s), s, float("-inf")), -1).nan_to_num(0.0) @ v64
    return torch.autograd.grad(out, (q64, k64, v64), do.double())


def mod_fields(sm):
    """(fields, values) of a score_mod as fagen.attention's modded path sees it after lowering."""
    from fagen.runtime import modded

    m = modded.prepare(score_mod=sm)
    return m.fields, m.values


def phase_check(part: tuple[int, int]) -> None:
    import torch

    import fagen
    from fagen.runtime import api, hopper, modded, resolve
    from fagen.spec.axes import DType
    from fagen.verify.tolerances import compare_grad

    api.BWD_MIN_WORK = hopper.BWD_MIN_WORK = api.BWD_WINDOW_MIN_WORK = hopper.BWD_WINDOW_MIN_WORK = 0
    H, S, D = 2, 333, 128
    g = torch.Generator().manual_seed(9)
    wide, tight = (torch.randn(H, n, generator=g).to(dev()) * 0.5 for n in (767, 665))

    def rel_free(score, b, h, q_idx, kv_idx):  # padded tiles reach q - kv in [-383, 383]: all inside
        return score + wide[h, q_idx - kv_idx + 383]

    def rel_tight(score, b, h, q_idx, kv_idx):  # real rows inside, padded tiles outside: clamped
        return score + tight[h, q_idx - kv_idx + 332]

    def alibi(score, b, h, q_idx, kv_idx):
        return score + (kv_idx - q_idx) * torch.exp2(-((h + 1) * 8.0 / H))

    def prefix(b, h, q_idx, kv_idx):
        return (kv_idx < 83) | (q_idx >= kv_idx)

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= 37)

    q, k, v, do = (torch.randn(1, H, S, D, generator=g).to(dev(), torch.bfloat16) for _ in range(4))

    def run(name, call, sm=None, mm=None, want_free=None, mutant=False, direct=False, repeat=False):
        t0 = time.perf_counter()
        selection(True)
        try:
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            got = torch.autograd.grad(call(qg, kg, vg), (qg, kg, vg), do)
            used = sorted({m.NAME for m in list(modded._GLUON_BWD.values()) + list(resolve._FAST.values())
                           if m is not None and m.NAME.endswith("_gluon")})
            ref = reference(sm, mm, "none", q, k, v, do)
            errs = [compare_grad(n, a, r, DType.BF16) for n, a, r in zip(("dq", "dk", "dv"), got, ref)]
            notes = []
            if want_free is not None:
                mod = next(m for m in modded._GLUON_BWD.values() if m is not None)
                fields, vals = mod_fields(sm)
                free = mod._mod_free(q, k, *[vals[t[0]] for t in fields[2]], *[vals[x[0]] for x in fields[3]])
                assert free == want_free, f"_mod_free {free}, expected {want_free}"
                if free:  # the clamped kernel on the same inputs: the same elements, within the same tolerance
                    keep, mod._mod_free = mod._mod_free, lambda *a: False
                    again = torch.autograd.grad(call(qg, kg, vg), (qg, kg, vg), do)
                    mod._mod_free = keep
                    errc = [compare_grad(n, a, r, DType.BF16) for n, a, r in zip(("dq", "dk", "dv"), again, ref)]
                    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, again))
                    notes.append(f"clamped kernel: max |err| {max(errc):.1e}, max |diff| {diff:.1e}")
            if repeat:  # deterministic: the same inputs, the same bits
                twice = torch.autograd.grad(call(qg, kg, vg), (qg, kg, vg), do)
                assert all(torch.equal(a, b) for a, b in zip(got, twice)), "two runs differ"
                notes.append("bitwise repeatable")
            assert used or direct, "the Gluon backward did not serve"
            ok = not mutant
            line = (f"{'PASS' if ok else 'FAIL'} {name}: max |err| dq {errs[0]:.1e} dk {errs[1]:.1e} dv {errs[2]:.1e}"
                    f" via {','.join(used) or ('the module' if direct else 'triton')}; {'; '.join(notes)}")
        except Exception as e:  # noqa: BLE001 - a line, never the end of the run
            ok = mutant and isinstance(e, AssertionError)
            line = f"{'PASS' if ok else 'FAIL'} {name}: {'caught: ' if ok else ''}{type(e).__name__}: {str(e)[:150]}"
        print(f"CHECK {line} ({time.perf_counter() - t0:.1f} s)", flush=True)

    def attention(sm=None, mm=None, det=True):
        return lambda q, k, v: fagen.attention(q, k, v, score_mod=sm, mask_mod=mm, deterministic=det)

    def early_call(sm):
        module, values = early_module(sm)
        return lambda q, k, v: module.attention(q, k, v, mods=values)

    def window_call(desc, det, fixed=False):
        module = window_module(desc, fixed)
        return lambda q, k, v: module.attention(q, k, v, window=(37, 0), deterministic=det)

    def mutant_call():
        from fagen.codegen.render import render
        from fagen.runtime.loader import load_source
        from fagen.spec.kernel import KernelSpec

        m = modded.prepare(score_mod=rel_free)
        spec = KernelSpec(backend="gluon", direction="bwd", head_dim=D, dtype="bf16", score_mod=m.fields[0],
                          mod_tensors=[list(t) for t in m.fields[2]], mod_scalars=[list(x) for x in m.fields[3]])
        src = render(spec).files[".py"]
        head = "            if MOD_FREE:"
        at = src.index(head)
        end = src.index("\n", src.index("\n", at) + 1)
        line = src[src.index("\n", at) + 1:end]
        assert line.endswith("* 1.4426950408889634"), line
        src = src[:end] + " * 0.5" + src[end:]  # the clamp-free branch's bias halved
        module = load_source(src, spec.name + "_mutant")
        return lambda q, k, v: module.attention(q, k, v, mods=m.values)

    if DRY:  # no Gluon on the interpreter: the sm_90 builds of the clamp-free kernel and the mutant's render
        from fagen.spec.kernel import KernelSpec

        m = modded.prepare(score_mod=rel_free)
        spec = KernelSpec(backend="gluon", direction="bwd", head_dim=D, dtype="bf16", score_mod=m.fields[0],
                          mod_tensors=[list(t) for t in m.fields[2]], mod_scalars=[list(x) for x in m.fields[3]])
        mutant_call()
        for free in (False, True):
            ck = fagen.load(spec).compile_backward_for(mod_free=free)
            print(f"CHECK BUILT relative bias mod_free={free}: sm_90, {ck.metadata.shared} B shared", flush=True)
        return
    cases = [  # (name, call maker, score_mod, mask_mod, keywords): one slice per check phase (part i of n)
        ("prefix-lm P 83 (two split calls)", lambda: attention(mm=prefix), None, prefix, dict(repeat=True)),
        ("window causal (37, 0) via fagen.attention, deterministic", lambda: attention(mm=window), None, window,
         dict(repeat=True)),
        ("relative bias, every index inside (clamp-free kernel)", lambda: attention(rel_free), rel_free, None,
         dict(want_free=True, repeat=True)),
        ("MUTANT clamp-free bias halved", mutant_call, rel_free, None, dict(mutant=True, direct=True)),
        ("window causal (37, 0) via fagen.attention, deterministic=False", lambda: attention(mm=window, det=False),
         None, window, {}),
        ("relative bias, padded tiles outside (clamped kernel)", lambda: attention(rel_tight), rel_tight, None,
         dict(want_free=False)),
        ("alibi (attention-gym, row-free)", lambda: attention(alibi), alibi, None, {}),
        ("window causal (37, 0) desc det", lambda: window_call(True, True), None, window, dict(direct=True)),
        ("window causal (37, 0) desc unordered", lambda: window_call(True, False), None, window, dict(direct=True)),
        ("relative bias inside, the read before the S wait (bwd_mod_early)", lambda: early_call(rel_free), rel_free,
         None, dict(direct=True)),
    ][:int(os.environ.get("S9_CHECKS", "99"))]  # --checks N: the first N
    for name, make, sm, mm, kw in cases[part[0]::part[1]]:
        run(name, make(), sm, mm, **kw)


def phase_time() -> None:
    import torch

    from fagen.bench.mods import _inputs, _visible_pairs
    from fagen.bench.timing import measure

    shape = shape_of()
    q, k, v, do = _inputs(shape, dev(), True)
    todo = plan()
    rows = list(todo)
    t_end = float(os.environ.get("S9_TIME_END", time.time() + 60))
    for row in rows:
        sm, mm = row_mods(row, shape)
        bm = fagen_mask(mm, shape)
        fl = 2.5 * 4.0 * shape.head_dim * _visible_pairs(bm, mm, shape)
        for variant in (["flex"] if not DRY else []) + todo[row]:
            rec = {"row": row, "variant": variant}
            if time.time() > t_end:
                rec["error"] = "skipped: out of time"
            elif DRY and variant not in ("triton", "api"):
                rec["error"] = "dry run: Gluon only on sm_90"
            else:
                try:
                    att = flex_call(sm, mm, shape) if variant == "flex" else caller(row, variant, sm, mm, bm)
                    out = att(q, k, v)
                    torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
                    rec["bwd_ms"] = measure(lambda i: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                                            1, torch.device(dev()), 10.0, 30.0 if not DRY else 1.0)
                    rec["tflops"] = fl / rec["bwd_ms"] / 1e9
                    del out
                except Exception as e:  # noqa: BLE001 - a row of the table
                    rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            print("REC " + json.dumps(rec), flush=True)


def main() -> None:
    from _phases import child_env, run_phase

    t0 = time.time()
    env = child_env("/tmp/fagen-s9-modsel", ROOT)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # nine phases compile at once
    script = os.path.abspath(__file__)
    lines: dict[str, list] = {}
    argv = dict(zip(sys.argv[1::2], sys.argv[2::2]))  # --rows a,b --drop row/variant,... --checks N --warm N
    for flag, name in (("--rows", "S9_ROWS"), ("--drop", "S9_DROP"), ("--checks", "S9_CHECKS")):
        if flag in argv:
            env[name] = os.environ[name] = argv[flag]
    items = [(r, v) for r, vs in plan().items() for v in (["flex"] if not DRY else []) + vs
             if not (DRY and v not in ("triton", "api"))]
    items.sort(key=lambda item: item[1] != "flex")  # Flex's compiles (the longest) in groups of their own
    n = 1 if DRY else int(argv.get("--warm", 8))
    groups = [items[i::n] for i in range(n)]

    def go(name, limit, extra=()):
        rc, got = run_phase(script, name, limit, env, on_line=lambda s: print(s, end="", flush=True), extra=extra)
        lines.setdefault(name, []).extend(got)  # the check parts share one name
        if rc != 0:
            print(f"phase {name}: {rc}", flush=True)

    parts = 1 if DRY else 4
    threads = [threading.Thread(target=go, args=("check", 40.0, (json.dumps([i, parts]),)), name=f"check{i}")
               for i in range(parts)]
    threads += [threading.Thread(target=go, args=(f"warm{i}", 40.0, (json.dumps(g),))) for i, g in enumerate(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    left = BUDGET - (time.time() - t0)
    env["S9_TIME_END"] = str(time.time() + left - 4)
    print(f"compiled in {time.time() - t0:.0f} s; timing for {left:.0f} s", flush=True)
    go("time", max(5.0, left))
    recs = [json.loads(s[4:]) for s in lines.get("time", []) if s.startswith("REC ")]
    flex = {r["row"]: r.get("bwd_ms") for r in recs if r["variant"] == "flex"}
    print("\n| row | variant | bwd ms | bwd TF/s | x Flex |\n|---|---|---:|---:|---:|")
    for r in recs:
        if r.get("error"):
            print(f"| {r['row']} | {r['variant']} | - | - | {r['error'][:90]} |")
            continue
        x = f"{flex[r['row']] / r['bwd_ms']:.2f}x" if flex.get(r["row"]) else "-"
        print(f"| {r['row']} | {r['variant']} | {r['bwd_ms']:.3f} | {r['tflops']:.0f} | {x} |")
    for s in lines.get("check", []):
        if s.startswith("CHECK "):
            print(s[6:], end="")
    print(f"total {time.time() - t0:.0f} s")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "mods_bwd_s9.json"), "w") as f:
            json.dump({"records": recs, "checks": lines.get("check", [])}, f, indent=1)


if __name__ == "__main__":
    if "--phase" in sys.argv:
        name = sys.argv[sys.argv.index("--phase") + 1]
        if DRY and name != "check":  # the dry check builds for sm_90: no interpreter
            os.environ.setdefault("TRITON_INTERPRET", "1")
        if name == "check":
            phase_check(tuple(json.loads(sys.argv[-1])))
        elif name == "time":
            phase_time()
        else:
            phase_warm([tuple(x) for x in json.loads(sys.argv[-1])])
    else:
        main()
