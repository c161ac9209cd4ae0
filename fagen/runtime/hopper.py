"""When the Gluon (Hopper) forward serves a case in place of the Triton one: the use-time, machine-dependent choice.

[Note] Hopper selection
A spec never depends on the machine ([Note] Deterministic specs in fagen/spec/tuned.py): KernelSpec's default
backend stays 'triton' everywhere. The choice of the gluon backend is made where a kernel is *used*, from the
inputs' device: by fagen.attention (fagen/runtime/resolve.py) when no gradient is needed, and by `fagen bench`
(BenchCase.spec) when no spec field is pinned on the command line. It applies when
  - $FAGEN_HOPPER is not "0" (read when a case is first resolved in a process; set it before the first call),
  - the device is CUDA of compute capability 9.0 (H100/H200) and triton has the Gluon Hopper API (>= 3.6),
  - the gluon backend's measured rule picks the case (GluonBackend.selected, [Note] Gluon selection rule in
    fagen/backends/gluon.py: where the H100 measurements of docs/hopper.md show a win over the Triton forward).
fp8 (dtype fp8_e4m3) has no other kernel: an fp8 case within the gluon forward's limits (prefill forward, head_dim
64/128, mask none/causal/padding/causal+padding, no switch or the window alone) is always the gluon one on sm_90
(README "fp8 forward").
MLA's absorbed decode (fagen.attention with v=None: shared_kv, 576/512, bf16, causal or none) takes the gluon decode
where its module fits the inputs (latent_decode_spec: Hq x Sq a multiple of 64 or one padded tile, one KV head),
from LATENT_MIN_WORK pairs, LATENT_CAPTURED_MIN_WORK while the stream is capturing a CUDA graph; with an fp8 e4m3
latent cache (fagen.attention's, dense or paged, and the bench's) the gluon fp8 decode, where select_fp8_latent is on,
up to LATENT_FP8_MAX_ROWS rows.
Everywhere else the present kernels serve, unchanged. fagen.attention also asks for a problem of at least MIN_WORK
(batch x query heads x Sq x Sk, with Sk bounded by a window's left + right + 1) pairs, WINDOW_MIN_WORK with a
window: below that the Gluon module's host time per call outlasts what its kernel saves ([Note] Gluon size rule).

A score_mod (no mask_mod) follows the same rule through mod_forward_spec, called by fagen.attention's modded path
(fagen/runtime/modded.py) when no gradient is needed, where GluonBackend.select_score_mods says (on: measured).

With gradients, fagen.attention takes the gluon bwd module (its Gluon forward and the Gluon backward of
fagen/templates/gluon/backward.py.j2) where GluonBackend.bwd_selected picks the case ([Note] Gluon backward rule in
fagen/backends/gluon.py: d128 bf16, none/causal, any gqa, and d64's plain cases; the switches and score_mods of
[Note] Gluon backward selection), under the same conditions ($FAGEN_HOPPER, sm_90, the Gluon API) and from
BWD_MIN_WORK pairs ([Note] Gluon backward size rule): below that the Triton bwd module's per-call time is lower or
equal.
deterministic=False (fagen.attention's keyword) gives that module's unordered dQ adds where unordered_selected
says they won; elsewhere the deterministic mode serves. Every Triton backward is deterministic anyway.
"""

from __future__ import annotations

import functools
import os

from fagen.backends import GLUON
from fagen.spec.axes import Backend, Direction, DType, SpecError
from fagen.spec.kernel import KernelSpec

ENV = "FAGEN_HOPPER"
MIN_WORK = 1 << 26  # batch x query heads x Sq x Sk below which fagen.attention keeps the Triton forward
BWD_MIN_WORK = 1 << 29  # the same floor for the gluon backward (with gradients): [Note] Gluon backward size rule
WINDOW_MIN_WORK = 1 << 24  # the same with a window: B x Hq x Sq x (left + right + 1) ([Note] Gluon size rule)
# the gluon backward's floor with a window, in the same pairs ([Note] Gluon backward selection): the sliding-window
# row of `fagen bench --suite mods` (B1 H16 S8192, window (1024, 0)) is 1.3e8 pairs
BWD_WINDOW_MIN_WORK = 1 << 26

