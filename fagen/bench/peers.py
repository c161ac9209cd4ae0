"""The peers fagen is measured against: torch SDPA with one backend forced, and compiled FlexAttention."""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch
import torch.nn.functional as F

from fagen.bench.cases import CaseContext, Prepared, Unavailable, Unsupported, first_line, shorten
from fagen.bench.workloads import BenchCase
from fagen.spec.axes import Mask

SDPA_BACKENDS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION",
                 "sdpa-efficient": "EFFICIENT_ATTENTION"}
# Dynamo recompiles flex_attention for every new shape and block mask; past its recompile limit (8 by default)
# it silently runs the unfused eager path, which materialises the scores. Raise the limits, and fail loudly.
DYNAMO_LIMITS = {"recompile_limit": 1000, "cache_size_limit": 1000, "accumulated_recompile_limit": 10000,
                 "accumulated_cache_size_limit": 10000, "fail_on_recompile_limit_hit": True}


def _sdpa_mask(impl: str, case: BenchCase, cc: CaseContext) -> tuple[dict, str]:
    """SDPA keyword arguments that express the case's mask, and a note on how."""
    sq, sk = case.seq_q, case.seq_k
    if case.softcap is not None or case.alibi:
        raise Unsupported("SDPA has no score modifier: " + ("a logit softcap (tanh) cannot be expressed as a mask"
                                                             if case.softcap is not None else
                                                             "ALiBi needs a per-head float bias (not tried)"))
    if case.window is not None or case.sinks:
        if impl == "sdpa-flash":
            what = " and no ".join(["sliding window"] * (case.window is not None) + ["sinks"] * case.sinks)
            raise Unsupported(f"flash takes no mask tensor, so no {what}")
        mask = cc.dense_mask().unsqueeze(1)
        if case.sinks:
            mask = torch.cat([mask, _sink_columns(case, cc)], -1)
        what = ", ".join(["sliding window"] * (case.window is not None) + ["sinks as an extra key"] * case.sinks)
        return {"attn_mask": mask}, f"dense bool mask [B, 1, Sq, Sk{' + 16' * case.sinks}] ({what})"
    if case.mask is Mask.NONE:
        return {}, ""
    if case.mask is Mask.CAUSAL:
        if sq == sk:
            return {"is_causal": True}, ""
        from torch.nn.attention.bias import causal_lower_right  # SDPA's is_causal is top-left aligned

        return {"attn_mask": causal_lower_right(sq, sk)}, "causal_lower_right bias"
    if impl == "sdpa-flash":
        # Flash takes no mask tensor. With equal lengths per sequence, its plain causal over the padded length
        # gives every valid row exactly its keys (j <= i < len); it just cannot skip the padding.
        if case.mask is Mask.CAUSAL_PADDING and sq == sk and case.seqlens_q == case.seqlens_k:
            return {"is_causal": True}, "dense causal over the padded length (no padding skip)"
        raise Unsupported(f"flash takes no mask tensor, and {case.mask} is not plain causal")
    return {"attn_mask": cc.dense_mask().unsqueeze(1)}, "dense bool mask [B, 1, Sq, Sk]"


# [Note] Sinks through SDPA
# SDPA has no sinks. A sink is a key whose logit is sink[h] for every query of head h and whose value is zero:
# it joins the softmax denominator and adds nothing to the output. SDPA computes logits q.k, so the head
# dimension grows by SINK_DIMS: q gets sink[h] / scale in two of them (a high and a low part in q's dtype, so
# bf16 rounding does not move the sink), real keys get zeros there, and one extra key has ones there and zeros
# elsewhere. Keys grow by SINK_KEYS (one sink key, the rest masked out, to keep Sk a multiple of 16), v gets zero
# rows and columns, the output drops the extra columns, and the scale is passed explicitly. The extended
# tensors are built in every call, inside the timing: that is what a user of SDPA pays for sinks.
SINK_DIMS, SINK_KEYS = 8, 16


def _sink_columns(case: BenchCase, cc: CaseContext) -> torch.Tensor:
    """bool [B, 1, Sq, SINK_KEYS]: the sink key (column 0) is seen by every valid row, the others by none."""
    cols = torch.zeros(case.batch, 1, case.seq_q, SINK_KEYS, dtype=torch.bool, device=cc.device)
    rows = torch.arange(case.seq_q, device=cc.device).view(1, -1)
    valid = rows < (torch.tensor(case.seqlens_q, device=cc.device).view(-1, 1) if case.mask.padded else case.seq_q)
    cols[:, 0, :, 0] = valid
    return cols


