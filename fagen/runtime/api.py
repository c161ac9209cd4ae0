"""fagen.attention: differentiable attention that picks, renders, caches and runs the kernel matching its inputs."""

from __future__ import annotations

import functools
import sys

import torch

from fagen.codegen.args import SWITCH_KEYWORD
from fagen.runtime import hopper
from fagen.runtime.hopper import MIN_WORK, WINDOW_MIN_WORK, big_backward, unordered
from fagen.runtime.hopper import window_keys as _window_keys
from fagen.runtime.kinds import prefers_decode
from fagen.runtime.resolve import _DTYPES, _FAST, AttentionError, _module, fast_key, resolve, resolve_varlen, spec_for
from fagen.spec.axes import DECODE_BATCH_INVARIANT, DECODE_MAX_SEQ_Q, Kind, Layout, Mask
from fagen.spec.kernel import SCORE_SWITCHES, KernelSpec, SpecError


def attention(q, k, v, *, mask: Mask | str = "none", scale: float | None = None, seqlens_q=None, seqlens_k=None,
              tree_mask=None, window=None, softcap: float | None = None, alibi_slopes=None, sinks=None,
              cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
              score_mod=None, mask_mod=None, block_mask=None, check: bool | None = None,
              batch_invariant: bool = DECODE_BATCH_INVARIANT, head_dim_v: int | None = None,
              deterministic: bool = True, block_table=None, k_scale=None) -> torch.Tensor:
    """Attention over q [B, Hq, Sq, D], k and v [B, Hkv, Sk, D]; returns out like q, differentiable.

    The kernel is chosen from the inputs (dtype, head_dim D, gqa = Hq / Hkv) and `mask`, rendered and loaded once
    per process (then cached on disk). Masks and their inputs follow the generated kernels' contract:
    "causal" is bottom-right aligned, "padding"/"causal+padding" take seqlens_q and seqlens_k (int [B]),
    "tree" takes tree_mask (bool [B, Sq, Sq] ancestor-or-self, or int parent pointers [B, Sq]). Index inputs are
    int32 or int64 (README "Index dtypes").
    check=True also validates the values of those inputs (a host sync; see the README).
    Score modifiers (README "Score modifiers"), each picking a kernel with that switch: window=(left, right) (ints,
    None for an unbounded side; (w, 0) with "causal" is the usual sliding window), softcap (cap * tanh(s / cap)),
    alibi_slopes (float32 [Hq]) and sinks (float32 [Hq] logits; sinks.grad is filled when it requires grad).

    Packed sequences (README "Layouts", varlen): q [total_q, Hq, D], k and v [total_k, Hkv, D] with cu_seqlens_q and
    cu_seqlens_k (int [B + 1] prefix sums) and max_seqlen_q / max_seqlen_k (host ints); mask "none" or "causal"
    (per sequence, bottom-right aligned); out is like q. Called eagerly; under torch.compile call the varlen
    module's attention() (fagen.load(spec)), which traces as its own operators.

    User mods (README "User mods"): score_mod(score, b, h, q_idx, kv_idx) -> score and mask_mod(b, h, q_idx,
    kv_idx) -> bool, FlexAttention's signatures, traced once into a kernel of their own; closure numbers are
    runtime arguments and captured tensors typed kernel arguments. block_mask (fagen.create_block_mask of the
    same mask_mod) lets the kernels skip hidden blocks and skip the mask on blocks it shows entirely.

    Without gradients, a few queries against a long KV cache (fagen.runtime.kinds.prefers_decode) run the split-KV
    decode kernel; both kinds give the same results. v's head dim may differ from q's (MLA's 192/128): out takes
    v's. batch_invariant=True: each sequence's result is the same bits alone and in any batch (README "Serving");
    False (the default, fagen.spec.axes.DECODE_BATCH_INVARIANT): the batch-dependent split rule, faster at some
    shapes. It reaches the decode kernel only (prefill kernels are batch-invariant anyway). Under torch.compile the
    call traces into the module's own operators and autograd (fagen/runtime/ops.py), with no graph break; the
    decode operators carry the mode.

    deterministic=True (the default): gradients are bitwise repeatable. False allows the Hopper backward's unordered
    dQ adds where they are faster (README "Deterministic gradients"); every other backward is deterministic anyway.

    v=None with head_dim_v (README "MLA absorbed decode"): k is one shared latent cache [B, Hkv, Sk, D] and V is its
    first head_dim_v columns, read once (MLA's absorbed decode, d 576 / d_v 512); 1 to 16 queries, no gradient,
    the shared_kv decode kernel, out [B, Hq, Sq, head_dim_v]. Called eagerly (a graph break under torch.compile).
    Paged: k is [num_pages, page_size, Hkv, D] with block_table (int [B, max_pages]) and seqlens_k (int [B]). The
    cache may be fp8 e4m3 (torch.float8_e4m3fn, q bf16/fp16) with one scale for K and V, k_scale: a float (per
    tensor), a float32 [Hkv] (per KV head) or float32 [num_pages, page_size, Hkv] (paged) / [B, Hkv, Sk] (dense),
    one a cached row (per token); the Gluon fp8 latent decode serves it on sm_90 where selected, else the Triton
    decode (README "MLA absorbed decode").
    """
    if deterministic is not True and deterministic is not False:
        raise AttentionError(f"deterministic: expected True or False, got {deterministic!r}")
    if v is None:
        return _eager_only(_latent)(q, k, mask=mask, scale=scale, seqlens_q=seqlens_q, seqlens_k=seqlens_k,
                                    tree_mask=tree_mask, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                                    sinks=sinks, check=check, batch_invariant=batch_invariant, head_dim_v=head_dim_v,
                                    block_table=block_table, k_scale=k_scale)
    for name, value in (("block_table", block_table), ("k_scale", k_scale)):
        if value is not None:
            raise AttentionError(f"{name}: fagen.attention takes a paged or fp8 cache for the shared latent decode "
                                 "only (v=None with head_dim_v: README \"MLA absorbed decode\"); for other caches "
                                 "call a decode module's forward (fagen.load(spec))")
    if head_dim_v is not None:
        raise AttentionError("head_dim_v: it names V's columns of a shared latent cache, with v=None; with a v "
                             "tensor, out takes v's head dim: drop head_dim_v")
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        spec_for(q, k, v, mask=mask, layout=Layout.VARLEN if varlen else Layout.DENSE)  # raises, naming the input
    if score_mod is not None or mask_mod is not None or block_mask is not None:
        packed = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k) if varlen else None
        plain = None if torch.compiler.is_compiling() else _as_switches(
            q, k, v, mask, score_mod, mask_mod, block_mask, window, softcap, alibi_slopes, sinks, seqlens_q,
            seqlens_k, packed)
        if type(plain) is not tuple:  # None, or the Mods it prepared (a NamedTuple), which the modded path reuses
            return _eager_only(_modded)(
                q, k, v, mask=mask, scale=scale, seqlens_q=seqlens_q, seqlens_k=seqlens_k, tree_mask=tree_mask,
                window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, score_mod=score_mod,
                mask_mod=mask_mod, block_mask=block_mask, check=check, packed=packed, prepared=plain,
                deterministic=deterministic)
        mask, window, softcap, alibi_slopes, split = plain  # the mods were built-in switches: their call's path
        if split is not None:  # switch calls on views (fagen/mods/split.py: dilated windows, prefix rows, documents)
            if split[0] == "document" and window is softcap is alibi_slopes is sinks is None \
                    and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
                return _document_forward(q, k, v, split[1], scale, check)  # [Note] Document forward's host path
            from fagen.mods.split import run_split

            return run_split(split, attention, q, k, v, mask=mask, scale=scale, window=window, softcap=softcap,
                             check=check, resolve=resolve, bwd_min_work=hopper.BWD_MIN_WORK)  # [Note] Split calls' backward
    if window is None and softcap is None and alibi_slopes is None and sinks is None:  # the common call
        switches, scores = (), _NO_SCORES
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    else:
        scores = {name: value for name, value in zip(_SCORE_ARGS, (window, softcap, alibi_slopes, sinks))
                  if value is not None}
        switches = tuple(name for name, arg in zip(SCORE_SWITCHES, _SCORE_ARGS) if arg in scores)
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                                  or (isinstance(sinks, torch.Tensor) and sinks.requires_grad))
    if varlen:
        if seqlens_q is not None or seqlens_k is not None or tree_mask is not None:
            given = [n for n, t in (("seqlens_q", seqlens_q), ("seqlens_k", seqlens_k), ("tree_mask", tree_mask))
                     if t is not None]
            raise AttentionError(f"{', '.join(given)}: packed sequences (cu_seqlens_q/cu_seqlens_k) carry their own "
                                 "lengths and take mask 'none' or 'causal'; drop " + " and ".join(given))
        return _varlen(q, k, v, mask, scale, scores, switches, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                       max_seqlen_k, check)
    qs, ks = q.shape, k.shape
    four = len(qs) == 4 and len(ks) == 4
    decode = not needs_grad and four and prefers_decode(qs[2], ks[2])
    if torch.compiler.is_compiling():
        from fagen.runtime import ops  # [Note] Dynamo on demand

        win = None if window is None else _op_window(window)
        if window is not None and win is None:  # the operator cannot carry it: run eagerly into the module's check
            return _eager_only(attention)(q, k, v, mask=mask, scale=scale, seqlens_q=seqlens_q,
                                          seqlens_k=seqlens_k, tree_mask=tree_mask, window=window, softcap=softcap,
                                          alibi_slopes=alibi_slopes, sinks=sinks, check=check)
        # [Note] Gluon backward under torch.compile: the size rule below, as a guard on the traced shapes
        big_bwd = True if needs_grad and four and window is None and big_backward(qs[0] * qs[1] * qs[2] * ks[2], None) \
            else False  # a branch: a constant, under a guard on the (maybe symbolic) sizes
        return ops.attention(q, k, v, str(mask), scale, seqlens_q, seqlens_k, tree_mask, decode, win, softcap,
                             alibi_slopes, sinks, batch_invariant, big_bwd, deterministic)[0]
    # [Note] Host time. A warm call costs one dict lookup on plain values before the module's own checks and launch:
    # no spec is built, hashed or validated per call (the key is fast_key's, the one resolve() stores under). Without gradients on an
    # H100/H200 the Gluon forward may serve ([Note] Hopper selection in fagen/runtime/hopper.py); it has forward()
    # only, and its host path costs more, so only problems of at least hopper.MIN_WORK query-key pairs may take it
    # ([Note] Gluon size rule). A window bounds the keys a row visits: its pairs count, not Sq x Sk, against
    # hopper.WINDOW_MIN_WORK.
    keys = ks[2] if four and window is None else _window_keys(ks[2], window) if four else 0
    # With gradients the same holds for the gluon bwd module, from hopper.BWD_MIN_WORK pairs (big_bwd).
    pairs = qs[0] * qs[1] * qs[2] * keys if four else 0
    forward_only = not needs_grad and not decode and four \
        and pairs >= (MIN_WORK if window is None else min(MIN_WORK, WINDOW_MIN_WORK))
    big_bwd = needs_grad and four and big_backward(pairs, window)
    if big_bwd and deterministic is False:  # the rule's unordered-only switch sets ([Note] Gluon backward selection)
        big_bwd = 2
    module = _FAST.get(fast_key(q, k, v, mask, decode, switches, forward_only, big_bwd)) \
        if four and isinstance(mask, str) else None
    if module is None:
        module = resolve(q, k, v, mask, decode, switches, forward_only, big_bwd)
    if not needs_grad:  # no autograd node to build: the forward alone (prefill, decode, or the Gluon forward)
        if decode and batch_invariant is not DECODE_BATCH_INVARIANT:  # the module's forward checks the value
            return module.forward(q, k, v, scale=scale, seqlens_q=seqlens_q, seqlens_k=seqlens_k,
                                  tree_mask=tree_mask, check=check, batch_invariant=batch_invariant, **scores)[0]
        if scores or scale is not None or seqlens_q is not None or seqlens_k is not None or tree_mask is not None \
                or check is not None:
            return module.forward(q, k, v, scale=scale, seqlens_q=seqlens_q, seqlens_k=seqlens_k,
                                  tree_mask=tree_mask, check=check, **scores)[0]
        return module.forward(q, k, v)[0]  # the plainest call: no keyword to pass
    if deterministic is False and unordered(module):  # the gluon backward's unordered dQ adds, where they won
        return module.attention(q, k, v, scale=scale, seqlens_q=seqlens_q, seqlens_k=seqlens_k,
                                tree_mask=tree_mask, check=check, deterministic=False, **scores)
    return module.attention(q, k, v, scale=scale, seqlens_q=seqlens_q, seqlens_k=seqlens_k, tree_mask=tree_mask,
                            check=check, **scores)


