"""Seventh session: the MLA prefill backward (head_dim 192, head_dim_v 128; issue 27: >= 0.9x cuDNN's backward in the
same run) at the bench row bwd-mla-d192v128-causal-s4k (causal, b4 h16 s4096, bf16): the work order of the gradient
kernels ([Note] MLA work order, GROUP_PROGRAMS) and the per-kernel split (preprocess, dK/dV, dQ).

    PYTHONPATH=$PWD python3 scripts/gpu_mla_bwd_s7.py            # H100, under ~90 s; one table; $OUT/gpu_mla_bwd_s7.md
    GPU_MLA_BWD_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_mla_bwd_s7.py   # the same code on the CPU interpreter, tiny
    PYTHONPATH=$PWD python3 scripts/gpu_mla_bwd_s7.py --ptxas    # no GPU: sm_90 registers / spills / shared per kernel

A candidate is the default spec's render with some module constants replaced (DKDV_BLOCK_N/M, DQ_BLOCK_M/N, each
kernel's warps and stages, GROUP_PROGRAMS: a group of the work order is the fewest (head, batch) pairs, a power of
two, with that many blocks; 1 is the grid order of the sixth session). Phases, each in child processes with
timeouts (a kernel that faults or hangs loses its row, never the table):
1. check (in parallel, 8 at a time; none starts after CHECK_BUDGET_S): each candidate's dq/dk/dv against the
   float64 reference, outputs NaN-filled, at shapes whose lengths are not multiples of any block (causal b3 h2
   Sq 200 / Sk 333: 6 pairs, a partial group; none gqa 2 S 257), then one untimed call at the bench shape (and,
   for the shapes table's candidates, at each of its masks: fills Triton's cache);
2. time (one child; restarted past a crash with the rest): SDPA cuDNN's backward, then each checked candidate:
   the whole backward, the preprocess alone (need_dq=need_dkdv=False) and its dK/dV and dQ launches (need_dq /
   need_dkdv, each less the preprocess); fagen.attention's backward (the product path: whatever module it
   resolves); then SHAPES: cuDNN and SHAPE_LABELS at other shapes.
   A candidate with `_streams` times the dK/dV launch and the dQ launch (each with its own preprocess) on two
   streams at once (round A's "2 streams": 351.5 TF/s against 359.8 on one stream; none in round B).
TF/s counts as fagen's bench does: 2.5 * 2 * B * H * S * S * (192 + 128) / 2 for the causal backward.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

DRY = os.environ.get("GPU_MLA_BWD_DRY") == "1"
PTXAS = "--ptxas" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
D, DV = 192, 128
B, H, S = (1, 2, 80) if DRY else (4, 16, 4096)
T0 = time.time()
CHECK_BUDGET_S = 50  # no check starts after this
BUDGET_S = 70  # no timing child starts after this; a running one is stopped at BUDGET_S + 25
# The product's constants ([Note] MLA backward steps: spec m128n128w8s2, dK/dV 32-query steps, dQ 64-key steps, both
# kernels at 3 stages; [Note] MLA work order: groups of 128 programs or more); candidates change some.
DEFAULT = dict(DKDV_BLOCK_N=128, DKDV_BLOCK_M=32, DKDV_NUM_WARPS=8, DKDV_NUM_STAGES=3,
               DQ_BLOCK_M=128, DQ_BLOCK_N=64, DQ_NUM_WARPS=8, DQ_NUM_STAGES=3, GROUP_PROGRAMS=128)
# the module constants a candidate may change
PATCHED = ("DKDV_BLOCK_N", "DKDV_BLOCK_M", "DKDV_NUM_WARPS", "DKDV_NUM_STAGES", "DQ_BLOCK_M", "DQ_BLOCK_N",
           "DQ_NUM_WARPS", "DQ_NUM_STAGES", "GROUP_PROGRAMS")


def cand(label, **kw):
    return label, {**DEFAULT, **kw}


# (label, constants), the most promising first: the checks stop starting at CHECK_BUDGET_S. At the bench shape the
# grid has 64 (head, batch) pairs of 32 blocks: group 64 is one group (every head's heaviest block first), group 1
# the sixth session's order (head after head).
CANDIDATES = (
    ("product", {}),  # the render as it ships, unpatched (128 programs: groups of 4 pairs at the bench shape)
    cand("s6 product", GROUP_PROGRAMS=1),  # the sixth session's: 341-347 TF/s there, 342.5 in round A
    cand("programs 64", GROUP_PROGRAMS=64),  # groups of 2 at the bench shape
    cand("programs 256", GROUP_PROGRAMS=256),  # of 8: round A's product (359.8; by the preprocess 360.0)
    cand("programs 512", GROUP_PROGRAMS=512),  # of 16 (round A 351.7)
    ("product again", {}),  # the product timed once more, last: the run's noise
)
if DRY:  # the interpreter is slow at d192: the rehearsal runs the default and two variants
    CANDIDATES = tuple(c for c in CANDIDATES if c[0] in ("product", "s6 product", "programs 256"))


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def source(consts: dict) -> tuple[object, str]:
    """(spec, the default bwd render with `consts` for the per-kernel constants)."""
    import fagen

    spec = fagen.KernelSpec(head_dim=D, head_dim_v=DV, mask="causal", dtype="bf16", direction="bwd",
                            **consts.get("_tiles", {}))
    src = fagen.generate(spec)
    for name, value in consts.items():
        if name.startswith("_"):  # a timing switch (_streams), not a constant
            continue
        text = f"tl.constexpr({value})" if name == "GROUP_PROGRAMS" else f"{value}"
        src, n = re.subn(rf"^{name} = .*$", f"{name} = {text}", src, count=1, flags=re.M)
        if n != 1:
            raise RuntimeError(f"{name} not in the render")
    return spec, src


def module(label: str, consts: dict, mask="causal", gqa=1):
    import fagen
    from fagen.runtime.loader import load_source

    spec = fagen.KernelSpec(head_dim=D, head_dim_v=DV, mask=mask, gqa=gqa, dtype="bf16", direction="bwd",
                            **consts.get("_tiles", {}))
    _, base = source(consts)  # the causal render's constants, patched into this spec's render
    src = fagen.generate(spec)
    for line in base.splitlines():
        if line.split(" = ")[0] in PATCHED:
            src = re.sub(rf"^{line.split(' = ')[0]} = .*$", line, src, count=1, flags=re.M)
    tag = "_".join(f"{v}" for n, v in consts.items() if not n.startswith("_")) or "product"
    return load_source(src, f"{spec.name}_mlabwd_{tag}")


# ---- child: check ----------------------------------------------------------------------------------------------
def child_check(label: str, consts: dict) -> dict:
    import torch

    from fagen.verify import reference

    dev = "cpu" if DRY else "cuda"
    gen = torch.Generator(device=dev).manual_seed(1)
    worst = 0.0
    # (mask, gqa, batch, sq, sk): causal at 3 batches of 2 heads (6 pairs of 2 or 3 blocks: one group, partial, of
    # the 64 pairs that GROUP_PROGRAMS 128 asks for; tests/test_mla_prefill.py checks several partial groups)
    shapes = ((("causal", 1, 3, 40, 61), ("none", 2, 1, 33, 33)) if DRY else
              (("causal", 1, 3, 200, 333), ("none", 2, 1, 257, 257)))
    for mask, gqa, nb, sq, sk in shapes:
        m = module(label, consts, mask, gqa)
        hq = 2 * gqa
        q = torch.randn(nb, hq, sq, D, device=dev, generator=gen).bfloat16()
        k = torch.randn(nb, hq // gqa, sk, D, device=dev, generator=gen).bfloat16()
        v = torch.randn(nb, hq // gqa, sk, DV, device=dev, generator=gen).bfloat16()
        do = torch.randn(nb, hq, sq, DV, device=dev, generator=gen).bfloat16()
        # NaN-filled outputs: a program that never runs leaves NaN (the work order is a permutation of the grid)
        m._new_out = lambda t: torch.full_like(t, float("nan"))
        out, lse = m.forward(q, k, v)
        got = m.backward(do, q, k, v, out, lse)
        ref_in = [t.double().requires_grad_() for t in (q, k, v)]
        ref_out, _ = reference.attention(*ref_in, mask=mask)
        ref_out.backward(do.double())
        for name, g, r in zip(("dq", "dk", "dv"), got, (t.grad for t in ref_in)):
            unit = max(1.0, r.abs().max().item())
            err = (g.double() - r).abs().max().item() / unit
            if not err < 2e-2:  # NaN fails too
                raise AssertionError(f"{name} {mask} gqa{gqa} sq{sq} sk{sk}: max err {err:.2e} / {unit:.1f}")
            worst = max(worst, err)
    # one untimed call at the bench shape: Triton's cache for the timing child (and at the other shapes' masks)
    m = module(label, consts)
    q, k, v, do = bench_inputs()
    out, lse = m.forward(q, k, v)
    m.backward(do, q, k, v, out, lse)
    if label in SHAPE_LABELS:
        for mask, gqa, nb, hq, s in {(x[0], x[1]): x for x in SHAPES}.values():  # one call per module
            m = module(label, consts, mask, gqa)
            q, k, v, do = (torch.randn(nb, h, s, d, device=dev, generator=gen).bfloat16()
                           for h, d in ((hq, D), (hq // gqa, D), (hq // gqa, DV), (hq, DV)))
            out, lse = m.forward(q, k, v)
            m.backward(do, q, k, v, out, lse)
    if not DRY:
        torch.cuda.synchronize()
    return {"err": worst}


def bench_inputs():
    import torch

    dev = "cpu" if DRY else "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, H, S, D, device=dev, generator=gen).bfloat16()
    k = torch.randn(B, H, S, D, device=dev, generator=gen).bfloat16()
    v = torch.randn(B, H, S, DV, device=dev, generator=gen).bfloat16()
    do = torch.randn(B, H, S, DV, device=dev, generator=gen).bfloat16()
    return q, k, v, do


def timed(fn) -> float:
    if DRY:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=50, rep=200)


# Other shapes, product against the sixth session's order and cuDNN (the modules of the checks: no new compile):
# (mask, gqa, batch, query heads, seq). cuDNN gets K/V repeated to the query heads under GQA (the same FLOPs).
SHAPES = (("causal", 1, 8, 16, 2048), ("causal", 1, 1, 16, 8192), ("none", 2, 4, 16, 4096))
SHAPE_LABELS = ("product", "programs 256", "s6 product")
if DRY:
    SHAPES = (("causal", 1, 2, 2, 64), ("none", 2, 1, 4, 48))


def child_shape(i: int) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mask, gqa, nb, hq, s = SHAPES[i]
    dev = "cpu" if DRY else "cuda"
    gen = torch.Generator(device=dev).manual_seed(5)
    q, k, v, do = (torch.randn(nb, h, s, d, device=dev, generator=gen).bfloat16()
                   for h, d in ((hq, D), (hq // gqa, D), (hq // gqa, DV), (hq, DV)))
    flops = 2.5 * 2 * nb * hq * s * s * (D + DV) / (2 if mask == "causal" else 1)
    row = {"label": f"shape {i}", "shape": f"{mask} gqa{gqa} b{nb} h{hq} s{s}"}
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in
                  (q, k.repeat_interleave(gqa, 1), v.repeat_interleave(gqa, 1)))
    with sdpa_kernel(SDPBackend.MATH if DRY else SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=mask == "causal")
    row["cudnn"] = flops / timed(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)) / 1e9
    for label in SHAPE_LABELS:
        m = module(label, dict(CANDIDATES)[label], mask, gqa)
        out, lse = m.forward(q, k, v)
        row[label] = flops / timed(lambda: m.backward(do, q, k, v, out, lse)) / 1e9
    print("ROW " + json.dumps(row), flush=True)


# ---- child: time -----------------------------------------------------------------------------------------------
def child_time(labels: list[str]) -> None:
    """One JSON line per row, flushed: the parent keeps the rows of a child that dies."""
    import torch
    import torch.nn.functional as F

    q, k, v, do = bench_inputs()
    flops = 2.5 * 2 * B * H * S * S * (D + DV) / 2
    by_label = dict(CANDIDATES)
    for label in labels:
        if label == "sdpa-cudnn":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
            with sdpa_kernel(SDPBackend.MATH if DRY else SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
            t = timed(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True))
            print("ROW " + json.dumps({"label": label, "ms": t, "tf": flops / t / 1e9}), flush=True)
            continue
        if label.startswith("shape "):  # "shape <i>": the product and the sixth session's order at SHAPES[i]
            child_shape(int(label.split()[1]))
            continue
        if label == "fagen.attention":  # the product path: resolve() picks the module, autograd runs its backward
            import fagen
            from fagen.runtime import resolve

            qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
            o = fagen.attention(qg, kg, vg, mask="causal")
            t = timed(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True))
            name = resolve.resolve(qg, kg, vg, "causal", False).NAME
            print("ROW " + json.dumps({"label": label, "ms": t, "tf": flops / t / 1e9, "module": name}), flush=True)
            continue
        m = module(label, by_label[label])
        out, lse = m.forward(q, k, v)
        scale = D ** -0.5
        t = timed(lambda: m.backward(do, q, k, v, out, lse))
        if by_label[label].get("_streams") and not DRY:  # the dQ kernel on a side stream beside the dK/dV kernel
            side = torch.cuda.Stream()

            def both():
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                m._launch_backward(do, q, k, v, out, lse, scale, None, None, None, need_dq=False)
                with torch.cuda.stream(side):
                    m._launch_backward(do, q, k, v, out, lse, scale, None, None, None, need_dkdv=False)
                main.wait_stream(side)
            t = timed(both)
        t_kv = timed(lambda: m._launch_backward(do, q, k, v, out, lse, scale, None, None, None, need_dq=False))
        t_q = timed(lambda: m._launch_backward(do, q, k, v, out, lse, scale, None, None, None, need_dkdv=False))
        t_pre = timed(lambda: m._launch_backward(do, q, k, v, out, lse, scale, None, None, None, need_dq=False,
                                                 need_dkdv=False))
        extra = {"ms_pre": t_pre}
        if label == "product":  # the module's forward: a training step runs it (bwd-module tiles)
            extra["ms_fwd"] = timed(lambda: m.forward(q, k, v))
        print("ROW " + json.dumps({"label": label, "ms": t, "tf": flops / t / 1e9, "ms_kv": t_kv, "ms_q": t_q,
                                   **extra}), flush=True)


# ---- parent ----------------------------------------------------------------------------------------------------
def spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def phase_check(timeout_s: float, parallel: int) -> dict:
    results, pending, running = {}, list(CANDIDATES), {}
    while pending or running:
        while pending and len(running) < parallel:
            label, _ = pending.pop(0)
            if not DRY and time.time() - T0 > CHECK_BUDGET_S:
                results[label] = {"fail": "skipped: check budget"}
                continue
            running[label] = (spawn(["--check", label]), time.time())
        time.sleep(0.2)
        for label, (p, t0) in list(running.items()):
            if p.poll() is None and time.time() - t0 < timeout_s:
                continue
            if p.poll() is None:
                p.kill()
                out = p.communicate()[0]
                results[label] = {"fail": f"timeout after {timeout_s:.0f} s"}
            else:
                out = p.communicate()[0]
                line = [x for x in out.splitlines() if x.startswith("CHECK ")]
                results[label] = json.loads(line[-1][6:]) if line else {
                    "fail": (out.strip().splitlines() or ["no output"])[-1][:160]}
            log(f"check {label}: {results[label]}")
            del running[label]
    return results


def phase_time(labels: list[str], timeout_s: float) -> dict:
    rows, todo = {}, list(labels)
    while todo and (DRY or time.time() - T0 < BUDGET_S):
        p = spawn(["--time", *todo])
        t0 = time.time()
        lines = []
        import threading

        def read():
            for line in p.stdout:
                lines.append(line)
                if line.startswith("ROW "):
                    r = json.loads(line[4:])
                    rows[r["label"]] = r
                    log(f"time {r['label']}: " + (f"{r['tf']:.1f} TF/s" if "tf" in r else json.dumps(r)))
        th = threading.Thread(target=read, daemon=True)
        th.start()
        while p.poll() is None and time.time() - t0 < timeout_s and (DRY or time.time() - T0 < BUDGET_S + 25):
            time.sleep(0.2)
        killed = p.poll() is None
        if killed:
            p.kill()
            p.wait()
        th.join(5)
        done = [x for x in todo if x in rows]
        left = [x for x in todo if x not in rows]
        if left and not killed and p.returncode != 0:  # the first unfinished one broke the child: skip it
            rows[left[0]] = {"label": left[0], "fail": "".join(lines[-3:]).strip()[-160:] or "crashed"}
            left = left[1:]
        elif left:
            for x in left:
                rows[x] = {"label": x, "fail": "timing budget"}
            left = []
        todo = left
        del done
    return rows


def ptxas_table() -> None:
    """sm_90 registers / spills / shared memory of each candidate's dK/dV and dQ kernels (CPU, no GPU)."""
    import tempfile
    from pathlib import Path

    from fagen.aot import artifacts
    from fagen.runtime.modules import import_module

    print("| candidate | dK/dV regs | spills (words) | KB | dQ regs | spills | KB |\n|---|---|---|---|---|---|---|")
    only = [a for a in sys.argv[1:] if not a.startswith("--")]
    for label, consts in CANDIDATES:
        if only and label not in only:
            continue
        spec, src = source(consts)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, f"mlabwd_{abs(hash(label))}.py")
            with open(path, "w") as f:
                f.write(src)
            cells = []
            try:
                with artifacts._compiled_mode():
                    mod = import_module(Path(path), f"mlabwd_{abs(hash(label))}", filename=f"{spec.name}.py")
                    for entry in mod.AOT_KERNELS:
                        if entry["name"] not in ("_attn_bwd_dkdv", "_attn_bwd_dq"):
                            continue
                        _, _, rec = artifacts._compile_kernel(spec, "sm_90", entry)
                        cells += [str(rec["registers"]), str(rec["spills"]), f"{rec['shared'] / 1024:.0f}"]
            except Exception as e:  # noqa: BLE001
                cells = [f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:120]}"]
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    if "--check" in sys.argv:
        label = sys.argv[sys.argv.index("--check") + 1]
        print("CHECK " + json.dumps(child_check(label, dict(CANDIDATES)[label])), flush=True)
        return
    if "--time" in sys.argv:
        child_time(sys.argv[sys.argv.index("--time") + 1:])
        return
    if PTXAS:
        ptxas_table()
        return
    import torch

    if not DRY and not torch.cuda.is_available():
        sys.exit("gpu_mla_bwd_s7.py needs a CUDA GPU (GPU_MLA_BWD_DRY=1 rehearses it on the CPU)")
    log(f"{'CPU rehearsal' if DRY else torch.cuda.get_device_name()}  torch {torch.__version__}")
    checks = phase_check(timeout_s=600 if DRY else 45, parallel=2 if DRY else 8)
    ok = [label for label, _ in CANDIDATES if "err" in checks.get(label, {})]
    # fagen.attention last: its module may compile in the timing child (Triton's cache usually has it from phase 1)
    shapes = [f"shape {i}" for i in range(len(SHAPES))] if set(SHAPE_LABELS) <= set(ok) else []
    rows = phase_time(["sdpa-cudnn", *ok, "fagen.attention", *shapes], timeout_s=600 if DRY else 60)
    peer = rows.get("sdpa-cudnn", {}).get("tf")
    flops = 2.5 * 2 * B * H * S * S * (D + DV) / 2
    case = f"causal b{B} h{H} s{S} d{D}v{DV} bf16"
    lines = [f"MLA backward (seventh session), {case} ({'CPU rehearsal' if DRY else torch.cuda.get_device_name()})",
             "", "dK/dV and dQ ms: each kernel alone, less the preprocess (pre ms, timed alone)",
             "", "| candidate | constants (dK/dV n m w s; dQ m n w s; group) | check | TF/s | vs cuDNN | ms | pre ms "
             "| dK/dV ms | dQ ms |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    nan = float("nan")
    for label, c in (("sdpa-cudnn", None), ("fagen.attention", None), *CANDIDATES):
        r, chk = rows.get(label, {}), checks.get(label, {})
        const = r.get("module", "") if c is None else "(the render)" if not c else (
            f"n{c['DKDV_BLOCK_N']} m{c['DKDV_BLOCK_M']} w{c['DKDV_NUM_WARPS']} s{c['DKDV_NUM_STAGES']}; "
            f"m{c['DQ_BLOCK_M']} n{c['DQ_BLOCK_N']} w{c['DQ_NUM_WARPS']} s{c['DQ_NUM_STAGES']}; "
            f"p{c['GROUP_PROGRAMS']}"
            + (" (dQ on a side stream)" if c.get("_streams") else ""))
        check = "" if c is None else (f"PASS {chk['err']:.1e}" if "err" in chk else f"FAIL {chk.get('fail', '?')}")
        if "tf" in r:
            ratio = f"{r['tf'] / peer:.2f}x" if peer else "-"
            pre = r.get("ms_pre", nan)
            lines.append(f"| {label} | {const} | {check} | {r['tf']:.1f} | {ratio} | {r['ms']:.3f} | {pre:.3f} | "
                         f"{r.get('ms_kv', nan) - pre:.3f} | {r.get('ms_q', nan) - pre:.3f} |")
        else:
            lines.append(f"| {label} | {const} | {check} | - | - | - | - | - | {r.get('fail', '')[:80]} |")
    r = rows.get("product", {})
    if "ms_fwd" in r:
        lines.append(f"\nproduct: the bwd module's forward (m128n128w8s2) {flops / 2.5 / r['ms_fwd'] / 1e9:.1f} "
                     f"TF/s, {r['ms_fwd']:.3f} ms; forward + backward {r['ms_fwd'] + r['ms']:.3f} ms")
    shape_rows = [rows[x] for x in shapes if "cudnn" in rows.get(x, {})]
    if shape_rows:
        lines += ["", "Other shapes (TF/s and the ratio to cuDNN; cuDNN with K/V repeated under GQA):", "",
                  "| shape | cuDNN | " + " | ".join(SHAPE_LABELS) + " |", "|---|---:|" + "---:|" * len(SHAPE_LABELS)]
        for r in shape_rows:
            lines.append(f"| {r['shape']} | {r['cudnn']:.1f} | "
                         + " | ".join(f"{r[x]:.1f} ({r[x] / r['cudnn']:.2f}x)" for x in SHAPE_LABELS) + " |")
    best = max((r for lb, r in rows.items() if lb not in ("sdpa-cudnn", "fagen.attention") and "tf" in r),
               key=lambda r: r["tf"], default=None)
    if best:
        lines.append(f"\nbest: {best['label']} {best['tf']:.1f} TF/s"
                     + (f" ({best['tf'] / peer:.2f}x cuDNN)" if peer else ""))
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_mla_bwd_s7.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
