"""The window render's calls on the Gluon backward's fast host path ([Note] Switches on the fast backward path in
fagen/templates/host/gluon_bwd_launch.py): with _BWD_FAST_SWITCHES on, _bwd_host takes the fast path for a window
render and launches the plain path's kernels with the plain path's arguments (the switches' values appended to
the main kernel's), in the deterministic, unordered and fixed-point (mode 2) modes; off (the default), the plain
path. The same for the d128 default's mode 2 (the qmul rows by TMA: [Note] Fixed-point dQ on the fast path) with
_BWD_FAST_FIXED, in its plain calls and its prefix render's (variant bwd_prefix_tma). Kernels and the TMA encoder are
fakes (test_gluon_bwd_host.py's), so this runs on the CPU."""

import pytest
import torch
import triton
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

import fagen
from fagen import backends
from fagen.codegen import render
from fagen.runtime.loader import load_source
from test_gluon_bwd_host import MAIN_META, _bwd_args, _desc_key, _JIT
from test_hostpath import _Fill

WINDOW_SPEC = dict(backend="gluon", direction="bwd", head_dim=128, mask="causal", dtype="bf16", window=True)


def _fixed_module(fixed=1):
    """The window render with the fixed-point dQ (variant bwd_window_fixed 1; 0: the chain's render), without the
    window's own keys (variant bwd_window: the eleventh session's render has a host path of its own)."""
    from fagen import backends
    from fagen.codegen.render import render
    from fagen.runtime.loader import load_source

    spec = fagen.KernelSpec(**WINDOW_SPEC)
    saved = {k: backends.GLUON.variant[k] for k in ("bwd_window_fixed", "bwd_window")}
    backends.GLUON.variant.update(bwd_window_fixed=fixed, bwd_window={})
    render.cache_clear()
    try:
        src = render(spec).files[".py"]
    finally:
        backends.GLUON.variant.update(saved)
        render.cache_clear()
    assert ("BWD_DET_MODE = 2" in src and "BWD_FIXED_FAST = 1" in src) == bool(fixed)
    return load_source(src, spec.name + "_fixed_test" * fixed)


@pytest.fixture(params=[(0, "window"), (1, "window"), (2, "window"), (0, "prefix"), (1, "prefix"), (2, "prefix"),
                        (2, "tma"), (1, "tma-prefix"), (2, "tma-prefix")],
                ids=["det", "unordered", "fixed", "prefix-det", "prefix-unordered", "prefix-fixed", "tma-fixed",
                     "tma-prefix-unordered", "tma-prefix-fixed"])
