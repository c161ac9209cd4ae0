"""fagen.attention with a user score_mod / mask_mod: trace (once, fagen/runtime/mods.py), pick the modded spec's
module (memoised by the mods' canonical fields), pass the captured tensors and numbers as kernel arguments.

[Note] Runtime scalars. A closure number reaches the kernels as a plain int or float argument; int arguments are
listed in the kernels' do_not_specialize (fagen/codegen/mod_args.py), so a changed value, even from 64 to 65, is
a new argument of the same compiled kernel: no trace, no render, no compile. The fast path of a warm call costs one
dict lookup for the trace and a run of its guard, which reads the closure's values ([Note] Trace cache in
fagen/runtime/mods.py), and one dict lookup for the module.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import torch

from fagen.codegen.args import SWITCH_KEYWORD
from fagen.codegen.mod_args import ModArgs
from fagen.mods import ir
from fagen.mods import lower as lowering
from fagen.mods import split
from fagen.mods.text import ModScalar, ModTensor
from fagen.runtime import hopper
from fagen.runtime.device import gpu_arch
from fagen.runtime.loader import load
from fagen.runtime.mods import Mods, prepare
from fagen.runtime.resolve import AttentionError, fast_key, spec_for
from fagen.spec.axes import Layout
from fagen.spec.kernel import SCORE_SWITCHES, KernelSpec, SpecError
from fagen.spec.tuned import DEFAULT_ARCH

_MODULES: dict[tuple, tuple[ModuleType, ModArgs]] = {}

# [Note] Modded tiles. A mod's loads of captured tensors are [BLOCK_M, BLOCK_N] gathers inside the key loop, and
# Triton's software pipeliner stages them in shared memory like K and V. With the plain d128 bf16 tiles
# (m128n128, 3 stages) the forward needs 353 KB on sm_90 (227 KB allowed) for a relative bias plus a document
# mask; m128n64 with 2 stages needs 129 KB with no spills in the forward (fagen compile --arch sm_90 on this
# mod, no GPU run yet). So for head_dim > 64 a spec whose mods read captured tensors takes block_n <= 64 and
# num_stages <= 2. Mods without loads (a softcap, a causal or window mask_mod) keep the plain tiles: the softcap
# score_mod compiles at m128n128, 3 stages, in 225 KB, as the switch kernel does.


# The choice per arch, in one place: MODDED_TILES maps (arch, kind, loads) to the launch fields a head_dim > 64
# modded spec sets over its plain spec's ({} keeps the plain tiles): kind "mask" for specs with a mask_mod (with or
# without a score_mod), "score" for a score_mod alone; loads: whether the mods read captured tensors.
# scripts/gpu_mods_tiles.py times candidate tiles on the rows of `fagen bench --suite mods` (d128 bf16) and prints
# the winner of each key, to copy here. An arch without an entry takes the compile-only rule above. The H100 run of
# 2026-11-26 (benchmarks/mods.md, "Tiles") kept three keys and moved relative bias to 2 stages of m128n128, whose
# backward took 0.68x the time of m128n64w8s2 (forward 1.11x; the forward of a score_mod alone runs on the Gluon
# kernel anyway when no gradient is needed). The backward sweep of the same day (scripts/gpu_mods_bwd.py, after the
# backward's loop changes of [Note] Modded dK/dV phases in triton/mods.j2) kept every entry: each default was the
# fastest backward of its rows against m128n128w8s2 and m128n64w8s2 (docs/mods.md, "The backward").
MODDED_TILES: dict[tuple[str, str, bool], dict] = {
    ("sm_90", "score", True): {"num_stages": 2},  # relative bias, learned bias: m128n128w8s2 (H100: fwd+bwd 0.78x)
    ("sm_90", "mask", True): {"block_n": 64, "num_stages": 2},  # document mask
    ("sm_90", "score", False): {},  # ALiBi, softcap
    ("sm_90", "mask", False): {},  # prefix-LM, sliding window, dilated
}


# [Note] Forward tiles. Without a gradient fagen.attention runs the forward alone, and a spec's tiles above are chosen
# for forward and backward together (the backward's spills decided most keys). MODDED_FWD_TILES maps (arch, kind,
# loads, short) to the launch fields of a forward-only twin of the modded spec (direction fwd), for a mask_mod (a
# score_mod alone takes the gluon forward there, [Note] Hopper selection); a key without an entry keeps the spec's
# own forward. short: the block mask leaves at most SHORT_ROW_KEYS keys per query row on average (its density, read
# at its build, times Sk): such rows run a few key blocks per program, where two CTAs per SM hide each program's
# start. scripts/gpu_mods_fwd.py times the forward of candidate tiles on the mask rows of `fagen bench --suite mods`.
# H100, 2026-11-26 (docs/mods.md, "Forward on the H100"), rows at 7-16 key blocks of 128 per query block: the
# document mask (reads tensors) 200 TF/s at m64n64w4s2 against 173 at its m128n64w8s2 (m64n64w4s3 spilled: 131);
# the sliding window 311 at m64n64w4s3 against 286 at the plain m128n128w8s3, the dilated window 75 against 73;
# prefix-LM, 34 blocks per row, 497 at the plain tiles against 446.
SHORT_ROW_KEYS = 2560
MODDED_FWD_TILES: dict[tuple[str, str, bool, bool], dict] = {
    ("sm_90", "mask", True, True): {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2},  # document mask
    ("sm_90", "mask", False, True): {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},  # windows
}


def mods_class(fields: tuple) -> tuple[str, bool]:
    """(kind, loads) of a Mods' fields: MODDED_TILES's key after the arch."""
    return ("mask" if fields[1] is not None else "score"), bool(fields[2])


def modded_tiles(base: KernelSpec, fields: tuple, arch: str) -> dict:
    """The launch fields a modded spec sets over its plain spec's (`base`, resolved for `arch`) on `arch`
    ([Note] Modded tiles); {} keeps the plain tiles."""
    if base.head_dim <= 64:
        return {}
    kind, loads = mods_class(fields)
    found = MODDED_TILES.get((arch, kind, loads))
    if found is not None:
        return dict(found)
    return {"block_n": min(64, base.block_n), "num_stages": min(2, base.num_stages)} if loads else {}


def modded_spec(base: KernelSpec, fields: tuple, tiles: dict | None = None, arch: str | None = None) -> KernelSpec:
    """The modded spec of a plain spec and a Mods' fields on `arch` (None: this process's GPU, else sm_90): the
    plain spec's given fields, the modded tiles ([Note] Modded tiles) or `tiles` (scripts/gpu_mods_tiles.py times
    candidates through this); the launch fields neither sets stay unset, so fagen.load resolves them per arch."""
    score, text, tensors, scalars = fields
    if tiles is None:
        arch = arch or gpu_arch() or DEFAULT_ARCH
        tiles = modded_tiles(base.for_arch(arch), fields, arch)
    given = {k: v for k, v in base.to_dict().items() if k not in base.defaulted}
    return KernelSpec.from_dict({**given, **tiles, "score_mod": score, "mask_mod": text,
                                 "mod_tensors": [list(t) for t in tensors],
                                 "mod_scalars": [list(s) for s in scalars]})


def module_for(q, k, v, mask, switches: tuple[str, ...], mods: Mods,
               layout: Layout = Layout.DENSE) -> tuple[ModuleType, ModArgs]:
    """The bwd (differentiable) module of these inputs with these mods, and its mod argument list."""
    return _bwd_module(*_mods_spec(q, k, v, mask, switches, mods, layout))


def _bwd_module(key: tuple, spec: KernelSpec, args: ModArgs) -> tuple[ModuleType, ModArgs]:
    hit = _MODULES.get(key)
    if hit is None:
        module = load(spec)
        hit = _MODULES[key] = (module, args)
    return hit


_MOD_SPECS: dict[tuple, tuple[tuple, KernelSpec, ModArgs]] = {}


def _mods_spec(q, k, v, mask, switches: tuple[str, ...], mods: Mods,
               layout: Layout) -> tuple[tuple, KernelSpec, ModArgs]:
    """(key, the bwd spec, its mod argument list) of these inputs with these mods; nothing rendered or loaded."""
    key = (fast_key(q, k, v, mask, False, switches, False), mods.fields, layout)
    hit = _MOD_SPECS.get(key)
    if hit is not None:
        return hit
    base = spec_for(q, k, v, mask=mask, switches=switches, layout=layout)
    _, _, tensors, scalars = mods.fields
    try:
        spec = modded_spec(base, mods.fields)
    except SpecError as e:
        raise AttentionError(f"no kernel for these mods: {e}") from None
    hit = _MOD_SPECS[key] = (key, spec, ModArgs(tuple(ModTensor(*t) for t in tensors),
                                                tuple(ModScalar(*s) for s in scalars)))
    return hit


def check_values(q, args: ModArgs, values: dict) -> None:
    """Captured tensors live on q's device; a number is finite where the kernel reads it as fp32/int32."""
    device = q.device if args.tensors else None
    for t in args.tensors:
        x = values[t.name]
        if x.device != device:
            raise AttentionError(f"captured tensor {t.name}: on {x.device}, but q is on {device}; move it "
                                 f"(the mod reads it inside the kernel)")
    for s in args.scalars:
        x = values[s.name]
        if s.type == "int" and not -2**31 <= x < 2**31:
            raise AttentionError(f"captured number {s.name} = {x}: kernels read int scalars as int32; keep it "
                                 "within +-2**31")


