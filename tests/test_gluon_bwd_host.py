"""The Gluon backward's fast host path ([Note] Gluon backward host path in fagen/templates/host/gluon_bwd_launch.py):
its launches hand the launcher's C entry point exactly what triton's descriptor wrapper makes of the plain path's
TensorDescriptors, its descriptors are the plain path's (_run_backward), its workspaces are kept per stream, zeroed
per call, and fresh under CUDA graph capture. The kernels and the TMA encoder are fakes (as in test_hostpath.py), so
this runs on the CPU; scripts/gpu_gluon_bwd_host.py runs the real ones."""

import threading

import pytest
import torch
import triton
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

import fagen
from fagen import backends
from fagen.codegen import render
from fagen.runtime.loader import load_source
from test_hostpath import _Fill
from test_launch import _same

# the descriptors' tensordesc_meta of the bf16 d128 backward, as compile_backward_for() reports them: q, dO
# [1, 1, 64, 64] and k, v [1, 1, 128, 64] bf16 (swizzle 3: 128 bytes), lse2 / delta [1, 64] float32 (none), the dQ
# accumulator [1, 1, 64, 32] float32 (128 bytes)
BF16 = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "fp4_padded": False}
F32 = {"swizzle": 0, "elem_size": 4, "elem_type": 7, "fp4_padded": False}
MAIN_META = [dict(BF16, block_size=[1, 1, 64, 64])] * 2 + [dict(BF16, block_size=[1, 1, 128, 64])] * 2 \
    + [dict(F32, block_size=[1, 64])] * 2 + [dict(F32, swizzle=3, block_size=[1, 1, 64, 32])]
EPI_META = [dict(BF16, block_size=[1, 1, 64, 64])] * 2  # dK, dV by TMA stores (the unordered causal kernel)


class _Launcher:
    """triton 3.6's CudaLauncher of one compiled kernel: launch is wrap_handle_tensordesc's wrapper around a recorder
    (no wrapper where the kernel takes no descriptor)."""

    def __init__(self, arg_names, n_args, metas):
        from triton.backends.nvidia.driver import wrap_handle_tensordesc
        self.raw = []
        signature = {n: "tensordesc<bf16[1, 1, 64, 128]>" if i < len(metas) else "i32"
                     for i, n in enumerate(arg_names[:n_args])}
        self.launch = wrap_handle_tensordesc(self._record, signature, metas)  # the C entry point: no closure
        self.global_scratch_size = self.profile_scratch_size = 0
        self.num_ctas, self.launch_cooperative_grid, self.launch_pdl = 1, False, False

    def _record(self, *args):
        self.raw.append(args)

    def __call__(self, gx, gy, gz, stream, function, *args):
        self.launch(gx, gy, gz, stream, function, False, False, None, None, *args)


class _JIT:
    """A @gluon.jit kernel as _gluon_run and the plain path use it: fn[grid](...) compiles (recorded), launches.
    n_args: the positional arguments a call passes (a tuple: any of those counts)."""

    def __init__(self, real, n_args, metas=()):
        n_args = n_args if isinstance(n_args, tuple) else (n_args, )
        self.arg_names, self.n_args, self.metas, self.compiles = real.arg_names, n_args, list(metas), []
        self.launcher = _Launcher(self.arg_names, max(n_args), self.metas)

    def bound(self, i):
        """The i-th compile's arguments by name (positional and keyword alike)."""
        _, args, consts = self.compiles[i]
        return {**dict(zip(self.arg_names, args)), **consts}

    def __getitem__(self, grid):
        def compile_and_launch(*args, **consts):
            assert len(args) in self.n_args
            self.compiles.append((grid, args, consts))
            kernel = type("K", (), {})()
            kernel.run, kernel.function, kernel.packed_metadata = self.launcher, 1234, (4, 1, 0)
            kernel.metadata = type("M", (), {"tensordesc_meta": self.metas})()
            tail = [consts[n] for n in self.arg_names[len(args):]]
            self.launcher(*grid, *(1, ) * (3 - len(grid)), 77, 1234, (4, 1, 0), None, None, None, *args, *tail)
            return kernel
        return compile_and_launch


