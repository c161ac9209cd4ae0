"""GPU check and timings of MLA prefill (head_dim 192, head_dim_v 128; issue 27: causal forward >= 1.0x and backward
>= 0.9x the best peer in the same run, cuDNN through SDPA) at the bench's row shape: causal, b4 h16 s4096, bf16.

    PYTHONPATH=$PWD python3 scripts/gpu_mla_prefill.py   # under ~100 s on an H100; one table; $OUT/gpu_mla_prefill.md
    GPU_MLA_PREFILL_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_mla_prefill.py   # CPU interpreter, tiny shapes

Rows, in this order: fagen's default Triton forward (its out and lse feed the backward rows); the Gluon (sm_90)
forward's variants ([Note] Gluon MLA widths, [Note] Tile schedule: the tile order of the persistent loop, paired
against heavy-first by batch, the order before); fagen's default backward; SDPA (cuDNN) forward and backward, the
peer; the Gluon variants with the tile counter (after the peer: a barrier protocol gone wrong would hang, and the
watchdog then prints what finished); the fastest new Gluon variant checked at Sq != Sk, mask none, gqa 2 and at every
batch and head of an odd count of query blocks; the d128 causal gluon forward at fwd-d128-causal-s16k's shape as the
product renders it and with the tile schedule (GluonBackend.variant["tile_schedule_all"], measurement only); backward
variants (the rendered module's per-kernel constants
patched: stages, dK/dV query step). Past BUDGET_S the rest are skipped. Every fagen kernel is checked once
against the float64 reference on one (batch, head) slice before it is timed: out for a forward (a forward also
over every batch and head against an fp32 reference: a tile order that missed or repeated a tile fails there),
dq/dk/dv for a backward (given the default forward's out and lse). TF/s counts the causal flops as fagen's bench
does: 2 * B * H * S * S * (192 + 128) / 2 for the forward, 2.5x that for the backward. The last rows name the
fastest forward and backward and their ratio to cuDNN.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time

DRY = os.environ.get("GPU_MLA_PREFILL_DRY") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gpu_rows import ROWS, T0, guarded, log, row  # noqa: E402
from gpu_rows import bench as _bench  # noqa: E402

import fagen  # noqa: E402
from fagen import backends  # noqa: E402
from fagen.codegen import render as _render  # noqa: E402
from fagen.runtime.loader import load_source  # noqa: E402
from fagen.spec.axes import DType  # noqa: E402
from fagen.verify import reference  # noqa: E402
from fagen.verify.tolerances import TOLERANCE, compare  # noqa: E402

DEV = "cpu" if DRY else "cuda"
D, DV = 192, 128
B, H, S = (1, 2, 80) if DRY else (4, 16, 4096)  # 80: not a multiple of any block
BUDGET_S = 100  # candidate rows start only before this many seconds
# After WATCHDOG_S seconds the table is printed and the run ends, whatever runs then (a hung kernel included).
WATCHDOG_S = float(os.environ.get("GPU_MLA_PREFILL_WATCHDOG_S", 150))
FWD_BEST: dict[str, float] = {}  # impl -> TF/s of the checked, timed rows
BWD_BEST: dict[str, float] = {}
PEER: dict[str, float] = {}  # "fwd"/"bwd" -> cuDNN's TF/s
_FINISH, _DONE = threading.Lock(), []
# Candidates beyond the defaults (a default among them is not run twice): sm_90 ptxas on the CPU (fagen's build,
# triton 3.6, 2026-11-26, with [Note] Split head dim), registers and spilled words of the forward kernel, or of the
# dK/dV and dQ kernels; shared memory in KB. Pruned: those that spill more or do not fit 227 KB (fwd m128n64w4s2
# 52 words, m128n128w4s2 172; bwd m64n64w4s2 132, m64n128w8s2 64; m128n128 bwd over 227 KB).
FWD_TILES = ()  # Triton forward tiles: m128n128w8s2 411, m128n64w8s4 456 (14:23 / 15:12 UTC); the Gluon one leads
# The gluon forward's variants (label, tiles, source patch): [Note] Gluon MLA widths, [Note] Tile schedule. sm_90
# ptxas on the CPU (168 registers, spills in bytes stored / loaded): lean n128 s2 with _SCHED 1 (paired)
# 28 / 84, _SCHED 0 (heavy first by batch, the order before and the render's default) 4 / 4, _SCHED 2 (a tile
# counter, by batch) 12 / 36, _SCHED 3 (the counter over L2 sections of heads) 20 / 60; n64 s2: _SCHED 1 0,
# _SCHED 3 4 / 8 (O through V, measured no faster on the H100, left the template). The counter variants run after the peer's rows (a barrier protocol gone wrong
# would hang: the watchdog ends it).
SCHED1 = (("_SCHED = 1", "_SCHED = 1"),)  # the render's default is 1, paired (0: heavy first by batch)
SCHED0 = (("_SCHED = 1", "_SCHED = 0"),)
SCHED2 = (("_SCHED = 1", "_SCHED = 2"),)
SCHED3 = (("_SCHED = 1", "_SCHED = 3"),)
GLUON_TILES = (
    ("gluon paired", dict(block_m=128, block_n=128, num_warps=8, num_stages=2), SCHED1),
    ("gluon heavy-first", dict(block_m=128, block_n=128, num_warps=8, num_stages=2), SCHED0),
    ("gluon paired", dict(block_m=128, block_n=64, num_warps=8, num_stages=2), SCHED1),
)
GLUON_LATE = (
    ("gluon sections", dict(block_m=128, block_n=128, num_warps=8, num_stages=2), SCHED3),
    ("gluon counter", dict(block_m=128, block_n=128, num_warps=8, num_stages=2), SCHED2),
    ("gluon sections", dict(block_m=128, block_n=64, num_warps=8, num_stages=2), SCHED3),
)
# d128 causal (the bench row fwd-d128-causal-s16k: b1 h16 s16384): the gluon forward as the product renders it, and
# with the tile schedule rendered (GluonBackend.variant["tile_schedule_all"]) at _SCHED 3 and 2 (sm_90 ptxas: 0
# spills, 229,856 bytes of shared memory against 229,752).
D128 = (1, 16, 1024) if DRY else (1, 16, 16384)
D128_SCHED = (("d128 sections", 3), ("d128 counter", 2))
GLUON_PATCHES = {label: patches for label, _, patches in GLUON_TILES + GLUON_LATE}
# Backward variants (label, tiles, patches of the rendered module's constants: [Note] Backward tiles); sm_90 ptxas
# of the default m128n64w8s3: dK/dV 255 registers 10 spilled words, dQ 241 / 0; 162/201 KB.
BWD_TILES = (
    ("fagen", dict(block_m=128, block_n=64, num_warps=8, num_stages=3),
     (("DKDV_NUM_STAGES = NUM_STAGES", "DKDV_NUM_STAGES = 2"),)),
    ("fagen", dict(block_m=128, block_n=64, num_warps=8, num_stages=3),
     (("DQ_NUM_STAGES = NUM_STAGES", "DQ_NUM_STAGES = 2"),)),
    ("fagen", dict(block_m=128, block_n=64, num_warps=8, num_stages=3),
     (("DKDV_BLOCK_M = 64", "DKDV_BLOCK_M = 32"),)),
)


def patched(s, patches, tag):
    """The spec's module with texts replaced (a variant of the render measured beside it)."""
    if not patches:
        return fagen.load(s)
    source = fagen.generate(s)
    for old, new in patches:
        if old not in source:
            raise RuntimeError(f"{tag}: {old!r} not in the render")
        source = source.replace(old, new)
    return load_source(source, f"{s.name}_{tag}")


