"""Twentieth session: issue 27's MLA prefill backward (d_qk 192, d_v 128, causal b4 h16 s4096 bf16; >= 0.9x cuDNN
in the same run) on the H200: a one-kernel Triton backward (lab/triton_bwd_mla_fused.py: the dK/dV program adds its
dQ part in int32 fixed point, then a convert kernel; 5 matmuls of work against the product pair's 7).

    PYTHONPATH=$PWD python3 scripts/gpu_mlabwd_s20.py --round A   # H200, under 50 s; table on stdout, $OUT/table.txt
    PYTHONPATH=$PWD python3 scripts/gpu_mlabwd_s20.py --dry-run   # CPU: every kernel built for sm_90 (ptxas table),
                                                                  # then the same flow on the interpreter, tiny shapes

Phases (child processes under wall-clock limits: a kernel that faults or hangs loses its row, never the table):
1. check, every candidate at once: dq/dk/dv against float64, outputs NaN-filled (a program that never ran fails),
   at causal gqa 1 b3 h16 Sq 208 / Sk 336 (the bench shape's Triton specialization), causal and none gqa 2 b1 hq 4
   Sq 257 / Sk 333 (Sq != Sk, off every block); causal S 208: dQ's row 0 (one key) exactly 0; Sk 1 causal and
   none: every row sees at most one key, dQ = dK = 0 exactly; two calls give the same bits; a mutant (the convert
   leaves the unit out of dQ's last 64 columns) must fail;
2. time: cuDNN (SDPA), fagen.attention's backward (autograd), the product's module (m.backward) and each checked
   candidate, plus pieces, in passes, each pass every row once in a shuffled order (the row before matters on the
   H200: docs/serving.md, nineteenth session); per pass each row's ratio to cuDNN and to the product's module of the
   same pass, median [q1, q3] and [min, max]; "b2b" rows: 10 calls back to back between two events. Before the
   passes, at the bench shape: the candidates' dq against the product's (max |diff| / max |dq|) and two calls' bits.
TF/s as fagen's bench: 2.5 * 2 * B * H * S^2 * (192 + 128) / 2. Exit 1 when a check fails (the mutant aside).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
DRY = "--dry-run" in sys.argv or os.environ.get("MLABWD20_DRY") == "1"
if DRY:
    os.environ["MLABWD20_DRY"] = "1"
    os.environ.setdefault("TRITON_INTERPRET", "1")
ROUND = sys.argv[sys.argv.index("--round") + 1] if "--round" in sys.argv else os.environ.get("MLABWD20_ROUND", "A")
os.environ["MLABWD20_ROUND"] = ROUND
D, DV = 192, 128
B, H, S = (1, 2, 64) if DRY else (4, 16, 4096)
T0 = float(os.environ.get("MLABWD20_T0", time.time()))
WALL_S = 50
CHECK_S = 30
LAB = os.path.join(ROOT, "lab", "triton_bwd_mla_fused.py")

# candidates: label: (keyword arguments of the lab's backward, source edits of the lab file); those in SHORT check
# the float64 shapes only (they differ from a fully checked one in the pipeline's depth alone)
CANDS = {
    "A": {
        "fused s3": ({}, ()),
        "fused s2": ({"stages": 2}, ()),
        "fused tma s3": ({"tma_add": True}, ()),
        "fused tma s2": ({"tma_add": True, "stages": 2}, ()),
    },
    "B": {  # round A: the pointer adds 5.7 ms a fused kernel, TMA adds 3.2: where the TMA variant's time goes
        "fused tma s3": ({"tma_add": True}, ()),
        # diagnostics (wrong dQ: timed only, never checked): the same bytes stored, not reduce-added; and the adds of
        # dQ's first 128 columns only (2/3 of the traffic; the last 64 columns' dot leaves too)
        "diag tma store": ({"tma_add": True}, (("DescLo.atomic_add([row_head, start_m]", "DescLo.store([row_head, start_m]"),
                                               ("DescHi.atomic_add([row_head + D_LO", "DescHi.store([row_head + D_LO"))),
        "diag tma lo only": ({"tma_add": True}, (("DescHi.atomic_add([row_head + D_LO, start_m], _round_i32(dq2_t * qm[None, :], UPCAST))",
                                                  "dq2_t = dq2_t  # (the dot, unused, leaves)"), )),
    },
}[ROUND]
SHORT = ("fused s2", "fused tma s2")
DIAG = ("diag tma store", "diag tma lo only")  # timed, not checked (their dQ is wrong on purpose)
LEVER = "product MLA_FUSED_DQ"  # the lever in the product: the render with MLA_FUSED_DQ on (its fast launches)
MUTANT = ({}, (("tl.trans(a2.to(tl.float32) * f[None, :])", "tl.trans(a2.to(tl.float32) * scale)"), ))
PIECES = {"A": ("fused s3", "fused tma s3"), "B": ("fused tma s3", )}[ROUND]  # the first: [zero], [pre] (bound + preprocess), [main], [conv]; the others [main]
B2B = {"A": ("cudnn", "product", "fused s3", "product MLA_FUSED_DQ"),
       "B": ("cudnn", "product", "fagen.attention")}[ROUND]
FA_LEVER = False  # a row of fagen.attention's backward with the lever on (not run: the lever lost 2.6x in round A)
WITH_LEVER = ROUND == "A"  # the lever in the product (pointer adds) timed: round A only
PASSES = 60


def out(msg: str) -> None:
    print(msg, flush=True)


def dev():
    return "cpu" if DRY else "cuda"


_MODS = {}


def lab(label: str):
    """The lab module with the candidate's (or the mutant's) source edits, imported from a file of its own."""
    edits = MUTANT[1] if label == "mutant" else CANDS[label][1]
    if edits not in _MODS:
        src = open(LAB).read()
        for old, new in edits:
            if src.count(old) != 1:
                raise RuntimeError(f"{old!r} not once in the lab file")
            src = src.replace(old, new)
        path = LAB
        if edits:
            path = os.path.join(tempfile.mkdtemp(), f"mlabwd20_{len(_MODS)}.py")
            with open(path, "w") as f:
                f.write(src)
        spec = importlib.util.spec_from_file_location(f"mlabwd20_lab_{len(_MODS)}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _MODS[edits] = mod
    return _MODS[edits]


def kwargs(label: str) -> dict:
    return dict(MUTANT[0] if label == "mutant" else CANDS[label][0])


def product(mask="causal", gqa=1, fused=False):
    """The product's bwd module; fused: rendered with MLA_FUSED_DQ on ([Note] MLA one-kernel backward)."""
    import fagen
    from fagen.backends import triton as triton_backend
    from fagen.codegen import render
    from fagen.runtime.loader import load_source

    spec = fagen.KernelSpec(head_dim=D, head_dim_v=DV, mask=mask, gqa=gqa, dtype="bf16", direction="bwd")
    old = triton_backend.MLA_FUSED_DQ
    triton_backend.MLA_FUSED_DQ = fused
    render._cache_clear()
    try:
        src = fagen.generate(spec)
    finally:
        triton_backend.MLA_FUSED_DQ = old
        render._cache_clear()
    if fused and "_launch_backward_fused" not in src:
        raise RuntimeError("MLA_FUSED_DQ on, but the render has no fused backward")
    return load_source(src, f"{spec.name}_mlabwd20{'_fx' if fused else ''}")


