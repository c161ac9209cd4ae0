"""Bad-value fuzz of every kernel kind ([Note] Memory safety in fagen/templates/triton/masks.j2).

Lengths, cu_seqlens, page indices, tree parents and window extents that no check read (check=False), negative and
huge, against every layout (dense padding, varlen, paged) x kind (prefill, decode) x direction (fwd, bwd). Each case
is a call with one bad value, checked against one good call of its group: the bad call returns, nothing is NaN
outside the bad sequence, and every other sequence's out/lse (and dq/dk/dv) is bitwise the good call's. After a
group's bad calls a good call must still give the same bits (no state, such as decode's split counters, is left
broken), and check=True must still raise InputError. Unchecked bad values may give their own sequence any result.

    compute-sanitizer --tool memcheck --error-exitcode 1 python scripts/gpu_memcheck_fuzz.py      (an H100: 0 errors)
    python scripts/gpu_memcheck_fuzz.py --device cpu --group varlen        (tests/test_fuzz_memory.py, interpreter)

Covers the Triton backend (prefill fwd/bwd, decode, varlen, paged; MLA's shared latent cache; user mods with
captured tensors on the paged decode and the varlen fwd+bwd), on an sm_90 GPU the Gluon MLA decode, and, on a GPU
with nvcc, the CUDA backend's padding forward. Prints one line per case and a summary (also to $OUT/gpu_memcheck_fuzz.log when OUT is set);
exits 1 if a case failed.
"""
import argparse
import os
import random
import sys

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
ap.add_argument("--group", action="append", help="run only these groups (default: all)")
ap.add_argument("--seed", type=int, default=0, help="seed of the random bad values drawn beside the fixed ones")
args = ap.parse_args()
if args.device == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
else:
    # Every tensor its own cudaMalloc: inside the caching allocator's 2 MB segments an overrun past a small tensor
    # reads memory that memcheck counts as allocated, and would go unreported.
    os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import fagen  # noqa: E402

DEV = args.device
GPU = DEV == "cuda"
DT = torch.float16 if GPU else torch.float32
D = 64 if GPU else 16
# Small tiles on the interpreter (several blocks per sequence); the default tiles (the ones users run) on a GPU.
TILES = {} if GPU else dict(block_m=16, block_n=16, num_warps=1, num_stages=1)
DTILES = {} if GPU else dict(block_n=16)
# Sequence 1 holds the bad value; the CPU runs two sequences (so it is the last: an overrun leaves the tensor) and
# two query heads, the GPU three and four.
NB, HQ = (3, 4) if GPU else (2, 2)
HKV = HQ // 2
OTHER = torch.tensor([b for b in range(NB) if b != 1], device=DEV)  # the sequences that must not change
I32_MAX, I32_MIN = 2**31 - 1, -2**31
RNG = random.Random(args.seed)
FAILED, RAN, LOG = [], [], []


def say(line):
    LOG.append(line)
    print(line, flush=True)


def spec(**kw):
    tiles = DTILES if kw.get("kind") == "decode" else TILES
    return fagen.KernelSpec(head_dim=D, gqa=2, dtype="fp16" if GPU else "fp32", **tiles, **kw)


def i32(*values):
    return torch.tensor(values, dtype=torch.int32, device=DEV)


def randn(*shape):
    return torch.randn(*shape, device=DEV, dtype=DT)


def bad_ints(limit):
    """Fixed bad values for something that must lie in [0, limit], and some drawn at random (fewer on the CPU,
    where the interpreter runs each case in about a second)."""
    fixed = [limit + 1, 100000, -1, I32_MAX, I32_MIN] + ([99, -5] if GPU else [])
    return fixed + [RNG.randint(I32_MIN, I32_MAX) for _ in range(3 if GPU else 1)]


def same(name, good, bad, where):
    """good and bad tensors agree bitwise on the index `where` (the sequences the bad value does not belong to)."""
    g, b = good[where], bad[where]
    if torch.isnan(b).any():
        return f"{name}: NaN outside the bad sequence"
    if not torch.equal(g, b):
        return f"{name}: another sequence changed (max diff {(g.float() - b.float()).abs().max().item():.3g})"
    return None


def report(name, problems):
    RAN.append(name)
    if problems:
        FAILED.append(name)
        say(f"FAIL {name}: {'; '.join(problems)}")
    else:
        say(f"ok   {name}")


