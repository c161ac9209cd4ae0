"""The CUDA backend on a GPU: forward properties against the float64 reference, and agreement with Triton."""

import concurrent.futures
import itertools
import os
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fagen
from fagen.aot import nvcc
from fagen import files
from fagen.runtime import loader as runtime
from fagen.runtime.modules import import_module
from fagen.verify.properties import reference
from fagen.codegen.render import generate_launcher
from fagen.spec.axes import DType, Mask
from fagen.verify.strategies import Problem, problems
from fagen.verify.properties import LSE_TOLERANCE, TOLERANCE, PropertyFailure, check_forward, compare
from _env import DEVICE, ON_GPU, SCALE

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")]

DTYPES = (DType.FP16, DType.BF16)
HEAD_DIMS = (40, 64, 80, 128)  # 40: head_dim padded to 48 in shared memory
# The default (head_dim <= 128: 128x64, 4 warps of 32 rows = two MMA tiles each, 2 stages) and one with 16 rows
# per warp (one MMA tile, Q fragments kept in registers), 32 keys a step and 3 stages.
CONFIGS = ({}, {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 3})
ONE_TILE = {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2}  # 16 rows (one MMA tile) per warp
WIDE = {"block_m": 256, "block_n": 64, "num_warps": 8, "num_stages": 2}  # 8 warps of 32 rows


def cuda_spec(**kw):
    return fagen.KernelSpec(**{"backend": "cuda", **kw})


def property_specs(mask, dtype, head_dims=HEAD_DIMS):
    return st.builds(lambda d, gqa, cfg: cuda_spec(head_dim=d, mask=mask, dtype=dtype, gqa=gqa, **cfg),
                     st.sampled_from(head_dims), st.sampled_from((1, 4)), st.sampled_from(CONFIGS))


def _every_spec():
    specs = [cuda_spec(head_dim=d, mask=m, dtype=t, gqa=g, **c)
             for m, t, d, g, c in itertools.product(Mask, DTYPES, HEAD_DIMS, (1, 4), CONFIGS)]
    specs += [cuda_spec(head_dim=64, mask=m, dtype=t, gqa=4, **cfg)
              for m, t, cfg in itertools.product(Mask, DTYPES, (ONE_TILE, WIDE))]
    specs += [cuda_spec(head_dim=d, mask="causal", dtype="bf16") for d in (16, 24, 200, 256)]
    return specs


@pytest.fixture(scope="module", autouse=True)
def precompiled():
    """Compile every spec these tests can draw, in parallel: one nvcc per core instead of one at a time."""
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    specs = _every_spec()
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:
        list(pool.map(lambda s: nvcc.compile_cached(fagen.generate(s), arch, name=s.name), specs))
    print(f"\nprecompiled {len(specs)} CUDA variants for {arch} in {time.perf_counter() - start:.1f} s")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", list(Mask))
@given(data=st.data())
def test_forward_matches_reference(mask, dtype, data):
    spec = data.draw(property_specs(mask, dtype), label="spec")
    problem = data.draw(problems(spec, SCALE), label="problem")
    check_forward(fagen.load(spec), spec, problem, DEVICE)


def _ragged(mask, seed):
    """Lengths that are not multiples of any block; padding and trees with their own shapes."""
    sq, sk = (37, 37 + 611) if mask is Mask.TREE else (300, 517)
    return Problem(batch=2, heads_kv=2, seq_q=sq, seq_k=sk, seed=seed,
                   seqlens_q=(300, 77) if mask.padded else None, seqlens_k=(517, 1) if mask.padded else None,
                   parents=(tuple([-1, 0, 1, 1, 0, 4, -1, 6, 2] + list(range(8, 36))),) * 2 if mask is Mask.TREE
                   else None)


@pytest.mark.parametrize("config", range(len(CONFIGS)))
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", list(Mask))
def test_every_mask_dtype_gqa_with_padded_head_dim(mask, dtype, gqa, config):
    """Fixed coverage: every mask x dtype x gqa 1/4, head_dim 40 (padded to 48), ragged lengths."""
    spec = cuda_spec(head_dim=40, mask=mask, dtype=dtype, gqa=gqa, **CONFIGS[config])
    check_forward(fagen.load(spec), spec, _ragged(mask, seed=11), DEVICE)