def backward_fn(label: str, mask="causal", gqa=1, nan=False):
    """f(do, q, k, v, o, lse) -> (dq, dk, dv) of a row."""
    import torch

    new = (lambda t: torch.full_like(t, float("nan"))) if nan else None
    if label in ("product", LEVER):
        m = product(mask, gqa, fused=label == LEVER)
        if nan:
            m._new_out = new
        return m.backward
    mod, kw = lab(label), kwargs(label)
    return lambda do, q, k, v, o, lse: mod.backward(do, q, k, v, o, lse, causal=mask == "causal", new_out=new, **kw)


def ref_fwd(q, k, v, causal, scale):
    """float32 torch forward: (out in q's dtype, natural-log lse), bottom-right causal, GQA by repeat."""
    import torch

    g = q.shape[1] // k.shape[1]
    s = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float().repeat_interleave(g, 1)) * scale
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        m = torch.arange(sk, device=q.device)[None, :] <= torch.arange(sq, device=q.device)[:, None] + (sk - sq)
        s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    o = torch.einsum("bhqk,bhkd->bhqd", p, v.float().repeat_interleave(g, 1))
    return o.to(q.dtype), lse.contiguous()


def ref_fwd_chunked(q, k, v):
    import torch

    o = torch.empty(q.shape[:3] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        for h in range(0, q.shape[1], 4):
            o[b, h:h + 4], lse[b, h:h + 4] = (x[0] for x in ref_fwd(q[b:b + 1, h:h + 4], k[b:b + 1, h:h + 4],
                                                                    v[b:b + 1, h:h + 4], True, D ** -0.5))
    return o, lse


def bench_inputs():
    import torch

    gen = torch.Generator(device=dev()).manual_seed(0)
    return tuple(torch.randn(B, H, S, d, device=dev(), generator=gen).bfloat16() for d in (D, D, DV, DV))


# ---- child: check ----------------------------------------------------------------------------------------------
# (mask, gqa, batch, query heads, Sq, Sk) by build group: one child process per (candidate, group), so the builds
# run in parallel (the lab's kernels do not specialize on the lengths: one fused build a group)
GROUPS = {
    "c1": (("causal", 1, 3, 16, 208, 336), ("causal", 1, 1, 16, 208, 208), ("causal", 1, 1, 4, 40, 1)),
    "c2": (("causal", 2, 1, 4, 257, 333), ),
    "n2": (("none", 2, 1, 4, 257, 333), ),
    "n1": (("none", 1, 1, 4, 40, 1), ),
}
DRY_SHAPES = {"c1": (("causal", 1, 3, 2, 48, 80), ("causal", 1, 1, 2, 48, 48), ("causal", 1, 1, 2, 40, 1)),
              "c2": (("causal", 2, 1, 4, 45, 61), ), "n2": (("none", 2, 1, 4, 45, 61), ),
              "n1": (("none", 1, 1, 2, 40, 1), )}


def check_jobs() -> list[tuple[str, str]]:
    """(label, group) of every check child: the product the bench shape's group only, SHORT candidates and the
    mutant without the one-key groups' extra builds."""
    jobs = [("product", "c1")]
    for label in (*(c for c in CANDS if c not in DIAG), *((LEVER, ) if WITH_LEVER else ())):
        jobs += [(label, g) for g in (("c1", "c2", "n2") if label in SHORT else GROUPS)]
    return jobs + [("mutant", "c1")]


def child_check(label: str, group: str) -> None:
    import torch

    from fagen.verify import reference

    gen = torch.Generator(device=dev()).manual_seed(1)
    worst, errs = 0.0, []
    shapes = (DRY_SHAPES if DRY else GROUPS)[group]
    if label == "product" or label in SHORT or label == "mutant":
        shapes = shapes[:1]
    for mask, gqa, nb, hq, sq, sk in shapes:
        f = backward_fn(label, mask, gqa, nan=True)
        q = torch.randn(nb, hq, sq, D, device=dev(), generator=gen).bfloat16()
        k = torch.randn(nb, hq // gqa, sk, D, device=dev(), generator=gen).bfloat16()
        v = torch.randn(nb, hq // gqa, sk, DV, device=dev(), generator=gen).bfloat16()
        do = torch.randn(nb, hq, sq, DV, device=dev(), generator=gen).bfloat16()
        o, lse = ref_fwd(q, k, v, mask == "causal", D ** -0.5)
        got = f(do, q, k, v, o, lse)
        tag = f"{mask[0]}{gqa} {sq}/{sk}:"
        if sk == 1:  # every row sees at most one key: dS = 0, dQ = dK = 0 exactly
            z = max(got[0].abs().max().item(), got[1].abs().max().item())
            errs.append(f"{tag} zeros {z:.0e}")
            if z != 0:
                worst = float("inf")
            continue
        if sq == sk:  # dQ's row 0 sees one key; and two calls give the same bits
            z = got[0][:, :, 0].abs().max().item()
            errs.append(f"{tag} dq0 {z:.0e}")
            if z != 0:
                worst = float("inf")
            again = f(do, q, k, v, o, lse)
            same = all(torch.equal(a, b) for a, b in zip(got, again))
            errs.append("bits " + ("same" if same else "DIFFER"))
            if not same:
                worst = float("inf")
            continue
        ref_in = [t.double().requires_grad_() for t in (q, k, v)]
        ref_out, _ = reference.attention(*ref_in, mask=mask)
        ref_out.backward(do.double())
        e3 = []
        for g, r in zip(got, (t.grad for t in ref_in)):
            err = (g.double() - r).abs().max().item() / max(1.0, r.abs().max().item())
            err = err if err == err else float("inf")  # NaN: a program that never ran
            e3.append(f"{err:.1e}")
            worst = max(worst, err)
        errs.append(f"{tag} " + "/".join(e3))
    if worst < 2e-2 and group == "c1":  # one untimed call at the bench shape: the timing child's build is cached
        f = backward_fn(label)
        q, k, v, do = bench_inputs()
        f(do, q, k, v, do, torch.zeros(q.shape[:3], device=dev()))
        if not DRY:
            torch.cuda.synchronize()
    out("CHECK " + json.dumps({"label": f"{label} {group}", "worst": worst, "errs": " ".join(errs)}))


# ---- child: time -----------------------------------------------------------------------------------------------
def child_time(labels: list[str]) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fagen

    q, k, v, do = bench_inputs()
    rows = {}
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH if DRY else SDPBackend.CUDNN_ATTENTION):
        oc = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
    rows["cudnn"] = lambda: torch.autograd.grad(oc, (qg, kg, vg), do, retain_graph=True)
    qp, kp, vp = (t.detach().clone().requires_grad_() for t in (q, k, v))
    op = fagen.attention(qp, kp, vp, mask="causal")
    rows["fagen.attention"] = lambda: torch.autograd.grad(op, (qp, kp, vp), do, retain_graph=True)
    if FA_LEVER:  # fagen.attention's path with the lever on: the render with MLA_FUSED_DQ resolved and loaded
        from fagen.backends import triton as triton_backend
        from fagen.codegen import render
        from fagen.runtime import resolve

        triton_backend.MLA_FUSED_DQ = True
        render._cache_clear()
        resolve._module.cache_clear()  # its memos (load() keys on the render state too)
        resolve._FAST.clear()
        qf, kf, vf = (t.detach().clone().requires_grad_() for t in (q, k, v))
        of = fagen.attention(qf, kf, vf, mask="causal")
        triton_backend.MLA_FUSED_DQ = False
        render._cache_clear()
        resolve._module.cache_clear()
        resolve._FAST.clear()
        rows["fagen.attention MLA_FUSED_DQ"] = lambda: torch.autograd.grad(of, (qf, kf, vf), do, retain_graph=True)
        got = torch.autograd.grad(of, (qf, kf, vf), do, retain_graph=True)
        ref = torch.autograd.grad(op, (qp, kp, vp), do, retain_graph=True)
        out("fagen.attention with MLA_FUSED_DQ against without (dq 0: the lever did not run): " + " ".join(
            f"{n} {((g.float() - r.float()).abs().max() / r.float().abs().max()).item():.1e}"
            for n, g, r in zip(("dq", "dk", "dv"), got, ref)))
    o, lse = ref_fwd_chunked(q, k, v)
    args = (do, q, k, v, o, lse)
    m = product()
    rows["product"] = lambda: m.backward(*args)
    launch = m._launch_backward
    largs = (*args, D ** -0.5, None, None, None)
    rows["product [pre+dK/dV]"] = lambda: launch(*largs, need_dq=False)
    rows["product [pre+dQ]"] = lambda: launch(*largs, need_dkdv=False)
    ref = m.backward(*args)
    for label in labels:
        if label == LEVER:
            m_on = product(fused=True)
            rows[label] = (lambda m_on=m_on: m_on.backward(*args))
        else:
            mod, kw = lab(label), kwargs(label)
            rows[label] = (lambda mod=mod, kw=kw: mod.backward(*args, **kw))
        got = rows[label]()
        again = rows[label]()
        same = all(torch.equal(a, b) for a, b in zip(got, again))
        diffs = " ".join(f"{n} {((g.float() - r.float()).abs().max() / r.float().abs().max()).item():.1e}"
                         for n, g, r in zip(("dq", "dk", "dv"), got, ref))
        out(f"bench shape, {label} against the product: {diffs}; two calls: {'same bits' if same else 'DIFFER'}")
        if label in PIECES:
            sq_pad = -(-S // mod.PRE_BLOCK_M) * mod.PRE_BLOCK_M
            bufs = (torch.empty((3, B, H, sq_pad), dtype=torch.float32, device=dev()),
                    torch.zeros((B, H, D, sq_pad), dtype=torch.int32, device=dev()))
            mod.backward(*args, bufs=bufs, **kw)
            for piece in (mod.PARTS if label == PIECES[0] else ("main", )):  # the others: as the first
                rows[f"{label} [{piece}]"] = (lambda mod=mod, kw=kw, p=piece, bufs=bufs:
                                              mod.backward(*args, parts=(p, ), bufs=bufs, **kw))
    for label in B2B:
        if label in rows:
            rows[f"{label} b2b"] = rows[label]
    for f in rows.values():
        f()
    if not DRY:
        torch.cuda.synchronize()
    out(f"[{time.time() - T0:5.1f}s] time: {len(rows)} rows ready")
    if DRY:
        def bench(f):
            t = time.perf_counter()
            f()
            return (time.perf_counter() - t) * 1e3
    else:
        from triton.testing import do_bench

        def bench(f):
            return do_bench(f, warmup=3, rep=25)

    def back_to_back(f, n=10):
        if DRY:
            return bench(f)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            f()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n
    names = list(rows)
    shuffle = random.Random(20)
    for p in range(2 if DRY else PASSES):
        order = shuffle.sample(names, len(names))
        ms = {n: (back_to_back if n.endswith(" b2b") else bench)(rows[n]) for n in order}
        out("PASS " + json.dumps({n: ms[n] for n in names}))
        if time.time() - T0 > WALL_S - 3:
            break


# ---- parent ----------------------------------------------------------------------------------------------------
def spawn(args: list[str], env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def run_gpu() -> int:
    from _phases import child_env, run_phase

    env = child_env("/tmp/mlabwd20_cache", ROOT)
    env["MLABWD20_T0"] = str(T0)
    if DRY:
        env["TRITON_INTERPRET"] = "1"
    kids = {f"{lb} {g}": spawn(["--check", lb, g], env) for lb, g in check_jobs()}
    kids["warm"] = spawn(["--warm"], env)
    checks, rc = {}, 0
    for lb, p in kids.items():
        try:
            text = p.communicate(timeout=900 if DRY else max(1, CHECK_S - (time.time() - T0)))[0]
        except subprocess.TimeoutExpired:
            p.kill()
            text = p.communicate()[0] + f"\nkilled at {time.time() - T0:.0f} s"
        line = [x for x in text.splitlines() if x.startswith("CHECK ")]
        if line:
            checks[lb] = json.loads(line[-1][6:])
            ok = checks[lb]["worst"] < 2e-2
            out(f"check {lb}: {'PASS' if ok else 'FAIL'} worst {checks[lb]['worst']:.1e} ({checks[lb]['errs']})")
        else:
            ok = False
            out(f"check {lb}: FAIL {' | '.join(text.strip().splitlines()[-3:])[-400:]}")
        if lb.startswith("mutant"):
            if ok:
                out("the mutant PASSED: the check cannot fail")
                rc = 1
            else:
                out("(the mutant failed, as it must)")
        elif lb != "warm" and not ok:
            rc = 1
    out(f"[{time.time() - T0:5.1f}s] checks done")
    # timed: candidates whose bench-shape group passed and no group failed a check (a group stopped at CHECK_S
    # says FAIL above and exits 1, but does not cost the candidate its timing)
    ok = [lb for lb in DIAG if lb in CANDS] + [lb for lb in (*CANDS, LEVER) if checks.get(f"{lb} c1", {}).get("worst", 1) < 2e-2
          and all(checks[c]["worst"] < 2e-2 for c in checks if c.rsplit(" ", 1)[0] == lb)]
    passes = []

    def on_line(s: str) -> None:
        if s.startswith("PASS "):
            passes.append(json.loads(s[5:]))
        else:
            print(s, end="", flush=True)
    code, _ = run_phase(os.path.abspath(__file__), "time", 900 if DRY else max(5, WALL_S - (time.time() - T0)), env,
                        on_line=on_line, extra=tuple(ok))
    if code != 0 and len(passes) < 3:
        out(f"time phase: {code}")
    table(passes)
    return rc


def q3(xs):
    xs = sorted(xs)
    return statistics.median(xs), xs[len(xs) // 4], xs[(3 * len(xs)) // 4]


def table(passes: list[dict]) -> None:
    if not passes:
        out("no timing passes")
        return
    flops = 2.5 * 2 * B * H * S * S * (D + DV) / 2
    lines = [f"{len(passes)} shuffled passes, causal b{B} h{H} s{S} 192/128 bf16, backward only; b2b rows against "
             "cuDNN's and the product's b2b rows", "| row | median ms | TF/s | vs cuDNN per pass: median [q1, q3] "
             "[min, max] | vs product per pass: median [q1, q3] |", "|---|---:|---:|---|---|"]
    for n in passes[0]:
        ms = [p[n] for p in passes if n in p]
        if n.endswith("]"):
            lines.append(f"| {n} | {statistics.median(ms):.3f} [{min(ms):.3f}, {max(ms):.3f}] | | | |")
            continue
        tail = " b2b" if n.endswith(" b2b") else ""
        r = [p["cudnn" + tail] / p[n] for p in passes if "cudnn" + tail in p and n in p]
        rp = [p["product" + tail] / p[n] for p in passes if "product" + tail in p and n in p] or [float("nan")]
        med, lo, hi = q3(r)
        pm, plo, phi = q3(rp)
        lines.append(f"| {n} | {statistics.median(ms):.3f} | {flops / statistics.median(ms) / 1e9:.1f} | "
                     f"{med:.3f}x [{lo:.3f}, {hi:.3f}] [{min(r):.3f}, {max(r):.3f}] | {pm:.3f} [{plo:.3f}, {phi:.3f}] |")
    out("\n".join(lines))
    d = os.environ.get("OUT")
    if d:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "table.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(d, "passes.json"), "w") as f:
            json.dump(passes, f)


def ptxas_table() -> int:
    """sm_90 registers / spilled words / shared KB of each candidate's kernels (CPU, no GPU)."""
    from fagen.aot import artifacts

    out("| candidate | kernel | registers | spilled words | shared KB |\n|---|---|---:|---:|---:|")
    bad = 0
    for label in CANDS:
        kw = kwargs(label)
        try:
            with artifacts._compiled_mode():  # real @triton.jit functions under TRITON_INTERPRET=1 too
                _MODS.clear()
                mod = lab(label)
                _MODS.clear()
            res = mod.build_sm90(num_stages=kw.get("stages"), tma_add=kw.get("tma_add", False))
        except Exception as e:  # noqa: BLE001
            out(f"| {label} | build failed: {type(e).__name__}: {str(e).splitlines()[0][:100]} | | | |")
            bad += 1
            continue
        for name, (regs, spills, shared, _) in res.items():
            out(f"| {label} | {name} | {regs} | {spills} | {shared / 1024:.0f} |")
    return bad


def main() -> int:
    if "--check" in sys.argv:
        i = sys.argv.index("--check")
        child_check(sys.argv[i + 1], sys.argv[i + 2])
        return 0
    if "--warm" in sys.argv:  # fagen.attention's forward and backward built and run once at the bench shape
        import torch

        import fagen

        q, k, v, do = (t.requires_grad_() for t in bench_inputs())
        torch.autograd.grad(fagen.attention(q, k, v, mask="causal"), (q, k, v), do)
        out("CHECK " + json.dumps({"label": "warm", "worst": 0.0, "errs": "fagen.attention built"}))
        return 0
    if "--phase" in sys.argv:
        child_time([a for a in sys.argv[sys.argv.index("time") + 1:] if not a.startswith("--")])
        return 0
    if "--ptxas" in sys.argv:
        return 1 if ptxas_table() else 0
    if DRY:
        out(f"round {ROUND}: sm_90 builds")
        bad = ptxas_table()
        out(f"[{time.time() - T0:5.1f}s] builds done; the run on the CPU interpreter:")
        return run_gpu() or (1 if bad else 0)
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (--dry-run rehearses it on the CPU)")
    out(f"{torch.cuda.get_device_name()} torch {torch.__version__}, round {ROUND}")
    return run_gpu()


if __name__ == "__main__":
    sys.exit(main())