def window_bwd(request, monkeypatch):
    """(module, mode, fakes) of the window render (or the causal render with bwd_prefix 2, [Note] Prefix rows in the
    backward: its mode 2 beside the chain; or the d128 default, its mode 2 with the qmul rows by TMA, without and
    with the prefix argument) with fast launches and its kernels faked; fakes["kind"] names which."""
    mode, kind = request.param
    if kind.startswith("tma"):  # the d128 default render (bwd_fixed_tma), with bwd_prefix_tma for the prefix
        monkeypatch.setitem(backends.GLUON.variant, "bwd_prefix_tma", int(kind == "tma-prefix"))
        render.render.cache_clear()
        spec = fagen.KernelSpec(**{**WINDOW_SPEC, "window": False})
        mod = load_source(fagen.generate(spec), spec.name + "_" + kind.replace("-", "_") + "_host")
        render.render.cache_clear()
        assert mod.BWD_FIXED_TMA == 1 and mod.BWD_FIXED_FAST == 1 and mod.BWD_DET_MODE == 2
        assert mod.BWD_PREFIX == int(kind == "tma-prefix")
    elif kind == "prefix":
        # the chain's render (bwd_d128 {}) with bwd_prefix 2: mode 2 without the TMA rows, beside the chain
        monkeypatch.setitem(backends.GLUON.variant, "bwd_d128", {})
        render.render.cache_clear()
        spec = fagen.KernelSpec(**{**WINDOW_SPEC, "window": False})
        mod = load_source(fagen.generate(spec), spec.name + "_prefix_host")
        render.render.cache_clear()
        assert mod.BWD_PREFIX == 1 and mod.BWD_PREFIX_MODE == 2 and mod.BWD_DET_MODE == 0
    else:
        mod = _fixed_module(int(mode == 2))
    extra = {"window": (37, 0, 0.0), "tma": ()}.get(kind, (83, ))
    real, epi_tma = mod._BWD_KERNELS[mode]
    # mode 2's fast pre- and postprocess take QMul, KVB (and GQA) positionally ([Note] Fixed-point dQ on the fast path)
    fakes = {"pre": _JIT(mod._bwd_preprocess, (7, 12)), "conv": _JIT(mod._dq_convert, (5, 8)),
             "main": _JIT(real, 18 + len(extra), MAIN_META + ([dict(MAIN_META[0])] * 2 if epi_tma else [])),
             "extra": extra, "kind": kind}
    for name, value in (("_FAST_LAUNCH", True), ("_KERNELS", {}), ("_BWD_WS", type(mod._BWD_WS)()),
                        ("_GLUON_FAST", True), ("_raw_stream", lambda device: 77),
                        ("_bwd_preprocess", fakes["pre"]), ("_dq_convert", fakes["conv"]),
                        ("_BWD_KERNELS", {mode: (fakes["main"], epi_tma)}),
                        ("_fast_bwd_preprocess", mod._gluon(fakes["pre"])),
                        ("_fast_dq_convert", mod._gluon(fakes["conv"])),
                        ("_fast_bwd_kernels", {mode: (mod._gluon(fakes["main"]), epi_tma)}),
                        ("_fast_kv_bound", _Bound(mod, fakes))):
        monkeypatch.setattr(mod, name, value)
    monkeypatch.setitem(mod._NUM_SMS, -1, 132)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: -1)  # the plain path's device of a CPU tensor
    fakes["fill"] = _Fill()
    monkeypatch.setattr(triton.runtime.driver, "_active", fakes["fill"])
    return mod, mode, fakes


class _Bound:
    """The bound kernel ([Note] The bound kernel): the plain path's torch bound maxed into KVB, its launch recorded."""

    def __init__(self, mod, fakes):
        self.mod, self.calls = mod, fakes.setdefault("bound", [])

    def __getitem__(self, grid):
        def call(k, v, kvb, sk, **consts):
            self.calls.append((grid, sk, consts))
            want = self.mod._bwd_kv_bound(k, v).reshape(-1)
            kvb[:want.numel()] = torch.maximum(kvb[:want.numel()], want)
        return call


def _same_launch(a, b):
    """Two launches' arguments alike: descriptors by what they describe, tensors by dtype and size (workspaces are
    fresh on the plain path), the rest equal."""
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(y, TensorDescriptor):
            assert isinstance(x, TensorDescriptor) and _desc_key(x) == _desc_key(y), i
        elif isinstance(y, torch.Tensor):
            assert isinstance(x, torch.Tensor) and x.dtype == y.dtype, i
            assert x.numel() >= y.numel() if i == 9 else x.numel() == y.numel(), i
        else:
            assert type(x) is type(y) and x == y, i


@pytest.mark.parametrize("switches,fixed", [(False, False), (True, False), (False, True), (True, True)])
def test_window_calls_take_the_fast_path_only_when_switched_on(window_bwd, monkeypatch, switches, fixed):
    """A window render's calls: fast with _BWD_FAST_SWITCHES; a prefix render's: always, but mode 2 of a render with
    the qmul rows by TMA, which (as its plain calls) takes it with _BWD_FAST_FIXED only."""
    mod, mode, fakes = window_bwd
    monkeypatch.setattr(mod, "_BWD_FAST_SWITCHES", switches)
    monkeypatch.setattr(mod, "_BWD_FAST_FIXED", fixed)
    taken = []
    monkeypatch.setattr(mod, "_run_backward_fast", lambda *a, **k: taken.append("fast"))
    monkeypatch.setattr(mod, "_run_backward", lambda *a, **k: taken.append("plain"))
    args, grads = _bwd_args()
    if fakes["extra"]:
        mod._bwd_host(*args, *grads, mode, None, fakes["extra"])
    else:  # the plain call of a render without switches or prefix
        mod._bwd_host(*args, *grads, mode)
    kind = fakes["kind"]
    want = switches if kind == "window" else fixed if kind.startswith("tma") and mode == 2 else True
    assert taken == ["fast" if want else "plain"]


