"""CUDA-graph safety: the per-call path of every mask x kind x backend reads no device value, so a CUDA graph can
capture it ([Note] Checks that read device values). On the CPU that is shown under FakeTensorMode, where reading a
value raises; on a GPU each variant is captured, replayed on new inputs and compared with eager."""

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

import fagen
from fagen.verify.strategies import Problem
from _env import DEVICE, ON_GPU

MASKS = ["none", "causal", "padding", "causal+padding", "tree"]


def _problem(mask, sq, sk):
    padded = mask in ("padding", "causal+padding")
    return Problem(batch=2, heads_kv=2, seq_q=sq, seq_k=sk, seed=3,
                   seqlens_q=(sq, max(sq - 2, 1)) if padded else None, seqlens_k=(sk, sk - 5) if padded else None,
                   parents=((-1,) + tuple(i // 2 for i in range(sq - 1)),) * 2 if mask == "tree" else None)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_checks_read_no_device_value_unless_asked(mask, backend):
    spec = fagen.KernelSpec(head_dim=32, mask=mask, gqa=2, dtype="fp16", backend=backend)
    module = fagen.load(spec)
    (q, k, v), kw = _problem(mask, 12, 20).inputs(spec, DEVICE)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq, fk = mode.from_tensor(q), mode.from_tensor(k)
        fkw = {name: mode.from_tensor(t) for name, t in kw.items()}
        module._check_qkv(fq, fk, mode.from_tensor(v))
        module._check_mask_inputs(fq, fk, fkw.get("seqlens_q"), fkw.get("seqlens_k"), fkw.get("tree_mask"))
        if kw:  # the opt-in value checks do read values: this test would see a host sync
            with pytest.raises(DataDependentOutputException):
                module._check_mask_inputs(fq, fk, fkw.get("seqlens_q"), fkw.get("seqlens_k"),
                                          fkw.get("tree_mask"), check=True)


def _capture(fn):
    """Warm up on a side stream (compiles, fills caches), then capture one call into a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()
    return graph, static


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("kind, backend", [("prefill", "triton"), ("decode", "triton"), ("prefill", "cuda")])
def test_capture_and_replay_equals_eager(mask, kind, backend):
    spec = fagen.KernelSpec(head_dim=128, mask=mask, gqa=4, dtype="bf16", kind=kind, backend=backend)
    module = fagen.load(spec)
    sq, sk = (3, 1000) if kind == "decode" else (300, 333)
    problem = _problem(mask, sq, sk)
    (q, k, v), kw = problem.inputs(spec, DEVICE)
    graph, (out, lse) = _capture(lambda: module.forward(q, k, v, **kw))
    for seed in (7, 8):  # new values in the captured buffers: the replay must follow them
        (q2, k2, v2), _ = Problem(**{**problem.__dict__, "seed": seed}).inputs(spec, DEVICE)
        q.copy_(q2), k.copy_(k2), v.copy_(v2)
        graph.replay()
        want_out, want_lse = module.forward(q, k, v, **kw)
        torch.testing.assert_close(out, want_out, rtol=0, atol=0)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA device")
def test_decode_plan_run_captures_with_caller_buffers():
    spec = fagen.KernelSpec(head_dim=128, mask="causal+padding", gqa=4, dtype="bf16", kind="decode")
    module = fagen.load(spec)
    problem = _problem("causal+padding", 2, 4096)
    (q, k, v), kw = problem.inputs(spec, DEVICE)
    plan = module.plan(2, q.shape[1], 2, 4096, device=DEVICE)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device=DEVICE)
    graph, _ = _capture(lambda: plan.run(q, k, v, **kw, out=out, lse=lse))
    kw["seqlens_k"].copy_(torch.tensor([4000, 17], dtype=torch.int32))  # lengths change between steps
    graph.replay()
    want_out, want_lse = module.forward(q, k, v, **kw)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