def _plain_render(mask):
    """The bf16 d128 gluon bwd module of `mask` without the prefix argument (variant bwd_prefix 0: the causal
    render's kernels then take the arguments below; tests/test_gluon_bwd_window_host.py covers the prefix render's)."""
    from fagen import backends
    from fagen.codegen import render
    from fagen.runtime.loader import load_source

    saved = backends.GLUON.variant["bwd_prefix"]
    backends.GLUON.variant["bwd_prefix"] = 0
    render.render.cache_clear()
    try:
        spec = fagen.KernelSpec(backend="gluon", direction="bwd", head_dim=128, mask=mask, dtype="bf16")
        return load_source(fagen.generate(spec), spec.name + "_noprefix")
    finally:
        backends.GLUON.variant["bwd_prefix"] = saved
        render.render.cache_clear()


@pytest.fixture(params=[(True, "causal"), (False, "causal"), (True, "none")], ids=["det", "unordered", "none"])
def gluon_bwd(request, monkeypatch):
    """The bf16 d128 gluon bwd module with fast launches on and its three kernels faked; (module, mode, fakes)."""
    deterministic, mask = request.param
    # the chain's render (bwd_d128 {}) without the prefix argument: modes 0 and 1 (mode 2 on the fast path, the
    # d128 default's with its qmul rows by TMA: test_gluon_bwd_window_host.py)
    monkeypatch.setitem(backends.GLUON.variant, "bwd_d128", {})
    mod = _plain_render(mask)
    mode = 0 if deterministic else 1
    real, epi_tma = mod._BWD_KERNELS[mode]
    fakes = {"pre": _JIT(mod._bwd_preprocess, 7), "conv": _JIT(mod._dq_convert, 5),
             "main": _JIT(real, 18, MAIN_META + (EPI_META if epi_tma else []))}
    for name, value in (("_FAST_LAUNCH", True), ("_KERNELS", {}), ("_BWD_WS", type(mod._BWD_WS)()),
                        ("_GLUON_FAST", True),
                        ("_raw_stream", lambda device: 77), ("_bwd_preprocess", fakes["pre"]),
                        ("_dq_convert", fakes["conv"]), ("_BWD_KERNELS", {mode: (fakes["main"], epi_tma)}),
                        ("_fast_bwd_preprocess", mod._gluon(fakes["pre"])),
                        ("_fast_dq_convert", mod._gluon(fakes["conv"])),
                        ("_fast_bwd_kernels", {mode: (mod._gluon(fakes["main"]), epi_tma)})):
        monkeypatch.setattr(mod, name, value)
    monkeypatch.setitem(mod._NUM_SMS, -1, 132)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    fakes["fill"] = _Fill()
    monkeypatch.setattr(triton.runtime.driver, "_active", fakes["fill"])
    return mod, mode, fakes


def _bwd_args(sq=300, sk=333, b=2, h=2, seed=0):
    """A backward's launch inputs (CPU tensors, dense and TMA-ready) and its outputs."""
    torch.manual_seed(seed)
    q, do, out = (torch.randn(b, h, sq, 128).bfloat16() for _ in range(3))
    k, v = (torch.randn(b, h, sk, 128).bfloat16() for _ in range(2))
    lse = torch.randn(b, h, sq)
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    return (do, q, k, v, out, lse, 0.0884), grads


def _desc_key(d):
    """What a TensorDescriptor is, without its base's address (the plain path's workspaces are fresh per call)."""
    return (d.base.dtype, tuple(d.base.shape), d.shape, d.strides, d.block_shape, d.layout)


def test_fast_path_launches_what_triton_s_wrapper_makes_of_the_plain_descriptors(gluon_bwd):
    mod, mode, fakes = gluon_bwd
    args, grads = _bwd_args()
    for _ in range(3):
        mod._run_backward_fast(*args, *grads, mode)
    for name in ("pre", "main", "conv"):  # compiled (through fn[grid]) once each, then the C entry point
        fake = fakes[name]
        assert len(fake.compiles) == 1, name
        wrapped, fast, again = fake.launcher.raw
        assert len(fast) == len(wrapped) and all(map(_same, fast, wrapped)), name
        assert fast == again, name  # the workspaces and maps are kept: a warm call launches the same bytes
    n_desc = len(fakes["main"].metas)
    assert sum(type(a) is tuple and a[0] == "map" for a in fakes["main"].launcher.raw[1]) == n_desc
    assert len(fakes["fill"].calls) == 2 * n_desc  # the wrapper's encodes, then the fast path's, kept after that