def case(name, run, compare, good):
    """run() -> dict of tensors with the bad value; compare: [(key, index)] that must equal `good` (the same run
    with good values) bitwise; [] checks only that the call returns."""
    try:
        bad = run()
        if GPU:
            torch.cuda.synchronize()
        problems = [p for p in (same(key, good[key], bad[key], where) for key, where in compare) if p]
    except Exception as e:  # noqa: BLE001 - a case that raises is a failed case, reported on its line
        problems = [f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"]
    report(name, problems)


def still_good(name, run, good):
    """After the bad calls, a good call gives the first good call's bits: no state (decode's split counters) broke."""
    again = run()
    report(f"{name}: a good call after the bad ones is unchanged",
           [p for p in (same(key, good[key], again[key], (slice(None),)) for key in good) if p])


def refused(name, call, what):
    """check=True must raise the module's InputError naming `what`."""
    try:
        call()
        problem = "no error"
    except ValueError as e:
        problem = None if type(e).__name__ == "InputError" and what in str(e) else f"{type(e).__name__}: {e}"
    report(name, [f"not refused ({problem})"] if problem else [])


def group_padding():
    """Dense padding masks: bad seqlens_k / seqlens_q of sequence 1, prefill fwd + bwd and decode (split merge)."""
    sq, sk = (37, 45) if GPU else (20, 23)
    q, k, v = randn(NB, HQ, sq, D), randn(NB, HKV, sk, D), randn(NB, HKV, sk, D)
    do = randn(NB, HQ, sq, D)
    other = (OTHER,)
    m = fagen.load(spec(mask="causal+padding", direction="bwd"))

    def prefill(lq, lk):
        lq, lk = i32(*lq), i32(*lk)
        out, lse = m.forward(q, k, v, seqlens_q=lq, seqlens_k=lk, check=False)
        dq, dk, dv = m.backward(do, q, k, v, out, lse, seqlens_q=lq, seqlens_k=lk, check=False)
        return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)

    lens_q, lens_k = [sq, 11, sq - 3][:NB], [sk, 13, sk - 1][:NB]
    good = prefill(lens_q, lens_k)
    for which, values in (("k", bad_ints(sk)), ("q", bad_ints(sq)[:4])):
        for value in values:
            lq, lk = list(lens_q), list(lens_k)
            (lk if which == "k" else lq)[1] = value
            case(f"padding prefill fwd+bwd seqlens_{which}[1]={value}", lambda: prefill(lq, lk),
                 [(key, other) for key in ("out", "lse", "dq", "dk", "dv")], good)
    still_good("padding prefill", lambda: prefill(lens_q, lens_k), good)
    refused("padding check=True refuses seqlens_k past Sk",
            lambda: m.forward(q, k, v, seqlens_q=i32(*lens_q), seqlens_k=i32(*[sk, sk + 1, 3][:NB]), check=True),
            "seqlens_k")

    dec = fagen.load(spec(mask="padding", kind="decode"))
    qd = randn(NB, HQ, 3, D)
    dq_lens = [3, 2, 3][:NB]

    def decode(lq, lk):
        lq, lk = i32(*lq), i32(*lk)
        out, lse = dec.forward_split(qd, k, v, num_splits=3, seqlens_q=lq, seqlens_k=lk, check=False)
        one, lse1 = dec.forward(qd, k, v, seqlens_q=lq, seqlens_k=lk, check=False)
        return dict(out=out, lse=lse, out1=one, lse1=lse1)

    good = decode(dq_lens, lens_k)
    for which, values in (("k", bad_ints(sk)), ("q", [4, 100000, -1, I32_MIN])):
        for value in values:
            lq, lk = list(dq_lens), list(lens_k)
            (lk if which == "k" else lq)[1] = value
            case(f"padding decode (3 splits, and 1) seqlens_{which}[1]={value}", lambda: decode(lq, lk),
                 [(key, other) for key in good], good)
    still_good("padding decode", lambda: decode(dq_lens, lens_k), good)

    if GPU:
        try:
            cu = fagen.load(fagen.KernelSpec(head_dim=D, mask="padding", backend="cuda", dtype="fp16"))
        except Exception as e:  # noqa: BLE001 - no nvcc on this machine: say so and go on
            say(f"skip the CUDA backend: {type(e).__name__}: {str(e).splitlines()[0]}")
            return
        qc, kc, vc = randn(NB, 2, sq, D), randn(NB, 2, sk, D), randn(NB, 2, sk, D)

        def cuda(lk):
            out, lse = cu.forward(qc, kc, vc, seqlens_q=i32(*lens_q), seqlens_k=i32(*lk), check=False)
            return dict(out=out, lse=lse)

        good = cuda(lens_k)
        for value in bad_ints(sk):
            case(f"padding cuda backend seqlens_k[1]={value}", lambda: cuda([sk, value, sk - 1]),
                 [("out", other), ("lse", other)], good)


def group_varlen():
    """Packed sequences: cu_seqlens past the rows, decreasing, huge; fwd + bwd. Sequence 0 (rows 0..9 of q, 0..11
    of k) must not change unless a decreasing cu_seqlens makes another sequence's rows cover it."""
    tq, tk = 30, 34
    q, k, v = randn(tq, HQ, D), randn(tk, HKV, D), randn(tk, HKV, D)
    do = randn(tq, HQ, D)
    good_q, good_k = [0, 10, 10, 30], [0, 12, 12, 34]
    m = fagen.load(spec(mask="causal", direction="bwd", layout="varlen"))

    def run(cq, ck):
        kw = dict(cu_seqlens_q=i32(*cq), cu_seqlens_k=i32(*ck), max_seqlen_q=30, max_seqlen_k=34, check=False)
        out, lse = m.forward(q, k, v, **kw)
        dq, dk, dv = m.backward(do, q, k, v, out, lse, **kw)
        return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)

    good = run(good_q, good_k)
    rows_q, rows_k = (slice(0, 10),), (slice(0, 12),)
    seq0 = [("out", rows_q), ("lse", (slice(None), slice(0, 10))), ("dq", rows_q), ("dk", rows_k), ("dv", rows_k)]
    cases = [([0, 10, 10, 40], None), ([0, 10, 10, I32_MAX], None), ([0, 10, 30, 10], None),
             (None, [0, 12, 12, 100000]), (None, [0, 12, 40, 34]), ([0, 10, 10, 40], [0, 12, 12, 40]),
             ([0, 10, RNG.randint(10, 2**20), RNG.randint(I32_MIN, I32_MAX)], None),
             ([0, 10, 25, I32_MIN], [0, 12, 12, -3]),  # decreasing: the last sequence is empty
             ([0, 10, -5, 30], [0, 12, 2, 34])]  # decreasing: sequence 2's clamped rows cover sequence 0's
    for cq, ck in cases:
        overlap = min((cq or good_q)[2:]) < 10 or min((ck or good_k)[2:]) < 12
        name = f"varlen fwd+bwd cu_seqlens_q={cq or good_q} cu_seqlens_k={ck or good_k}"
        case(name + (" (rows overlap sequence 0: returns)" if overlap else ""),
             lambda: run(cq or good_q, ck or good_k), [] if overlap else seq0, good)
    still_good("varlen", lambda: run(good_q, good_k), good)
    refused("varlen check=True refuses cu_seqlens past the rows",
            lambda: m.forward(q, k, v, cu_seqlens_q=i32(0, 10, 10, 40), cu_seqlens_k=i32(*good_k), max_seqlen_q=30,
                              max_seqlen_k=34, check=True), "cu_seqlens_q")


