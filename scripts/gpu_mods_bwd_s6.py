"""The mods backward against FlexAttention's, per attention-gym row of `fagen bench --suite mods` (bf16, d128, B1
H16 S8192): issue 26's backward target (>= 1.2x Flex on every row), with variants side by side in one process.

    PYTHONPATH=$PWD python3 scripts/gpu_mods_bwd_s6.py [--rows a,b] [--rep-ms 30] [--time-limit 45]
    GPU_MODS_BWD_S6_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_mods_bwd_s6.py   # CPU: interpreter, tiny shape
    PYTHONPATH=$PWD python3 scripts/gpu_mods_bwd_s6.py --gluon     # the Gluon backward's mods (eighth session)

--gluon (docs/mods.md, "The Gluon backward"): phase 0, in a child process with a timeout, checks the Gluon
backward (fagen/templates/gluon/backward.py.j2) with each mod feature against the float64 reference of the user's
own functions at small odd shapes (d128 bf16, B1 H2, S 333 / Sq 200 Sk 333; one
relative bias at gqa 2): the causal window and a two-sided window
on mask none (both dQ modes), the softcap switch, ALiBi, a relative bias (a captured tensor) and a softcap score_mod
(its derivative in dS); then two mutants (the softcap's tanh chain dropped from dS; the window's left edge dropped from the per-element
mask), which must fail. Rows and variants
become the four rows below the target with "api" and "gluon" (the row's Gluon bwd module: the window switch, the
score_mod as the API lowers it; "gluon-nondet" with deterministic=False, "gluon-desc"
the window's steps in descending query blocks (variant bwd_window_desc), "gluon-clamped" without the clamp-free tiles, "gluon-noclamp" its index never clamped; prefix-LM's two split calls each on the Gluon backward; "gluon-low" prefix-LM's
causal call alone on it, the "none" call over [0, P) on the Triton one, as a per-call BWD_MIN_WORK would choose).

Variants:
  api           fagen.attention(q, k, v, score_mod=, mask_mod=, block_mask=) as a user calls it, with gradients:
                whatever it lowers to (the document and prefix-LM splits with their backward, the window switch)
  split         the split lowering's calls written out here as fagen.attention calls on slices, autograd through
                them (document: one varlen causal call over the runs of q[0]; prefix-LM: "none" over [0, P) and
                causal rows [P, S) over all keys, concatenated): against api, the cost of the slices' backward
                ([Note] Split gradients in fagen/mods/split.py)
  default       the row's rendered bwd module (the modded spec; the plain causal+window module for the sliding-window
                row), unedited; the others are text edits of it:
  dkdv=NxMwWsS  the dK/dV kernel's tiles: N keys per program, M queries per step, warps, stages
  dq=MxNwWsS    the dQ kernel's tiles: M queries per program, N keys per step, warps, stages
  noclamp       _mod_index returns its index unclamped, in int32 (valid where every index is in range, as the
                relative bias's is)
  i32           _mod_index clamps as it does but returns int32 (valid where the tensor has < 2**31 elements)
  nowrap        _mod_index without the negative wrap (i + size for i < 0), the clamp kept
  umin          _mod_index's wrap, then one unsigned min for the clamp (i < -size reads the last element)
Phases: 1. worker processes (spawned, one per slice of the (row, variant) list) run every variant and Flex once at
the bench shape, filling the Triton and Inductor caches (a variant that faults there is an error row, not a lost
table); 2. this process, per row: Flex's gradients and backward time (create_block_mask, torch.compile'd
flex_attention, as fagen/bench/mods.py runs it), then each variant's gradients checked against Flex's (max |diff| /
max |Flex|, ok under 3e-2; float64 in the dry run) and its backward timed (autograd.grad of a kept output for q, k,
v; fagen.bench.timing.measure). TF/s as `fagen bench` counts them: 2.5 * 4 * D per visible pair. One table at the
end; $OUT/mods_bwd_s6.json (if $OUT is set) holds every record.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DRY = bool(os.environ.get("GPU_MODS_BWD_S6_DRY"))
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"
else:  # phase 1 runs up to 16 workers: one Inductor compile thread each
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# Per row: variants in priority order (the first is the module fagen.attention runs, unedited).
VARIANTS = {
    "document+causal": ["api", "split", "default", "dkdv=128x64w8s3 dq=128x64w8s3"],
    "prefix-lm": ["api", "split", "default", "dkdv=128x64w8s3 dq=128x64w8s3"],
    "sliding-window+causal": ["api", "default"],
    "relative-bias": ["api", "default", "noclamp", "nowrap", "umin"],
    "alibi": ["api", "default", "dkdv=128x64w8s3 dq=128x64w8s3"],
}
ROWS = list(VARIANTS)
GLUON = "--gluon" in sys.argv
if GLUON:
    VARIANTS = {"sliding-window+causal": ["api", "gluon", "gluon-desc", "gluon-nondet"], "alibi": ["api", "gluon", "gluon-nondet"],
                "prefix-lm": ["api", "gluon", "gluon-low"],
                "relative-bias": ["api", "gluon", "gluon-clamped", "gluon-noclamp"]}
    ROWS = list(VARIANTS)
# Rows fagen.attention lowers to a built-in switch: (mask, switches, window)
LOWERED = {"sliding-window+causal": ("causal", ("window",), (1024, 0))}


def shape_of():
    import torch

    from fagen.bench.mods import ModsShape

    if DRY:
        return ModsShape(batch=1, heads=2, seq=200, head_dim=32, dtype=torch.float32)  # 200: no whole blocks
    return ModsShape()


def device():
    return "cpu" if DRY or os.environ.get("GPU_MODS_BWD_S6_SM90") else "cuda"  # SM90: scripts/sm90_mods_bwd_s5.py


def edit(src: str, variant: str) -> str:
    """The module source with a variant's edits (module docstring); raises if an edit finds nothing to change."""
    for part in variant.split():
        if part in ("default", "api", "split"):
            continue
        m = re.fullmatch(r"(dkdv|dq)=(\d+)x(\d+)w(\d+)s(\d+)", part)
        if m:
            kern, a, b, w, s = m.group(1), *map(int, m.groups()[1:])
            names = (("DKDV_BLOCK_N", a), ("DKDV_BLOCK_M", b), ("DKDV_NUM_WARPS", w), ("DKDV_NUM_STAGES", s)) \
                if kern == "dkdv" else (("DQ_BLOCK_M", a), ("DQ_BLOCK_N", b), ("DQ_NUM_WARPS", w),
                                        ("DQ_NUM_STAGES", s))
            for name, value in names:
                src, n = re.subn(rf"^{name} = .*$", f"{name} = {value}", src, flags=re.M)
                assert n == 1, name
            continue
        old = "    return tl.minimum(tl.maximum(i, 0), size - 1).to(tl.int64)\n"
        if part == "i32":
            assert old in src, part
            src = src.replace(old, "    return tl.minimum(tl.maximum(i, 0), size - 1)\n")
        elif part == "nowrap":  # the clamp without torch's negative wrap
            full = "    i = tl.where(i < 0, i + size, i)\n"
            assert full in src, part
            src = src.replace(full, "")
        elif part == "umin":  # the wrap, then one unsigned min (i < -size reads the last element, not the first)
            assert old in src, part
            src = src.replace(old, "    return tl.minimum(i.to(tl.uint32), size - 1).to(tl.int64)\n")
        elif part == "noclamp":
            full = "    i = tl.where(i < 0, i + size, i)\n" + old
            assert full in src, part
            src = src.replace(full, "    return i\n")
        else:
            raise SystemExit(f"unknown variant part {part!r}")
    return src