def test_fast_path_descriptors_are_the_plain_path_s(gluon_bwd, monkeypatch):
    """The first fast call's TensorDescriptors (built from its requests: default NVMMA layouts) against the plain
    _run_backward's (the template's explicit accumulator and row layouts): equal but for the workspaces' addresses;
    every other argument equal (the counters' shape aside: the kernel reads them flat)."""
    mod, mode, fakes = gluon_bwd
    args, grads = _bwd_args()
    mod._run_backward_fast(*args, *grads, mode)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: -1)  # the plain path's device of a CPU tensor
    mod._run_backward(*args, *grads, mode)
    (_, fast, fast_c), (_, plain, plain_c) = fakes["main"].compiles
    assert fast_c == plain_c
    for i, (a, b) in enumerate(zip(fast, plain)):
        if isinstance(b, TensorDescriptor):
            assert isinstance(a, TensorDescriptor) and _desc_key(a) == _desc_key(b), i
            if i < 4 or i > 6:  # q, dO, k, v (dK, dV): the inputs themselves
                assert a.base is b.base
        elif isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and (a is b or i == 9), i  # Sem: the kept counters
            if i == 9:
                assert a.numel() >= b.numel() and not a.any()
        else:
            assert type(a) is type(b) and a == b, i
    assert fakes["main"].compiles[0][0] == fakes["main"].compiles[1][0]  # the grid
    for name in ("pre", "conv"):
        (ga, fa, ca), (gb, pb, cb) = fakes[name].compiles
        assert ga == gb and ca == cb and len(fa) == len(pb)
        for x, y in zip(fa, pb):  # delta and lse2 go as [B * H, sq_pad] views of the workspace, [B, H, sq_pad] there
            assert (x.dtype, x.numel()) == (y.dtype, y.numel()) if isinstance(y, torch.Tensor) \
                else type(x) is type(y) and x == y


def test_the_three_launches_share_their_workspaces_as_the_plain_path_does(gluon_bwd):
    """delta and lse2 written by the preprocess are the rows the main kernel reads (d_desc, l_desc), the dQ
    accumulator it adds into is the one the conversion reads, and dQ goes to the caller's buffer."""
    mod, mode, fakes = gluon_bwd
    args, grads = _bwd_args()
    mod._run_backward_fast(*args, *grads, mode)
    (_, pre, _), = fakes["pre"].compiles
    (_, main, _), = fakes["main"].compiles
    (_, conv, _), = fakes["conv"].compiles
    names = fakes["main"].arg_names
    ptr = {name: (a.base if isinstance(a, TensorDescriptor) else a).data_ptr() for name, a in zip(names, main)
           if isinstance(a, (TensorDescriptor, torch.Tensor))}
    assert (pre[3].data_ptr(), pre[4].data_ptr()) == (ptr["d_desc"], ptr["l_desc"])  # Delta, Lse2
    assert pre[0] is args[4] and pre[1] is args[0] and pre[2] is args[5]  # O, dO, Lse
    assert conv[0].data_ptr() == ptr["dq_desc"] and conv[1] is grads[0]
    assert [ptr[n] for n in ("q_desc", "do_desc", "k_desc", "v_desc")] == [args[i].data_ptr() for i in (1, 0, 2, 3)]
    assert (ptr["DK"], ptr["DV"]) == (grads[1].data_ptr(), grads[2].data_ptr())


def test_the_template_s_workspace_layouts_are_the_default_ones():
    """The fast path names the accumulator's and the rows' descriptors by box alone (get_default_for), the plain
    path by an explicit layout: they must agree, or the fast path would compile another kernel."""
    acc = torch.empty(1, 2, 128, 128)
    rows = torch.empty(1, 2, 128)
    mod = fagen.load(fagen.KernelSpec(backend="gluon", direction="bwd", head_dim=128, mask="causal", dtype="bf16"))
    assert mod._tensor_descriptor(acc, (1, 1, 64, 64)).layout == mod._bwd_acc_descriptor(acc).layout
    assert mod._tensor_descriptor(rows.view(2, 128), (1, 64)).layout == mod._bwd_row_descriptor(rows).layout


