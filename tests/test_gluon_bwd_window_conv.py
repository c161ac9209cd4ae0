"""The window render's dQ converted in its main kernel (variant bwd_win_conv, fifteenth session; [Note] dQ conversion
in the main kernel in fagen/templates/gluon/backward.py.j2): the count a converted block waits for against the tiles
that step through it (_bwd_visits against _bwd_tile, the render's own functions run on Python ints), and the host
paths' launches with the kernels faked (the main kernel takes dQ, the int32 accumulator and zeroed counters after the
switches' values; no conversion pass in mode 2). On an H100: scripts/gpu_window_s15.py (float64, bit for bit the
product's gradients)."""

import types

import pytest
import torch

import fagen
from _env import ON_GPU
import triton

from test_gluon_bwd_host import MAIN_META, _bwd_args, _JIT
from test_gluon_bwd_window_fast import _module, LEVER
from test_gluon_bwd_window_host import _Bound, _same_launch
from test_hostpath import _Fill

pytestmark = pytest.mark.skipif(ON_GPU, reason="host fakes and Python ints")
CONV = {**LEVER, "bwd_win_conv": 1}
UNBOUNDED = 1 << 30


class _GL:
    """gluon.language's scalar integer functions on Python ints."""
    constexpr = int

    @staticmethod
    def minimum(a, b):
        return min(a, b)

    @staticmethod
    def maximum(a, b):
        return max(a, b)

    @staticmethod
    def where(c, a, b):
        return a if c else b


def _python(mod, *names):
    """The render's jit functions `names` as Python functions on ints (each other's callees replaced too)."""
    env = {}
    for name in names:
        fn = getattr(mod, name).fn
        env[name] = types.FunctionType(fn.__code__, {**fn.__globals__, "gl": _GL}, name)
    for f in env.values():
        f.__globals__.update(env)
    return env


@pytest.fixture(scope="module")
def conv_module():
    return _module(CONV, "_wconv_test")


def test_the_lever_renders_only_when_asked(conv_module):
    assert conv_module.BWD_WIN_CONV == 1 and _module().BWD_WIN_CONV == 0
    assert "_bwd_conv_tail" not in fagen.generate(fagen.KernelSpec(backend="gluon", direction="bwd", head_dim=128,
                                                                   mask="causal", dtype="bf16", window=True))


