"""The modded forward's host path (issue 26): a warm call with a block mask takes its checked kernel form from the
BlockMask ([Note] Checked block masks in host/checks.py.j2) and, on a GPU, launches through a kept step ([Note]
Forward steps in triton/attention.py.j2) with exactly the arguments the general path passes. The launcher and
the kernel are fakes (tests/test_launch.py), so this runs on the CPU."""

import threading

import pytest
import torch

import fagen
from _env import DEVICE
from fagen.bench import gym_mods as g
from fagen.runtime import modded
from fagen.runtime.block_mask import BlockMask
from fagen.runtime.mods import prepare
from test_launch import FakeTritonJIT, _raw_stream_of, _same


def _doc_mask():
    return g.generate_doc_mask_mod(g.causal_mask, g.length_to_offsets([13, 30, 27], DEVICE))


def _qkv(sq=70, sk=70, d=16):
    torch.manual_seed(0)
    q = torch.randn(1, 4, sq, d, device=DEVICE)
    k, v = torch.randn(1, 2, sk, d, device=DEVICE), torch.randn(1, 2, sk, d, device=DEVICE)
    return q, k, v


def _counting(monkeypatch):
    calls = []
    real = BlockMask.kernel_form

    def kernel_form(self, *args):
        calls.append(args)
        return real(self, *args)
    monkeypatch.setattr(BlockMask, "kernel_form", kernel_form)
    return calls


def test_a_warm_call_takes_the_checked_block_mask_and_a_new_shape_is_still_refused(monkeypatch):
    from fagen.mods import lower as lowering

    monkeypatch.setattr(lowering, "ENABLED", False)  # the modded path (the document mask would split into varlen calls)
    calls = _counting(monkeypatch)
    mask_mod = _doc_mask()
    q, k, v = _qkv()
    bm = fagen.create_block_mask(mask_mod, None, None, 70, 70, device=DEVICE, block_size=16)
    with torch.no_grad():
        first = fagen.attention(q, k, v, mask_mod=mask_mod, block_mask=bm)
        assert len(calls) == 1  # checked once
        for _ in range(3):
            assert torch.equal(fagen.attention(q, k, v, mask_mod=mask_mod, block_mask=bm), first)
        assert len(calls) == 1  # warm calls: no kernel_form, no check
        mods = prepare(mask_mod=mask_mod)
        forward, _ = modded.module_for(q, k, v, "none", (), mods)  # what served them (no arch: its own forward)
        # the same q but a k of another length: the module's own check refuses it, as on a first call
        k2, v2 = torch.randn(1, 2, 150, 16, device=DEVICE), torch.randn(1, 2, 150, 16, device=DEVICE)
        with pytest.raises(ValueError, match=r"block_mask: classes of shape \(1, 1, \d+, \d+\) do not fit q "
                                             r"\(1, 4, 70, 16\) and k \(1, 2, 150, 16\) at blocks"):
            forward.forward(q, k2, v2, mods=mods.values, block_mask=bm)
        # another q length: refused (fagen.attention's own line names the shapes)
        q3 = torch.randn(1, 4, 150, 16, device=DEVICE)
        with pytest.raises(ValueError, match=r"block_mask: built for Sq=70, Sk=70, but q and k have Sq=150, Sk=70"):
            fagen.attention(q3, k, v, mask_mod=mask_mod, block_mask=bm)
        with pytest.raises(ValueError, match=r"block_mask: classes of shape \(1, 1, \d+, \d+\) do not fit q "
                                             r"\(1, 4, 150, 16\)"):
            forward.forward(q3, k, v, mods=mods.values, block_mask=bm)
        # its kernel_form() tuple, passed as it is, is checked on every call
        tiles = [max(getattr(forward, p + x, 0) for p in ("", "DQ_", "DKDV_")) for x in ("BLOCK_M", "BLOCK_N")]
        form = bm.kernel_form(q.device, *tiles)
        n = len(calls)
        forward.forward(q, k, v, mods=mods.values, block_mask=form)
        with pytest.raises(ValueError, match="do not fit q"):
            forward.forward(q3, k, v, mods=mods.values, block_mask=form)
        assert len(calls) == n


def _modded_spec(mask_mod, **extra):
    fields = prepare(mask_mod=mask_mod).fields
    return fagen.KernelSpec(head_dim=16, mask="none", gqa=2, dtype="fp32", block_m=16, block_n=16,
                            direction="fwd", mask_mod=fields[1], mod_tensors=[list(t) for t in fields[2]],
                            mod_scalars=[list(s) for s in fields[3]], **extra)


def _aligned_like(t):
    flat = torch.empty(t.numel() + 16, dtype=t.dtype, device=t.device)
    start = (-flat.data_ptr() % 16) // t.element_size()
    return flat[start:start + t.numel()].view(t.shape).copy_(t)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("with_mask", [True, False])