@pytest.mark.parametrize("config", ["one-tile", "wide"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", list(Mask))
def test_other_warp_layouts(mask, dtype, config):
    """16 rows per warp with 8 warps (Q in registers), and 8 warps of 32 rows (block_m 256)."""
    spec = cuda_spec(head_dim=64, mask=mask, dtype=dtype, gqa=4, **{"one-tile": ONE_TILE, "wide": WIDE}[config])
    check_forward(fagen.load(spec), spec, _ragged(mask, seed=12), DEVICE)


@pytest.mark.parametrize("head_dim", [16, 24, 200, 256])
def test_head_dims_at_the_edges(head_dim):
    spec = cuda_spec(head_dim=head_dim, mask="causal", dtype="bf16")
    check_forward(fagen.load(spec), spec, Problem(batch=2, heads_kv=3, seq_q=333, seq_k=1201, seed=13), DEVICE)


@pytest.mark.parametrize("mask, problem", [
    ("causal", Problem(batch=1, heads_kv=1, seq_q=400, seq_k=70, seed=1)),  # rows i < 330 see nothing
    ("padding", Problem(batch=2, heads_kv=1, seq_q=200, seq_k=200, seqlens_q=(200, 5), seqlens_k=(0, 200), seed=2)),
    ("causal+padding", Problem(batch=1, heads_kv=1, seq_q=300, seq_k=300, seqlens_q=(250,), seqlens_k=(3,),
                               poison=True, seed=3)),
    ("none", Problem(batch=1, heads_kv=1, seq_q=50, seq_k=0, seed=4)),
])
def test_rows_that_see_no_key_give_zero_and_minus_inf(mask, problem):
    spec = cuda_spec(head_dim=64, mask=mask)
    (q, k, v), kwargs = problem.inputs(spec, DEVICE)
    out, lse = fagen.load(spec).forward(q, k, v, **kwargs)
    vis = reference.visible(mask, problem.batch, problem.seq_q, problem.seq_k, device=DEVICE,
                            **{k_: v_ for k_, v_ in kwargs.items() if k_.startswith("seqlens")})
    empty = ~vis.any(-1)
    assert empty.any(), "the problem must contain rows that see no key"
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out.float()[empty.unsqueeze(1).expand(-1, out.shape[1], -1)] == 0).all()
    assert (lse[empty.unsqueeze(1).expand_as(lse)] == float("-inf")).all()
    check_forward(fagen.load(spec), spec, problem, DEVICE)


def test_strided_and_misaligned_inputs():
    """[B, S, H, D] views (strided), and a view 2 bytes off 16-byte alignment (copied first), give the reference."""
    spec = cuda_spec(head_dim=64, mask="causal", gqa=2)
    mod = fagen.load(spec)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 333, 4, 64, generator=g).half().to(DEVICE).transpose(1, 2)
    k = torch.randn(2, 210, 2, 64, generator=g).half().to(DEVICE).transpose(1, 2)
    v = torch.randn(2, 210, 2, 64, generator=g).half().to(DEVICE).transpose(1, 2)
    assert not q.is_contiguous()
    for args in ((q, k, v), (_misaligned(q), k, v)):
        out, lse = mod.forward(*args)
        ref_out, ref_lse = reference.attention(q, k, v, mask="causal")
        compare("out", out, ref_out, **TOLERANCE[DType.FP16])
        compare("lse", lse, ref_lse, **LSE_TOLERANCE)


def _misaligned(t):
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 != 0
    return view


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", list(Mask))
@given(data=st.data())
def test_cuda_and_triton_agree(mask, dtype, data):
    """Cross-backend: on the same inputs the CUDA and Triton kernels agree within the dtype's tolerance."""
    spec = data.draw(property_specs(mask, dtype, head_dims=(40, 128)), label="spec")  # few Triton compiles
    problem = data.draw(problems(spec, SCALE), label="problem")
    (q, k, v), kwargs = problem.inputs(spec, DEVICE)
    twin = fagen.KernelSpec(head_dim=spec.head_dim, mask=mask, gqa=spec.gqa, dtype=dtype)
    out, lse = fagen.load(spec).forward(q, k, v, **kwargs)
    out_t, lse_t = fagen.load(twin).forward(q, k, v, **kwargs)
    compare("out (cuda vs triton)", out, out_t.double(), **TOLERANCE[dtype])
    compare("lse (cuda vs triton)", lse, lse_t.double(), **LSE_TOLERANCE)


