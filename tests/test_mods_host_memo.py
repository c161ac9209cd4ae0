"""The mods rows' host cuts of the nineteenth session (docs/mods.md "The mods rows' host path (nineteenth session)"),
each a lever off by default: the lowering memo ([Note] Lowering memo in fagen/runtime/modded.py), the document
launch memo ([Note] Document launch memo in fagen/runtime/api.py) and the varlen steps ([Note] Varlen steps in
templates/triton/attention.py.j2). A warm call that a memo serves answers what the path without it answers; a call
that differs from the memo's in any one field of its key is answered as the path without the memo answers it."""

import pytest
import torch

import fagen
from _env import DEVICE, ON_GPU
from fagen.bench import gym_mods as g
from fagen.runtime import api, modded
from fagen.runtime.resolve import AttentionError


def _qkv(b, hq, s, d=16, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, hq, s, d, generator=gen).to(DEVICE, dtype) for _ in range(3))


def _ids(lengths):
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(DEVICE)


def _doc_mod(ids):
    def mm(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)
    return mm


def _switches(q, k, v, mask_mod, block_mask=None, mask="none"):
    """as_switches' answer for a dense call of mask_mod without switch keywords, with the split's runs as host
    values (a document split's cu_seqlens as a list) so two answers compare by value."""
    got = modded.as_switches(q, k, v, mask, None, mask_mod, block_mask, {}, None, None, None)
    if type(got) is not tuple:
        return type(got).__name__
    new_mask, scores, split = got
    if split is not None and split[0] == "document":
        split = ("document", (split[1][0].tolist(), split[1][1]))
    return new_mask, scores, split, modded.LOWERED[0]


@pytest.fixture
def memo(monkeypatch):
    """The lowering memo on, empty, and the calls of _lower counted."""
    monkeypatch.setattr(modded, "LOWER_MEMO", True)
    monkeypatch.setattr(modded, "_LOWER_MEMO", {})
    calls = []
    real = modded._lower
    monkeypatch.setattr(modded, "_lower", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    return calls


def _fresh(monkeypatch, fn):
    """fn() with the memo off (the path without it)."""
    monkeypatch.setattr(modded, "LOWER_MEMO", False)
    try:
        return fn()
    finally:
        monkeypatch.setattr(modded, "LOWER_MEMO", True)


def test_a_warm_call_is_served_by_the_lowering_memo_with_the_same_answer(memo, monkeypatch):
    q, k, v = _qkv(1, 2, 40)
    mm = _doc_mod(_ids([12, 16, 12]))
    first = _switches(q, k, v, mm)
    assert first[3] == "documents+causal" and len(memo) == 1
    assert _switches(q, k, v, mm) == first and len(memo) == 1  # served: no lowering
    assert _fresh(monkeypatch, lambda: _switches(q, k, v, mm)) == first


def _window(w):
    return g.generate_sliding_window(w)  # attention-gym's factory: a new closure of the same code per call


def _variants():
    """(name, warm call, call that differs in one key field): each a function of nothing, returning _switches'
    arguments."""
    q, k, v = _qkv(1, 2, 40)
    ids = _ids([12, 16, 12])
    other = _ids([20, 20])
    wide = torch.randn(2, 3, 40, 16, device=DEVICE)[:, :2]  # a batch stride the dilated views cannot take
    qb, kb, vb = _qkv(2, 2, 40)
    dil = g.generate_dilated_sliding_window(8, 2)

    def changed_in_place():
        ids[20:] = 7  # the tensor's version moves: new runs
        return (q, k, v, _doc_mod(ids))

    return {
        "closure number": (lambda: (q, k, v, _window(8)), lambda: (q, k, v, _window(4))),
        "tensor version": (lambda: (q, k, v, _doc_mod(ids)), changed_in_place),
        "tensor object": (lambda: (q, k, v, _doc_mod(ids)), lambda: (q, k, v, _doc_mod(other))),
        "shape": (lambda: (q, k, v, _doc_mod(ids)), lambda: (q[:, :, :24], k[:, :, :24], v[:, :, :24], _doc_mod(ids))),
        "strides": (lambda: (qb, kb, vb, dil), lambda: (wide, wide, wide, dil)),
        "mask": (lambda: (q, k, v, _doc_mod(ids)), lambda: (q, k, v, _doc_mod(ids), None, "causal")),
    }


@pytest.mark.skipif(ON_GPU, reason="host path only")
@pytest.mark.parametrize("field", list(_variants()))
def test_a_call_differing_in_one_key_field_is_lowered_as_without_the_memo(field, memo, monkeypatch):
    warm, differ = _variants()[field]
    _switches(*warm())
    _switches(*warm())  # warm (the memo holds the first call's answer)
    args = differ()
    want = _fresh(monkeypatch, lambda: _switches(*args))
    assert _switches(*args) == want


@pytest.mark.skipif(ON_GPU, reason="host path only")
def test_another_block_mask_is_checked_again(memo):
    """The block mask is in the key (the object and its classes' shape): one built for another length is refused
    on a call after a warm one with the right mask."""
    q, k, v = _qkv(1, 2, 40)
    mm = _doc_mod(_ids([12, 16, 12]))
    good = fagen.create_block_mask(mm, None, None, 40, 40, device=DEVICE, block_size=16)
    bad = fagen.create_block_mask(mm, None, None, 48, 48, device=DEVICE, block_size=16)
    _switches(q, k, v, mm, good)
    _switches(q, k, v, mm, good)
    with pytest.raises(AttentionError, match="block_mask: built for Sq=48"):
        _switches(q, k, v, mm, bad)


@pytest.mark.skipif(ON_GPU, reason="host path only")
def test_a_freed_tensor_s_entry_never_serves_a_new_one(memo, monkeypatch):
    """Captured tensors are compared by identity through weak references: an entry whose tensor is gone serves no
    call, even one whose new tensor got the same id and version."""
    q, k, v = _qkv(1, 2, 40)
    ids = _ids([12, 16, 12])
    _switches(q, k, v, _doc_mod(ids))
    (key, entry), = modded._LOWER_MEMO.items()
    new = _ids([20, 20])
    stale = tuple(id(new) if x == id(ids) else x for x in key)  # the key a new tensor at the old address makes
    modded._LOWER_MEMO[stale] = entry
    del ids
    monkeypatch.setattr(modded, "_memo_key", lambda *a, **kw: stale)
    got = _switches(q, k, v, _doc_mod(new))
    assert got[2][1][0] == [0, 20, 40]  # the new tensor's runs, not the entry's


# -- the document launch memo ---------------------------------------------------------------------------------------
def _doc_call(q, k, v, mm, **kw):
    with torch.no_grad():
        return fagen.attention(q, k, v, mask_mod=mm, **kw)


@pytest.fixture
def launches(monkeypatch):
    """DOC_MEMO on, empty; the varlen module's launch_forward / _launch_forward / forward calls counted."""
    monkeypatch.setattr(api, "DOC_MEMO", True)
    monkeypatch.setattr(api, "_DOC_CHECKED", {})
    calls = []
    q, k, v = _qkv(1, 2, 40)
    module = api.resolve_varlen(*(t.squeeze(0).transpose(0, 1) for t in (q, k, v)), "causal")
    for name in ("launch_forward", "_launch_forward", "forward"):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, (lambda n, r: lambda *a, **kw: (calls.append(n), r(*a, **kw))[1])(name, real))
    return calls


