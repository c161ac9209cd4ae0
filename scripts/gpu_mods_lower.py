"""GPU check and timing of mod lowering (fagen/mods/lower.py, issue 26: "a built-in switch written as a mod runs
within 5% of the switch kernel").

    PYTHONPATH=$PWD python3 scripts/gpu_mods_lower.py          # H100/H200, about 1-2 minutes; one PASS/FAIL line
                                                                # per check, then one table; a JSON log to $OUT if set
    GPU_MODS_LOWER_DRY=1 python3 scripts/gpu_mods_lower.py     # the same code on the CPU interpreter, tiny shapes
    GPU_MODS_LOWER_FLEX=0 ...                                   # without FlexAttention

Rows (bf16, d128, B1 H16 S8192; attention-gym's functions from fagen/bench/gym_mods.py): the causal mask
(mask="causal" against mask_mod=causal_mask with its block mask), the tanh softcap (softcap=30.0 against
generate_tanh_softcap(30.0)) and the sliding window (mask="causal", window=(1024, 0) against
generate_sliding_window(1024) with its block mask, and FlexAttention with flex's block mask). Each mod runs lowered
(the default) and unlowered (fagen.mods.lower.ENABLED = False), forward without gradients and forward+backward.
Checks: a lowered call is served by the switch kernel (its out and dq, dk, dv are the switch call's bits, and it
says what it became); an unlowered one agrees with the switch kernel within bf16's tolerance. The table gives ms,
useful TF/s (4 * D per visible pair forward, 3.5x that forward+backward) and the time against the switch kernel.
Then the host time per call of the switch call and of the lowered mods (S256, no gradient), and the sliding
window's closure number changed on every call (no gradient), lowered and unlowered: kernel variants compiled in
the loop and host time per call against an unchanged number.
"""

from __future__ import annotations

import json
import os
import sys
import time

DRY = os.environ.get("GPU_MODS_LOWER_DRY") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from gpu_rows import CHECKS, T0, check, log  # noqa: E402
from gpu_rows import bench as _bench  # noqa: E402

import fagen  # noqa: E402
from fagen.bench import gym_mods as g  # noqa: E402
from fagen.mods import lower as lowering  # noqa: E402
from fagen.runtime import modded  # noqa: E402
from fagen.spec.axes import DType  # noqa: E402
from fagen.verify.tolerances import GRAD_TOLERANCE, TOLERANCE  # noqa: E402

DEV = "cpu" if DRY else "cuda"
DT = torch.float32 if DRY else torch.bfloat16  # the interpreter's bf16 dots are wrong
DTYPE = "fp32" if DRY else "bf16"
B, H, S, D = (1, 2, 80, 32) if DRY else (1, 16, 8192, 128)
WIN = 9 if DRY else 1024
S_HOST = S if DRY else 1024  # the changed-number loop's sequence, short enough that the host bounds a call
CAP = 30.0
FLEX = not DRY and os.environ.get("GPU_MODS_LOWER_FLEX", "1") != "0"
ROWS: list[dict] = []


def bench(fn) -> float:
    return _bench(fn, DRY, warmup=10, rep=100)  # ms, median; one untimed call on the interpreter


def pairs(case: str) -> int:
    """Visible (query, key) pairs per (b, h)."""
    if case == "softcap":
        return S * S
    if case == "causal":
        return S * (S + 1) // 2
    return sum(min(i, WIN) + 1 for i in range(S))  # causal, window (WIN, 0)


def inputs():
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, H, S, D, generator=gen).to(DEV, DT) for _ in range(4))
    return [t.requires_grad_() for t in (q, k, v)] + [do]


def run_all(q, k, v, do, attend):
    """(out without grad, (out, dq, dk, dv) with grad) of one way to attend, and what each call's mods were
    lowered to (None: not lowered)."""
    with torch.no_grad():
        fwd = attend(q, k, v)
    labels = [modded.LOWERED[0]]
    out = attend(q, k, v)
    labels.append(modded.LOWERED[0])
    return fwd, (out, *torch.autograd.grad(out, (q, k, v), do)), labels


