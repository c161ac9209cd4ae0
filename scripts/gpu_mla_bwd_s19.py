"""Nineteenth session: issue 27's MLA prefill backward (d_qk 192, d_v 128, causal b4 h16 s4096 bf16; >= 0.9x cuDNN
in the same run) on the H200: the Triton pair's tiles (chosen on the H100) against tiles that may suit the H200.

    PYTHONPATH=$PWD python3 scripts/gpu_mla_bwd_s19.py --round A   # H200, under 50 s; table on stdout, $OUT/table.txt
    PYTHONPATH=$PWD python3 scripts/gpu_mla_bwd_s19.py --dry-run   # CPU: every GPU candidate built for sm_90, plus
                                                                   # the check on the interpreter (and a mutant, red)
    PYTHONPATH=$PWD python3 scripts/gpu_mla_bwd_s19.py --ptxas [--all] [labels]   # CPU: sm_90 regs / spills / KB

A candidate is the default render with some module constants replaced (DKDV_BLOCK_N/M, DQ_BLOCK_M/N, each
kernel's warps and stages, GROUP_PROGRAMS), as scripts/gpu_mla_bwd_s7.py does. Phases (child processes under
wall-clock limits: a kernel that faults or hangs loses its row, never the table):
1. check, all candidates at once (their builds in parallel): dq/dk/dv against float64, outputs NaN-filled (a
   program that never ran fails), causal gqa 1 b3 h16 Sq 208 / Sk 336 (off every block; the bench shape's build)
   and causal gqa 2 b1 hq 4 Sq 257 / Sk 333 (Sq != Sk, GQA); causal S 208, where dQ's row 0 (one key seen) must be
   exactly 0 ([Note] Exact delta); then one untimed call at the bench shape;
2. time: cuDNN (SDPA), the product through fagen.attention's autograd, the product's module called directly
   (m.backward, as the candidates are) and each checked candidate, in passes, each pass every row once (do_bench
   per row; "b2b" rows: 10 calls back to back between two events), in a shuffled order since the session's end
   (rounds A and B rotated one order, which kept each row behind the same row); per pass each row's ratio to cuDNN
   of the same pass, reported as median [min, max]; and the ratio to the base row of the same pass.
TF/s as fagen's bench: 2.5 * 2 * B * H * S^2 * (192 + 128) / 2. Exit 1 when a check fails (the mutant aside).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
DRY = "--dry-run" in sys.argv or os.environ.get("MLABWD19_DRY") == "1"
if DRY:
    os.environ["MLABWD19_DRY"] = "1"
    os.environ.setdefault("TRITON_INTERPRET", "1")
ROUND = sys.argv[sys.argv.index("--round") + 1] if "--round" in sys.argv else os.environ.get("MLABWD19_ROUND", "A")
os.environ["MLABWD19_ROUND"] = ROUND
D, DV = 192, 128
B, H, S = (1, 2, 64) if DRY else (4, 16, 4096)
T0 = float(os.environ.get("MLABWD19_T0", time.time()))  # the parent's start: children count from it
WALL_S = 50  # the whole run
CHECK_S = 34  # a check child still running then is stopped (its candidate is not timed)

# The product's constants ([Note] MLA backward steps, [Note] MLA work order; spec m128n128w8s2): candidates change some.
# The preprocess's tile is a lever of split specs ([Note] MLA preprocess tile: PRE_BLOCK_M, PRE_NUM_WARPS), off: the
# dQ kernel's, 128 rows on 8 warps. Round A ran before the lever (at 2a802097: "pre m64 w4" by source edits); round
# B at 4edf008e, where the product had it on (64 rows, 4 warps) and "s18 product" was the tile before (today's).
DEFAULT = dict(DKDV_BLOCK_N=128, DKDV_BLOCK_M=32, DKDV_NUM_WARPS=8, DKDV_NUM_STAGES=3,
               DQ_BLOCK_M=128, DQ_BLOCK_N=64, DQ_NUM_WARPS=8, DQ_NUM_STAGES=3, GROUP_PROGRAMS=128,
               PRE_BLOCK_M=128, PRE_NUM_WARPS=8)
PATCHED = tuple(DEFAULT)


def cand(label, **kw):
    return label, {**DEFAULT, **kw}


# Every candidate enumerated for sm_90 (--ptxas --all); GPU_LABELS the pruned ones run on the GPU.
ALL = (
    ("product", {}),
    cand("kv s2", DKDV_NUM_STAGES=2),
    cand("kv s4", DKDV_NUM_STAGES=4),
    cand("kv n64 w4", DKDV_BLOCK_N=64, DKDV_NUM_WARPS=4),
    cand("kv n64 w4 s2", DKDV_BLOCK_N=64, DKDV_NUM_WARPS=4, DKDV_NUM_STAGES=2),
    cand("kv n64 m64 w4", DKDV_BLOCK_N=64, DKDV_BLOCK_M=64, DKDV_NUM_WARPS=4),
    cand("kv n64 m16 w4", DKDV_BLOCK_N=64, DKDV_BLOCK_M=16, DKDV_NUM_WARPS=4),
    cand("kv m16 s4", DKDV_BLOCK_M=16, DKDV_NUM_STAGES=4),
    cand("q s2", DQ_NUM_STAGES=2),
    cand("q s4", DQ_NUM_STAGES=4),
    cand("q n32", DQ_BLOCK_N=32),
    cand("q n32 s4", DQ_BLOCK_N=32, DQ_NUM_STAGES=4),
    cand("q n32 s5", DQ_BLOCK_N=32, DQ_NUM_STAGES=5),
    cand("q m64 w4", DQ_BLOCK_M=64, DQ_NUM_WARPS=4),
    cand("q m64 w4 s2", DQ_BLOCK_M=64, DQ_NUM_WARPS=4, DQ_NUM_STAGES=2),
    cand("q m64 n32 w4", DQ_BLOCK_M=64, DQ_BLOCK_N=32, DQ_NUM_WARPS=4),
    cand("q m64 n32 w4 s4", DQ_BLOCK_M=64, DQ_BLOCK_N=32, DQ_NUM_WARPS=4, DQ_NUM_STAGES=4),
    cand("q m64 w8", DQ_BLOCK_M=64, DQ_NUM_WARPS=8),
    cand("q n128 s2", DQ_BLOCK_N=128, DQ_NUM_STAGES=2),
    cand("q m64 n32 w4 s2", DQ_BLOCK_M=64, DQ_BLOCK_N=32, DQ_NUM_WARPS=4, DQ_NUM_STAGES=2),
    cand("q m64 n16 w4 s4", DQ_BLOCK_M=64, DQ_BLOCK_N=16, DQ_NUM_WARPS=4, DQ_NUM_STAGES=4),
    cand("kv n64 w4 p1", DKDV_BLOCK_N=64, DKDV_NUM_WARPS=4, GROUP_PROGRAMS=1),
    cand("kv n64 m16 w4 s4", DKDV_BLOCK_N=64, DKDV_BLOCK_M=16, DKDV_NUM_WARPS=4, DKDV_NUM_STAGES=4),
    cand("s18 product", PRE_BLOCK_M=128, PRE_NUM_WARPS=8),  # the eighteenth's: the preprocess at the dQ kernel's tile
    cand("pre m64 w4", PRE_BLOCK_M=64, PRE_NUM_WARPS=4),  # round B's product
    cand("pre m32 w2", PRE_BLOCK_M=32, PRE_NUM_WARPS=2),
    cand("pre m32 w4", PRE_BLOCK_M=32, PRE_NUM_WARPS=4),
    cand("pre m64 w2", PRE_BLOCK_M=64, PRE_NUM_WARPS=2),
    cand("pre m64 w8", PRE_BLOCK_M=64, PRE_NUM_WARPS=8),
    cand("pre m128 w4", PRE_BLOCK_M=128, PRE_NUM_WARPS=4),
    cand("group 64", GROUP_PROGRAMS=64),
    cand("group 256", GROUP_PROGRAMS=256),
)
GPU_LABELS = {
    "A": ("product", "kv s4", "kv n64 w4", "q n32 s4", "q m64 n32 w4", "q m64 w8", "pre m64 w4", "group 256"),
    "B": ("product", "s18 product", "pre m32 w2", "pre m32 w4", "pre m64 w2", "pre m64 w8", "pre m128 w4", "group 256"),
}[ROUND]
BASE = "s18 product" if ROUND == "B" else "product"  # the table's second ratio: against this row of the same pass
# rows beside the whole backward: the preprocess alone (PRE), each gradient kernel with it (PARTS), and back to back
# (B2B: 10 calls between two events, no L2 flush, so the host's launch time hides under the GPU's)
PRE = {"A": ("product", ), "B": ("product", "s18 product", "pre m32 w2", "pre m32 w4", "pre m64 w2", "pre m64 w8",
                                 "pre m128 w4")}[ROUND]
PARTS = {"A": ("product", ), "B": ("product", "s18 product")}[ROUND]
B2B = {"A": (), "B": ("cudnn", "product", "s18 product")}[ROUND]
CANDIDATES = tuple(c for c in ALL if c[0] in GPU_LABELS)
if DRY:  # the interpreter is slow at d192: the rehearsal runs the product, two candidates and the mutant
    CANDIDATES = CANDIDATES[:3]
# checked only, expected to FAIL (the dry run: seen red on the CPU): dK's scale left out
MUTANT = ("mutant", {**DEFAULT, "_sub": (("    dk *= scale  #", "    dk *= 1.0  #"), )})
# ... and delta summed on the CUDA cores, not formed as dP is: dQ's row 0 is no longer exactly 0 where it rounds
MUTANT_DELTA = ("mutant delta", {**DEFAULT, "_sub": (
    ("    delta = tl.sum(tl.where(eye, tl.dot(o, tl.trans(do)), 0.0), 1)",
     "    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)"), )})
PASSES = 60


def out(msg: str) -> None:
    print(msg, flush=True)


def source(consts: dict, mask="causal", gqa=1) -> str:
    """The default bwd render at (mask, gqa) with `consts` for the per-kernel constants (and `_sub` applied)."""
    import fagen

    spec = fagen.KernelSpec(head_dim=D, head_dim_v=DV, mask=mask, gqa=gqa, dtype="bf16", direction="bwd")
    src = fagen.generate(spec)
    for name, value in consts.items():
        if name.startswith("_"):
            continue
        text = f"tl.constexpr({value})" if name == "GROUP_PROGRAMS" else f"{value}"
        src, n = re.subn(rf"^{name} = .*$", f"{name} = {text}", src, count=1, flags=re.M)
        if n != 1:
            raise RuntimeError(f"{name} not in the render")
    for old, new in consts.get("_sub", ()):  # source edits: (old, new), old once in the render
        if src.count(old) != 1:
            raise RuntimeError(f"{old!r} not once in the render")
        src = src.replace(old, new)
    return spec, src


def module(label: str, consts: dict, mask="causal", gqa=1):
    from fagen.runtime.loader import load_source

    spec, src = source(consts, mask, gqa)
    return load_source(src, f"{spec.name}_mlabwd19_{re.sub(r'[^a-z0-9]+', '_', label)}")


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
    """ref_fwd at the bench shape, 4 heads at a time (all scores at once would take 4 GB)."""
    import torch

    o = torch.empty(q.shape[:3] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        for h in range(0, q.shape[1], 4):
            o[b, h:h + 4], lse[b, h:h + 4] = (x[0] for x in ref_fwd(q[b:b + 1, h:h + 4], k[b:b + 1, h:h + 4],
                                                                    v[b:b + 1, h:h + 4], True, D ** -0.5))
    return o, lse


def dev():
    return "cpu" if DRY else "cuda"


def bench_inputs():
    import torch

    gen = torch.Generator(device=dev()).manual_seed(0)
    return tuple(torch.randn(B, H, S, d, device=dev(), generator=gen).bfloat16() for d in (D, D, DV, DV))


# ---- child: check ----------------------------------------------------------------------------------------------
def child_check(label: str) -> None:
    import torch

    from fagen.verify import reference

    consts = dict((*ALL, MUTANT, MUTANT_DELTA))[label]
    gen = torch.Generator(device=dev()).manual_seed(1)
    worst, errs = 0.0, []
    # (mask, gqa, batch, query heads, Sq, Sk): gqa 1 with 16 heads at lengths that are multiples of 16 (not of 32):
    # Triton's specialization of the bench shape (ints by divisibility by 16), so this build is the one timed; gqa 2
    # at odd lengths (a build of its own); Sq = Sk: query 0 sees key 0 alone, dS = P (dP - delta) = 0 bitwise where
    # delta is formed as dP is ([Note] Exact delta), so dQ's row 0 must be exactly 0 (a preprocess tile that rounds
    # its delta otherwise fails here)
    shapes = ((("causal", 1, 3, 2, 48, 80), ("causal", 2, 1, 4, 45, 61), ("causal", 1, 1, 2, 48, 48)) if DRY else
              (("causal", 1, 3, 16, 208, 336), ("causal", 2, 1, 4, 257, 333), ("causal", 1, 1, 16, 208, 208)))
    for mask, gqa, nb, hq, sq, sk in shapes:
        m = module(label, consts, mask, gqa)
        q = torch.randn(nb, hq, sq, D, device=dev(), generator=gen).bfloat16()
        k = torch.randn(nb, hq // gqa, sk, D, device=dev(), generator=gen).bfloat16()
        v = torch.randn(nb, hq // gqa, sk, DV, device=dev(), generator=gen).bfloat16()
        do = torch.randn(nb, hq, sq, DV, device=dev(), generator=gen).bfloat16()
        m._new_out = lambda t: torch.full_like(t, float("nan"))  # a program that never ran leaves NaN
        o, lse = ref_fwd(q, k, v, mask == "causal", D ** -0.5)
        got = m.backward(do, q, k, v, o, lse)
        ref_in = [t.double().requires_grad_() for t in (q, k, v)]
        ref_out, _ = reference.attention(*ref_in, mask=mask)
        ref_out.backward(do.double())
        if sq == sk:
            z = got[0][:, :, 0].abs().max().item()
            errs.append(f"dq row 0 {z:.1e}")
            if z != 0:
                worst = float("inf")
        for name, g, r in zip(("dq", "dk", "dv"), got, (t.grad for t in ref_in)):
            err = (g.double() - r).abs().max().item() / max(1.0, r.abs().max().item())
            err = err if err == err else float("inf")  # NaN: a program that never ran
            errs.append(f"{name} {err:.1e}")
            worst = max(worst, err)
    if worst < 2e-2:  # one untimed call at the bench shape: Triton's cache for the timing child
        m = module(label, consts)
        q, k, v, do = bench_inputs()
        m.backward(do, q, k, v, do, torch.zeros(q.shape[:3], device=dev()))  # any out / lse: a build, untimed
        if not DRY:
            torch.cuda.synchronize()
    out("CHECK " + json.dumps({"label": label, "worst": worst, "errs": " ".join(errs)}))


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
    from fagen.runtime import resolve

    out(f"fagen.attention resolves {resolve.resolve(qp, kp, vp, 'causal', False).NAME}")
    by_label = dict(ALL)
    o, lse = ref_fwd_chunked(q, k, v)
    for label in labels:
        m = module(label, by_label[label])
        rows[label] = (lambda m=m, o=o, lse=lse: m.backward(do, q, k, v, o, lse))
        launch = m._launch_backward
        args = (do, q, k, v, o, lse, D ** -0.5, None, None, None)
        if label in PRE:  # where the time goes: the preprocess alone, each gradient kernel with it
            rows[f"{label} [pre]"] = (lambda f=launch: f(*args, need_dq=False, need_dkdv=False))
        if label in PARTS:
            rows[f"{label} [pre+dK/dV]"] = (lambda f=launch: f(*args, need_dq=False))
            rows[f"{label} [pre+dQ]"] = (lambda f=launch: f(*args, need_dkdv=False))
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
    # each pass in its own shuffled order: a rotation keeps every row behind the same row, and round B read rows of
    # identical gradient kernels 1.01-1.07x apart by the row timed before them (the card's power state)
    import random

    shuffle = random.Random(19)
    for p in range(2 if DRY else PASSES):
        order = shuffle.sample(names, len(names))
        ms = {n: (back_to_back if n.endswith(" b2b") else bench)(rows[n]) for n in order}
        out("PASS " + json.dumps({n: ms[n] for n in names}))  # the rows' own order (the table's)
        if time.time() - T0 > WALL_S - 3:
            break


# ---- parent ----------------------------------------------------------------------------------------------------
def spawn(args: list[str], env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def run_gpu() -> int:
    from _phases import child_env, run_phase

    env = child_env("/tmp/mlabwd19_cache", ROOT)
    env["MLABWD19_T0"] = str(T0)
    if DRY:
        env["TRITON_INTERPRET"] = "1"
    labels = [c[0] for c in CANDIDATES] + (["mutant", "mutant delta"] if DRY else [])
    kids = {lb: spawn(["--check", lb], env) for lb in labels}
    kids["warm"] = spawn(["--warm"], env)
    checks, rc = {}, 0
    for lb, p in kids.items():
        try:
            text = p.communicate(timeout=600 if DRY else max(1, CHECK_S - (time.time() - T0)))[0]
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
            out(f"check {lb}: FAIL {' | '.join(text.strip().splitlines()[-3:])[-300:]}")
        if not ok and lb not in ("mutant", "mutant delta", "warm"):
            rc = 1
        if lb.startswith("mutant") and ok:
            out("the mutant PASSED: the check cannot fail")
            rc = 1
    out(f"[{time.time() - T0:5.1f}s] checks done")
    ok = [lb for lb in labels
          if not lb.startswith("mutant") and lb != "warm" and lb in checks and checks[lb]["worst"] < 2e-2]
    passes = []

    def on_line(s: str) -> None:
        if s.startswith("PASS "):
            passes.append(json.loads(s[5:]))
        else:
            print(s, end="", flush=True)
    code, _ = run_phase(os.path.abspath(__file__), "time", 600 if DRY else max(5, WALL_S - (time.time() - T0)), env,
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
    first = ["cudnn", "fagen.attention"]
    names = first + [n for n in passes[0] if n not in first]
    consts = dict(ALL)
    lines = [f"{len(passes)} passes, causal b{B} h{H} s{S} 192/128 bf16, backward only; b2b: back to back, against "
             "cuDNN's and the base's b2b", "| row | constants (dK/dV n m w s; dQ m n w s; group; pre m w) | median ms "
             f"| TF/s | vs cuDNN per pass: median [min, max] | vs {BASE} per pass: median [q1, q3] |",
             "|---|---|---:|---:|---|---|"]
    for n in names:
        ms = [p[n] for p in passes]
        c = consts.get(n)
        cs = "" if c is None else (
            f"n{c['DKDV_BLOCK_N']} m{c['DKDV_BLOCK_M']} w{c['DKDV_NUM_WARPS']} s{c['DKDV_NUM_STAGES']}; "
            f"m{c['DQ_BLOCK_M']} n{c['DQ_BLOCK_N']} w{c['DQ_NUM_WARPS']} s{c['DQ_NUM_STAGES']}; "
            f"p{c['GROUP_PROGRAMS']}; "
            f"m{c['PRE_BLOCK_M']} w{c['PRE_NUM_WARPS']}" if c else "(as shipped)")
        if n.endswith("]"):  # a part of a backward: its time only
            lines.append(f"| {n} | | {statistics.median(ms):.3f} [{min(ms):.3f}, {max(ms):.3f}] | | | |")
            continue
        tail = " b2b" if n.endswith(" b2b") else ""
        r = [p["cudnn" + tail] / p[n] for p in passes if "cudnn" + tail in p]
        rp = [p[BASE + tail] / p[n] for p in passes if BASE + tail in p] or [float("nan")]
        med, lo, hi = q3(rp)
        lines.append(f"| {n} | {cs} | {statistics.median(ms):.3f} | {flops / statistics.median(ms) / 1e9:.1f} | "
                     + (f"{statistics.median(r):.3f}x [{min(r):.3f}, {max(r):.3f}]" if r else "") +
                     f" | {med:.3f} [{lo:.3f}, {hi:.3f}] |")
    out("\n".join(lines))
    d = os.environ.get("OUT")
    if d:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "table.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(d, "passes.json"), "w") as f:
            json.dump(passes, f)


def ptxas_table(cands) -> None:
    """sm_90 registers / spilled words / shared KB of each candidate's dK/dV and dQ kernels (CPU, no GPU)."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from fagen.aot import artifacts
    from fagen.runtime.modules import import_module

    out("| candidate | dK/dV regs | spills (words) | KB | dQ regs | spills | KB | pre regs | spills | KB |\n"
        "|---|---|---|---|---|---|---|---|---|---|")
    tmp = tempfile.mkdtemp()
    work = []
    with artifacts._compiled_mode():
        for label, consts in cands:
            spec, src = source(consts)
            tag = re.sub(r"[^a-z0-9]+", "_", label)
            path = os.path.join(tmp, f"mlabwd19_{tag}.py")
            with open(path, "w") as f:
                f.write(src)
            mod = import_module(Path(path), f"mlabwd19_{tag}", filename=f"{spec.name}.py")
            work += [(label, spec, e) for name in ("_attn_bwd_dkdv", "_attn_bwd_dq", "_attn_bwd_preprocess")
                     for e in mod.AOT_KERNELS if e["name"] == name]

        def one(w):
            try:
                return w[0], artifacts._compile_kernel(w[1], "sm_90", w[2])[2]
            except Exception as e:  # noqa: BLE001
                return w[0], {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"}
        with ThreadPoolExecutor(2) as ex:
            recs = list(ex.map(one, work))
    bad = 0
    for label, _ in cands:
        cells = []
        for lb, rec in recs:
            if lb != label:
                continue
            if "error" in rec:
                cells.append(rec["error"])
                bad += 1
            else:
                cells += [str(rec["registers"]), str(rec["spills"]), f"{rec['shared'] / 1024:.0f}"]
        out(f"| {label} | " + " | ".join(cells) + " |")
    return bad


def main() -> int:
    if "--check" in sys.argv:
        child_check(sys.argv[sys.argv.index("--check") + 1])
        return 0
    if "--warm" in sys.argv:  # fagen.attention's forward and backward built and run once at the bench shape
        import torch

        import fagen

        q, k, v, do = (t.requires_grad_() for t in bench_inputs())
        torch.autograd.grad(fagen.attention(q, k, v, mask="causal"), (q, k, v), do)
        out("CHECK " + json.dumps({"label": "warm", "worst": 0.0, "errs": "fagen.attention built"}))
        return 0
    if "--phase" in sys.argv:  # the timing child: --phase time <labels>
        child_time([a for a in sys.argv[sys.argv.index("time") + 1:] if not a.startswith("--")])
        return 0
    if "--ptxas" in sys.argv:
        only = [a for i, a in enumerate(sys.argv[1:], 1) if not a.startswith("--") and sys.argv[i - 1] != "--round"]
        cands = ALL if "--all" in sys.argv else CANDIDATES
        return 1 if ptxas_table([c for c in cands if not only or c[0] in only]) else 0
    if DRY:  # every GPU candidate built for sm_90, then the run itself on the interpreter at tiny shapes
        out(f"round {ROUND}: sm_90 builds of the GPU candidates")
        bad = ptxas_table(tuple(c for c in ALL if c[0] in GPU_LABELS))
        out(f"[{time.time() - T0:5.1f}s] builds done; the run on the CPU interpreter:")
        return run_gpu() or (1 if bad else 0)
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (--dry-run rehearses it on the CPU)")
    out(f"{torch.cuda.get_device_name()} torch {torch.__version__}, round {ROUND}")
    return run_gpu()


if __name__ == "__main__":
    sys.exit(main())
