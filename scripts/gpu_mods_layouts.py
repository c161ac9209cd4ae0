"""GPU checks and timings of user mods on the varlen, decode and paged layouts (README "User mods", issue 26):
each path against the float64 reference running the same Python functions, then timed beside the same kernel
without mods.

    PYTHONPATH=$PWD python3 scripts/gpu_mods_layouts.py     # about a minute on an H100; one PASS/FAIL line per
                                                             # check, then a table; a JSON log to $OUT if set
    GPU_MODS_LAYOUTS_DRY=1 python3 scripts/gpu_mods_layouts.py   # the same code on the CPU interpreter, tiny shapes

Paths (bf16, d128, GQA 4): varlen prefill forward and backward (dq, dk, dv and a learned relative bias's gradient)
with a relative-bias score_mod and a per-sequence document mask_mod; dense decode (1 and 4 queries) and paged
decode with a bias score_mod and a sliding-window mask_mod whose width is a closure int; paged (chunked) prefill with
both. Decode and paged kernels see q_idx = i + lk - lq (the query's position among its keys), varlen the row.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

DRY = os.environ.get("GPU_MODS_LAYOUTS_DRY") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from gpu_rows import CHECKS, T0, check, log  # noqa: E402
from gpu_rows import bench as _bench  # noqa: E402

import fagen  # noqa: E402
from fagen.spec.axes import DType  # noqa: E402
from fagen.verify import reference  # noqa: E402
from fagen.verify.layouts import cu_seqlens  # noqa: E402
from fagen.verify.tolerances import GRAD_TOLERANCE, LSE_TOLERANCE, TOLERANCE, compare  # noqa: E402

DEV = "cpu" if DRY else "cuda"
DT = torch.float32 if DRY else torch.bfloat16  # the interpreter's bf16 dots are wrong ([Note] Interpreter upcast)
DTYPE = "fp32" if DRY else "bf16"
TOL = TOLERANCE[DType(DTYPE)]
D = 32 if DRY else 128
HKV, GQA = (1, 2) if DRY else (4, 4)
HQ = HKV * GQA
L = (lambda n: max(1, n // 64)) if DRY else (lambda n: n)  # sequence lengths
ROWS: list[dict] = []


def bench(fn) -> float:
    return _bench(fn, DRY, warmup=10, rep=100)  # ms, median; one untimed call on the interpreter


def timed(path: str, case: str, mods_ms, plain_ms) -> None:
    ROWS.append(dict(path=path, case=case, mods_ms=mods_ms, plain_ms=plain_ms))
    log(f"{path:<14} {case:<40} mods {mods_ms:9.4f} ms  plain {plain_ms:9.4f} ms")


def rnd(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(DT)


# -- the mods ------------------------------------------------------------------------------------------------------
def relative_bias(bias, span):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + span]
    return score_mod


def documents(doc):
    def mask_mod(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]
    return mask_mod


def sliding(width):
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx < width) & (kv_idx <= q_idx)
    return mask_mod


def shifted(fn, b0, score):
    """fn of sequence b0 when the reference runs that sequence alone as batch entry 0."""
    if score:
        return lambda s, b, h, qi, ki: fn(s, b + b0, h, qi, ki)
    return lambda b, h, qi, ki: fn(b + b0, h, qi, ki)


# -- varlen prefill, forward and backward ------------------------------------------------------------------------
def varlen():
    lens = [L(1000), 0, L(2048), L(77), L(1531)]
    gen = torch.Generator(device=DEV).manual_seed(0)
    total, longest = sum(lens), max(lens)
    q, k, v, do = (rnd(total, h, D, gen=gen) for h in (HQ, HKV, HKV, HQ))
    cu = cu_seqlens(lens, DEV)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
    bias = (0.5 * torch.randn(HQ, 2 * longest, generator=gen, device=DEV)).requires_grad_()
    doc = (torch.rand(len(lens), longest, generator=gen, device=DEV) < 0.01).cumsum(1).to(torch.int32)
    score_mod, mask_mod = relative_bias(bias, longest), documents(doc)
    case = f"causal lens {lens} hq{HQ} hkv{HKV} d{D}"
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

    bm = fagen.create_block_mask(mask_mod, len(lens), None, longest, longest, device=DEV,
                                 block_size=16 if DRY else 128)

    def run(block_mask=None):
        return fagen.attention(qg, kg, vg, mask="causal", score_mod=score_mod, mask_mod=mask_mod,
                               block_mask=block_mask, **kw)

    def compare_all(block_mask=None):
        out = run(block_mask)
        grads = torch.autograd.grad(out, (qg, kg, vg, bias), do)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
        want, _ = reference.packed_attention(*leaves[:3], cu.cpu(), cu.cpu(), mask="causal",
                                             score_mod=relative_bias(leaves[3], longest), mask_mod=mask_mod)
        errs = [compare("out", out, want, **TOL)]
        wants = torch.autograd.grad(want, leaves, do.double())
        for name, got, ref in zip(("dq", "dk", "dv", "dbias"), grads, wants):
            unit = max(1.0, ref.abs().max().item())
            errs.append(compare(name, got, ref, atol=GRAD_TOLERANCE[DType(DTYPE)]["atol"] * unit,
                                rtol=GRAD_TOLERANCE[DType(DTYPE)]["rtol"]))
        again = torch.autograd.grad(run(block_mask), (qg, kg, vg, bias), do)
        if not all(torch.equal(a, b) for a, b in zip(grads, again)):
            raise AssertionError("gradients differ between two runs (not deterministic)")
        return "max errs " + " ".join(f"{e:.1e}" for e in errs) + "; bitwise repeatable"

    check(f"varlen fwd+bwd {case}", compare_all)
    check(f"varlen fwd+bwd with a block mask (sparsity {bm.sparsity():.2f}) {case}", lambda: compare_all(bm))

    def plain():
        return fagen.attention(qg, kg, vg, mask="causal", **kw)

    with torch.no_grad():
        fwd, fwd_plain, fwd_bm = bench(run), bench(plain), bench(lambda: run(bm))
    timed("varlen fwd", case, fwd, fwd_plain)
    timed("varlen fwd", case + " +block mask", fwd_bm, fwd_plain)
    step = lambda f: torch.autograd.grad(f(), (qg, kg, vg), do)  # noqa: E731
    # with mods the backward also computes the learned bias's gradient (bias requires grad): its workspace and sort
    timed("varlen fwd+bwd", case + " +dbias", bench(lambda: step(run)), bench(lambda: step(plain)))
    timed("varlen fwd+bwd", case + " +dbias +block mask", bench(lambda: step(lambda: run(bm))),
          bench(lambda: step(plain)))


# -- decode, dense and paged -------------------------------------------------------------------------------------
_SCORE = "(score + bias[h, ((q_idx - kv_idx) + span)])"
_WINDOW = "(((q_idx - kv_idx) < width) & (kv_idx <= q_idx))"
_DECLS = dict(score_mod=_SCORE, mask_mod=_WINDOW, mod_tensors=[["bias", "fp32", 2]],
              mod_scalars=[["span", "int"], ["width", "int"]])


def decode_dense():
    b, sk = (2, L(4096)) if DRY else (32, 4096)
    gen = torch.Generator(device=DEV).manual_seed(1)
    k, v = rnd(b, HKV, sk, D, gen=gen), rnd(b, HKV, sk, D, gen=gen)
    bias = 0.5 * torch.randn(HQ, 2 * sk, generator=gen, device=DEV)
    values = dict(bias=bias, span=sk, width=L(1024))
    fns = dict(score_mod=relative_bias(bias, sk), mask_mod=sliding(values["width"]))
    for sq in (1, 4):
        q = rnd(b, HQ, sq, D, gen=gen)
        case = f"b{b} sq{sq} sk{sk} hq{HQ} hkv{HKV} d{D}"
        module = fagen.load(fagen.KernelSpec(head_dim=D, gqa=GQA, dtype=DTYPE, kind="decode", **_DECLS))
        plain = fagen.load(fagen.KernelSpec(head_dim=D, gqa=GQA, dtype=DTYPE, kind="decode"))

        def compare_slice(q=q):
            n = 2  # two sequences, every head: the reference's float64 scores stay small
            out, lse = module.forward(q, k, v, mods=values)
            want, want_lse = reference.attention(q[:n].double(), k[:n].double(), v[:n].double(),
                                                 mod_positions="absolute", **fns)
            errs = (compare("out", out[:n], want, **TOL), compare("lse", lse[:n], want_lse, **LSE_TOLERANCE))
            for splits in (1, 7):
                o, _ = module.forward_split(q[:n], k[:n], v[:n], mods=values, num_splits=splits)
                compare(f"out ({splits} splits)", o, want, **TOL)
            return f"max errs {errs[0]:.1e} {errs[1]:.1e}"

        check(f"decode dense {case}", compare_slice)
        timed("decode dense", case, bench(lambda: module.forward(q, k, v, mods=values)),
              bench(lambda: plain.forward(q, k, v)))


def paged_cache(ks, vs, page, gen):
    n_pages = [-(-x.shape[0] // page) for x in ks]
    total = sum(n_pages) + 2
    order = torch.randperm(total, generator=torch.Generator().manual_seed(2))
    table = torch.full((len(ks), max(n_pages) + 1), -1, dtype=torch.int32)
    k_cache = torch.full((total, page, HKV, D), float("nan"), dtype=DT, device=DEV)
    v_cache = torch.full_like(k_cache, float("nan"))
    nxt = 0
    for b, n in enumerate(n_pages):
        table[b, :n] = order[nxt:nxt + n]
        nxt += n
        idx = torch.arange(ks[b].shape[0])
        rows, slot = table[b, idx // page].long().to(DEV), (idx % page).to(DEV)
        k_cache[rows, slot], v_cache[rows, slot] = ks[b], vs[b]
    return k_cache, v_cache, table.to(DEV)


def decode_paged():
    b, page, top = (3, 4, L(4096)) if DRY else (32, 16, 4096)
    gen = torch.Generator(device=DEV).manual_seed(3)
    lens = [top, 0, 1, *torch.randint(1, top + 1, (b - 3,), generator=torch.Generator().manual_seed(4)).tolist()]
    lens = lens[:b]
    ks = [rnd(n, HKV, D, gen=gen) for n in lens]
    vs = [rnd(n, HKV, D, gen=gen) for n in lens]
    k_cache, v_cache, table = paged_cache(ks, vs, page, gen)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    bias = 0.5 * torch.randn(HQ, 2 * top, generator=gen, device=DEV)
    values = dict(bias=bias, span=top, width=L(1024))
    fns = dict(score_mod=relative_bias(bias, top), mask_mod=sliding(values["width"]))
    q = rnd(b, HQ, 1, D, gen=gen)
    case = f"b{b} page{page} sk<={top} hq{HQ} hkv{HKV} d{D}"
    module = fagen.load(fagen.KernelSpec(head_dim=D, gqa=GQA, dtype=DTYPE, kind="decode", layout="paged", **_DECLS))
    plain = fagen.load(fagen.KernelSpec(head_dim=D, gqa=GQA, dtype=DTYPE, kind="decode", layout="paged"))
    kw = dict(block_table=table, seqlens_k=seqlens)

    def compare_some():
        out, lse = module.forward(q, k_cache, v_cache, mods=values, **kw)
        worst = 0.0
        for i in range(min(b, 4)):
            want, want_lse = reference.attention(q[i:i + 1].double(), ks[i].transpose(0, 1)[None].double(),
                                                 vs[i].transpose(0, 1)[None].double(), mod_positions="absolute",
                                                 score_mod=shifted(fns["score_mod"], i, True),
                                                 mask_mod=shifted(fns["mask_mod"], i, False))
            worst = max(worst, compare(f"out {i}", out[i:i + 1], want, **TOL))
            compare(f"lse {i}", lse[i:i + 1], want_lse, **LSE_TOLERANCE)
        return f"max err {worst:.1e} (sequences 0..3: lengths {lens[:4]})"

    check(f"decode paged {case}", compare_some)
    timed("decode paged", case, bench(lambda: module.forward(q, k_cache, v_cache, mods=values, **kw)),
          bench(lambda: plain.forward(q, k_cache, v_cache, **kw)))


# -- paged (chunked) prefill ---------------------------------------------------------------------------------------
def paged_prefill():
    lens_q = [L(512), 0, L(300), L(1024)]
    lens_k = [n + extra for n, extra in zip(lens_q, (L(1000), 5, 0, L(2000)))]
    page = 4 if DRY else 16
    gen = torch.Generator(device=DEV).manual_seed(5)
    ks = [rnd(n, HKV, D, gen=gen) for n in lens_k]
    vs = [rnd(n, HKV, D, gen=gen) for n in lens_k]
    k_cache, v_cache, table = paged_cache(ks, vs, page, gen)
    q = rnd(sum(lens_q), HQ, D, gen=gen)
    top = max(lens_k)
    bias = 0.5 * torch.randn(HQ, 2 * top, generator=gen, device=DEV)
    values = dict(bias=bias, span=top, width=L(700))
    fns = dict(score_mod=relative_bias(bias, top), mask_mod=sliding(values["width"]))
    cu_q = cu_seqlens(lens_q, DEV)
    kw = dict(cu_seqlens_q=cu_q, max_seqlen_q=max(lens_q), block_table=table,
              seqlens_k=torch.tensor(lens_k, dtype=torch.int32, device=DEV))
    tiles = dict(block_m=16, block_n=16) if DRY else dict(block_n=64, num_stages=2)  # [Note] Modded tiles
    case = f"causal lens_q {lens_q} lens_k {lens_k} page{page}"
    module = fagen.load(fagen.KernelSpec(head_dim=D, gqa=GQA, dtype=DTYPE, layout="paged", mask="causal", **tiles,
                                         **_DECLS))
    plain = fagen.load(fagen.KernelSpec(head_dim=D, gqa=GQA, dtype=DTYPE, layout="paged", mask="causal"))

    def compare_all():
        out, lse = module.forward(q, k_cache, v_cache, mods=values, **kw)
        want, want_lse = reference.packed_attention(q.double(), torch.cat(ks).double(), torch.cat(vs).double(),
                                                    cu_q.cpu(), cu_seqlens(lens_k, "cpu"), mask="causal",
                                                    mod_positions="absolute", **fns)
        errs = (compare("out", out, want, **TOL), compare("lse", lse, want_lse, **LSE_TOLERANCE))
        return f"max errs {errs[0]:.1e} {errs[1]:.1e}"

    check(f"paged prefill {case}", compare_all)
    timed("paged prefill", case, bench(lambda: module.forward(q, k_cache, v_cache, mods=values, **kw)),
          bench(lambda: plain.forward(q, k_cache, v_cache, **kw)))


def main() -> int:
    log(f"device {torch.cuda.get_device_name() if DEV == 'cuda' else 'cpu (interpreter)'}, dtype {DTYPE}")
    for part in (varlen, decode_dense, decode_paged, paged_prefill):
        try:
            part()
        except Exception as e:  # noqa: BLE001 - a broken part is a FAIL line; the others still run
            CHECKS.append((part.__name__, False, str(e).splitlines()[0][:200]))
            print(f"FAIL {part.__name__}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            traceback.print_exc(file=sys.stderr)
    print("\n| path | case | with mods (ms) | without (ms) | ratio |\n|---|---|---|---|---|")
    for r in ROWS:
        print(f"| {r['path']} | {r['case']} | {r['mods_ms']:.4f} | {r['plain_ms']:.4f} | "
              f"{r['mods_ms'] / r['plain_ms']:.2f} |")
    failed = [c for c in CHECKS if not c[1]]
    print(f"\n{len(CHECKS) - len(failed)} PASS, {len(failed)} FAIL, {time.time() - T0:.0f} s")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_mods_layouts.json"), "w") as f:
            json.dump(dict(checks=CHECKS, rows=ROWS, dry=DRY), f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