def timed(case, impl, lowered_to, q, k, v, do, attend, switch_ms):
    def fwd():
        with torch.no_grad():
            attend(q, k, v)

    def fwd_bwd():
        out = attend(q, k, v)
        torch.autograd.grad(out, (q, k, v), do)

    ms = (bench(fwd), bench(fwd_bwd))
    flops = 4.0 * D * B * H * pairs(case)
    ROWS.append(dict(case=case, impl=impl, lowered_to=lowered_to, fwd_ms=ms[0], fwd_bwd_ms=ms[1],
                     fwd_tfs=flops / ms[0] / 1e9, fwd_bwd_tfs=3.5 * flops / ms[1] / 1e9,
                     fwd_x=ms[0] / switch_ms[0] if switch_ms else 1.0,
                     fwd_bwd_x=ms[1] / switch_ms[1] if switch_ms else 1.0))
    r = ROWS[-1]
    log(f"{case} {impl}: fwd {r['fwd_ms']:.3f} ms ({r['fwd_tfs']:.0f} TF/s, {r['fwd_x']:.3f}x switch), fwd+bwd "
        f"{r['fwd_bwd_ms']:.3f} ms ({r['fwd_bwd_tfs']:.0f} TF/s, {r['fwd_bwd_x']:.3f}x switch)")
    return ms


def case_rows(case, switch_kw, mod_kw, flex_mods):
    q, k, v, do = inputs()
    attend_switch = lambda q, k, v: fagen.attention(q, k, v, **switch_kw)  # noqa: E731
    attend_mod = lambda q, k, v: fagen.attention(q, k, v, **mod_kw)  # noqa: E731
    want = run_all(q, k, v, do, attend_switch)
    switch_ms = timed(case, "switch kernel", "-", q, k, v, do, attend_switch, None)
    tol, gtol = TOLERANCE[DType(DTYPE)]["atol"], GRAD_TOLERANCE[DType(DTYPE)]["atol"]  # bf16: 2e-2 (values ~1)
    for on in (True, False):
        lowering.ENABLED = on
        try:
            got = run_all(q, k, v, do, attend_mod)
            labels = got[2]
            label = labels[1] if labels[0] == labels[1] else f"{labels[0] or 'not lowered'} / {labels[1]}"
            pairs_ = list(zip((got[0], *got[1]), (want[0], *want[1])))
            diffs = [(a.float() - b.float()).abs().max().item() for a, b in pairs_]
            scales = [max(1.0, b.float().abs().max().item()) for _, b in pairs_]  # the grads' own size
            bounds = [tol * m for m in scales[:2]] + [gtol * m for m in scales[2:]]

            def verdict(labels=labels, diffs=diffs, bounds=bounds, on=on):
                note = f"lowered to {labels[0]} (no grad) / {labels[1]} (grad); max diff out {diffs[0]:.1e} " \
                       f"(grad {diffs[1]:.1e}), dq dk dv {max(diffs[2:]):.1e}"
                if on:  # a lowered call is the switch kernel's bits; one kept as a mod (gluon forward) within tol
                    assert labels[1] is not None, f"not lowered: {note}"
                    assert max(diffs[1:]) == 0, f"not the switch kernel's bits: {note}"
                    assert diffs[0] == 0 if labels[0] else diffs[0] < bounds[0], note
                else:
                    assert labels == [None, None], f"lowered with lowering off: {note}"
                    assert all(d < b for d, b in zip(diffs, bounds)), note
                return note

            check(f"{case} mod {'lowered' if on else 'unlowered'} vs switch", verdict)
            timed(case, "mod, lowered" if on else "mod, unlowered", label or "-", q, k, v, do, attend_mod,
                  switch_ms)
        finally:
            lowering.ENABLED = True
    if FLEX and flex_mods is not None:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = torch.compile(flex_attention, dynamic=False)
        score_mod, mask_mod = flex_mods
        bm = None if mask_mod is None else create_block_mask(mask_mod, None, None, S, S, device=DEV)
        attend_flex = lambda q, k, v: compiled(q, k, v, score_mod=score_mod, block_mask=bm)  # noqa: E731
        got = run_all(q, k, v, do, attend_flex)
        diff = (got[0].float() - want[0].float()).abs().max().item()

        def flex_verdict():
            assert diff < tol, f"max diff out {diff:.1e}"
            return f"max diff out {diff:.1e}"

        check(f"{case} flex vs switch", flex_verdict)
        timed(case, "flex", "-", q, k, v, do, attend_flex, switch_ms)