# B x Hq x Sq x Sk below which fagen.attention's shared latent decode keeps the Triton one ([Note] Gluon MLA decode
# size): a small step is host time. Per call, back to back, Hq 128 Sq 2, Triton / gluon module (H100,
# scripts/gpu_mla_glu.py, round B, the merge on fast launches): b1 kv1024 (2^18) 73.9 / 89.3 us, b4 kv4096 (2^22)
# 119.5 / 105.9, b8 kv8192 (2^24) 212 / 98, b16 kv8192 (2^25) 324 / 149. So the gluon module serves from 2^22.
LATENT_MIN_WORK = 1 << 22
# [Note] Latent padded tiles. The gluon decode runs Hq x Sq of 16, 32 or 48 rows (MLA's memory-bound Hq 16, Sq 1)
# as one 64-row tile padded ([Note] Padded row tiles in fagen/templates/gluon/mla_decode.py.j2); fagen.attention
# hands those shapes to it when this is True (from LATENT_MIN_WORK pairs, as the 64-row tiles). H100, Hq 16 Sq 1
# page 64, % of copy bandwidth, eager back to back (scripts/gpu_mla_dec_s9.py round A, 2026-11-27), gluon / Triton:
# b128 kv4k 91.4 / 89.5, b32 kv32k 91.5 / 87.4, b128 kv32k 95.9 / 97.4; b32 kv4k (2^21 pairs: Triton) was host
# time in both (34 / 65%, ~50 us of GPU work a call).
LATENT_PAD_SELECTED = True  # round B (CUDA graphs): 93.0 / 92.7 / 96.5% against 90.6 / 88.7 / 98.7
# (Since the twelfth session a 16-row case, Hq 16 Sq 1, runs the module's swap-AB tile instead of the padded one:
# 99.2 / 99.3 / 103.7% in graphs; [Note] Swap-AB tile in fagen/templates/gluon/mla_decode.py.j2.)
# [Note] Latent decode under capture. LATENT_MIN_WORK weighs host time, which a CUDA graph's replay does not pay:
# while the current stream is capturing (a serving engine's decode step), fagen.attention takes the gluon decode from
# LATENT_CAPTURED_MIN_WORK pairs instead (None: as eager). H100, Hq 16 Sq 1 b32 kv4k dense bf16 (2^21 pairs), 8 calls
# of fagen.attention in a graph (scripts/gpu_mladec_s10.py, tenth session round B): the Triton decode 69.9% of copy,
# the padded gluon tile 74.9% (round A's graph of the module: 74.7%); eager, the gluon call is host-bound (120-207 us
# against the Triton one's 73-75). Smaller steps are not measured in a graph, so the floor is the measured 2^21.
LATENT_CAPTURED_MIN_WORK = 1 << 21
# The most Hq x Sq rows a call with an fp8 e4m3 latent cache takes the gluon fp8 decode at, where
# GluonBackend.select_fp8_latent is on ([Note] Gluon fp8 latent decode in fagen/backends/gluon_decode.py): one program
# of 16 rows a sequence and split (Hq 16 Sq 1, the memory-bound rows); more rows run one program a 16 rows, each
# converting every block (Hq 128 Sq 2 b32 kv8k, H100 round A: 188 TF/s against the Triton decode's 199, docs/serving.md,
# "MLA decode, twelfth session"): the Triton decode kept those; with the gluon backend's variant fp8lat_seesaw (on):
# then Hq x Sq a multiple of 64 takes the seesaw over the converted cache ([Note] Seesaw fp8 conversion; H200, Hq 128
# Sq 2 b32 kv8k: 337 TF/s against the Triton decode's 207, docs/serving.md "MLA fp8 latent decode at 64-row programs";
# 366 with the f16 operands, the default since the twenty-fourth session, "MLA fp8 seesaw: the conversion's place").
LATENT_FP8_MAX_ROWS = 16
# [Note] Gluon size rule. The Gluon forward's kernel is faster than the Triton one (0.70-0.75x the time per call
# at 2^27 .. 2^29 causal d128 bf16 pairs on the H100), but its host path used to cost about 200 us a call
# (four TensorDescriptors and the JIT dispatch; benchmarks/latency.md), so MIN_WORK was 2^29. With fast launches
# ([Note] Gluon fast launches in fagen/templates/host/gluon_launch.py) a call costs 46 us of host time (the Triton
# forward 16-28 us). Per-call wall time in a queue (scripts/gpu_gluon_host.py, seventh session, H100), causal d128
# bf16 Gluon / Triton: round A 1.56x at 2^24, 0.83x at 2^25, 0.61x at 2^26; round B (a busier host) 1.26-1.47x at
# 2^25, 0.83x at 2^26, 0.71x at 2^28; full attention 0.80x at 2^25. So MIN_WORK is 2^26, where both rounds win.
# A causal window's kernel wins by more at equal pairs: 0.75x / 0.76x at 2^24 (window (256, 0), S4096 H16) in
# both rounds, a tie at 2^23 (0.98-0.99x), so windows take it from 2^24.
# [Note] Gluon backward size rule. The backward's host path is on fast launches since the eighth session
# ([Note] Gluon backward host path in fagen/templates/host/gluon_bwd_launch.py): the backward alone costs 160 us of
# host time at B1 H8 S256 causal against the plain path's 453 and the Triton backward's 136 (H100, round B of
# scripts/gpu_gluon_bwd_host.py). Per-call wall time of fwd+bwd in a queue, causal d128 bf16, Gluon deterministic /
# Triton: 1.11-1.44x from 2^22 to 2^27 pairs (both host-bound, 0.44-0.67 ms a call), 0.93x at 2^28 with S4096 but
# 1.28x at 2^28 with B8 H32 S1024 (short sequences), 1.00x at 2^29 (B2 H16 S4096), 0.97x at 2^31 (S8192); the
# unordered mode 0.93x, 0.79x, 0.80x at the last three. So the floor stays 2^29 pairs (none and GQA not measured
# in that run: its time limit killed the phase).
# The measured rule, as the gluon backend's descriptor states it (machine not considered).
selected = GLUON.selected