def paged_inputs(table, lens, what=None, value=None):
    """(block_table, seqlens_k) on the device, with one bad value put in sequence 1's: `what` is
    "block_table[1][2]" or "seqlens_k[1]"."""
    t, n = [list(r) for r in table], list(lens)
    if what == "block_table[1][2]":
        t[1][2] = value
    elif what == "seqlens_k[1]":
        n[1] = value
    return torch.tensor(t, dtype=torch.int32, device=DEV), i32(*n)


def group_paged():
    """Paged KV caches: block_table entries outside the cache and cached lengths past the table, for decode (plain,
    split, tree) and prefill; sequence 1 holds the bad value, sequences 0 and 2 must not change."""
    pages, page, width = 16, 4, 5
    kc, vc = randn(pages, page, HKV, D), randn(pages, page, HKV, D)
    table = [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14]][:NB]
    lens = [20, 17, 13][:NB]
    other = (OTHER,)
    qd = randn(NB, HQ, 2, D)
    dec = fagen.load(spec(mask="causal", kind="decode", layout="paged"))
    tree = fagen.load(spec(mask="tree", kind="decode", layout="paged"))
    parents = i32(*[-1, 0] * NB).view(NB, 2)
    pre = fagen.load(spec(mask="causal", layout="paged"))
    qp = randn(3 * NB, HQ, D)
    cu_q = [0, 3, 6, 9][:NB + 1]
    not_seq1 = torch.tensor([0, 1, 2, 6, 7, 8][:3 * NB - 3], device=DEV)

    def decode(what=None, value=None):
        t, n = paged_inputs(table, lens, what, value)
        out, lse = dec.forward(qd, kc, vc, block_table=t, seqlens_k=n, check=False)
        out3, lse3 = dec.forward_split(qd, kc, vc, num_splits=3, block_table=t, seqlens_k=n, check=False)
        outt, lset = tree.forward(qd, kc, vc, block_table=t, seqlens_k=n, tree_mask=parents, check=False)
        return dict(out=out, lse=lse, out3=out3, lse3=lse3, outt=outt, lset=lset)

    def prefill(what=None, value=None, cu=cu_q):
        t, n = paged_inputs(table, lens, what, value)
        out, lse = pre.forward(qp, kc, vc, cu_seqlens_q=i32(*cu), max_seqlen_q=3, block_table=t, seqlens_k=n,
                               check=False)
        return dict(out=out, lse=lse)

    good_d, good_p = decode(), prefill()
    bad_pages = [100000, -1, pages, I32_MIN] + ([-7, I32_MAX] if GPU else []) + [RNG.randint(pages, I32_MAX)]
    variants = [("block_table[1][2]", p) for p in bad_pages] + [("seqlens_k[1]", n) for n in bad_ints(width * page)]
    for what, value in variants:
        case(f"paged decode (plain, 3 splits, tree) {what}={value}", lambda: decode(what, value),
             [(key, other) for key in good_d], good_d)
        case(f"paged prefill {what}={value}", lambda: prefill(what, value),
             [("out", (not_seq1,)), ("lse", (slice(None), not_seq1))], good_p)
    for cu in ([0, 3, 100000, 9], [0, 3, 6, I32_MAX], [0, 3, 9, 5], [0, 3, -1, 9]):
        cu = cu[:NB + 1]
        # A start clamped below 3 (the -1) makes a later sequence's rows cover sequence 0's: README's overlap rule
        # leaves those rows unspecified, so that case only returns (the interpreter's program order hid this; the
        # H200 showed sequence 0 overwritten, 2026-11-26).
        starts = [min(max(c, 0), 3 * NB) for c in cu[1:NB]]  # the kernel's clamps ([Note] Memory safety)
        overlap = any(s < 3 and min(max(e, s), 3 * NB) > s for s, e in zip(starts, cu[2:]))
        case(f"paged prefill cu_seqlens_q={cu}" + (" (rows overlap sequence 0: returns)" if overlap else ""),
             lambda: prefill(cu=cu), [] if overlap else [("out", (slice(0, 3),)), ("lse", (slice(None), slice(0, 3)))],
             good_p)
    still_good("paged decode", decode, good_d)
    still_good("paged prefill", prefill, good_p)
    empty = kc[:0]  # a cache of 0 pages (a view: a real, non-null address)
    t = torch.tensor(table, dtype=torch.int32, device=DEV)
    out, lse = dec.forward(qd, empty, empty, block_table=t, seqlens_k=i32(*lens), check=False)
    report("paged decode from an empty cache (0 pages): every row sees nothing",
           [] if not out.any() and bool((lse == -float("inf")).all()) else ["rows saw keys of an empty cache"])
    bad_table = t.clone()
    bad_table[1, 2] = 100000
    refused("paged check=True refuses a page outside the cache",
            lambda: dec.forward(qd, kc, vc, block_table=bad_table, seqlens_k=i32(*lens), check=True), "block_table")


