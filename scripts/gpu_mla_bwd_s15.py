"""Fifteenth session: issue 27's MLA prefill backward (d_qk 192, d_v 128, causal b4 h16 s4096 bf16) against cuDNN,
and lab/gluon_bwd_mla.py (a warp-specialized Gluon backward at 192/128: one kernel for dK, dV and dQ) beside it.

    PYTHONPATH=$PWD python3 scripts/gpu_mla_bwd_s15.py     # H100, under 60 s; table on stdout and $OUTX/table.txt

Phases (scripts/_phases.py: each a child process under a wall-clock limit; a hang loses that phase only):
1. check: the Gluon lab kernel's dq/dk/dv (outputs NaN-filled) against float64 at lengths off every block:
   causal b2 h2 Sq 200 / Sk 333, causal S 333, none gqa 2 S 257; the worst error relative to max(1, max|ref|).
2. time: cuDNN (SDPA), the product's backward (the module fagen resolves for the spec, as the bench runs it) and
   the Gluon lab kernel (whole backward: preprocess, kernel, conversion; and its main kernel alone), PASSES
   passes, each pass every row once in a rotated order, do_bench per row; per pass the ratio of each row to
   cuDNN of the same pass, reported as median [min, max] over the passes (the card moves 5-15% pass to pass at its
   power cap: docs/serving.md, fifteenth session).
TF/s counts as fagen's bench: 2.5 * 2 * B * H * S^2 * (192 + 128) / 2.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
D, DV = 192, 128
B, H, S = 4, 16, 4096
PASSES = int(os.environ.get("MLABWD_PASSES", "14"))
T0 = float(os.environ.get("MLABWD_T0", time.time()))  # the parent's start: the children's budget counts from it
LINES: list[str] = []


def out(msg: str) -> None:
    LINES.append(msg)
    print(msg, flush=True)


def ref_fwd(q, k, v, causal, scale):
    """float32 torch forward: (out in q's dtype, natural-log lse), bottom-right causal."""
    import torch

    s = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float().repeat_interleave(q.shape[1] // k.shape[1], 1)) * scale
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        m = torch.arange(sk, device=q.device)[None, :] <= torch.arange(sq, device=q.device)[:, None] + (sk - sq)
        s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    o = torch.einsum("bhqk,bhkd->bhqd", p, v.float().repeat_interleave(q.shape[1] // k.shape[1], 1))
    return o.to(q.dtype), lse.contiguous()


# the Gluon lab kernel's variants: tag -> backward()'s keywords (fixed: the fixed-point dQ, int32 adds in any order,
# deterministic; QM_TMA 1 its row multipliers by TMA beside lse2 / delta, 0 plain loads; float: unordered float32
# adds; KSPLIT 1: each warpgroup's dQ_j^T over its own 64 keys, no dS^T exchange, two partials added; STAGES 3: three
# Q/dO ring slots; DQ_SLOTS 2: two dQ^T staging slots a warpgroup). Round A (02:37 UTC, H100) checked and timed
# fixed, fixedtma, fixedtma s3, fixedtma slots2 and float; round B the best of them beside KSPLIT.
ROUND = os.environ.get("MLABWD_ROUND", "B")
if ROUND == "A":
    GLUON = {"fixed": dict(fixed=True, QM_TMA=0), "fixedtma": dict(fixed=True, QM_TMA=1),
             "fixedtma s3": dict(fixed=True, QM_TMA=1, STAGES=3),
             "fixedtma slots2": dict(fixed=True, QM_TMA=1, DQ_SLOTS=2), "float": dict(fixed=False)}
    KERNEL_ROWS = ("fixed", "fixedtma", "float")  # also timed as the main kernel alone
else:
    GLUON = {"fixedtma": dict(fixed=True, QM_TMA=1), "ksplit": dict(fixed=True, QM_TMA=1, KSPLIT=1),
             "float": dict(fixed=False)}
    KERNEL_ROWS = ("ksplit", )
# checked only, expected to FAIL: the kernel broken on purpose (MUTANT 1: dK's scale left out), so that the float64
# check is seen red once on the GPU (round A: dk 8.0 / 13 / 8.1 relative error, FAIL as it should)
MUTANTS = {"mutant": dict(fixed=True, QM_TMA=1, MUTANT=1)} if ROUND == "A" else {}
# one program per tile instead of the persistent grid (the same build): timed where its variant passed
GRID_ROWS = {f"{t} grid": dict(GLUON[t], grid_all=True) for t in GLUON if t in ("fixedtma", "ksplit", "float")}


def phase_check(tag: str) -> None:
    import torch

    from fagen.verify import reference
    from lab import gluon_bwd_mla as glm

    kw = {**GLUON, **MUTANTS}[tag]
    gen = torch.Generator(device="cuda").manual_seed(1)
    worst, notes = 0.0, []
    for mask, gqa, nb, sq, sk in (("causal", 1, 2, 200, 333), ("causal", 1, 1, 333, 333), ("none", 2, 1, 257, 257)):
        hq = 2 * gqa
        q = torch.randn(nb, hq, sq, D, device="cuda", generator=gen).bfloat16()
        k = torch.randn(nb, 2, sk, D, device="cuda", generator=gen).bfloat16()
        v = torch.randn(nb, 2, sk, DV, device="cuda", generator=gen).bfloat16()
        do = torch.randn(nb, hq, sq, DV, device="cuda", generator=gen).bfloat16()
        scale = D ** -0.5
        o, lse = ref_fwd(q, k, v, mask == "causal", scale)
        t = time.time()
        got = glm.backward(do, q, k, v, o, lse, scale, mask == "causal", fill=True, **kw)
        again = glm.backward(do, q, k, v, o, lse, scale, mask == "causal", fill=True, **kw)
        torch.cuda.synchronize()
        same = all(torch.equal(x, y) for x, y in zip(got, again))
        ref_in = [x.double().requires_grad_() for x in (q, k, v)]
        ref_out, _ = reference.attention(*ref_in, mask=mask)
        ref_out.backward(do.double())
        errs = []
        for name, g, r in zip(("dq", "dk", "dv"), got, (x.grad for x in ref_in)):
            unit = max(1.0, r.abs().max().item())
            err = (g.double() - r).abs().max().item() / unit
            errs.append(f"{name} {err:.1e}")
            worst = max(worst, err) if err == err else float("inf")
        zero = ""
        if mask == "causal" and sq == sk:  # query 0 sees key 0 alone: dS = 0, so dQ's row is exactly 0
            z = got[0][:, :, 0].abs().max().item()
            zero = f", dq row 0 max {z:.1e}"
            if z != 0:
                notes.append("row 0 not exactly zero")
        if not same:
            notes.append(f"not repeatable at {mask} sq{sq}")
        out(f"check gluon {tag} {mask} gqa{gqa} b{nb} sq{sq} sk{sk}: {', '.join(errs)}; repeatable {same}{zero} "
            f"({time.time() - t:.1f} s)")
    out(f"CHECK gluon {tag} {'PASS' if worst < 2e-2 else 'FAIL'} worst {worst:.1e}" + (f" ({'; '.join(notes)})"
                                                                                     if notes else ""))


def phase_warm() -> None:
    """The product's modules compiled and run once at the bench shape (beside the check phase: Triton's and fagen's
    caches are warm for the time phase)."""
    import torch

    import fagen

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(B, H, S, D, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in range(2))
    v = torch.randn(B, H, S, DV, device="cuda", generator=gen).bfloat16().requires_grad_()
    o = fagen.attention(q, k, v, mask="causal")
    torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
    torch.cuda.synchronize()
    print(f"[{time.time() - T0:5.1f}s] warm: product compiled", flush=True)


def phase_time(gluon: list[str]) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    import fagen

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, S, D, device="cuda", generator=gen).bfloat16()
    k = torch.randn(B, H, S, D, device="cuda", generator=gen).bfloat16()
    v = torch.randn(B, H, S, DV, device="cuda", generator=gen).bfloat16()
    do = torch.randn(B, H, S, DV, device="cuda", generator=gen).bfloat16()
    flops = 2.5 * 2 * B * H * S * S * (D + DV) / 2
    scale = D ** -0.5
    rows = {}
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        oc = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
    rows["cudnn"] = lambda: torch.autograd.grad(oc, (qg, kg, vg), do, retain_graph=True)
    t = time.time()
    qp, kp, vp = (t_.detach().clone().requires_grad_() for t_ in (q, k, v))
    op = fagen.attention(qp, kp, vp, mask="causal")
    rows["product"] = lambda: torch.autograd.grad(op, (qp, kp, vp), do, retain_graph=True)
    rows["product"]()
    torch.cuda.synchronize()
    out(f"[{time.time() - T0:5.1f}s] product compiled/run in {time.time() - t:.1f} s")
    if gluon:
        from lab import gluon_bwd_mla as glm

        o, lse = ref_fwd_chunked(q, k, v, scale)
        for tag in gluon:
            kw = GLUON[tag]
            rows[f"gluon {tag}"] = (lambda kw=kw: glm.backward(do, q, k, v, o, lse, scale, True, **kw))
            rows[f"gluon {tag}"]()
            if tag in KERNEL_ROWS:  # the main kernel alone
                kern = glm.prepared(do, q, k, v, o, lse, scale, True, **kw)
                rows[f"gluon {tag} kernel"] = kern
                kern()
            for g_tag, g_kw in GRID_ROWS.items():
                if g_tag.startswith(tag + " "):
                    rows[f"gluon {g_tag}"] = (lambda kw=g_kw: glm.backward(do, q, k, v, o, lse, scale, True, **kw))
                    rows[f"gluon {g_tag}"]()
                    if tag in KERNEL_ROWS:
                        kern = glm.prepared(do, q, k, v, o, lse, scale, True, **g_kw)
                        rows[f"gluon {g_tag} kernel"] = kern
                        kern()
        torch.cuda.synchronize()
        out(f"[{time.time() - T0:5.1f}s] gluon compiled: {gluon}")
    names = list(rows)
    ms = {n: [] for n in names}
    for p in range(PASSES):
        order = names[p % len(names):] + names[:p % len(names)]
        for n in order:
            ms[n].append(do_bench(rows[n], warmup=10, rep=60))
        out(f"pass {p}: " + ", ".join(f"{n} {ms[n][-1]:.3f}" for n in names))
        if time.time() - T0 > 52:
            break
    out("")
    out(f"| row (causal b{B} h{H} s{S} 192/128 bf16) | median ms | TF/s | vs cuDNN per pass: median [min, max] |")
    out("|---|---:|---:|---|")
    for n in names:
        r = [a / b for a, b in zip(ms["cudnn"], ms[n])]
        med = statistics.median(ms[n])
        out(f"| {n} | {med:.3f} | {flops / med / 1e9:.1f} | {statistics.median(r):.3f}x "
            f"[{min(r):.3f}, {max(r):.3f}] |")


def ref_fwd_chunked(q, k, v, scale):
    """ref_fwd head by head (the bench shape's float32 scores would take 4 GB at once)."""
    import torch

    o = torch.empty(q.shape[:3] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        for h in range(0, q.shape[1], 4):
            o[b:b + 1, h:h + 4], lse[b:b + 1, h:h + 4] = ref_fwd(q[b:b + 1, h:h + 4], k[b:b + 1, h:h + 4],
                                                                 v[b:b + 1, h:h + 4], True, scale)
    return o, lse


def main() -> None:
    if "--phase" in sys.argv:
        name = sys.argv[sys.argv.index("--phase") + 1]
        if name.startswith("check-"):
            phase_check(name[6:].replace("_", " "))
        elif name == "warm":
            phase_warm()
        else:
            phase_time([x.replace("_", " ") for x in name.split("-")[1:] if x])
        return
    import subprocess

    from _phases import child_env, run_phase

    env = child_env("/tmp/mlabwd_cache", ROOT)
    env["MLABWD_T0"] = str(T0)
    script = os.path.abspath(__file__)
    # children at once: the product's compile (warm) and a check of each variant of the Gluon lab kernel
    names = ("warm", *(f"check-{t.replace(' ', '_')}" for t in (*GLUON, *MUTANTS)))
    kids = {n: subprocess.Popen([sys.executable, script, "--phase", n], env=env,
                                stdout=open(f"/tmp/mlabwd_{n}.log", "w"), stderr=subprocess.STDOUT) for n in names}
    for n, p in kids.items():
        try:
            p.wait(timeout=max(1, 32 - (time.time() - T0)))
        except subprocess.TimeoutExpired:
            p.kill()
            out(f"{n}: killed at {time.time() - T0:.0f} s")
        for line in open(f"/tmp/mlabwd_{n}.log").read().splitlines()[-8:]:
            out(f"{n}: {line}")
    ok = [t for t in GLUON if any(f"CHECK gluon {t} PASS" in s for s in LINES)]
    rc, _ = run_phase(script, "time-" + "-".join(t.replace(" ", "_") for t in ok), max(10, 58 - (time.time() - T0)),
                      env, on_line=lambda s: (LINES.append(s.rstrip()), print(s, end="", flush=True)))
    if rc != 0:
        out(f"time phase: {rc}")
    d = os.environ.get("OUTX") or os.environ.get("OUT")
    if d:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "table.txt"), "w") as f:
            f.write("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
