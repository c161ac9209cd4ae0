"""Paged fp8 KV decode, sixteenth session (issue 27; docs/serving.md "Paged fp8 KV decode (sixteenth session)"):
the paged row decode-d128-kv8k-b32-fp8-paged16 (0.92x of a copy of its bytes with the Triton decode kernel) against
the Gluon paged fp8 decode of lab/pagedfp8_gluon_decode.py (cp.async gathers into a STAGES-deep shared ring, mma_v2
dots with the GQA group's 4 rows padded to 16, the product's split rule, partial layout and merge arithmetic) at a
few (block_n, stages, warps, V's conversion path).

    PYTHONPATH=$PWD python3 scripts/gpu_pagedfp8_s16.py      # < 60 s on an H100; $OUTX/table.txt

Phases, each a child process with a timeout:
1. check: the product's default and each Gluon candidate at page 16 against float64 on the dequantized cache, 28
   sequences of 1..1200 keys (no multiple of a page or a key block), per-head scales, through the split rule and 3
   splits (the partials and the merge); table entries past each sequence's pages pointing outside the cache; it must
   FAIL against the reference on the cache read as bf16 and without its scales. Then a table whose used entries are
   garbage (out of range, negative): the candidate must run without a fault (values unspecified). Warms the builds.
2. time: the serving bench's paged row (its make_inputs sets, its float64 check, prepare_fagen with the candidate
   in place of fagen.load) and its copy reference (prepare_copy), each timed by the bench's time_prepared under
   L2_FLUSH "loop" and back to back, PASSES passes, the order shuffled each pass (copy included); per pass
   candidate / copy of that pass; the median and the spread (min-max) of the per-pass ratios. Then b32 kv32k page
   16 back to back beside a copy of the same bytes, one set, 3 shuffled passes.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for _phases
from _phases import child_env, run_phase as run_child  # noqa: E402

PHASES = {"check": 24, "time": 30}
if os.environ.get("GPU_PAGEDFP8_S16_PHASES"):  # "name:seconds,..."
    PHASES = {n: float(t) for n, t in (p.split(":") for p in os.environ["GPU_PAGEDFP8_S16_PHASES"].split(","))}
ROUND = os.environ.get("GPU_PAGEDFP8_S16_ROUND", "B")
PASSES = 5 if ROUND == "A" else 7
SPLIT_CHECKS = (3,)  # forward_split counts checked beside the rule (not DIRECT: the partials and the merge)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
G = lambda n, s, w, v=0, **kw: ("gluon", dict(block_n=n, stages=s, num_warps=w, v_cvt=v, **kw))  # noqa: E731
if ROUND == "A":
    CANDS = {"default": ("triton", {}), "gluon n64s3w4": G(64, 3, 4), "gluon n64s3w8": G(64, 3, 8),
             "gluon n64s3w8 vcvt": G(64, 3, 8, 1), "gluon n128s3w8 vcvt": G(128, 3, 8, 1)}
else:
    # round B: round A's best Gluon candidate (bf16 dots, 0.674x against the default's 0.920x) beside the product's
    # fp16 dots (the hardware's fp8 -> fp16 cvt, two values an instruction, instead of the bf16 bit trick) with V
    # converted once (vcvt), and K's fragment read in 16-byte pieces with its columns permuted (kfrag)
    CANDS = {"default": ("triton", {}), "gluon n64s3w4": G(64, 3, 4), "gluon f16 n64s3w4 vcvt": G(64, 3, 4, 1, f16=1),
             "gluon f16 n64s3w8 vcvt": G(64, 3, 8, 1, f16=1),
             "gluon f16 n64s3w4 vcvt kfrag": G(64, 3, 4, 1, f16=1, k_frag=1),
             "gluon f16 wsplit n64s3w4": G(64, 3, 4, f16=1, wsplit=1)}  # each warp its own keys and softmax
if os.environ.get("GPU_PAGEDFP8_S16_CANDS"):
    CANDS = {k: CANDS[k] for k in os.environ["GPU_PAGEDFP8_S16_CANDS"].split(",")}

def emit(section, case, impl, value, ms, note=""):
    print("ROW " + json.dumps([section, case, impl, value, "" if ms is None else f"{ms:.4f}", note]), flush=True)


_MODS = {}


class _Lab:
    """A Gluon candidate as a decode module (forward, forward_split, the product's _geometry) over the lab kernel,
    its split count from the product's split rule."""

    def __init__(self, product, kw):
        sys.path.insert(0, os.path.join(ROOT, "lab"))
        import pagedfp8_gluon_decode as lab
        self.lab, self.p, self.kw = lab, product, kw
        self._geometry = product._geometry

    def _rule(self, q, k, block_table):
        sk = block_table.shape[1] * k.shape[1]
        span = -(-sk // self.p.BLOCK_N) * self.p.BLOCK_N
        return self._geometry(q.shape[0], k.shape[2], 1, span, None, q.device.index or 0)[3]

    def forward(self, q, k, v, *, block_table, seqlens_k, k_scale=None, v_scale=None, scale=None, **_):
        return self.lab.forward(q, k, v, block_table=block_table, seqlens_k=seqlens_k, k_scale=k_scale,
                                v_scale=v_scale, scale=scale, num_splits=self._rule(q, k, block_table), **self.kw)

    def forward_split(self, q, k, v, *, num_splits, block_table, seqlens_k, k_scale=None, v_scale=None, scale=None):
        return self.lab.forward(q, k, v, block_table=block_table, seqlens_k=seqlens_k, k_scale=k_scale,
                                v_scale=v_scale, scale=scale, num_splits=num_splits, **self.kw)


def module(name, spec=None):
    """The candidate's module: the product's for the paged fp8 spec (or `spec`, the bench row's), or the lab kernel
    over it."""
    import fagen
    from fagen.runtime.loader import load_source

    kind, kw = CANDS[name]
    if spec is None:
        spec = fagen.KernelSpec(head_dim=128, gqa=4, dtype="bf16", kind="decode", kv_dtype="fp8_e4m3",
                                layout="paged")
    key = (name, spec)
    if key not in _MODS:
        if ("default", spec) not in _MODS:
            _MODS[("default", spec)] = load_source(fagen.generate(spec), f"{spec.name}_s16")
        _MODS[key] = _MODS[("default", spec)] if kind == "triton" else _Lab(_MODS[("default", spec)], kw)
    return _MODS[key]

def check_phase():
    import torch

    from fagen.verify import reference
    from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare

    T0 = time.time()
    dev = "cuda"
    HD, HKV, G = 128, 8, 4
    page = 16
    b = 28
    gen = torch.Generator(device=dev).manual_seed(13)
    lens = torch.randint(1, 1200 + 1, (b,), device=dev, generator=gen, dtype=torch.int32)
    lens[0], lens[1] = 1000, 77
    width = -(-(-(-int(lens.max()) // page) + 1) // 16) * 16  # a multiple of 16 as the bench rows' (Triton's
    # specialisation of the table's stride: the time phase's builds are this phase's)
    q = torch.randn(b, HKV * G, 1, HD, device=dev, generator=gen).mul(2).bfloat16()
    npg = b * width + 3
    kc = torch.randn(npg, page, HKV, HD, device=dev, generator=gen).to(torch.float8_e4m3fn)
    vc = torch.randn(npg, page, HKV, HD, device=dev, generator=gen).to(torch.float8_e4m3fn)
    table = torch.randperm(npg, device=dev, generator=gen)[:b * width].to(torch.int32).view(b, width)
    for i in range(b):  # entries past each sequence's pages point outside the cache ([Note] Memory safety)
        used = -(-int(lens[i]) // page)
        table[i, used:] = torch.tensor([10**6, -3, npg] * width, dtype=torch.int32, device=dev)[:width - used]
    ks = torch.exp2(torch.rand(HKV, device=dev, generator=gen) * 6 - 3)
    vs = torch.exp2(torch.rand(HKV, device=dev, generator=gen) * 6 - 3)

    def gathered(cache, i, n):
        return cache[table[i, :-(-n // page)].long()].reshape(-1, cache.shape[2], cache.shape[3])[:n] \
            .transpose(0, 1)[None]

    def misread(x):
        return x.view(torch.uint8).view(torch.bfloat16).double().nan_to_num(0.0).clamp(-1e4, 1e4) \
            .repeat_interleave(2, -1)

    kd, vd = reference.dequantize(kc, ks, head_dim_axis=2), reference.dequantize(vc, vs, head_dim_axis=2)
    base = None
    for name in CANDS:
        if time.time() - T0 > PHASES["check"] - 4:
            emit("check", "page16 28 lengths", name, "-", None, "skipped: time budget")
            continue
        try:
            m = module(name)
            kw = dict(block_table=table, seqlens_k=lens, k_scale=ks, v_scale=vs)
            runs = [("rule", m.forward(q, kc, vc, **kw))] + [
                (f"{n} splits", m.forward_split(q, kc, vc, num_splits=n, **kw)) for n in SPLIT_CHECKS]
            out, lse = runs[0][1]
            worst, far = 0.0, []
            for i, (how, (o2, l2)) in ((i, r) for i in range(b) for r in runs[1:]):
                n = int(lens[i])
                want, wlse = reference.attention(q[i:i + 1].double(), gathered(kd, i, n), gathered(vd, i, n))
                terms, _ = reference.attention(q[i:i + 1].double(), gathered(kd, i, n), gathered(vd, i, n).abs())
                unit = terms.clamp(min=1.0)
                worst = max(worst, compare(f"out {i} {how}", o2[i:i + 1].double() / unit, want / unit,
                                           **TOLERANCE["bf16"]))
                compare(f"lse {i} {how}", l2[i:i + 1], wlse, **LSE_TOLERANCE)
            for i in range(b):
                n = int(lens[i])
                want, wlse = reference.attention(q[i:i + 1].double(), gathered(kd, i, n), gathered(vd, i, n))
                terms, _ = reference.attention(q[i:i + 1].double(), gathered(kd, i, n), gathered(vd, i, n).abs())
                unit = terms.clamp(min=1.0)
                got = out[i:i + 1].double() / unit
                worst = max(worst, compare(f"out {i}", got, want / unit, **TOLERANCE["bf16"]))
                compare(f"lse {i}", lse[i:i + 1], wlse, **LSE_TOLERANCE)
                if i == 0:
                    for what, k2, v2 in (("read as bf16", gathered(misread(kc), i, n), gathered(misread(vc), i, n)),
                                         ("no scales", gathered(kc.double(), i, n), gathered(vc.double(), i, n))):
                        wrong, _ = reference.attention(q[i:i + 1].double(), k2, v2)
                        try:
                            compare(what, got, wrong / unit, **TOLERANCE["bf16"])
                        except AssertionError:
                            far.append(what)
                        else:
                            raise AssertionError(f"the result also matches the reference on the cache {what}")
            same = ""
            if base is None:
                base = (out, lse)
            else:
                same = f"; bitwise as default: {torch.equal(out, base[0]) and torch.equal(lse, base[1])}"
            # used entries out of range or negative: no fault (values unspecified); a sequence of 0 keys: out 0,
            # lse -inf ([Note] Empty rows)
            bad = table.clone()
            bad[:, 0], bad[:, 1] = 10**7, -5
            lz = lens.clone()
            lz[3] = 0
            oz, lz_ = m.forward(q, kc, vc, block_table=bad, seqlens_k=lz, k_scale=ks, v_scale=vs)
            torch.cuda.synchronize()
            if not (bool((oz[3] == 0).all()) and bool((lz_[3] == float("-inf")).all())):
                raise AssertionError("a sequence of 0 keys does not give out 0 and lse -inf")
            same += "; garbage table entries: no fault; 0 keys: 0 / -inf"
            emit("check", f"page16 b{b} 1..1200 keys, bad entries, per-head", name, "-", None,
                 f"ok (rule {m._geometry(b, HKV, 1, width * page, None, q.device.index or 0)[3]} splits; "
                 f"{', '.join(map(str, SPLIT_CHECKS))}), "
                 f"err {worst:.1e}; fails as {' and as '.join(far)}{same}")
        except Exception as e:  # noqa: BLE001
            emit("check", "page16 28 lengths", name, "-", None, f"ERROR {type(e).__name__}: {str(e)[:200]}")


def time_phase():  # noqa: C901 - one phase
    import torch

    from fagen.bench import timing
    from fagen.bench.cases import BenchOptions, CaseContext
    from fagen.bench.check import check
    from fagen.bench import impls
    from fagen.bench.serving import serving_rows
    from fagen.bench.workloads import kv_bytes
    from fagen.runtime import loader

    T0 = time.time()
    dev = torch.device("cuda")
    row = {c.name: c for c in serving_rows()}["decode-d128-kv8k-b32-fp8-paged16"]
    opts = BenchOptions(device=str(dev))
    cc = CaseContext(row, dev, opts.sets)
    nb = kv_bytes(row)
    entries = {}
    real_load = loader.load
    for name in CANDS:
        if time.time() - T0 > PHASES["time"] - 12:
            emit("time", row.name, name, "-", None, "skipped: time budget")
            continue
        try:
            loader.load = lambda spec, name=name: module(name, spec)
            prep = impls.prepare_fagen(row, cc)
            status, message, err = check("fagen", prep, cc)
            if status != "ok":
                raise AssertionError(f"check {status}: {message}")
            entries[name] = ([lambda s=s, p=prep: p.fn(s) for s in cc.sets], f"bench check ok, err {err:.1e}", prep)
        except Exception as e:  # noqa: BLE001
            emit("time", row.name, name, "-", None, f"ERROR {type(e).__name__}: {str(e)[:200]}")
        finally:
            loader.load = real_load
    cp = impls.prepare_copy(row, cc)
    entries["copy"] = ([lambda s=s: cp.fn(s) for s in cc.sets], "copy of the row's bytes", cp)

    def b2b(fns, n):
        for f in fns:
            f()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(n):
            fns[i % len(fns)]()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / n

    res = {}
    names = list(entries)
    rng = random.Random(16 if ROUND == "A" else 1616)
    emit("time", "L2_FLUSH", timing.L2_FLUSH, "-", None, f"{len(cc.sets)} sets; warm-up {opts.warmup_ms} ms, "
         f"{opts.rep_ms} ms of calls; {PASSES} passes, order shuffled")
    with torch.no_grad():
        for p in range(PASSES):
            order = names[:]
            rng.shuffle(order)
            if time.time() - T0 > PHASES["time"] - 9:
                break
            for name in order:
                ms = timing.time_prepared(entries[name][2], cc, opts)["ms"]  # the bench's own timing
                res.setdefault((name, "loop"), []).append(ms)
                res.setdefault((name, "b2b"), []).append(b2b(entries[name][0], 60))
    npass = min(len(v) for v in res.values()) if res else 0
    for name in names:
        if (name, "loop") not in res or ("copy", "loop") not in res:
            continue
        rl = [c / x for c, x in zip(res[("copy", "loop")][:npass], res[(name, "loop")][:npass])]
        rb = [c / x for c, x in zip(res[("copy", "b2b")][:npass], res[(name, "b2b")][:npass])]
        ml = statistics.median(res[(name, "loop")][:npass])
        emit("time", row.name, name, f"{nb / ml / 1e6:.0f} GB/s", ml,
             f"loop fagen/copy median {statistics.median(rl):.3f} spread {min(rl):.3f}-{max(rl):.3f} "
             f"(passes {[round(x, 3) for x in rl]}); b2b median {statistics.median(rb):.3f} "
             f"spread {min(rb):.3f}-{max(rb):.3f}; {entries[name][1]}")
    # other paged shapes, back to back only (one set; no bench check: the check phase covers the candidates' values)
    from fagen.bench.workloads import make_case
    extra = [("b32 kv32k page16", dict(batch=32, seq_k=32768, page_size=16))]  # the split rule's builds only
    if ROUND != "A":
        extra.insert(0, ("b128 kv8k page16", dict(batch=128, seq_k=8192, page_size=16)))
    for label, kw in extra:
        if time.time() - T0 > PHASES["time"] - 8:
            emit("time", label, "-", "-", None, "skipped: time budget")
            continue
        try:
            case = make_case(f"paged-{label.replace(' ', '-')}", head_dim=128, mask="none", heads_q=32, heads_kv=8,
                             seq_q=1, kv_dtype="fp8_e4m3", peers=False, **kw)
            ec = CaseContext(case, dev, 1)
            eb = kv_bytes(case)
            src, dst = torch.empty(eb // 2, dtype=torch.uint8, device=dev), torch.empty(eb // 2, dtype=torch.uint8,
                                                                                        device=dev)
            calls = {"copy": lambda: dst.copy_(src)}
            for name in CANDS:
                loader.load = lambda spec, name=name: module(name, spec)
                try:
                    pe = impls.prepare_fagen(case, ec)
                finally:
                    loader.load = real_load
                calls[name] = lambda pe=pe: pe.fn(ec.sets[0])
            got = {}
            with torch.no_grad():
                for name in calls:  # warm (builds come from the check phase's cache)
                    calls[name]()
                for p in range(3):
                    order = list(calls)
                    rng.shuffle(order)
                    for name in order:
                        got.setdefault(name, []).append(b2b([calls[name]], 12))
            for name in CANDS:
                r = [c / x for c, x in zip(got["copy"], got[name])]
                m = statistics.median(got[name])
                emit("time", label, name, f"{eb / m / 1e6:.0f} GB/s", m, f"b2b fagen/copy median "
                     f"{statistics.median(r):.3f} spread {min(r):.3f}-{max(r):.3f} "
                     f"(copy {statistics.median(got['copy']):.4f} ms, {eb / 1e6:.0f} MB)")
            del ec, src, dst, calls
        except Exception as e:  # noqa: BLE001
            emit("time", label, "-", "-", None, f"ERROR {type(e).__name__}: {str(e)[:200]}")


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        {"check": check_phase, "time": time_phase}[sys.argv[2]]()
        return
    t0 = time.time()
    env = child_env("/tmp/fagen-cache-gpu-pagedfp8-s16", ROOT)
    rows, logs = [], []
    for name, limit in PHASES.items():
        print(f"[{time.time() - t0:6.1f}s] #### phase {name} (timeout {limit}s)", flush=True)
        rc, lines = run_child(os.path.abspath(__file__), name, limit, env,
                              lambda line: line.startswith("ROW ") or print(line, end="", flush=True))
        rows += [json.loads(line[4:]) for line in lines if line.startswith("ROW ")]
        logs += lines
        print(f"[{time.time() - t0:6.1f}s] #### phase {name}: rc={rc}", flush=True)
        if rc != 0:
            rows.append([name, "(phase)", "-", "-", "", f"ERROR rc={rc}"])
    text = "\n".join(["| section | case | impl | value | ms | note |", "|---|---|---|---|---|---|"]
                     + ["| " + " | ".join(r) + " |" for r in rows])
    print("\n" + text, flush=True)
    out = os.environ.get("OUTX") or os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_pagedfp8_s16.md"), "w") as f:
            f.write(text + "\n\n" + "".join(logs))
        with open(os.path.join(out, "table.txt"), "w") as f:
            f.write(text + "\n")
    failed = [r for r in rows if "ERROR" in r[5]]
    print(f"done in {time.time() - t0:.0f} s; {len(failed)} failures", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