def group_tree():
    """Tree masks: parent pointers out of range, pointing forward, huge; bool masks that are not trees."""
    sq, sk = 20, 29
    q, k, v = randn(NB, HQ, sq, D), randn(NB, HKV, sk, D), randn(NB, HKV, sk, D)
    do = randn(NB, HQ, sq, D)
    m = fagen.load(spec(mask="tree", direction="bwd"))
    parents = torch.tensor([[-1] + [i // 2 for i in range(sq - 1)]] * NB, dtype=torch.int32, device=DEV)
    other = (OTHER,)

    def run(tree):
        out, lse = m.forward(q, k, v, tree_mask=tree, check=False)
        dq, dk, dv = m.backward(do, q, k, v, out, lse, tree_mask=tree, check=False)
        return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)

    good = run(parents)
    for value in (100000, -7, 5, I32_MIN) + ((sq, I32_MAX) if GPU else ()):
        bad = parents.clone()
        bad[1, 5] = bad[1, 0] = value
        case(f"tree prefill fwd+bwd parents[1][0, 5]={value}", lambda: run(bad),
             [(key, other) for key in good], good)
    noise = m.tree_mask_from_parents(parents, check=False)
    noise[1] = torch.rand(sq, sq, device=DEV) < 0.5
    case("tree prefill fwd+bwd with a bool mask of noise in sequence 1", lambda: run(noise),
         [(key, other) for key in good], good)
    bad = parents.clone()
    bad[1, 3] = 100000
    refused("tree check=True refuses a parent after its child",
            lambda: m.forward(q, k, v, tree_mask=bad, check=True), "tree parents")


def group_window():
    """Window extents are host ints: negative ones are refused always; huge ones act as unbounded (no overflow).
    With a bad padding length in sequence 1 and a sink of +inf on head 1."""
    sq, sk = 20, 23
    q, k, v = randn(2, HQ, sq, D), randn(2, HKV, sk, D), randn(2, HKV, sk, D)
    lq, lk = i32(sq, 11), i32(sk, 100000)
    m = fagen.load(spec(mask="causal+padding", window=True, sinks=True))
    sinks = torch.tensor([0.5, float("inf"), -1.0, 2.0][:HQ], device=DEV)
    dec = fagen.load(spec(mask="causal", kind="decode", window=True))
    qd = randn(2, HQ, 3, D)

    def run(window):
        out, lse = m.forward(q, k, v, seqlens_q=lq, seqlens_k=lk, window=window, sinks=sinks, check=False)
        outd, lsed = dec.forward_split(qd, k, v, num_splits=3, window=window, check=False)
        return dict(out=out, lse=lse, outd=outd, lsed=lsed)

    for window, same_as in (((2**40, 2**40), (None, None)), ((I32_MAX, 0), (None, 0)), ((2**62, None), (None, None))):
        case(f"window={window} acts as {same_as}", lambda: run(window),
             [("out", (slice(0, 1),)), ("lse", (slice(0, 1),)), ("outd", (slice(None),)), ("lsed", (slice(None),))],
             run(same_as))
    refused("window (-1, 0) is refused", lambda: m.forward(q, k, v, seqlens_q=lq, seqlens_k=lk, window=(-1, 0),
                                                           sinks=sinks), "window")


def group_mla():
    """MLA's shared latent cache (shared_kv: V is the first head_dim_v columns of the one K cache, read once): bad
    block_table entries and cached lengths in sequence 1 of a paged decode (fp8: group mla_fp8). Small dims
    (48 / 32) on the interpreter-sized run, the real 576 / 512 on a GPU."""
    dk, dv = (576, 512) if GPU else (48, 32)
    pages, page, width = 16, 4, 5
    kc = randn(pages, page, 1, dk)
    table = [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14]][:NB]
    lens = [20, 17, 13][:NB]
    qd = randn(NB, 2 * HQ, 2, dk)
    tiles = {} if GPU else dict(block_n=16)
    mla = fagen.load(fagen.KernelSpec(head_dim=dk, head_dim_v=dv, shared_kv=True, gqa=2 * HQ, kind="decode",
                                      layout="paged", mask="causal", dtype="fp16" if GPU else "fp32", **tiles))

    def run(what=None, value=None):
        t, n = paged_inputs(table, lens, what, value)
        out, lse = mla.forward(qd, kc, None, block_table=t, seqlens_k=n, check=False)
        return dict(out=out, lse=lse)

    good = run()
    variants = [("block_table[1][2]", p) for p in (100000, -1, pages, I32_MIN, I32_MAX)]
    variants += [("seqlens_k[1]", n) for n in bad_ints(width * page)]
    for what, value in variants:
        case(f"mla paged decode d{dk}/v{dv} {what}={value}", lambda: run(what, value),
             [(key, (OTHER,)) for key in good], good)
    still_good("mla paged decode", run, good)


def group_mla_fp8():
    """MLA's latent cache in fp8 (kv_dtype with shared_kv): e4m3 causal and e5m2 tree paged decodes, with k_scale a
    float, a per-head tensor and per-token scales called in turn at one shape (a decode step replayed for another
    form once loaded a scale through a null pointer, [Note] Decode steps), and bad block_table entries and lengths in
    sequence 1."""
    dk, dv = (576, 512) if GPU else (48, 32)
    pages, page, width = 16, 4, 5
    table = [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14]][:NB]
    lens = [20, 17, 13][:NB]
    qd = torch.randn(NB, 2 * HQ, 2, dk, device=DEV, dtype=torch.float16)
    parents = i32(*[-1, 0] * NB).view(NB, 2)
    tiles = {} if GPU else dict(block_n=16)
    forms = (0.7, torch.tensor([1.3], device=DEV), token_scales(pages, page, table, lens))
    names = ("float", "per head", "per token")
    for kv, mask in (("fp8_e4m3", "causal"), ("fp8_e5m2", "tree")):
        kc = torch.randn(pages, page, 1, dk, device=DEV).to(getattr(torch, {"fp8_e4m3": "float8_e4m3fn",
                                                                            "fp8_e5m2": "float8_e5m2"}[kv]))
        mla = fagen.load(fagen.KernelSpec(head_dim=dk, head_dim_v=dv, shared_kv=True, gqa=2 * HQ, kind="decode",
                                          layout="paged", mask=mask, dtype="fp16", kv_dtype=kv, **tiles))
        tree = dict(tree_mask=parents) if mask == "tree" else {}

        def run(what=None, value=None, scale=0.7):
            t, n = paged_inputs(table, lens, what, value)
            out, lse = mla.forward(qd, kc, None, block_table=t, seqlens_k=n, k_scale=scale, check=False, **tree)
            return dict(out=out, lse=lse)

        goods = [run(scale=s) for s in forms]
        variants = [("block_table[1][2]", p) for p in (100000, -1, pages, I32_MIN)]
        variants += [("seqlens_k[1]", n) for n in bad_ints(width * page)]
        for what, value in variants:
            for form, (scale, good) in enumerate(zip(forms, goods)):
                case(f"mla {kv} {mask} paged decode d{dk}/v{dv} k_scale {names[form]} "
                     f"{what}={value}", lambda: run(what, value, scale), [(key, (OTHER,)) for key in good], good)
        for form, (scale, good) in enumerate(zip(forms, goods)):
            still_good(f"mla {kv} {mask} paged decode k_scale {names[form]}",
                       lambda: run(scale=scale), good)