def attention(q, k, v, *, mask, scale, seqlens_q, seqlens_k, tree_mask, scores: dict, switches: tuple,
              score_mod, mask_mod, block_mask, check, packed=None, prepared: Mods | None = None, deterministic=True):
    """fagen.attention's path for calls with score_mod / mask_mod (README "User mods"); packed: the varlen
    keywords (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), or None for the dense layout; prepared:
    this call's Mods of these functions where as_switches made them; deterministic: fagen.attention's (the gluon
    backward's mode where it serves, [Note] Gluon backward selection in fagen/runtime/hopper.py)."""
    if block_mask is not None and mask_mod is None:
        raise AttentionError("block_mask: describes a mask_mod's blocks; pass that mask_mod= as well")
    mods = prepared if prepared is not None else prepare(score_mod=score_mod, mask_mod=mask_mod)
    low = _lower(mods, q, k, v, mask, scores, seqlens_q, seqlens_k, block_mask, packed) if lowering.ENABLED else None
    LOWERED[0] = None if low is None else low.label
    if low is not None:  # [Note] Mod lowering (fagen/mods/lower.py): the built-in switches' kernels serve
        if block_mask is not None and low.mask_lowered:
            _check_call_block_mask(block_mask, mods, q, k, packed)  # validated, then unused
            block_mask = None
        scores = {**scores, **low.scores}
        switches = tuple(name for name in SCORE_SWITCHES if SWITCH_KEYWORD[name] in scores)
        if low.fields is None:  # nothing left: fagen.attention's plain path, with its own kernel choice
            return Plain(dict(mask=low.mask, scale=scale, seqlens_q=seqlens_q, seqlens_k=seqlens_k,
                              tree_mask=tree_mask, check=check, **scores, **(packed or {})))
        mask, mods = low.mask, Mods(mods.traced, low.fields, {n: mods.values[n] for n in low.names})
        score_mod, mask_mod = (score_mod if low.fields[0] else None), (mask_mod if low.fields[1] else None)
    key, spec, args = _mods_spec(q, k, v, mask, switches, mods, Layout.DENSE if packed is None else Layout.VARLEN)
    check_values(q, args, mods.values)
    if block_mask is not None:
        _check_call_block_mask(block_mask, mods, q, k, packed)
    if packed is None:  # one dict of keywords per call
        kw = dict(scale=scale, check=check, mods=mods.values, seqlens_q=seqlens_q, seqlens_k=seqlens_k,
                  tree_mask=tree_mask, **scores)
    else:
        kw = dict(scale=scale, check=check, mods=mods.values, **packed, **scores)
    if mask_mod is not None:
        kw["block_mask"] = block_mask
    if not torch.is_grad_enabled() or not (q.requires_grad or k.requires_grad or v.requires_grad or any(
            mods.values[a.name].requires_grad for a in args.tensors)):
        qs = q.shape
        big = packed is None and qs[0] * qs[1] * qs[2] * k.shape[2] >= hopper.MIN_WORK
        short = block_mask is not None and block_mask.density * block_mask.seq_k <= SHORT_ROW_KEYS
        module = _FORWARD_ONLY.get((key, big, short))  # key holds q's device (fast_key)
        if module is None:
            module = _FORWARD_ONLY[(key, big, short)] = _forward_module(key, spec, args, q.device, big, short)
        return module.forward(q, k, v, **kw)[0]  # no autograd node to build
    gluon = _gluon_bwd(key, spec, q, k, scores, args, mods, deterministic) if packed is None else None
    if gluon is not None:  # [Note] Gluon backward selection (fagen/runtime/hopper.py)
        if deterministic is False and hopper.unordered(gluon):
            kw["deterministic"] = False
        return gluon.attention(q, k, v, **kw)
    return _bwd_module(key, spec, args)[0].attention(q, k, v, **kw)


