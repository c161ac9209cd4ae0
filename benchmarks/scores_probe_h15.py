"""Issue 15, second probe (2026-11-25, H100): the softcap tanh variants, the windowed d64 tile rule and cheap
window-4096 loop variants. Nothing here changes fagen; variants are edits of the generated source in memory (as
the mutants are), each bench record checked against the float64 reference as in `fagen bench`.

    python benchmarks/scores_probe_h15.py --json $OUT/probe.json

Parts: `acc` the tanh variants' own error over [-12, 12] against float64 tanh; `cap` the softcap row (d128 causal
bf16 s16k, cap 50) per tanh variant plus the Triton causal baseline; `prop` the property checks of
tests/test_scores.py::test_approximate_tanh_matches_reference per variant (fp16/bf16 forward, bf16 backward);
`bwd` the backward (d128 causal bf16 s8k) plain, softcap approx and exact; `win` the window rows: gpt-oss layer with the old and new default tiles, a d64 window 4096 with both tiles, and
the d128 window 4096 s32k with loop and TMA variants plus the Triton causal s32k baseline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import traceback

import torch
import triton
import triton.language as tl

import fagen
from fagen.bench.cases import BenchOptions, CaseContext, Prepared
from fagen.bench.check import check
from fagen.bench.impls import prepare_fagen
from fagen.bench.timing import time_prepared
from fagen.bench.workloads import flops, make_case, score_rows
from fagen.codegen.render import generate
from fagen.runtime.loader import load_source
from fagen.verify.properties import check_backward, check_forward
from fagen.verify.strategies import Problem

APPROX_LINE = ('        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, '
               'is_pure=True, pack=1)\n')
FLAG = "_TANH_APPROX = tl.constexpr(not _INTERPRET and torch.version.hip is None)"
RATIONAL = """        xc = tl.minimum(tl.maximum(x, -7.90531110763549805), 7.90531110763549805)
        x2 = xc * xc
        pn = x2 * -2.76076847742355e-16 + 2.00018790482477e-13
        pn = x2 * pn + -8.60467152213735e-11
        pn = x2 * pn + 5.12229709037114e-08
        pn = x2 * pn + 1.48572235717979e-05
        pn = x2 * pn + 6.37261928875436e-04
        pn = x2 * pn + 4.89352455891786e-03
        pn = xc * pn
        qd = x2 * 1.19825839466702e-06 + 1.18534705686654e-04
        qd = x2 * qd + 2.26843463243900e-03
        qd = x2 * qd + 4.89352518554385e-03
        t = tl.math.fdiv(pn, qd)