def row_setup(row, shape):
    """(score_mod, mask_mod, mods or None, base spec, lowered (mask, switches, window) or None)."""
    import torch

    from fagen.bench.mods import cases
    from fagen.runtime.mods import prepare
    from fagen.runtime.resolve import spec_for

    sm, mm = next((c[1], c[2]) for c in cases(shape, device()) if c[0] == row)
    q = torch.empty(1, shape.heads, 16, shape.head_dim, dtype=shape.dtype, device=device())
    low = LOWERED.get(row)
    if low is not None:
        return sm, mm, None, spec_for(q, q, q, mask=low[0], switches=low[1]), low
    return sm, mm, prepare(score_mod=sm, mask_mod=mm), spec_for(q, q, q), None


def module_of(row, variant, shape):
    from fagen.codegen.render import render
    from fagen.runtime.device import gpu_arch
    from fagen.runtime.loader import load_source
    from fagen.runtime.modded import modded_spec

    sm, mm, mods, base, low = row_setup(row, shape)
    spec = base if mods is None else modded_spec(base, mods.fields)
    spec = spec.for_arch(gpu_arch())
    src = edit(render(spec).files[".py"], variant)
    return load_source(src, spec.name + "_v" + re.sub(r"[^a-z0-9]+", "_", variant)), spec


