"""The window render's fixed-point backward on its fast host path ([Note] Window fixed-point fast path in
fagen/templates/host/gluon_bwd_window.py): the bound kernel against the plain path's torch bound (CPU interpreter),
and, with the kernels faked (test_gluon_bwd_host.py's fakes), the path's launches against the plain path's: the same
kernels, grids and arguments, the qmul rows beside delta in one row descriptor, taken only when switched on."""

import pytest
import torch
import triton
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

import fagen
from _env import ON_GPU
from fagen import backends
from fagen.codegen import render
from fagen.runtime.loader import load_source
from test_gluon_bwd_host import MAIN_META, _bwd_args, _desc_key, _JIT
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


def test_only_the_window_fixed_tma_render_has_the_path():
    mod = _module()
    assert mod.BWD_DET_MODE == 2 and mod._BWD_WINDOW_FAST is True
    for lever in ({"bwd_window": {}, "bwd_window_fixed": 1}, {"bwd_window": {}, "bwd_fixed_tma": 1},
                  {"bwd_window": {}}):
        spec = fagen.KernelSpec(**WINDOW_SPEC)
        saved = {k: backends.GLUON.variant[k] for k in lever}
        backends.GLUON.variant.update(lever)
        render.render.cache_clear()
        try:
            assert "_run_backward_window" not in render.render(spec).files[".py"], lever
        finally:
            backends.GLUON.variant.update(saved)
            render.render.cache_clear()


@pytest.mark.parametrize("b,hkv,sk,block", [(2, 3, 333, 64), (1, 1, 64, 64), (1, 2, 65, 64), (1, 2, 333, 32),
                                             (1, 1, 200, 128)])
def test_the_bound_kernel_is_the_plain_path_s_bound(b, hkv, sk, block):
    """max|K| bit for bit, max_j |V_j|_2 to float32 rounding (the plain path rounds each norm to bf16), over rows
    not a multiple of the kernel's 64; NaN in K or V gives +inf; maxima accumulate over what KVB held (zeros)."""
    mod = _module()
    g = torch.Generator().manual_seed(sk)
    k = (torch.randn(b, hkv, sk, 128, generator=g) * torch.rand(b, hkv, 1, 1, generator=g) * 4).bfloat16()
    v = (torch.randn(b, hkv, sk, 128, generator=g) * torch.rand(b, hkv, sk, 1, generator=g) * 3).bfloat16()
    k[0, 0, sk - 1, 5] = 50.0  # the largest |K| of head 0 in the last (partial) block
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
    """(module, fakes) of the window fixed-tma render with fast launches and its kernels faked."""
    mod = _module()
    extra = (37, 0, 0.0)
    real, epi_tma = mod._BWD_KERNELS[2]
    fakes = {"pre": _JIT(mod._bwd_preprocess, 7), "conv": _JIT(mod._dq_convert, 5),
             "main": _JIT(real, 18 + len(extra), MAIN_META + ([dict(MAIN_META[0])] * 2 if epi_tma else [])),
             "pre_w": _JIT(mod._bwd_preprocess_w, 9), "conv_w": _JIT(mod._dq_convert_w, 6),
             "extra": extra, "bound": []}

    class _Bound:  # the bound kernel: the plain path's bound into KVB, recorded
        def __getitem__(self, grid):
            def call(k, v, kvb, sk, **consts):
                fakes["bound"].append((grid, sk, consts))
                kvb.copy_(torch.maximum(kvb, mod._bwd_kv_bound(k, v).reshape(-1)))
            return call

    for name, value in (("_FAST_LAUNCH", True), ("_KERNELS", {}), ("_BWD_WWS", type(mod._BWD_WWS)()),
                        ("_GLUON_FAST", True), ("_raw_stream", lambda device: 77),
                        ("_bwd_preprocess", fakes["pre"]), ("_dq_convert", fakes["conv"]),
                        ("_BWD_KERNELS", {2: (fakes["main"], epi_tma)}),
                        ("_fast_bwd_kernels", {2: (mod._gluon(fakes["main"]), epi_tma)}),
                        ("_fast_kv_bound", _Bound()), ("_fast_pre_w", mod._gluon(fakes["pre_w"])),
                        ("_fast_conv_w", mod._gluon(fakes["conv_w"]))):
        monkeypatch.setattr(mod, name, value)
    monkeypatch.setitem(mod._NUM_SMS, -1, 132)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: -1)
    monkeypatch.setattr(triton.runtime.driver, "_active", _Fill())
    return mod, fakes