@pytest.mark.skipif(ON_GPU, reason="interpreter-sized")
def test_a_warm_document_call_launches_what_launch_forward_launches(launches, monkeypatch):
    q, k, v = _qkv(1, 2, 40)
    mm = _doc_mod(_ids([12, 16, 12]))
    first = _doc_call(q, k, v, mm)
    assert launches == ["launch_forward", "_launch_forward"]
    launches.clear()
    warm = _doc_call(q, k, v, mm)
    assert launches == ["_launch_forward"] and torch.equal(warm, first) and warm.stride() == first.stride()
    monkeypatch.setattr(api, "DOC_MEMO", False)
    assert torch.equal(_doc_call(q, k, v, mm), first)


@pytest.mark.skipif(ON_GPU, reason="interpreter-sized")
@pytest.mark.parametrize("field", ["scale", "runs", "check", "dtype"])
def test_a_document_call_differing_in_one_key_field_launches_as_without_the_memo(field, launches, monkeypatch):
    q, k, v = _qkv(1, 2, 40)
    ids = _ids([12, 16, 12])
    mm = _doc_mod(ids)
    kw = dict(scale=0.25)
    _doc_call(q, k, v, mm, **kw)
    _doc_call(q, k, v, mm, **kw)
    if field == "scale":
        kw = dict(scale=0.5)
    elif field == "runs":
        ids[24:] = 9  # new runs of the same longest (16): a new cu_seqlens tensor
    elif field == "check":
        kw = dict(kw, check=True)
    else:
        q, k, v = (t.half() for t in (q, k, v))
    launches.clear()
    got = _doc_call(q, k, v, mm, **kw)
    if field == "check":
        assert launches[0] == "forward"
    elif field == "dtype":
        assert launches == []  # float16's module, not float32's
    else:
        assert launches[0] == "launch_forward"  # checked again (a miss)
    monkeypatch.setattr(api, "DOC_MEMO", False)
    want = _doc_call(q, k, v, mm, **kw)
    assert torch.equal(got, want)


# -- varlen steps -----------------------------------------------------------------------------------------------------
@pytest.mark.skipif(ON_GPU, reason="host fakes")
@pytest.mark.parametrize("tma", [False, True])
def test_a_varlen_step_replays_the_general_path(monkeypatch, tma):
    """[Note] Varlen steps: the second call of a (shapes, strides, cu_seqlens' shapes, max_seqlens) key launches
    exactly what the first (general) call did; another batch, another longest sequence or a misaligned cu_seqlens
    takes the general path; off, no step is kept."""
    from test_launch import FakeTritonJIT, _raw_stream_of, _same

    module = fagen.load(fagen.KernelSpec(head_dim=16, mask="causal", gqa=2, dtype="fp32", block_m=16, block_n=16,
                                         layout="varlen"))
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
        return module._launch_forward(q, k, v, 0.25, cu, cu, None, longest, longest, **buffers)

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


@pytest.mark.skipif(ON_GPU, reason="host path only")
def test_a_captured_inference_tensor_is_not_memoised(memo, monkeypatch):
    """An inference tensor has no version counter: the call is lowered every time, as without the memo."""
    q, k, v = _qkv(1, 2, 40)
    with torch.inference_mode():
        limit = torch.full((40,), 30, device=DEVICE)

    def mm(b, h, q_idx, kv_idx):
        return (kv_idx < limit[q_idx]) & (q_idx >= kv_idx)

    want = _fresh(monkeypatch, lambda: _switches(q, k, v, mm))
    assert _switches(q, k, v, mm) == want and _switches(q, k, v, mm) == want
    assert not modded._LOWER_MEMO