def sink_extend(q, k, v, sinks):
    """(q, k, v) with the sink key and the sink dimensions of [Note] Sinks through SDPA."""
    B, Hq, Sq, D = q.shape
    Hkv = k.shape[1]
    want = (sinks.float() / D ** -0.5).view(1, Hq, 1, 1)
    hi = want.to(q.dtype)
    lo = (want - hi.float()).to(q.dtype)
    pad_q = torch.zeros(B, Hq, Sq, SINK_DIMS - 2, dtype=q.dtype, device=q.device)
    q2 = torch.cat([q, hi.expand(B, Hq, Sq, 1), lo.expand(B, Hq, Sq, 1), pad_q], -1)
    keys = torch.zeros(B, Hkv, SINK_KEYS, D + SINK_DIMS, dtype=k.dtype, device=k.device)
    keys[:, :, 0, D:D + 2] = 1
    k2 = torch.cat([torch.nn.functional.pad(k, (0, SINK_DIMS)), keys], 2)
    v2 = torch.nn.functional.pad(v, (0, SINK_DIMS, 0, SINK_KEYS))
    return q2, k2, v2


def _refusal(e: BaseException, caught: list) -> str:
    """Why SDPA refused: its warnings name the reasons ("... not used because:" heads them, then one warning per
    reason); the RuntimeError itself only says that no kernel was available."""
    reasons = []
    for w in caught:
        line = str(w.message).strip().splitlines()[0] if str(w.message).strip() else ""
        if line and not line.endswith(":") and line not in reasons:
            reasons.append(line)
    text = "; ".join(reasons[:2]) if reasons else first_line(e)
    return shorten(text, 200)


def sdpa_preparer(impl: str) -> Callable[[BenchCase, CaseContext], Prepared]:
    return functools.partial(prepare_sdpa, impl)


