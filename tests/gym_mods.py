"""attention-gym's example mods, written out from attn_gym/mods and attn_gym/masks (pytorch-labs/attention-gym
at 14fd5f4) so the tests need no install of it; the bodies are theirs, the comments say where each comes from."""

import torch
from torch.nn.attention.flex_attention import and_masks, or_masks


def causal_mask(b, h, q_idx, kv_idx):  # attn_gym/masks/causal.py
    return q_idx >= kv_idx


def generate_alibi_bias(H):  # attn_gym/mods/alibi.py
    def alibi_mod(score, b, h, q_idx, kv_idx):
        scale = torch.exp2(-((h + 1) * 8.0 / H))
        bias = (kv_idx - q_idx) * scale
        return score + bias

    return alibi_mod


def generate_tanh_softcap(soft_cap):  # attn_gym/mods/softcapping.py (approx=False)
    def tanh_softcap(score, b, h, q_idx, kv_idx):
        return soft_cap * torch.tanh(score / soft_cap)

    return tanh_softcap


def generate_sliding_window(window_size):  # attn_gym/masks/sliding_window.py
    def sliding_window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= window_size

    return and_masks(sliding_window, causal_mask)


def generate_prefix_lm_mask(prefix_length):  # attn_gym/masks/prefix_lm.py
    def prefix_mask(b, h, q_idx, kv_idx):
        return kv_idx < prefix_length

    return or_masks(prefix_mask, causal_mask)


def _offsets_to_doc_ids_tensor(offsets):  # attn_gym/masks/document_mask.py
    counts = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(len(counts), device=offsets.device, dtype=torch.int32), counts)


def length_to_offsets(lengths, device):
    offsets = [0]
    offsets.extend(lengths)
    offsets = torch.tensor(offsets, device=device, dtype=torch.int32)
    return torch.cumsum(offsets, dim=-1)


def generate_doc_mask_mod(mask_mod, offsets):
    document_id = _offsets_to_doc_ids_tensor(offsets)

    def doc_mask_mod(b, h, q_idx, kv_idx):
        same_doc = document_id[q_idx] == document_id[kv_idx]
        q_logical = q_idx - offsets[document_id[q_idx]]
        kv_logical = kv_idx - offsets[document_id[kv_idx]]
        inner_mask = mask_mod(b, h, q_logical, kv_logical)
        return same_doc & inner_mask

    return doc_mask_mod


def generate_dilated_sliding_window(window_size, dilation):  # attn_gym/masks/dilated_sliding_window.py
    def dilated_sliding_window(b, h, q_idx, kv_idx):
        diff = torch.abs(q_idx - kv_idx)
        in_window = diff <= window_size
        is_dilated = (diff % dilation) == 0
        return in_window & is_dilated

    return dilated_sliding_window


# Not in attention-gym's modules; the two score_mods of FlexAttention's documentation and blog post.
def generate_relative_bias(rel_bias, max_len):
    """Relative-position bias: a learned [H, 2 * max_len - 1] table read at q_idx - kv_idx."""
    def rel_bias_mod(score, b, h, q_idx, kv_idx):
        return score + rel_bias[h, q_idx - kv_idx + max_len - 1]

    return rel_bias_mod


def generate_learned_bias(bias):
    """A learned [B, H, Sq, Sk]-indexed bias (FlexAttention's "bias" example), read at every element."""
    def bias_mod(score, b, h, q_idx, kv_idx):
        return score + bias[b, h, q_idx, kv_idx]

    return bias_mod


def generate_natten(canvas_w, canvas_h, kernel_w, kernel_h):  # attn_gym/masks/natten.py
    def get_x_y(idx):
        return idx // canvas_w, idx % canvas_w

    def natten_mask_mod(b, h, q_idx, kv_idx):
        q_x, q_y = get_x_y(q_idx)
        kv_x, kv_y = get_x_y(kv_idx)
        kernel_center_x = q_x.clamp(kernel_w // 2, (canvas_w - 1) - kernel_w // 2)
        kernel_center_y = q_y.clamp(kernel_h // 2, (canvas_h - 1) - kernel_h // 2)
        hori_mask = (kernel_center_x - kv_x).abs() <= kernel_w // 2
        vert_mask = (kernel_center_y - kv_y).abs() <= kernel_h // 2
        return hori_mask & vert_mask

    return natten_mask_mod


def generate_vision_cross_attention_mask_mod(intervals, image_token_length):  # attn_gym/masks/flamingo.py
    num_images = intervals.shape[0]
    image_boundaries = torch.repeat_interleave(
        torch.arange(num_images, device=intervals.device), repeats=image_token_length
    )

    def vision_cross_attention_mask_mod(b, h, q_idx, kv_idx):
        image_idx = image_boundaries[kv_idx]
        interval = intervals[image_idx]
        return (q_idx >= interval[0]) & (q_idx < interval[1])

    return vision_cross_attention_mask_mod
