"""Issue 15 follow-up on the H100: why the score-switch rows miss their targets. Nothing here changes fagen.

For each switch row of `fagen bench --suite scores`, fagen alone: a few block configs (spec overrides), for the
softcap a variant whose `_tanh` is the PTX `tanh.approx.f32` instruction instead of the template's exp2 form (the
generated source is edited in memory, as the mutants are, and checked against the float64 reference like every
bench record), and the backward with and without the softcap (its dK/dV kernel spills on sm_90). Each line: the
bench's median ms with the L2 flushed (`do_bench`), the TF/s counted as the bench counts them, and `piped`: the
mean ms of 50 calls issued back to back (no flush, host overhead overlapped), to tell host time from GPU time.

    python benchmarks/scores_probe.py --json $OUT/probe.json              # the first probe
    python benchmarks/scores_probe.py --set extra --json $OUT/probe2.json # smaller gpt-oss blocks, softcap configs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from fagen.bench.cases import BenchOptions, CaseContext, Prepared
from fagen.bench.check import check
from fagen.bench.impls import prepare_fagen
from fagen.bench.timing import time_prepared
from fagen.bench.workloads import BenchCase, flops, make_case, score_rows
from fagen.codegen.render import generate
from fagen.runtime.loader import load_source

TANH_EXP2 = "    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)  # 2 / ln 2\n"
TANH_PTX = ('    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, '
            'is_pure=True, pack=1)\n')


def configured(case: BenchCase, m: int, n: int, w: int, s: int) -> BenchCase:
    return dataclasses.replace(case, overrides=(("block_m", m), ("block_n", n), ("num_warps", w), ("num_stages", s)))


def ptx_tanh(case: BenchCase, cc: CaseContext) -> Prepared:
    spec, _ = case.spec(cc.device)
    source = generate(spec)
    if TANH_EXP2 in source:
        source = source.replace(TANH_EXP2, TANH_PTX)
    elif "tanh.approx.f32" not in source:
        raise RuntimeError("the template's _tanh changed; update TANH_EXP2")
    # else: since 2026-11-25 half-precision kernels take tanh.approx.f32 themselves ([Note] Approximate tanh), so
    # this variant is the shipped kernel; benchmarks/scores_probe_h15.py compares the tanh variants.
    module = load_source(source, f"{spec.name}_ptx_tanh")
    return Prepared(lambda s: module.forward(s.q, s.k, s.v, **s.kwargs, **s.scores), spec=spec.name + "+ptx-tanh")


def piped(prepared: Prepared, cc: CaseContext, n: int = 50) -> float:
    s = cc.sets[0]
    with torch.no_grad():
        prepared.fn(s)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            prepared.fn(s)
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--skip-bwd", action="store_true")
    ap.add_argument("--set", choices=["main", "extra"], default="main",
                    help="main: the first probe; extra: smaller blocks for the gpt-oss row, more softcap configs")
    args = ap.parse_args()
    device = torch.device("cuda")
    opts = BenchOptions(device="cuda", impls=("fagen",), sets=3)
    rows = {c.name: c for c in score_rows()}
    plan: list[tuple[str, BenchCase, object]] = []
    win, cap, oss = rows["fwd-d128-win4k-s32k"], rows["fwd-d128-softcap-causal-s16k"], rows[
        "fwd-gptoss-d64-win128-sink-s8k"]
    if args.set == "extra":
        for cfg in [None, (64, 32, 4, 3), (64, 32, 4, 4), (64, 32, 2, 3), (32, 32, 2, 3), (32, 32, 4, 3),
                    (64, 16, 4, 3), (128, 32, 4, 3), (128, 32, 8, 3)]:
            plan.append((f"gptoss {cfg or 'default'}", configured(oss, *cfg) if cfg else oss, prepare_fagen))
        plan.append(("softcap ptx-tanh", cap, ptx_tanh))
        for cfg in [(128, 128, 8, 2), (64, 128, 4, 3), (128, 64, 8, 3)]:
            plan.append((f"softcap ptx-tanh {cfg}", configured(cap, *cfg), ptx_tanh))
        args.skip_bwd = True
    else:
        for cfg in [None, (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)]:
            plan.append((f"win4k {cfg or 'default'}", configured(win, *cfg) if cfg else win, prepare_fagen))
        plan.append(("softcap default", cap, prepare_fagen))
        plan.append(("softcap ptx-tanh", cap, ptx_tanh))
        plan.append(("softcap ptx-tanh (128, 64, 4, 3)", configured(cap, 128, 64, 4, 3), ptx_tanh))
        plan.append(("softcap (128, 64, 4, 3)", configured(cap, 128, 64, 4, 3), prepare_fagen))
        for cfg in [None, (64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (64, 32, 4, 3)]:
            plan.append((f"gptoss {cfg or 'default'}", configured(oss, *cfg) if cfg else oss, prepare_fagen))
    if not args.skip_bwd:
        d128 = dict(head_dim=128, mask="causal", batch=1, heads_q=16, heads_kv=16, seq_q=16384, seq_k=16384,
                    direction="bwd")
        plan.append(("bwd causal s16k plain", make_case("bwd-plain", **d128), prepare_fagen))
        plan.append(("bwd causal s16k softcap 50", make_case("bwd-cap", **d128, softcap=50.0), prepare_fagen))
    results = []
    contexts: dict[tuple, CaseContext] = {}
    for label, case, prep in plan:
        t0 = time.perf_counter()
        key = (case.name, case.direction)
        if key not in contexts:
            contexts.clear()
            torch.cuda.empty_cache()
            contexts[key] = CaseContext(case, device, opts.sets)
        cc = contexts[key]
        cc.case = case  # same shapes and inputs, other overrides
        rec = {"label": label, "case": case.name, "overrides": [list(o) for o in case.overrides]}
        try:
            prepared = prep(case, cc)
            rec["spec"] = prepared.spec
            if case.direction.value == "fwd":
                rec["check"], msg, _ = check("fagen", prepared, cc)
                rec["check_msg"] = msg[:200]
            times = time_prepared(prepared, cc, opts)
            rec.update(times)
            rec["tflops"] = flops(case) / times["ms"] / 1e9
            if case.direction.value == "fwd":
                rec["piped_ms"] = piped(prepared, cc)
        except Exception as e:  # noqa: BLE001 - report and go on
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}" if str(e) else type(e).__name__
        rec["wall_s"] = round(time.perf_counter() - t0, 1)
        results.append(rec)
        if "error" in rec:
            print(f"{label:<40} ERROR {rec['error']}", flush=True)
        else:
            extra = (f"  piped {rec['piped_ms']:.4g} ms  check {rec['check']}" if "piped_ms" in rec else
                     f"  fwd+bwd {rec['fwdbwd_ms']:.4g} ms")
            print(f"{label:<40} {rec['ms']:8.4g} ms {rec['tflops']:7.1f} TF/s{extra}  ({rec['wall_s']} s)"
                  + (f"  {rec['check_msg']}" if rec.get("check_msg") else ""), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f,
                          indent=1)


if __name__ == "__main__":
    main()
