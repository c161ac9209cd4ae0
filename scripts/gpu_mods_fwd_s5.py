"""The modded forward against FlexAttention, row by row, with the variants that might lift each row to issue 26's
forward target (>= 1.3x Flex): bf16, d128, B1 H16 S8192, the bench's mods (fagen/bench/mods.py cases()), Flex
compiled with its own block mask of the same mask_mod, as `fagen bench --suite mods` runs it.

    PYTHONPATH=$PWD python3 scripts/gpu_mods_fwd_s5.py [--rows alibi,dilated] [--rep-ms 30]   # H100, < 100 s
    GPU_MODS_FWD_S5_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_mods_fwd_s5.py   # CPU interpreter, tiny, no Flex

Every variant's output is checked against Flex's (max |diff| / max |Flex|, <= 2e-2) before it is timed; a variant
that fails the check is printed as FAIL and not timed. TF/s counts visible pairs (4 * D per pair), as the bench.
Variants (the label in the table; `strided`, `varlen` and `split` are what `attention` lowers to on this branch,
their functions below kept as the prototypes the lowerings were written from):
  attention        fagen.attention(q, k, v, score_mod=, mask_mod=, block_mask=) without gradient (the bench's column)
  alibi: slopes    the gym ALiBi with its h-only factor exp2(-(h + 1) * 8 / H) evaluated on the host into a float32
                   [H] tensor: `score + (kv_idx - q_idx) * slopes[h]` (the Gluon modded forward)
         split     `score + kv_idx * s - q_idx * s` (s = the gym's factor): the int -> float conversions on the
                   row and column vectors, not per element
         fsplit    `score + ((kv_idx + 0.0) - q_idx) * s`: the same value as the gym's (positions < 2**24), the
                   conversions on the vectors
         colonly   `score + kv_idx * s` (the row term dropped: the same softmax, another lse; a bound only)
         plain     no mod at all (the ceiling)
  window: gluon    the causal + window(1024, 0) switch on the Gluon forward (hopper.MIN_WORK lifted)
          tXXX     the Triton window switch kernel at tile XXX (fagen.load of a fwd spec)
          modded   the modded kernel (lowering off) at its forward tile
          1loop    the switch kernel with one masked key loop over [lo, hi) (a template variant: one software
                   pipeline instead of three, the mask on every block)
          edges-s1 the switch kernel with its masked edge loops unpipelined (num_stages=1, as the tree tail)
  dilated: strided the dilated window as window(W/d, W/d) over d strided subsequences (q[:, :, r::d] is
                   [B*H, d, S/d, D] as a view; one fagen.attention call), then back to [B, H, S, D]
           strided+copy  the same on contiguous copies of q, k, v (what the strides cost)
  prefix-lm: modded the modded kernel (lowering off; `attention` lowers to the split since [Note] Prefix rows)
             split rows < P: mask none over keys < P; rows >= P: causal (bottom-right) over all keys; two calls
             and a torch.cat
             tXXX  the modded forward at tile XXX
  document+causal: modded  the modded kernel (lowering off; `attention` lowers to varlen since [Note] Documents)
                   varlen  the packed documents as fagen's varlen layout (cu_seqlens = the gym's offsets), causal
                   tXXX the modded forward at tile XXX
  dilated: modded  the modded kernel (lowering off; `attention` lowers to `strided` since [Note] Dilated windows)
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DRY = os.environ.get("GPU_MODS_FWD_S5_DRY", "0") == "1"
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

T0 = time.time()
DEVICE = "cpu" if DRY else "cuda"
ROWS = ("dilated", "prefix-lm", "alibi", "sliding-window+causal", "document+causal", "relative-bias", "softcap")
TOL = 2e-2


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def tile(text: str) -> dict:
    import re

    m = re.fullmatch(r"m(\d+)n(\d+)w(\d+)s(\d+)", text)
    return dict(zip(("block_m", "block_n", "num_warps", "num_stages"), map(int, m.groups())))


def modded_tile_fn(q, sm, mm, bm, config):
    """The modded forward module of these mods at one tile (a fwd spec, lowering off)."""
    from fagen.runtime.loader import load
    from fagen.runtime.modded import modded_spec
    from fagen.runtime.mods import prepare
    from fagen.runtime.resolve import spec_for

    mods = prepare(score_mod=sm, mask_mod=mm)
    spec = modded_spec(spec_for(q, q, q), mods.fields, {**tile(config), "direction": "fwd"})
    module = load(spec)
    return lambda q, k, v: module.forward(q, k, v, mods=mods.values, block_mask=bm)[0]


def window_tile_fn(q, config, window, mask):
    from fagen.runtime.loader import load
    from fagen.spec.kernel import KernelSpec

    spec = KernelSpec(head_dim=q.shape[-1], mask=mask, dtype={torch.bfloat16: "bf16", torch.float32: "fp32",
                                                              torch.float16: "fp16"}[q.dtype],
                      window=True, direction="fwd", **tile(config))
    module = load(spec)
    return lambda q, k, v: module.forward(q, k, v, window=window)[0]


# Template variants ([Note] in the module docstring: window 1loop / edges-s1): the window switch's forward rendered
# from an edited copy of fagen/templates ($FAGEN_TEMPLATE_DIR, which the render and its index key read), loaded
# beside the product's module, not in place of it.
WINDOW_VARIANTS = {
    "1loop": [("triton/attention.py.j2",
               '{% set loops = [("lo", "w_lo", "True"), ("w_lo", "w_hi", "False"), ("w_hi", "hi", "True")] %}',
               '{% set loops = [("lo", "hi", "True")] %}')],
    "edges-s1": [("triton/attention.py.j2",
                  '{% if spec.mask == "tree" %}\n    # [Note] Unpipelined tree tail',
                  '{% if spec.mask == "tree" or spec.window %}\n    # [Note] Unpipelined tree tail')],
}


def template_variant_fn(q, variant, window, mask):
    import shutil
    import tempfile

    from fagen.codegen import render as R
    from fagen.runtime import loader
    from fagen.runtime.device import gpu_arch
    from fagen.spec.kernel import KernelSpec

    root = os.path.join(tempfile.mkdtemp(prefix="fagen-tpl-"), "templates")
    shutil.copytree(R.TEMPLATE_DIR, root)
    for rel, old, new in WINDOW_VARIANTS[variant]:
        path = os.path.join(root, rel)
        text = open(path).read()
        assert old in text, f"{variant}: the template no longer has {old[:60]!r}"
        open(path, "w").write(text.replace(old, new))
    spec = KernelSpec(head_dim=q.shape[-1], mask=mask, dtype={torch.bfloat16: "bf16", torch.float32: "fp32",
                                                              torch.float16: "fp16"}[q.dtype],
                      window=True, direction="fwd").for_arch(gpu_arch())
    os.environ["FAGEN_TEMPLATE_DIR"] = root
    try:
        module = loader.import_module(loader.source_path(spec).with_suffix(".py"))
    finally:
        del os.environ["FAGEN_TEMPLATE_DIR"]
    return lambda q, k, v: module.forward(q, k, v, window=window)[0]


def gluon_forced(fn):
    """fn with fagen.attention's MIN_WORK lifted (the Gluon forward where its rule selects the case)."""
    from fagen.runtime import api

    def run(q, k, v):
        old = api.MIN_WORK
        api.MIN_WORK = 0
        try:
            return fn(q, k, v)
        finally:
            api.MIN_WORK = old
    return run