def _clamped(src: str) -> str:
    """The clamped read on every tile (variant gluon-clamped: [Note] Clamp-free tiles in fagen/mods/emit.py off)."""
    src, n = re.subn(r"^( +)if .*# \[Note\] Clamp-free tiles.*\n +xadd = .*\n +else:\n +(xadd = .*)\n",
                     lambda m: m.group(1) + m.group(2) + "\n", src, flags=re.M)
    assert n >= 1, "no clamp-free branch"
    return src


def _noclamp(src: str) -> str:
    """_mod_index without its wrap and clamp (variant gluon-noclamp: valid where every index is in range, as the
    relative bias's is; the upper bound of a clamp-free fast path)."""
    old = ("    i = gl.where(i < 0, i + size, i)\n"
           "    return gl.minimum(gl.maximum(i, 0), size - 1).to(gl.int64)\n")
    assert old in src, "no _mod_index"
    return src.replace(old, "    return i\n")


def gluon_module(row, shape, mask=None, edit=""):
    """(module, its attention keywords) of the row's Gluon backward: the lowered window switch, or the score_mod as
    fagen.attention leaves it after lowering (ALiBi: `alibi-rowfree`); `mask`: a plain Gluon bwd module; edit:
    "clamped" or "noclamp", the variants' edits."""
    import torch

    import fagen
    from fagen.runtime import modded
    from fagen.spec.kernel import KernelSpec

    dt = "bf16" if shape.dtype == torch.bfloat16 else "fp16"
    plain = dict(backend="gluon", direction="bwd", head_dim=shape.head_dim, dtype=dt)
    if mask is not None:
        return fagen.load(KernelSpec(mask=mask, **plain)), {}
    sm, mm, mods, base, low = row_setup(row, shape)
    if low is not None and edit == "desc":  # variant bwd_window_desc ([Note] Window in the backward)
        from fagen import backends
        from fagen.codegen.render import render
        from fagen.runtime.loader import load_source

        spec = KernelSpec(mask=low[0], window=True, **plain)
        backends.GLUON.variant["bwd_window_desc"] = 1
        render.cache_clear()
        try:
            src = render(spec).files[".py"]
        finally:
            backends.GLUON.variant["bwd_window_desc"] = 0
            render.cache_clear()
        assert "GQA * steps - 1 - i" in src
        return load_source(src, spec.name + "_desc"), {"window": low[2]}
    if low is not None:
        return fagen.load(KernelSpec(mask=low[0], window=True, **plain)), {"window": low[2]}
    q = torch.empty(1, shape.heads, shape.seq, shape.head_dim, dtype=shape.dtype, device=device(),
                    requires_grad=True)
    got = modded._lower(mods, q, q, q, "none", {}, None, None, None, None)
    fields, values = mods.fields, mods.values
    if got is not None and got.fields is not None:
        fields, values = got.fields, {n: mods.values[n] for n in got.names}
    spec = KernelSpec(mask="none", score_mod=fields[0], mod_tensors=[list(t) for t in fields[2]],
                      mod_scalars=[list(x) for x in fields[3]], **plain)
    if edit:  # a text edit of the module
        from fagen.codegen.render import render
        from fagen.runtime.loader import load_source

        src = render(spec).files[".py"]
        src = {"clamped": _clamped, "noclamp": _noclamp}[edit](src)
        return load_source(src, spec.name + "_" + edit), {"mods": values}
    return fagen.load(spec), {"mods": values}


