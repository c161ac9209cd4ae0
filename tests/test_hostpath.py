"""The modded forward's host path (issue 26): a warm call with a block mask takes its checked kernel form from the
BlockMask ([Note] Checked block masks in host/checks.py.j2) and, on a GPU, launches through a kept step ([Note]
Forward steps in triton/attention.py.j2) with exactly the arguments the general path passes. The launcher and
the kernel are fakes (tests/test_launch.py), so this runs on the CPU."""

import threading

import pytest
import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

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


# -- the Gluon forward's fast launches ([Note] Gluon fast launches in fagen/templates/host/gluon_launch.py) ------
# The compiled kernel is faked around triton's own descriptor wrapper (wrap_handle_tensordesc), and the TMA encoder
# (fill_tma_descriptor) by a stand-in that returns its arguments: the fast path must hand the launcher's C entry
# point exactly what triton's wrapper makes of the TensorDescriptors the plain path passes.
GLUON_META = [{"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [1, 1, rows, 64], "fp4_padded": False}
              for rows in (64, 128, 128, 64)]  # the bf16 d128 forward's, as compile_for() reports them


class _Fill:
    """triton.runtime.driver.active with utils.fill_tma_descriptor recording its calls."""

    def __init__(self):
        self.calls = []
        self.utils = self

    def fill_tma_descriptor(self, ptr, swizzle, elem_size, elem_type, block, shape, strides, padding):
        self.calls.append(ptr)
        return ("map", ptr, swizzle, elem_size, elem_type, tuple(block), tuple(shape), tuple(strides), padding)


class _GluonLauncher:
    """triton 3.6's CudaLauncher of a kernel with TMA descriptors: launch is wrap_handle_tensordesc's wrapper."""

    def __init__(self, arg_names, n_descs):
        from triton.backends.nvidia.driver import wrap_handle_tensordesc
        self.raw = []
        signature = {n: "tensordesc<bf16[1, 1, 64, 128]>" if i < n_descs else "i32" for i, n in enumerate(arg_names)}
        self.launch = wrap_handle_tensordesc(lambda *args: self.raw.append(args), signature, GLUON_META)
        self.global_scratch_size = self.profile_scratch_size = 0
        self.num_ctas, self.launch_cooperative_grid, self.launch_pdl = 1, False, False

    def __call__(self, gx, gy, gz, stream, function, *args):  # the JIT's launch of a compiled kernel
        self.launch(gx, gy, gz, stream, function, False, False, None, None, *args)


class _GluonJIT:
    """A @gluon.jit function as _gluon_run uses it: fn[grid](...) compiles (counted), launches, returns the kernel."""

    def __init__(self, arg_names):
        self.arg_names, self.compiles = arg_names, []
        self.launcher = _GluonLauncher(arg_names, 4)

    def __getitem__(self, grid):
        def compile_and_launch(*args, **consts):
            self.compiles.append((grid, args, consts))
            kernel = type("K", (), {})()
            kernel.run, kernel.function, kernel.packed_metadata = self.launcher, 1234, (4, 1, 0)
            kernel.metadata = type("M", (), {"tensordesc_meta": GLUON_META})()
            tail = [consts[n] for n in self.arg_names[len(args):]]
            self.launcher(*grid, 1, 1, 77, 1234, (4, 1, 0), None, None, None, *args, *tail)
            return kernel
        return compile_and_launch


@pytest.fixture
def gluon_fwd(monkeypatch):
    """The bf16 causal d128 Gluon module with fast launches on, its kernel faked (no GPU runs it here)."""
    mod = fagen.load(fagen.KernelSpec(backend="gluon", head_dim=128, mask="causal", dtype="bf16"))
    monkeypatch.setattr(mod, "_FAST_LAUNCH", True)
    monkeypatch.setattr(mod, "_KERNELS", {})
    monkeypatch.setattr(mod, "_raw_stream", lambda device: 77)
    fill = _Fill()
    monkeypatch.setattr(triton.runtime.driver, "_active", fill)
    return mod, _GluonJIT(mod._attn_fwd_hopper.arg_names), fill


def _gluon_args(mod, sq=300, sk=333, seed=0):
    """A forward launch's positional arguments as _launch_forward passes them (CPU tensors, TMA-ready)."""
    torch.manual_seed(seed)
    q, o = (torch.randn(2, 4, sq, 128).bfloat16() for _ in range(2))
    k, v = (torch.randn(2, 4, sk, 128).bfloat16() for _ in range(2))
    lse = torch.empty(2, 4, sq)
    return [mod._descriptor(q, mod.BLOCK_M), mod._descriptor(k, mod.BLOCK_N), mod._descriptor(v, mod.BLOCK_N),
            mod._descriptor(o, mod.BLOCK_M), lse, 0.125, 24, 3, 4, sq, sk, torch.zeros(1, dtype=torch.int32)]


def _consts(mod):
    return dict(HEAD_DIM=128, BLOCK_M=mod.BLOCK_M, BLOCK_N=mod.BLOCK_N, STAGES=mod.STAGES, GQA=1, CAUSAL=1,
                CONSUMER_REGS=mod.CONSUMER_REGS, LOADER_REGS=mod.LOADER_REGS, num_warps=4)


def test_gluon_fast_launch_passes_what_triton_s_descriptor_wrapper_passes(gluon_fwd):
    mod, fn, fill = gluon_fwd
    args = _gluon_args(mod)
    for _ in range(3):
        mod._gluon_run(fn, (24,), args, _consts(mod))
    assert len(fn.compiles) == 1  # compiled (through fn[grid]) once, then the C entry point
    (grid, plain, consts), = fn.compiles
    for got, (t, box) in zip(plain[:4], args[:4]):  # the plain path: TensorDescriptors as the module built them
        layout = gl.NVMMASharedLayout.get_default_for(list(box), gl.bfloat16)
        assert isinstance(got, TensorDescriptor) and got.base is t and got.block_shape == list(box)
        assert got.layout == layout and got.shape == list(t.shape) and got.strides == list(t.stride())
    wrapped, fast, again = fn.launcher.raw
    assert len(fast) == len(wrapped) and all(map(_same, fast, wrapped))  # the launch triton's wrapper makes
    assert fast == again and any(type(a) is tuple and a[0] == "map" for a in fast)
    assert len(fill.calls) == 4 + 4  # the wrapper's four encodes, then the fast path's four, kept after that


def test_gluon_fast_launch_keeps_maps_per_address_shape_and_strides(gluon_fwd):
    mod, fn, fill = gluon_fwd
    args = _gluon_args(mod)
    mod._gluon_run(fn, (24,), args, _consts(mod))
    mod._gluon_run(fn, (24,), args, _consts(mod))
    n = len(fill.calls)
    q2 = torch.randn_like(args[0][0])  # a new q (another address): only its map is encoded
    mod._gluon_run(fn, (24,), [(q2, args[0][1])] + args[1:], _consts(mod))
    assert fill.calls[n:] == [q2.data_ptr()]
    k_view = args[1][0][:, :, :200]  # the same address, another shape: a new map, and it says so
    mod._gluon_run(fn, (24,), [args[0], (k_view, args[1][1])] + args[2:9] + [300, 200, args[11]], _consts(mod))
    assert fill.calls[n + 1:] == [k_view.data_ptr()] and fn.launcher.raw[-1][14 + 9 + 2] == 200  # k's Sk
    assert len(fn.compiles) == 1


def test_gluon_fast_launch_specialises_like_triton(gluon_fwd):
    """A new compile for another descriptor dtype or box, an int that becomes 1 or leaves the multiples of 16,
    another constexpr; not for another length of the same class."""
    mod, fn, _ = gluon_fwd
    args, consts = _gluon_args(mod), _consts(mod)
    runs = [args, args[:9] + [320, 336, args[11]], args[:9] + [301, 333, args[11]],
            args[:8] + [1] + args[9:], [(args[0][0], (1, 1, 32, 128))] + args[1:],
            [(args[0][0].half(), args[0][1])] + args[1:]]
    for a in runs:
        mod._gluon_run(fn, (24,), a, consts)
    mod._gluon_run(fn, (24,), args, dict(consts, STAGES=3))
    assert len(fn.compiles) == 6  # 320/336 like 300/333 (not multiples of 16: 301 is too); the rest each compile


def test_gluon_plain_path_when_off(gluon_fwd, monkeypatch):
    mod, fn, fill = gluon_fwd
    monkeypatch.setattr(mod, "_GLUON_FAST", False)
    args = _gluon_args(mod)
    for _ in range(3):
        mod._gluon_run(fn, (24,), args, _consts(mod))
    assert len(fn.compiles) == 3 and not mod._KERNELS
    assert all(isinstance(d, TensorDescriptor) for _, a, _ in fn.compiles for d in a[:4])


def test_gluon_modules_launch_through_the_fast_path():
    """Every Gluon forward launches its kernel through _gluon with descriptor requests, never fn[grid] directly."""
    for extra in (dict(dtype="bf16"), dict(dtype="fp8_e4m3"), dict(dtype="bf16", window=True),
                  dict(dtype="bf16", head_dim=192, head_dim_v=128)):
        spec = fagen.KernelSpec(backend="gluon", **{"head_dim": 128, "mask": "causal", **extra})
        src = fagen.generate(spec)
        host = src[src.index("def _launch_forward("):src.index("def forward(")]
        assert "_fast_attn_fwd_hopper[grid](" in host
        assert "_attn_fwd_hopper[grid](" not in host.replace("_fast_attn", "")  # no plain fn[grid] launch
        assert "TensorDescriptor(" not in host and "get_default_for" not in host


def test_a_window_takes_the_gluon_forward_from_window_min_work(monkeypatch):
    """fagen.attention's size rule ([Note] Gluon size rule in fagen/runtime/hopper.py): a window's own pairs against
    WINDOW_MIN_WORK, the same call without the window against MIN_WORK. The device is faked as an sm_90 GPU: the
    Gluon module's forward refuses CPU tensors with its InputError, which shows it was picked."""
    from fagen.runtime import api, hopper, resolve
    if torch.cuda.is_available():
        pytest.skip("the CPU run shows the choice through the Gluon module's device check")
    monkeypatch.setattr(hopper, "is_hopper", lambda device: True)
    monkeypatch.setattr(hopper, "gluon_missing", lambda: None)
    monkeypatch.delenv(hopper.ENV, raising=False)
    monkeypatch.setattr(resolve, "_FAST", {})
    monkeypatch.setattr(api, "_FAST", resolve._FAST)
    monkeypatch.setattr(api, "WINDOW_MIN_WORK", 64 * 40)  # a window (39, 0) at Sq = Sk = 64 visits 64 x 40 pairs
    monkeypatch.setattr(api, "MIN_WORK", 64 * 64 + 1)
    q = torch.randn(1, 1, 64, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        with pytest.raises(ValueError, match="Gluon kernel"):
            fagen.attention(q, q, q, mask="causal", window=(39, 0))
        assert fagen.attention(q, q, q, mask="causal", window=(38, 0)).shape == q.shape  # 64 x 39: Triton
        assert fagen.attention(q, q, q, mask="causal").shape == q.shape  # 64 x 64 < MIN_WORK: Triton
        monkeypatch.setattr(api, "MIN_WORK", 64 * 64)
        resolve._FAST.clear()
        with pytest.raises(ValueError, match="Gluon kernel"):
            fagen.attention(q, q, q, mask="causal")
