"""The cold path of fagen.attention (README "User mods", docs/mods.md "Cold start"): what a process's first call
imports, renders, loads and compiles, and that a warm cache skips the render."""

import subprocess
import sys

import pytest
import torch

import fagen
from _env import DEVICE


def _inputs(seed=0, heads=2, seq=40, dim=16):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, seq, dim, generator=gen).to(DEVICE) for _ in range(3)]


def _reference(q, k, v, bias):
    s = (q.double() @ k.double().transpose(-1, -2)) / q.shape[-1] ** 0.5
    i = torch.arange(q.shape[2], device=q.device)
    s = s + torch.where(i[:, None] >= i[None, :], bias, -0.5)
    return torch.softmax(s, -1) @ v.double()


def test_fagen_attention_and_a_mods_call_import_no_dynamo():
    """torch._dynamo costs about 1 s of a process's start: neither fagen.attention's import nor a plain or a mods
    call may pull it in ([Note] Dynamo on demand in fagen/runtime/api.py)."""
    code = ("import sys, torch, fagen\n"
            "q = torch.randn(1, 2, 20, 16)\n"
            "fagen.attention(q, q, q)\n"
            "c = 0.3\n"
            "fagen.attention(q, q, q, score_mod=lambda s, b, h, i, j: s + c * (i >= j))\n"
            "late = [m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules]\n"
            "assert not late, late\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


def test_a_traced_mods_call_runs_eagerly_behind_one_graph_break():
    """Under torch.compile a call with mods still breaks the graph once and runs eagerly (with Dynamo loaded after
    fagen, the disable wrapper is made on demand)."""
    torch._dynamo.reset()
    q, k, v = _inputs(1)
    bias = 0.25

    def layer(q, k, v):
        return fagen.attention(q + 1, k, v, score_mod=lambda s, b, h, i, j: s + torch.where(i >= j, bias, -0.5)) * 2

    explain = torch._dynamo.explain(layer)(q, k, v)
    assert explain.graph_break_count == 1, explain.break_reasons
    got = torch.compile(layer, backend="eager")(q, k, v)
    want = _reference(q + 1, k, v, bias) * 2
    assert (got.double() - want).abs().max().item() < 1e-4