def attend(row, variant, shape, bm):
    """The (q, k, v) -> out callable of a fagen variant."""
    import fagen

    sm, mm = row_setup(row, shape)[:2]
    if variant == "api":
        return lambda q, k, v: fagen.attention(q, k, v, score_mod=sm, mask_mod=mm, block_mask=bm)
    if variant == "split":
        return split_call(row, shape, mm)
    if variant in ("gluon", "gluon-low") and row == "prefix-lm":
        return split_call(row, shape, mm, gluon=variant)
    if variant == "gluon-nondet":  # deterministic=False: the unordered dQ adds
        module, kw = gluon_module(row, shape)
        return lambda q, k, v: module.attention(q, k, v, deterministic=False, **kw)
    if variant in ("gluon", "gluon-clamped", "gluon-noclamp", "gluon-desc"):
        module, kw = gluon_module(row, shape, edit=variant[6:])
        return lambda q, k, v: module.attention(q, k, v, **kw)
    return fagen_call(row, module_of(row, variant, shape)[0], shape, bm)


def split_call(row, shape, mm, gluon=False):
    """The split lowering's switch calls, written out (fagen/mods/split.py's run_split, with gradients); gluon: each
    call on the Gluon backward's module (prefix-LM)."""
    import torch

    import fagen
    from fagen.runtime.mods import prepare

    s = shape.seq
    if row == "prefix-lm":
        p = s // 4  # fagen/bench/mods.py's prefix length
        if gluon:  # the API's one autograd node over the two calls (_Prefix), their modules chosen here
            from fagen.mods.split import _Prefix
            from fagen.runtime.resolve import resolve

            low = gluon_module(row, shape, "causal")[0]

            def run(q, k, v):
                top = gluon_module(row, shape, "none")[0] if gluon == "gluon" else \
                    resolve(q[:, :, :p], k[:, :, :p], v[:, :, :p], "none", False, ())
                return _Prefix.apply(q, k, v, p, (top, low), {})
            return run

        def run(q, k, v):
            top = fagen.attention(q[:, :, :p], k[:, :, :p], v[:, :, :p], mask="none")
            return torch.cat([top, fagen.attention(q[:, :, p:], k, v, mask="causal")], dim=2)
        return run
    ids = next(x for x in prepare(mask_mod=mm).values.values() if isinstance(x, torch.Tensor))[:s]
    starts = torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1
    cu = torch.cat([starts.new_zeros(1), starts, starts.new_full((1,), s)]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())

    def run(q, k, v):
        out = fagen.attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), mask="causal",
                              cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
        return out.transpose(0, 1)[None]
    return run


def fagen_call(row, module, shape, bm):
    sm, mm, mods, base, low = row_setup(row, shape)
    if low is not None:
        kw = {} if low[2] is None else {"window": low[2]}
        return lambda q, k, v: module.attention(q, k, v, **kw)
    kw = dict(mods=mods.values, **({"block_mask": bm} if mm is not None else {}))
    return lambda q, k, v: module.attention(q, k, v, **kw)


def fagen_mask(mm, shape):
    import fagen

    return None if mm is None else fagen.create_block_mask(mm, None, None, shape.seq, shape.seq, device=device())


def flex_call(sm, mm, shape):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from fagen.bench.peers import configure_dynamo

    configure_dynamo()
    compiled = torch.compile(flex_attention, dynamic=False)
    bm = None if mm is None else create_block_mask(mm, None, None, shape.seq, shape.seq, device=device())
    return lambda q, k, v: compiled(q, k, v, score_mod=sm, block_mask=bm)


def warm(items):
    """Phase 1 (a worker): run each (row, variant) once at the bench shape, forward and backward ("flex": Flex)."""
    import torch

    from fagen.bench.mods import _inputs

    shape = shape_of()
    q, k, v, do = _inputs(shape, device(), True)
    done = []
    for row, variant in items:
        t0 = time.perf_counter()
        try:
            sm, mm = row_setup(row, shape)[:2]
            if variant == "flex":
                att = flex_call(sm, mm, shape)
            else:
                att = attend(row, variant, shape, fagen_mask(mm, shape))
            torch.autograd.grad(att(q, k, v), (q, k, v), do)
            if device() == "cuda":
                torch.cuda.synchronize()
            done.append((row, variant, None, time.perf_counter() - t0))
        except Exception as e:  # noqa: BLE001 - recorded in the table
            done.append((row, variant, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                         time.perf_counter() - t0))
    return done


