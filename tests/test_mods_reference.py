"""The float64 reference with user mods: each built-in switch written as a mod agrees with the switch, mods
compose with the built-in masks and GQA, and rows that see no key give out = 0, lse = -inf."""

import torch

from fagen.verify.reference import attention

B, HKV, G, SQ, SK, D = 2, 2, 2, 7, 11, 16  # lengths that are not multiples of anything


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HKV * G, SQ, D, dtype=torch.float64, generator=g)
    k = torch.randn(B, HKV, SK, D, dtype=torch.float64, generator=g)
    v = torch.randn(B, HKV, SK, D, dtype=torch.float64, generator=g)
    return q, k, v


def _same(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-12)


def test_softcap_as_a_mod():
    cap = 2.5
    q, k, v = _qkv()
    _same(attention(q, k, v, mask="causal", score_mod=lambda s, b, h, qi, ki: cap * torch.tanh(s / cap)),
          attention(q, k, v, mask="causal", softcap=cap))


def test_alibi_as_a_mod():
    slopes = torch.rand(HKV * G, dtype=torch.float64) + 0.1
    q, k, v = _qkv(1)

    def alibi(score, b, h, q_idx, kv_idx):  # distance to the bottom-right aligned row, as the switch
        return score - slopes[h] * torch.abs(kv_idx - (q_idx + SK - SQ))

    _same(attention(q, k, v, score_mod=alibi), attention(q, k, v, alibi_slopes=slopes))


def test_window_and_causal_as_mask_mods():
    q, k, v = _qkv(2)
    left, right = 3, 1

    def window(b, h, q_idx, kv_idx):
        i = q_idx + SK - SQ
        return (kv_idx >= i - left) & (kv_idx <= i + right)

    _same(attention(q, k, v, mask="causal", mask_mod=window), attention(q, k, v, mask="causal", window=(left, right)))
    _same(attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + SK - SQ),
          attention(q, k, v, mask="causal"))


def test_mods_compose_with_padding_gqa_and_sinks():
    q, k, v = _qkv(3)
    lq, lk = torch.tensor([5, 7]), torch.tensor([11, 6])
    bias = torch.randn(HKV * G, SK, dtype=torch.float64)
    sinks = torch.randn(HKV * G, dtype=torch.float64)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, kv_idx]

    def even_heads_skip_first_key(b, h, q_idx, kv_idx):
        return (h % 2 == 1) | (kv_idx > 0)

    out, lse = attention(q, k, v, mask="causal+padding", seqlens_q=lq, seqlens_k=lk, sinks=sinks,
                         score_mod=score_mod, mask_mod=even_heads_skip_first_key)
    # The same by hand: the bias is an ALiBi-like additive term, the mask_mod a -inf.
    s = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(G, 1)) * D ** -0.5 + bias.view(1, -1, 1, SK)
    i, j = torch.arange(SQ).view(1, 1, -1, 1), torch.arange(SK).view(1, 1, 1, -1)
    h = torch.arange(HKV * G).view(1, -1, 1, 1)
    vis = (i < lq.view(-1, 1, 1, 1)) & (j < lk.view(-1, 1, 1, 1)) & (j <= i + (lk - lq).view(-1, 1, 1, 1))
    vis = vis & ((h % 2 == 1) | (j > 0))
    s = torch.where(vis, s, float("-inf"))
    s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(B, -1, SQ, 1)], -1)
    p = torch.softmax(s, -1)[..., :SK]
    rows = (i < lq.view(-1, 1, 1, 1)).squeeze(-1)
    want = torch.where(rows.unsqueeze(-1), p @ v.repeat_interleave(G, 1), 0.0)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse[rows.expand_as(lse)], torch.logsumexp(s, -1)[rows.expand_as(lse)])


def test_rows_that_see_no_key_give_zero_and_minus_inf():
    q, k, v = _qkv(4)
    out, lse = attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: (q_idx != 2) & (kv_idx < 9))
    assert torch.all(out[:, :, 2] == 0) and torch.all(lse[:, :, 2] == float("-inf"))
    assert torch.isfinite(lse[:, :, [0, 1, 3]]).all()
    out2, lse2 = attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: torch.where(
        (q_idx != 2) & (kv_idx < 9), s, -float("inf")))
    _same((out, lse), (out2, lse2))


def test_learned_bias_gets_its_gradient():
    q, k, v = _qkv(5)
    q, k, v = q[:1, :2, :3], k[:1, :1, :5], v[:1, :1, :5]
    bias = torch.randn(2, 9, dtype=torch.float64, requires_grad=True)

    def run(bias):
        out, lse = attention(q, k, v, mask="causal", score_mod=lambda s, b, h, qi, ki: s + bias[h, qi - ki + 4])
        return out.sum() + torch.where(torch.isinf(lse), 0.0, lse).sum()

    assert torch.autograd.gradcheck(run, (bias,))
