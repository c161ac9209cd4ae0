"""The window render's fixed-point backward on the general fast host path ([Note] The bound kernel and [Note] Switches
on the fast backward path in fagen/templates/host/gluon_bwd_launch.py; the eleventh session's window path of its own
was merged into it in the twelfth): the bound kernel against the plain path's torch bound (CPU interpreter), and, with the kernels faked (test_gluon_bwd_host.py's fakes), the path's launches against the
plain path's: the same kernels, grids and arguments, the qmul rows beside delta in one row descriptor, KVB the
workspace's; taken only when switched on."""

import pytest
import torch
import triton

import fagen
from _env import ON_GPU
from fagen import backends
from fagen.codegen import render
from fagen.runtime.loader import load_source
from test_gluon_bwd_host import MAIN_META, _bwd_args, _JIT
from test_gluon_bwd_window_host import _Bound, _same_launch
from test_hostpath import _Fill

pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU interpreter and host fakes")
WINDOW_SPEC = dict(backend="gluon", direction="bwd", head_dim=128, mask="causal", dtype="bf16", window=True)
LEVER = {"bwd_window_fixed": 1, "bwd_fixed_tma": 1}


def _module(lever=LEVER, name="_wfast_test"):
    spec = fagen.KernelSpec(**WINDOW_SPEC)
    saved = {k: backends.GLUON.variant[k] for k in lever}
    backends.GLUON.variant.update(lever)
    render.render.cache_clear()
    try:
        src = render.render(spec).files[".py"]
    finally:
        backends.GLUON.variant.update(saved)
        render.render.cache_clear()
    return load_source(src, spec.name + name)


def test_the_window_render_has_no_path_of_its_own():
    """The product's window render (variant bwd_window) runs the general fast path with the bound kernel; the
    eleventh session's duplicates (its workspace, the pre/postprocess wrappers, _run_backward_window) are gone."""
    src = fagen.generate(fagen.KernelSpec(**WINDOW_SPEC))
    for name in ("_run_backward_window", "_bwd_preprocess_w", "_dq_convert_w", "_BWD_WWS"):
        assert name not in src, name
    mod = _module()
    assert mod.BWD_DET_MODE == 2 and mod.BWD_FIXED_TMA == 1 and mod.BWD_WINDOW == 1
    assert mod._BWD_BOUND_KERNEL is True and mod._BWD_WINDOW_FAST is True


@pytest.mark.parametrize("on", [False, True])
def test_modes_2_and_1_take_the_fast_path_only_when_switched_on(monkeypatch, on):
    mod = _module()
    monkeypatch.setattr(mod, "_BWD_WINDOW_FAST", on)
    monkeypatch.setattr(mod, "_BWD_FAST_SWITCHES", False)
    taken = []
    monkeypatch.setattr(mod, "_run_backward", lambda *a, **k: taken.append(("plain", a[10])))
    monkeypatch.setattr(mod, "_run_backward_fast", lambda *a, **k: taken.append(("fast", a[10], a[11:])))
    args, grads = _bwd_args()
    extra = (37, 0, 0.0)
    for mode in (2, 1):
        mod._bwd_host(*args, *grads, mode, None, extra)
    assert taken == ([("fast", 2, (None, extra)), ("fast", 1, (None, extra))] if on else
                     [("plain", 2), ("plain", 1)])


def _kv(b, hkv, sk, seed):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(b, hkv, sk, 128, generator=g) * torch.rand(b, hkv, 1, 1, generator=g) * 4).bfloat16()
    v = (torch.randn(b, hkv, sk, 128, generator=g) * torch.rand(b, hkv, sk, 1, generator=g) * 3).bfloat16()
    k[0, 0, sk - 1, 5] = 50.0  # the largest |K| of head 0 in the last (partial) block
    return k, v


@pytest.mark.parametrize("b,hkv,sk,block", [(2, 3, 333, 64), (1, 1, 64, 64), (1, 2, 65, 64), (1, 2, 333, 32),
                                             (1, 1, 200, 128)])
def test_the_bound_kernel_is_the_plain_path_s_bound(b, hkv, sk, block):
    """max|K| bit for bit, max_j |V_j|_2 to float32 rounding (the plain path rounds each norm to bf16), over rows
    not a multiple of the kernel's 64; NaN in K or V gives +inf; maxima accumulate over what KVB held (zeros)."""
    mod = _module()
    k, v = _kv(b, hkv, sk, sk)
    kvb = torch.zeros(b * hkv * 2)
    mod._bwd_kv_bound_rows[(triton.cdiv(sk, block), b * hkv)](k, v, kvb, sk, HEAD_DIM=128, BLOCK=block)
    want = mod._bwd_kv_bound(k, v).reshape(-1, 2)
    got = kvb.view(-1, 2)
    assert torch.equal(got[:, 0], want[:, 0])
    exact = torch.linalg.vector_norm(v.double(), dim=-1).amax(-1).reshape(-1)
    torch.testing.assert_close(got[:, 1].double(), exact, rtol=1e-6, atol=0)
    torch.testing.assert_close(got[:, 1], want[:, 1], rtol=1e-2, atol=0)  # bf16-rounded norms
    k[0, 0, 3, 7], v[-1, -1, sk - 1, 0] = float("nan"), float("nan")
    kvb.zero_()
    mod._bwd_kv_bound_rows[(triton.cdiv(sk, block), b * hkv)](k, v, kvb, sk, HEAD_DIM=128, BLOCK=block)
    got = kvb.view(-1, 2)
    assert got[0, 0] == float("inf") and got[-1, 1] == float("inf")
    assert torch.isfinite(got[1:, 0]).all() and torch.isfinite(got[:-1, 1]).all()