@pytest.mark.parametrize("on", [False, True])
def test_mode_2_takes_the_window_path_only_when_switched_on(window_fast, monkeypatch, on):
    mod, fakes = window_fast
    monkeypatch.setattr(mod, "_BWD_WINDOW_FAST", on)
    taken = []
    monkeypatch.setattr(mod, "_run_backward_window", lambda *a, **k: taken.append("window"))
    monkeypatch.setattr(mod, "_run_backward", lambda *a, **k: taken.append("plain"))
    monkeypatch.setattr(mod, "_run_backward_fast", lambda *a, **k: taken.append("fast"))
    args, grads = _bwd_args()
    for mode in (2, 1, 0):
        mod._bwd_host(*args, *grads, mode, None, fakes["extra"])
    # mode 1 on the fast path's unordered launches when on; mode 0 as before (plain: _BWD_FAST_SWITCHES is off)
    assert taken == ["window", "fast", "plain"] if on else ["plain", "plain", "plain"]


def test_the_window_path_launches_the_plain_path_s_kernels_and_arguments(window_fast):
    mod, fakes = window_fast
    args, grads = _bwd_args(sq=300, sk=333, b=2, h=2)
    extra = fakes["extra"]
    for _ in range(2):  # the second call on kept views and a kept entry
        mod._run_backward_window(*args, *grads, None, extra)
    mod._run_backward(*args, *grads, 2, None, extra)
    (g_fast, fast, c_fast), (g_plain, plain, c_plain) = fakes["main"].compiles  # the fast one compiled once
    assert g_fast == g_plain and c_fast == c_plain and c_fast["DQ_MODE"] == 2
    assert len(fast) == len(plain) and tuple(fast[-3:]) == extra
    for i, (x, y) in enumerate(zip(fast, plain)):
        if isinstance(y, TensorDescriptor):
            assert isinstance(x, TensorDescriptor) and _desc_key(x) == _desc_key(y), i
        elif isinstance(y, torch.Tensor):
            assert x.dtype == y.dtype and x.numel() == y.numel(), i  # Sem: the qmul rows (a pointer)
        else:
            assert type(x) is type(y) and x == y, i
    # delta and qmul rows in one [2 * B * Hq, sq_pad] descriptor; Sem is its qmul half; an int32 accumulator
    dm = fast[5].base
    assert dm.shape == (2 * 2 * 2, 320) and fast[9].data_ptr() == dm[4:].data_ptr()
    assert fast[6].base.dtype == torch.int32 and torch.count_nonzero(fast[6].base) == 0
    assert fakes["bound"][0] == ((6, 4), 333, {"HEAD_DIM": 128, "BLOCK": 64, "num_warps": 4})
    # the pre- and postprocess: the plain path's kernels (inlined in the wrappers) with the same values, QMul and
    # KVB positional; compiled once, then through the launcher's entry
    ((gf, pf, cf), ), ((gp, pp, cp), ) = fakes["pre_w"].compiles, fakes["pre"].compiles
    assert gf == gp and len(fakes["pre_w"].launcher.raw) == 2
    assert [type(x) for x in pf[:7]] == [type(x) for x in pp] and pf[5:7] == pp[5:7]
    assert torch.equal(pf[8], cp["KVB"].reshape(-1)) and pf[7].data_ptr() == fast[9].data_ptr()
    assert pf[3].data_ptr() == dm.data_ptr() and pf[3].shape == (4, 320)
    assert {k: cf[k] for k in ("HEAD_DIM", "BLOCK_M", "GQA")} == {k: cp[k] for k in ("HEAD_DIM", "BLOCK_M", "GQA")}
    ((gf, vf, kf), ), ((gp, vp, kp), ) = fakes["conv_w"].compiles, fakes["conv"].compiles
    assert gf == gp and vf[2:5] == vp[2:5] and vf[0].dtype == torch.int32 and vf[5].data_ptr() == fast[9].data_ptr()
    assert vf[1].data_ptr() == grads[0].data_ptr() and kp["QMul"].numel() == vf[5].numel()


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
    assert "BWD_DET_MODE = 2" in src and "_run_backward_window" in src