def reference64(sm, mm, q, k, v, do):
    """float64 dq, dk, dv from the user's functions over broadcast index tensors (the dry run's reference)."""
    import math

    import torch

    B, H, S, D = q.shape
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    b = torch.arange(B)[:, None, None, None]
    h = torch.arange(H)[None, :, None, None]
    qi = torch.arange(S)[None, None, :, None]
    ki = torch.arange(S)[None, None, None, :]
    s = (q64 @ k64.transpose(-1, -2)) / math.sqrt(D)
    if sm is not None:
        s = sm(s, b, h, qi, ki)
    if mm is not None:
        s = torch.where(mm(b, h, qi, ki).expand_as(s), s, float("-inf"))
    out = torch.softmax(s, -1).nan_to_num(0.0) @ v64
    return torch.autograd.grad(out, (q64, k64, v64), do.double())


def resources(module) -> dict:
    """{kernel: (registers, spilled words)} of the module's compiled dK/dV and dQ kernels."""
    import triton

    res = {}
    for name in ("_attn_bwd_dkdv", "_attn_bwd_dq"):
        fn = getattr(module, name, None)
        if not isinstance(fn, triton.runtime.jit.JITFunction):
            continue
        for cache in (getattr(fn, "device_caches", None) or {}).values():
            kernels = cache[0] if isinstance(cache, tuple) else cache
            for kern in kernels.values():
                try:
                    kern._init_handles()
                    res[name] = (kern.n_regs, kern.n_spills // 4)
                except Exception:  # noqa: BLE001
                    pass
    return res


# Phase 0 of --gluon: (name, mask, spec fields, call keywords, score_mod, mask_mod, Sq, Sk, deterministic, mutant)
def _gluon_cases():
    import torch

    H, S = 2, 333
    g = torch.Generator(device="cpu").manual_seed(5)
    bias = (torch.randn(H, 2 * S - 1, generator=g) * 0.5).to(device())
    cap = 20.0

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    def alibi(score, b, h, q_idx, kv_idx):  # attention-gym's, slopes from h
        return score + (kv_idx - q_idx) * torch.exp2(-((h + 1) * 8.0 / H))

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + S - 1]

    def causal_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= 37)

    def two_sided(b, h, q_idx, kv_idx):  # Sq 200, Sk 333: i_aligned = q_idx + 133, window (50, 20)
        return (kv_idx >= q_idx + 133 - 50) & (kv_idx <= q_idx + 133 + 20)

    win = dict(window=True)
    desc = dict(window=True, variant={"bwd_window_desc": 1})
    return [("window causal", "causal", win, {"window": (37, 0)}, None, causal_window, S, S, True, None),
            ("window causal desc", "causal", desc, {"window": (37, 0)}, None, causal_window, S, S, True, None),
            ("window causal unordered", "causal", win, {"window": (37, 0)}, None, causal_window, S, S, False, None),
            ("window none (50,20) Sq<Sk", "none", win, {"window": (50, 20)}, None, two_sided, 200, S, True, None),
            ("window none unordered", "none", win, {"window": (50, 20)}, None, two_sided, 200, S, False, None),
            ("softcap switch", "none", dict(softcap=True), {"softcap": cap}, softcap, None, S, S, True, None),
            ("alibi (h slopes)", "none", {}, None, alibi, None, S, S, True, None),
            ("relative bias", "causal", {}, None, rel_bias, None, S, S, True, None),
            ("relative bias, gqa 2 (KV heads 1)", "causal", {"gqa": 2}, None, rel_bias, None, S, S, True, None),
            ("softcap score_mod", "causal", {}, None, softcap, None, S, S, True, None),
            ("MUTANT softcap chain dropped", "none", dict(softcap=True), {"softcap": cap}, softcap, None, S, S, True,
             ("            dst = dst * (1.0 - tcap * tcap)", "            dst = dst")),
            ("MUTANT window left edge dropped", "causal", win, {"window": (37, 0)}, None, causal_window, S, S, True,
             ("(keys[:, None] >= i_al - win_left) & ", ""))]


QUICK_CHECKS = ("window causal", "window causal desc", "relative bias")  # --quick-checks: one window, the clamp-free tiles' both paths


