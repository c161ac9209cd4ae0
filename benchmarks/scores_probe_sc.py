"""Issue 15, softcap probe (H100): software exp2 on the FMA pipe for part of the softcap tile ([Note] Software exp2
in fagen/templates/triton/attention.py.j2). Renders the d128 causal bf16 softcap forward with the render knob
fagen.spec.defaults.SOFT_EXP2 set to each variant (every = 0: today's kernel; 1: all columns in software; 2: half;
4: a quarter), checks each against the float64 reference, then times it beside fagen's plain causal forward.

    OUT=/tmp/o python benchmarks/scores_probe_sc.py            # GPU: checks, timings, $OUT/scores_probe_sc.json
    python benchmarks/scores_probe_sc.py --dry-run             # CPU: render + compile each for sm_90, registers,
                                                               # spills, SASS op counts (MUFU, FFMA, SHFL, LDS/STS)

Variants are renders of the template with the knob set (no edits of the source); they load through
scores_probe_h15's loading path (fagen.runtime.loader.load_source), the plain forward too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scores_probe_h15 as h15  # noqa: E402  (its loading path and bench rows)

import fagen  # noqa: E402
from fagen.bench.workloads import SOFTCAP, score_rows  # noqa: E402
from fagen.codegen.render import _context, environment, template_name  # noqa: E402
from fagen.verify.properties import check_forward, check_nan_propagates  # noqa: E402
from fagen.verify.strategies import Problem  # noqa: E402
from fagen.verify.tolerances import PropertyFailure  # noqa: E402

EVERY = {"off": 0, "all": 1, "half": 2, "quarter": 4}
CHECKS = [dict(batch=1, heads_kv=2, seq_q=333, seq_k=333, softcap=SOFTCAP, magnitude=4.0, seed=1),
          dict(batch=2, heads_kv=4, seq_q=1000, seq_k=1000, softcap=5.0, magnitude=4.0, seed=2)]
B, H, S, D = 1, 16, 16384, 128
DEVICE = "cuda"


def soft_source(spec, every: int, degree: int = 4) -> str:
    """`spec` rendered with the software-exp2 knob (validated: every 0, 1, 2 or 4; degree 3, 4 or 5)."""
    if every not in (0, 1, 2, 4) or degree not in (3, 4, 5):
        raise ValueError(f"soft exp2: every {every!r} (0, 1, 2, 4), degree {degree!r} (3, 4, 5)")
    return environment().get_template(template_name(spec)).render(
        **{**_context(spec), "soft_exp2": {"every": every, "degree": degree}})


def specs():
    """The softcap row's spec (tuned config, as `fagen bench` picks it) and the same spec without the softcap."""
    rows = {c.name: c for c in score_rows(baselines=True)}
    cap = rows["fwd-d128-softcap-causal-s16k"].spec(torch.device("cuda"))[0]
    return cap, fagen.KernelSpec(**{**cap.to_dict(), "softcap": False})


def variants(names, degree):
    cap, plain = specs()
    out = [("plain", "plain", plain, soft_source(plain, 0))]
    out += [(f"softcap {n}" + (f" d{degree}" if EVERY[n] else ""), f"soft{EVERY[n]}d{degree}", cap,
             soft_source(cap, EVERY[n], degree)) for n in names]
    return out


# -- dry run: compile for sm_90 ----------------------------------------------------------------------------------
SASS_OPS = ("MUFU.EX2", "MUFU.TANH", "FFMA", "FMUL", "FADD", "FMNMX", "IMAD", "LEA", "SHF", "SHFL", "LDS", "STS",
            "LDSM", "STSM", "BAR", "HGMMA", "F2FP")


def compile_sm90(spec, source):
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    from fagen.aot.artifacts import _resource_usage, import_for_compile
    from fagen.codegen.render import Rendered

    module = import_for_compile(spec, Rendered(spec=spec, files={".py": source}, digest=str(hash(source))))
    entry = module.AOT_KERNELS[0]
    fn = entry["fn"]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in entry["divisible"]}
    target = GPUTarget("cuda", 90, 32)
    options = make_backend(target).parse_options({"num_warps": entry["num_warps"], "num_stages": entry["num_stages"]})
    t0 = time.perf_counter()
    kernel = triton.compile(ASTSource(fn, entry["signature"], entry["constexprs"], attrs), target=target,
                            options=options.__dict__)
    seconds = time.perf_counter() - t0
    registers, stack, _ = _resource_usage(kernel.asm["cubin"])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", str(path)], capture_output=True, text=True,
                              check=True).stdout
    ops = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)]
    count = {op: sum(1 for o in ops if o == op or o.startswith(op + ".")) for op in SASS_OPS}
    ttgir = kernel.asm["ttgir"]
    return dict(registers=registers, spills=stack // 4, compile_s=round(seconds, 1), sass_total=len(ops),
                sass=count, convert_layout=ttgir.count("ttg.convert_layout"), local_alloc=ttgir.count("local_alloc"),
                ptx_ex2=kernel.asm["ptx"].count("ex2.approx"), ptx_shfl=kernel.asm["ptx"].count("shfl.sync"))