def test_workspaces_are_kept_per_stream_zeroed_per_call_and_fresh_under_capture(gluon_bwd, monkeypatch):
    mod, mode, fakes = gluon_bwd
    args, grads = _bwd_args()
    mod._run_backward_fast(*args, *grads, mode)
    acc = fakes["main"].compiles[0][1][6].base  # the dQ accumulator, as the first (plain) launch saw it
    acc.fill_(3.0)  # what a kernel leaves in it
    mod._run_backward_fast(*args, *grads, mode)
    assert not acc.any()  # zeroed again by the next call, in place
    ((_, (buf, views)), ) = mod._BWD_WS.__dict__.items()
    assert acc.data_ptr() == buf.data_ptr() and len(views) == 1
    monkeypatch.setattr(mod, "_raw_stream", lambda device: 78)  # another stream: its own buffer
    mod._run_backward_fast(*args, *grads, mode)
    assert len(mod._BWD_WS.__dict__) == 2
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    before = {k: v[0].data_ptr() for k, v in mod._BWD_WS.__dict__.items()}
    mod._run_backward_fast(*args, *grads, mode)
    assert {k: v[0].data_ptr() for k, v in mod._BWD_WS.__dict__.items()} == before  # nothing kept from a capture
    captured = fakes["main"].launcher.raw[-1]
    pointers = [a for a in captured if type(a) is int] + [a[1] for a in captured if type(a) is tuple]
    assert pointers and not set(before.values()) & set(pointers)  # no kept buffer in the captured launch
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(mod, "_BWD_WS_KEEP", 1 << 10)  # a call above the kept size allocates its own
    mod._run_backward_fast(*args, *grads, mode)
    assert {k: v[0].data_ptr() for k, v in mod._BWD_WS.__dict__.items()} == before


def test_the_mods_window_row_s_workspace_is_kept(gluon_bwd):
    """The workspace of the mods suite's window row (B1 H16 S8192 d128: 68 MB) is kept per stream, not allocated
    per call: a fresh buffer costs its views again, about 100 us of host a call on the H100 (seventeenth session,
    scripts/gpu_window_host_s17.py --ab: 307 against 412 us), with the same GPU time."""
    mod, mode, _ = gluon_bwd
    q = torch.empty(1, 16, 8192, 128, dtype=torch.bfloat16)
    first = mod._bwd_workspace(1, 16, 8192, mode, q, 16)
    again = mod._bwd_workspace(1, 16, 8192, mode, q, 16)
    assert again[0].data_ptr() == first[0].data_ptr() and all(a is b for a, b in zip(first, again))
    ((_, (buf, views)), ) = mod._BWD_WS.__dict__.items()
    assert buf.data_ptr() == first[0].data_ptr() and len(views) == 1


class _Spy:
    """A fast launcher that records, per launch, whether the dQ accumulator held anything but zeros."""

    def __init__(self, inner, name, acc, seen):
        self.inner, self.name, self.acc, self.seen = inner, name, acc, seen

    def __getitem__(self, grid):
        launch = self.inner[grid]

        def call(*args, **consts):
            self.seen[self.name] = bool(self.acc.any())
            return launch(*args, **consts)
        return call


def test_the_fill_precedes_the_preprocess_and_the_main_kernel(gluon_bwd, monkeypatch):
    """The accumulator's fill comes first (the eleventh session's late fill, after the preprocess, won nothing on the
    H100 and was removed): neither the preprocess nor the main kernel sees the last call's values."""
    mod, mode, fakes = gluon_bwd
    args, grads = _bwd_args()
    mod._run_backward_fast(*args, *grads, mode)
    acc = fakes["main"].compiles[0][1][6].base
    seen = {}
    monkeypatch.setattr(mod, "_fast_bwd_preprocess", _Spy(mod._fast_bwd_preprocess, "pre", acc, seen))
    monkeypatch.setattr(mod, "_fast_bwd_kernels", {m: (_Spy(k, "main", acc, seen), e)
                                                   for m, (k, e) in mod._fast_bwd_kernels.items()})
    acc.fill_(3.0)  # what the last call's kernel left
    mod._run_backward_fast(*args, *grads, mode)
    assert seen == {"pre": False, "main": False}