def no_lowering(fn):
    from fagen.mods import lower

    def run(q, k, v):
        lower.ENABLED = False
        try:
            return fn(q, k, v)
        finally:
            lower.ENABLED = True
    return run


def dilated_strided(window, dilation):
    """The dilated window |q - kv| <= W, (q - kv) % d == 0 as window(W // d, W // d) on d strided subsequences:
    q = d * i + r, kv = d * j + r, so |i - j| <= W // d. Needs S % d == 0 and Hq == Hkv (one view, no copy)."""
    import fagen

    def run(q, k, v):
        b, h, s, d = q.shape
        w = window // dilation

        def view(x):  # [B, H, S, D] -> [B*H, dilation, S/dilation, D], no copy
            return x.reshape(b * h, s // dilation, dilation, d).transpose(1, 2)
        out = fagen.attention(view(q), view(k), view(v), window=(w, w))
        return out.transpose(1, 2).reshape(b, h, s, d)
    return run


def doc_varlen(mm):
    """The document mask + causal as fagen's varlen layout (mask causal per document): q[0] as [S, H, D] views,
    cu_seqlens = the gym's offsets (B = 1)."""
    import inspect

    import fagen

    offsets = inspect.getclosurevars(mm).nonlocals["offsets"].to(torch.int32)
    longest = int((offsets[1:] - offsets[:-1]).max())

    def run(q, k, v):
        out = fagen.attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), mask="causal",
                              cu_seqlens_q=offsets, cu_seqlens_k=offsets, max_seqlen_q=longest,
                              max_seqlen_k=longest)
        return out.transpose(0, 1)[None]
    return run


def prefix_split(prefix):
    import fagen

    def run(q, k, v):
        p = prefix
        top = fagen.attention(q[:, :, :p], k[:, :, :p], v[:, :, :p])
        bottom = fagen.attention(q[:, :, p:], k, v, mask="causal")  # bottom-right: row p + i sees keys <= p + i
        return torch.cat([top, bottom], dim=2)
    return run