def tag_of(patches) -> str:
    return "+".join(new.replace(" ", "").replace("gl.constexpr", "") for _, new in patches)


def d128_module(sched):
    """The d128 causal gluon module: the product's (sched None), or rendered with the tile schedule at _SCHED sched."""
    s = fagen.KernelSpec(backend="gluon", head_dim=128, mask="causal", dtype="bf16")
    if sched is None:
        return fagen.load(s)
    backends.GLUON.variant["tile_schedule_all"] = True
    _render.render.cache_clear()
    try:
        source = fagen.generate(s)
    finally:
        backends.GLUON.variant["tile_schedule_all"] = False
        _render.render.cache_clear()
    if "_SCHED = 1" not in source:
        raise RuntimeError("no _SCHED in the d128 render")
    return load_source(source.replace("_SCHED = 1", f"_SCHED = {sched}"), f"{s.name}_sched{sched}")


def run_d128() -> None:
    """fwd-d128-causal-s16k's shape: the product's gluon forward and the tile schedules, each checked (one head
    against float64, every head against fp32) and timed."""
    b, h, s = D128
    case = f"causal b{b} h{h} s{s} d128"
    flops = 2 * b * h * s * s * 256 / 2
    gen = torch.Generator(device=DEV).manual_seed(1)
    q, k, v = (torch.randn(b, h, s, 128, device=DEV, generator=gen).bfloat16() for _ in range(3))
    if DRY:
        for label, sched in D128_SCHED:
            d128_module(sched)
            row("fwd", case, f"gluon {label}", None, "", None, "rendered; not run: Gluon kernels need sm_90")
        return
    q1, k1, v1 = (t[:, -1:].contiguous() for t in (q, k, v))
    want1, _ = reference.attention(q1.double(), k1.double(), v1.double(), mask="causal")
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    for label, sched in (("d128 product", None),) + D128_SCHED:
        if time.time() - T0 > BUDGET_S:
            row("fwd", case, f"gluon {label}", None, "", None, "skipped: time budget")
            continue

        def one(label=label, sched=sched):
            m = d128_module(sched)
            err = compare("out", m.forward(q1, k1, v1)[0], want1, **TOLERANCE[DType.BF16])
            err = max(err, compare("out (all heads)", m.forward(q, k, v)[0], want, **TOLERANCE[DType.BF16]))
            t = bench(lambda: m.forward(q, k, v))
            row("fwd", case, f"gluon {label}", flops / t / 1e9, "TF/s", t, f"err {err:.1e}")
        guarded("fwd", case, f"gluon {label}", one)


