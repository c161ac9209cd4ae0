"""fagen.attention with a user score_mod / mask_mod: trace (once, fagen/runtime/mods.py), pick the modded spec's
module (memoised by the mods' canonical fields), pass the captured tensors and numbers as kernel arguments.

[Note] Runtime scalars. A closure number reaches the kernels as a plain int or float argument; int arguments are
listed in the kernels' do_not_specialize (fagen/codegen/mod_args.py), so a changed value, even from 64 to 65, is
a new argument of the same compiled kernel: no trace, no render, no compile. The fast path of a warm call costs one
dict lookup for the trace, a walk of the recorded closure paths (read_captures) and one dict lookup for the module.
"""

from __future__ import annotations

from types import ModuleType

import torch

from fagen.codegen.mod_args import ModArgs
from fagen.mods.text import ModScalar, ModTensor
from fagen.runtime import hopper
from fagen.runtime.device import gpu_arch
from fagen.runtime.loader import load
from fagen.runtime.mods import Mods, prepare
from fagen.runtime.resolve import AttentionError, fast_key, spec_for
from fagen.spec.axes import Layout
from fagen.spec.kernel import KernelSpec, SpecError
from fagen.spec.tuned import DEFAULT_ARCH

_MODULES: dict[tuple, tuple[ModuleType, ModArgs]] = {}
_SPECS: dict[ModuleType, KernelSpec] = {}  # module -> its spec (the forward twins are made from it)

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
    key = (fast_key(q, k, v, mask, False, switches, False), mods.fields, layout)
    hit = _MODULES.get(key)
    if hit is not None:
        return hit
    base = spec_for(q, k, v, mask=mask, switches=switches, layout=layout)
    _, _, tensors, scalars = mods.fields
    try:
        spec = modded_spec(base, mods.fields)
    except SpecError as e:
        raise AttentionError(f"no kernel for these mods: {e}") from None
    module = load(spec)
    _SPECS[module] = spec
    hit = _MODULES[key] = (module, ModArgs(tuple(ModTensor(*t) for t in tensors),
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
              score_mod, mask_mod, block_mask, check, packed=None):
    """fagen.attention's path for calls with score_mod / mask_mod (README "User mods"); packed: the varlen
    keywords (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), or None for the dense layout."""
    if block_mask is not None and mask_mod is None:
        raise AttentionError("block_mask: describes a mask_mod's blocks; pass that mask_mod= as well")
    mods = prepare(score_mod=score_mod, mask_mod=mask_mod)
    module, args = module_for(q, k, v, mask, switches, mods, Layout.DENSE if packed is None else Layout.VARLEN)
    check_values(q, args, mods.values)
    if block_mask is not None:
        if packed is None:
            _check_block_mask(block_mask, mods, q.device, q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        else:  # B sequences, positions within each: built for (B, H, max_seqlen_q, max_seqlen_k)
            _check_block_mask(block_mask, mods, q.device, packed["cu_seqlens_q"].shape[0] - 1, q.shape[1],
                              packed["max_seqlen_q"], packed["max_seqlen_k"])
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
        key = (module, q.device, big, short)
        forward = _FORWARD_ONLY.get(key)
        if forward is None:  # [Note] Hopper selection (a score_mod: select_score_mods), [Note] Forward tiles
            forward = _gluon_forward(module, q.device) if big else module
            if mask_mod is not None:
                forward = _forward_twin(forward, mods.fields, short)
            _FORWARD_ONLY[key] = forward
        return forward.forward(q, k, v, **kw)[0]  # no autograd node to build
    return module.attention(q, k, v, **kw)


# (module, device, big, short) -> the module whose forward serves a call without gradient: one lookup for what
# _gluon_forward and _forward_twin pick (each memoised as well); the module fixes the mods' fields
_FORWARD_ONLY: dict[tuple, ModuleType] = {}


_GLUON: dict[tuple, ModuleType] = {}


def _gluon_forward(module: ModuleType, device) -> ModuleType:
    """The gluon modded forward that serves `module`'s spec on `device` where hopper.mod_forward_spec picks one."""
    key = (module, device)
    if key not in _GLUON:
        twin = hopper.mod_forward_spec(_SPECS[module], device)
        _GLUON[key] = load(twin) if twin is not None else module
    return _GLUON[key]


_FORWARD: dict[tuple[ModuleType, bool], ModuleType] = {}


def _forward_twin(module: ModuleType, fields: tuple, short: bool) -> ModuleType:
    """The forward-only module of `module`'s spec at MODDED_FWD_TILES' tiles for rows short or not ([Note] Forward
    tiles), or `module`."""
    hit = _FORWARD.get((module, short))
    if hit is None:
        spec = _SPECS[module]
        arch = gpu_arch()
        tiles = MODDED_FWD_TILES.get((arch, *mods_class(fields), short)) if arch and spec.head_dim > 64 else None
        hit = module
        if tiles is not None:
            given = {k: v for k, v in spec.to_dict().items() if k not in spec.defaulted}
            hit = load(KernelSpec.from_dict({**given, **tiles, "direction": "fwd"}))
        _FORWARD[(module, short)] = hit
    return hit


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
