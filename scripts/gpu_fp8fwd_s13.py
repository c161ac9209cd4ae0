"""The fp8 (e4m3) Gluon forward, thirteenth session (issue 28), on an H100/H200: the host pass (transpose_v) and the
schedule. Each variant is checked against float64 on the dequantized inputs (scripts/gpu_fp8.py's check) and bit for
bit against the product; then TF/s at d128 B1 H16 s16k, causal and full: cuDNN's fp8 SDPA (the bench's cudnn-fp8
peer), fagen's bf16 forward and the fp8 rows (random inputs and the standard suite's own fp8 inputs) in one process,
PASSES passes whose row order is rotated from pass to pass, medians. Built on scripts/gpu_fp8fwd_s12.py. Round B (the
default; FP8FWD_ROUND=A for round A's rows) times in the standard suite's own measure (fagen.bench.timing.measure: the
rows' 3 input sets rotated, do_bench's L2 flush) with the product and bf16 through the bench's own preparers.

    PYTHONPATH=$PWD python3 scripts/gpu_fp8fwd_s13.py          # < 70 s on an H100; one table; $OUTX/gpu_fp8fwd_s13.md
    GPU_FP8_FWD_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_fp8fwd_s13.py   # any machine: sm_90 builds of every variant

Phases (each a child process with a timeout; scripts/_phases.py): build (a pool; fills triton's cache), check, time.
The harness is scripts/_fp8_timing.py's (fourteenth session; before, a copy of scripts/gpu_fp8fwd_s12.py's).
docs/hopper.md, "fp8 forward: the host pass and the schedule (thirteenth session)".
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_fp8_fwd_s7 as s7  # noqa: E402
import _fp8_timing as T  # noqa: E402

# name -> None (the product) or {"variant": GluonBackend.variant keys, "fields": spec fields, "patch": ((regex,
# replacement), ...) on the render, "masks": the masks it is built, checked and timed at (default both), "check_rows":
# s7.CHECKS-style rows (default: its first)}.
# Round A (thirteenth session): the host pass's levers (GluonBackend.variant fp8_pass_evict: transpose_v's V loads
# evict-first; fp8_vt_pad: Vt's row stride padded off the power of two, 16384 B at s16k, by 128 B), at the product's
# 2-slot ring and at 4 slots (the 4-slot pathology of the twelfth session), and the full mask's schedule through the
# tile counter (fp8_full_order 3: L2 sections of heads, 2: the plain order), full mask only. Every variant is timed on
# the standard suite's own inputs (BENCH_INPUTS: what the bench measures); TIMED also on random inputs.
MANY = ("none", 1, 2, 8, 1500, 1300, True)  # full mask, 192 tiles: more than the grid, lengths off the blocks
EVICT, PAD = {"fp8_pass_evict": 1}, {"fp8_vt_pad": 128}
VARIANTS = {
    "product": None,
    "product, 4 stages": {"fields": {"num_stages": 4}},
    "pass evict-first": {"variant": EVICT},
    "Vt stride +128": {"variant": PAD},
    "evict-first + stride +128": {"variant": {**EVICT, **PAD}},
    "4 stages, Vt stride +128": {"fields": {"num_stages": 4}, "variant": PAD},
    "4 stages, evict-first + stride +128": {"fields": {"num_stages": 4}, "variant": {**EVICT, **PAD}},
    # the pass's shape (diagnostic patches, full mask only): 128 keys a program, at 4 and 8 warps
    "pass 128 keys": {"patch": ((r"^TRANSPOSE_BLOCK_S = 64$", "TRANSPOSE_BLOCK_S = 128"), ), "masks": ("none", ),
                      "check_rows": (MANY, )},
    "pass 128 keys, 8 warps": {"patch": ((r"^TRANSPOSE_BLOCK_S = 64$", "TRANSPOSE_BLOCK_S = 128"),
                                         (r"PERM=_P_PERM, num_warps=4\)", "PERM=_P_PERM, num_warps=8)")),
                               "masks": ("none", ), "check_rows": (MANY, )},
    "full: counter, L2 sections": {"variant": {"fp8_full_order": 3}, "masks": ("none", ), "check_rows": (MANY, )},
    "full: counter, plain order": {"variant": {"fp8_full_order": 2}, "masks": ("none", ), "check_rows": (MANY, )},
}
# Round A (H100, /work/wt/results/fp8fwd-A.txt): on the bench's inputs (set 0 only) TF/s causal / full: product
# 864 / 854, evict 875 / 868, pad 861 / 867, evict + pad 876 / 874, 4 stages 888 / 860, 4 stages + pad 895 / 879, 4
# stages evict + pad 869 / 859; pass 128 keys 842, at 8 warps 822; counter (sections / plain) 847 / 848 (full);
# cudnn-fp8 824 / 941, bf16 625 / 582. Round B (ROUND "B", the default): the candidates in the bench's own measure
# (fagen.bench.timing.measure: do_bench's L2 flush, the 3 input sets rotated), the product through the bench's own
# prepare_fagen, bf16 through the bench's bf16 rows.
ROUND = os.environ.get("FP8FWD_ROUND", "B")
if ROUND == "B":
    VARIANTS = {n: VARIANTS[n] for n in ("product", "product, 4 stages", "pass evict-first", "Vt stride +128",
                                         "evict-first + stride +128", "4 stages, Vt stride +128",
                                         "4 stages, evict-first + stride +128")}
    for off in (64 << 10, (1 << 20) + (2 << 10)):  # diagnostics, random inputs only: Vt's base moved by off bytes
        VARIANTS[f"Vt at +{off} B"] = {"random_only": True, "patch": ((
            r"    vt = torch\.empty\(\(b, h, d, \(width \+ 15\) // 16 \* 16\), dtype=v\.dtype, device=v\.device\)"
            r"\[\.\.\., :width\]",
            f"    w16 = (width + 15) // 16 * 16\n    vt = torch.empty(b * h * d * w16 + {off}, dtype=v.dtype, "
            f"device=v.device)[{off}:].view(b, h, d, w16)[..., :width]"), )}
s7.VARIANTS = VARIANTS
TIMED = ("product", "product, 4 stages", "4 stages, Vt stride +128", "evict-first + stride +128")  # random inputs
D64 = ()
D64_ONLY = ()
EQUAL = {n: "product" for n in VARIANTS if n != "product"}
FULL = ()  # the product's GQA / window checks: main's, unchanged here
ALONE = ("product", "product, 4 stages")  # also timed with Vt made once
BENCH_INPUTS = tuple(VARIANTS)  # the standard suite's fp8 rows' own inputs
# transpose_v alone, timed at the full mask's turn (round A)
PASS_ALONE = ("product", "pass evict-first", "Vt stride +128", "pass 128 keys", "pass 128 keys, 8 warps")
PASSES = 7 if ROUND == "A" else 9
PHASE_TIMEOUT = {"build": 22, "check": 14, "time": 27} if ROUND == "A" else {"build": 20, "check": 12, "time": 31}
RANDOM = ("product", "pass evict-first") + tuple(n for n in VARIANTS if (VARIANTS[n] or {}).get("random_only"))
# round B: timed on random inputs (one set) too
BENCH_MS = (10, 50)  # round B: the bench's measure's warm-up and rep ms (the bench's own: 25, 100)
s7.PHASE_TIMEOUT = PHASE_TIMEOUT


def masks_of(name):
    return (VARIANTS[name] or {}).get("masks", s7.MASKS)


def check_cases():
    """(variant, head_dim, s7.CHECKS-style row, window) of every fp8 check; the product first at each shape."""
    cases = [("product", 128, c, None) for c in (s7.CHECKS[0], MANY)]  # first: the rows the others are compared with
    cases += [(n, 128, c, None) for n in VARIANTS if n != "product"
              for c in (VARIANTS[n] or {}).get("check_rows", (s7.CHECKS[0], ))]
    return cases + [(n, 128, c[:-1], c[-1]) for n in FULL for c in s7.PRODUCT_CHECKS]


def jobs():
    out = [(mask, n, 128, False, 1) for n in VARIANTS for mask in masks_of(n)]
    out += [(mask, n, d, w is not None, gqa) for n, d, (mask, gqa, *_), w in check_cases() if gqa > 1 or w]
    return list(dict.fromkeys(out))


s7.check_cases = check_cases
s7.jobs = jobs
FIRST = ("product", "product, 4 stages", "full: counter, L2 sections", "full: counter, plain order")  # the distinct
# attention kernels; the others differ in transpose_v only, and find them in triton's cache when built after them


def phase_build():
    """s7's build in two waves: bf16 and the distinct fp8 kernels, then the variants that share their kernel."""
    import multiprocessing as mp
    work = jobs()
    bf16 = [] if s7.DRY else [("bf16", m) for m in s7.MASKS]
    waves = (bf16 + [j for j in work if j[1] in FIRST], [j for j in work if j[1] not in FIRST])
    s7.log(f"== build: {sum(map(len, waves))} modules in two waves")
    with mp.get_context("spawn").Pool(max(2, min(12, (os.cpu_count() or 4) - 1)) if not s7.DRY else 2) as pool:
        for wave in waves:
            for msg in pool.imap_unordered(s7._job, wave):
                s7.log(msg)


