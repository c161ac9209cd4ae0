"""The host path of a call (issue 13): fast launches ([Note] Fast launches in fagen/templates/host/launch.py), the
decode workspace cache ([Note] Decode workspace) and fagen.attention's warm path. The launcher and the kernels are
fakes here, so these run on the CPU too; the real launches are exercised by every kernel test on a GPU."""

import threading

import pytest
import torch
import triton

import fagen
from _env import DEVICE
from fagen.runtime import api

DECODE = fagen.KernelSpec(head_dim=16, mask="none", gqa=2, dtype="fp32", kind="decode", block_m=16, block_n=16)


class FakeLauncher:
    """triton 3.6's CudaLauncher as _run reads it: the C entry point `launch` and its flags."""

    def __init__(self, scratch=0, profile=0):
        self.calls, self.wrapper_calls = [], []
        self.global_scratch_size, self.profile_scratch_size, self.num_ctas = scratch, profile, 1
        self.launch_cooperative_grid, self.launch_pdl = False, True

    def launch(self, *args):
        self.calls.append(args)

    def __call__(self, *args):
        self.wrapper_calls.append(args)


class FakeKernel:
    def __init__(self, launcher):
        self.run, self.function, self.packed_metadata = launcher, 1234, (4, 1, 0)


class FakeJIT:
    """A @triton.jit function as _run uses it: arg_names, and fn[grid](...) compiles (counted), launches, returns."""

    def __init__(self, arg_names, scratch=0, profile=0):
        self.arg_names, self.compiles, self.launcher = arg_names, [], FakeLauncher(scratch, profile)

    def __getitem__(self, grid):
        def compile_and_launch(*args, **consts):
            self.compiles.append((grid, args, consts))
            return FakeKernel(self.launcher)
        return compile_and_launch


@pytest.fixture
def module(monkeypatch):
    mod = fagen.load(DECODE)
    monkeypatch.setattr(mod, "_FAST_LAUNCH", True)
    monkeypatch.setattr(mod, "_KERNELS", {})
    monkeypatch.setattr(mod, "_raw_stream", lambda device: 77)
    return mod


def _aligned(n=64):
    t = torch.zeros(n + 16, dtype=torch.float32)
    return t[(-t.data_ptr() % 16) // 4:][:n]  # 16-byte aligned start


def test_fast_launch_calls_the_launcher_directly(module):
    fn = FakeJIT(["X", "Y", "n", "s", "BLOCK"])
    x, y = _aligned(), _aligned()
    for _ in range(3):
        module._run(fn, (5, 2), (x, y, 32, 0.5), {"BLOCK": 16, "num_warps": 4})
    assert len(fn.compiles) == 1  # compiled (through fn[grid]) once, then the launcher's C entry point
    assert len(fn.launcher.calls) == 2 and not fn.launcher.wrapper_calls
    assert fn.launcher.calls[0] == (5, 2, 1, 77, 1234, False, True, None, None, (4, 1, 0), None, None, None,
                                    x, y, 32, 0.5, 16)


def test_specialisation_key_follows_triton(module):
    """A new compile exactly where Triton specialises: pointer alignment, int == 1, % 16, int32 range; floats and
    other int values reuse the kernel."""
    fn = FakeJIT(["X", "n"])
    x = _aligned()
    launches = [(x, 32), (x, 48), (x, 1), (x, 17), (x, 33), (x, 2 ** 31), (x, 2 ** 31 + 16), (x[1:], 32), (x, 32)]
    for args in launches:
        module._run(fn, (1,), args, {})
    compiled = [args[1] if args[0] is x else "misaligned" for _, args, _ in fn.compiles]
    assert compiled == [32, 1, 17, 2 ** 31, "misaligned"]  # 2 ** 31: int64, no longer int32
    assert len(fn.launcher.calls) == 4  # 48 like 32, 33 like 17, 2 ** 31 + 16 like 2 ** 31, the final 32


def test_constexprs_and_device_are_part_of_the_key(module, monkeypatch):
    fn = FakeJIT(["X", "BLOCK"])
    x = _aligned()
    for block in (16, 32, 16):
        module._run(fn, (1,), (x,), {"BLOCK": block})
    assert [c["BLOCK"] for _, _, c in fn.compiles] == [16, 32]
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 3)  # the same launch from another device
    module._run(fn, (1,), (x,), {"BLOCK": 16})
    assert len(fn.compiles) == 3


