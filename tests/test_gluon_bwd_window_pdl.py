"""The window chain's dQ conversion as the main kernel's programmatic dependent ([Note] Window conversion overlap in
fagen/templates/gluon/backward.py.j2; variant bwd_window_pdl, eighteenth session): the render (only with a chain:
the main kernel's launch_dependents, the conversion kernel), the render's own _bwd_visits on ints against the
visitors of the render's _bwd_tile (each query block's counter ends at its number of visitors, so a conversion
program waits for exactly the last adder's publish), the fast path's launches with the kernels faked, and the
conversion kernel's sm_90 build. The kernels run in scripts/gpu_window_s18.py (H200)."""

import types

import pytest
import torch
import triton

from _env import ON_GPU
from test_gluon_bwd_host import _bwd_args, _JIT
from test_gluon_bwd_window_chain import CASES, SPIN, STORE, _module, _source, _visits, store_fast  # noqa: F401

PDL = {**SPIN, "bwd_window_pdl": 1}


def test_the_key_renders_the_overlap_only_with_a_chain():
    fixed, spin, pdl = _source({"bwd_window_fixed": 1, "bwd_fixed_tma": 1}), _source(SPIN), _source(PDL)
    assert "BWD_WIN_PDL = 0" in fixed and "BWD_WIN_PDL = 0" in spin and "BWD_WIN_PDL = 1" in pdl
    assert _source() == pdl  # the product's render since the eighteenth session's flip
    assert _source({"bwd_window_fixed": 1, "bwd_fixed_tma": 1, "bwd_window_pdl": 1}) == fixed  # no chain: nothing
    assert pdl.replace("BWD_WIN_PDL = 1", "BWD_WIN_PDL = 0").count("\n") > spin.count("\n")
    for name in ("_bwd_launch_dependents", "_bwd_grid_wait", "_bwd_wait_count", "_bwd_visits", "_dq_convert_chain"):
        assert f"def {name}(" in pdl and f"def {name}(" not in spin, name
    # the deterministic kernel lets its dependent launch at its start; the unordered one (mode 1) does not
    main = pdl.split("def _attn_bwd_hopper(")[1].split("gl.warp_specialize(")[0]
    main_u = pdl.split("def _attn_bwd_hopper_u(")[1].split("gl.warp_specialize(")[0]
    assert "_bwd_launch_dependents(num_tiles)" in main and "_bwd_launch_dependents" not in main_u
    assert "fence.acq_rel.gpu; fence.proxy.async.global" in pdl and "griddepcontrol.wait" in pdl


@pytest.fixture(scope="module")
def visits():
    mod = _module(PDL, "visits")
    mod.gl = types.SimpleNamespace(maximum=max, minimum=min, where=lambda c, a, b: a if c else b)
    mod._bwd_tile, mod._bwd_first = mod._bwd_tile.fn, mod._bwd_first.fn  # this test's module only
    walk = types.SimpleNamespace(tile=mod._bwd_tile, first=mod._bwd_first, bm=mod.BWD_BLOCK_M, bn=mod.BWD_BLOCK_N)
    return mod._bwd_visits.fn, walk


@pytest.mark.parametrize("case", CASES + [(300, 100, 37, 0), (100, 300, 0, 0), (8192, 8192, 1024, 0)], ids=str)
def test_each_query_block_waits_for_its_number_of_visitors(visits, case):
    """_bwd_visits(m0) is the number of key blocks whose walk holds m0 (the counter's final value: one publish per
    visit), for every query block of the padded accumulator, 0 where none visits (the host then fills it)."""
    count, walk = visits
    sq, sk, left, right = case
    seen, _ = _visits(walk, sq, sk, left, right)
    for m0 in range(0, -(-sq // walk.bm) * walk.bm, walk.bm):
        assert count(m0, sq, sk, left, right, walk.bm, walk.bn, True) == len(seen.get(m0, [])), (case, m0)


@pytest.mark.skipif(ON_GPU, reason="host fakes")
@pytest.mark.parametrize("mode", [0, 1])
def test_the_fast_path_launches_the_dependent_conversion_in_mode_0(store_fast, monkeypatch, mode):  # noqa: F811
    """Mode 0 of a PDL render: the conversion is _dq_convert_chain with launch_pdl, head-fastest grid, the counters
    the main kernel publishes to, the window's values; mode 1 keeps _dq_convert."""
    mod, fakes = store_fast
    pdl = _module(PDL, "fast")
    chain = _JIT(pdl._dq_convert_chain, 9)
    monkeypatch.setattr(mod, "BWD_WIN_PDL", 1)
    monkeypatch.setattr(mod, "_fast_dq_convert_chain", mod._gluon(chain))
    args, grads = _bwd_args(sq=300, sk=333, b=2, h=2)
    mod._run_backward_fast(*args, *grads, mode, None, fakes["extra"])
    if mode == 1:
        assert not chain.compiles and len(fakes["conv"].compiles) == 1
        return
    assert not fakes["conv"].compiles and len(chain.compiles) == 1
    grid, _, consts = chain.compiles[0]
    got = chain.bound(0)
    sem = fakes["main"].compiles[0][1][9]
    assert grid == (4, 320 // mod.BWD_BLOCK_M) and consts["launch_pdl"] is True
    assert got["Sem"] is sem and got["DQ"] is grads[0] and (got["win_left"], got["win_right"]) == (37, 0)
    assert (got["seq_q"], got["seq_k"], got["sq_pad"], got["BLOCK_N"]) == (300, 333, 320, mod.BWD_BLOCK_N)


@pytest.mark.skipif(ON_GPU, reason="sm_90 build on the CPU")
def test_the_dependent_conversion_builds_for_sm_90():
    """ptxas builds _dq_convert_chain with launch_pdl: one relaxed spin with its nanosleep, then the acquire and the
    proxy fence before the loads, and griddepcontrol.wait (the last program) after them."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    mod = _module(PDL, "build")
    args = {"DQacc": torch.empty(4), "DQ": torch.empty(4, dtype=torch.bfloat16), "Sem": torch.empty(4, dtype=torch.int32),
            "scale": 0.5, "seq_q": 1000, "seq_k": 1000, "sq_pad": 1024, "win_left": 37, "win_right": 0}
    consts = {"HEAD_DIM": 128, "BLOCK_M": mod.BWD_BLOCK_M, "BLOCK_N": mod.BWD_BLOCK_N, "CAUSAL": True}
    sig = {**{n: mangle_type(v) for n, v in args.items()}, **{n: "constexpr" for n in consts}}
    ck = triton.compile(GluonASTSource(fn=mod._dq_convert_chain, signature=sig, constexprs=consts),
                        target=GPUTarget("cuda", 90, 128), options={"num_warps": 4, "launch_pdl": True})
    ptx = ck.asm["ptx"]
    assert ck.metadata.launch_pdl and ptx.count("ld.relaxed.gpu.global.b32") == 1 and "nanosleep" in ptx
    spin, fence, load, wait = (ptx.index(s) for s in ("ld.relaxed.gpu", "fence.proxy.async.global", "ld.global.b32",
                                                      "griddepcontrol.wait"))
    assert spin < fence < load < wait
