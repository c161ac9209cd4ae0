"""The fp8 (e4m3) Gluon forward, tenth session (issue 28), on an H100/H200: each variant checked against float64,
the cudnn-fp8 bench peer as main had it and as fixed (checked through the bench's own check), then one table of
TF/s at d128 B1 H16 s16k, causal and full: fagen's bf16 forward, the fp8 product, the variants and cudnn-fp8, in
one process (the time phase).

    PYTHONPATH=$PWD python3 scripts/gpu_fp8fwd_s10.py          # < 100 s on an H100; one table; $OUTX/gpu_fp8fwd_s10.md
    GPU_FP8_FWD_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_fp8fwd_s10.py   # any machine: sm_90 builds of every variant

The phases (build in a pool, check with scripts/gpu_fp8.py's check: RMSE within 1.5x the e4m3 emulation's, lse,
the fingerprint that fails a P V in bf16, empty rows; causal Sq != Sk both ways, mask none, lengths off the blocks;
GQA 4 / 2 with per-head descales and the window for FULL_CHECKS' variants) are scripts/gpu_fp8_fwd_s7.py's, each in
a child process with a timeout. docs/hopper.md, "fp8 forward, tenth session".
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_fp8_fwd_s7 as s7  # noqa: E402
from _phases import child_env, run_phase as run_child  # noqa: E402



class _Variants(dict):
    """s7's VARIANTS: every variant by name; s7's loops over it (the d128 time rows) see TIMED_D128 only."""

    def __iter__(self):
        return iter(TIMED_D128)


# name -> None (the product) or {"variant": GluonBackend.variant keys, "fields": spec fields, "patch": ..., "diag"}
# Round A (H100, /work/wt/results/fp8fwd-A.txt; TF/s causal / full, d128 s16k): product 838 / 866, the softmax under
# the P V 817 / 821, with the late O rescale 835 / 821, the late O rescale alone 825 / 782, with turns 825 / 819;
# d64 2 WGs 505 / 519, 3 WGs at block_n 128 563 / 599 (now the product: fp8_d64); bf16 617 / 603, with the softmax
# under the P V 602 / 577. Round B: the losers once more against the product, 3 WGs at block_n 64 with the softmax
# under the P V, d64's new product against main's and with the softmax under the P V, d64's GQA and window checks.
s7.VARIANTS = _Variants({
    "product": None,
    # the softmax in a block of its own, so ptxas waits for P_{n-1} V_{n-1} after it ([Note] fp8 softmax under the P V)
    "softmax under the P V": {"variant": {"fp8_pv_overlap": 1}},
    # three warpgroups at block_n 64 (ninth session: 823 / 819 against 825 / 854) with their softmax under the P V
    "3 WGs, block_n 64, softmax under the P V": {"variant": {"fp8_wgs": 3, "fp8_pv_overlap": 1},
                                                  "fields": {"block_n": 64}},
    "2 WGs (main's d64)": {"variant": {"fp8_d64": {}}},  # d64 only: the product before the flip
})
TIMED_D128 = ("product", "softmax under the P V", "3 WGs, block_n 64, softmax under the P V")
s7.D64_VARIANTS = ("product", "2 WGs (main's d64)", "softmax under the P V")
FULL_CHECKS = ("product", )  # GQA, window (d128 and d64)
s7.PHASE_TIMEOUT = {"build": 34, "check": 18, "cudnn": 12, "time": 30}
PEERS = {  # label -> cudnn-fp8 as fixed, and as main a69c293 drove it ([Note] What the cuDNN fp8 peer computes)
    "cudnn-fp8 fixed (P 64, checked on its own K', V')": dict(P_SCALE=64.0, O_TYPES=("bf16", "e4m3"),
                                                              own_inputs=True),
    "cudnn-fp8 main (P 256, O e4m3, checked on the per-head inputs)": dict(P_SCALE=256.0, O_TYPES=("e4m3", ),
                                                                           own_inputs=False),
}
TIMED_PEERS = tuple(PEERS)


def check_cases():
    cases = [(name, 128, c, None) for name in TIMED_D128 for c in s7.CHECKS]
    cases += [(name, 64, c, None) for name in s7.D64_VARIANTS for c in s7.CHECKS[:2]]
    return cases + [(name, d, c[:-1], c[-1]) for name in FULL_CHECKS for d in (128, 64) for c in s7.PRODUCT_CHECKS]


def jobs():
    out = [(mask, name, 128, False, 1) for name in TIMED_D128 for mask in s7.MASKS]
    out += [(mask, name, d, w is not None, gqa) for name, d, (mask, gqa, *_), w in check_cases() if gqa > 1 or w]
    out += [(mask, name, 64, False, 1) for name in s7.D64_VARIANTS for mask in s7.MASKS]
    return list(dict.fromkeys(out))


s7.check_cases = check_cases
s7.jobs = lambda: jobs() + [("bf16ov", m) for m in s7.MASKS]


def bf16_overlap(mask):
    """fagen's bf16 forward with the softmax under the P V (GluonBackend.variant pv_overlap 1)."""
    import fagen
    from fagen.runtime.loader import load_source
    sp = s7.spec_of(mask, "bf16")
    return load_source(s7.render_with(sp, {"pv_overlap": 1}), f"{sp.name}_pv_overlap")