def enabled() -> bool:
    """False when $FAGEN_HOPPER is "0" (or "off", "false", "no"): the Triton kernels serve everywhere."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


@functools.cache
def gluon_missing() -> str | None:
    """None when this triton has the Gluon Hopper API the template is written against; else the reason."""
    try:
        import triton
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except ImportError as e:
        return f"triton has no Gluon Hopper API ({e})"
    try:
        major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    except ValueError:
        return f"unreadable triton version {triton.__version__!r}"
    if (major, minor) < (3, 6):
        return f"the Gluon kernel is written against triton 3.6's API; found {triton.__version__}"
    return None


_CAPABILITY: dict[int, tuple[int, int]] = {}


def is_hopper(device) -> bool:
    """Whether `device` (a torch.device) is a CUDA device of compute capability 9.0."""
    if getattr(device, "type", None) != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index] == (9, 0)


def gluon_twin(spec: KernelSpec) -> KernelSpec:
    """The gluon spec of the same case (its own default blocks)."""
    return KernelSpec(head_dim=spec.head_dim, head_dim_v=spec.head_dim_v, mask=spec.mask, gqa=spec.gqa,
                      dtype=spec.dtype, backend=Backend.GLUON, **{name: True for name in spec.switches})


def forward_spec(spec: KernelSpec, device) -> KernelSpec | None:
    """The gluon spec that should serve `spec`'s case as a forward on `device`, or None: keep `spec`.

    `spec` may be a bwd spec (fagen.attention's): only its case (head_dim, mask, dtype, gqa) is read.
    """
    if spec.dtype is DType.FP8_E4M3:  # no Triton fp8 kernel to keep: $FAGEN_HOPPER does not apply
        fp8 = gluon_twin(spec)
        return fp8 if selected(fp8) and is_hopper(device) and gluon_missing() is None else None
    case = KernelSpec(head_dim=spec.head_dim, head_dim_v=spec.head_dim_v, mask=spec.mask, gqa=spec.gqa,
                      dtype=spec.dtype, kind=spec.kind, **{name: True for name in spec.switches})
    if not (enabled() and selected(case) and is_hopper(device) and gluon_missing() is None):
        return None
    return gluon_twin(case)


def latent_decode_spec(spec: KernelSpec, device, rows: int | None = None) -> KernelSpec | None:
    """The gluon spec that should serve a shared latent decode (MLA's absorbed decode, a Triton decode spec) on
    `device`, or None: keep `spec`. The caller also asks the module whether it takes the inputs (its fits(q, k): Hq x
    Sq a multiple of 64 or one padded tile of 16, 32 or 48 rows, one KV head, pages of a multiple of 64 keys;
    [Note] Gluon MLA decode in fagen/backends/gluon.py); the Triton decode keeps every other case. `rows` (Hq x Sq,
    when the caller knows it): a padded tile serves only under LATENT_PAD_SELECTED ([Note] Latent padded tiles)."""
    if not (spec.shared_kv and GLUON.decode_selected(spec) and enabled() and is_hopper(device)
            and gluon_missing() is None):
        return None
    if spec.kv_dtype is not None:  # [Note] Gluon fp8 latent decode: programs of 16 rows, measured up to
        return _latent_twin(spec) if rows is None or rows <= LATENT_FP8_MAX_ROWS or (  # LATENT_FP8_MAX_ROWS
            GLUON.variant["fp8lat_seesaw"] and rows % 64 == 0) else None  # or the seesaw's 64-row programs
    if rows is not None and rows % 64 and not LATENT_PAD_SELECTED:
        return None
    return _latent_twin(spec)


@functools.lru_cache(maxsize=256)
def _latent_twin(spec: KernelSpec) -> KernelSpec:
    """The gluon decode spec of a shared latent decode's case (built once: a spec's validation is host time)."""
    return KernelSpec(head_dim=spec.head_dim, head_dim_v=spec.head_dim_v, shared_kv=True, kind=spec.kind,
                      mask=spec.mask, gqa=spec.gqa, dtype=spec.dtype, layout=spec.layout, kv_dtype=spec.kv_dtype,
                      backend=Backend.GLUON)


def mod_forward_spec(spec: KernelSpec, device) -> KernelSpec | None:
    """The gluon spec that should serve a modded (Triton) spec's forward on `device`, or None: keep `spec`. Only a
    score_mod without a mask_mod, on the dense layout ([Note] Gluon selection rule: select_score_mods)."""
    if not spec.modded or spec.mask_mod is not None or str(spec.layout) != "dense" or spec.switches:
        return None
    try:
        twin = KernelSpec(head_dim=spec.head_dim, mask=spec.mask, gqa=spec.gqa, dtype=spec.dtype,
                          backend=Backend.GLUON, score_mod=spec.score_mod, mod_tensors=spec.mod_tensors,
                          mod_scalars=spec.mod_scalars)
    except SpecError:  # a case the gluon forward does not take (head_dim, mask, dtype): keep the Triton one
        return None
    if not (enabled() and selected(twin) and is_hopper(device) and gluon_missing() is None):
        return None
    return twin


def backward_spec(spec: KernelSpec, device, unordered: bool = False) -> KernelSpec | None:
    """The gluon bwd spec that should serve `spec`'s case with gradients on `device`, or None: keep `spec` (the
    caller checks the problem size against BWD_MIN_WORK, BWD_WINDOW_MIN_WORK with a window, and that no captured
    tensor asks for a gradient: [Note] Gluon backward selection); unordered: the call's deterministic=False."""
    if not (enabled() and GLUON.bwd_selected(spec, unordered) and is_hopper(device) and gluon_missing() is None):
        return None
    return _bwd_twin(spec)


