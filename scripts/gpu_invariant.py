"""What batch-invariant decode costs (issue 27 part 3, docs/serving.md "Batch-invariant decode"): batch_invariant=True
against False in the same run, interleaved, at d128 h32/8 (b1, b32) x (kv 4k, 32k), dense and paged, and MLA's
absorbed decode (576/512, one shared latent cache, h16 sq1 b32 kv 4k and 32k); each row also checks the bits.

    PYTHONPATH=$PWD python3 scripts/gpu_invariant.py          # under ~120 s on an H100; one table; $OUT/gpu_invariant.md
    GPU_INVARIANT_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_invariant.py   # the same code on the CPU interpreter

- Timing: triton's do_bench (L2 flushed before each call, median), ROUNDS rounds, the modes interleaved within a
  round (False, then the invariant rules); a mode's time is its median over the rounds, the cost its time over
  False's, minus 1. `spread` is the range of the per-round cost of the module's own rule.
- Rules: the module's own (INVARIANT_MIN_CHUNK, INVARIANT_SPLITS: [Note] Batch-invariant splits in the decode
  template) and a few candidates beside it (the module's two constants set for the call, then restored), to pick
  the rule: `best` is the cheapest candidate where every shape's cost is known.
- Bits: for every rule, the batch's last sequence (its length not a multiple of the key block) run alone, its cache
  cut to its own keys (dense) or its block table to its own pages (paged), must give its row of the batch bit for
  bit, out and lse; the split rule's bits are shown for contrast (they may differ). One shape also checks that a
  CUDA graph of plan(batch_invariant=b).run replays the eager bits, for both b.
- Every module is first checked against the float64 reference on the last sequence.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import traceback

DRY = os.environ.get("GPU_INVARIANT_DRY") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from gpu_rows import T0, log  # noqa: E402
from gpu_rows import bench as _bench  # noqa: E402

import fagen  # noqa: E402
from fagen.spec.axes import DType  # noqa: E402
from fagen.verify import reference  # noqa: E402
from fagen.verify.tolerances import TOLERANCE, compare  # noqa: E402

DEV = "cpu" if DRY else "cuda"
KV = (lambda n: max(70, n // 256)) if DRY else (lambda n: n)
B = (lambda n: min(n, 3)) if DRY else (lambda n: n)
ROUNDS = 1 if DRY else 5
PAGE_D128, PAGE_MLA = 16, (16 if DRY else 64)
# candidate (smallest chunk, most splits) per V width, beside the module's own rule; the CPU takes tiny chunks
CANDIDATES = {128: [(512, 32), (1024, 16), (512, 8)],
              512: [(512, 32), (512, 16), (1024, 16)]}
if DRY:
    CANDIDATES = {32: [(16, 2)]}
ROWS: list[tuple] = []  # (shape, mode, ms, cost, bits, note)


def bench(fn) -> float:
    return _bench(fn, DRY, warmup=5, rep=25, return_mode="median")  # ms, median


class Rule:
    """batch_invariant=True with the module's (INVARIANT_MIN_CHUNK, INVARIANT_SPLITS) set to `rule` for the call
    (None: the module's own), or the split rule (batch_invariant=False) when `rule` is False."""

    def __init__(self, m, rule):
        self.m, self.rule = m, rule
        self.own = (m.INVARIANT_MIN_CHUNK, m.INVARIANT_SPLITS)
        self.name = "False" if rule is False else ("True (own " if rule is None else "True (") + \
            f"{(self.own if rule is None else rule)[0]}/{(self.own if rule is None else rule)[1]})"

    def __call__(self, fn, *args, **kw):
        if self.rule is False:
            return fn(*args, batch_invariant=False, **kw)
        if self.rule is not None:
            self.m.INVARIANT_MIN_CHUNK, self.m.INVARIANT_SPLITS = self.rule
        try:
            return fn(*args, batch_invariant=True, **kw)
        finally:
            self.m.INVARIANT_MIN_CHUNK, self.m.INVARIANT_SPLITS = self.own


def row(shape, mode, ms, cost, bits, note=""):
    ROWS.append((shape, mode, "-" if ms is None else f"{ms:.4f}", "" if cost is None else f"{100 * cost:+.1f}%",
                 bits, note))
    log(" | ".join(ROWS[-1]))


def inputs(kind, b, kv):
    """(module, q, k, v, kw, alone_kw, v_alone_arg, bytes read): the batch's lengths are kv except the last's,
    kv - 37 (not a multiple of a key block)."""
    gen = torch.Generator(device=DEV).manual_seed(b * 7 + kv)
    lens = torch.full((b,), kv, dtype=torch.int32, device=DEV)
    lens[-1] = kv - 37
    n = kv - 37
    if kind == "mla":
        d, dv, hq, hkv, page = (48, 32, 4, 1, PAGE_MLA) if DRY else (576, 512, 16, 1, PAGE_MLA)
        spec = fagen.KernelSpec(head_dim=d, head_dim_v=dv, shared_kv=True, kind="decode", gqa=hq, dtype="bf16",
                                layout="paged")
    else:
        d = dv = 32 if DRY else 128
        hq, hkv, page = (4, 2, PAGE_D128) if DRY else (32, 8, PAGE_D128)
        spec = fagen.KernelSpec(head_dim=d, kind="decode", gqa=hq // hkv, dtype="bf16",
                                layout="paged" if kind == "paged" else "dense",
                                mask="none" if kind == "paged" else "padding")
    m = fagen.load(spec)
    q = torch.randn(b, hq, 1, d, device=DEV, generator=gen).mul(2).bfloat16()
    if kind == "dense":
        k = torch.randn(b, hkv, kv, d, device=DEV, generator=gen).bfloat16()
        v = torch.randn(b, hkv, kv, dv, device=DEV, generator=gen).bfloat16()
        lq = torch.ones(b, dtype=torch.int32, device=DEV)
        kw = dict(seqlens_q=lq, seqlens_k=lens)
        alone = dict(seqlens_q=lq[-1:].clone(), seqlens_k=lens[-1:].clone())
        k1, v1 = k[-1:, :, :n].clone(), v[-1:, :, :n].clone()
        ref_k, ref_v = k[-1:, :, :n], v[-1:, :, :n]
        read = int(lens.sum()) * hkv * (d + dv) * 2
        return m, q, k, v, kw, (k1, v1, alone), (ref_k, ref_v), read
    pages = kv // page
    k = torch.randn(b * pages, page, hkv, d, device=DEV, generator=gen).bfloat16()
    v = None if kind == "mla" else torch.randn(b * pages, page, hkv, dv, device=DEV, generator=gen).bfloat16()
    table = torch.randperm(b * pages, device=DEV, generator=gen).to(torch.int32).view(b, pages)
    kw = dict(block_table=table, seqlens_k=lens)
    own = -(-n // page)
    alone = dict(block_table=table[-1:, :own].clone(), seqlens_k=lens[-1:].clone())
    ref_k = k[table[-1].long()].reshape(-1, hkv, d)[:n].transpose(0, 1)[None]
    ref_v = None if v is None else v[table[-1].long()].reshape(-1, hkv, dv)[:n].transpose(0, 1)[None]
    read = int(lens.sum()) * hkv * (d if kind == "mla" else d + dv) * 2
    return m, q, k, v, kw, (k, v, alone), (ref_k, ref_v), read


def shape(kind, b, kv, graphs=False):
    b, kv = B(b), KV(kv)
    name = f"{'mla 576/512 h16' if kind == 'mla' else 'd128 h32/8'} {kind if kind != 'mla' else 'paged'} b{b} kv{kv}"
    m, q, k, v, kw, (k1, v1, alone), (ref_k, ref_v), read = inputs(kind, b, kv)
    out, _ = m.forward(q, k, v, batch_invariant=False, **kw)
    mla = kind == "mla"
    want, _ = reference.attention(q[-1:], ref_k, ref_v, head_dim_v=m.HEAD_DIM_V if mla else None)
    err = compare("out", out[-1:], want, **TOLERANCE[DType.BF16])
    rules = [Rule(m, False), Rule(m, None)] + [Rule(m, r) for r in CANDIDATES[m.HEAD_DIM_V]
                                                  if r != (m.INVARIANT_MIN_CHUNK, m.INVARIANT_SPLITS)]
    bits = {}
    for r in rules:  # bits first (this also compiles every variant before the timing)
        o, lse = r(m.forward, q, k, v, **kw)
        o1, l1 = r(m.forward, q[-1:].clone(), k1, v1, **alone)
        bits[r.name] = torch.equal(o[-1], o1[0]) and torch.equal(lse[-1], l1[0])
    times = {r.name: [] for r in rules}
    for _ in range(ROUNDS):
        for r in rules:
            times[r.name].append(bench(lambda: r(m.forward, q, k, v, **kw)))
    base = statistics.median(times["False"])
    per_round = [t / f - 1 for t, f in zip(times[rules[1].name], times["False"])]
    for r in rules:
        ms = statistics.median(times[r.name])
        cost = None if r.rule is False else ms / base - 1
        note = f"{read / ms / 1e6:.0f} GB/s" + (f"; err {err:.1e}" if r.rule is False else "")
        if r.rule is None:
            note += f"; spread {100 * min(per_round):+.1f}..{100 * max(per_round):+.1f}%"
        row(name, r.name, ms, cost, ("same" if bits[r.name] else "DIFFERENT") if r.rule is not False else
            ("same" if bits[r.name] else "differ (allowed)"), note)
    if graphs and not DRY:
        for inv in (False, True):
            p = m.plan(b, q.shape[1], 1, kw["block_table"].shape[1] * k.shape[1] if "block_table" in kw
                       else k.shape[2], device=DEV, batch_invariant=inv)
            eager = p.run(q, k, v, **kw)
            o, lse = torch.empty_like(eager[0]), torch.empty_like(eager[1])
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                p.run(q, k, v, **kw, out=o, lse=lse)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                p.run(q, k, v, **kw, out=o, lse=lse)
            o.zero_()
            g.replay()
            torch.cuda.synchronize()
            same = torch.equal(o, eager[0]) and torch.equal(lse, eager[1])
            row(name, f"graph plan({inv})", None, None, "same" if same else "DIFFERENT", "replay vs eager run")


def main() -> None:
    if not torch.cuda.is_available() and not DRY:
        sys.exit("gpu_invariant.py needs a CUDA GPU (GPU_INVARIANT_DRY=1 rehearses it on the CPU)")
    log(f"{'CPU rehearsal' if DRY else torch.cuda.get_device_name()}  torch {torch.__version__}  fagen {fagen.__file__}")
    shapes = [(kind, b, kv) for kind in ("dense", "paged") for b in (1, 32) for kv in (4096, 32768)]
    shapes += [("mla", 32, 4096), ("mla", 32, 32768)]
    for i, (kind, b, kv) in enumerate(shapes):
        try:
            shape(kind, b, kv, graphs=i == 2)
        except Exception as e:  # noqa: BLE001 - a failure is a row, never the end of the run
            row(f"{kind} b{b} kv{kv}", "ERROR", None, None, "", f"{type(e).__name__}: {str(e).splitlines()[0][:150]}")
            traceback.print_exc(file=sys.stderr)
        torch.cuda.empty_cache() if not DRY else None
    lines = ["| shape | mode (min chunk/most splits) | ms | cost | alone vs batch | note |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in ROWS]
    # the verdict of issue 27's rule: a rule may be the default only if it costs under 3% at every shape
    costs: dict[tuple[str, str], list[float]] = {}
    for r in ROWS:
        if r[1].startswith("True") and r[3]:
            key = (r[0].split()[0], r[1].replace("own ", ""))  # (d128 or mla, the rule)
            costs.setdefault(key, []).append(float(r[3].rstrip("%")))
    verdict = [f"{k[0]} {k[1]}: worst {max(v):+.1f}%, mean {statistics.mean(v):+.1f}% over {len(v)} shapes"
               for k, v in sorted(costs.items())]
    own = [float(r[3].rstrip("%")) for r in ROWS if r[1].startswith("True (own") and r[3]]
    bad_bits = [r for r in ROWS if r[4] == "DIFFERENT"]
    text = "\n".join(lines) + "\n\n" + "\n".join(verdict) + \
        f"\n\nown rule worst cost {max(own) if own else float('nan'):+.1f}% -> default " \
        f"{'True' if own and max(own) < 3 else 'False'} by issue 27's 3% bar; bitwise failures: {len(bad_bits)}" \
        f"; {time.time() - T0:.0f} s"
    print("\n" + text)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_invariant.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