def phase_check():
    """Every fp8 check (_fp8_timing.check_variants), the EQUAL variants bit for bit against the product."""
    T.check_variants(s7, check_cases(), EQUAL)


T_PHASE = time.time()


def _extra(rows, mask, flops, q8, g):
    """Round A's rows beyond the standard ones: the pass alone (GB/s of V read and Vt written, full mask) and the
    product at H33 (33 x 128 = 32 x 132 tiles: no partial last wave; H16 has 15.5 waves)."""
    import torch
    import gpu_fp8
    b, h, s, d = s7.TIME_SHAPE
    if mask != "none":
        return
    for name in PASS_ALONE:
        m = s7.module(mask, name)
        rows.append((f"pass alone (GB/s): {name}", mask, 2 * q8[2][0].numel() * 1e3,
                     lambda m=m, v=q8[2][0]: m.transpose_v(v)))
    q33 = [gpu_fp8.quantize(torch.randn((b, 33, s, d), generator=g, device="cuda").clamp(-4, 4), False)
           for _ in range(3)]
    m = s7.module(mask, "product")
    rows.append(("fp8 product, H33 (whole waves)", mask, flops * 33 / h, lambda m=m, t=q33: m.forward(
        t[0][0], t[1][0], t[2][0], q_descale=t[0][1], k_descale=t[1][1], v_descale=t[2][1])))