def test_modded_forward_step_replays_the_general_path(monkeypatch, tma, with_mask):
    """[Note] Forward steps on a modded spec: the second call of a shape launches exactly what the first (general)
    call did; a misaligned captured tensor, another block granularity or no block mask takes the general path."""
    mask_mod = _doc_mask()
    module = fagen.load(_modded_spec(mask_mod))
    for name, value in (("_FAST_LAUNCH", True), ("_KERNELS", {}), ("_INTERPRET", False), ("_STEPS", {}),
                        ("_SCRATCH", {}), ("TMA", tma), ("_raw_stream", _raw_stream_of([77]))):
        monkeypatch.setattr(module, name, value)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    fwd = FakeTritonJIT(module._attn_fwd)
    fwd.launcher.global_scratch_size = 128 if tma else 0
    monkeypatch.setattr(module, "_attn_fwd", fwd)
    q, k, v = (_aligned_like(t) for t in _qkv())
    values = {name: _aligned_like(t) for name, t in prepare(mask_mod=mask_mod).values.items()}
    bm = fagen.create_block_mask(mask_mod, None, None, 70, 70, device=DEVICE, block_size=16) if with_mask else None
    masks = module._check_mask_inputs(q, k, None, None, None)

    def launch(values=values, bm=bm, **buffers):
        return module._launch(q, k, v, 0.25, *masks, *module._check_mods(q, values, bm, k=k), **buffers)

    launch()
    assert len(fwd.compiles) == 1 and len(module._STEPS) == 1
    first_out, first_lse = fwd.compiles[0][1][3:5]
    launch(out=first_out, lse=first_lse)
    launch(out=first_out, lse=first_lse)
    assert len(fwd.compiles) == 1 and len(fwd.launcher.calls) == 2  # two replays, nothing compiled
    (grid, args, consts), = fwd.compiles
    tail = tuple(consts[name] for name in fwd.arg_names[len(args):])
    for call in fwd.launcher.calls:
        assert call[:7] == (*grid, 77, 1234, False, True) and len(call) == 13 + len(args) + len(tail)
        bad = [name for name, a, b in zip(fwd.arg_names, call[13:], args + tail) if not _same(a, b)]
        assert not bad, bad
        # the captured tensors and the block mask's go as device addresses (fast= in fagen/codegen/args.py)
        tensors = [n for n in fwd.arg_names if n in ("mt0", "mt1", "BlkCls", "BlkList", "BlkListT")]
        assert len(tensors) == 5
        kinds = {n: type(call[13 + fwd.arg_names.index(n)]) for n in tensors}
        assert kinds == {n: int if with_mask or n.startswith("mt") else type(None) for n in tensors}, kinds
    if with_mask:  # a coarser block mask: another granularity, another grid: the general path keeps a step
        steps = len(module._STEPS)
        launch(bm=bm.at(32, 32), out=first_out, lse=first_lse)
        assert len(module._STEPS) == steps + 1
        assert fwd.launcher.calls[-1][:3] == (6, 4, 1) != grid  # 3 rows of 32 queries, 2 programs each
    # a captured tensor 4 bytes off 16-byte alignment: Triton specialises it differently, so never the kept step
    name = next(iter(values))
    flat = torch.empty(values[name].numel() + 8, dtype=values[name].dtype, device=DEVICE)
    start = ((-flat.data_ptr() % 16) // flat.element_size() + 1)
    off = flat[start:start + values[name].numel()].view(values[name].shape).copy_(values[name])
    compiles = len(fwd.compiles)
    launch(values={**values, name: off}, out=first_out, lse=first_lse)
    assert len(fwd.compiles) == compiles + 1


def _fast_launches(module, monkeypatch):
    """`module` launching as on a GPU through a fake compiled forward ([Note] Fast launches): (the fake, aligned
    q/k/v, their mask inputs)."""
    for name, value in (("_FAST_LAUNCH", True), ("_KERNELS", {}), ("_INTERPRET", False), ("_STEPS", {}),
                        ("_SCRATCH", {}), ("_raw_stream", _raw_stream_of([77]))):
        monkeypatch.setattr(module, name, value)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    fwd = FakeTritonJIT(module._attn_fwd)
    monkeypatch.setattr(module, "_attn_fwd", fwd)
    q, k, v = (_aligned_like(t) for t in _qkv())
    return fwd, (q, k, v), module._check_mask_inputs(q, k, None, None, None)


def test_a_kept_modded_step_reads_this_calls_closure_number(monkeypatch):
    """A closure int is a runtime argument ([Note] Runtime scalars): a kept step passes the call's value, 64 or 65,
    to the same compiled kernel."""
    mask_mod = g.generate_sliding_window(64)
    module = fagen.load(_modded_spec(mask_mod))
    fwd, (q, k, v), masks = _fast_launches(module, monkeypatch)
    (name,) = prepare(mask_mod=mask_mod).values
    for window in (64, 64, 65, 1):
        module._launch(q, k, v, 0.25, *masks, *module._check_mods(q, {name: window}, None, k=k))
        assert len(module._STEPS) == 1
    assert len(fwd.compiles) == 1 and len(fwd.launcher.calls) == 3
    where = fwd.arg_names.index("ms0")
    assert [call[13 + where] for call in fwd.launcher.calls] == [64, 65, 1]


def test_a_kept_window_step_reads_this_calls_window(monkeypatch):
    """The window switch's extents are never specialised (mod_jit) and not in the step key ([Note] Forward steps): a
    changed window, as a lowered sliding-window mod's closure number gives, replays the kept step with its own
    extents, on the one compiled kernel."""
    module = fagen.load(fagen.KernelSpec(head_dim=16, mask="causal", window=True, dtype="fp32", block_m=16,
                                         block_n=16, direction="fwd"))
    fwd, (q, k, v), masks = _fast_launches(module, monkeypatch)
    for window in ((64, 0), (64, 0), (65, 0), (1, 3)):
        module._launch(q, k, v, 0.25, *masks, *module._check_scores(q, window, None, None, None))
        assert len(module._STEPS) == 1
    assert len(fwd.compiles) == 1 and len(fwd.launcher.calls) == 3
    left, right = fwd.arg_names.index("win_left"), fwd.arg_names.index("win_right")
    assert [(call[13 + left], call[13 + right]) for call in fwd.launcher.calls] == [(64, 0), (65, 0), (1, 3)]