def token_scales(pages, page, table, lens):
    """Per-token scales [pages, page, 1] from 1/2 to 2 in the slots the sequences own, NaN in every other (no valid
    output may read one)."""
    scales = torch.full((pages, page, 1), float("nan"), device=DEV)
    for row, n in zip(table, lens):
        for p in range(-(-n // page)):
            used = min(page, n - p * page)
            scales[row[p], :used] = torch.rand(used, 1, device=DEV) * 1.5 + 0.5
    return scales


def group_fp8_token():
    """Per-token fp8 scales (README "fp8 KV cache"): an e4m3 latent cache (MLA, paged) with scales [pages, page, 1],
    NaN in every slot no sequence owns; bad block_table entries and lengths in sequence 1 leave the other sequences'
    bits, and a scale tensor of the wrong shape, dtype or device is refused before any launch, check=False too."""
    dk, dv = (576, 512) if GPU else (48, 32)
    pages, page, width = 16, 4, 5
    table = [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14]][:NB]
    lens = [20, 17, 13][:NB]
    qd = torch.randn(NB, 2 * HQ, 1, dk, device=DEV, dtype=torch.float16)
    kc = torch.randn(pages, page, 1, dk, device=DEV).to(torch.float8_e4m3fn)
    scales = token_scales(pages, page, table, lens)
    mla = fagen.load(fagen.KernelSpec(head_dim=dk, head_dim_v=dv, shared_kv=True, gqa=2 * HQ, kind="decode",
                                      layout="paged", mask="causal", dtype="fp16", kv_dtype="fp8_e4m3", **DTILES))

    def run(what=None, value=None, scale=scales):
        t, n = paged_inputs(table, lens, what, value)
        out, lse = mla.forward(qd, kc, None, block_table=t, seqlens_k=n, k_scale=scale, check=False)
        return dict(out=out, lse=lse)

    good = run()
    report("fp8 per-token paged decode: no NaN scale reaches a valid output",
           ["NaN in out"] if torch.isnan(good["out"]).any() else [])
    variants = [("block_table[1][2]", p) for p in (100000, -1, pages)]
    variants += [("seqlens_k[1]", n) for n in (width * page + 1, -1, I32_MAX)]
    for what, value in variants:
        case(f"fp8 per-token paged decode d{dk}/v{dv} {what}={value}", lambda: run(what, value),
             [(key, (OTHER,)) for key in good], good)
    still_good("fp8 per-token paged decode", run, good)
    for name, bad, what in (("shape [pages, page]", scales[..., 0], "per KV head) or a float32 tensor"),
                            ("shape [pages, page - 1, 1]", scales[:, 1:], "must have the cache's shape"),
                            ("dtype float16", scales.half(), "must be float32"),
                            ("device meta", torch.ones(pages, page, 1, device="meta"), "must be on q's device")):
        refused(f"fp8 per-token scales of {name} refused before launch", lambda: run(scale=bad), what)


def group_paged_fp8():
    """An fp8 cache with its own V, paged ([Note] Paged prefetch (fp8, own V) in the decode template: each key step
    loads the next step's page numbers): e4m3 causal and e5m2 none, k/v scales per head and per tensor, through the
    split rule and 3 splits, with pages of 4 keys (a key block spans several pages); bad block_table entries and
    lengths in sequence 1, and NaN in every page no sequence owns."""
    table = [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14]][:NB]
    qd = torch.randn(NB, HQ, 1, D, device=DEV, dtype=torch.float16)
    for kv, mask, scales in (("fp8_e4m3", "causal", (torch.tensor([1.3] * HKV, device=DEV), 0.6)),
                             ("fp8_e5m2", "none", (0.7, torch.tensor([0.9] * HKV, device=DEV)))):
        paged_fp8_cases(qd, kv, mask, scales, table, [20, 17, 13][:NB], pages=16, page=4, bad_lens=None)


