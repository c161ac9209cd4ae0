"""The Gluon forward's tile schedule ([Note] Tile schedule, [Note] Tile counter in
fagen/templates/gluon/attention.py.j2): the counter's host side on any machine (torch.cuda's stream hooks faked), the
kernel's reset in the render, and on an H100/H200 the counter orders against the float64 reference, called twice and
under CUDA graph replay (scripts/gpu_fwd_sched.py measures them)."""

import re

import pytest
import torch

import fagen
from fagen import backends
from fagen.codegen import render as render_mod
from fagen.runtime.loader import load_source
from fagen.spec.kernel import KernelSpec

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def scheduled(sched: int, **fields):
    """The gluon module rendered with the tile schedule (the measurement variant) at _SCHED sched."""
    spec = KernelSpec(backend="gluon", **{"head_dim": 128, "dtype": "bf16", **fields})
    saved = backends.GLUON.variant["tile_schedule_all"]
    backends.GLUON.variant["tile_schedule_all"] = True
    render_mod.render.cache_clear()
    try:
        source = fagen.generate(spec)
    finally:
        backends.GLUON.variant["tile_schedule_all"] = saved
        render_mod.render.cache_clear()
    source = re.sub(r"^_SCHED = \d", f"_SCHED = {sched}", source, count=1, flags=re.M)
    return load_source(source, f"{spec.name}_test_sched{sched}")


@pytest.mark.parametrize("causal_order", [None, 2])
def test_the_rendered_order_is_the_backend_rule_s(monkeypatch, causal_order):
    """The template's _SCHED and whether it renders a schedule follow GluonBackend.tile_order / tile_schedule ([Note]
    Gluon tile order): MLA causal 1; causal without the window or a mod the variant's causal_order; else none."""
    monkeypatch.setitem(backends.GLUON.variant, "causal_order", causal_order)
    render_mod.render.cache_clear()
    cases = [dict(head_dim=192, head_dim_v=128, mask="causal"), dict(head_dim=192, head_dim_v=128, mask="none"),
             dict(mask="causal"), dict(mask="causal", gqa=4, dtype="fp16"), dict(head_dim=64, mask="causal"),
             dict(mask="causal", dtype="fp8_e4m3"), dict(mask="causal", softcap=True), dict(mask="none"),
             dict(mask="causal", window=True), dict(mask="none", dtype="fp8_e4m3")]
    try:
        for fields in cases:
            spec = KernelSpec(backend="gluon", **{"head_dim": 128, "dtype": "bf16", **fields})
            src = fagen.generate(spec)
            order = backends.GLUON.tile_order(spec)
            got = re.search(r"^_SCHED = (\d)", src, flags=re.M)
            assert (int(got.group(1)) if got else None) == order, (fields, order)
            assert ("TileCounter" in src) == backends.GLUON.tile_schedule(spec) == (order is not None), fields
            if spec.head_dim == 192 and str(spec.mask) == "causal":
                assert order == 1
            elif str(spec.mask) == "causal" and not spec.window:
                assert order == causal_order, fields
    finally:
        render_mod.render.cache_clear()


class _Streams:
    """torch.cuda's stream hooks, faked: the current stream's handle and whether it is capturing."""

    def __init__(self):
        self.handle, self.capturing = 1, False

    def current_stream(self, device=None):
        return type("S", (), {"cuda_stream": self.handle})()

    def is_current_stream_capturing(self):
        return self.capturing


def test_the_counter_is_cached_per_stream_and_fresh_under_graph_capture(monkeypatch):
    mod = scheduled(2, mask="causal")
    fake = _Streams()
    monkeypatch.setattr(torch.cuda, "current_stream", fake.current_stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", fake.is_current_stream_capturing)
    monkeypatch.setattr(mod, "_COUNTERS", {})
    monkeypatch.setattr(mod, "_raw_stream", lambda index: fake.current_stream(index).cuda_stream)
    dev = torch.device("cpu")
    first = mod._tile_counter(dev)
    assert first.dtype == torch.int32 and first.shape == (1,) and int(first) == 0
    assert mod._tile_counter(dev) is first  # no allocation per call
    fake.handle = 2
    other = mod._tile_counter(dev)
    assert other is not first  # two streams never share a counter
    fake.handle, fake.capturing = 1, True
    captured = mod._tile_counter(dev)
    assert captured is not first and int(captured) == 0  # its zeroing is captured with the kernel
    assert mod._tile_counter(dev) is not captured and len(mod._COUNTERS) == 2


def test_the_launch_s_last_take_zeroes_the_counter_in_the_kernel():
    """A launch makes num_tiles takes (num_tiles - programs hand out tiles, one per program finds none left), so the
    take that returns num_tiles - 1 is the last; it writes 0 back. The host zeroes the counter only once."""
    src = fagen.generate(KernelSpec(backend="gluon", head_dim=192, head_dim_v=128, mask="causal", dtype="bf16"))
    loader = src[src.index("def _loader("):src.index("\n\n\n", src.index("def _loader("))]
    take = re.search(r"taken = gl\.atomic_add\(TileCounter, 1\)\n\s+if taken == num_tiles - 1:.*\n"
                     r"\s+gl\.atomic_xchg\(TileCounter, 0\)\n\s+tile = gl\.num_programs\(0\) \+ taken", loader)
    assert take, loader
    host = src[src.index("def _launch_forward("):]
    assert "torch.zeros" not in host[:host.index("_attn_fwd_hopper[grid]")]  # the cached counter, not one per call


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="runs on an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("sched", [2, 3])
def test_counter_orders_match_the_reference_twice_and_under_graph_replay(sched):
    from fagen.spec.axes import DType
    from fagen.verify import reference
    from fagen.verify import tolerances as verify
    mod = scheduled(sched, mask="causal", gqa=2)
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn((3, 16, 1100, 128), generator=g, device="cuda", dtype=torch.bfloat16)  # 3 * 16 * 9 tiles
    k, v = (torch.randn((3, 8, 1100, 128), generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    want, _ = reference.attention(q, k, v, mask="causal")
    for _ in range(2):  # the second call reads the counter the first one left: it must be 0 again
        out, _ = mod.forward(q, k, v)
        verify.compare("out", out, want, **verify.TOLERANCE[DType.BF16])
    torch.cuda.synchronize()
    assert all(int(c) == 0 for c in mod._COUNTERS.values())
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mod.forward(q, k, v, out=out, lse=lse)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mod.forward(q, k, v, out=out, lse=lse)
    out.zero_()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    verify.compare("out (graph replay)", out, want, **verify.TOLERANCE[DType.BF16])