def changed_window():
    """A closure window number changed on every call (the bench's changed-scalar row: S 1024, no gradient):
    kernel variants compiled during the loop and host time per call against an unchanged number, lowered (the
    switch kernels, whose window ints Triton specialises by value class: 1, a multiple of 16, other) and unlowered
    (the modded kernels, which list their ints in do_not_specialize)."""
    from fagen.bench.mods import _compiled_kernels

    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, H, S_HOST, D, generator=gen).to(DEV, DT) for _ in range(3))  # host-bound calls
    widths = [WIN + 3, WIN + 5, WIN + 16 - WIN % 16, WIN + 7, 1, 2, WIN + 32 - WIN % 16, WIN + 9] * (1 if DRY else 25)
    for on in (True, False):
        lowering.ENABLED = on
        try:
            with torch.no_grad():
                fixed = g.generate_sliding_window(WIN + 3)
                fagen.attention(q, k, v, mask_mod=fixed)
                before = _compiled_kernels() if not DRY else 0
                times = {}
                for label, fns in (("unchanged", [fixed] * len(widths)),
                                   ("changed", [g.generate_sliding_window(w) for w in widths])):
                    if DEV == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for fn in fns:
                        fagen.attention(q, k, v, mask_mod=fn)
                    times[label] = (time.perf_counter() - t0) / len(fns) * 1e6
                    if DEV == "cuda":
                        torch.cuda.synchronize()
                compiled = (_compiled_kernels() if not DRY else 0) - before
                label = modded.LOWERED[0]
            log(f"changed window, lowering {'on' if on else 'off'} (last: {label}): {compiled} kernel variants "
                f"compiled in the loop; host {times['changed']:.0f} us/call changed, {times['unchanged']:.0f} "
                f"unchanged ({times['changed'] / times['unchanged']:.2f}x)")
            SCALARS.append(dict(lowering=on, compiled=compiled, changed_us=times["changed"],
                                unchanged_us=times["unchanged"]))
        finally:
            lowering.ENABLED = True


SCALARS: list[dict] = []
HOST: list[dict] = []


def host_times():
    """Host time per call (no gradient, S 256 so that the host bounds a call; dry: the interpreter's launch stubbed
    out) of the switch call and of the same mods lowered: medians of 200 interleaved batches of 20 calls."""
    import statistics

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, 256 if not DRY else S, D, generator=gen).to(DEV, DT) for _ in range(3))
    window, cap = g.generate_sliding_window(WIN), g.generate_tanh_softcap(CAP)
    pairs = [("causal", dict(mask="causal"), dict(mask_mod=g.causal_mask)),
             ("sliding-window+causal", dict(mask="causal", window=(WIN, 0)), dict(mask_mod=window)),
             ("softcap", dict(softcap=CAP), dict(score_mod=cap))]
    stub = None
    if DRY:
        import triton.runtime.interpreter as interpreter

        stub = interpreter.InterpretedFunction.run
        interpreter.InterpretedFunction.run = lambda *a, **kw: None
    try:
        with torch.no_grad():
            for case, switch_kw, mod_kw in pairs:
                calls = [lambda: fagen.attention(q, k, v, **switch_kw), lambda: fagen.attention(q, k, v, **mod_kw)]
                for fn in calls * 20:
                    fn()
                got = ([], [])
                for _ in range(200):
                    for fn, out in zip(calls, got):
                        t0 = time.perf_counter()
                        for _ in range(20):
                            fn()
                        out.append((time.perf_counter() - t0) / 20 * 1e6)
                if DEV == "cuda":
                    torch.cuda.synchronize()
                a, b = statistics.median(got[0]), statistics.median(got[1])
                HOST.append(dict(case=case, switch_us=a, lowered_us=b, lowered_to=modded.LOWERED[0]))
                log(f"host {case}: switch {a:.1f} us/call, lowered mod {b:.1f} us/call (+{b - a:.1f} us)")
    finally:
        if stub is not None:
            interpreter.InterpretedFunction.run = stub