def test_the_fast_window_launches_are_the_plain_path_s(window_bwd):
    """The same kernels, grids and arguments on both paths: the window's (win_left, win_right, cap_in) after the
    main kernel's sq_pad; mode 2's int32 accumulator and qmul rows (Sem) and its pre/postprocess keywords."""
    mod, mode, fakes = window_bwd
    args, grads = _bwd_args()
    extra = fakes["extra"]
    mod._run_backward_fast(*args, *grads, mode, None, extra)
    mod._run_backward(*args, *grads, mode, None, extra)
    (g_fast, fast, c_fast), (g_plain, plain, c_plain) = fakes["main"].compiles
    assert g_fast == g_plain and c_fast == c_plain
    assert tuple(fast[18:]) == extra and tuple(plain[18:]) == extra
    _same_launch(fast, plain)
    if mode == 2:
        assert fast[6].base.dtype == torch.int32 and fast[9].dtype == torch.float32  # the accumulator, the qmul rows
    for name in ("pre", "conv"):  # by name: mode 2's fast path passes QMul, KVB positionally
        (ga, _, _), (gb, _, _) = fakes[name].compiles
        fa, pb = fakes[name].bound(0), fakes[name].bound(1)
        assert ga == gb and fa.keys() == pb.keys(), name
        for key, y in pb.items():
            x = fa[key]
            if key == "KVB" and y is not None:  # the workspace's KVB ([Note] The bound kernel): the plain bound
                assert torch.equal(x.reshape(-1)[:y.numel()], y.reshape(-1)), (name, key)
                continue
            assert (x.dtype, x.numel()) == (y.dtype, y.numel()) if isinstance(y, torch.Tensor) \
                else type(x) is type(y) and x == y, (name, key)
    if mode == 2:  # QMul: the same rows written by the preprocess and read by the conversion and the main kernel
        pre = fakes["pre"].bound(0)
        qmul = pre["QMul"]
        assert fakes["conv"].bound(0)["QMul"] is qmul and fast[9] is qmul
        if mod.BWD_FIXED_TMA:  # d_desc: delta, then the qmul rows ([Note] qmul rows by TMA)
            rows = fast[5].base
            assert rows.data_ptr() == pre["Delta"].data_ptr() and rows.shape[0] == 2 * pre["Delta"].shape[0]
            assert rows[rows.shape[0] // 2:].data_ptr() == qmul.data_ptr()
        else:
            assert fast[5].base.data_ptr() == pre["Delta"].data_ptr()


def test_warm_fast_calls_launch_without_compiling(window_bwd):
    """Every launch of a warm call goes to the launcher's C entry point: one compile (fn[grid]) per kernel over three
    calls, the later calls' bytes alike (mode 2's QMul / KVB positional: a tensor among the keywords would be a new
    launch key per call)."""
    mod, mode, fakes = window_bwd
    args, grads = _bwd_args()
    for _ in range(3):
        mod._run_backward_fast(*args, *grads, mode, None, fakes["extra"])
    for name in ("pre", "main", "conv"):
        assert len(fakes[name].compiles) == 1, name
        assert len(fakes[name].launcher.raw) == 3, name


def test_the_tma_rows_render_marks_its_delta_rows():
    """The d128 default (qmul rows by TMA) takes mode 2's delta and qmul rows as one descriptor: BWD_FIXED_TMA tells
    the fast path so ([Note] Fixed-point dQ on the fast path); the render without the TMA rows takes delta alone."""
    src = fagen.generate(fagen.KernelSpec(backend="gluon", direction="bwd", head_dim=128, mask="causal", dtype="bf16"))
    assert "BWD_DET_MODE = 2" in src and "BWD_FIXED_FAST = 1" in src and "BWD_FIXED_TMA = 1" in src
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(backends.GLUON.variant, "bwd_d128", {"bwd_fixed": 1})
        render.render.cache_clear()
        try:
            src = fagen.generate(fagen.KernelSpec(backend="gluon", direction="bwd", head_dim=128, mask="causal",
                                                  dtype="bf16"))
        finally:
            render.render.cache_clear()
    assert "BWD_DET_MODE = 2" in src and "BWD_FIXED_FAST = 1" in src and "BWD_FIXED_TMA = 0" in src