def phase_time():
    """Round A: TF/s (4 B H S^2 D, halved causal; do_bench medians over PASSES rotated passes): cudnn-fp8 and the
    variants on the bench row's inputs, fagen bf16 and the TIMED fp8 rows on random inputs, the V transpose counted,
    the ALONE kernels without it, the pass alone and H33 (_fp8_timing.standard_rows, time_rows, emit_times)."""
    import torch
    import triton
    b, h, s, d = s7.TIME_SHAPE
    s7.log(f"== time: B{b} H{h} S{s}; {torch.cuda.get_device_name()}; torch {torch.__version__}, "
           f"triton {triton.__version__}")
    rows = T.standard_rows(s7, bench_inputs=BENCH_INPUTS, timed=TIMED, alone=ALONE, masks_of=masks_of, extra=_extra)
    times = T.time_rows(s7, rows, PASSES, PHASE_TIMEOUT["time"], T_PHASE)
    T.emit_times(s7, rows, times, noted=("fp8 ", "bench inputs: "))


def phase_time_bench():
    """Round B: TF/s in the standard suite's measure (fagen.bench.timing.measure over the rows' 3 input sets, rotated;
    do_bench's L2 flush), PASSES passes with the row order rotated, medians: cudnn-fp8 and fagen's product through
    the bench's own preparers, fagen bf16 on the bench's bf16 rows, the fp8 variants called as prepare_fagen does."""
    import torch
    import triton
    from fagen.bench import impls, peer_cudnn_fp8 as peer
    from fagen.bench.cases import CaseContext
    from fagen.bench.timing import measure
    from fagen.bench.workloads import standard_suite
    b, h, s, d = s7.TIME_SHAPE
    s7.log(f"== time (bench measure): B{b} H{h} S{s}; {torch.cuda.get_device_name()}; torch {torch.__version__}, "
           f"triton {triton.__version__}")
    dev = torch.device("cuda")
    suite = {c.name: c for c in standard_suite()}
    skip = T.skipped()
    rows, keep = [], []  # (label, mask, flops, (call(i), n_sets))

    def fp8_call(m):
        def call(st):
            sc = {n: t for n, t in st.scores.items() if n not in ("k_scale", "v_scale")}
            return m.forward(st.q, st.k, st.v, k_descale=st.scores["k_scale"], v_descale=st.scores["v_scale"],
                             **st.kwargs, **sc)[0]
        return call
    for mask in s7.MASKS:
        flops = T.flops_of(s7, mask)
        word = "causal" if mask == "causal" else "full"
        try:
            cc = CaseContext(suite[f"fwd-fp8-d128-{word}-s16k"], dev, 3)
            bcc = CaseContext(suite[f"fwd-d128-{word}-s16k"], dev, 3)
            keep += [cc, bcc]
        except Exception as e:  # noqa: BLE001
            s7.emit(section="time", variant="setup", mask=mask, value="ERROR",
                    note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
            continue

        def cudnn(cc=cc, mask=mask):
            prepared = peer.prepare_cudnn_fp8(cc.case, cc)
            T.check_peer(s7, mask, prepared, cc)
            return prepared.fn
        makers = [("cudnn-fp8", cudnn, cc),
                  ("fagen bf16 (bench row)", lambda bcc=bcc: impls.prepare_fagen(bcc.case, bcc).fn, bcc),
                  ("fp8 product (bench's prepare_fagen)", lambda cc=cc: impls.prepare_fagen(cc.case, cc).fn, cc)]
        makers += [(f"fp8 {n}", lambda n=n, mask=mask: fp8_call(s7.module(mask, n)), cc) for n in VARIANTS
                   if n not in skip and mask in masks_of(n) and not (VARIANTS[n] or {}).get("random_only")]
        for label, make, c in makers:  # one failing row (a peer that declines) leaves the others
            try:
                fn = make()
                rows.append((label, mask, flops, (lambda i, fn=fn, c=c: fn(c.sets[i]), len(c.sets))))
            except Exception as e:  # noqa: BLE001
                s7.emit(section="time", variant=label, mask=mask, value="ERROR",
                        note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
                traceback.print_exc(limit=3)
    try:  # random inputs (round A: the product 12% low there, evict-first + stride +128 not): one set, per tensor
        import gpu_fp8
        g = torch.Generator(device="cuda").manual_seed(1)
        q8 = [gpu_fp8.quantize(torch.randn((b, h, s, d), generator=g, device="cuda"), False) for _ in range(3)]
        keep.append(q8)
        for mask in s7.MASKS:
            flops = T.flops_of(s7, mask)
            for n in RANDOM:
                if n not in skip:
                    m = s7.module(mask, n)
                    rows.append((f"random inputs: fp8 {n}", mask, flops, (lambda i, m=m, t=q8: m.forward(
                        t[0][0], t[1][0], t[2][0], q_descale=t[0][1], k_descale=t[1][1], v_descale=t[2][1]), 1)))
    except Exception as e:  # noqa: BLE001
        s7.emit(section="time", variant="random inputs", mask="-", value="ERROR",
                note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    with torch.no_grad():
        times = T.time_rows(s7, rows, PASSES, PHASE_TIMEOUT["time"], T_PHASE, warm=lambda fn: fn[0](0),
                            measure=lambda fn: measure(*fn, dev, *BENCH_MS), margin=(1.15, 1.5))
    T.emit_times(s7, rows, times, bf16="fagen bf16 (bench row)", noted=("fp8 ", "random inputs: "), digits=3,
                 base=lambda label: "random inputs: fp8 product" if label.startswith("random") else "fp8 product")


def main():
    timer = phase_time if ROUND == "A" else phase_time_bench
    T.main(s7, __file__, {"build": phase_build, "check": phase_check, "time": timer}, PHASE_TIMEOUT, check_cases,
           VARIANTS, "gpu_fp8fwd_s13.md", "/tmp/fagen-cache-gpu-fp8fwd-s13")


if __name__ == "__main__":
    main()
