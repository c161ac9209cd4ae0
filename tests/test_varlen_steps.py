"""The varlen steps ([Note] Varlen steps in templates/triton/attention.py.j2; docs/mods.md "The mods rows' host path
(nineteenth session)"): a warm varlen call replays the general path's launch; a call that differs in any one field of
the step's key takes the general path."""

import pytest
import torch

import fagen
from _env import ON_GPU


# -- varlen steps -----------------------------------------------------------------------------------------------------
@pytest.mark.skipif(ON_GPU, reason="host fakes")
@pytest.mark.parametrize("modded", [False, True], ids=["plain", "learned-bias"])
@pytest.mark.parametrize("tma", [False, True])
def test_a_varlen_step_replays_the_general_path(monkeypatch, tma, modded):
    """[Note] Varlen steps: the second call of a (shapes, strides, cu_seqlens' shapes, max_seqlens) key launches
    exactly what the first (general) call did; another batch, another longest sequence or a misaligned cu_seqlens
    takes the general path; off, no step is kept. A modded spec's captured tensor joins the step's alignment check
    (the GPU memory fuzz's learned-bias varlen case found the step's replay reading its address before assigning it)."""
    from test_launch import FakeTritonJIT, _raw_stream_of, _same

    mods = dict(score_mod="(score + bias[h, ((q_idx - kv_idx) + 40)])", mod_tensors=[["bias", "fp32", 2]])
    module = fagen.load(fagen.KernelSpec(head_dim=16, mask="causal", gqa=2, dtype="fp32", block_m=16, block_n=16,
                                         layout="varlen", **(mods if modded else {})))
    bias = (torch.randn(4, 80),) if modded else ()
    for name, value in (("_FAST_LAUNCH", True), ("_KERNELS", {}), ("_INTERPRET", False), ("_STEPS", {}),
                        ("_SCRATCH", {}), ("TMA", tma), ("_raw_stream", _raw_stream_of([77])),
                        ("_VARLEN_STEPS", True)):
        monkeypatch.setattr(module, name, value)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    fwd = FakeTritonJIT(module._attn_fwd)
    fwd.launcher.global_scratch_size = 128 if tma else 0
    monkeypatch.setattr(module, "_attn_fwd", fwd)
    q, k, v = torch.randn(40, 4, 16), torch.randn(40, 2, 16), torch.randn(40, 2, 16)
    cu = torch.tensor([0, 7, 40], dtype=torch.int32)
    assert (q.data_ptr() | k.data_ptr() | v.data_ptr() | cu.data_ptr()) % 16 == 0

    def launch(cu=cu, longest=33, **buffers):
        return module._launch_forward(q, k, v, 0.25, cu, cu, None, longest, longest, *bias, **buffers)

    launch()
    assert len(fwd.compiles) == 1 and len(module._STEPS) == 1
    kout, klse = fwd.compiles[0][1][3:5]  # the kernel views [1, H, total, D] / [1, H, total] of out and lse
    launch(out=kout[0].permute(1, 0, 2), lse=klse[0])
    launch(out=kout[0].permute(1, 0, 2), lse=klse[0])
    assert len(fwd.compiles) == 1 and len(fwd.launcher.calls) == 2  # two replays
    (grid, args, consts), = fwd.compiles
    tail = tuple(consts[name] for name in fwd.arg_names[len(args):])
    for call in fwd.launcher.calls:
        assert call[:3] == grid and len(call) == 13 + len(args) + len(tail)
        bad = [name for name, a, b in zip(fwd.arg_names, call[13:], args + tail) if not _same(a, b)]
        assert not bad, bad
    for other, want in ((dict(longest=17), (2, 4, 2)), (dict(cu=torch.tensor([0, 7, 20, 40], dtype=torch.int32)),
                                                         (3, 4, 3))):
        launch(**other)  # a new key: the general path (the kept kernel), then a step of its own
        assert fwd.launcher.calls[-1][:3] == want
    odd = torch.zeros(5, dtype=torch.int32)[1:]  # a 4-byte offset: Triton specialises it differently
    odd.copy_(cu[[0, 1, 2, 2]])
    compiles = len(fwd.compiles)
    launch(cu=odd[:3])
    assert len(fwd.compiles) == compiles + 1
    monkeypatch.setattr(module, "_STEPS", {})
    monkeypatch.setattr(module, "_VARLEN_STEPS", False)
    launch()
    launch()
    assert not module._STEPS
