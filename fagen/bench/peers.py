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

    def variant(kw, expand):
        def fn(s):
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
    """(mask_mod, batch dim of the block mask) equivalent to the fagen contract; (None, None) for no mask."""
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
    attend = _compiled_flex() if compiled else flex_attention
    gqa = case.gqa > 1

    def fn(s):
        return attend(s.q, s.k, s.v, block_mask=block_mask, enable_gqa=gqa)

    return fn


def prepare_flex(case: BenchCase, cc: CaseContext) -> Prepared:
    """torch.compile'd flex_attention; the block mask is built once, outside the timing."""
    if cc.device.type != "cuda":
        raise Unavailable("compiled FlexAttention needs CUDA (its eager CPU path is unfused and not a peer)")
    try:
        fn = flex_callable(case, cc)
    except ImportError as e:
        raise Unavailable(f"torch has no FlexAttention: {e}") from None
    return Prepared(fn, note="block mask" if case.mask is not Mask.NONE else "")