@functools.lru_cache(maxsize=256)
def _bwd_twin(spec: KernelSpec) -> KernelSpec | None:
    """The gluon bwd spec of a case (the switches, the score_mod and its captured values' declarations), or None
    where the gluon backward's check refuses it (built once: a spec's validation is host time)."""
    try:
        return KernelSpec(head_dim=spec.head_dim, mask=spec.mask, gqa=spec.gqa, dtype=spec.dtype,
                          direction=Direction.BWD, backend=Backend.GLUON, **{name: True for name in spec.switches},
                          score_mod=spec.score_mod, mod_tensors=spec.mod_tensors, mod_scalars=spec.mod_scalars)
    except SpecError:
        return None


# [Note] Gluon backward selection. fagen.attention takes the gluon backward for a call with gradients where
# GluonBackend.bwd_selected picks its case (d128 bf16, mask none/causal, the switch sets of bwd_selected_switches, a
# score_mod where bwd_select_score_mods) and the problem has at least BWD_MIN_WORK pairs (BWD_WINDOW_MIN_WORK with
# a window, whose pairs count the window's keys), on sm_90. Three callers: the plain path (fagen/runtime/api.py,
# through resolve's big_bwd: the switches), the prefix-LM split (run_split's bwd_min_work: each of its two calls by
# its own pairs) and the modded path (fagen/runtime/modded.py: a score_mod without a mask_mod, dense, where no
# captured tensor requires grad; a learned bias keeps the Triton backward, whose per-tile sums give it its
# deterministic gradient). Everything else keeps the Triton backward: sm_80, other head dims and dtypes, ALiBi and
# sinks switches, a mask_mod, varlen.


def window_keys(sk: int, window) -> int:
    """Keys a row can see at most under window (left, right): None for an unbounded side. A malformed window counts
    sk: the module's own check (_check_scores, generated) then refuses it with its InputError, the one window check."""
    try:
        left, right = window
        return min(sk, (sk if left is None else left) + (sk if right is None else right) + 1)
    except (TypeError, ValueError):
        return sk


def big_backward(pairs: int, window) -> bool:
    """The Gluon backward's size rule ([Note] Gluon backward size rule): at least BWD_MIN_WORK query-key pairs,
    BWD_WINDOW_MIN_WORK with a window (its pairs counted with window_keys). fagen.attention's plain path and the
    modded path both ask it."""
    return pairs >= (BWD_MIN_WORK if window is None else BWD_WINDOW_MIN_WORK)


def unordered(module) -> bool:
    """Whether fagen.attention(deterministic=False) passes the mode on to `module`: a gluon bwd module whose case
    the rule gives unordered dQ adds (GluonBackend.unordered_selected). Others serve deterministically."""
    return hasattr(module, "backward_unordered_op") and GLUON.unordered_selected(module.MASK, module.GQA)
