"""[Note] MLA Gluon dK/dV (fagen/templates/gluon/mla_dkdv.py; MLA_GLUON_DKDV in fagen/backends/triton.py;
docs/serving.md, "MLA backward (twenty-second session)"): on by default (pinned); off, in no render (the renders
byte for byte as before it); on, only the dense bf16/fp16 192/128 backward renders with a causal or no mask carry it, the
render state says so, the Gluon launch is built before the preprocess's and runs in place of the Triton dK/dV
kernel's; where a call does not fit it (the CPU, lengths) the module falls back to the Triton kernels, the same
bits; the rendered kernel builds for sm_90 within shared memory, without spills and without atomics. On the H200:
scripts/gpu_mlabwd_s22.py (float64 checks, exact zeros, bitwise repeatability, timings)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from _env import ON_GPU
from fagen.backends import triton as triton_backend
from fagen.codegen import render as render_mod
from fagen.codegen.render import render, render_state
from fagen.runtime.loader import load_source
from fagen.spec.kernel import KernelSpec
from test_hopper_compile import ROOT

MLA = dict(head_dim=192, head_dim_v=128, dtype="bf16", direction="bwd")


@pytest.fixture
def lever_on(monkeypatch):
    monkeypatch.setattr(triton_backend, "MLA_GLUON_DKDV", True)
    render_mod._cache_clear()
    yield
    monkeypatch.undo()
    render_mod._cache_clear()


def test_on_by_default():
    """The product's choice for d_qk 192 / d_v 128 since the twenty-second session (both rounds +4.8-5.7% on the
    H200 in do_bench): pinned."""
    assert triton_backend.MLA_GLUON_DKDV is True
    spec = KernelSpec(mask="causal", **MLA)
    assert "gkv = _mla_gluon_kv(" in render(spec).files[".py"]
    assert render_state(spec).endswith(" mla_gluon_dkdv")


def test_off_is_in_no_render(monkeypatch):
    monkeypatch.setattr(triton_backend, "MLA_GLUON_DKDV", False)
    render_mod._cache_clear()
    try:
        for mask in ("causal", "none"):
            spec = KernelSpec(mask=mask, **MLA)
            src = render(spec).files[".py"]
            assert "_mla_gluon_kv" not in src and "gluon" not in src.lower()
            assert "mla_gluon_dkdv" not in render_state(spec)
    finally:
        monkeypatch.undo()
        render_mod._cache_clear()


def test_on_renders_only_for_dense_mla_backward_with_a_causal_or_no_mask(lever_on):
    for mask, gqa, dtype in (("causal", 1, "bf16"), ("none", 2, "bf16"), ("causal", 1, "fp16")):
        spec = KernelSpec(mask=mask, gqa=gqa, **dict(MLA, dtype=dtype))
        src = render(spec).files[".py"]
        assert src.count("\n    def _attn_bwd_mla_kv(") == 1 and src.count("gkv()") == 1
        # built before the preprocess's launch, run where the Triton dK/dV kernel's launch would be, else that one
        assert src.index("gkv = _mla_gluon_kv(") < src.index("_fast(_attn_bwd_preprocess)[") < src.index("gkv()")
        assert src.index("gkv()") < src.index("    elif need_dkdv:\n        _fast(_attn_bwd_dkdv)[")
        assert f"delta, scale, {mask == 'causal'}, seqlens_q" in src
        assert render_state(spec).endswith(" mla_gluon_dkdv")
    others = (dict(MLA, mask="causal", direction="fwd"), dict(MLA, mask="causal", softcap=True),
              dict(MLA, mask="causal", layout="varlen"), dict(MLA, mask="causal", sinks=True),
              dict(head_dim=128, mask="causal", dtype="bf16", direction="bwd"),
              dict(head_dim=128, head_dim_v=64, mask="causal", dtype="bf16", direction="bwd"))
    for fields in others:
        assert "_mla_gluon_kv" not in render(KernelSpec(**fields)).files[".py"], fields


@pytest.mark.skipif(ON_GPU, reason="the fallback on a host without sm_90: the CPU interpreter")
def test_on_falls_back_to_the_triton_kernels_where_the_call_does_not_fit(lever_on):
    spec = KernelSpec(mask="causal", gqa=2, **MLA)
    m = load_source(render(spec).files[".py"], f"{spec.name}_gkv_test_on")
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 45, 192, generator=gen).bfloat16()
    k = torch.randn(1, 2, 61, 192, generator=gen).bfloat16()
    v = torch.randn(1, 2, 61, 128, generator=gen).bfloat16()
    do = torch.randn(1, 4, 45, 128, generator=gen).bfloat16()
    empty = torch.empty((1, 4, 128))
    assert m._mla_gluon_kv(q, k, v, do, torch.empty_like(k), torch.empty_like(v), empty, empty, 0.1, True, None, None,
                           None) is None  # a CPU tensor
    out, lse = m.forward(q, k, v)
    got = m.backward(do, q, k, v, out, lse)
    monkey_off = triton_backend.MLA_GLUON_DKDV
    triton_backend.MLA_GLUON_DKDV = False
    render_mod._cache_clear()
    try:
        base = load_source(render(spec).files[".py"], f"{spec.name}_gkv_test_off").backward(do, q, k, v, out, lse)
    finally:
        triton_backend.MLA_GLUON_DKDV = monkey_off
        render_mod._cache_clear()
    assert all(torch.equal(a, b) for a, b in zip(got, base))


_BUILD = r"""
import json, os, re, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "scripts"))
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import gpu_mlabwd_s22 as script
from lab.gluon_bwd import step_sass
from sm90 import ptxas

out = {}
for key, kw in json.loads(sys.argv[2]).items():
    ck = script.lever_build(**kw)
    ptx = ck.asm["ptx"]
    res = next(iter(ptxas(ptx)[0].values()))
    out[key] = dict(shared=ck.metadata.shared, spills=res.spill_stores + res.spill_loads,
                    setmaxnreg=sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)",
                                                                  ptx)}),
                    local=[x["ldl"] + x["stl"] for x in step_sass(ck, 8)],
                    atomics=len(re.findall(r"\b(atom|red)\.", ptx)))
print("RESULT " + json.dumps(out))
"""


def test_the_rendered_kernel_builds_for_sm90_without_spills(tmp_path):
    builds = {"causal": dict(mask="causal"), "none gqa2": dict(mask="none", gqa=2)}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    env["FAGEN_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _BUILD, str(ROOT), json.dumps(builds)], capture_output=True,
                          text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    built = json.loads(proc.stdout.split("RESULT ", 1)[1])
    for r in built.values():
        assert r["shared"] <= 227 * 1024, r  # sm_90's opt-in shared memory per block
        assert {240, 24} <= set(r["setmaxnreg"]), r
        assert r["spills"] == 0 and not any(r["local"]), r
        assert r["atomics"] == 0, r  # one program a key block: the same bits every call