_GLUON_BWD: dict[tuple, ModuleType | None] = {}


def _gluon_bwd(key: tuple, spec: KernelSpec, q, k, scores: dict, args: ModArgs, mods: Mods,
               deterministic: bool = True) -> ModuleType | None:
    """The gluon bwd module that serves a dense modded call with gradients, or None: the Triton one ([Note] Gluon
    backward selection in fagen/runtime/hopper.py): at least BWD_MIN_WORK pairs (BWD_WINDOW_MIN_WORK with a window,
    its keys counted), no captured tensor requiring grad, a case the rule picks on q's device."""
    qs, window = q.shape, scores.get("window")
    keys = k.shape[2] if window is None else hopper.window_keys(k.shape[2], window)
    if not hopper.big_backward(qs[0] * qs[1] * qs[2] * keys, window) \
            or any(mods.values[a.name].requires_grad for a in args.tensors):
        return None
    mode = (key, deterministic is False)
    if mode not in _GLUON_BWD:
        twin = hopper.backward_spec(spec, q.device, deterministic is False)
        _GLUON_BWD[mode] = None if twin is None else load(twin)
    return _GLUON_BWD[mode]


@dataclasses.dataclass(frozen=True)
class Plain:
    """attention's answer when the mods were exactly built-in switches: fagen.attention's keywords for its plain
    path (fagen/runtime/api.py runs them)."""
    kwargs: dict