def alibi_variants(h):
    """(label, score_mod) of the gym ALiBi's rewrites ([the module docstring])."""
    slopes = torch.exp2(-((torch.arange(h, dtype=torch.float32) + 1) * 8.0 / h)).to(DEVICE)
    hh = h

    def slopes_mod(score, b, h, q_idx, kv_idx):
        return score + (kv_idx - q_idx) * slopes[h]

    def split_mod(score, b, h, q_idx, kv_idx):
        s = torch.exp2(-((h + 1) * 8.0 / hh))
        return score + kv_idx * s - q_idx * s

    def fsplit_mod(score, b, h, q_idx, kv_idx):
        s = torch.exp2(-((h + 1) * 8.0 / hh))
        return score + ((kv_idx + 0.0) - q_idx) * s

    def colonly_mod(score, b, h, q_idx, kv_idx):
        s = torch.exp2(-((h + 1) * 8.0 / hh))
        return score + kv_idx * s

    # split and fsplit compile (sm_90 ptxas, this CPU) to no fewer conversions or FP32 instructions than the gym's
    # form (I2FP 235-241 against 271, FADD+FMUL+FFMA 2890 against 2573): not timed
    return [("slopes", slopes_mod), ("colonly", colonly_mod)]


def variants(name, sm, mm, bm, shape, q):
    """[(label, fn(q, k, v) -> out, compare out with Flex?)] for one row."""
    import fagen

    attend = lambda q, k, v: fagen.attention(q, k, v, score_mod=sm, mask_mod=mm, block_mask=bm)  # noqa: E731
    out = [("attention", attend, True)]
    small = DRY
    if name == "alibi":
        for label, mod in alibi_variants(shape.heads):
            out.append((label, lambda q, k, v, mod=mod: fagen.attention(q, k, v, score_mod=mod), label != "colonly"))
        out.append(("plain", lambda q, k, v: fagen.attention(q, k, v), False))
    elif name == "sliding-window+causal":
        w = 1024 if not small else 64
        out.append(("gluon", gluon_forced(lambda q, k, v: fagen.attention(q, k, v, mask="causal", window=(w, 0))),
                    True))
        for c in ("m64n64w4s3", "m128n64w8s3"):  # the switch's own tile: m128n128w8s3
            out.append(("t" + c, window_tile_fn(q, c, (w, 0), "causal"), True))
        for variant in WINDOW_VARIANTS:
            out.append((variant, template_variant_fn(q, variant, (w, 0), "causal"), True))
        out.append(("modded", no_lowering(attend), True))
    elif name == "dilated":
        w, d = (1024, 4) if not small else (64, 4)
        out.append(("modded", no_lowering(attend), True))
    elif name == "prefix-lm":
        out.append(("modded", no_lowering(attend), True))
        for c in ("m128n64w8s3", "m128n128w8s2"):
            out.append(("t" + c, modded_tile_fn(q, sm, mm, bm, c), True))
    elif name == "document+causal":
        out.append(("modded", no_lowering(attend), True))
        for c in ("m128n64w8s2", "m64n128w4s2"):
            out.append(("t" + c, modded_tile_fn(q, sm, mm, bm, c), True))
    return out


def fwd_bwd_rows(name, mm, bm, q, k, v, flops, rep_ms, table):
    """fagen's backward (autograd.grad of q, k, v) as the bench times it, lowered (the strided window) and not
    (the modded kernels); the bwd rate counts 2.5x the forward's flops, as the bench does. Flex's backward on this
    row: 72 TF/s (benchmarks/mods.md, fourth run)."""
    import fagen
    from fagen.mods import lower

    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    do = torch.randn_like(q)
    for label, on in (("bwd lowered", True), ("bwd modded", False)):
        lower.ENABLED = on
        try:
            out = fagen.attention(*leaves, mask_mod=mm, block_mask=bm)
            ms = time_ms(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True), rep_ms)
            table.append((name, label, ms, 2.5 * flops, None, "bwd"))
            log(f"{name} {label}: {ms} ms")
        except Exception as e:  # noqa: BLE001
            table.append((name, label, None, flops, None, f"ERROR {type(e).__name__}: {str(e)[:90]}"))
        finally:
            lower.ENABLED = True


def rows_of(shape, wanted):
    from fagen.bench import gym_mods as g
    from fagen.bench.mods import cases

    found = [(n, sm, mm) for n, sm, mm, _ in cases(shape, DEVICE) if n in wanted]
    if DRY:  # windows that fit the tiny shape
        swap = {"sliding-window+causal": (None, g.generate_sliding_window(64)),
                "dilated": (None, g.generate_dilated_sliding_window(64, 4))}
        found = [(n, *swap.get(n, (sm, mm))) for n, sm, mm in found]
    return found


