"""Paged fp8 KV decode, seventeenth session (issue 27; docs/serving.md "Paged fp8 KV decode (seventeenth session)"):
the paged row decode-d128-kv8k-b32-fp8-paged16 (0.92x of a copy of its bytes with the Triton decode kernel) against
the Gluon swap-AB paged fp8 decode of lab/pagedfp8_swap_decode.py (the fp8 MLA latent decode's structure: S^T = K Q^T
by wgmma with the keys as M and the GQA group's 4 query rows as N = 8, K's A fragment converted in registers from
the cp.async ring's bytes, V^T and P^T from shared memory; the product's split rule, partial layout and merge
arithmetic) at a few ring depths, and the sixteenth session's best Gluon kernel (lab/pagedfp8_gluon_decode.py, fp16
wsplit n64s3w4).

    PYTHONPATH=$PWD python3 scripts/gpu_pagedfp8_s17.py      # < 60 s on an H100; $OUTX/table.txt

Phases, each a child process with a timeout:
1. check: the product's default and each Gluon candidate at page 16 against float64 on the dequantized cache, 28
   sequences of 1..1200 keys (no multiple of a page or a key block), per-head scales, through the split rule and 3
   splits (the partials and the merge); table entries past each sequence's pages pointing outside the cache; it must
   FAIL against the reference on the cache read as bf16 and without its scales. Then a table whose used entries are
   garbage (out of range, negative): the candidate must run without a fault (values unspecified), and a sequence of
   0 keys gives out 0 and lse -inf. Warms the builds.
2. time: the serving bench's paged row (its make_inputs sets, its float64 check, prepare_fagen with the candidate
   in place of fagen.load) and its copy reference (prepare_copy), each timed by the bench's time_prepared under
   L2_FLUSH "loop" and back to back, PASSES passes, the order shuffled each pass (copy included); per pass
   candidate / copy of that pass; the median and the spread (min-max) of the per-pass ratios. Then other paged
   shapes back to back beside a copy of the same bytes, one set, 3 shuffled passes.
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
if os.environ.get("GPU_PAGEDFP8_S17_PHASES"):  # "name:seconds,..."
    PHASES = {n: float(t) for n, t in (p.split(":") for p in os.environ["GPU_PAGEDFP8_S17_PHASES"].split(","))}
ROUND = os.environ.get("GPU_PAGEDFP8_S17_ROUND", "B")
PASSES = 5 if ROUND == "A" else 7
SPLIT_CHECKS = (3,)  # forward_split counts checked beside the rule (not DIRECT: the partials and the merge)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W16 = ("pagedfp8_gluon_decode", dict(block_n=64, stages=3, num_warps=4, v_cvt=0, f16=1, wsplit=1))
SW = lambda s, **kw: ("pagedfp8_swap_decode", dict(stages=s, **kw))  # noqa: E731
# the most wanted first: a check phase near its time limit skips the last. pipe: block j + 1's scores issued before
# block j's softmax; red: the column max across the warps with one barrier instead of Triton's two
if ROUND == "A":
    CANDS = {"default": ("triton", {}), "swap s4": SW(4), "swap s4 pipe": SW(4, pipe=1), "swap s4 red": SW(4, red=1),
             "swap s4 pipe red": SW(4, pipe=1, red=1), "swap s3 pipe red": SW(3, pipe=1, red=1),
             "swap s3 pipe red 2splits": SW(3, pipe=1, red=1, splits=2)}  # 512 programs at b32, 3 an SM (69 KB)
else:
    # round B (round A, 08:57: every swap s4 form 0.911-0.914 of copy against the default's 0.927; s3 PIPE, whose
    # wait for block j + 2 follows its issue in the same step, 0.806): a deeper ring (s5: 101 KB, still two programs
    # an SM), the copies issued right after the column max's barriers (early 1) or right after the step's ring reads
    # (early 2, one more barrier: the reads-alone kernel's place), two warpgroups on 128-key blocks (w8 s2: 16 warps
    # an SM, the copies first in a step, 101 KB), and three programs an SM (s3 without PIPE, 69 KB, 2 forced splits:
    # 512 programs at b32)
    CANDS = {"default": ("triton", {}), "swap s5 red": SW(5, red=1), "swap s5 red early1": SW(5, red=1, early=1),
             "swap s5 red early2": SW(5, red=1, early=2), "swap s3 red 2splits": SW(3, red=1, splits=2),
             "swap w8 s2": SW(2, w8=1),  # new in this round: last, so that a fault costs the others nothing
             "diag s5 red nocopy": SW(5, red=1, nocopy=1)}  # the steps without their reads: wrong values,
    # timed only (no check): the step's own time
if os.environ.get("GPU_PAGEDFP8_S17_CANDS"):
    CANDS = {k: CANDS[k] for k in os.environ["GPU_PAGEDFP8_S17_CANDS"].split(",")}

def emit(section, case, impl, value, ms, note=""):
    print("ROW " + json.dumps([section, case, impl, value, "" if ms is None else f"{ms:.4f}", note]), flush=True)


_MODS = {}


class _Lab:
    """A Gluon candidate as a decode module (forward, forward_split, the product's _geometry) over a lab kernel
    (lab/<name>.py's forward), its split count from the product's split rule."""

    def __init__(self, product, lab, kw):
        sys.path.insert(0, os.path.join(ROOT, "lab"))
        import importlib
        kw = dict(kw)
        self.force = kw.pop("splits", None)  # a split count in place of the rule's (more programs an SM)
        self.lab, self.p, self.kw = importlib.import_module(lab), product, kw
        self._geometry = product._geometry

    def _rule(self, q, k, block_table):
        if self.force:
            return self.force
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
    """The candidate's module: the product's for the paged fp8 spec (or `spec`, the bench row's), or a lab kernel
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
            _MODS[("default", spec)] = load_source(fagen.generate(spec), f"{spec.name}_s17")
        _MODS[key] = _MODS[("default", spec)] if kind == "triton" else _Lab(_MODS[("default", spec)], kind, kw)
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
        if CANDS[name][1].get("nocopy"):  # a timing diagnostic: its values are wrong by design
            continue
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
            n_rule = getattr(m, "force", None) or m._geometry(b, HKV, 1, width * page, None, q.device.index or 0)[3]
            emit("check", f"page16 b{b} 1..1200 keys, bad entries, per-head", name, "-", None,
                 f"ok (rule {n_rule} splits; {', '.join(map(str, SPLIT_CHECKS))}), "
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
    skip = set(filter(None, os.environ.get("GPU_PAGEDFP8_S17_SKIP", "").split(",")))
    for name in CANDS:
        if name in skip:
            continue
        if time.time() - T0 > PHASES["time"] - 12:
            emit("time", row.name, name, "-", None, "skipped: time budget")
            continue
        try:
            loader.load = lambda spec, name=name: module(name, spec)
            prep = impls.prepare_fagen(row, cc)
            status, message, err = check("fagen", prep, cc)
            if CANDS[name][1].get("nocopy"):  # a timing diagnostic: wrong values by design
                status, message, err = "ok", "", float("nan")
            if status != "ok":
                raise AssertionError(f"check {status}: {message}")
            entries[name] = ([lambda s=s, p=prep: p.fn(s) for s in cc.sets], f"bench check ok, err {err:.1e}"
                             if err == err else "timing diagnostic, not checked", prep)
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
    rng = random.Random(17 if ROUND == "A" else 1717)
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
        vs = ""
        if ("default", "loop") in res and name not in ("default", "copy"):  # default time / candidate's, per pass
            rd = [d / x for d, x in zip(res[("default", "loop")][:npass], res[(name, "loop")][:npass])]
            vs = f"; speed / default's, loop: median {statistics.median(rd):.3f} spread {min(rd):.3f}-{max(rd):.3f}"
        emit("time", row.name, name, f"{nb / ml / 1e6:.0f} GB/s", ml,
             f"loop fagen/copy median {statistics.median(rl):.3f} spread {min(rl):.3f}-{max(rl):.3f} "
             f"(passes {[round(x, 3) for x in rl]}); b2b median {statistics.median(rb):.3f} "
             f"spread {min(rb):.3f}-{max(rb):.3f}{vs}; {entries[name][1]}")
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
            timed = [n for n in CANDS if n in entries]  # those that passed the bench's check above
            for name in timed:
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
            for name in timed:
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
    env = child_env("/tmp/fagen-cache-gpu-pagedfp8-s17", ROOT)
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
        if name == "check":  # the time phase leaves out a candidate that failed its check or may have faulted
            # (no row from a check phase that died), so that one kernel cannot take the CUDA context of all
            ok = {r[2] for r in rows if r[0] == "check" and r[5].startswith("ok")}
            budget = {r[2] for r in rows if r[0] == "check" and "time budget" in r[5]} if rc == 0 else set()
            bad = [n for n in CANDS if n not in ok | budget and not CANDS[n][1].get("nocopy")]
            if bad:
                env["GPU_PAGEDFP8_S17_SKIP"] = ",".join(bad)
                rows.append(["time", "(left out)", ", ".join(bad), "-", "", "not checked ok in the check phase"])
    text = "\n".join(["| section | case | impl | value | ms | note |", "|---|---|---|---|---|---|"]
                     + ["| " + " | ".join(r) + " |" for r in rows])
    print("\n" + text, flush=True)
    out = os.environ.get("OUTX") or os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_pagedfp8_s17.md"), "w") as f:
            f.write(text + "\n\n" + "".join(logs))
        with open(os.path.join(out, "table.txt"), "w") as f:
            f.write(text + "\n")
    failed = [r for r in rows if "ERROR" in r[5]]
    print(f"done in {time.time() - t0:.0f} s; {len(failed)} failures", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