LOWERED: list = [None]  # what the last call's mods became ("causal+window(1024,0)"), None: not lowered (bench, tests)


def as_switches(q, k, v, mask, score_mod, mask_mod, block_mask, scores: dict, seqlens_q, seqlens_k, packed):
    """(mask, scores) of a call whose mods are all built-in switches ([Note] Mod lowering in fagen/mods/lower.py),
    for fagen.attention's plain path; where any mod stays, the Mods it prepared (attention() then runs the rest
    with them, prepared=), or None before preparing any. The warm cost: the trace cache's lookup, the closure's
    numbers and the memoised plan, a few microseconds, and none of the modded path's spec checks (the plain path
    checks the inputs as for the switch call)."""
    if not lowering.ENABLED or mask_mod is None and block_mask is not None:
        return None
    if packed is None and q.dim() != 4 or packed is not None and None in packed.values():
        return None  # malformed: the modded path names what is wrong
    mods = prepare(score_mod=score_mod, mask_mod=mask_mod)
    low = _lower(mods, q, k, v, mask, scores, seqlens_q, seqlens_k, block_mask, packed, views=packed is None)
    if low is None or low.fields is not None:
        return mods
    LOWERED[0] = low.label
    if block_mask is not None:
        _check_call_block_mask(block_mask, mods, q, k, packed)  # validated, then unused
    return low.mask, {**scores, **low.scores}, low.split  # split: mods/split.run_split runs it (api.py)