# [Note] Dynamo on demand. torch.compiler.disable imports torch._dynamo (about 1 s of a process's start, more than a
# warm call of a new mod costs), so nothing here applies it at import: _eager_only(fn) is fn itself while
# torch._dynamo is not imported (no torch.compile can be tracing or running then), and fn's disable wrapper,
# made once, as soon as it is. Dynamo traces _eager_only like any function (a dict lookup; the first time also the
# disable call) and then breaks the graph at the wrapper, as a decorated function did. The operators of traced calls
# (fagen/runtime/ops.py) are imported in the branch that only a trace takes. tests/test_cold.py checks that
# fagen.attention imports no Dynamo, and that a traced mods call still runs eagerly behind one graph break.
_DISABLED: dict = {}


def _eager_only(fn):
    """fn, or its torch.compiler.disable wrapper once torch._dynamo is imported ([Note] Dynamo on demand)."""
    if "torch._dynamo" not in sys.modules:
        return fn
    wrapper = _DISABLED.get(fn)
    if wrapper is None:
        wrapper = _DISABLED[fn] = torch.compiler.disable(fn)
    return wrapper


# _latent (the shared latent decode has no custom operator) and _modded (tracing the user's functions is host work)
# run eagerly through _eager_only: a graph break under torch.compile.
def _latent(q, k, *, mask, head_dim_v, window, softcap, alibi_slopes, sinks, block_table, k_scale, **rest):
    """fagen.attention(q, k, None, head_dim_v=...): the shared_kv decode module's forward (README "MLA absorbed
    decode"), dense or paged (block_table), the cache q's dtype or fp8 e4m3 (with k_scale)."""
    if head_dim_v is None:
        raise AttentionError("v=None reads V from the k cache (a shared latent cache, MLA's absorbed decode): pass "
                             "head_dim_v, V's columns (for example 512 with head_dim 576)")
    if isinstance(head_dim_v, bool) or not isinstance(head_dim_v, int):
        raise AttentionError(f"head_dim_v: expected an int, got {head_dim_v!r}")
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise AttentionError(f"{name}: expected a 4-dim torch.Tensor [batch, heads, seq, head_dim], got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    paged = block_table is not None
    hkv = k.shape[2] if paged else k.shape[1]
    kv_dtype = _latent_kv(q, k, k_scale)
    if (kv_dtype is None and k.dtype != q.dtype) or k.shape[-1] != q.shape[-1] or hkv == 0 or q.shape[1] % hkv:
        raise AttentionError(f"q {q.dtype} {tuple(q.shape)} and the latent cache k {k.dtype} {tuple(k.shape)} need "
                             "one dtype (or an fp8 e4m3 cache), one head dim, and q heads a multiple of k's ("
                             + ("[num_pages, page_size, Hkv, D] with block_table)" if paged else "[B, Hkv, Sk, D])"))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        raise AttentionError("v=None (a shared latent cache) runs the decode kernel, which has no backward: call it "
                             "under torch.no_grad(), or pass v")
    if not 1 <= q.shape[2] <= DECODE_MAX_SEQ_Q:
        raise AttentionError(f"v=None (a shared latent cache) serves decode steps of 1 to {DECODE_MAX_SEQ_Q} "
                             f"queries, got {q.shape[2]}")
    scores = {name: value for name, value in zip(_SCORE_ARGS, (window, softcap, alibi_slopes, sinks))
              if value is not None}
    switches = tuple(name for name, arg in zip(SCORE_SWITCHES, _SCORE_ARGS) if arg in scores)
    if paged:
        rest = _paged_keywords(block_table, rest)
    if kv_dtype is not None:
        rest["k_scale"] = k_scale
    try:
        spec = _latent_spec(q.shape[-1], head_dim_v, mask, q.shape[1] // hkv, _DTYPES.get(q.dtype, str(q.dtype)),
                            switches, Layout.PAGED if paged else Layout.DENSE, kv_dtype)
    except SpecError as e:
        raise AttentionError(f"no kernel for these inputs: {e}") from None
    module = _module(spec)
    span = k.shape[2] if not paged else block_table.shape[-1] * k.shape[1] if isinstance(
        block_table, torch.Tensor) and block_table.dim() == 2 else 0  # keys a row (a bad table: the module names it)
    work = q.shape[0] * q.shape[1] * q.shape[2] * span
    # [Note] Latent decode and batch invariance: the size floors weigh the batch (and a graph's capture), so with
    # batch_invariant=True the kernel follows the case only (the gluon decode wherever it fits): a sequence alone and
    # in a batch of any size then runs the same kernel, whose own rule keeps its bits.
    twin = hopper.latent_decode_spec(spec, q.device, q.shape[1] * q.shape[2]) if rest.get("batch_invariant") or \
        work >= hopper.LATENT_MIN_WORK or (
        hopper.LATENT_CAPTURED_MIN_WORK is not None and work >= hopper.LATENT_CAPTURED_MIN_WORK and q.is_cuda
        and torch.cuda.is_current_stream_capturing()) else None  # [Note] Latent decode under capture
    if twin is not None and (gluon := _module(twin)).fits(q, k) is None:  # [Note] Hopper selection: MLA decode
        module = gluon
    return module.forward(q, k, None, **rest, **scores)[0]
_NO_SCORES: dict = {}


def _latent_kv(q, k, k_scale):
    """The spec's kv_dtype of a latent cache k: None for q's dtype (then k_scale must be None), "fp8_e4m3" for
    torch.float8_e4m3fn (the module checks k_scale's form)."""
    if k.dtype == torch.float8_e4m3fn and q.dtype in (torch.bfloat16, torch.float16):
        return "fp8_e4m3"
    if k.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise AttentionError(f"k: an fp8 latent cache is float8_e4m3fn (e4m3) with a bf16 or fp16 q, got k "
                             f"{k.dtype} with q {q.dtype}")
    if k_scale is not None:
        raise AttentionError(f"k_scale: only an fp8 latent cache (k float8_e4m3fn) takes a scale, k is {k.dtype}; "
                             "drop k_scale")
    return None


def _paged_keywords(block_table, rest):
    """A paged latent call's module keywords: block_table and seqlens_k (required); seqlens_q is the dense form's."""
    if rest.get("seqlens_k") is None:
        raise AttentionError("seqlens_k: a paged latent cache (block_table) needs seqlens_k, each sequence's key "
                             "count (int [B])")
    if rest.get("seqlens_q") is not None:
        raise AttentionError("seqlens_q: a paged latent cache reads seqlens_k only (masks none, causal and tree)")
    rest = {name: value for name, value in rest.items() if name != "seqlens_q"}
    if rest.get("tree_mask") is None:
        rest.pop("tree_mask", None)
    return {**rest, "block_table": block_table}


@functools.lru_cache(maxsize=256)
def _latent_spec(head_dim, head_dim_v, mask, gqa, dtype, switches, layout=Layout.DENSE, kv_dtype=None) -> KernelSpec:
    """The shared latent decode's (Triton) spec of a case, built once: a KernelSpec's validation is 30-100 us of
    host time, as much as the rest of a small decode step's host path (docs/serving.md, "MLA decode, tenth
    session"). A SpecError is raised, not kept."""
    return KernelSpec(head_dim=head_dim, head_dim_v=head_dim_v, shared_kv=True, kind=Kind.DECODE, mask=mask,
                      gqa=gqa, dtype=dtype, layout=layout, kv_dtype=kv_dtype, **{name: True for name in switches})


_SCORE_ARGS = tuple(SWITCH_KEYWORD[name] for name in SCORE_SWITCHES)  # the public keyword of each switch


def _modded(q, k, v, *, window, softcap, alibi_slopes, sinks, packed, deterministic=True, **rest):
    """The path of calls with user mods (fagen/runtime/modded.py): the bwd module of the mods' spec, dense or varlen
    (packed: the varlen keywords)."""
    from fagen.runtime import modded

    if packed is not None:
        if None in packed.values():
            raise AttentionError("varlen: pass cu_seqlens_q, cu_seqlens_k, max_seqlen_q and max_seqlen_k together "
                                 "(README \"Layouts\")")
        given = [n for n in ("seqlens_q", "seqlens_k", "tree_mask") if rest[n] is not None]
        if given:
            raise AttentionError(f"{', '.join(given)}: packed sequences (cu_seqlens_q/cu_seqlens_k) carry their own "
                                 "lengths and take mask 'none' or 'causal'; drop " + " and ".join(given))
    spec_for(q, k, v, mask=rest["mask"], layout=Layout.DENSE if packed is None else Layout.VARLEN)  # inputs' errors
    scores = {name: value for name, value in zip(_SCORE_ARGS, (window, softcap, alibi_slopes, sinks))
              if value is not None}
    switches = tuple(name for name, arg in zip(SCORE_SWITCHES, _SCORE_ARGS) if arg in scores)
    out = modded.attention(q, k, v, scores=scores, switches=switches, packed=packed, deterministic=deterministic,
                           **rest)
    if type(out) is modded.Plain:  # the mods were exactly built-in switches (fagen/mods/lower.py): run those
        return attention(q, k, v, deterministic=deterministic, **out.kwargs)
    return out


def _as_switches(q, k, v, mask, score_mod, mask_mod, block_mask, window, softcap, alibi_slopes, sinks, seqlens_q,
                 seqlens_k, packed):
    """(mask, window, softcap, alibi_slopes) when the mods are all built-in switches (fagen/mods/lower.py), else
    the call's Mods where it prepared them (the modded path takes them: one trace-cache lookup per call), or None."""
    from fagen.runtime import modded

    scores = {name: value for name, value in zip(_SCORE_ARGS, (window, softcap, alibi_slopes, sinks))
              if value is not None}
    got = modded.as_switches(q, k, v, mask, score_mod, mask_mod, block_mask, scores, seqlens_q, seqlens_k, packed)
    if got is None or type(got) is modded.Mods:
        return got
    new_mask, scores, split = got
    return new_mask, scores.get("window"), scores.get("softcap"), scores.get("alibi_slopes"), split


# [Note] Document forward's host path. The document split ([Note] Documents in fagen/mods/split.py) runs one varlen
# kernel of ~0.18 ms at the mods bench's document row (B1 H16 S8192 d128, six documents), and its host path
# (the trace guard, the lowering, then fagen.attention again on the [S, H, D] views, the varlen module's
# attention() through its autograd.Function, its checks and views) cost 125-385 us a call on the H100 host
# (thirteenth session, round A): about as long as the bench's L2 flush between two timed calls (256 MB zeroed, ~0.09
# ms), so do_bench read the host path, not the kernel, by as much as it overran the flush: 178-361 us for a kernel
# of 177 us by torch.profiler, by the process's state (the suite's 161 TF/s against 270 alone; see docs/mods.md,
# "The document row in the suite (thirteenth session)"). Without gradients the split's call goes straight to the
# varlen module's launch_forward(): no second pass through fagen.attention, no autograd node, and no read of the
# runs, which are ours (int32 on q's device, T[:S]'s bounds), unless the call asks check=True (then the module's
# forward() reads them); with gradients, the split's path (run_split and the module's autograd Function). Same
# kernel, same bits (tests/test_mods_split.py); docs/mods.md, "The document path's host entry (fourteenth session)".


def _document_forward(q, k, v, runs, scale, check):
    """out [1, H, S, D] of the document split without gradients: the varlen causal module's launch on the views
    [S, H, D], cu_seqlens = the runs' bounds ([Note] Document forward's host path)."""
    cu, longest = runs
    q, k, v = q.squeeze(0).transpose(0, 1), k.squeeze(0).transpose(0, 1), v.squeeze(0).transpose(0, 1)
    module = resolve_varlen(q, k, v, "causal")
    if check:  # the call asked for the device reads: forward() reads the runs too
        out = module.forward(q, k, v, scale=scale, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                             max_seqlen_k=longest, check=True)[0]
    else:
        out = module.launch_forward(q, k, v, scale=scale, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                    max_seqlen_k=longest)[0]
    return out.transpose(0, 1).unsqueeze(0)


def _varlen(q, k, v, mask, scale, scores, switches, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check):
    """fagen.attention on packed sequences: the varlen bwd module of these inputs (differentiable)."""
    if cu_seqlens_q is None or cu_seqlens_k is None or max_seqlen_q is None or max_seqlen_k is None:
        raise AttentionError("varlen: pass cu_seqlens_q, cu_seqlens_k, max_seqlen_q and max_seqlen_k together "
                             "(README \"Layouts\")")
    module = resolve_varlen(q, k, v, mask, switches)
    return module.attention(q, k, v, scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, check=check, **scores)


__all__ = ["attention", "spec_for", "AttentionError"]


def _op_window(window) -> list[int] | None:
    """The traced call's form of a window (fagen/runtime/ops.py), [left, right] with -1 for an unbounded side; None
    where that form cannot carry it: the call then runs eagerly, where the module's check names what is wrong."""
    if isinstance(window, (tuple, list)) and len(window) == 2 \
            and all(w is None or (type(w) is int and w >= 0) for w in window):
        return [-1 if w is None else w for w in window]
    return None
