"""The Gluon MLA absorbed decode in the product (issue 27; fagen/templates/gluon/mla_decode.py.j2) through its
entries, the paged decode module's forward and fagen.attention(q, k, None, head_dim_v=512), against float64 and
against the Triton decode of the same case, one table.

    PYTHONPATH=$PWD python3 scripts/gpu_mla_glu.py              # under ~90 s on an H100; $OUT/gpu_mla_glu.md
    GPU_MLA_GLU_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_mla_glu.py   # CPU: sm_90 builds and the host rule only

Two phases at once, each a child process with a timeout (a kernel that faults or hangs costs its phase's rows):
1. check: Hq 128, Sq 2, page 64, lengths 1000/77/0/513/64 (NaN past each, pages shuffled): the gluon module's
   forward (the split rule, one split, three, batch_invariant) against float64; Sq 1; batch invariance (one
   sequence alone and in the batch, bitwise); bad lengths and page indexes (no fault, the other sequences' bits
   unchanged); fagen.attention on a dense latent cache (which module served, against float64).
2. time: Hq 128 Sq 2 kv8192 b32 and b64 (TF/s, causal: 2 x (576 + 512) flops a query row and key seen) and the
   memory-bound Hq 16 Sq 1 kv8192 b64 (GB/s of the cache read, against a device copy's), plus Hq 64 Sq 1 (the
   smallest rows the Gluon kernel takes) and Hq 128 Sq 1 (DeepSeek's plain decode step): the product's Gluon
   forward and the Triton decode, same process; and the per-call wall time of back-to-back steps at Hq 128 Sq 2
   from b1 kv1024 to b16 kv8192 (where the gluon module's host time stops mattering: hopper.LATENT_MIN_WORK).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DRY = os.environ.get("GPU_MLA_GLU_DRY") == "1"
T0 = time.time()
D, DV, PAGE = 576, 512, 64
SCALE = 192 ** -0.5
CHECK_LENS = [1000, 77, 0, 513, 64]
TIMEOUTS = dict(check=75, time=75, dry=300)  # round B: the runner stopped the script at 100 s


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def emit(section, case, impl, value, ms, note):
    print("ROW\t" + "\t".join([section, case, impl, value, "" if ms is None else f"{ms:.4f}", note]), flush=True)


def spec(hq, backend, layout="paged"):
    import fagen
    return fagen.KernelSpec(head_dim=D, head_dim_v=DV, shared_kv=True, kind="decode", gqa=hq, dtype="bf16",
                            mask="causal", layout=layout, backend=backend)


def module(hq, backend, layout="paged"):
    import fagen
    return fagen.load(spec(hq, backend, layout))


def inputs(lens, hq, sq, seed, dev):
    """q, a shuffled paged latent cache (NaN past each length), table, lengths, and sequence i's float64 keys."""
    import torch
    gen = torch.Generator(device="cpu").manual_seed(seed)
    width = max(1, max(-(-n // PAGE) for n in lens))
    pages = len(lens) * width + 3
    q = torch.randn(len(lens), hq, sq, D, generator=gen).bfloat16()
    cache = torch.randn(pages, PAGE, 1, D, generator=gen).bfloat16()
    table = torch.randperm(pages, generator=gen)[:len(lens) * width].to(torch.int32).view(len(lens), width)
    for b, n in enumerate(lens):
        for p in range(width):
            if n - p * PAGE < PAGE:
                cache[table[b, p], max(0, n - p * PAGE):] = float("nan")

    def keys(i):
        return cache[table[i].long()].double().reshape(-1, 1, D)[:lens[i]].transpose(0, 1)[None].to(dev)
    return q.to(dev), cache.to(dev), table.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev), keys


def compare(name, q, keys, lens, out, lse):
    """Max error of out against float64 (scaled by the reference of |V|, as scripts/gpu_mla_decode_s7.py) and lse;
    raises on a miss. An empty sequence: out 0, lse -inf."""
    import torch
    from fagen.verify import reference
    from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE
    from fagen.verify.tolerances import compare as cmp
    worst = 0.0
    for b, n in enumerate(lens):
        got, got_lse = out[b:b + 1].double(), lse[b:b + 1]
        if n == 0:
            assert bool((got == 0).all()) and bool(torch.isneginf(got_lse).all()), f"{name} seq {b}: empty"
            continue
        k = keys(b)
        qb = q[b:b + 1].double()
        want, want_lse = reference.attention(qb, k, None, head_dim_v=DV, mask="causal", scale=SCALE)
        unit = reference.attention(qb, k, k[..., :DV].abs(), mask="causal", scale=SCALE)[0].clamp(min=1.0)
        cmp(f"{name} out seq {b}", (got / unit).cpu(), (want / unit).cpu(), **TOLERANCE["bf16"])
        cmp(f"{name} lse seq {b}", got_lse.cpu(), want_lse.cpu(), **LSE_TOLERANCE)
        worst = max(worst, (got - want).abs().max().item())
    return worst


def row(section, case, impl, fn):
    """Run fn() -> (value, note) into a row; an exception is an ERROR row (the phase goes on)."""
    try:
        value, note = fn()
        emit(section, case, impl, value, None, note)
    except Exception as e:  # noqa: BLE001
        import traceback
        traceback.print_exc(file=sys.stderr)
        emit(section, case, impl, "-", None, f"ERROR {type(e).__name__}: {str(e).strip().splitlines()[0][:150]}")


def phase_check():
    import torch
    import fagen
    from fagen.runtime import hopper
    glu = module(128, "gluon")
    case = "h128 sq2 lens " + "/".join(map(str, CHECK_LENS))
    q, cache, table, lens, keys = inputs(CHECK_LENS, 128, 2, 7, "cuda")
    kw = dict(block_table=table, seqlens_k=lens, scale=SCALE)

    def one(fn):
        def run():
            t = time.time()
            out, lse = fn()
            torch.cuda.synchronize()
            return f"max err {compare(case, q, keys, CHECK_LENS, out, lse):.1e}", f"{time.time() - t:.1f} s with compile"
        return run
    row("check", case, "gluon forward (split rule)", one(lambda: glu.forward(q, cache, None, **kw)))
    row("check", case, "gluon 1 split (direct)", one(lambda: glu.forward_split(q, cache, None, num_splits=1, **kw)))
    row("check", case, "gluon 3 splits", one(lambda: glu.forward_split(q, cache, None, num_splits=3, **kw)))
    row("check", case, "gluon batch_invariant", one(lambda: glu.forward(q, cache, None, batch_invariant=True, **kw)))

    def invariant():
        out, lse = glu.forward(q, cache, None, batch_invariant=True, **kw)
        same = []
        for b in (0, 3):
            o1, l1 = glu.forward(q[b:b + 1], cache, None, block_table=table[b:b + 1], seqlens_k=lens[b:b + 1],
                                 scale=SCALE, batch_invariant=True)
            same.append(torch.equal(o1, out[b:b + 1]) and torch.equal(l1, lse[b:b + 1]))
        assert all(same), f"not bitwise the same alone and in the batch: {same}"
        return "bitwise", "seqs 0 and 3 alone vs in the batch of 5"
    row("check", case, "gluon batch invariance", invariant)

    def unsafe():  # [Note] Gluon decode memory safety: bad values change their own sequence only
        out0, lse0 = glu.forward(q, cache, None, **kw)
        bad_t, bad_l = table.clone(), lens.clone()
        bad_t[1, 0], bad_t[3, :] = -7, 10 ** 9
        bad_l[2], bad_l[4] = 10 ** 6, -5
        out, lse = glu.forward(q, cache, None, block_table=bad_t, seqlens_k=bad_l, scale=SCALE)
        torch.cuda.synchronize()
        assert torch.equal(out[0], out0[0]) and torch.equal(lse[0], lse0[0]), "sequence 0 changed"
        assert bool((out[4] == 0).all()) and bool(torch.isneginf(lse[4]).all()), "a negative length is not empty"
        return "no fault", "pages -7 and 1e9, lengths 1e6 and -5: sequence 0 bitwise unchanged"
    row("check", case, "gluon bad table/lengths", unsafe)

    q1, cache1, table1, lens1, keys1 = inputs(CHECK_LENS, 128, 1, 8, "cuda")
    row("check", case.replace("sq2", "sq1"), "gluon forward (split rule)", lambda: (
        f"max err {compare('sq1', q1, keys1, CHECK_LENS, *glu.forward(q1, cache1, None, block_table=table1, seqlens_k=lens1, scale=SCALE)):.1e}", ""))

    def attention():
        lens_d = [8201, 8201]  # 2 x 256 x 8201 pairs: past hopper.LATENT_MIN_WORK (2^22)
        qd, cached, tabled, _, keysd = inputs(lens_d, 128, 2, 9, "cuda")
        k = torch.stack([keysd(b)[0].bfloat16() for b in range(2)])  # [2, 1, 8201, 576] dense, from the pages
        with torch.no_grad():
            out = fagen.attention(qd, k, None, head_dim_v=DV, mask="causal", scale=SCALE)
        twin = hopper.latent_decode_spec(spec(128, "triton", "dense"), qd.device)
        served = "triton"
        if twin is not None:
            g_out = fagen.load(twin).forward(qd, k, None, scale=SCALE)[0]
            served = "gluon" if torch.equal(g_out, out) else "triton (gluon differs)"
        err = 0.0  # fagen.attention returns out only
        for b in range(2):
            kk = k[b:b + 1].double()
            want = fagen.verify.reference.attention(qd[b:b + 1].double(), kk, None, head_dim_v=DV, mask="causal",
                                                    scale=SCALE)[0]
            err = max(err, (out[b:b + 1].double() - want).abs().max().item())
        assert err < 0.05, err
        return f"max err {err:.1e}", f"served by {served}"
    import fagen.verify.reference  # noqa: F401
    row("check", "fagen.attention dense h128 sq2 sk8201", "fagen.attention", attention)


def timed(b, hq, sq, n, seed=5):
    import torch
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = b * (n // PAGE)
    q = torch.randn(b, hq, sq, D, device="cuda", generator=gen).bfloat16()
    cache = torch.randn(pages, PAGE, 1, D, device="cuda", generator=gen).bfloat16()
    table = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).view(b, n // PAGE)
    lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    return q, cache, table, lens


def phase_time():
    import torch
    from triton.testing import do_bench
    cases = [(32, 128, 2, 8192), (64, 128, 2, 8192), "host", (64, 128, 1, 8192), (64, 64, 1, 8192), (64, 16, 1, 8192)]
    copy_gbs = None
    for c in cases:
        if c == "host":
            phase_host()
            phase_attention()
            continue
        b, hq, sq, n = c
        q, cache, table, lens = timed(b, hq, sq, n)
        name = f"h{hq} sq{sq} b{b} kv{n} page{PAGE}"
        flops = 2 * (D + DV) * hq * b * (sq * n - sq * (sq - 1) // 2)
        nbytes = b * n * D * 2  # the latent cache, read once
        memory = sq == 1  # GB/s too
        if memory and copy_gbs is None:
            src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
            dst = torch.empty_like(src)
            copy_gbs = 2 * nbytes / do_bench(lambda: dst.copy_(src), warmup=10, rep=40) / 1e6
            emit("time", f"copy {nbytes >> 20} MiB", "torch copy_", f"{copy_gbs:.0f} GB/s", None, "read + write")
        ref = None
        impls = [("triton", module(hq, "triton"), {}), ("gluon", module(hq, "gluon"), {}),
                 ("gluon batch_invariant", module(hq, "gluon"), {"batch_invariant": True}),
                 ("triton batch_invariant", module(hq, "triton"), {"batch_invariant": True})][:4 if sq == 2 else 3]
        for label, mod, extra in impls:
            why = mod.fits(q, cache) if hasattr(mod, "fits") else None
            if why is not None:
                emit("time", name, label, "-", None, f"not taken: {why[:90]}")
                continue
            regs = extra.pop("_wg_regs", None)
            saved = getattr(mod, "WG_REGS", None)
            if regs is not None:
                mod.WG_REGS = regs  # read at each launch: a key of its own in the launch cache
            try:
                fn = lambda: mod.forward(q, cache, None, block_table=table, seqlens_k=lens, scale=SCALE, **extra)  # noqa
                out = fn()[0]
                torch.cuda.synchronize()
                note = ""
                if ref is None:
                    ref = out.float()
                else:
                    note = f"max diff vs triton {(out.float() - ref).abs().max().item():.1e}"
                ms = do_bench(fn, warmup=10, rep=40)
                value = f"{flops / ms / 1e9:.1f} TF/s"
                if memory:
                    value += f", {nbytes / ms / 1e6:.0f} GB/s ({nbytes / ms / 1e6 / copy_gbs:.0%} of copy)"
                emit("time", name, label, value, ms, note)
            except Exception as e:  # noqa: BLE001
                emit("time", name, label, "-", None, f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            finally:
                if regs is not None:
                    mod.WG_REGS = saved


def phase_attention():
    """fagen.attention(q, k, None, head_dim_v=512) on a dense latent cache at Hq 128 Sq 2 b32 kv8192: the product's
    choice (the gluon module) against FAGEN_HOPPER=0 (the Triton decode), same process."""
    import torch
    from triton.testing import do_bench
    import fagen
    b, n = 32, 8192
    gen = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(b, 128, 2, D, device="cuda", generator=gen).bfloat16()
    k = torch.randn(b, 1, n, D, device="cuda", generator=gen).bfloat16()
    flops = 2 * (D + DV) * 128 * b * (2 * n - 1)
    for label, env in (("fagen.attention (gluon)", "1"), ("fagen.attention, FAGEN_HOPPER=0 (triton)", "0")):
        os.environ["FAGEN_HOPPER"] = env
        try:
            with torch.no_grad():
                fn = lambda: fagen.attention(q, k, None, head_dim_v=DV, mask="causal", scale=SCALE)  # noqa
                fn()
                torch.cuda.synchronize()
                ms = do_bench(fn, warmup=10, rep=40)
            emit("time", f"dense h128 sq2 b{b} kv{n}", label, f"{flops / ms / 1e9:.1f} TF/s", ms, "")
        except Exception as e:  # noqa: BLE001
            emit("time", "dense", label, "-", None, f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    os.environ["FAGEN_HOPPER"] = "1"


def phase_host():
    """Per-call wall time of decode steps (Hq 128 Sq 2, page 64) from small to large: calls back to back, so a small
    step is host time (hopper.LATENT_MIN_WORK, B x Hq x Sq x Sk, is where the gluon module starts to win)."""
    import torch
    for b, n in ((1, 1024), (4, 4096), (8, 8192), (16, 8192)):
        q, cache, table, lens = timed(b, 128, 2, n)
        case = f"h128 sq2 b{b} kv{n} (2^{(b * 256 * n).bit_length() - 1} pairs) per call"
        for label, mod in (("triton", module(128, "triton")), ("gluon", module(128, "gluon"))):
            try:
                fn = lambda: mod.forward(q, cache, None, block_table=table, seqlens_k=lens, scale=SCALE)  # noqa
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(100):
                    fn()
                torch.cuda.synchronize()
                emit("time", case, label, f"{(time.perf_counter() - t) / 100 * 1e6:.1f} us", None, "100 back to back")
            except Exception as e:  # noqa: BLE001
                emit("time", case, label, "-", None, f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:120]}")


def dry():
    """CPU: the sm_90 builds (ptxas: registers, spills, shared memory) and the modules' host checks."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import torch
    from sm90 import ptxas
    from fagen.runtime import hopper
    glu = module(128, "gluon")
    for splits, sq in ((1, 2), (2, 2), (1, 1)):
        ck = glu.compile_for(seq_q=sq, num_splits=splits)
        res, log_, _ = ptxas(ck.asm["ptx"])
        res = next(iter(res.values()))
        emit("sm90", f"h128 sq{sq} splits {splits} (compile only)", "gluon", f"{res.registers} regs", None,
             f"spills {res.spill_stores}/{res.spill_loads}, smem {ck.metadata.shared} B, C7514 {'C7514' in log_}")
    q, cache, table, lens, _ = inputs([100, 0], 128, 2, 1, "cpu")
    emit("host", "fits h128 sq2 page64", "gluon", str(glu.fits(q, cache)), None, "")
    emit("host", "fits h16 sq1", "gluon", str(module(16, "gluon").fits(q[:, :16, :1], cache))[:60], None, "")
    emit("host", "selection on cpu", "hopper", str(hopper.latent_decode_spec(spec(128, "triton"), q.device)), None,
         "None: not sm_90")
    del torch


def start_phase(name):
    log(f"#### phase {name} (timeout {TIMEOUTS[name]} s)")
    proc = subprocess.Popen([sys.executable, __file__, "--phase", name], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
    lines = []

    def pump():
        for line in proc.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            if line.startswith("ROW\t"):
                log("row " + " | ".join(line.split("\t")[1:]))
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    return name, proc, time.time(), lines, reader


def finish_phase(started):
    name, proc, t0, lines, reader = started
    rows = []
    try:
        proc.wait(timeout=max(1.0, TIMEOUTS[name] - (time.time() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rows.append((name, "phase", "-", "-", "", f"ERROR timed out after {TIMEOUTS[name]} s"))
    reader.join(timeout=5)
    rows = [tuple(x.split("\t")[1:]) for x in lines if x.startswith("ROW\t")] + rows
    print("\n".join(f"    {x}" for x in [x for x in lines if not x.startswith("ROW\t")][-12:]), flush=True)
    if proc.returncode not in (0, None) and not any("timed out" in r[5] for r in rows):
        rows.append((name, "phase", "-", "-", "", f"ERROR exit {proc.returncode}"))
    return rows


def main():
    if "--phase" in sys.argv:
        {"check": phase_check, "time": phase_time, "dry": dry}[sys.argv[sys.argv.index("--phase") + 1]]()
        return
    import torch
    import triton
    if not DRY and not torch.cuda.is_available():
        sys.exit("gpu_mla_glu.py needs a CUDA GPU (GPU_MLA_GLU_DRY=1 builds for sm_90 on the CPU)")
    log(f"{'CPU dry run' if DRY else torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"triton {triton.__version__}")
    phases = ["dry"] if DRY else ["check", "time"]
    started = [start_phase(p) for p in phases]  # at once: the compiles overlap, the checks' GPU work is small
    rows = [r for s in started for r in finish_phase(s)]
    lines = ["| section | case | impl | value | ms | note |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_mla_glu.md"), "w") as f:
            f.write(text + "\n")
    failed = [r for r in rows if "ERROR" in r[5]]
    log(f"done in {time.time() - T0:.0f} s; {len(failed)} failures")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
