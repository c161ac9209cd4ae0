"""fp8 KV-cache decode bandwidth, seventh session (issue 27 part 2; docs/serving.md "An fp8 KV cache"): the product
default against fp16 dots ([Note] fp16 dots in the decode template: tiles converted to fp16 by the hardware, q and P
scaled by powers of two into fp16's range) and a few tiles, each checked against float64 first.

    PYTHONPATH=$PWD python3 scripts/gpu_fp8kv_s7.py      # at most 105 s on an H100; one table; $OUT/gpu_fp8kv_s7.md
    GPU_FP8KV_S7_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_fp8kv_s7.py   # the CPU interpreter, tiny shapes

Candidates (text replacements on the render). Round A (00:50 UTC): default (then bf16 dots), f16 (F16_DOTS on), f16v
(F16_DOTS and V_ONCE on: V converted once in its load layout, as MLA's latent tile is; d128 only), f16l / f16vl (and
LAZY_RESCALE on: [Note] Lazy rescale), f16 at MLA tiles n64w8s3, n32w8s3, n32w4s4. Round B: default (the product,
fp16 dots now), asm (F16_DOTS off: the default of before), v (V_ONCE on, d128), l (LAZY_RESCALE on, MLA), and at
d128 b32 kv8192 the default and v with 2 and 4 splits (forward_split); MLA n32w4s4 and n64w4s2.
Phases, each in a child process with a timeout (a kernel that faults or hangs loses its phase, not the table):
1. d128: h32/8 at b32 kv8192 and b128 kv4096: bf16, e4m3, e5m2 (per-head scales): GB/s of the bytes read and % of a
   device copy measured in the same phase; every row checked (the last sequence) before it is timed.
2. mla: h16 sq1 page 64 at b32 kv32768 and b128 kv4096: bf16, e4m3 per token (the scales' 4 bytes a token counted).
3. check (the candidates, MLA first; the default is checked in each timing row), while time is left: against the float64
   reference on the dequantized cache (reference.dequantize), out within atol * max(1, T) + rtol * |o| (T: the
   reference on |V|, as gpu_fp8_pertoken.py), lengths not multiples of the key block: d128 h8/2 dense (Sk 1000;
   per-head, per-token scales) and paged page 16 (seqlens 1000/77/513; per-tensor, per-token), e4m3 and e5m2; MLA
   576/512 h16 page 64 (seqlens 1000/77/513, Sq 2 and 1), e4m3 per token and per tensor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

DRY = os.environ.get("GPU_FP8KV_S7_DRY") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# timings first (each row is checked before it is timed), then the checks while time is left
PHASES = {"d128": 35, "mla": 45, "check": 25} if not DRY else {"d128": 600, "mla": 600, "check": 600}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def phase(name):  # noqa: C901 - one phase in this process
    import torch
    import triton  # noqa: F401

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from gpu_rows import T0, log, row  # noqa: F401
    from gpu_rows import bench as _bench

    import fagen
    from fagen.runtime.loader import load_source
    from fagen.verify import reference
    from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare

    dev = "cpu" if DRY else "cuda"
    fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    D, DV, PAGE = (48, 32, 16) if DRY else (576, 512, 64)

    def emit(section, case, impl, value, unit, ms, note=""):
        row(section, case, impl, value, unit, ms, note)
        print("ROW " + json.dumps([section, case, impl, "-" if value is None else f"{value:.1f} {unit}",
                                   "" if ms is None else f"{ms:.4f}", note]), flush=True)

    def guarded(section, case, impl, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a failure is a row, never the end of the phase
            import traceback
            emit(section, case, impl, None, "", None, f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:150]}")
            traceback.print_exc(file=sys.stdout)

    def bench(fn):
        return _bench(fn, DRY, warmup=10, rep=40)

    # candidates: name -> (text replacements on the render, spec fields)
    # round B: the product default has fp16 dots ([Note] fp16 dots); "asm" is the default before (bf16 dots, e4m3
    # through the integer asm); "v" adds V converted once in its load layout (V_ONCE, d128); "l" the lazy rescale
    cands = {"default": ([], {}), "asm": ([("_F16_DOTS = True", "_F16_DOTS = False")], {}),
             "v": ([("V_ONCE = tl.constexpr(False and", "V_ONCE = tl.constexpr(True and")], {}),
             "l": ([("LAZY_RESCALE = tl.constexpr(False)", "LAZY_RESCALE = tl.constexpr(True)")], {})}
    mods = {}

    def module(spec_kw, cand):
        fields = dict(spec_kw, **cands[cand][1])
        key = (json.dumps(fields, sort_keys=True), cand)
        if key not in mods:
            spec = fagen.KernelSpec(**fields)
            if not cands[cand][0] or not spec.kv_dtype:
                mods[key] = fagen.load(spec)
            else:
                src = fagen.generate(spec)
                for old, new in cands[cand][0]:
                    if old not in src:
                        raise RuntimeError(f"{cand}: {old!r} not in the render")
                    src = src.replace(old, new)
                mods[key] = load_source(src, f"{spec.name}_{cand}")
        return mods[key]

    def scales(shape, gen):
        return torch.exp2(torch.rand(shape, device=dev, generator=gen) * 6 - 3)  # log-uniform 1/8 .. 8

    def d128_spec(kv, layout="dense", gqa=4):
        return dict(head_dim=128 if not DRY else 32, gqa=gqa, dtype="bf16", kind="decode", kv_dtype=kv, layout=layout,
                    **({"block_n": 16} if DRY else {}))

    def mla_spec(kv, mask="causal", **tiles):
        return dict(head_dim=D, head_dim_v=DV, shared_kv=True, kind="decode", gqa=16, dtype="bf16", mask=mask,
                    layout="paged", kv_dtype=kv, **({"block_n": 16} if DRY else tiles))

    def paged(k, page):
        """[B, H, S, D] -> shuffled pages [B*S/page, page, H, D] and the table."""
        b, h, s, d = k.shape
        n = s // page
        perm = torch.randperm(b * n, device=dev).to(torch.int32)
        cache = k.view(b, h, n, page, d).permute(0, 2, 3, 1, 4).reshape(b * n, page, h, d)[perm.argsort().long()]
        return cache, perm.view(b, n)

    def check_d128(kv, cand, layout, form):
        hd = 128 if not DRY else 32
        b, hkv, g, sk, page = 3, 2, 4, (1000 if not DRY else 100), 16
        gen = torch.Generator(device=dev).manual_seed(1)
        q = torch.randn(b, hkv * g, 1, hd, device=dev, generator=gen).mul(2).bfloat16()
        k = torch.randn(b, hkv, sk if layout == "dense" else 1024 if not DRY else 112, hd, device=dev, generator=gen)
        v = torch.randn_like(k)
        kq, vq = k.to(fp8[kv]), v.to(fp8[kv])
        m = module(d128_spec(kv, layout), cand)
        if layout == "dense":
            ks = scales((hkv,), gen) if form == "head" else scales(kq.shape[:-1], gen)
            vs = scales((hkv,), gen) if form == "head" else scales(vq.shape[:-1], gen)
            out, lse = m.forward(q, kq, vq, k_scale=ks, v_scale=vs)
            kd, vd = reference.dequantize(kq, ks), reference.dequantize(vq, vs)
        else:
            lens = torch.tensor([1000, 77, 513] if not DRY else [100, 7, 53], dtype=torch.int32, device=dev)
            kc, table = paged(kq, page)
            vc = vq.view(b, hkv, -1, page, hd).permute(0, 2, 3, 1, 4).reshape(-1, page, hkv, hd)[
                table.flatten().argsort().long()]
            if form == "tensor":
                ks, vs = 0.7, 1.6
            else:
                ks = scales(kc.shape[:-1], gen)
                vs = scales(vc.shape[:-1], gen)
            out, lse = m.forward(q, kc, vc, block_table=table, seqlens_k=lens, k_scale=ks, v_scale=vs)
            kd = reference.dequantize(kc, ks)[table.long()].permute(0, 3, 1, 2, 4).reshape(b, hkv, -1, hd)
            vd = reference.dequantize(vc, vs)[table.long()].permute(0, 3, 1, 2, 4).reshape(b, hkv, -1, hd)
            kd, vd = ([t[i:i + 1, :, :int(lens[i])] for i in range(b)] for t in (kd, vd))
        if layout == "dense":
            kd, vd = ([t[i:i + 1] for i in range(b)] for t in (kd, vd))
        err = 0.0
        for i in range(b):  # each sequence on its own keys
            want, wlse = reference.attention(q[i:i + 1].double(), kd[i], vd[i])
            terms, _ = reference.attention(q[i:i + 1].double(), kd[i], vd[i].abs())  # weighted |v|: compare_terms
            unit = terms.clamp(min=1.0)
            err = max(err, compare(f"out {i}", out[i:i + 1].double() / unit, want / unit, **TOLERANCE["bf16"]))
            compare(f"lse {i}", lse[i:i + 1], wlse, **LSE_TOLERANCE)
        return err

    def mla_inputs(kv, b, sq, n_max, lens, gen, per_token):
        q = torch.randn(b, 16, sq, D, device=dev, generator=gen).bfloat16()
        pages = -(-n_max // PAGE)
        cache = torch.randn(b * pages, PAGE, 1, D, device=dev, generator=gen).to(fp8[kv] if kv else torch.bfloat16)
        table = torch.randperm(b * pages, device=dev, generator=gen).to(torch.int32).view(b, pages)
        ks = (scales(cache.shape[:-1], gen) if per_token else 0.8) if kv else None
        return q, cache, table, torch.tensor(lens, dtype=torch.int32, device=dev), ks

    def mla_check_rows(m, q, cache, table, lens, ks, which):
        kw = {} if ks is None else dict(k_scale=ks)
        out, lse = m.forward(q, cache, None, block_table=table, seqlens_k=lens, **kw)
        worst = 0.0
        for i in which:
            n = int(lens[i])
            keys = reference.dequantize(cache, ks)[table[i].long()].reshape(-1, 1, D)[:n].transpose(0, 1)[None]
            want, wlse = reference.attention(q[i:i + 1].double(), keys, None, head_dim_v=DV, mask="causal")
            terms, _ = reference.attention(q[i:i + 1].double(), keys, keys[..., :DV].abs(), mask="causal")
            unit = terms.clamp(min=1.0)
            worst = max(worst, compare(f"out {i}", out[i:i + 1].double() / unit, want / unit, **TOLERANCE["bf16"]))
            compare(f"lse {i}", lse[i:i + 1], wlse, **LSE_TOLERANCE)
        return worst

    def copy_bw():
        x = torch.empty(1 << (20 if DRY else 30), dtype=torch.uint8, device=dev)
        y = torch.empty_like(x)
        return 2 * x.numel() / bench(lambda: y.copy_(x)) / 1e6

    if name == "check":
        for cand in ("default", "v"):
            for form in ("token", "tensor"):
                for sq in (2, 1):
                    if cand == "v":  # V_ONCE: on for MLA already
                        continue
                    case = f"MLA h16 sq{sq} page{PAGE} e4m3 {form} lens 1000/77/513"

                    def run():
                        gen = torch.Generator(device=dev).manual_seed(sq)
                        lens = [1000, 77, 513] if not DRY else [100, 7, 53]
                        q, cache, table, ln, ks = mla_inputs("fp8_e4m3", 3, sq, max(lens), lens, gen, form == "token")
                        m = module(mla_spec("fp8_e4m3"), cand)
                        err = mla_check_rows(m, q, cache, table, ln, ks, range(3))
                        emit("check", case, cand, None, "", None, f"ok, err {err:.1e}")
                    guarded("check", case, cand, run)
            for kv in fp8:
                for layout, form in (("dense", "head"), ("dense", "token"), ("paged", "tensor"), ("paged", "token")):
                    if cand == "v" and (kv == "fp8_e5m2" or form in ("head", "tensor")) \
                            or kv == "fp8_e5m2" and form == "token" and layout == "dense":
                        continue
                    case = f"d128 h8/2 {layout} {kv} {form} scales"

                    def run():
                        err = check_d128(kv, cand, layout, form)
                        emit("check", case, cand, None, "", None, f"ok, err {err:.1e}")
                    guarded("check", case, cand, run)
        return

    peak = copy_bw()
    emit(name, "device copy (read + write)", "torch copy_", peak, "GB/s", None)
    if name == "d128":
        hd = 128 if not DRY else 32
        for b, sk in ((32, 8192), (128, 4096)):
            b, sk = (min(b, 2), max(64, sk // 128)) if DRY else (b, sk)
            case = f"d128 h32/8 b{b} kv{sk}"
            rows = [(None, "default", None), ("fp8_e4m3", "default", None), ("fp8_e4m3", "asm", None),
                    ("fp8_e4m3", "v", None), ("fp8_e5m2", "default", None), ("fp8_e5m2", "asm", None)]
            if b == 32 or DRY:  # one wave of 2 programs an SM at most: more splits, more programs an SM
                rows += [("fp8_e4m3", c, n) for c in ("default", "v") for n in (2, 4)]
            for kv, cand, splits in rows:
                impl = f"{kv or 'bf16'} {cand}" + (f" {splits} splits" if splits else "")

                def run():
                    gen = torch.Generator(device=dev).manual_seed(0)
                    q = torch.randn(b, 32, 1, hd, device=dev, generator=gen).mul(3).bfloat16()
                    k = torch.randn(b, 8, sk, hd, device=dev, generator=gen)
                    v = torch.randn(b, 8, sk, hd, device=dev, generator=gen)
                    kw = {}
                    if kv:
                        k, v = k.to(fp8[kv]), v.to(fp8[kv])
                        kw = dict(k_scale=0.5 + torch.rand(8, device=dev, generator=gen),
                                  v_scale=0.5 + torch.rand(8, device=dev, generator=gen))
                    else:
                        k, v = k.bfloat16(), v.bfloat16()
                    m = module(d128_spec(kv), cand)
                    out, _ = m.forward_split(q, k, v, num_splits=splits, **kw)
                    ref, _ = reference.attention(q[-1:, :4].double(),
                                                 reference.dequantize(k[-1:, :1], kw["k_scale"][:1] if kv else None),
                                                 reference.dequantize(v[-1:, :1], kw["v_scale"][:1] if kv else None))
                    err = compare("out", out[-1:, :4], ref, **TOLERANCE["bf16"])
                    ms = bench(lambda: m.forward_split(q, k, v, num_splits=splits, **kw) if splits else
                               m.forward(q, k, v, **kw))
                    read = k.numel() * k.element_size() + v.numel() * v.element_size()
                    emit("d128", case, impl, read / ms / 1e6, "GB/s", ms,
                         f"{100 * read / ms / 1e6 / peak:.0f}% of copy; err {err:.1e}")
                guarded("d128", case, impl, run)
    if name == "mla":
        impls = [(None, "default", {}), ("fp8_e4m3", "default", {}), ("fp8_e4m3", "asm", {}),
                 ("fp8_e4m3", "l", {})]
        if not DRY:  # round A: n32w4s4 39 / 45% against the default's 39 / 44 (n64w8s3 36 / 40, n32w8s3 26 / 30)
            # n64w4s2: q's fragments re-read from shared memory once per 64 keys instead of 32 (spills 224 B)
            impls += [("fp8_e4m3", "default", dict(block_m=16, block_n=bn, num_warps=4, num_stages=st))
                      for bn, st in ((32, 4), (64, 2))]
        for b, n in ((32, 32768), (128, 4096)):
            b, n = (min(b, 2), max(64, n // 256)) if DRY else (b, n)
            case = f"MLA h16 sq1 page{PAGE} b{b} kv{n}"
            for kv, cand, tiles in impls:
                impl = f"{kv or 'bf16'}{' per token' if kv else ''} {cand}"
                impl += " m{block_m}n{block_n}w{num_warps}s{num_stages}".format(**tiles) if tiles else ""
                if tiles and time.time() - T0 > 30:
                    emit("mla", case, impl, None, "", None, "skipped: time budget")
                    continue

                def run():
                    gen = torch.Generator(device=dev).manual_seed(5)
                    q, cache, table, lens, ks = mla_inputs(kv, b, 1, n, [n] * b, gen, True)
                    m = module(mla_spec(kv, mask="none", **tiles), cand)
                    kw = {} if ks is None else dict(k_scale=ks)
                    out, _ = m.forward(q, cache, None, block_table=table, seqlens_k=lens, **kw)
                    keys = reference.dequantize(cache, ks)[table[-1].long()].reshape(-1, 1, D)[:n].transpose(0, 1)[None]
                    want, _ = reference.attention(q[-1:].double(), keys, None, head_dim_v=DV)
                    terms, _ = reference.attention(q[-1:].double(), keys, keys[..., :DV].abs())
                    unit = terms.clamp(min=1.0)
                    err = compare("out", out[-1:].double() / unit, want / unit, **TOLERANCE["bf16"])
                    ms = bench(lambda: m.forward(q, cache, None, block_table=table, seqlens_k=lens, **kw))
                    read = b * n * D * cache.element_size() + (b * n * 4 if kv else 0) + q.numel() * 2 * (1 + DV / D)
                    emit("mla", case, impl, read / ms / 1e6, "GB/s", ms,
                         f"{100 * read / ms / 1e6 / peak:.0f}% of copy; err {err:.1e}")
                guarded("mla", case, impl, run)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        phase(sys.argv[2])
        return
    t0 = time.time()
    env = dict(os.environ)
    env.setdefault("FAGEN_CACHE_DIR", "/tmp/fagen-cache-gpu-fp8kv-s7")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    rows, logs = [], []
    for name, limit in PHASES.items():
        print(f"[{time.time() - t0:6.1f}s] #### phase {name} (timeout {limit}s)", flush=True)
        lines = []
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--phase", name], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)

        def pump(stream=proc.stdout, lines=lines):
            for line in stream:
                lines.append(line)
                if not line.startswith("ROW "):
                    print(line, end="", flush=True)
        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = f"killed after {limit}s"
        reader.join(timeout=5)
        rows += [json.loads(line[4:]) for line in lines if line.startswith("ROW ")]
        logs += lines
        print(f"[{time.time() - t0:6.1f}s] #### phase {name}: rc={rc}", flush=True)
        if rc != 0:
            rows.append([name, "(phase)", "-", "-", "", f"ERROR rc={rc}"])
    text = "\n".join(["| section | case | impl | value | ms | note |", "|---|---|---|---|---|---|"]
                     + ["| " + " | ".join(r) + " |" for r in rows])
    print("\n" + text, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_fp8kv_s7.md"), "w") as f:
            f.write(text + "\n\n" + "".join(logs))
    failed = [r for r in rows if "ERROR" in r[5]]
    print(f"done in {time.time() - t0:.0f} s; {len(failed)} failures", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