def test_another_thread_gets_its_own_workspace(gluon_bwd):
    """Two threads may launch on one stream; their calls' fills and kernels could interleave there, so each thread
    keeps its own buffer."""
    mod, mode, fakes = gluon_bwd
    args, grads = _bwd_args()
    mod._run_backward_fast(*args, *grads, mode)
    seen = []
    thread = threading.Thread(target=lambda: (mod._run_backward_fast(*args, *grads, mode),
                                              seen.append(fakes["main"].launcher.raw[-1])))
    thread.start()
    thread.join()
    ((_, (buf, _)), ) = mod._BWD_WS.__dict__.items()
    pointers = [a for a in seen[0] if type(a) is int] + [a[1] for a in seen[0] if type(a) is tuple]
    assert buf.data_ptr() not in pointers and fakes["main"].launcher.raw[-2] != seen[0]


def test_workspace_parts_are_disjoint_and_aligned():
    mod = fagen.load(fagen.KernelSpec(backend="gluon", direction="bwd", head_dim=128, mask="causal", dtype="bf16"))
    for b, hq, hkv, sq_pad, mode in ((1, 1, 1, 64, 0), (2, 3, 3, 320, 0), (3, 5, 5, 64, 1), (1, 7, 7, 192, 0),
                                     (2, 3, 3, 320, 2), (2, 8, 2, 64, 2), (1, 1, 1, 64, 2)):
        n = b * hq * sq_pad * (128 + 3) + max(b * hq * sq_pad // 64, 2 * b * hkv) + 8
        buf = torch.empty(n)
        zero, delta, lse2, acc, sem, qmul, dm, kvb = mod._bwd_views(buf, b, hq, hkv, sq_pad, mode)
        assert acc.shape == (b, hq, sq_pad, 128) and delta.shape == lse2.shape == qmul.shape == (b * hq, sq_pad)
        assert sem.dtype == torch.int32 and sem.numel() >= (b * hq * sq_pad // 64 if mode == 0 else 1)
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in (delta, lse2, acc, sem, qmul))
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # disjoint
        assert all(t.data_ptr() % 16 == 0 for t in (delta, lse2, acc, sem, qmul, kvb)) \
            and spans[-1][1] <= buf.data_ptr() + 4 * n
        # [Note] qmul rows by TMA: one [2 B Hq, sq_pad] view over delta, then the qmul rows
        assert dm.shape == (2 * b * hq, sq_pad) and dm.is_contiguous() and dm.data_ptr() == delta.data_ptr()
        assert dm[b * hq:].data_ptr() == qmul.data_ptr()
        assert zero.data_ptr() == acc.data_ptr() and zero.numel() * 4 >= spans[1][1] - spans[0][0]  # acc + sem
        if mode:  # [Note] The bound kernel: KVB in the counters' place, zeroed with the accumulator, before delta
            assert kvb.data_ptr() == acc.data_ptr() + acc.numel() * 4 and kvb.numel() >= 2 * b * hkv
            assert kvb.data_ptr() + kvb.numel() * 4 <= delta.data_ptr() and zero.numel() == acc.numel() + kvb.numel()


def test_the_backward_launches_through_the_fast_host_path():
    src = fagen.generate(fagen.KernelSpec(backend="gluon", direction="bwd", head_dim=128, mask="causal",
                                          dtype="bf16"))
    launch = src[src.index("def _launch_backward("):src.index("def _check_deterministic(")]
    assert "_bwd_host(" in launch and "_run_backward(" not in launch
    fast = src[src.index("def _run_backward_fast("):src.index("def _bwd_host(")]
    assert "TensorDescriptor(" not in fast and "torch.zeros" not in fast and "torch.empty" not in fast


# -- the fp8 forward's operator ([Note] fp8 operator in fagen/templates/gluon/fp8_host.py.j2) --------------------
@pytest.mark.parametrize("window", [None, (5, 0)])
def test_the_fp8_forward_compiles_fullgraph_through_its_operator(monkeypatch, window):
    """forward() under torch.compile(fullgraph=True): one graph holding fagen::<module>_fwd, the launch reached with
    what an eager call passes (descales None -> ones, per-head strides, out_dtype, the window), outputs equal."""
    torch._dynamo.reset()
    mod = fagen.load(fagen.KernelSpec(backend="gluon", head_dim=128, mask="causal", dtype="fp8_e4m3", gqa=2,
                                      window=window is not None))
    seen = []

    def launch(q, k, v, scale, descales, out_dtype, *rest, out=None, lse=None):
        seen.append((round(scale, 12), [(d.tolist(), s) for d, s in descales], out_dtype,
                     rest[3:5] if window else ()))  # the scale: Dynamo's float may differ in the last bit
        (qd, _), (kd, _), (vd, _) = descales
        hq, hkv = q.shape[1], k.shape[1]
        s = (q.float() * qd.view(-1, 1, 1)) @ (k.float() * kd.view(-1, 1, 1)).repeat_interleave(hq // hkv, 1) \
            .transpose(-1, -2) * scale
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), -torch.inf)
        o = s.softmax(-1) @ (v.float() * vd.view(-1, 1, 1)).repeat_interleave(hq // hkv, 1)
        return o.to(out_dtype), s.logsumexp(-1)

    monkeypatch.setattr(mod, "_launch_forward", launch)
    monkeypatch.setattr(mod, "_check_device", lambda q: None)
    torch.manual_seed(0)
    q = torch.randn(1, 4, 19, 128).to(torch.float8_e4m3fn)
    k, v = (torch.randn(1, 2, 19, 128).to(torch.float8_e4m3fn) for _ in range(2))
    kd = torch.tensor([0.5, 2.0])
    kw = dict(k_descale=kd, out_dtype=torch.float16, **({} if window is None else {"window": window}))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "fagen" in str(n.target)})
        return gm.forward

    got = torch.compile(lambda q, k, v: mod.forward(q, k, v, **kw), fullgraph=True, backend=backend)(q, k, v)
    want = mod.forward(q, k, v, **kw)
    assert graphs == [{f"fagen.{mod.forward_op._qualname.split('::')[1]}.default"}]
    assert seen[0] == seen[1] == (round(128 ** -0.5, 12), [([1.0], 0), ([0.5, 2.0], 1), ([1.0], 0)], torch.float16,
                                  () if window is None else window)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[0].dtype == torch.float16
    out, lse = torch.empty(1, 4, 19, 128, dtype=torch.float16), torch.empty(1, 4, 19)
    compiled = torch.compile(lambda q, k, v, out, lse: mod.forward(q, k, v, out=out, lse=lse, **kw), fullgraph=True,
                             backend="eager")
    res = compiled(q, k, v, out, lse)
    assert res[0] is out and torch.equal(out, want[0]) and torch.equal(lse, want[1])
    descales = (torch.ones(1), torch.ones(1), kd, torch.ones(1))
    torch.library.opcheck(mod.forward_op, (q, k, v, 0.088, *descales[:2], descales[3], 0, 1, 0, torch.float16,
                                           *(window or (0, 0))), test_utils=("test_faketensor", ))


def test_other_modes_and_arguments_take_the_plain_path(gluon_bwd, monkeypatch):
    """_bwd_host runs the fast path for dq_mode 0/1 with the plain argument list only: a mode or an argument it does
    not know (another render's) goes to _run_backward, which takes them."""
    mod, mode, _ = gluon_bwd
    taken = []
    monkeypatch.setattr(mod, "_run_backward_fast", lambda *a: taken.append(("fast", a[10:])))
    monkeypatch.setattr(mod, "_run_backward", lambda *a, **kw: taken.append(("plain", a[10:], kw)))
    args, grads = _bwd_args()
    mod._bwd_host(*args, *grads, mode)
    mod._bwd_host(*args, *grads, 2)
    mod._bwd_host(*args, *grads, mode, 0.5)
    mod._bwd_host(*args, *grads, mode, extra=(1, ))
    monkeypatch.setattr(mod, "_BWD_FAST", False)
    mod._bwd_host(*args, *grads, mode)
    assert taken == [("fast", (mode, )), ("plain", (2, ), {}), ("plain", (mode, 0.5), {}),
                     ("plain", (mode, ), {"extra": (1, )}), ("plain", (mode, ), {})]