def _lower(mods: Mods, q, k, v, mask, scores: dict, seqlens_q, seqlens_k, block_mask, packed, views=False):
    """This call's lowering of its mods ([Note] Mod lowering in fagen/mods/lower.py), or None; views: the caller
    can run split.run_split ([Note] Dilated windows, [Note] Prefix rows in fagen/mods/split.py)."""
    traced = mods.traced
    p = split.plan(mods.fields, traced.score_mod, traced.mask_mod)  # lower.plan's, with the splits
    if p is None:
        return None
    mask = mask if type(mask) is str else str(mask)  # a Mask's str is its value
    if packed is None:
        offset = lowering.alignment(mask, q.shape[2], k.shape[2], seqlens_q, seqlens_k, False)
    else:
        offset = lowering.alignment(mask, packed["max_seqlen_q"], packed["max_seqlen_k"], packed["cu_seqlens_q"],
                                    packed["cu_seqlens_k"], True)
    slopes_ok = None
    if p.alibi is not None:
        grad = torch.is_grad_enabled()

        def slopes_ok(t):  # the switch's alibi_slopes: float32 (the declaration) [Hq] on q's device, no gradient
            return tuple(t.shape) == (q.shape[1],) and t.device == q.device and not (grad and t.requires_grad)
    low = lowering.lower(p, mods.fields, (traced.score_mod, traced.mask_mod), mods.values, mask=mask,
                         offset=offset, scores=scores, block_mask=block_mask is not None, slopes_ok=slopes_ok,
                         host_slopes=lambda tree, names, values: _host_slopes(tree, names, values, q),
                         splits=(lambda kind, n: split.splittable(kind, n, q, k, v, _grad(q, k, v, mods)))
                         if views else None)
    if low is not None and low.fields is None and traced.score_mod is not None and packed is None and not scores \
            and low.mask in ("none", "causal") and set(low.scores) <= SCORE_KEYS \
            and _gluon_serves(mods, q, k, v, low.mask):  # [Note] Score mods on the gluon forward
        low = lowering.lower(p, mods.fields, (traced.score_mod, traced.mask_mod), mods.values, mask=mask,
                             offset=offset, scores=scores, block_mask=block_mask is not None, score=False)
    return low


SCORE_KEYS = {"softcap", "alibi_slopes"}
_SLOPES: dict[tuple, torch.Tensor | None] = {}


def _host_slopes(tree: ir.Node, names: tuple, values: dict, q) -> torch.Tensor | None:
    """The float32 [Hq] alibi_slopes on q's device of a slope that is an expression of h ([Note] Host slopes in
    fagen/mods/lower.py), cached by (tree, Hq, the closure numbers it reads, device); None where the host cannot
    evaluate it. A miss evaluates Hq values and copies them to the device (not while a CUDA graph captures: the
    mod then runs as written)."""
    key = (tree, q.shape[1], q.device, *(values[n] for n in names))
    if key in _SLOPES:
        return _SLOPES[key]
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    got = lowering.head_slopes(tree, q.shape[1], values)
    found = None if got is None else torch.tensor(got, dtype=torch.float32, device=q.device)
    if len(_SLOPES) >= 256:
        _SLOPES.clear()
    _SLOPES[key] = found
    return found


def _grad(q, k, v, mods: Mods) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in mods.values.values()))

# [Note] Score mods on the gluon forward. Without a gradient on an H100, fagen.attention runs a score_mod alone
# (mask none/causal, no switch) on the gluon modded forward ([Note] Hopper selection), which measured faster than
# the softcap switch's forward (scripts/gpu_mods_lower.py, H100, S8192 full: the softcap mod 1.050 ms, the softcap
# switch 1.142 ms; the switch's forward is Triton's, the gluon one with a softcap switch lost to it). So where that
# forward would serve the mod, a score_mod that is a softcap or ALiBi stays a mod (a causal mask_mod beside it
# still lowers); with a gradient the switch kernels win (fwd+bwd 4.797 against 5.417 ms) and the mod lowers.
_GLUON_SCORE: dict[tuple, bool] = {}