def prepare_sdpa(impl: str, case: BenchCase, cc: CaseContext) -> Prepared:
    """SDPA with exactly one backend allowed; a backend that refuses the case raises Unsupported.

    Variants are tried in order until the backend takes one: native GQA and a bool mask first; then an
    additive mask in q's dtype (some backends take no bool mask); then KV expanded to every query head (for
    backends without GQA). The record's note says which variant ran.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA_BACKENDS[impl])
    kwargs, note = _sdpa_mask(impl, case, cc)
    gqa = case.gqa
    mask = kwargs.get("attn_mask")
    has_bool_mask = isinstance(mask, torch.Tensor) and mask.dtype == torch.bool

    def additive():  # built only if the bool mask is refused: it costs 2 bytes per (query, key) pair
        return torch.zeros(mask.shape, dtype=cc.sets[0].q.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))

    expanded: dict[int, tuple] = {}
    sinks = case.sinks

    def variant(kw, expand):
        def fn(s):
            if sinks:  # [Note] Sinks through SDPA
                q, k, v = sink_extend(s.q, s.k, s.v, s.scores["sinks"])
                if expand:
                    k, v = k.repeat_interleave(gqa, dim=1), v.repeat_interleave(gqa, dim=1)
                gqa_kw = {"enable_gqa": True} if gqa > 1 and not expand else {}
                out = F.scaled_dot_product_attention(q, k, v, **kw, **gqa_kw, scale=case.head_dim ** -0.5)
                return out[..., :case.head_dim]
            if not expand:
                return F.scaled_dot_product_attention(s.q, s.k, s.v, **kw, **({"enable_gqa": True} if gqa > 1 else {}))
            if id(s.k) not in expanded:  # KV heads repeated gqa times, made once per input set
                expanded[id(s.k)] = (s.k.repeat_interleave(gqa, dim=1), s.v.repeat_interleave(gqa, dim=1))
            k, v = expanded[id(s.k)]
            return F.scaled_dot_product_attention(s.q, k, v, **kw)
        return fn

    def probe(fn):
        with sdpa_kernel(backend), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with torch.no_grad():
                    fn(cc.sets[0])
                return None
            except torch.cuda.OutOfMemoryError:
                raise
            except (RuntimeError, ValueError, NotImplementedError) as e:
                return _refusal(e, caught)

    first_why = None
    for use_additive in (False, True):
        if use_additive and not has_bool_mask:
            continue
        kw = {**kwargs, "attn_mask": additive()} if use_additive else kwargs
        for expand in (False, True) if gqa > 1 else (False,):
            why = probe(fn := variant(kw, expand))
            if why is None:
                extra = ["additive mask in q's dtype"] * use_additive + ["KV expanded to all query heads"] * expand
                return Prepared(fn, context=lambda: sdpa_kernel(backend), note="; ".join([note] * bool(note) + extra))
            expanded.clear()
            first_why = first_why or why
    raise Unsupported(first_why)


def configure_dynamo() -> None:
    import torch._dynamo.config as dynamo_config

    for name, value in DYNAMO_LIMITS.items():
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, value)
    # The bench times the backward alone by calling it again on a kept graph (retain_graph=True); AOTAutograd's
    # donated buffers forbid that ("compiled with non-empty donated buffers ... retain_graph=False").
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "donated_buffer"):
        functorch_config.donated_buffer = False


def flex_mask_mod(case: BenchCase, cc: CaseContext):
    """(mask_mod, batch dim of the block mask) equivalent to the fagen contract, window included; (None, None)
    for no mask."""
    base, batch = _flex_base_mask(case, cc)
    if case.window is None or case.mask is Mask.TREE:  # the tree's dense lookup holds the window already
        return base, batch
    left, right = case.window
    aligned, padded_batch = _flex_aligned(case, cc)

    def windowed(b, h, q_idx, kv_idx):
        a = aligned(b, q_idx)
        ok = (kv_idx >= a - left) if left is not None else (kv_idx <= a + right)
        if left is not None and right is not None:
            ok = ok & (kv_idx <= a + right)
        return ok & base(b, h, q_idx, kv_idx) if base is not None else ok

    if left is None and right is None:
        return base, batch
    return windowed, batch if batch is not None else padded_batch


def _flex_aligned(case: BenchCase, cc: CaseContext):
    """(aligned(b, q_idx) = q_idx + Sk - Sq of its sequence, batch dim the block mask needs for it)."""
    if case.mask.padded:
        lq = torch.tensor(case.seqlens_q, dtype=torch.int64, device=cc.device)
        lk = torch.tensor(case.seqlens_k, dtype=torch.int64, device=cc.device)
        return (lambda b, q_idx: q_idx + lk[b] - lq[b]), case.batch
    shift = case.seq_k - case.seq_q
    return (lambda b, q_idx: q_idx + shift), None


def flex_score_mod(case: BenchCase, cc: CaseContext):
    """score_mod for the softcap and ALiBi (after flex's scale, in FlashAttention-2's order), or None."""
    cap = case.softcap
    slopes = s_alibi = None
    if case.alibi:
        slopes = cc.sets[0].scores["alibi_slopes"]
        s_alibi, _ = _flex_aligned(case, cc)
    if cap is None and slopes is None:
        return None

    def score_mod(score, b, h, q_idx, kv_idx):
        if cap is not None:
            score = cap * torch.tanh(score / cap)
        if slopes is not None:
            score = score - slopes[h] * (kv_idx - s_alibi(b, q_idx)).abs()
        return score

    return score_mod


def _flex_base_mask(case: BenchCase, cc: CaseContext):
    device = cc.device
    if case.mask is Mask.NONE:
        return None, None
    if case.mask is Mask.CAUSAL:
        shift = case.seq_k - case.seq_q  # bottom-right aligned

        def causal(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + shift

        return causal, None
    if case.mask.padded:
        lq = torch.tensor(case.seqlens_q, dtype=torch.int64, device=device)
        lk = torch.tensor(case.seqlens_k, dtype=torch.int64, device=device)
        causal = case.mask.causal

        def padded(b, h, q_idx, kv_idx):
            ok = (q_idx < lq[b]) & (kv_idx < lk[b])
            if causal:
                ok = ok & (kv_idx <= q_idx + lk[b] - lq[b])
            return ok

        return padded, case.batch
    dense = cc.dense_mask()  # tree: the visibility mask [B, Sq, Sk] looked up per element

    def tree(b, h, q_idx, kv_idx):
        return dense[b, q_idx, kv_idx]

    return tree, case.batch


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    configure_dynamo()
    return torch.compile(flex_attention, dynamic=False)


def flex_callable(case: BenchCase, cc: CaseContext, compiled: bool = True):
    """fn(input set) -> out through FlexAttention with the case's block mask (eager when compiled=False)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask_mod, batch = flex_mask_mod(case, cc)
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, batch, None, case.seq_q, case.seq_k, device=cc.device)
    score_mod = flex_score_mod(case, cc)
    gqa = case.gqa > 1
    if not case.sinks:
        attend = _compiled_flex() if compiled else flex_attention

        def fn(s):
            return attend(s.q, s.k, s.v, block_mask=block_mask, score_mod=score_mod, enable_gqa=gqa)

        return fn

    # Sinks: flex returns lse (natural log); a sink s joins each row's denominator, so the output is scaled by
    # exp(lse) / (exp(lse) + exp(s)) = sigmoid(lse - s). Rows that see no key (lse = -inf) stay zero.
    def with_sinks(q, k, v, sinks):
        out, lse = flex_attention(q, k, v, block_mask=block_mask, score_mod=score_mod, enable_gqa=gqa,
                                  return_lse=True)
        return (out.float() * torch.sigmoid(lse - sinks.view(1, -1, 1)).unsqueeze(-1)).to(out.dtype)

    if compiled:
        configure_dynamo()
        with_sinks = torch.compile(with_sinks, dynamic=False)
    return lambda s: with_sinks(s.q, s.k, s.v, s.scores["sinks"])


def prepare_flex(case: BenchCase, cc: CaseContext) -> Prepared:
    """torch.compile'd flex_attention; the block mask is built once, outside the timing."""
    if cc.device.type != "cuda":
        raise Unavailable("compiled FlexAttention needs CUDA (its eager CPU path is unfused and not a peer)")
    try:
        fn = flex_callable(case, cc)
    except ImportError as e:
        raise Unavailable(f"torch has no FlexAttention: {e}") from None
    notes = ["block mask"] * (case.mask is not Mask.NONE or case.window is not None)
    notes += ["score_mod"] * (case.softcap is not None or case.alibi) + ["sinks via its lse"] * case.sinks
    return Prepared(fn, note=", ".join(notes))