def time_ms(fn, rep_ms) -> float:
    from fagen.bench.timing import measure

    return measure(lambda i: fn(), 1, torch.device(DEVICE), 10.0, rep_ms)


def flex_of(sm, mm, shape):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from fagen.bench.peers import configure_dynamo

    configure_dynamo()
    compiled = torch.compile(flex_attention, dynamic=False)
    bm = None if mm is None else create_block_mask(mm, None, None, shape.seq, shape.seq, device=DEVICE)
    return lambda q, k, v: compiled(q, k, v, score_mod=sm, block_mask=bm)


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=",".join(ROWS[:5]))
    ap.add_argument("--rep-ms", type=float, default=30.0)
    a = ap.parse_args()
    import fagen
    from fagen.bench.mods import ModsShape, _visible_pairs

    shape = ModsShape(heads=2, seq=256, head_dim=32, dtype=torch.float32) if DRY else ModsShape()
    dev = "cpu (interpreter)" if DRY else torch.cuda.get_device_name()
    log(f"{dev}, torch {torch.__version__}; fagen {fagen.__file__}")
    gen = torch.Generator(device="cpu").manual_seed(1)
    q, k, v = (torch.randn(shape.batch, shape.heads, shape.seq, shape.head_dim, generator=gen)
               .to(DEVICE, shape.dtype) for _ in range(3))
    table, records = [], []
    for name, sm, mm in rows_of(shape, [r for r in a.rows.split(",") if r]):
        try:
            bm = None if mm is None else fagen.create_block_mask(mm, None, None, shape.seq, shape.seq, device=DEVICE)
            flops = 4.0 * shape.head_dim * _visible_pairs(bm, mm, shape)
            with torch.no_grad():
                if DRY:
                    from fagen.verify import reference

                    want = reference.attention(q, k, v, score_mod=sm, mask_mod=mm)[0].to(q.dtype)
                    flex_ms = None
                else:
                    flex = flex_of(sm, mm, shape)
                    want = flex(q, k, v)
                    flex_ms = time_ms(lambda: flex(q, k, v), a.rep_ms)
                table.append((name, "flex", flex_ms, flops, None, "-"))
                log(f"{name} flex: {flex_ms} ms")
                for label, fn, compare in variants(name, sm, mm, bm, shape, q):
                    try:
                        got = fn(q, k, v)
                        err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
                        if label == "attention":
                            from fagen.runtime import modded

                            compare_note = f" (lowered to {modded.LOWERED[0]})"
                        else:
                            compare_note = ""
                        if compare and not err <= TOL:
                            table.append((name, label, None, flops, flex_ms, f"FAIL {err:.1e}"))
                            continue
                        ms = None if DRY else time_ms(lambda: fn(q, k, v), a.rep_ms)
                        table.append((name, label, ms, flops, flex_ms, f"{err:.1e}" + ("" if compare else " (n/c)")
                                      + compare_note))
                        log(f"{name} {label}: {ms} ms (flex {flex_ms}), err {err:.1e}")
                    except Exception as e:  # noqa: BLE001 - a variant that cannot run is reported
                        table.append((name, label, None, flops, flex_ms, f"ERROR {type(e).__name__}: "
                                                                        f"{(str(e).splitlines() or [''])[0][:90]}"))
                        traceback.print_exc(file=sys.stderr)
            if name == "dilated" and not DRY:  # the split serves with gradients too: the bench's bwd column
                fwd_bwd_rows(name, mm, bm, q, k, v, flops, a.rep_ms, table)
            log(f"done {name}")
        except Exception as e:  # noqa: BLE001
            table.append((name, "row", None, 0, None, f"ERROR {type(e).__name__}: {str(e)[:120]}"))
            traceback.print_exc(file=sys.stderr)
        if not DRY:
            torch.cuda.empty_cache()
    print()
    print(f"{'mod':<22} {'variant':<14} {'ms':>7} {'TF/s':>6} {'vs Flex':>7}  check (vs Flex's out)")
    for name, label, ms, flops, flex_ms, chk in table:
        tf = "" if ms is None else f"{flops / ms / 1e9:6.0f}"
        x = f"{flex_ms / ms:6.2f}x" if ms and flex_ms else ""
        print(f"{name:<22} {label:<14} {'' if ms is None else f'{ms:7.3f}':>7} {tf:>6} {x:>7}  {chk}")
        records.append(dict(mod=name, variant=label, ms=ms, tflops=None if ms is None else flops / ms / 1e9,
                            flex_ms=flex_ms, check=chk))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "mods_fwd_s5.json"), "w") as f:
            json.dump({"device": dev, "records": records}, f, indent=1)
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