def bench(fn) -> float:
    return _bench(fn, DRY, warmup=10, rep=50)  # ms, median


def tiles_name(spec) -> str:
    return f"m{spec.block_m}n{spec.block_n}w{spec.num_warps}s{spec.num_stages}"


def spec(direction="fwd", backend="triton", **tiles):
    return fagen.KernelSpec(head_dim=D, head_dim_v=DV, mask="causal", dtype="bf16", direction=direction,
                            backend=backend, **tiles)


def main() -> None:
    if not torch.cuda.is_available() and not DRY:
        sys.exit("gpu_mla_prefill.py needs a CUDA GPU (GPU_MLA_PREFILL_DRY=1 rehearses it on the CPU)")
    log(f"{'CPU rehearsal' if DRY else torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"fagen {fagen.__file__}")
    case = f"causal b{B} h{H} s{S} d{D}v{DV}"
    watchdog(case, WATCHDOG_S)
    flops = 2 * B * H * S * S * (D + DV) / 2
    gen = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(B, H, S, D, device=DEV, generator=gen).mul(2).bfloat16()
    k = torch.randn(B, H, S, D, device=DEV, generator=gen).bfloat16()
    v = torch.randn(B, H, S, DV, device=DEV, generator=gen).bfloat16()
    do = torch.randn(B, H, S, DV, device=DEV, generator=gen).bfloat16()
    sl = (slice(0, 1), slice(H - 1, H))  # one (batch, head) slice for the checks
    q1, k1, v1, do1 = (t[sl].contiguous() for t in (q, k, v, do))
    ref_in = [t.double().requires_grad_() for t in (q1, k1, v1)]
    ref_out, _ = reference.attention(*ref_in, mask="causal")
    ref_out.backward(do1.double())
    ref_grads = [t.grad for t in ref_in]
    fwd_best, bwd_best, peer = FWD_BEST, BWD_BEST, PEER

    ref32 = None if DRY else torch.cat([F.scaled_dot_product_attention(  # the whole out in fp32, a batch at a time
        q[i:i + 1].float(), k[i:i + 1].float(), v[i:i + 1].float(), is_causal=True) for i in range(B)])

    def run_fwd(s, label, patches=()):
        m = patched(s, patches, re.sub(r"\W", "_", label.split()[-1]))  # a tag per label: one patch set per label
        name = f"{label} {tiles_name(s)}"
        err = compare("out", m.forward(q1, k1, v1)[0], ref_out.detach(), **TOLERANCE[DType.BF16])
        if ref32 is not None:  # every tile written once (the tile order): the whole out against fp32
            err = max(err, compare("out (all heads)", m.forward(q, k, v)[0], ref32, **TOLERANCE[DType.BF16]))
        t = bench(lambda: m.forward(q, k, v))
        row("fwd", case, name, flops / t / 1e9, "TF/s", t, f"err {err:.1e}")
        fwd_best[name] = flops / t / 1e9
        return m

    default_fwd = guarded("fwd", case, "fagen default", lambda: run_fwd(spec(), "fagen default"))
    def edges(backend, patches=(), **tiles):  # beyond the timed case: Sq != Sk, none, gqa 2
        errs = []
        # the last: every batch and head at an odd count of query blocks, past one round of paired tiles
        for mask, gqa, sq, sk, nb in (("causal", 1, S // 4 + 7, S // 2, 1), ("none", 2, S // 2, S // 2, 1),
                                      ("causal", 2, S // 2, S // 2, 1), ("causal", 1, S // 2 + 7, S // 2 + 7, B)):
            es = fagen.KernelSpec(head_dim=D, head_dim_v=DV, mask=mask, dtype="bf16", gqa=gqa, backend=backend, **tiles)
            src = fagen.generate(es)
            m = patched(es, tuple(p for p in patches if p[0] in src), "edges")
            hq = gqa if nb == 1 else H
            qe, ke, ve = q[:nb, :hq, :sq], k[:nb, :hq // gqa, :sk], v[:nb, :hq // gqa, :sk]
            got, got_lse = m.forward(qe, ke, ve)
            want, want_lse = reference.attention(qe.double(), ke.double(), ve.double(), mask=mask)
            errs.append(compare(f"out {mask} gqa{gqa}", got, want, **TOLERANCE[DType.BF16]))
            compare(f"lse {mask} gqa{gqa}", got_lse, want_lse, **TOLERANCE[DType.BF16])
        row("check", case, f"{backend} {tag_of(patches)} {tiles_name(spec(backend=backend, **tiles))} edges", None, "",
            None, f"PASS causal sq{S // 4 + 7} sk{S // 2}, none gqa2, causal gqa2 s{S // 2}, causal b{B} h{H} "
            f"s{S // 2 + 7} (max err {max(errs):.1e})")

    if DRY:
        row("fwd", case, "gluon", None, "", None, "not run: Gluon kernels need sm_90 (no interpreter)")
    else:  # the forward first: every gluon variant
        for label, tiles, patches in GLUON_TILES:
            s = spec(backend="gluon", **tiles)
            guarded("fwd", case, f"{label} {tiles_name(s)}", lambda s=s, l=label, p=patches: run_fwd(s, l, p))
    out, lse = default_fwd.forward(q, k, v) if default_fwd else (None, None)
    out1, lse1 = default_fwd.forward(q1, k1, v1) if default_fwd else (None, None)

    def run_bwd(s, label, patches=()):
        m = patched(s, patches, "bwd" + str(abs(hash(tag_of(patches))) % 10 ** 6))
        errs = []
        for name, got, want in zip(("dq", "dk", "dv"), m.backward(do1, q1, k1, v1, out1, lse1), ref_grads):
            unit = max(1.0, want.abs().max().item())
            errs.append(compare(name, got, want, atol=2e-2 * unit, rtol=2e-2) / unit)
        t = bench(lambda: m.backward(do, q, k, v, out, lse))
        name = f"{label} {tiles_name(s)}" + (f" {tag_of(patches)}" if patches else "")
        row("bwd", case, name, 2.5 * flops / t / 1e9, "TF/s", t, f"err (dq, dk, dv, / max) {max(errs):.1e}")
        bwd_best[name] = 2.5 * flops / t / 1e9

    if out is not None:
        guarded("bwd", case, "fagen default", lambda: run_bwd(spec("bwd"), "fagen default"))

    from torch.nn.attention import SDPBackend, sdpa_kernel
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def sdpa(a, b, c):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION if not DRY else SDPBackend.MATH):
            return F.scaled_dot_product_attention(a, b, c, is_causal=True)

    def run_sdpa():
        with torch.no_grad():
            err = compare("sdpa out", sdpa(q1, k1, v1), ref_out.detach(), **TOLERANCE[DType.BF16])
            t_f = bench(lambda: sdpa(q, k, v))
        name = "sdpa-cudnn" if not DRY else "sdpa-math"
        row("fwd", case, name, flops / t_f / 1e9, "TF/s", t_f, f"err {err:.1e}")
        o = sdpa(qg, kg, vg)
        t_b = bench(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True))
        row("bwd", case, name, 2.5 * flops / t_b / 1e9, "TF/s", t_b)
        peer.update(fwd=flops / t_f / 1e9, bwd=2.5 * flops / t_b / 1e9)
    guarded("peer", case, "sdpa-cudnn", run_sdpa)

    if DRY:
        guarded("check", case, "triton edges", lambda: edges("triton"))  # the check's own code, rehearsed
    else:
        for label, tiles, patches in GLUON_LATE:
            s = spec(backend="gluon", **tiles)
            if time.time() - T0 > BUDGET_S:
                row("fwd", case, f"{label} {tiles_name(s)}", None, "", None, "skipped: time budget")
                continue
            guarded("fwd", case, f"{label} {tiles_name(s)}", lambda s=s, l=label, p=patches: run_fwd(s, l, p))
        gluon_rows = {name: tf for name, tf in fwd_best.items()
                      if name.startswith("gluon") and not name.startswith("gluon heavy-first")}
        if gluon_rows:  # the fastest new gluon variant, checked at the cases the selection would cover
            label, best = max(gluon_rows, key=gluon_rows.get).rsplit(" ", 1)
            tiles = next(t for lb, t, p in GLUON_TILES + GLUON_LATE
                         if lb == label and tiles_name(spec(backend="gluon", **t)) == best)
            guarded("check", case, "gluon edges", lambda: edges("gluon", GLUON_PATCHES[label], **tiles))

    run_d128()
    for label, tiles, patches in BWD_TILES:
        s = spec("bwd", **tiles)
        if out is None:
            continue
        name = f"{label} {tiles_name(s)} {tag_of(patches)}"
        if time.time() - T0 > BUDGET_S:
            row("bwd", case, name, None, "", None, "skipped: time budget")
            continue
        guarded("bwd", case, name, lambda s=s, l=label, p=patches: run_bwd(s, l, p))

    default_fwd_tiles = tiles_name(spec())
    for tiles in FWD_TILES:
        s = spec(**tiles)
        if tiles_name(s) == default_fwd_tiles:
            continue
        if time.time() - T0 > BUDGET_S:
            row("fwd", case, f"fagen {tiles_name(s)}", None, "", None, "skipped: time budget")
            continue
        guarded("fwd", case, f"fagen {tiles_name(s)}", lambda s=s: run_fwd(s, "fagen"))
    finish(case)


def finish(case, note="") -> None:
    """The winner rows and the table, printed and written to $OUT once (by the run's end or by the watchdog)."""
    with _FINISH:
        if _DONE:
            return
        _DONE.append(True)
        for direction, best in (("fwd", FWD_BEST), ("bwd", BWD_BEST)):
            if best:
                name, tf = max(best.items(), key=lambda kv: kv[1])
                ratio = f"{tf / PEER[direction]:.2f}x cuDNN" if direction in PEER else "no peer"
                row("winner", case, f"{direction}: {name}", tf, "TF/s", None, ratio)
        lines = ["| section | case | impl | value | ms | note |", "|---|---|---|---|---|---|"]
        lines += [f"| {' | '.join(r)} |" for r in ROWS]
        text = "\n".join(lines) + (f"\n\n{note}" if note else "")
        print("\n" + text, flush=True)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "gpu_mla_prefill.md"), "w") as f:
                f.write(text + "\n")


def watchdog(case, after_s: float) -> None:
    """A kernel that never returns (a barrier protocol gone wrong) would take the table with it: after `after_s`
    seconds the rows so far are printed and the process ends."""
    def run():
        time.sleep(max(0.0, after_s - (time.time() - T0)))
        finish(case, f"WATCHDOG: stopped at {time.time() - T0:.0f} s; the rows above are all that finished")
        os._exit(3)
    threading.Thread(target=run, daemon=True).start()


if __name__ == "__main__":
    main()