def dry_run(rows, log):
    out = []
    for label, _, spec, source in rows:
        rec = dict(label=label, spec=spec.name, **compile_sm90(spec, source))
        out.append(rec)
        log(f"{label:<22} regs {rec['registers']:3d} spills {rec['spills']:3d} convert_layout {rec['convert_layout']} "
            f"local_alloc {rec['local_alloc']} ptx ex2 {rec['ptx_ex2']} shfl {rec['ptx_shfl']} | SASS {rec['sass_total']}"
            f" {' '.join(f'{k} {v}' for k, v in rec['sass'].items())} ({rec['compile_s']} s)")
    return out


# -- GPU: checks and timings ---------------------------------------------------------------------------------------
def gpu_run(rows, log, warmup, rep, rounds):
    import triton

    out = []
    q, k, v = (torch.randn(B, H, S, D, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * B * H * S * S * D / 2
    mods = {}
    for label, tag, spec, source in rows:
        t0 = time.perf_counter()
        rec = dict(label=label, spec=spec.name, checks=[])
        mod = h15.load_source(source, f"{spec.name}_sc_{tag}")
        mods[label] = mod
        if spec.softcap:
            for kw in CHECKS:
                p = Problem(**kw)
                try:
                    o = check_forward(mod, spec, p, DEVICE)
                    check_nan_propagates(mod, spec, p, DEVICE)
                    rec["checks"].append(dict(problem=kw, ok=True, max_err=o.max_err, max_lse_err=o.max_lse_err))
                    log(f"{label:<22} {p.batch},{p.heads_kv},{p.seq_q} cap {p.softcap}: PASS (out {o.max_err:.3g}, "
                        f"lse {o.max_lse_err:.3g}; NaN propagates)")
                except PropertyFailure as e:
                    rec["checks"].append(dict(problem=kw, ok=False, error=str(e)[:300]))
                    log(f"{label:<22} {p.batch},{p.heads_kv},{p.seq_q} cap {p.softcap}: FAIL {str(e)[:200]}")
        kwargs = {"softcap": SOFTCAP} if spec.softcap else {}
        mod.forward(q, k, v, **kwargs)  # compile at this shape
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        rec["load_s"] = round(time.perf_counter() - t0, 1)
        rec["ms"] = []
        out.append(rec)
    for _ in range(rounds):  # interleaved rounds: clock drift hits every variant alike
        for rec in out:
            mod, kwargs = mods[rec["label"]], ({"softcap": SOFTCAP} if "softcap" in rec["label"] else {})
            rec["ms"].append(triton.testing.do_bench(lambda: mod.forward(q, k, v, **kwargs), warmup=warmup, rep=rep))
    plain = min(out[0]["ms"])
    for rec in out:
        rec["tflops"] = [flops / ms / 1e9 for ms in rec["ms"]]
        rec["ratio_to_plain"] = plain / min(rec["ms"])
        log(f"{rec['label']:<22} {min(rec['ms']):8.3f} ms  {max(rec['tflops']):6.1f} TF/s (rounds "
            f"{', '.join(f'{t:.1f}' for t in rec['tflops'])})  {rec['ratio_to_plain']:.3f}x plain  "
            f"checks {'PASS' if all(c['ok'] for c in rec['checks']) else 'FAIL'}  (load {rec['load_s']} s)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="render + compile each variant for sm_90 (no GPU)")
    ap.add_argument("--variants", default="off,half,quarter,all")
    ap.add_argument("--degree", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--rep", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    t0 = time.perf_counter()

    def log(line):
        print(f"[{time.perf_counter() - t0:6.1f} s] {line}", flush=True)

    rows = variants(args.variants.split(","), args.degree)
    results = {"torch": torch.__version__, "degree": args.degree}
    if args.dry_run:
        results["dry_run"] = dry_run(rows, log)
    else:
        results["gpu"] = torch.cuda.get_device_name()
        results["runs"] = gpu_run(rows, log, args.warmup, args.rep, args.rounds)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        path = Path(out) / ("scores_probe_sc_dry.json" if args.dry_run else "scores_probe_sc.json")
        path.write_text(json.dumps(results, indent=1, default=str))
        log(f"wrote {path}")


if __name__ == "__main__":
    main()
