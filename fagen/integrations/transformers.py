"""A "fagen" attention implementation for Hugging Face transformers, through its public attention interfaces.

    import fagen.integrations.transformers as fagen_hf
    fagen_hf.register()                                   # once per process
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fagen")

The attention function receives transformers' query/key/value ([B, H, S, D], K/V with their own KV heads: fagen
runs GQA natively) and the 2D padding mask that transformers builds for un-padded kernels (flash_attention_mask:
None when nothing is padded). Right padding maps onto fagen's `padding` / `causal+padding` masks; the model's
own causal flag and scaling are passed through, and so are the model's score modifiers: `sliding_window` (keys
within sliding_window - 1 before the query, and as many after it for a bidirectional layer), `softcap` (Gemma 2)
and `s_aux`, the per-head attention sinks (gpt-oss; cast to float32, with their gradient). A `deterministic`
keyword (transformers' flash-attention kwarg) reaches fagen.attention's (None: True). Needs `pip install "fagen[hf]"`.
"""

from __future__ import annotations

import torch

import fagen

NAME = "fagen"


class UnsupportedAttention(ValueError):
    """The model asks for something this attention implementation does not do; the message says what to change."""


def register(name: str = NAME) -> str:
    """Register the attention function and its mask builder under `name` (idempotent); returns the name."""
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import flash_attention_mask
    except ImportError as e:
        raise ImportError("fagen.integrations.transformers needs transformers: pip install 'fagen[hf]'") from e
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


def _lengths(mask: torch.Tensor, q_len: int) -> torch.Tensor:
    """Valid lengths of a right-padded 2D mask [B, S] (True/1 = token); UnsupportedAttention for other layouts."""
    mask = mask.bool()
    lens = mask.sum(-1, dtype=torch.int32)
    if mask.shape[1] != q_len:
        raise UnsupportedAttention("fagen: a padding mask with a KV cache (query length != key length) is not "
                                   "supported yet; run generation without padding, or use attn_implementation='sdpa'")
    positions = torch.arange(mask.shape[1], device=mask.device)
    if not torch.equal(mask, positions < lens[:, None]):  # one host sync: only when transformers passes padding
        raise UnsupportedAttention("fagen: padding must be on the right (tokens first, then padding), as fagen's "
                                   "seqlens contract is; set tokenizer.padding_side = 'right'")
    return lens


def _scores(kwargs: dict, causal: bool) -> dict:
    """fagen.attention's score arguments from the model's sliding_window, softcap and s_aux (sinks)."""
    scores = {}
    window = kwargs.get("sliding_window")
    if window is not None:  # transformers: key j is in query i's window iff |i - j| < sliding_window
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise UnsupportedAttention(f"fagen: sliding_window must be a positive int, got {window!r}")
        scores["window"] = (window - 1, 0 if causal else window - 1)
    if kwargs.get("softcap") is not None:
        scores["softcap"] = float(kwargs["softcap"])
    if kwargs.get("s_aux") is not None:
        scores["sinks"] = kwargs["s_aux"].float()
    return scores


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: returns (out [B, S, H, D], None)."""
    if dropout:
        raise UnsupportedAttention(f"fagen has no attention dropout (got {dropout}); set attention_dropout=0")
    if kwargs.get("output_attentions"):
        raise UnsupportedAttention("fagen does not return attention weights; use attn_implementation='eager'")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = causal and query.shape[2] > 1  # one query against its cache sees every key, as in transformers' sdpa
    lens = {}
    if attention_mask is not None:
        seqlens = _lengths(attention_mask, query.shape[2])
        lens = {"seqlens_q": seqlens, "seqlens_k": seqlens}
    mask = ("causal" if causal else "none") if not lens else ("causal+padding" if causal else "padding")
    det = kwargs.get("deterministic")
    out = fagen.attention(query, key, value, mask=mask, scale=scaling, deterministic=True if det is None else det,
                          **lens, **_scores(kwargs, causal))
    return out.transpose(1, 2).contiguous(), None
