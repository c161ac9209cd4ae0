"""Where the first call of a new user mod spends its time: a per-phase breakdown, cold and warm caches, each in a
fresh process, on the current tree (issue 26: "First call of a new mod, cold caches: <= 3 s to first result (Flex:
10-15 s). Warm: <= 0.3 s.").

Scenarios (each a new subprocess; "cold": fresh FAGEN_CACHE_DIR and TRITON_CACHE_DIR, "warm": the caches the cold
run of the same row filled):
  start      process start to the first result, the clock started after `import torch` (what `fagen bench --suite
             mods` cold-first-call reports): import fagen, CUDA init, then fagen.attention(q, q, q, score_mod=mod).
  new mod    the issue's case: a process that already imported fagen, initialised CUDA and ran one plain
             fagen.attention call (untimed setup), then the first call of a mod no cache has seen (cold), one an
             earlier process compiled (warm), or a new mod in a process whose caches hold everything else (other
             caches warm: the plain call is served from them, the mod compiles). Only that call is timed.
  triton fwd new mod   the "new mod cold" row with FAGEN_HOPPER=0: the Triton modded forward serves (and the plain
             call's Triton forward), for comparison only (docs/mods.md, "The cold first call on the H200").
  flex       the same for FlexAttention: torch.compile(flex_attention) ran one plain call (setup), then the first
             call with the new score_mod; fresh TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR (cold), then reused.
The mod is the bench's: score + where(q_idx >= kv_idx, c, -0.5) with a literal c new to every run; q = k = v
[1, 16, 4096, 128] bf16, no gradient (2^28 pairs >= hopper.MIN_WORK: on sm_90 the Gluon modded forward).

Phases are exclusive wall times, from wrappers around: fagen.runtime.mods.trace (trace), fagen.codegen.render's
_render (render, Jinja), fagen.runtime.loader.load (load: cache files, index, spec for the arch),
fagen.runtime.modules.import_module (import of the generated module), triton.runtime.cache.triton_key (triton key:
the hash of libtriton.so, once per process), triton.compiler.compile (compile, a cache hit included),
triton's compile_module_from_src (launcher lookup) and its C compiler call (gcc: cuda_utils and the launcher stub);
"launch+sync" is the rest of the call. Triton's compilation listener counts compiles and cache hits by kernel, and
gives each compile's stage times (ir init, ttgir, llir, ptx, cubin: ptxas), printed in a second table.

    PYTHONPATH=$PWD python3 scripts/gpu_coldstart.py            # H200: ~100 s (flex included), two tables
    GPU_COLDSTART_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_coldstart.py   # CPU interpreter, tiny shapes, no flex
    PYTHONPATH=$PWD python3 scripts/gpu_coldstart.py --dry-run            # the same
Writes $OUT/gpu_coldstart.json (every child's record) when $OUT is set.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

DRY = os.environ.get("GPU_COLDSTART_DRY", "0") == "1" or "--dry-run" in sys.argv[1:]
T0 = time.time()

CHILD = r'''
import json, os, sys, time
T = time.perf_counter
mode, const, device, seq, heads, dim, dtype_name = sys.argv[1], float(sys.argv[2]), sys.argv[3], *map(int, sys.argv[4:7]), sys.argv[7]
PH, CNT, STACK, COMPILES = {}, {}, [], []
t_torch = T()
import torch
rec = {"mode": mode, "torch import": T() - t_torch}
t0 = T()
dtype = getattr(torch, dtype_name)


def timed(label, fn):
    def wrapper(*a, **k):
        start = T()
        STACK.append(0.0)
        try:
            return fn(*a, **k)
        finally:
            inner, spent = STACK.pop(), T() - start
            PH[label] = PH.get(label, 0.0) + spent - inner
            CNT[label] = CNT.get(label, 0) + 1
            if STACK:
                STACK[-1] += spent
    wrapper.__wrapped__ = fn
    return wrapper


def sync():
    if device == "cuda":
        torch.cuda.synchronize()


def mod_of(c):
    """A mod no cache has seen: c is a literal of its expression (a closure number would be a runtime scalar of a
    kernel compiled before), as in fagen bench --suite mods' cold row."""
    return eval(f"lambda score, b, h, q_idx, kv_idx: score + torch.where(q_idx >= kv_idx, {c!r}, -0.5)",
                {"torch": torch})


def patch_fagen():
    import fagen.codegen.render as render
    import fagen.runtime.loader as loader
    import fagen.runtime.mods as mods
    import fagen.runtime.modded as modded
    import fagen.runtime.resolve as resolve
    mods.trace = timed("trace", mods.trace)
    render._render = timed("render", render._render)
    loader.import_module = timed("import module", loader.import_module)
    load = timed("load", loader.load)
    loader.load = modded.load = resolve.load = load