def _gluon_check_all(part=(0, 1), quick=False) -> list[str]:
    """Phase 0 (a child process): the dq, dk, dv of cases part[0]::part[1] against float64; one line each."""
    import math

    import torch

    from fagen.codegen.render import render
    from fagen.runtime.loader import load_source
    from fagen.runtime.mods import prepare
    from fagen.spec.axes import DType
    from fagen.spec.kernel import KernelSpec
    from fagen.verify.tolerances import compare_grad

    dev, lines, D = device(), [], 128
    if DRY:
        os.environ.pop("TRITON_INTERPRET", None)  # sm_90 builds, not the interpreter
    cases = [c for c in _gluon_cases() if not quick or c[0] in QUICK_CHECKS]
    for name, mask, fields, kw, sm, mm, sq, sk, det, mutant in cases[part[0]::part[1]]:
        t0 = time.perf_counter()
        try:
            fields = dict(fields)
            lever = fields.pop("variant", {})  # GluonBackend.variant keys rendered for this case only
            spec_fields = dict(backend="gluon", direction="bwd", head_dim=D, dtype="bf16", mask=mask, **fields)
            if kw is None:  # a score_mod: the spec carries it, the call its captured values
                m = prepare(score_mod=sm)
                spec_fields.update(score_mod=m.fields[0], mod_tensors=[list(t) for t in m.fields[2]],
                                   mod_scalars=[list(x) for x in m.fields[3]])
                kw = {"mods": m.values}
            spec = KernelSpec(**spec_fields)
            from fagen import backends

            saved = dict(backends.GLUON.variant)
            backends.GLUON.variant.update(lever)
            render.cache_clear()
            try:
                src = render(spec).files[".py"]
            finally:
                backends.GLUON.variant.clear()
                backends.GLUON.variant.update(saved)
                render.cache_clear()
            if lever.get("bwd_window_desc") and "f = GQA * steps - 1 - i" not in src:
                raise RuntimeError("bwd_window_desc did not render")
            if mutant:  # (text, replacement) in every kernel that has it
                if mutant[0] not in src:
                    raise RuntimeError("the mutant's text is not in the source")
                src = src.replace(*mutant)
            module = load_source(src, spec.name + ("_mutant" if mutant else "_desc" if lever else "_check"))
            if DRY:  # no Gluon on the interpreter: the sm_90 build of its backward only
                ck = module.compile_backward_for(deterministic=det)
                lines.append(f"BUILT gluon bwd {name}: sm_90, {ck.metadata.shared} B shared ({spec.name}, "
                             f"{time.perf_counter() - t0:.1f} s)")
                print("  phase 0: " + lines[-1], flush=True)
                continue
            g = torch.Generator(device="cpu").manual_seed(7)
            hkv = 2 // fields.get("gqa", 1)
            q, k, v = (torch.randn(1, hh, n, D, generator=g).to(dev, torch.bfloat16)
                       for hh, n in ((2, sq), (hkv, sk), (hkv, sk)))
            do = torch.randn(1, 2, sq, D, generator=g).to(dev, torch.bfloat16)
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            got = torch.autograd.grad(module.attention(qg, kg, vg, deterministic=det, **kw), (qg, kg, vg), do)
            q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
            k64r, v64r = (t.repeat_interleave(2 // hkv, dim=1) for t in (k64, v64))  # query head h reads h // gqa
            qi = torch.arange(sq, device=dev)[None, None, :, None]
            ki = torch.arange(sk, device=dev)[None, None, None, :]
            h = torch.arange(2, device=dev)[None, :, None, None]
            b = torch.zeros(1, device=dev, dtype=torch.long)[:, None, None, None]
            s = (q64 @ k64r.transpose(-1, -2)) / math.sqrt(D)
            if sm is not None:
                s = sm(s, b, h, qi, ki)
            vis = ki <= qi + (sk - sq) if mask == "causal" else torch.ones_like(ki, dtype=torch.bool)
            if mm is not None:
                vis = vis & mm(b, h, qi, ki)
            s = torch.where(vis.expand_as(s), s, float("-inf"))
            out = torch.softmax(s, -1).nan_to_num(0.0) @ v64r
            ref = torch.autograd.grad(out, (q64, k64, v64), do.double())
            errs = []
            for gname, a, r in zip(("dq", "dk", "dv"), got, ref):
                compare_grad(gname, a, r, DType.BF16)
                errs.append(float((a.double() - r).abs().max()))
            ok = not mutant
            lines.append(f"{'PASS' if ok else 'FAIL'} gluon bwd {name}: max |err| dq {errs[0]:.1e} dk {errs[1]:.1e} "
                         f"dv {errs[2]:.1e} ({spec.name}, {time.perf_counter() - t0:.1f} s)"
                         + ("  <- the mutant passed: the check cannot see it" if mutant else ""))
        except Exception as e:  # noqa: BLE001 - a line, never the end of the run
            ok = bool(mutant) and isinstance(e, AssertionError)
            lines.append(f"{'PASS' if ok else 'FAIL'} gluon bwd {name}: "
                         f"{'caught: ' if ok else ''}{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                         f" ({time.perf_counter() - t0:.1f} s)")
        print("  phase 0: " + lines[-1], flush=True)
    return lines


def gluon_checks(n=4, quick=False):
    """Start phase 0 in n child processes; returns a callable that collects their lines (a timeout or a fault is a
    FAIL line: that child's cases are lost, not the run)."""
    pool = mp.get_context("spawn").Pool(n)
    jobs = [pool.apply_async(_gluon_check_all, ((i, n), quick)) for i in range(n)]

    def collect(timeout=60.0):
        deadline, lines = time.perf_counter() + timeout, []
        for i, job in enumerate(jobs):
            try:
                lines += job.get(max(1.0, deadline - time.perf_counter()))
            except Exception as e:  # noqa: BLE001 - a hang or a fault in the child
                lines.append(f"FAIL gluon bwd checks {i}::{n}: {type(e).__name__}: {str(e)[:160]} (stopped)")
        pool.terminate()
        return lines
    return collect


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", help="comma-separated rows (default: " + ",".join(ROWS) + ")")
    ap.add_argument("--rep-ms", type=float, default=30.0)
    ap.add_argument("--time-limit", type=float, default=45.0,
                    help="seconds of phase 2 after which no more variant is timed")
    ap.add_argument("--workers", type=int, default=0 if DRY else min(16, os.cpu_count() or 4))
    ap.add_argument("--phase1-limit", type=float, default=50.0, help="seconds phase 1 may take")
    ap.add_argument("--flex-rows", help="comma-separated rows that time Flex too (default: every row)")
    ap.add_argument("--quick-checks", action="store_true", help="phase 0: " + ", ".join(QUICK_CHECKS) + " only")
    ap.add_argument("--gluon", action="store_true", help="the Gluon backward's mods (module docstring)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    collect = (gluon_checks(2, True) if args.quick_checks else gluon_checks()) if GLUON else None  # phase 0
    rows = args.rows.split(",") if args.rows else ROWS
    flex_rows = args.flex_rows.split(",") if args.flex_rows else rows
    items = [(r, v) for r in rows for v in (([] if DRY or r not in flex_rows else ["flex"]) + VARIANTS[r])]

    import torch

    errors = {}
    if args.workers:
        n = max(1, min(args.workers, len(items)))
        results, deadline = [], time.perf_counter() + args.phase1_limit
        with mp.get_context("spawn").Pool(n) as pool:  # a worker that hangs (a kernel's deadlock) is cut off
            it = pool.imap_unordered(warm, [items[i::n] for i in range(n)])
            for _ in range(n):
                try:
                    results.append(it.next(timeout=max(1.0, deadline - time.perf_counter())))
                except mp.TimeoutError:
                    break
        seen = {(row, variant) for done in results for row, variant, _, _ in done}
        late = [item for item in items if item not in seen]
        if late:  # phase 2 runs them itself (a hang there is past the runner's patience, but the table is printed)
            print(f"phase 1: past {args.phase1_limit:.0f} s without {late}", flush=True)
        for done in results:
            for row, variant, err, _ in done:
                if err:
                    errors[(row, variant)] = err
    checks = collect() if collect else []
    t_compiled = time.perf_counter()
    print(f"phase 1: {len(items)} (row, variant) runs in {t_compiled - t_start:.0f} s ({len(errors)} failed)",
          flush=True)

    from fagen.bench.mods import _inputs, _visible_pairs
    from fagen.bench.timing import measure

    shape = shape_of()
    dev = torch.device(device())
    q, k, v, do = _inputs(shape, device(), True)
    records = []

    def timed(fn):
        return measure(lambda i: fn(), 1, dev, 10.0, args.rep_ms)

    try:  # the runner's SIGINT (its wall limit) still prints the table of what was timed
        for row in rows:
            sm, mm = row_setup(row, shape)[:2]
            bm = fagen_mask(mm, shape)
            fl = 4.0 * shape.head_dim * _visible_pairs(bm, mm, shape)
            ref, flex_ms = None, None
            try:
                if DRY:
                    ref = reference64(sm, mm, q, k, v, do)
                elif row not in flex_rows:
                    errors[(row, "flex")] = "not timed (--flex-rows)"
                elif (row, "flex") not in errors:
                    att = flex_call(sm, mm, shape)
                    out = att(q, k, v)
                    ref = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
                    flex_ms = timed(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
                    del out
            except Exception as e:  # noqa: BLE001
                errors[(row, "flex")] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            rec = {"row": row, "variant": "flex", "bwd_ms": flex_ms,
                   "bwd_TF/s": 2.5 * fl / flex_ms / 1e9 if flex_ms else None, "error": errors.get((row, "flex"))}
            records.append(rec)
            print("  " + json.dumps(rec), flush=True)
            for variant in VARIANTS[row]:
                rec = {"row": row, "variant": variant}
                records.append(rec)
                if time.perf_counter() - t_compiled > args.time_limit:
                    rec["error"] = f"skipped: past --time-limit {args.time_limit:.0f} s"
                    continue
                if (row, variant) in errors:
                    rec["error"] = errors[(row, variant)]
                    continue
                try:
                    module = None
                    if not variant.startswith(("api", "split", "gluon")):
                        module, spec = module_of(row, variant, shape)
                        rec["spec"] = spec.name
                    att = attend(row, variant, shape, bm)
                    out = att(q, k, v)
                    got = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
                    if ref is not None:
                        rec["err"] = [float((a.double() - b.double()).abs().max() / b.double().abs().max())
                                      for a, b in zip(got, ref)]
                        rec["ok"] = all(e < 3e-2 for e in rec["err"])  # NaN fails
                    rec["bwd_ms"] = timed(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
                    rec["bwd_TF/s"] = 2.5 * fl / rec["bwd_ms"] / 1e9
                    if flex_ms:
                        rec["x_flex"] = flex_ms / rec["bwd_ms"]
                    rec["res"] = resources(module) if module is not None else {}
                    if variant == "api":
                        from fagen.runtime import modded

                        rec["lowered_to"] = modded.LOWERED[0]
                    del out, got
                except Exception as e:  # noqa: BLE001 - recorded in the table
                    rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                print("  " + json.dumps(rec, default=str), flush=True)
    except KeyboardInterrupt:
        print("interrupted: the table holds the rows timed so far", flush=True)

    gpu = torch.cuda.get_device_name() if device() == "cuda" else "cpu (dry run)"
    print(f"\n{gpu}, torch {torch.__version__}, triton {__import__('triton').__version__}; "
          f"{str(shape.dtype).split('.')[-1]} d{shape.head_dim} B{shape.batch} H{shape.heads} S{shape.seq}")
    print("| row | variant | bwd ms | bwd TF/s | x Flex | dK/dV regs/spill | dQ regs/spill | check dq dk dv vs "
          + ("float64" if DRY else "Flex") + " |")
    print("|---|---|---:|---:|---:|---|---|---|")
    for r in records:
        if r.get("error"):
            print(f"| {r['row']} | {r['variant']} | - | - | - | - | - | error: {r['error'][:100]} |")
            continue
        ms = f"{r['bwd_ms']:.3f}" if r.get("bwd_ms") else "-"
        tf = f"{r['bwd_TF/s']:.0f}" if r.get("bwd_TF/s") else "-"
        x = f"{r['x_flex']:.2f}x" if r.get("x_flex") else "-"
        res = r.get("res", {})
        rs = [("%d/%d" % res[n]) if n in res else "-" for n in ("_attn_bwd_dkdv", "_attn_bwd_dq")]
        chk = (("ok " if r["ok"] else "FAIL ") + " ".join(f"{e:.1e}" for e in r["err"])) if "err" in r else "-"
        name = r["variant"] + (f" -> {r['lowered_to']}" if r.get("lowered_to") else "")
        print(f"| {r['row']} | {name} | {ms} | {tf} | {x} | {rs[0]} | {rs[1]} | {chk} |")
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "mods_bwd_s6.json"), "w") as f:
            json.dump({"gpu": gpu, "records": records}, f, indent=1, default=str)
    for line in checks:
        print(line)
    print(f"total {time.perf_counter() - t_start:.0f} s (phase 1 {t_compiled - t_start:.0f} s)")


if __name__ == "__main__":
    main()
