"""Numerics at the edges of the score switches: the fp32 softcap against float64 at caps up to 1e6 ([Note] Exact
tanh in triton/masks.j2), and an infinite sink (out = 0, lse = +inf, finite gradients; [Note] Sinks)."""

import math

import pytest
import torch

import fagen
from _env import DEVICE, ON_GPU
from fagen.verify import reference

SMALL = {} if ON_GPU else dict(block_m=16, block_n=16, num_warps=1, num_stages=1)
D = 64 if ON_GPU else 32
KINDS = [("prefill", "fwd"), ("prefill", "bwd"), ("decode", "fwd")]


def _spec(kind, direction, **switches):
    return fagen.KernelSpec(head_dim=D, mask="causal", gqa=2, dtype="fp32", kind=kind, direction=direction,
                            **(SMALL if kind == "prefill" else {}), **switches)


def _qkv(sq, sk, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, s, D, generator=g) for h, s in ((4, sq), (2, sk), (2, sk)))
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)


@pytest.mark.parametrize("kind, direction", KINDS)
def test_fp32_softcap_stays_exact_for_large_caps(kind, direction):
    """fp32, scores q.k scaled by 3 (|s| up to ~10), caps from 50 to 1e6: out and lse stay at fp32 rounding. The
    old 1 - 2 / (exp(2x) + 1) cancelled for small s / cap: 1.4e-3 at cap 1e4 and 0.17 at cap 1e6."""
    module = fagen.load(_spec(kind, direction, softcap=True))
    sq = 3 if kind == "decode" else 37
    q, k, v = _qkv(sq, 45)
    scale = 3.0 / math.sqrt(D)
    for cap in (50.0, 1e3, 1e4, 1e6):
        out, lse = module.forward(q, k, v, scale=scale, softcap=cap)
        ref_out, ref_lse = reference.attention(q.cpu(), k.cpu(), v.cpu(), mask="causal", scale=scale, softcap=cap)
        err_out = (out.cpu().double() - ref_out).abs().max().item()
        err_lse = (lse.cpu().double() - ref_lse).abs().max().item()
        assert err_out < 3e-5 and err_lse < 3e-5, f"cap {cap:g}: out error {err_out:.2e}, lse error {err_lse:.2e}"


@pytest.mark.parametrize("kind, direction", KINDS)
def test_infinite_sink_gives_zero_output_and_infinite_lse(kind, direction):
    """sinks = +inf on head 0: its rows get out = 0 and lse = +inf (the contract's formula), never NaN; the other
    heads match the float64 reference; backward: zero gradients from those rows and dsinks[0] = 0 (the limit as the
    sink grows: the row's output no longer depends on it)."""
    module = fagen.load(_spec(kind, direction, sinks=True))
    sq = 3 if kind == "decode" else 37
    q, k, v = _qkv(sq, 45, seed=1)
    sinks = torch.tensor([float("inf"), 0.5, -1.0, 2.0], device=DEVICE)
    runs = [module.forward(q, k, v, sinks=sinks)]
    if kind == "decode":
        runs.append(module.forward_split(q, k, v, sinks=sinks, num_splits=3))  # the merge adds the sink
    finite = sinks.clone()
    finite[0] = 0.0  # the reference for heads 1.. (head 0's rows are checked against the formula's limit)
    ref_out, ref_lse = reference.attention(q.cpu(), k.cpu(), v.cpu(), mask="causal", sinks=finite.cpu())
    for out, lse in runs:
        assert not out.isnan().any() and not lse.isnan().any()
        assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))
        assert bool((lse[:, 0] == float("inf")).all())
        torch.testing.assert_close(out[:, 1:].cpu().double(), ref_out[:, 1:], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(lse[:, 1:].cpu().double(), ref_lse[:, 1:], atol=2e-5, rtol=1e-5)
    if direction == "bwd":
        out, lse = runs[0]
        do = torch.randn_like(out)
        dq, dk, dv, dsinks = module.backward(do, q, k, v, out, lse, sinks=sinks)
        for t in (dq, dk, dv, dsinks):
            assert not t.isnan().any()
        assert torch.equal(dq[:, 0], torch.zeros_like(dq[:, 0])) and dsinks[0].item() == 0.0
        ref = [t.double().requires_grad_() for t in (q.cpu(), k.cpu(), v.cpu(), finite.cpu())]
        ref_out, _ = reference.attention(*ref[:3], mask="causal", sinks=ref[3])
        (ref_out[:, 1:] * do.cpu().double()[:, 1:]).sum().backward()  # head 0 (out = 0) adds nothing
        torch.testing.assert_close(dq[:, 1:].cpu().double(), ref[0].grad[:, 1:], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(dk.cpu().double(), ref[1].grad, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(dv.cpu().double(), ref[2].grad, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(dsinks[1:].cpu().double(), ref[3].grad[1:], atol=1e-4, rtol=1e-4)
