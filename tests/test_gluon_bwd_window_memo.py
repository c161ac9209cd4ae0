"""The Gluon backward's launch memo ([Note] Launch memo in fagen/templates/host/gluon_bwd_launch.py; eighteenth
session): a warm call of modes 0, 1 replays its three launches' flat argument lists, kept per workspace view and
keyed by everything they are made of. With the kernels faked (test_gluon_bwd_window_chain's store_fast): a replay
hands the launcher the bytes the memo-free path hands it; a call that differs in any one field of the key (an
address, a shape, the scale, the switches' values, a launcher) launches what the memo-free path launches for it; no
memo under CUDA graph capture. scripts/window_host_cpu_s18.py times it (the window row's backward host time)."""

import pytest
import torch

from _env import ON_GPU
from test_gluon_bwd_host import _bwd_args
from test_gluon_bwd_window_chain import STORE, store_fast  # noqa: F401

NAMES = ("pre", "main", "conv")
ARG = {"do": 0, "q": 1, "k": 2, "v": 3, "out": 4, "lse": 5}


def _call(mod, fakes, monkeypatch, args, grads, extra, mode=0, memo=True):
    """One _run_backward_fast with the memo on or off: the three launches' raw arguments, and _gluon_run's calls."""
    monkeypatch.setattr(mod, "_BWD_MEMO", memo)
    runs = []
    real = mod._gluon_run
    monkeypatch.setattr(mod, "_gluon_run", lambda *a: runs.append(a[0]) or real(*a))
    mod._run_backward_fast(*args, *grads, mode, None, extra)
    monkeypatch.setattr(mod, "_gluon_run", real)
    return [fakes[n].launcher.raw[-1] for n in NAMES], len(runs)


def _prefix(t, sq):
    """t's first sq rows of [B, H, S(, D)] as a contiguous tensor at t's address (t's shape but sq)."""
    shape = (*t.shape[:2], sq, *t.shape[3:])
    return t.reshape(-1)[:torch.Size(shape).numel()].view(shape)


@pytest.mark.skipif(ON_GPU, reason="host fakes")
@pytest.mark.parametrize("mode", [0, 1])
def test_a_warm_call_replays_the_launches_of_the_memo_free_path(store_fast, monkeypatch, mode):  # noqa: F811
    mod, fakes = store_fast
    args, grads = _bwd_args(sq=300, sk=333, b=2, h=2)
    _call(mod, fakes, monkeypatch, args, grads, fakes["extra"], mode, memo=False)  # compiles (fn[grid])
    off, n_off = _call(mod, fakes, monkeypatch, args, grads, fakes["extra"], mode, memo=False)
    _call(mod, fakes, monkeypatch, args, grads, fakes["extra"], mode)  # builds the memo
    on, n_on = _call(mod, fakes, monkeypatch, args, grads, fakes["extra"], mode)
    assert on == off and n_off == 3 and n_on == 0  # the same bytes, no _gluon_run
    ((_, (_, views)), ) = mod._BWD_WS.__dict__.items()
    assert [len(v[-1]) for v in views.values()] == [1]


@pytest.mark.skipif(ON_GPU, reason="host fakes")
@pytest.mark.parametrize("field", [*ARG, "dq", "dk", "dv", "scale", "extra", "shape", "launcher"])
def test_a_call_that_differs_in_one_field_launches_its_own_arguments(store_fast, monkeypatch, field):  # noqa: F811
    """Each field of the memo's key: a call equal to a memoised one but in that field launches what the memo-free
    path launches for it (a key without the field would replay the first call's launches: red)."""
    mod, fakes = store_fast
    args, grads = _bwd_args(sq=300, sk=333, b=2, h=2)
    extra = fakes["extra"]
    for _ in range(2):
        _call(mod, fakes, monkeypatch, args, grads, extra)
    args, grads = list(args), list(grads)
    if field in ARG:
        args[ARG[field]] = args[ARG[field]].clone()
    elif field in ("dq", "dk", "dv"):
        i = ("dq", "dk", "dv").index(field)
        grads[i] = torch.empty_like(grads[i])
    elif field == "scale":
        args[6] = 0.07
    elif field == "extra":
        extra = (36, 0, 0.0)
    elif field == "shape":  # the same addresses and workspace views (sq_pad), 290 query rows
        for i in (0, 1, 4, 5):
            args[i] = _prefix(args[i], 290)
        grads[0] = _prefix(grads[0], 290)
    else:  # a launcher swapped (as scripts and tests do): its launches, not the memo's
        monkeypatch.setattr(mod, "_fast_dq_convert", mod._gluon(fakes["conv"]))
    got, n_got = _call(mod, fakes, monkeypatch, args, grads, extra)
    want, _ = _call(mod, fakes, monkeypatch, args, grads, extra, memo=False)
    assert n_got == 3 and got == want


@pytest.mark.skipif(ON_GPU, reason="host fakes")
def test_no_memo_under_cuda_graph_capture(store_fast, monkeypatch):  # noqa: F811
    """While a graph is captured the workspace is the call's own, so no memo is kept or replayed: every launch
    goes through _gluon_run (a memo of a graph pool's address would outlive the pool's use)."""
    mod, fakes = store_fast
    args, grads = _bwd_args(sq=300, sk=333, b=2, h=2)
    _call(mod, fakes, monkeypatch, args, grads, fakes["extra"])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    for _ in range(2):
        assert _call(mod, fakes, monkeypatch, args, grads, fakes["extra"])[1] == 3
    assert mod._bwd_workspace(2, 2, 384, 0, args[1], 2)[-1] is None  # the call's own buffer: nowhere to keep one


@pytest.mark.skipif(ON_GPU, reason="host fakes")
def test_the_gradients_are_contiguous_for_strided_inputs(store_fast):  # noqa: F811
    """_launch_backward's dq, dk, dv come from _new_out (empty_like in contiguous format: the eighteenth session's
    cheaper allocation) and stay contiguous [B, H, S, D] however q, k, v are strided (the kernels write them dense);
    empty_like's default (preserve) format would give q's strides: red."""
    mod, fakes = store_fast
    args, _ = _bwd_args(sq=300, sk=333, b=2, h=2)
    do, q, k, v, out, lse, scale = args
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))  # [B, S, H, D] memory
    assert not q.is_contiguous()
    dq, dk, dv = mod._launch_backward(do, q, k, v, out, lse, scale, None, None, None, 37, 0, None, None, None)
    for g, t in ((dq, q), (dk, k), (dv, v)):
        assert g.is_contiguous() and g.shape == t.shape and g.dtype == t.dtype
    assert len(fakes["conv"].compiles) == 1 and fakes["conv"].bound(0)["DQ"] is dq  # it writes the returned dq