def patch_triton():
    import triton
    import triton.compiler
    import triton.runtime.build as build
    import triton.runtime.cache as cache
    cache.triton_key = timed("triton key", cache.triton_key)
    triton.compiler.compile = timed("compile", triton.compiler.compile)
    build._build = timed("gcc", build._build)
    try:
        import triton.backends.nvidia.driver as nvd
        nvd.compile_module_from_src = timed("launcher", nvd.compile_module_from_src)
    except Exception:
        pass
    try:
        triton.knobs.compilation.listener = lambda src, metadata, metadata_group, times, cache_hit: COMPILES.append(
            [getattr(src, "name", "?"), bool(cache_hit), stage_times(times)])
    except Exception:
        pass


def stage_times(times):
    """Triton's compile stage seconds (ir init: the AST to the first IR; then ttir/ttgir, llir, ptx, cubin: ptxas)."""
    try:
        return {"ir init": times.ir_initialization / 1e6, **{k: v / 1e6 for k, v in times.lowering_stages}}
    except Exception:
        return {}


def phase(label, fn):
    start = T()
    out = fn()
    rec[label] = T() - start
    return out


if mode == "flex":
    from torch.nn.attention.flex_attention import flex_attention
    phase("cuda init", lambda: (torch.empty(1, device=device), sync()))
    q = torch.randn(1, heads, seq, dim, device=device, dtype=dtype)
    compiled = torch.compile(flex_attention, dynamic=False)
    phase("plain call (setup)", lambda: (compiled(q, q, q), sync()))
    start = T()
    out = compiled(q, q, q, score_mod=mod_of(const))
    sync()
    rec["first call"] = T() - start
    print(json.dumps(rec))
    sys.exit(0)

import fagen
phase("import fagen", lambda: fagen.attention)
patch_fagen()
phase("import triton", patch_triton)
rec["dynamo imported"] = "torch._dynamo" in sys.modules
phase("cuda init", lambda: (torch.empty(1, device=device), sync()))
q = torch.randn(1, heads, seq, dim, device=device, dtype=dtype)
sync()
if mode == "newmod":
    phase("plain call (setup)", lambda: (fagen.attention(q, q, q), sync()))
    PH.clear(); CNT.clear(); COMPILES.clear()
mod = mod_of(const)
start = T()
with torch.no_grad():
    out = fagen.attention(q, q, q, score_mod=mod)
sync()
end = T()
rec["call"] = end - start
rec["first result"] = end - (t0 if mode == "start" else start)
rec["phases"], rec["counts"], rec["compiles"] = dict(PH), dict(CNT), list(COMPILES)
start = T()
with torch.no_grad():
    fagen.attention(q, q, q, score_mod=mod_of(const))  # the same code, a new function object: no new compile
