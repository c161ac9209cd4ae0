"""GPU check and timing of user score_mods in the Gluon (sm_90) forward (docs/mods.md, "Gluon"; issue 26).

    PYTHONPATH=$PWD python3 scripts/gpu_gluon_mods.py    # H100/H200; about 1-2 minutes; one PASS/FAIL line per
                                                          # check, then one table; a JSON log to $OUT if set

Checks (d128 bf16, B1 H16 S4096, causal and full): the gluon modded forward's out and lse against fagen.verify's
float64 reference running the same Python functions, for a tanh softcap (closure float), ALiBi (captured slopes
tensor), a relative-position bias (captured [H, 2S - 1] tensor, its offset a closure int) and a bias from h and the
positions alone; then the softcap with its closure number changed, which must not compile a new kernel.
Timing (S8192): the gluon modded forward against fagen.attention's Triton modded forward (no gradient, so the
forward alone), and each backend's plain forward beside them, in TF/s (causal counts half the pairs).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

from gpu_rows import CHECKS, T0, check, log

import fagen
from fagen.runtime.mods import prepare
from fagen.spec.axes import DType
from fagen.spec.kernel import KernelSpec
from fagen.verify import reference
from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare

os.environ.setdefault("FAGEN_HOPPER", "1")
B, H, D, S_CHECK, S_TIME = 1, 16, 128, 4096, 8192
DT = torch.bfloat16
TOL = TOLERANCE[DType.BF16]
ROWS: list[dict] = []


def mods_of(seq: int, gen) -> dict:
    """name -> score_mod at sequence length `seq` (closures as attention-gym's factories write them)."""
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, device="cuda", dtype=torch.float32) / H)
    bias = torch.randn(H, 2 * seq - 1, device="cuda", dtype=torch.float32, generator=gen)
    cap = 30.0
    off = seq - 1

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + off]

    def head_bias(score, b, h, q_idx, kv_idx):
        return score - (h + 1) * 0.01 * torch.abs(q_idx - kv_idx) / 64

    return {"softcap": softcap, "alibi": alibi, "rel_bias": rel_bias, "head_bias": head_bias}


def gluon_module(fn, mask: str):
    m = prepare(score_mod=fn)
    score, _, tensors, scalars = m.fields
    spec = KernelSpec(backend="gluon", head_dim=D, dtype="bf16", mask=mask, score_mod=score,
                      mod_tensors=[list(t) for t in tensors], mod_scalars=[list(s) for s in scalars])
    return fagen.load(spec), m.values, spec


def compiled_count(module) -> int:
    """Compiled kernels held by the module's gluon JIT function (-1 where this triton hides them)."""
    fn = module._attn_fwd_hopper
    try:
        return sum(len(c[0]) for c in fn.device_caches.values())
    except Exception:  # noqa: BLE001
        return -1


def qkv(seq: int, gen):
    return [torch.randn(B, H, seq, D, device="cuda", dtype=DT, generator=gen) for _ in range(3)]