def test_launches_on_the_current_stream():
    spec = cuda_spec(head_dim=128, mask="causal", dtype="bf16")
    mod = fagen.load(spec)
    (q, k, v), _ = Problem(batch=2, heads_kv=2, seq_q=2048, seq_k=2048, seed=5).inputs(spec, DEVICE)
    want = mod.forward(q, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = mod.forward(q, k, v)
    side.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_prebuilt_cubin_runs_without_compiling(tmp_path, monkeypatch):
    spec = cuda_spec(head_dim=64, mask="tree", dtype="fp16", gqa=2)
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    built = nvcc.compile_spec(spec, arch, tmp_path)
    mod = fagen.load(spec)
    problem = _ragged(Mask.TREE, seed=6)
    want = check_forward(mod, spec, problem, DEVICE)

    def refuse(*args, **kwargs):
        raise AssertionError("compiled again although a prebuilt cubin was registered")

    monkeypatch.setattr(nvcc, "compile_cached", refuse)
    mod.use_cubin(built.cubin, arch)
    assert check_forward(mod, spec, problem, DEVICE).max_err == want.max_err


# Deliberately broken CUDA kernels (text edits of the rendered .cu): the properties above must catch each one.
CUDA_MUTANTS = [
    ("causal-off-by-one", "causal", "8 * rh) + shift + 1)", "8 * rh) + shift)"),
    ("dropped-rescale", "none", "acc[mt][dt][0] *= alpha[mt][0];", "acc[mt][dt][0] *= 1.0f;"),
    ("wrong-gqa-head", "none", "const int h_kv = h / GQA;", "const int h_kv = h % (num_heads / GQA);"),
    ("tree-ignores-bits", "tree", "return (word >> (node % 32)) & 1u;", "return word == word;"),
    ("padding-rows-kept", "causal+padding", "l != 0.0f && row < len_q;", "l != 0.0f;"),
    ("unmasked-tail", "padding", "const int lim = len_k -", "const int lim = len_k + BLOCK_N -"),
]


def _load_mutant(spec, old, new):
    """The launcher of `spec` over a .cu with `old` replaced by `new`, rendered into the cache and imported."""
    source = fagen.generate(spec)
    assert old in source, f"mutant pattern {old!r} not in the rendered source"
    broken = source.replace(old, new)
    stem = f"{spec.name}-mutant{files.digest(broken)[:12]}"
    folder = files.cache_root() / "src"
    files.write_if_different(folder / f"{stem}.cu", broken)
    files.write_if_different(folder / f"{stem}.py", generate_launcher(spec))
    return import_module(folder / f"{stem}.py")


@pytest.mark.parametrize("name, mask, old, new", CUDA_MUTANTS, ids=[m[0] for m in CUDA_MUTANTS])
def test_broken_kernels_are_caught(name, mask, old, new):
    spec = cuda_spec(head_dim=64, mask=mask, dtype="fp16", gqa=4)
    problem = _ragged(Mask(mask), seed=21)
    check_forward(fagen.load(spec), spec, problem, DEVICE)  # the intact kernel passes ...
    with pytest.raises(PropertyFailure):  # ... and the broken one fails
        check_forward(_load_mutant(spec, old, new), spec, problem, DEVICE)


@pytest.mark.parametrize("switches", [dict(window=True), dict(softcap=True), dict(window=True, softcap=True)])
@pytest.mark.parametrize("mask", list(Mask))
def test_window_and_softcap_match_reference(mask, switches):
    """The cuda forward's window (with block skipping) and softcap against float64, on ragged problems."""
    spec = cuda_spec(head_dim=64, mask=mask, dtype="bf16", gqa=4, **switches)
    module = fagen.load(spec)
    sq, sk = (9, 9 + 1000) if mask is Mask.TREE else (1000, 1537)
    for window in ((0, 0), (127, 0), (300, 45), (None, 64), (2000, None)):
        problem = Problem(batch=2, heads_kv=2, seq_q=sq, seq_k=sk, seed=5, magnitude=4.0,
                          seqlens_q=(sq, sq // 3) if mask.padded else None,
                          seqlens_k=(sk, sk // 2) if mask.padded else None,
                          parents=((-1, 0, 1, 1, 0, 4, -1, 6, 2),) * 2 if mask is Mask.TREE else None,
                          window=window if spec.window else None, softcap=5.0 if spec.softcap else None)
        check_forward(module, spec, problem, DEVICE)
        if not spec.window:
            break