def block_mask(mask_mod):
    return fagen.create_block_mask(mask_mod, None, None, S, S, device=DEV, block_size=16 if DRY else 128)


def main() -> int:
    log(f"device {torch.cuda.get_device_name() if DEV == 'cuda' else 'cpu (interpreter)'}, dtype {DTYPE}, "
        f"B{B} H{H} S{S} D{D}, window {WIN}")
    causal, window = g.causal_mask, g.generate_sliding_window(WIN)
    cases = [
        ("causal", dict(mask="causal"), dict(mask_mod=causal, block_mask=block_mask(causal)), None),
        ("softcap", dict(softcap=CAP), dict(score_mod=g.generate_tanh_softcap(CAP)), None),
        ("sliding-window+causal", dict(mask="causal", window=(WIN, 0)),
         dict(mask_mod=window, block_mask=block_mask(window)), (None, window)),
    ]
    for case in cases:
        try:
            case_rows(*case)
        except Exception as e:  # noqa: BLE001 - a broken case is a FAIL line; the others still run
            CHECKS.append((case[0], False, str(e).splitlines()[0][:200] if str(e) else type(e).__name__))
            print(f"FAIL {case[0]}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                  flush=True)
            import traceback

            traceback.print_exc(file=sys.stderr)
    for part in (host_times, changed_window):
        try:
            part()
        except Exception as e:  # noqa: BLE001
            print(f"FAIL {part.__name__}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                  flush=True)
    print("\n| host time per call | switch us | lowered mod us | extra us | lowered to |\n|---|---|---|---|---|")
    for r in HOST:
        extra = r["lowered_us"] - r["switch_us"]
        print(f"| {r['case']} | {r['switch_us']:.1f} | {r['lowered_us']:.1f} | {extra:.1f} | {r['lowered_to']} |")
    print("\n| case | impl | lowered to | fwd ms | fwd TF/s | fwd x switch | fwd+bwd ms | fwd+bwd TF/s | "
          "fwd+bwd x switch |\n|---|---|---|---|---|---|---|---|---|")
    for r in ROWS:
        print(f"| {r['case']} | {r['impl']} | {r['lowered_to']} | {r['fwd_ms']:.3f} | {r['fwd_tfs']:.0f} | "
              f"{r['fwd_x']:.3f} | {r['fwd_bwd_ms']:.3f} | {r['fwd_bwd_tfs']:.0f} | {r['fwd_bwd_x']:.3f} |")
    print("\n| changed window number | kernel variants compiled | host us/call changed | unchanged | ratio |\n"
          "|---|---|---|---|---|")
    for r in SCALARS:
        print(f"| lowering {'on' if r['lowering'] else 'off'} | {r['compiled']} | {r['changed_us']:.0f} | "
              f"{r['unchanged_us']:.0f} | {r['changed_us'] / r['unchanged_us']:.2f}x |")
    failed = [c for c in CHECKS if not c[1]]
    print(f"\n{len(CHECKS) - len(failed)} PASS, {len(failed)} FAIL, {time.time() - T0:.0f} s")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_mods_lower.json"), "w") as f:
            json.dump(dict(checks=CHECKS, rows=ROWS, changed_window=SCALARS, host=HOST, dry=DRY), f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