"""
VARIANTS = {
    "exact": None,
    "approx.f32": APPROX_LINE,
    "approx.f16x2": ('        t = tl.inline_asm_elementwise("tanh.approx.f16x2 $0, $1;", "=r,r", [x.to(tl.float16)], '
                     'dtype=tl.float16, is_pure=True, pack=2).to(tl.float32)\n'),
    "approx.bf16x2": ('        t = tl.inline_asm_elementwise("tanh.approx.bf16x2 $0, $1;", "=r,r", [x.to(tl.bfloat16)], '
                      'dtype=tl.bfloat16, is_pure=True, pack=2).to(tl.float32)\n'),
    "rational": RATIONAL,
    "ex2+rcp": ('        t = 1.0 - 2.0 * tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", '
                '[tl.math.exp2(x * 2.8853900817779268) + 1.0], dtype=tl.float32, is_pure=True, pack=1)\n'),
}


def variant_source(spec, variant: str) -> str:
    src = generate(spec)
    assert APPROX_LINE in src and FLAG in src, "the template's _tanh changed; update the probe"
    if VARIANTS[variant] is None:
        return src.replace(FLAG, "_TANH_APPROX = tl.constexpr(False)")
    return src.replace(APPROX_LINE, VARIANTS[variant])


def variant_module(spec, variant: str):
    return load_source(variant_source(spec, variant), f"{spec.name}_tanh_{variant.replace('.', '_').replace('+', '_')}")


# -- acc: the tanh variants alone -------------------------------------------------------------------------------
@triton.jit
def _tanh_kernel(X, Y, n, V: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0)
    if V == 0:
        t = 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)
    elif V == 1:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    elif V == 2:
        t = tl.inline_asm_elementwise("tanh.approx.f16x2 $0, $1;", "=r,r", [x.to(tl.float16)], dtype=tl.float16,
                                      is_pure=True, pack=2).to(tl.float32)
    elif V == 3:
        t = tl.inline_asm_elementwise("tanh.approx.bf16x2 $0, $1;", "=r,r", [x.to(tl.bfloat16)], dtype=tl.bfloat16,
                                      is_pure=True, pack=2).to(tl.float32)
    elif V == 4:
        xc = tl.minimum(tl.maximum(x, -7.90531110763549805), 7.90531110763549805)
        x2 = xc * xc
        pn = x2 * -2.76076847742355e-16 + 2.00018790482477e-13
        pn = x2 * pn + -8.60467152213735e-11
        pn = x2 * pn + 5.12229709037114e-08
        pn = x2 * pn + 1.48572235717979e-05
        pn = x2 * pn + 6.37261928875436e-04
        pn = x2 * pn + 4.89352455891786e-03
        pn = xc * pn
        qd = x2 * 1.19825839466702e-06 + 1.18534705686654e-04
        qd = x2 * qd + 2.26843463243900e-03
        qd = x2 * qd + 4.89352518554385e-03
        t = tl.math.fdiv(pn, qd)
    else:
        t = 1.0 - 2.0 * tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r",
                                                  [tl.math.exp2(x * 2.8853900817779268) + 1.0], dtype=tl.float32,
                                                  is_pure=True, pack=1)
    tl.store(Y + offs, t, mask=offs < n)


def part_acc(log):
    x = torch.cat([torch.linspace(-12, 12, 1 << 23, device="cuda"),
                   torch.logspace(-8, 1.1, 1 << 20, device="cuda"), -torch.logspace(-8, 1.1, 1 << 20, device="cuda")])
    want = torch.tanh(x.double())
    out = []
    for v, name in enumerate(VARIANTS):
        y = torch.empty_like(x)
        _tanh_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), V=v, BLOCK=1024)
        err = (y.double() - want).abs()
        rel = err / want.abs().clamp_min(1e-30)
        mid = (x.abs() > 0.25) & (x.abs() < 4)
        signed = ((y.double() - want) / want.abs().clamp_min(1e-30))[mid]
        rec = dict(variant=name, max_abs=err.max().item(), max_rel=rel[x != 0].max().item(),
                   max_rel_mid=rel[mid].max().item(), mean_rel_mid=signed.mean().item(),
                   max_rel_small=rel[(x.abs() < 0.25) & (x != 0)].max().item())
        out.append(rec)
        log(f"acc {name:<14} max_abs {rec['max_abs']:.3g} max_rel {rec['max_rel']:.3g} "
            f"|x| in (0.25,4): max_rel {rec['max_rel_mid']:.3g} mean signed rel {rec['mean_rel_mid']:.3g}; "
            f"|x| < 0.25 max_rel {rec['max_rel_small']:.3g}")
    return out


# -- timing helpers -----------------------------------------------------------------------------------------------
OPTS = BenchOptions(device="cuda", impls=("fagen",), sets=3)


def bench(label, case, prep, contexts, log, do_check=True):
    t0 = time.perf_counter()
    key = (case.name, case.direction)
    if key not in contexts:
        contexts.clear()
        torch.cuda.empty_cache()
        contexts[key] = CaseContext(case, torch.device("cuda"), OPTS.sets)
    cc = contexts[key]
    cc.case = case
    rec = {"label": label, "case": case.name, "overrides": [list(o) for o in case.overrides]}
    try:
        prepared = prep(case, cc)
        rec["spec"] = prepared.spec
        if do_check:
            rec["check"], msg, _ = check("fagen", prepared, cc)
            rec["check_msg"] = msg[:200]
        rec.update(time_prepared(prepared, cc, OPTS))
        rec["tflops"] = flops(case) / rec["ms"] / 1e9
    except Exception as e:  # noqa: BLE001 - report and go on
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}" if str(e) else type(e).__name__
    rec["wall_s"] = round(time.perf_counter() - t0, 1)
    if "error" in rec:
        log(f"{label:<44} ERROR {rec['error']}")
    else:
        log(f"{label:<44} {rec['ms']:8.4g} ms {rec['tflops']:7.1f} TF/s  fwdbwd {rec.get('fwdbwd_ms')}  "
            f"check {rec.get('check')}  "
            f"[{rec['spec']}] ({rec['wall_s']} s) {rec.get('check_msg', '')}")
    return rec


def source_prep(edit, tag):
    def prep(case, cc):
        spec, _ = case.spec(cc.device)
        src = edit(generate(spec))
        module = load_source(src, f"{spec.name}_{tag}")
        return Prepared(lambda s: module.forward(s.q, s.k, s.v, **s.kwargs, **s.scores), spec=f"{spec.name}+{tag}")
    return prep


def tanh_prep(variant):
    def prep(case, cc):
        spec, _ = case.spec(cc.device)
        module = variant_module(spec, variant)
        return Prepared(lambda s: module.forward(s.q, s.k, s.v, **s.kwargs, **s.scores), spec=f"{spec.name}+{variant}")
    return prep


def configured(case, m, n, w, s):
    return dataclasses.replace(case, overrides=(("block_m", m), ("block_n", n), ("num_warps", w), ("num_stages", s)))


# -- prop: property checks per tanh variant ----------------------------------------------------------------------
def approx_problems(decode=False):
    sq, sk = (3 if decode else 257), 300
    return [Problem(batch=2, heads_kv=2, seq_q=sq, seq_k=sk, magnitude=m, softcap=cap, seed=i)
            for i, (cap, m) in enumerate((c, m) for c in (0.5, 2.0, 5.0, 30.0) for m in (1.0, 4.0, 16.0))]


def part_prop(variants, log):
    out = []
    for variant in variants:
        for dtype, direction in (("fp16", "fwd"), ("bf16", "fwd"), ("bf16", "bwd")):
            spec = fagen.KernelSpec(head_dim=128, mask="causal", gqa=2, dtype=dtype, direction=direction,
                                    softcap=True)
            rec = dict(variant=variant, dtype=dtype, direction=direction, failures=[], max_err=0.0, max_lse_err=0.0)
            t0 = time.perf_counter()
            try:
                module = variant_module(spec, variant)
                for p in approx_problems():
                    try:
                        o = (check_backward if direction == "bwd" else check_forward)(module, spec, p, "cuda")
                        rec["max_err"] = max(rec["max_err"], float(getattr(o, "max_err", 0.0) or 0.0))
                        rec["max_lse_err"] = max(rec["max_lse_err"], float(getattr(o, "max_lse_err", 0.0) or 0.0))
                    except AssertionError as e:
                        rec["failures"].append(f"cap {p.softcap} mag {p.magnitude}: {str(e).splitlines()[0][:160]}")
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rec["wall_s"] = round(time.perf_counter() - t0, 1)
            out.append(rec)
            log(f"prop {variant:<14} {dtype} {direction}: {len(rec['failures'])} of 12 failed, max_err "
                f"{rec['max_err']:.3g} max_lse_err {rec['max_lse_err']:.3g} ({rec['wall_s']} s) "
                f"{rec.get('error', '')} {rec['failures'][:3]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--parts", default="acc,cap,win,bwd,prop")
    ap.add_argument("--prop-variants", default="approx.f32,approx.f16x2,rational")
    args = ap.parse_args()
    parts = args.parts.split(",")
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}

    def log(line):
        print(line, flush=True)

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    rows = {c.name: c for c in score_rows(baselines=True)}
    contexts: dict = {}
    for part in parts:
        try:
            if part == "acc":
                results["acc"] = part_acc(log)
            elif part == "cap":
                recs = [bench("causal s16k triton (baseline)", rows["fwd-d128-causal-s16k-triton"], prepare_fagen,
                              contexts, log, do_check=False)]
                cap = rows["fwd-d128-softcap-causal-s16k"]
                recs.append(bench("softcap default (committed: approx.f32)", cap, prepare_fagen, contexts, log))
                for v in ("exact", "approx.f16x2", "rational", "ex2+rcp"):
                    recs.append(bench(f"softcap {v}", cap, tanh_prep(v), contexts, log))
                results["cap"] = recs
            elif part == "win":
                oss = rows["fwd-gptoss-d64-win128-sink-s8k"]
                recs = [bench("gptoss default (rule: m64n32w4s3)", oss, prepare_fagen, contexts, log),
                        bench("gptoss m128n128w4s3 (old default)", configured(oss, 128, 128, 4, 3), prepare_fagen,
                              contexts, log)]
                w64 = make_case("fwd-d64-win4k-s16k", head_dim=64, mask="causal", batch=1, heads_q=16, heads_kv=16,
                                seq_q=16384, seq_k=16384, window=(4095, 0))
                recs += [bench("d64 win4k s16k default (rule)", w64, prepare_fagen, contexts, log),
                         bench("d64 win4k s16k m128n128w4s3", configured(w64, 128, 128, 4, 3), prepare_fagen,
                               contexts, log)]
                win = rows["fwd-d128-win4k-s32k"]
                recs.append(bench("causal s32k triton (baseline)", rows["fwd-d128-causal-s32k-triton"],
                                  prepare_fagen, contexts, log, do_check=False))
                recs.append(bench("win4k s32k default", win, prepare_fagen, contexts, log))

                def two_loops(src):
                    a = "offs_m, offs_n, offs_d, lo, w_lo, len_q"
                    mid = src.index("offs_m, offs_n, offs_d, w_lo, w_hi, len_q")
                    start = src.rindex("    acc, m_i, l_i = _fwd_inner(", 0, mid)
                    end = src.index("UPCAST, TMA)\n", mid) + len("UPCAST, TMA)\n")
                    assert a in src
                    return (src[:start] + src[end:]).replace(a, "offs_m, offs_n, offs_d, lo, w_hi, len_q")

                def no_tma(src):
                    assert "\nTMA = True" in src
                    return src.replace("\nTMA = True", "\nTMA = False")

                recs.append(bench("win4k s32k 2 loops (left edge + interior masked)", win,
                                  source_prep(two_loops, "twoloops"), contexts, log))
                recs.append(bench("win4k s32k no TMA", win, source_prep(no_tma, "notma"), contexts, log))
                results["win"] = recs
            elif part == "bwd":
                d128 = dict(head_dim=128, mask="causal", batch=1, heads_q=16, heads_kv=16, seq_q=8192, seq_k=8192,
                            direction="bwd")
                plain, capped = make_case("bwd-plain-s8k", **d128), make_case("bwd-cap-s8k", **d128, softcap=50.0)

                def bwd_prep(variant):
                    def prep(case, cc):
                        spec, _ = case.spec(cc.device)
                        module = variant_module(spec, variant)
                        return Prepared(lambda s: module.attention(s.q, s.k, s.v, **s.kwargs, **s.scores),
                                        spec=f"{spec.name}+{variant}")
                    return prep

                results["bwd"] = [bench("bwd causal s8k plain", plain, prepare_fagen, contexts, log, do_check=False),
                                  bench("bwd causal s8k softcap 50 (committed: approx.f32)", capped, prepare_fagen,
                                        contexts, log, do_check=False),
                                  bench("bwd causal s8k softcap 50 exact", capped, bwd_prep("exact"), contexts, log,
                                        do_check=False)]
            elif part == "prop":
                results["prop"] = part_prop(args.prop_variants.split(","), log)
        except Exception:  # noqa: BLE001
            log(f"part {part} FAILED:\n{traceback.format_exc()}")
        save()


if __name__ == "__main__":
    main()