def paged_fp8_cases(qd, kv, mask, scales, table, lens, pages, page, bad_lens):
    """One paged fp8 decode spec's cases (group_paged_fp8, group_dense_fp8): NaN (e4m3: 0x7f; e5m2: 0x7f is NaN too)
    in every page no sequence owns; bad block_table entries, then bad lengths (the first `bad_lens` of them, None:
    all), of sequence 1; the plain call through the split rule and 3 splits."""
    d, width = qd.shape[-1], len(table[0])
    dt = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv]
    kc, vc = (torch.randn(pages, page, HKV, d, device=DEV).to(dt) for _ in range(2))
    owned = [p for row, n in zip(table, lens) for p in row[:-(-n // page)]]
    for c in (kc, vc):
        spare = torch.ones(pages, dtype=torch.bool, device=DEV)
        spare[owned] = False
        c.view(torch.uint8)[spare] = 0x7F
    qname = {torch.float16: "fp16", torch.bfloat16: "bf16"}[qd.dtype]
    dec = fagen.load(fagen.KernelSpec(head_dim=d, gqa=2, kind="decode", layout="paged", mask=mask, dtype=qname,
                                      kv_dtype=kv, **DTILES))
    label = f"fp8 {kv} {mask} paged decode d{d} {qname}"

    def run(what=None, value=None):
        t, n = paged_inputs(table, lens, what, value)
        kw = dict(block_table=t, seqlens_k=n, k_scale=scales[0], v_scale=scales[1], check=False)
        out, lse = dec.forward(qd, kc, vc, **kw)
        out3, lse3 = dec.forward_split(qd, kc, vc, num_splits=3, **kw)
        return dict(out=out, lse=lse, out3=out3, lse3=lse3)

    good = run()
    report(f"{label}: no NaN page reaches a valid output",
           ["NaN in out"] if any(torch.isnan(good[key]).any() for key in ("out", "out3")) else [])
    variants = [("block_table[1][2]", p) for p in (100000, -1, pages, I32_MIN, I32_MAX)]
    variants += [("seqlens_k[1]", n) for n in bad_ints(width * page)[:bad_lens]]
    for what, value in variants:
        case(f"{label} (plain, 3 splits) {what}={value}", lambda: run(what, value),
             [(key, (OTHER,)) for key in good], good)
    still_good(label, run, good)


def group_dense_fp8():
    """An e4m3 cache at d128 with bf16 queries (on sm_90 the measured renders: swapped dots, [Note] fp8 decode
    swapped dots, and the tiles by shape: 64-key blocks on 2 warps, SHAPE_TILE's 32-key one-warp programs for a long
    cache with few (batch, head) pairs), dense, then paged (pages of 16, paged_fp8_cases): bad seqlens_k of sequence
    1, through the split rule and 3 splits; NaN in every key past each sequence's length."""
    d, sk = (128, 8192) if GPU else (16, 40)
    qdt, name = (torch.bfloat16, "bf16") if GPU else (torch.float16, "fp16")
    lens = [sk, sk // 2 + 37, sk - 5][:NB]
    qd = torch.randn(NB, HQ, 1, d, device=DEV, dtype=qdt)
    kc, vc = (torch.randn(NB, HKV, sk, d, device=DEV).to(torch.float8_e4m3fn) for _ in range(2))
    for c in (kc, vc):
        for b, n in enumerate(lens):
            c.view(torch.uint8)[b, :, n:] = 0x7F  # e4m3 NaN past the length
    dec = fagen.load(fagen.KernelSpec(head_dim=d, gqa=2, kind="decode", mask="padding", dtype=name,
                                      kv_dtype="fp8_e4m3", **DTILES))

    def run(lk):
        kw = dict(seqlens_q=i32(*[1] * NB), seqlens_k=i32(*lk), k_scale=0.8, v_scale=1.1, check=False)
        out, lse = dec.forward(qd, kc, vc, **kw)
        out3, lse3 = dec.forward_split(qd, kc, vc, num_splits=3, **kw)
        return dict(out=out, lse=lse, out3=out3, lse3=lse3)

    good = run(lens)
    report(f"fp8 e4m3 dense decode d{d} {name}: no NaN key past a length reaches a valid output",
           ["NaN in out"] if any(torch.isnan(good[key]).any() for key in ("out", "out3")) else [])
    for value in bad_ints(sk):
        lk = list(lens)
        lk[1] = value
        case(f"fp8 e4m3 dense decode d{d} {name} sk{sk} (rule, 3 splits) seqlens_k[1]={value}", lambda: run(lk),
             [(key, (OTHER,)) for key in good], good)
    still_good(f"fp8 e4m3 dense decode d{d} {name}", lambda: run(lens), good)

    width = -(-sk // 16)
    table = [[b * width + i for i in range(width)] for b in range(NB)]
    paged_fp8_cases(qd, "fp8_e4m3", "causal", (1.2, 0.9), table, lens, pages=NB * width + 4, page=16, bad_lens=5)


def group_mla192():
    """MLA's prefill head dims in a dense decode (d_qk 192, d_v 128, GQA 16 over one KV head): on sm_90 the
    MLA192_DECODE tile (fagen/backends/triton.py; twenty-third session) and its split rule's programs an SM. Bad
    seqlens_k of sequence 1, through the split rule and 3 splits; NaN in every key past each sequence's length."""
    dk, dv, sk = (192, 128, 4096) if GPU else (48, 32, 40)
    qdt, name = (torch.bfloat16, "bf16") if GPU else (torch.float16, "fp16")
    lens = [sk, sk // 2 + 37, sk - 5][:NB]
    qd = torch.randn(NB, 16, 1, dk, device=DEV, dtype=qdt)
    kc, vc = torch.randn(NB, 1, sk, dk, device=DEV, dtype=qdt), torch.randn(NB, 1, sk, dv, device=DEV, dtype=qdt)
    for c in (kc, vc):
        for b, n in enumerate(lens):
            c[b, :, n:] = float("nan")
    dec = fagen.load(fagen.KernelSpec(head_dim=dk, head_dim_v=dv, gqa=16, kind="decode", mask="padding", dtype=name,
                                      **DTILES))

    def run(lk):
        kw = dict(seqlens_q=i32(*[1] * NB), seqlens_k=i32(*lk), check=False)
        out, lse = dec.forward(qd, kc, vc, **kw)
        out3, lse3 = dec.forward_split(qd, kc, vc, num_splits=3, **kw)
        return dict(out=out, lse=lse, out3=out3, lse3=lse3)

    good = run(lens)
    report(f"dense decode d{dk}/v{dv} {name}: no NaN key past a length reaches a valid output",
           ["NaN in out"] if any(torch.isnan(good[key]).any() for key in ("out", "out3")) else [])
    for value in bad_ints(sk):
        lk = list(lens)
        lk[1] = value
        case(f"dense decode d{dk}/v{dv} {name} sk{sk} (rule, 3 splits) seqlens_k[1]={value}", lambda: run(lk),
             [(key, (OTHER,)) for key in good], good)
    still_good(f"dense decode d{dk}/v{dv} {name}", lambda: run(lens), good)


def group_mods():
    """User mods with captured tensors on the layouts that take lengths from the caller: a modded paged decode
    (bad block_table, seqlens_k) and a modded varlen fwd+bwd with a learned bias (bad cu_seqlens). The captured
    tensors' own indices are clamped by the mods' emitter ([Note] Index clamping in fagen/mods/emit.py): here the
    score_mod indexes far outside bias on purpose."""
    mods = dict(score_mod="(score + bias[h, ((q_idx - kv_idx) * 1000003)])", mod_tensors=[["bias", "fp32", 2]])
    bias = torch.randn(HQ, 64, device=DEV, dtype=torch.float32)
    pages, page, width = 16, 4, 5
    kc, vc = randn(pages, page, HKV, D), randn(pages, page, HKV, D)
    table = [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14]][:NB]
    lens = [20, 17, 13][:NB]
    qd = randn(NB, HQ, 2, D)
    dec = fagen.load(spec(mask="causal", kind="decode", layout="paged", **mods))

    def decode(what=None, value=None):
        t, n = paged_inputs(table, lens, what, value)
        out, lse = dec.forward(qd, kc, vc, block_table=t, seqlens_k=n, mods={"bias": bias}, check=False)
        return dict(out=out, lse=lse)

    good = decode()
    variants = [("block_table[1][2]", p) for p in (100000, -1, I32_MIN)] + [("seqlens_k[1]", n) for n in
                                                                             bad_ints(width * page)[:4]]
    for what, value in variants:
        case(f"modded paged decode {what}={value}", lambda: decode(what, value),
             [(key, (OTHER,)) for key in good], good)
    still_good("modded paged decode", decode, good)

    tq, tk = 30, 34
    q, k, v = randn(tq, HQ, D), randn(tk, HKV, D), randn(tk, HKV, D)
    do = randn(tq, HQ, D)
    lb = torch.randn(HQ, 64, device=DEV, dtype=torch.float32)
    m = fagen.load(spec(mask="causal", direction="bwd", layout="varlen",
                        score_mod="(score + bias[h, ((q_idx - kv_idx) + 32)])", mod_tensors=[["bias", "fp32", 2]]))

    def varlen(cq, ck):
        kw = dict(cu_seqlens_q=i32(*cq), cu_seqlens_k=i32(*ck), max_seqlen_q=30, max_seqlen_k=34, check=False)
        qg, kg, vg, bg = (t.clone().requires_grad_() for t in (q, k, v, lb))
        out = m.attention(qg, kg, vg, mods={"bias": bg}, **kw)
        dq, dk_, dv_, db = torch.autograd.grad(out, (qg, kg, vg, bg), do)
        return dict(out=out.detach(), dq=dq, dk=dk_, dv=dv_, dbias=db)

    good_q, good_k = [0, 10, 10, 30], [0, 12, 12, 34]
    goodv = varlen(good_q, good_k)
    for cq, ck in (([0, 10, 10, 40], good_k), ([0, 10, 10, I32_MAX], good_k), (good_q, [0, 12, 12, 100000]),
                   ([0, 10, 25, I32_MIN], [0, 12, 12, -3])):
        case(f"modded varlen fwd+bwd (learned bias) cu_seqlens_q={cq} cu_seqlens_k={ck}", lambda: varlen(cq, ck),
             [("out", (slice(0, 10),)), ("dq", (slice(0, 10),)), ("dk", (slice(0, 12),)), ("dv", (slice(0, 12),))],
             goodv)
    still_good("modded varlen", lambda: varlen(good_q, good_k), goodv)


def group_gluon_padding():
    """The Gluon Hopper forward's padding masks (sm_90 only; [Note] Gluon padding masks in
    fagen/templates/gluon/attention.py.j2; twenty-second session): bad seqlens_k / seqlens_q of sequence 1, bf16 and
    fp8 e4m3 (whose V transpose reads the lengths too), padding and causal+padding, d128, the product's levers."""
    from fagen.runtime import hopper
    if not GPU or torch.cuda.get_device_capability() != (9, 0) or hopper.gluon_missing():
        say("skip gluon_padding: needs an sm_90 GPU and triton's Gluon API")
        return
    sq, sk = 300, 333
    lens_q, lens_k = [sq, 170, sq - 3][:NB], [sk, 201, sk - 1][:NB]
    for dtype in ("bf16", "fp8_e4m3"):
        x = [torch.randn(NB, h, s, 128, device=DEV) for h, s in ((HQ, sq), (HKV, sk), (HKV, sk))]
        q, k, v = (t.to(torch.float8_e4m3fn if dtype == "fp8_e4m3" else torch.bfloat16) for t in x)
        for mask in ("causal+padding", "padding"):
            m = fagen.load(fagen.KernelSpec(head_dim=128, mask=mask, gqa=HQ // HKV, dtype=dtype, backend="gluon"))

            def run(lq, lk, m=m, q=q, k=k, v=v):
                out, lse = m.forward(q, k, v, seqlens_q=i32(*lq), seqlens_k=i32(*lk), check=False)
                return dict(out=out, lse=lse)

            good = run(lens_q, lens_k)
            name = f"gluon {dtype} {mask} d128"
            for which, values in (("k", bad_ints(sk)), ("q", bad_ints(sq)[:5])):
                for value in values:
                    lq, lk = list(lens_q), list(lens_k)
                    (lk if which == "k" else lq)[1] = value
                    case(f"{name} seqlens_{which}[1]={value}", lambda: run(lq, lk),
                         [("out", (OTHER,)), ("lse", (OTHER,))], good)
            still_good(name, lambda: run(lens_q, lens_k), good)


def group_mla_gluon():
    """The Gluon MLA decode (sm_90 only; [Note] Gluon decode memory safety in fagen/templates/gluon/mla_decode.py.j2):
    bad block_table entries and lengths in sequence 1 of a paged 576/512 decode, pages of 64, one split and the
    batch-invariant merge; Hq 16 Sq 1: the swap-AB tile ([Note] Swap-AB tile) and, with SWAP_AB_ROWS 0, one 64-row
    tile padded (the next sequence's rows never stored). $FUZZ_MLA_GLUON_HQ (say 16) keeps those query heads only."""
    from fagen.runtime import hopper
    if not GPU or torch.cuda.get_device_capability() != (9, 0) or hopper.gluon_missing():
        say("skip mla_gluon: needs an sm_90 GPU and triton's Gluon API")
        return
    pages, page, width = 16, 64, 4
    kc = randn(pages, page, 1, 576)
    table = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]][:NB]
    lens = [200, 170, 130][:NB]
    only = os.environ.get("FUZZ_MLA_GLUON_HQ")
    for hq, sq, invariant, sab in ((64, 2, False, 16), (64, 2, True, 16), (16, 1, False, 0), (16, 1, False, 16),
                                   (16, 1, True, 16)):  # Hq 16: [Note] Padded row tiles, [Note] Swap-AB tile
        if only and str(hq) != only:
            continue
        qd = randn(NB, hq, sq, 576)
        mla = fagen.load(fagen.KernelSpec(head_dim=576, head_dim_v=512, shared_kv=True, gqa=hq, kind="decode",
                                          layout="paged", mask="causal", dtype="fp16", backend="gluon"))

        def run(what=None, value=None, mla=mla, qd=qd, invariant=invariant, sab=sab):
            t, n = paged_inputs(table, lens, what, value)
            old, mla.SWAP_AB_ROWS = mla.SWAP_AB_ROWS, sab
            try:
                out, lse = mla.forward(qd, kc, None, block_table=t, seqlens_k=n, check=False,
                                       batch_invariant=invariant)
            finally:
                mla.SWAP_AB_ROWS = old
            return dict(out=out, lse=lse)

        good = run()
        variants = [("block_table[1][2]", p) for p in (100000, -1, pages, I32_MIN, I32_MAX)]
        variants += [("seqlens_k[1]", n) for n in bad_ints(width * page)]
        for what, value in variants:
            case(f"mla gluon paged decode h{hq} sq{sq} invariant={invariant} swap_ab={sab} {what}={value}",
                 lambda: run(what, value), [(key, (OTHER,)) for key in good], good)
        still_good(f"mla gluon paged decode h{hq} sq{sq} invariant={invariant} swap_ab={sab}", run, good)


def group_mla_fp8_seesaw():
    """The Gluon fp8 latent decode's seesaw (sm_90 only; [Note] Seesaw fp8 conversion, variant fp8lat_seesaw: Hq x Sq
    a multiple of 64 over an e4m3 cache, a converter warpgroup): bad block_table entries and lengths in sequence 1 of
    a paged 576/512 decode, pages of 64, the scale a float, per KV head and per token, the split rule and the
    batch-invariant splits; a hang (the converter's barriers) is the call's timeout."""
    from fagen.runtime import hopper
    if not GPU or torch.cuda.get_device_capability() != (9, 0) or hopper.gluon_missing():
        say("skip mla_fp8_seesaw: needs an sm_90 GPU and triton's Gluon API")
        return
    pages, page, width = 16, 64, 4
    kc = torch.randn(pages, page, 1, 576, device=DEV).to(torch.float8_e4m3fn)
    table = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]][:NB]
    lens = [200, 170, 130][:NB]
    forms = (("float", 0.7), ("per head", torch.tensor([1.3], device=DEV)),
             ("per token", token_scales(pages, page, table, lens)))
    for hq, sq, invariant in ((64, 1, False), (32, 2, False), (32, 2, True)):
        qd = torch.randn(NB, hq, sq, 576, device=DEV, dtype=torch.bfloat16)
        mla = fagen.load(fagen.KernelSpec(head_dim=576, head_dim_v=512, shared_kv=True, gqa=hq, kind="decode",
                                          layout="paged", mask="causal", dtype="bf16", kv_dtype="fp8_e4m3",
                                          backend="gluon"))
        for form, scale in forms:
            def run(what=None, value=None, mla=mla, qd=qd, invariant=invariant, scale=scale):
                t, n = paged_inputs(table, lens, what, value)
                out, lse = mla.forward(qd, kc, None, block_table=t, seqlens_k=n, k_scale=scale, check=False,
                                       batch_invariant=invariant)
                return dict(out=out, lse=lse)

            good = run()
            variants = [("block_table[1][2]", p) for p in (100000, -1, pages, I32_MIN, I32_MAX)]
            variants += [("seqlens_k[1]", n) for n in bad_ints(width * page)]
            name = f"mla fp8 seesaw paged decode h{hq} sq{sq} {form} invariant={invariant}"
            for what, value in variants:
                case(f"{name} {what}={value}", lambda: run(what, value), [(key, (OTHER,)) for key in good], good)
            still_good(name, run, good)


GROUPS = {"padding": group_padding, "varlen": group_varlen, "paged": group_paged, "tree": group_tree,
          "window": group_window, "mla": group_mla, "mla_fp8": group_mla_fp8, "fp8_token": group_fp8_token,
          "paged_fp8": group_paged_fp8, "dense_fp8": group_dense_fp8, "mods": group_mods, "mla_gluon": group_mla_gluon,
          "gluon_padding": group_gluon_padding, "mla192": group_mla192,
          "mla_fp8_seesaw": group_mla_fp8_seesaw}

torch.manual_seed(args.seed)
for name in args.group or GROUPS:
    GROUPS[name]()
say(f"summary: {len(RAN)} cases, {len(FAILED)} failed on {DEV}" + (f": {FAILED}" if FAILED else ""))
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "gpu_memcheck_fuzz.log"), "w") as f:
        f.write("\n".join(LOG) + "\n")
sys.exit(1 if FAILED else 0)
