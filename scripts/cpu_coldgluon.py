"""Where the cold compile of a new mod's forward goes, stage by stage, on a CPU (no GPU: triton compiles for sm_90
ahead of time with its bundled ptxas). Issue 26's cold row (benchmarks/s18/coldstart.txt): q = k = v
[1, 16, 4096, 128] bf16, no gradient, score + where(q_idx >= kv_idx, c, -0.5) with a new literal c; 2^28 pairs >=
hopper.MIN_WORK, so the H200 compiles the Gluon modded forward `_attn_fwd_hopper` (3.69 s of a 3.74 s call).

Each build runs in a fresh process with fresh FAGEN_CACHE_DIR and TRITON_CACHE_DIR: the Gluon modded forward
(the module's compile_for, as tests/test_hopper_compile.py builds it) and the Triton modded forward of the same mod
(its AOT_KERNELS entry through fagen.aot's triton.compile), each twice in the same process with a new literal c
(the second: a new mod in a process that compiled one already). Triton's compilation listener gives the stage
times (ir init: the AST to TTIR/TTGIR source, then ttir, ttgir, llir, ptx, cubin = ptxas).

    PYTHONPATH=$PWD python3 scripts/cpu_coldgluon.py [--kinds gluon,triton,gluon-plain] [--env K=V] [--json PATH]
        [--variant fwd_tail_first=0 --variant fwd_tail_first=1 --repeat 2]  (each variant in its own processes;
        an empty --variant= is the product's)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r'''
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
kind, consts = sys.argv[2], [float(c) for c in sys.argv[3].split(",")]
variant = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
T = time.perf_counter
t0 = T()
import torch, triton
from triton.backends.compiler import GPUTarget
import fagen
from fagen.runtime import mods, modded
from fagen.spec.kernel import KernelSpec
from fagen import backends
backends.GLUON.variant.update(variant)  # a Gluon variant's keys (--variant), set before any render
rec = {"kind": kind, "variant": variant, "imports": T() - t0, "builds": []}
import resource
from triton.backends.nvidia.compiler import CUDABackend
CPU = {}


def cpu_now():  # this process's CPU time and its waited-for children's (ptxas): wall time is the machine's load's
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + ch.ru_utime + ch.ru_stime


def cpu_timed(stage, fn):
    def wrapper(*a, **k):
        start = cpu_now()
        try:
            return fn(*a, **k)
        finally:
            CPU[stage] = CPU.get(stage, 0.0) + cpu_now() - start
    return wrapper


for stage, name in (("ttir", "make_ttir"), ("ttgir", "make_ttgir"), ("ttgir", "gluon_to_ttgir"), ("llir", "make_llir"),
                    ("ptx", "make_ptx"), ("cubin", "make_cubin")):
    wrapped = cpu_timed(stage, getattr(CUDABackend, name))
    setattr(CUDABackend, name, staticmethod(wrapped) if isinstance(CUDABackend.__dict__[name], staticmethod) else wrapped)
TIMES = []
triton.knobs.compilation.listener = lambda src, metadata, metadata_group, times, cache_hit: TIMES.append(
    dict(name=getattr(src, "name", "?"), hit=bool(cache_hit), init=times.ir_initialization / 1e6,
         stages={k: v / 1e6 for k, v in times.lowering_stages}, store=times.store_results / 1e6))
for c in consts:
    fn = eval(f"lambda score, b, h, q_idx, kv_idx: score + torch.where(q_idx >= kv_idx, {c!r}, -0.5)",
              {"torch": torch})
    t = T()
    CPU.clear()
    c0 = cpu_now()
    m = mods.prepare(score_mod=fn)
    base = KernelSpec(head_dim=128, dtype="bf16", mask="none")
    spec = modded.modded_spec(base, m.fields, arch="sm_90")
    if kind == "gluon-plain":  # the plain Gluon forward (no mod): what the kernel costs without the mod
        spec = KernelSpec(head_dim=128, dtype="bf16", mask="none", backend="gluon")
    elif kind == "gluon":  # hopper.mod_forward_spec's twin, without its device checks
        spec = KernelSpec(head_dim=spec.head_dim, mask=spec.mask, gqa=spec.gqa, dtype=spec.dtype, backend="gluon",
                          score_mod=spec.score_mod, mod_tensors=spec.mod_tensors, mod_scalars=spec.mod_scalars)
    t_spec = T()
    if kind.startswith("gluon"):
        module = fagen.load(spec)
        t_load = T()
        ck = module.compile_for(seq_q=4096, seq_k=4096)
    else:
        from fagen.aot import artifacts
        module = artifacts.import_for_compile(spec)
        t_load = T()
        entry = [e for e in module.AOT_KERNELS if e["name"] == "_attn_fwd"][0]
        artifacts._compile_kernel(spec, "sm_90", entry)
    t_end = T()
    cpu = dict(CPU, total=cpu_now() - c0)
    b = dict(cpu=cpu, const=c, spec=spec.name, trace_spec=t_spec - t, load=t_load - t_spec, compile=t_end - t_load)
    b.update(TIMES[-1] if TIMES else {})
    rec["builds"].append(b)
print("RESULT " + json.dumps(rec))
'''


def run(kind: str, consts, extra_env: dict, variant: dict | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="coldgluon-") as tmp:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(FAGEN_CACHE_DIR=os.path.join(tmp, "fagen"), TRITON_CACHE_DIR=os.path.join(tmp, "triton"),
                   **extra_env)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        start = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", CHILD, root, kind, ",".join(map(repr, consts)), json.dumps(variant or {})], env=env,
                           capture_output=True, text=True, timeout=600)
        if p.returncode:
            raise SystemExit(p.stderr[-3000:])
        rec = json.loads(p.stdout.split("RESULT ", 1)[1])
        rec["process"] = time.perf_counter() - start
        return rec


def table(recs: list) -> str:
    stages = ("ttir", "ttgir", "llir", "ptx", "cubin")
    lines = ["| build | trace+spec | load (render, import) | compile | ir init | " + " | ".join(stages) + " |",
             "|---|" + "---:|" * (4 + len(stages))]
    for rec in recs:
        for i, b in enumerate(rec["builds"]):
            cells = [f"{b['trace_spec']:.3f}", f"{b['load']:.3f}", f"{b['compile']:.3f}", f"{b.get('init', 0):.3f}"]
            cells += [f"{b.get('stages', {}).get(s, 0):.3f}" if s in b.get("stages", {}) else "-" for s in stages]
            name = rec["kind"] + "".join(f" {k}={v}" for k, v in rec.get("variant", {}).items())
            lines.append(f"| {name} {'first' if i == 0 else 'second'} mod | " + " | ".join(cells) + " |")
            cpu = b["cpu"]
            lines.append(f"| (CPU s) | | | {cpu['total']:.3f} | | " + " | ".join(
                f"{cpu[s]:.3f}" if s in cpu else "-" for s in stages) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="gluon,triton")
    ap.add_argument("--env", action="append", default=[], help="K=V for the builds, e.g. TRITON_DISABLE_LINE_INFO=1")
    ap.add_argument("--variant", action="append", default=[],
                    help="K=V (an int) of the Gluon variant for the builds, e.g. fwd_tail_first=1; several: kinds x variants")
    ap.add_argument("--repeat", type=int, default=1, help="processes per kind and variant, alternated")
    ap.add_argument("--json")
    a = ap.parse_args()
    stamp = time.time_ns() % 10**6 / 10**6
    extra = dict(e.split("=", 1) for e in a.env)
    variants = [dict([(k, int(v))]) if k else {} for k, v in (x.split("=", 1) if x else ("", "") for x in a.variant)] or [{}]
    recs = [run(kind, (0.5 + stamp + r, 0.625 + stamp + r), extra, var) for r in range(a.repeat)
            for kind in a.kinds.split(",") for var in variants]
    print(f"env {extra or '(none)'}")
    print(table(recs))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(recs, f, indent=1)


if __name__ == "__main__":
    main()