@pytest.fixture
def window_fast(monkeypatch):
    """(module, fakes) of the product's window render with fast launches and its kernels faked."""
    mod = _module()
    extra = (37, 0, 0.0)
    real, epi_tma = mod._BWD_KERNELS[2]
    fakes = {"pre": _JIT(mod._bwd_preprocess, (7, 12)), "conv": _JIT(mod._dq_convert, (5, 8)),
             "main": _JIT(real, 18 + len(extra), MAIN_META + ([dict(MAIN_META[0])] * 2 if epi_tma else [])),
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


def test_the_window_s_fast_launches_are_the_plain_path_s(window_fast):
    """Mode 2 of the window render on the fast path: the plain path's main kernel, grid and arguments (the switches'
    values appended; delta and the qmul rows in one descriptor, Sem its qmul half, an int32 accumulator); KVB the
    workspace's, written by the bound kernel; the accumulator zero when the main kernel starts."""
    mod, fakes = window_fast
    args, grads = _bwd_args(sq=300, sk=333, b=2, h=2)
    extra = fakes["extra"]
    for _ in range(2):  # the second call on kept views and a kept entry, its accumulator dirty from the first
        mod._run_backward_fast(*args, *grads, 2, None, extra)
        acc = fakes["main"].compiles[0][1][6].base
        assert acc.dtype == torch.int32 and torch.count_nonzero(acc) == 0
        acc.fill_(3)
    mod._run_backward(*args, *grads, 2, None, extra)
    (g_fast, fast, c_fast), (g_plain, plain, c_plain) = fakes["main"].compiles  # the fast one compiled once
    assert g_fast == g_plain and c_fast == c_plain and c_fast["DQ_MODE"] == 2
    assert tuple(fast[18:]) == extra and tuple(plain[18:]) == extra
    _same_launch(fast, plain)
    dm = fast[5].base  # delta and qmul rows in one [2 * B * Hq, sq_pad] descriptor; Sem its qmul half
    assert dm.shape == (2 * 2 * 2, 320) and fast[9].data_ptr() == dm[4:].data_ptr()
    (_, pre_f, kw_f), (_, pre_p, kw_p) = fakes["pre"].compiles
    assert pre_f[11] == kw_p["GQA"]
    kvb = pre_f[10]
    assert torch.equal(kvb[:8].view(4, 2), kw_p["KVB"].reshape(4, 2))  # the plain bound
    assert kvb.data_ptr() == acc.data_ptr() + acc.numel() * 4  # the workspace's, after the accumulator
    assert pre_f[9].data_ptr() == fast[9].data_ptr() and pre_f[3].data_ptr() == dm.data_ptr()
    assert fakes["bound"][0] == ((6, 4), 333, {"HEAD_DIM": 128, "BLOCK": 64, "num_warps": 4})
    assert len(fakes["bound"]) == 2  # the two fast calls (the plain path's: torch)
    ((_, conv_f, _), (_, conv_p, kc_p)) = fakes["conv"].compiles
    assert conv_f[0].dtype == torch.int32 and conv_f[7].data_ptr() == fast[9].data_ptr()
    assert conv_f[1].data_ptr() == grads[0].data_ptr() and kc_p["QMul"].numel() == conv_f[7].numel()


def test_variant_bwd_window_reaches_window_renders_only(monkeypatch):
    """variant["bwd_window"] (the selection hook) applies to a backward with the window switch alone."""
    monkeypatch.setitem(backends.GLUON.variant, "bwd_window", dict(LEVER))
    for fields, takes in ((WINDOW_SPEC, True), ({**WINDOW_SPEC, "softcap": True}, False),
                          ({**WINDOW_SPEC, "window": False}, False), ({**WINDOW_SPEC, "direction": "fwd"}, False)):
        got = backends.GLUON.variant_for(fagen.KernelSpec(**fields))
        assert (got.get("bwd_window_fixed") == 1 and got.get("bwd_fixed_tma") == 1) == takes, fields
    render.render.cache_clear()
    try:
        src = render.render(fagen.KernelSpec(**WINDOW_SPEC)).files[".py"]
    finally:
        render.render.cache_clear()
    assert "BWD_DET_MODE = 2" in src and "BWD_FIXED_TMA = 1" in src
