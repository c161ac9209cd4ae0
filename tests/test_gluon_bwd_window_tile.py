"""The window render's tile levers of the fourteenth session (fagen/templates/gluon/backward.py.j2), off by default.
Variant bwd_kv_prefetch ([Note] K/V prefetch into L2): the producer prefetches its next tile's K and V into L2; on the
CPU, the sm_90 build has the two prefetches (lane 0's, 32 KB each) only with the lever, within the product's shared
memory and registers, and both host paths pass K and V after the switches' values only to a render with the lever
(kernels faked, as test_gluon_bwd_window_fast.py does). Bits on the H100: scripts/gpu_window_s14.py (the prefetch
changes no value: checked against the product). Variant bwd_epi_two (two epilogue stages) lost in round A and was
removed with its test (docs/mods.md, fourteenth session)."""

import re

import pytest
import torch
import triton

from _env import ON_GPU
from test_gluon_bwd_host import MAIN_META, _bwd_args, _JIT
from test_gluon_bwd_window_fast import LEVER, _module
from test_gluon_bwd_window_host import _Bound
from test_hopper_compile import build_sm90
from test_hostpath import _Fill

pytestmark = pytest.mark.skipif(ON_GPU, reason="sm_90 builds on the CPU and host fakes")
# the window render's keys (variant bwd_window, merged over the others) with the prefetch on and off
KVPF = {"bwd_window": {**LEVER, "bwd_kv_prefetch": 4}}
NOPF = {"bwd_window": {**LEVER, "bwd_kv_prefetch": 0}}

_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
from fagen import backends
from fagen.codegen import render
from fagen.runtime.loader import load_source
from fagen.spec.kernel import KernelSpec
from sm90 import ptxas

out = {}
default = dict(backends.GLUON.variant)
for key, lever in json.loads(sys.argv[2]).items():
    backends.GLUON.variant.clear()
    backends.GLUON.variant.update(default, **lever)
    render.render.cache_clear()
    spec = KernelSpec(backend="gluon", direction="bwd", head_dim=128, mask="causal", dtype="bf16", window=True)
    mod = load_source(render.render(spec).files[".py"], f"{spec.name}_{key}")
    ck = mod.compile_backward_for(deterministic=True)
    ptx = ck.asm["ptx"]
    res = next(iter(ptxas(ptx)[0].values()))
    out[key] = dict(shared=ck.metadata.shared, prefetch=re.findall(r"@(\w+) cp\.async\.bulk\.prefetch\.L2\.global "
                                                                  r"\[%rd\d+\], (\d+);", ptx),
                    any_prefetch=ptx.count("prefetch"), laneid=ptx.count("%laneid"),
                    setmaxnreg=sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
                    host=mod.BWD_KV_PREFETCH)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, {"product": NOPF, "kvpf": KVPF},
                      "gluon-bwd-window-tile")


def test_the_lever_builds_two_lane_0_prefetches_of_a_key_block(built):
    product, kvpf = built["product"], built["kvpf"]
    assert kvpf["prefetch"] == [["pl", "32768"]] * 2 and kvpf["laneid"] >= 2 and kvpf["host"] == 1, kvpf
    assert product["any_prefetch"] == 0 and product["host"] == 0, product
    assert kvpf["shared"] <= product["shared"] + 64 <= 227 * 1024 + 64, (kvpf, product)
    assert kvpf["setmaxnreg"] == product["setmaxnreg"], (kvpf, product)


@pytest.fixture
def faked(monkeypatch):
    """kvpf: (module, main kernel's fake) of the window render with the lever, or of the product's."""
    def make(lever, name):
        mod = _module(lever, name)
        extra = (37, 0, 0.0)
        real, epi_tma = mod._BWD_KERNELS[2]
        n = 18 + len(extra) + 2 * mod.BWD_KV_PREFETCH
        fakes = {"pre": _JIT(mod._bwd_preprocess, (7, 12)), "conv": _JIT(mod._dq_convert, (5, 8)),
                 "main": _JIT(real, n, MAIN_META + ([dict(MAIN_META[0])] * 2 if epi_tma else []))}
        for key, value in (("_FAST_LAUNCH", True), ("_KERNELS", {}), ("_BWD_WS", type(mod._BWD_WS)()),
                           ("_GLUON_FAST", True), ("_raw_stream", lambda device: 77),
                           ("_bwd_preprocess", fakes["pre"]), ("_dq_convert", fakes["conv"]),
                           ("_BWD_KERNELS", {2: (fakes["main"], epi_tma)}),
                           ("_fast_bwd_preprocess", mod._gluon(fakes["pre"])),
                           ("_fast_dq_convert", mod._gluon(fakes["conv"])),
                           ("_fast_bwd_kernels", {2: (mod._gluon(fakes["main"]), epi_tma)}),
                           ("_fast_kv_bound", _Bound(mod, fakes))):
            monkeypatch.setattr(mod, key, value)
        monkeypatch.setitem(mod._NUM_SMS, -1, 132)
        return mod, fakes["main"], extra

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: -1)
    monkeypatch.setattr(triton.runtime.driver, "_active", _Fill())
    return make


@pytest.mark.parametrize("lever", [True, False])
def test_both_host_paths_pass_k_and_v_after_the_switches_only_with_the_lever(faked, lever):
    mod, main, extra = faked(KVPF if lever else NOPF, "_kvpf_test" if lever else "_kvpf_off_test")
    args, grads = _bwd_args(sq=300, sk=333, b=2, h=2)
    k, v = args[2], args[3]
    mod._run_backward_fast(*args, *grads, 2, None, extra)
    mod._run_backward(*args, *grads, 2, None, extra)
    for _, got, _ in main.compiles:
        assert tuple(got[18:18 + len(extra)]) == extra
        tail = got[18 + len(extra):]
        if lever:
            assert len(tail) == 2 and tail[0].data_ptr() == k.data_ptr() and tail[1].data_ptr() == v.data_ptr()
        else:
            assert len(tail) == 0
    assert len(main.compiles) == 2 and mod.BWD_KV_PREFETCH == int(lever)