def _job(job):
    if job[0] != "bf16ov":
        return s7._warm_bf16(job[1]) if job[0] == "bf16" else s7._warm(job)
    t = time.time()
    try:
        import torch
        m = bf16_overlap(job[1])
        q, k, v = (torch.randn(1, 1, 200, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        m.forward(q, k, v)
        torch.cuda.synchronize()
        return f"built bf16 softmax under the P V {job[1]} in {time.time() - t:.1f}s"
    except Exception as e:  # noqa: BLE001
        return f"build ERROR bf16 overlap {job[1]}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


s7._job = _job


def phase_check():
    """s7's fp8 checks, then fagen's bf16 forward with the softmax under the P V against float64 (the bench's bf16
    tolerance; lse too) at lengths off the blocks, causal Sq != Sk both ways and mask none, each called twice."""
    import torch
    from fagen.verify import reference
    from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare
    from fagen.spec.axes import DType
    for mask, b, h, sq, sk in (("causal", 1, 3, 1100, 1537), ("causal", 2, 2, 1537, 1000), ("none", 1, 2, 700, 1300)):
        label = f"bf16 {mask} b{b} h{h} sq{sq} sk{sk}"
        try:
            m = bf16_overlap(mask)
            g = torch.Generator(device="cuda").manual_seed(sq)
            q = torch.randn(b, h, sq, 128, device="cuda", generator=g).mul(2).to(torch.bfloat16)
            k, v = (torch.randn(b, h, sk, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
            ref_out, ref_lse = reference.attention(q.double(), k.double(), v.double(), mask=mask)
            worst = 0.0
            for _ in range(2):
                out, lse = m.forward(q, k, v)
                worst = max(worst, compare("out", out, ref_out, **TOLERANCE[DType.BF16]))
                seen = torch.isfinite(ref_lse)
                compare("lse", torch.where(seen, lse.double(), 0.0), torch.where(seen, ref_lse, 0.0), **LSE_TOLERANCE)
                assert torch.equal(torch.isfinite(lse), seen) and not out[~seen].any()
            s7.emit(section="check", variant="bf16 softmax under the P V", case=label, value="PASS",
                    note=f"max err {worst:.2e}")
        except Exception as e:  # noqa: BLE001
            s7.emit(section="check", variant="bf16 softmax under the P V", case=label, value="FAIL",
                    note=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    s7.phase_check()


def _peer(name, mask):
    """(Prepared, CaseContext) of the bench's fwd-fp8-d128-<mask>-s16k row for cudnn-fp8 configured as PEERS[name]."""
    import torch
    from fagen.bench import peer_cudnn_fp8 as peer
    from fagen.bench.cases import CaseContext
    from fagen.bench.workloads import standard_suite
    cfg = PEERS[name]
    if mask not in _peer.contexts:
        row = f"fwd-fp8-d128-{'causal' if mask == 'causal' else 'full'}-s16k"
        case = next(c for c in standard_suite() if c.name == row)
        _peer.contexts[mask] = CaseContext(case, torch.device("cuda"), 1)
    cc = _peer.contexts[mask]
    case = cc.case
    saved = peer.P_SCALE, peer.O_TYPES
    peer.P_SCALE, peer.O_TYPES = cfg["P_SCALE"], cfg["O_TYPES"]
    try:
        prepared = peer.prepare_cudnn_fp8(case, cc)
    finally:
        peer.P_SCALE, peer.O_TYPES = saved
    if not cfg["own_inputs"]:
        prepared.inputs = None
    return prepared, cc


_peer.contexts = {}


def phase_cudnn():
    """The bench's check (fagen/bench/check.py: out against float64 row slices of head 0, atol = rtol = 0.1) of
    each PEERS configuration."""
    from fagen.bench.check import check
    try:
        import cudnn
        s7.log(f"cudnn backend {cudnn.backend_version_string()}, frontend {getattr(cudnn, '__version__', '?')}")
    except Exception as e:  # noqa: BLE001
        s7.log(f"cudnn: {e!r}")
    for mask in s7.MASKS:
        for name in PEERS:
            try:
                prepared, cc = _peer(name, mask)
                status, msg, worst = check("cudnn-fp8", prepared, cc)
                s7.emit(section="check", variant=name, case=f"bench row {mask}",
                        value="PASS" if status == "ok" else "FAIL",
                        note=(f"max err {worst:.3g}" if worst is not None else msg[:230]) + f" | {prepared.note[-40:]}")
            except Exception as e:  # noqa: BLE001
                s7.emit(section="check", variant=name, case=f"bench row {mask}", value="FAIL",
                        note=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")


def phase_time():
    """cudnn-fp8 as fixed and as main had it, then s7's time phase (bf16, the TIMED_D128 variants, the product's
    kernel alone, d64), in the same process."""
    import torch
    import triton
    if s7.MOCK:
        s7.phase_time()
        return
    b, h, s, d = s7.TIME_SHAPE
    for mask in s7.MASKS:
        flops = 4 * b * h * s * s * d / (2 if mask == "causal" else 1)
        for name in TIMED_PEERS:
            try:
                prepared, cc = _peer(name, mask)
                st = cc.sets[0]
                prepared.fn(st)
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(lambda: prepared.fn(st), warmup=25, rep=150, return_mode="median")
                s7.emit(section="time", variant=name.split(" (")[0], mask=mask, value=round(flops / ms / 1e9, 1),
                        ms=round(ms, 4), note=prepared.note.split("per-tensor descales")[-1][-60:])
            except Exception as e:  # noqa: BLE001
                s7.emit(section="time", variant=name, mask=mask, value="ERROR",
                        note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    _peer.contexts.clear()  # the bench's inputs freed before fagen's rows
    torch.cuda.empty_cache()
    g = torch.Generator(device="cuda").manual_seed(1)
    x = [torch.randn((b, h, s, d), generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    import fagen
    for mask in s7.MASKS:  # bf16: the product and the softmax under the P V, side by side
        flops = 4 * b * h * s * s * d / (2 if mask == "causal" else 1)
        for name, m in (("bf16 product", fagen.load(s7.spec_of(mask, "bf16"))), ("bf16 softmax under the P V",
                                                                                  bf16_overlap(mask))):
            try:
                m.forward(*x)
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(lambda: m.forward(*x), warmup=25, rep=150, return_mode="median")
                s7.emit(section="time", variant=name, mask=mask, value=round(flops / ms / 1e9, 1), ms=round(ms, 4))
            except Exception as e:  # noqa: BLE001
                s7.emit(section="time", variant=name, mask=mask, value="ERROR",
                        note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    del x
    s7.phase_time()


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        {"build": s7.phase_build, "check": phase_check, "cudnn": phase_cudnn, "time": phase_time}[sys.argv[2]]()
        return
    env = child_env("/tmp/fagen-cache-gpu-fp8fwd-s10")
    rows = []
    phases = ("build", ) if s7.DRY else ("check", "time") if s7.MOCK else tuple(s7.PHASE_TIMEOUT)
    for name in phases:
        limit = s7.PHASE_TIMEOUT[name] * (10 if s7.DRY or s7.MOCK else 1)
        s7.log(f"#### phase {name} (timeout {limit}s, {time.time() - s7.T0:.0f}s so far)")

        def on_line(line):
            print(line, end="", flush=True)
            if line.startswith("ROW "):
                rows.append(s7.json.loads(line[4:]))
        rc, _ = run_child(__file__, name, limit, env, on_line)
        s7.log(f"#### phase {name}: rc={rc}")
    text = s7.table(rows)
    s7.log(text)
    s7.log(f"total {time.time() - s7.T0:.0f}s")
    out = os.environ.get("OUTX") or os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu_fp8fwd_s10.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