def _gluon_serves(mods: Mods, q, k, v, mask: str) -> bool:
    """Whether this call's score_mod, kept as a mod with the built-in `mask`, runs on the gluon modded forward."""
    if v is None or not q.is_cuda or q.dim() != 4 \
            or q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] < hopper.MIN_WORK \
            or torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    key = (mods.fields[0], fast_key(q, k, v, mask, False, (), True))
    hit = _GLUON_SCORE.get(key)
    if hit is None:
        scalars, tensors = ir.names_in(mods.traced.score_mod)
        fields = (mods.fields[0], None, tuple(t for t in mods.fields[2] if t[0] in tensors),
                  tuple(s for s in mods.fields[3] if s[0] in scalars))
        try:
            hit = hopper.mod_forward_spec(modded_spec(spec_for(q, k, v, mask=mask), fields), q.device) is not None
        except (SpecError, AttentionError):
            hit = False
        _GLUON_SCORE[key] = hit
    return hit


def _check_call_block_mask(block_mask, mods: Mods, q, k, packed) -> None:
    if packed is None:
        _check_block_mask(block_mask, mods, q.device, q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    else:  # B sequences, positions within each: built for (B, H, max_seqlen_q, max_seqlen_k)
        _check_block_mask(block_mask, mods, q.device, packed["cu_seqlens_q"].shape[0] - 1, q.shape[1],
                          packed["max_seqlen_q"], packed["max_seqlen_k"])


# [Note] Forward-only first calls. A call without gradient runs one forward kernel: the Gluon forward of a score_mod
# on a large enough problem ([Note] Hopper selection; mod_forward_spec), a mask_mod's forward twin ([Note] Forward
# tiles), or else the forward of the bwd module. Only that one module is rendered, imported and compiled: the bwd
# module of a twin's spec is not loaded until a call needs gradients (Triton then compiles its forward and
# backward kernels at their first launch, as always), so the first call of a new mod pays for one module and one
# kernel. tests/test_cold.py counts the modules such a call loads.
_FORWARD_ONLY: dict[tuple, ModuleType] = {}


def _forward_module(key: tuple, spec: KernelSpec, args: ModArgs, device, big: bool, short: bool) -> ModuleType:
    """The module whose forward serves a call without gradient ([Note] Forward-only first calls)."""
    twin = hopper.mod_forward_spec(spec, device) if big else None  # [Note] Hopper selection (select_score_mods)
    if twin is None and spec.mask_mod is not None:  # [Note] Forward tiles
        twin = _forward_spec(spec, key[1], short)
    return load(twin) if twin is not None else _bwd_module(key, spec, args)[0]


def _forward_spec(spec: KernelSpec, fields: tuple, short: bool) -> KernelSpec | None:
    """The forward-only spec of a modded spec at MODDED_FWD_TILES' tiles for rows short or not ([Note] Forward
    tiles), or None: the spec's own forward serves."""
    arch = gpu_arch()
    tiles = MODDED_FWD_TILES.get((arch, *mods_class(fields), short)) if arch and spec.head_dim > 64 else None
    if tiles is None:
        return None
    given = {k: v for k, v in spec.to_dict().items() if k not in spec.defaulted}
    return KernelSpec.from_dict({**given, **tiles, "direction": "fwd"})


def _check_block_mask(bm, mods: Mods, device, batch: int, heads: int, sq: int, sk: int) -> None:
    from fagen.runtime.block_mask import BlockMask

    if not isinstance(bm, BlockMask):
        raise AttentionError(f"block_mask: expected a fagen.create_block_mask result, got {type(bm).__name__}")
    if bm.mask_mod != mods.fields[1]:
        raise AttentionError(f"block_mask: built for mask_mod {bm.mask_mod!r}, but this call's mask_mod is "
                             f"{mods.fields[1]!r}; build it from the same function")
    if (bm.seq_q, bm.seq_k) != (sq, sk):
        raise AttentionError(f"block_mask: built for Sq={bm.seq_q}, Sk={bm.seq_k}, but q and k have Sq={sq}, "
                             f"Sk={sk} (varlen: max_seqlen_q, max_seqlen_k); build one per shape")
    nb, nh = bm.classes.shape[:2]
    if nb not in (1, batch) or nh not in (1, heads):
        raise AttentionError(f"block_mask: built for B={nb}, H={nh}, but q has B={batch}, H={heads} "
                             "(query heads; varlen: B is the number of sequences)")
    if bm.classes.device != device:
        raise AttentionError(f"block_mask: on {bm.classes.device}, but q is on {device}")