def test_kernels_with_scratch_launch_directly_with_a_kept_buffer(module, monkeypatch):
    """[Note] Launch scratch: one buffer per (device, stream), grown for a larger grid, fresh under graph capture."""
    monkeypatch.setattr(module, "_SCRATCH", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    fn = FakeJIT(["X"], scratch=128)
    x = _aligned()
    for grid in ((1, 1, 1), (4, 2, 1), (4, 2, 1), (1024, 1, 1)):
        module._run(fn, grid, (x,), {})
    assert len(fn.compiles) == 1 and not fn.launcher.wrapper_calls
    scratch = [call[7] for call in fn.launcher.calls]
    assert all(type(p) is int for p in scratch)
    (buf,) = module._SCRATCH.values()
    assert buf.numel() >= 1024 * 128 and scratch[2] == buf.data_ptr()  # grown to the largest grid, then kept
    assert scratch[0] == scratch[1]  # the same buffer while it is large enough
    monkeypatch.setattr(module, "_raw_stream", lambda device: 78)  # another stream: its own buffer
    module._run(fn, (1, 1, 1), (x,), {})
    assert len(module._SCRATCH) == 2 and fn.launcher.calls[-1][7] != buf.data_ptr()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # capturing: the graph owns it
    module._run(fn, (1, 1, 1), (x,), {})
    assert len(module._SCRATCH) == 2 and fn.launcher.calls[-1][7] not in {b.data_ptr() for b in module._SCRATCH.values()}


def test_kernels_with_a_profiling_buffer_go_through_triton_wrapper(module):
    fn = FakeJIT(["X"], profile=64)
    x = _aligned()
    for _ in range(2):
        module._run(fn, (1, 1, 1), (x,), {})
    assert len(fn.compiles) == 1 and not fn.launcher.calls
    assert fn.launcher.wrapper_calls == [(1, 1, 1, 77, 1234, (4, 1, 0), None, None, None, x)]


def test_unknown_kernels_always_take_fn_grid(module):
    class Odd(FakeJIT):
        def __getitem__(self, grid):
            def launch(*args, **consts):
                self.compiles.append(args)
                return None  # not a CompiledKernel (another triton): no fast launch
            return launch
    fn = Odd(["X"])
    for _ in range(3):
        module._run(fn, (1,), (_aligned(),), {})
    assert len(fn.compiles) == 3


def test_host_int_helpers_match_triton(module):
    for n in range(0, 300):
        assert module._pow2(n) == triton.next_power_of_2(max(n, 1)), n
        for d in (1, 3, 16, 64):
            assert module._cdiv(n, d) == triton.cdiv(n, d), (n, d)


def _raw_stream_of(streams):
    def raw_stream(index):  # torch._C._cuda_getCurrentRawStream takes a device index, nothing else
        assert type(index) is int, f"raw stream queried with {index!r}"
        return streams[0]
    return raw_stream


def test_decode_workspace_is_reused_per_stream_and_thread(module, monkeypatch):
    monkeypatch.setattr(module, "_INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(module, "_WORKSPACES", threading.local())
    stream = [5]
    monkeypatch.setattr(module, "_raw_stream", _raw_stream_of(stream))
    cpu = torch.device("cpu")
    first = module._workspace((4, 1, 8, 1), cpu, 0)
    assert first[0].shape == (4, 1, 8, 1, 16) and first[1].shape == (4, 1, 8, 1)
    assert first[2].dtype == torch.int32 and first[2].shape == (1 * 4,) and not first[2].any()  # 8 heads / gqa 2
    assert all(a is b for a, b in zip(module._workspace((4, 1, 8, 1), cpu, 0), first))  # same shape and stream
    stream[0] = 6
    assert all(a is not b for a, b in zip(module._workspace((4, 1, 8, 1), cpu, 0), first))  # another stream
    stream[0] = 5
    other = []
    thread = threading.Thread(target=lambda: other.append(module._workspace((4, 1, 8, 1), cpu, 0)))
    thread.start()
    thread.join()
    assert other[0][0] is not first[0]  # another thread: its own
    resized = module._workspace((2, 1, 8, 1), cpu, 0)
    assert resized[0].shape == (2, 1, 8, 1, 16) and resized[0] is not first[0]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert module._workspace((2, 1, 8, 1), cpu, 0)[0] is not resized[0]  # capturing: the graph's pool owns it


class FakeTritonJIT(triton.runtime.JITFunction, FakeJIT):
    """FakeJIT that _fast takes for a @triton.jit function."""

    def __init__(self, real):
        FakeJIT.__init__(self, real.arg_names)

    __getitem__ = FakeJIT.__getitem__
    __hash__ = object.__hash__


def _same(launched, compiled):
    """An argument of the replayed launch against the general path's: a tensor goes as itself or its address."""
    if isinstance(compiled, torch.Tensor):
        return launched is compiled or (type(launched) is int and launched == compiled.data_ptr())
    return type(launched) is type(compiled) and launched == compiled


STEP_SPECS = {
    "none": DECODE,
    "causal+padding": fagen.KernelSpec(head_dim=16, mask="causal+padding", gqa=2, dtype="fp32", kind="decode",
                                       block_m=16, block_n=16),
    "tree": fagen.KernelSpec(head_dim=16, mask="tree", gqa=2, dtype="fp32", kind="decode", block_m=16, block_n=16),
    "switches": fagen.KernelSpec(head_dim=16, mask="causal", gqa=2, dtype="fp32", kind="decode", block_m=16,
                                 block_n=16, window=True, softcap=True, alibi=True, sinks=True),
}


@pytest.mark.parametrize("which", list(STEP_SPECS))
@pytest.mark.parametrize("seq_k", [300, 16])  # split (the last split merges) and direct (one split)
def test_decode_step_replays_the_general_path(monkeypatch, which, seq_k):
    """[Note] Decode steps: the second call of a shape launches exactly what the first (general) call did."""
    module = fagen.load(STEP_SPECS[which])
    for name, value in (("_FAST_LAUNCH", True), ("_KERNELS", {}), ("_INTERPRET", False), ("_STEPS", {}),
                        ("_WORKSPACES", threading.local()), ("_raw_stream", _raw_stream_of([77]))):
        monkeypatch.setattr(module, name, value)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    split = FakeTritonJIT(module._decode_split)
    monkeypatch.setattr(module, "_decode_split", split)
    sq = 3
    q = torch.randn(1, 4, sq, 16)
    k, v = torch.randn(1, 2, seq_k, 16), torch.randn(1, 2, seq_k, 16)
    assert (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0
    lens = {}
    if which == "causal+padding":
        lens = dict(seqlens_q=torch.tensor([2], dtype=torch.int32),
                    seqlens_k=torch.tensor([seq_k - 1], dtype=torch.int32))
    parents = torch.tensor([[-1, 0, 0]], dtype=torch.int32) if which == "tree" else None
    masks = module._check_mask_inputs(q, k, lens.get("seqlens_q"), lens.get("seqlens_k"), parents)
    scores = module._check_scores(q, (8, None), 30.0, torch.rand(4), torch.rand(4)) if which == "switches" else ()

    def launch(**buffers):
        return module._launch(q, k, v, 0.25, *masks, *scores, **buffers, num_splits=None)

    launch()
    assert len(split.compiles) == 1 and len(module._STEPS) == 1
    (grid, args, consts), = split.compiles
    assert (grid[0] > 1) == (seq_k == 300) and (args[7] is None) == (seq_k == 16)  # tickets only with splits
    # the second call writes into the first call's outputs, so every address matches what was compiled with
    first_out, first_lse = args[5:7]
    launch(out=first_out, lse=first_lse)
    assert len(split.compiles) == 1  # nothing new compiled or re-specialised
    (call,) = split.launcher.calls
    tail = tuple(consts[name] for name in split.arg_names[len(args):])
    assert call[:13] == (*grid, 77, 1234, False, True, None, None, (4, 1, 0), None, None, None)
    assert len(call) == 13 + len(args) + len(tail)
    bad = [name for name, a, b in zip(split.arg_names, call[13:], args + tail) if not _same(a, b)]
    assert not bad, bad
    q = torch.randn(1, 4, sq, 16 + 1)[..., 1:]  # a 4-byte offset: Triton specialises it differently
    launch()
    assert len(split.compiles) == 2


def test_warm_attention_call_resolves_nothing(monkeypatch):
    q = torch.randn(1, 4, 1, 16, device=DEVICE)
    k = torch.randn(1, 2, 300, 16, device=DEVICE)
    with torch.no_grad():
        first = fagen.attention(q, k, k)
        monkeypatch.setattr(api, "resolve", lambda *a, **kw: pytest.fail("a warm call resolved its module again"))
        assert torch.equal(fagen.attention(q, k, k), first)


FORWARD_SPECS = {
    "none": fagen.KernelSpec(head_dim=16, mask="none", gqa=2, dtype="fp32", block_m=16, block_n=16),
    "causal+padding": fagen.KernelSpec(head_dim=16, mask="causal+padding", gqa=2, dtype="fp32", block_m=16,
                                       block_n=16),
    "tree": fagen.KernelSpec(head_dim=16, mask="tree", gqa=2, dtype="fp32", block_m=16, block_n=16),
    "switches": fagen.KernelSpec(head_dim=16, mask="causal", gqa=2, dtype="fp32", block_m=16, block_n=16,
                                 window=True, softcap=True, alibi=True, sinks=True),
}


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("which", list(FORWARD_SPECS))
def test_forward_step_replays_the_general_path(monkeypatch, which, tma):
    """[Note] Forward steps: the second call of a shape launches exactly what the first (general) call did, with
    device addresses as ints and (TMA) a kept scratch buffer; a misaligned or strided input takes the general path."""
    module = fagen.load(FORWARD_SPECS[which])
    for name, value in (("_FAST_LAUNCH", True), ("_KERNELS", {}), ("_INTERPRET", False), ("_STEPS", {}),
                        ("_SCRATCH", {}), ("TMA", tma), ("_raw_stream", _raw_stream_of([77]))):
        monkeypatch.setattr(module, name, value)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    fwd = FakeTritonJIT(module._attn_fwd)
    fwd.launcher.global_scratch_size = 128 if tma else 0
    monkeypatch.setattr(module, "_attn_fwd", fwd)
    sq, sk = 5, 37
    q = torch.randn(2, 4, sq, 16)
    k, v = torch.randn(2, 2, sk, 16), torch.randn(2, 2, sk, 16)
    lens = {}
    if which == "causal+padding":
        lens = dict(seqlens_q=torch.tensor([5, 2], dtype=torch.int32), seqlens_k=torch.tensor([37, 9], dtype=torch.int32))
    parents = torch.tensor([[-1, 0, 0, 1, 1]] * 2, dtype=torch.int32) if which == "tree" else None
    masks = module._check_mask_inputs(q, k, lens.get("seqlens_q"), lens.get("seqlens_k"), parents)
    window = [8, None]
    scores = lambda: module._check_scores(q, tuple(window), 30.0, torch.rand(4), torch.rand(4)) \
        if which == "switches" else ()  # noqa: E731

    def launch(**buffers):
        return module._launch(q, k, v, 0.25, *masks, *scores(), **buffers)

    launch()
    assert len(fwd.compiles) == 1 and len(module._STEPS) == 1
    first_out, first_lse = fwd.compiles[0][1][3:5]
    launch(out=first_out, lse=first_lse)
    launch(out=first_out, lse=first_lse)
    assert len(fwd.compiles) == 1 and len(fwd.launcher.calls) == 2  # nothing new compiled: two replays
    (grid, args, consts), = fwd.compiles
    tail = tuple(consts[name] for name in fwd.arg_names[len(args):])
    for call in fwd.launcher.calls:
        assert call[:7] == (*grid, 77, 1234, False, True) and call[8:13] == (None, (4, 1, 0), None, None, None)
        assert (type(call[7]) is int) == tma and (call[7] is None) == (not tma)
        assert len(call) == 13 + len(args) + len(tail)
        bad = [name for name, a, b in zip(fwd.arg_names, call[13:], args + tail)
               if not _same(a, b) and name not in ("Slopes", "Sinks")]  # fresh tensors per call
        assert not bad, bad
    if which == "switches":
        window[0] = 16  # another window extent, another int class: never specialised, so the kept step replays it
        launch()
        assert len(fwd.compiles) == 1 and len(module._STEPS) == 1
        assert fwd.launcher.calls[-1][13 + fwd.arg_names.index("win_left")] == 16
    q = torch.randn(2, 4, sq, 16 + 1)[..., 1:]  # a 4-byte offset: Triton specialises it differently
    compiles, steps = len(fwd.compiles), len(module._STEPS)
    launch()
    assert len(fwd.compiles) == compiles + 1
    q = torch.randn(2, 4, 16, sq).transpose(2, 3)  # not unit-stride: copied, so never kept as a step
    launch()
    assert len(module._STEPS) == steps


def _qkv16(b=2, hq=4, hkv=2, sq=5, sk=7, d=16):
    return tuple(torch.randn(b, h, s, d, device=DEVICE) for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))


@pytest.mark.parametrize("defect, message", [
    (lambda q, k, v: ([1.0], k, v), "q: expected a torch.Tensor"),
    (lambda q, k, v: (q, k.double(), v), "k: dtype torch.float64"),
    (lambda q, k, v: (q, k, v.half()), "v: dtype torch.float16"),
    (lambda q, k, v: (q[0], k, v), "q: expected 4 dims"),
    (lambda q, k, v: (q, k[0], v[0]), "k: expected 4 dims"),
    (lambda q, k, v: (q, k, v[:, :, :3]), "k and v must have one shape"),
    (lambda q, k, v: (q[..., :8], k, v), "q: head_dim 8"),
    (lambda q, k, v: (q, k[..., :8], v[..., :8]), "k: head_dim 8"),
    (lambda q, k, v: (q[:1], k, v), "batch: q has 1, k/v have 2"),
    (lambda q, k, v: (q[:, :2], k, v), "heads: q has 2 heads"),
    (lambda q, k, v: (q, k.to("meta"), v), "k: on meta"),
])
def test_fast_accept_takes_nothing_the_checks_refuse(defect, message):
    """[Note] Fast accept: every input with one defect is refused with the loop's message; fitting ones pass."""
    module = fagen.load(FORWARD_SPECS["none"])
    module._check_qkv(*_qkv16())
    module._check_qkv(torch.nn.Parameter(_qkv16()[0]), *_qkv16()[1:])  # a subclass: the loop accepts
    with pytest.raises(module.InputError, match=message):
        module._check_qkv(*defect(*_qkv16()))


def test_new_outputs_are_fresh_contiguous_tensors(module):
    """_new_out / _new_lse: q's dtype and device (lse float32 [B, Hq, Sq]), contiguous, a new tensor per call, for
    contiguous and strided q alike."""
    for q in (torch.randn(2, 4, 5, 16, device=DEVICE), torch.randn(2, 5, 4, 16, device=DEVICE).transpose(1, 2)):
        outs = [module._new_out(q) for _ in range(2)]
        lses = [module._new_lse(q) for _ in range(2)]
        for out, lse in zip(outs, lses):
            assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device and out.is_contiguous()
            assert lse.shape == q.shape[:3] and lse.dtype == torch.float32 and lse.device == q.device
            assert lse.is_contiguous() and lse.untyped_storage().nbytes() == 4 * q.shape[:3].numel()
        assert outs[0].data_ptr() != outs[1].data_ptr() and lses[0].data_ptr() != lses[1].data_ptr()


def test_backward_launches_replay_through_the_launcher(monkeypatch):
    """[Note] Fast launches in the backward: the second call of a shape compiles nothing and calls each of the three
    kernels' launcher with exactly the first call's arguments."""
    module = fagen.load(fagen.KernelSpec(head_dim=16, mask="causal", gqa=2, dtype="fp32", direction="bwd",
                                         block_m=16, block_n=16))
    for name, value in (("_FAST_LAUNCH", True), ("_KERNELS", {}), ("_INTERPRET", False),
                        ("_raw_stream", _raw_stream_of([77]))):
        monkeypatch.setattr(module, name, value)
    fakes = {}
    for name in ("_attn_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq"):
        fakes[name] = FakeTritonJIT(getattr(module, name))
        monkeypatch.setattr(module, name, fakes[name])
    q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 37, 16), torch.randn(2, 2, 37, 16)
    do, out, lse = torch.randn(2, 4, 5, 16), torch.randn(2, 4, 5, 16), torch.randn(2, 4, 5)
    for _ in range(3):
        module._launch_backward(do, q, k, v, out, lse, 0.25, None, None, None)
    for name, fn in fakes.items():
        (grid, args, consts), = fn.compiles  # compiled once
        tail = tuple(consts[n] for n in fn.arg_names[len(args):])
        assert len(fn.launcher.calls) == 2, name
        for call in fn.launcher.calls:
            assert call[:13] == (*grid, 77, 1234, False, True, None, None, (4, 1, 0), None, None, None), name
            same = [a is b or (isinstance(b, torch.Tensor) and isinstance(a, torch.Tensor) and a.shape == b.shape)
                    or a == b for a, b in zip(call[13:], args + tail)]
            assert len(call) == 13 + len(args) + len(tail) and all(same), name


@pytest.mark.parametrize("pages", [30, 1])  # split (the last split merges) and direct (one split)
def test_paged_decode_step_replays_the_general_path(monkeypatch, pages):
    """[Note] Decode steps, paged: a cache of fixed shape repeats its step while the lengths (device values) grow;
    the second call launches exactly what the first did; another block table width is another step."""
    module = fagen.load(fagen.KernelSpec(head_dim=16, mask="causal", gqa=2, dtype="fp32", kind="decode",
                                         layout="paged", block_m=16, block_n=16))
    for name, value in (("_FAST_LAUNCH", True), ("_KERNELS", {}), ("_INTERPRET", False), ("_STEPS", {}),
                        ("_WORKSPACES", threading.local()), ("_raw_stream", _raw_stream_of([77]))):
        monkeypatch.setattr(module, name, value)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    split = FakeTritonJIT(module._decode_split)
    monkeypatch.setattr(module, "_decode_split", split)
    q = torch.randn(2, 4, 1, 16)
    k_cache, v_cache = torch.randn(64, 16, 2, 16), torch.randn(64, 16, 2, 16)
    table = torch.randperm(64, dtype=torch.int32)[:2 * pages].reshape(2, pages).contiguous()
    lens = torch.tensor([pages * 16 - 3, min(7, pages * 16)], dtype=torch.int32)
    sq, sk, tree, table = module._check_layout(q, k_cache, v_cache, table, lens, None)

    def launch(**buffers):
        return module._launch(q, k_cache, v_cache, 0.25, sq, sk, tree, table, **buffers, num_splits=None)

    launch()
    assert len(split.compiles) == 1 and len(module._STEPS) == 1
    (grid, args, consts), = split.compiles
    assert (grid[0] > 1) == (pages == 30)
    first_out, first_lse = args[5:7]
    sk.add_(1)  # the sequences grow: a device value, the same step
    launch(out=first_out, lse=first_lse)
    assert len(split.compiles) == 1 and len(module._STEPS) == 1
    (call,) = split.launcher.calls
    tail = tuple(consts[name] for name in split.arg_names[len(args):])
    assert call[:13] == (*grid, 77, 1234, False, True, None, None, (4, 1, 0), None, None, None)
    assert len(call) == 13 + len(args) + len(tail)
    bad = [name for name, a, b in zip(split.arg_names, call[13:], args + tail) if not _same(a, b)]
    assert not bad, bad
    table = torch.cat([table, table[:, :1]], 1).contiguous()  # a wider table: more keys, another step
    launch()
    assert len(module._STEPS) == 2