sync()
rec["repeat call ms"] = (T() - start) * 1e3
x = q.double()
s = x @ x.transpose(-1, -2) / dim ** 0.5
i = torch.arange(seq, device=device)
s = s + torch.where(i[:, None] >= i[None, :], const, -0.5)
want = torch.softmax(s, -1) @ x
rec["max diff"] = (out.double() - want).abs().max().item()
print(json.dumps(rec))
'''


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def child(mode: str, const: float, env: dict, shape) -> dict:
    seq, heads, dim, dtype = shape
    args = [sys.executable, "-c", CHILD, mode, repr(const), "cpu" if DRY else "cuda", str(seq), str(heads), str(dim),
            dtype]
    try:
        res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=240 if DRY else 100)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": "timed out"}
    if res.returncode:
        tail = (res.stderr.strip().splitlines() or ["failed"])[-1]
        return {"mode": mode, "error": tail[:200]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    shape = (64, 2, 32, "float32") if DRY else (4096, 16, 128, "bfloat16")
    tol = 1e-3 if DRY else 2e-2
    base = {k: v for k, v in os.environ.items() if k not in ("FAGEN_CACHE_DIR", "TRITON_CACHE_DIR")}
    if DRY:
        base["TRITON_INTERPRET"] = "1"
    stamp = time.time_ns() % 10**6 / 10**6
    records = {}
    with tempfile.TemporaryDirectory(prefix="fagen-coldstart-") as tmp:
        runs = (("start", "start", 0.25 + stamp, ("cold", "warm")),
                ("new mod", "newmod", 0.5 + stamp, ("cold", "warm")),
                ("new mod", "newmod", 0.625 + stamp, ("other caches warm",)),
                ("triton fwd new mod", "newmod", 0.875 + stamp, ("cold",)))
        for row, mode, const, kinds in runs:
            env = dict(base, FAGEN_CACHE_DIR=os.path.join(tmp, row, "fagen"),
                       TRITON_CACHE_DIR=os.path.join(tmp, row, "triton"),
                       TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, row, "inductor"))
            if row.startswith("triton fwd"):  # the same call on the Triton modded forward (FAGEN_HOPPER=0): what the
                env["FAGEN_HOPPER"] = "0"  # Triton forward's cold compile costs on this host, for comparison only
            for caches in kinds:
                name = f"{row} {caches}"
                log(f"{name} ...")
                records[name] = child(mode, const, env, shape)
                log(f"{name}: {json.dumps(records[name])[:400]}")
        if not DRY:
            env = dict(base, TRITON_CACHE_DIR=os.path.join(tmp, "flex", "triton"),
                       TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "flex", "inductor"))
            for caches in ("cold", "warm"):
                if time.time() - T0 > (75 if caches == "cold" else 95):  # the whole run stays under ~140 s
                    log(f"flex {caches}: skipped (time budget)")
                    continue
                log(f"flex {caches} ...")
                records[f"flex {caches}"] = child("flex", 0.75 + stamp, env, shape)
                log(f"flex {caches}: {json.dumps(records[f'flex {caches}'])[:300]}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_coldstart.json"), "w") as f:
            json.dump(records, f, indent=1)
    print(table(records, tol))


PHASES = ("import fagen", "import triton", "cuda init", "plain call (setup)", "trace", "render", "load",
          "import module", "triton key", "compile", "launcher", "gcc")


def table(records: dict, tol: float) -> str:
    cols = [c for c in ("start cold", "start warm", "new mod cold", "new mod warm", "new mod other caches warm",
                        "triton fwd new mod cold") if c in records]
    lines = ["| phase (s) | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]

    def cell(r, key):
        if "error" in r:
            return "error"
        if key in r.get("phases", {}):
            return f"{r['phases'][key]:.3f} ({r['counts'][key]})"
        return f"{r[key]:.3f}" if isinstance(r.get(key), float) else "-"

    for key in PHASES:
        lines.append(f"| {key} | " + " | ".join(cell(records[c], key) for c in cols) + " |")

    def rest(r):
        return r["call"] - sum(r["phases"].values()) if "error" not in r else None

    lines.append("| launch+sync (rest of the call) | " + " | ".join(
        "error" if rest(records[c]) is None else f"{rest(records[c]):.3f}" for c in cols) + " |")
    lines.append("| **the call** | " + " | ".join(cell(records[c], "call") for c in cols) + " |")
    lines.append("| **first result** (start: since after import torch) | " + " | ".join(
        cell(records[c], "first result") for c in cols) + " |")
    lines.append("| repeat call ms (new function object) | " + " | ".join(
        cell(records[c], "repeat call ms") for c in cols) + " |")
    out = ["\n".join(lines), ""]
    for c in cols:
        r = records[c]
        if "error" in r:
            out.append(f"FAIL {c}: {r['error']}")
            continue
        real = [n for n, hit, _ in r["compiles"] if not hit]
        hits = [n for n, hit, _ in r["compiles"] if hit]
        ok = r["max diff"] <= tol
        out.append(f"{'PASS' if ok else 'FAIL'} {c}: max diff {r['max diff']:.2e} (tol {tol}); compiles {len(real)} "
                   f"{real}, cache hits {len(hits)} {hits}; torch._dynamo imported by fagen: {r['dynamo imported']}")
    out.append("")
    out.append(stage_table(records, cols))
    for c in ("flex cold", "flex warm"):
        if c in records:
            r = records[c]
            out.append(f"{c}: " + (f"error {r['error']}" if "error" in r else
                                   f"first call of the new mod {r['first call']:.2f} s (plain call setup "
                                   f"{r['plain call (setup)']:.2f} s)"))
    targets = {"new mod cold": 3.0, "triton fwd new mod cold": 3.0, "new mod other caches warm": 3.0,
               "new mod warm": 0.3}
    for c, limit in targets.items():
        if c in records and "error" not in records[c]:
            got = records[c]["call"]
            out.append(f"{c}: {got:.2f} s against the issue's {limit} s: {'met' if got <= limit else 'NOT met'}")
    out.append(f"total {time.time() - T0:.0f} s")
    return "\n".join(out)


STAGES = ("ir init", "ttir", "ttgir", "llir", "ptx", "cubin")


def stage_table(records: dict, cols) -> str:
    """Each compile (not a cache hit) of each row by Triton's stages, seconds (the compilation listener's times)."""
    lines = ["| row | kernel | " + " | ".join(STAGES) + " | sum |", "|---|---|" + "---:|" * (len(STAGES) + 1)]
    for c in cols:
        for name, hit, st in records[c].get("compiles", ()):
            if not hit and st:
                lines.append(f"| {c} | {name} | " + " | ".join(f"{st[s]:.3f}" if s in st else "-" for s in STAGES)
                             + f" | {sum(st.values()):.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