def run_checks() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = qkv(S_CHECK, gen)
    fns = mods_of(S_CHECK, gen)
    for mask in ("causal", "none"):
        for name, fn in fns.items():
            def one(fn=fn, mask=mask):
                module, values, spec = gluon_module(fn, mask)
                out, lse = module.forward(q, k, v, mods=values)
                torch.cuda.synchronize()
                want, want_lse = reference.attention(q, k, v, mask=mask, score_mod=fn)
                e = compare("out", out, want, **TOL)
                el = compare("lse", lse, want_lse, **LSE_TOLERANCE)
                return f"({spec.name}: out err {e:.2e}, lse err {el:.2e})"
            check(f"gluon {name:<9} {mask:<6} S{S_CHECK} vs float64", one)
            torch.cuda.empty_cache()

    def scalar_change():
        cap = 30.0

        def softcap(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

        module, values, _ = gluon_module(softcap, "causal")
        module.forward(q, k, v, mods=values)
        before = compiled_count(module)
        cap = 5.0  # noqa: F841 - read by softcap's closure
        m = prepare(score_mod=softcap)
        assert m.values["cap"] == 5.0, m.values
        out, lse = module.forward(q, k, v, mods=m.values)
        torch.cuda.synchronize()
        after = compiled_count(module)
        assert before == after, f"compiled kernels {before} -> {after}: a closure number recompiled"
        want, want_lse = reference.attention(q, k, v, mask="causal", score_mod=softcap)
        e = compare("out", out, want, **TOL)
        compare("lse", lse, want_lse, **LSE_TOLERANCE)
        return f"(cap 30 -> 5: compiled kernels {before} -> {after}, out err {e:.2e})"
    check("gluon softcap closure scalar changed: same kernel, right values", scalar_change)


def tflops(ms: float, seq: int, mask: str) -> float:
    flops = 4 * B * H * seq * seq * D * (0.5 if mask == "causal" else 1.0)
    return flops / ms / 1e9


def run_timing() -> None:
    from triton.testing import do_bench

    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = qkv(S_TIME, gen)
    fns = mods_of(S_TIME, gen)
    for mask in ("causal", "none"):
        try:
            g = fagen.load(KernelSpec(backend="gluon", head_dim=D, dtype="bf16", mask=mask))
            t = fagen.load(KernelSpec(head_dim=D, dtype="bf16", mask=mask))
            gms = do_bench(lambda: g.forward(q, k, v), warmup=5, rep=50)
            tms = do_bench(lambda: t.forward(q, k, v), warmup=5, rep=50)
            ROWS.append(dict(mod="(none)", mask=mask, gluon=tflops(gms, S_TIME, mask), triton=tflops(tms, S_TIME, mask),
                             gluon_spec=g.NAME, triton_spec=t.NAME))
        except Exception as e:  # noqa: BLE001
            log(f"plain {mask}: {type(e).__name__}: {e}")
        for name, fn in fns.items():
            try:
                module, values, _ = gluon_module(fn, mask)
                gms = do_bench(lambda: module.forward(q, k, v, mods=values), warmup=5, rep=50)
                with torch.no_grad():
                    fagen.attention(q, k, v, mask=mask, score_mod=fn)
                    tms = do_bench(lambda: fagen.attention(q, k, v, mask=mask, score_mod=fn), warmup=5, rep=50)
                from fagen.runtime import modded

                fields = prepare(score_mod=fn).fields
                tname = next((m.NAME for key, (m, _) in modded._MODULES.items()
                              if key[1] == fields and ("_causal_" in m.NAME) == (mask == "causal")), "")
                ROWS.append(dict(mod=name, mask=mask, gluon=tflops(gms, S_TIME, mask),
                                 triton=tflops(tms, S_TIME, mask), gluon_spec=module.NAME, triton_spec=tname))
            except Exception as e:  # noqa: BLE001
                log(f"timing {name} {mask}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                traceback.print_exc(file=sys.stderr)
            log(f"timed {name} {mask}")


def main() -> int:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    log(f"device {name}, triton {__import__('triton').__version__}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm_90 GPU (H100/H200)")
        return 2
    run_checks()
    run_timing()
    print(f"\nGluon vs Triton modded forward, d{D} bf16 B{B} H{H} S{S_TIME}, TF/s ({name})")
    print(f"{'score_mod':<10} {'mask':<7} {'gluon':>7} {'triton':>7} {'gluon/triton':>12}  gluon / triton spec")
    for r in ROWS:
        print(f"{r['mod']:<10} {r['mask']:<7} {r['gluon']:7.1f} {r['triton']:7.1f} {r['gluon'] / r['triton']:12.3f}  "
              f"{r['gluon_spec']} / {r['triton_spec']}")
    passed = sum(ok for _, ok, _ in CHECKS)
    print(f"\nchecks: {passed}/{len(CHECKS)} passed; {time.time() - T0:.0f} s")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_gluon_mods.json"), "w") as f:
            json.dump(dict(device=name, checks=CHECKS, rows=ROWS), f, indent=1)
    return 0 if passed == len(CHECKS) else 1


if __name__ == "__main__":
    sys.exit(main())