@pytest.mark.parametrize("causal", [True, False])
def test_a_block_waits_for_the_tiles_that_step_through_it(conv_module, causal):
    """_bwd_visits(m0) == the key blocks n whose tile (_bwd_tile's lo <= m0 < hi) steps through query block m0, for
    lengths off the blocks, Sq != Sk, windows narrow, wide and open."""
    f = _python(conv_module, "_bwd_visits", "_bwd_first", "_bwd_tile")
    bm, bn = conv_module.BWD_BLOCK_M, conv_module.BWD_BLOCK_N
    for sq, sk in ((333, 333), (1000, 1000), (300, 333), (333, 300), (64, 700), (777, 129)):
        n_kblk = -(-sk // bn)
        for left in (0, 37, 130, 1024, UNBOUNDED):
            for right in (0, 5, 200, UNBOUNDED):
                for m0 in range(0, -(-sq // bm) * bm, bm):
                    want = 0
                    for n in range(n_kblk):
                        _, _, _, _, lo, _, hi, _ = f["_bwd_tile"](n, 1, 1, sq, sk, left, right, bm, bn, 1, causal)
                        want += lo <= m0 < hi
                    got = f["_bwd_visits"](m0, sq, sk, n_kblk, left, right, bm, bn, causal)
                    assert got == want, (sq, sk, left, right, m0)


@pytest.fixture
def conv_fast(monkeypatch, conv_module):
    """(module, fakes) of the lever's window render with fast launches and its kernels faked (window_fast's)."""
    mod = conv_module
    extra = (37, 0, 0.0)
    real, epi_tma = mod._BWD_KERNELS[2]
    fakes = {"pre": _JIT(mod._bwd_preprocess, (7, 12)), "conv": _JIT(mod._dq_convert, (5, 8)),
             "main": _JIT(real, 18 + len(extra) + 3, MAIN_META + ([dict(MAIN_META[0])] * 2 if epi_tma else [])),
             "extra": extra}
    for name, value in (("_FAST_LAUNCH", True), ("_KERNELS", {}), ("_BWD_WS", type(mod._BWD_WS)()),
                        ("_GLUON_FAST", True), ("_raw_stream", lambda device: 77),
                        ("_bwd_preprocess", fakes["pre"]), ("_dq_convert", fakes["conv"]),
                        ("_BWD_KERNELS", {2: (fakes["main"], epi_tma)}),
                        ("_fast_bwd_preprocess", mod._gluon(fakes["pre"])),
                        ("_fast_dq_convert", mod._gluon(fakes["conv"])),
                        ("_fast_bwd_kernels", {2: (mod._gluon(fakes["main"]), epi_tma)}),
                        ("_fast_kv_bound", _Bound(mod, fakes))):
        monkeypatch.setattr(mod, name, value)
    monkeypatch.setitem(mod._NUM_SMS, -1, 132)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: -1)
    monkeypatch.setattr(triton.runtime.driver, "_active", _Fill())
    return mod, fakes


def test_the_fast_and_plain_paths_pass_the_conversion_s_arguments(conv_fast):
    """Mode 2 with the lever: the main kernel's arguments end in (dQ, the int32 accumulator, the flags: zero when
    the main kernel starts, one per tile and the next block's, after KVB in the workspace) on both paths, and
    neither launches the conversion pass."""
    mod, fakes = conv_fast
    args, grads = _bwd_args(sq=300, sk=333, b=2, h=2)
    extra = fakes["extra"]
    for _ in range(2):  # the second call on kept views, its counters dirty from the first
        mod._run_backward_fast(*args, *grads, 2, None, extra)
        _, main, _ = fakes["main"].compiles[-1]
        cnt = main[23]
        assert cnt.dtype == torch.int32 and cnt.numel() >= 4 * 3 * 4 + 4 and torch.count_nonzero(cnt) == 0
        cnt.fill_(7)
    mod._run_backward(*args, *grads, 2, None, extra)
    (_, fast, c_fast), (_, plain, c_plain) = fakes["main"].compiles
    assert c_fast == c_plain and c_fast["DQ_MODE"] == 2
    _same_launch(fast[:21], plain[:21])
    for launch in (fast, plain):
        assert len(launch) == 24 and tuple(launch[18:21]) == extra
        assert launch[21].data_ptr() == grads[0].data_ptr() and launch[22].dtype == torch.int32
        assert launch[22].numel() == 2 * 2 * 320 * 128 and launch[23].dtype == torch.int32
    kvb = fakes["pre"].compiles[0][1][10]
    assert fast[23].data_ptr() == kvb.data_ptr() + 2 * 2 * 2 * 4  # right after KVB [B * Hkv, 2]
    assert fast[22].data_ptr() == fast[6].base.data_ptr()  # the accumulator the dQ warp adds into
    assert plain[23].numel() == 4 * 3 * 4 + 4  # a flag per tile (3 key blocks x 4 heads), 16 bytes each, and the next block
    assert fakes["conv"].compiles == []  # no conversion pass in mode 2, on either path



class _Rec:
    """A launch recorder: fn[grid](*args, **consts) appends (grid, args, consts)."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **consts: self.calls.append((grid, args, consts))


@pytest.mark.parametrize("variant", [2, 3])
def test_variant_2_passes_the_flags_descriptor(monkeypatch, variant):
    """bwd_win_conv 2 and 3 (the flags set by the TMA unit): the main kernel's last argument describes the flags (16
    bytes a tile, [1, 4] int32 boxes) over the same memory as the flags pointer before it, on both paths; no
    conversion."""
    mod = _module({**CONV, "bwd_win_conv": variant}, f"_wconv{variant}_test")
    assert mod.BWD_WIN_CONV == variant
    main, pre, conv, bound = _Rec(), _Rec(), _Rec(), _Rec()
    for name, value in (("_fast_bwd_kernels", {2: (main, 1)}), ("_BWD_KERNELS", {2: (main, 1)}),
                        ("_fast_bwd_preprocess", pre), ("_bwd_preprocess", pre), ("_fast_dq_convert", conv),
                        ("_dq_convert", conv), ("_fast_kv_bound", bound), ("_BWD_WS", type(mod._BWD_WS)()),
                        ("_raw_stream", lambda device: 77)):
        monkeypatch.setattr(mod, name, value)
    monkeypatch.setitem(mod._NUM_SMS, -1, 132)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: -1)
    args, grads = _bwd_args(sq=300, sk=333, b=2, h=2)
    mod._run_backward_fast(*args, *grads, 2, None, (37, 0, 0.0))
    mod._run_backward(*args, *grads, 2, None, (37, 0, 0.0))
    (_, fast, _), (_, plain, _) = main.calls
    tiles = 3 * 4
    f2, box = fast[24]
    assert box == (1, 4) and f2.shape == (tiles, 4) and f2.dtype == torch.int32
    assert f2.data_ptr() == fast[23].data_ptr() and f2.data_ptr() % 16 == 0 and torch.count_nonzero(fast[23]) == 0
    desc = plain[24]
    assert isinstance(desc, mod.TensorDescriptor) and desc.block_shape == [1, 4] and list(desc.shape) == [tiles, 4]
    assert desc.base.data_ptr() == plain[23].data_ptr()
    assert conv.calls == []
