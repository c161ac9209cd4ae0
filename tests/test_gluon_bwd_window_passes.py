"""The fixed passes' levers of the window render's fast path ([Note] The accumulator's fill and conversion order in
fagen/templates/host/gluon_bwd_launch.py, thirteenth session): the reversed fill kernel on the CPU interpreter (every
element of the accumulator zero, nothing past it), and, with the kernels faked (test_gluon_bwd_window_fast.py's
fixture), the launches with _BWD_FILL_REV and _BWD_CONV_REV: the accumulator and KVB zero when their kernels start
on a dirty kept workspace, the fill's and the conversion's grids, the conversion's arguments the default's. The
side stream (_BWD_FILL_SIDE) needs a GPU: scripts/gpu_window_s13.py checks it bit for bit."""

import pytest
import torch

from _env import ON_GPU
from test_gluon_bwd_host import _bwd_args
from test_gluon_bwd_window_fast import _module, window_fast  # noqa: F401  (the fixture)

pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU interpreter and host fakes")


@pytest.mark.parametrize("bh,n_blk", [(3, 5), (1, 1), (2, 6)])
def test_the_reversed_fill_zeroes_the_accumulator_and_nothing_past_it(bh, n_blk):
    mod = _module()
    g = torch.Generator().manual_seed(bh * 10 + n_blk)
    n = bh * n_blk * 64 * 128
    buf = torch.randint(1, 1 << 30, (n + 4096, ), generator=g, dtype=torch.int32)
    tail = buf[n:].clone()
    mod._bwd_fill_rev[(bh, n_blk)](buf, n_blk, ROWS=64, HEAD_DIM=128)
    assert torch.count_nonzero(buf[:n]) == 0
    assert torch.equal(buf[n:], tail)


class _Fill:
    """_bwd_fill_rev faked: zeroes what the real kernel zeroes (block n_blk - 1 - p1 of head p0), launches recorded."""

    def __init__(self, calls):
        self.calls = calls

    def __getitem__(self, grid):
        def call(acc, n_blk, **consts):
            self.calls.append((grid, acc, n_blk, consts))
            rows = consts["ROWS"] * consts["HEAD_DIM"]
            flat = acc.view(-1)
            for h in range(grid[0]):
                for p in range(grid[1]):
                    blk = n_blk - 1 - p
                    flat[(h * n_blk + blk) * rows:(h * n_blk + blk + 1) * rows] = 0
        return call


@pytest.mark.parametrize("fill_rev,conv_rev", [(True, False), (False, True), (True, True)])
def test_the_levers_zero_and_launch_as_the_default(window_fast, monkeypatch, fill_rev, conv_rev):  # noqa: F811
    mod, fakes = window_fast
    calls, kvb_seen = [], []
    args, grads = _bwd_args(sq=300, sk=333, b=2, h=2)
    extra = fakes["extra"]
    mod._run_backward_fast(*args, *grads, 2, None, extra)  # the default launches, for comparison
    acc = fakes["main"].compiles[0][1][6].base
    whole = torch.empty(0, dtype=torch.int32).set_(acc.untyped_storage(), 0, (acc.untyped_storage().nbytes() // 4, ))
    real_bound = mod._fast_kv_bound

    class Bound:  # what KVB holds when the bound kernel starts
        def __getitem__(self, grid):
            def call(k, v, kvb, *a, **kw):
                kvb_seen.append(int(torch.count_nonzero(kvb)))
                return real_bound[grid](k, v, kvb, *a, **kw)
            return call
    for name, value in (("_fast_fill_rev", _Fill(calls)), ("_fast_kv_bound", Bound()), ("_BWD_FILL_REV", fill_rev),
                        ("_BWD_CONV_REV", conv_rev)):
        monkeypatch.setattr(mod, name, value)
    for _ in range(2):  # on the kept workspace, dirtied: the accumulator and KVB
        whole.fill_(3)
        mod._run_backward_fast(*args, *grads, 2, None, extra)
        assert fakes["main"].compiles[0][1][6].base.data_ptr() == acc.data_ptr()
        assert acc.dtype == torch.int32 and torch.count_nonzero(acc) == 0
    assert kvb_seen == [0, 0]
    if fill_rev:
        assert [c[0] for c in calls] == [(4, 5), (4, 5)] and calls[0][2] == 5
        assert calls[0][3] == {"ROWS": 64, "HEAD_DIM": 128, "num_warps": 4}
    else:
        assert calls == []
    conv = fakes["conv"].compiles
    (g0, a0, k0), (g1, a1, k1) = conv[0], conv[-1]
    assert k0 == {"ORDER": 0, "num_warps": 4} and len(conv) == 1 + conv_rev
    assert (g1, k1) == (((4, 5), {"ORDER": 1, "num_warps": 4}) if conv_rev else ((5, 4), k0))
    assert len(a0) == len(a1) and all(x.data_ptr() == y.data_ptr() if isinstance(x, torch.Tensor) else x == y
                                      for x, y in zip(a0, a1))
