"""Split-KV decode kernels against the float64 reference, against the prefill kernels, and their input errors."""

import types
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fagen
from fagen.runtime import kinds as select
from fagen.runtime import loader as runtime
from fagen.spec import axes, tables, targets
from fagen.verify.properties import reference
from fagen.spec.axes import DType, Kind, Mask
from fagen.verify.strategies import GPU_HEAD_DIMS, Problem, decode_problems, specs
from fagen.verify.mutants import MUTANTS
from fagen.verify.properties import TOLERANCE, PropertyFailure, check_forward, compare
from _env import DEVICE, ON_GPU, SCALE

HEAD_DIMS = GPU_HEAD_DIMS if ON_GPU else (16, 24, 40)
BLOCKS = (32, 64) if ON_GPU else (16, 32)  # block_m caps the packed rows; block_n keys per step
SPLITS = st.one_of(st.none(), st.integers(1, 9), st.sampled_from((64, 1000)))


def with_splits(module, num_splits):
    """The module seen through check_forward, with the number of KV splits fixed (None: the module's choice)."""
    return types.SimpleNamespace(forward=lambda *a, **kw: module.forward_split(*a, num_splits=num_splits, **kw))


def decode_spec(**fields):
    return fagen.KernelSpec(kind="decode", **fields)


@pytest.mark.parametrize("dtype", list(DType.portable()))
@pytest.mark.parametrize("mask", list(Mask))
@given(data=st.data())
def test_decode_matches_reference(mask, dtype, data):
    spec = data.draw(specs(masks=[mask], dtypes=[dtype], head_dims=HEAD_DIMS, gqas=(1, 4, 8), blocks=BLOCKS,
                           kinds=[Kind.DECODE]), label="spec")
    problem = data.draw(decode_problems(spec, SCALE), label="problem")
    num_splits = data.draw(SPLITS, label="num_splits")
    check_forward(with_splits(fagen.load(spec), num_splits), spec, problem, DEVICE)


def _fixed_problem(mask, seq_q, seed=11):
    """Two sequences, 83 keys (83 = 5 * 16 + 3: not a multiple of any block or split), ragged padding, a tree."""
    padded = mask.padded
    parents = (-1, 0, 0, 1, 3, -1, 5, 2, 7, 8, 0, 10, 11, 12, 13, 14)[:seq_q]
    return Problem(batch=2, heads_kv=2, seq_q=seq_q, seq_k=83 + (seq_q if mask is Mask.TREE else 0), seed=seed,
                   seqlens_q=(seq_q, max(seq_q - 2, 0)) if padded else None, seqlens_k=(83, 40) if padded else None,
                   parents=(parents, parents) if mask is Mask.TREE else None, poison=padded)


@pytest.mark.parametrize("gqa, seq_q", [(1, 1), (4, 5), (8, 16)])
@pytest.mark.parametrize("dtype", list(DType.portable()))
@pytest.mark.parametrize("mask", list(Mask))
def test_every_mask_dtype_gqa(mask, dtype, gqa, seq_q):
    """Fixed coverage: 1 row (broadcast path), 20 rows (one 32-row tile), 128 rows (four 32-row tiles); 3 splits."""
    spec = decode_spec(head_dim=40, mask=mask, dtype=dtype, gqa=gqa, block_m=32, block_n=16)
    check_forward(with_splits(fagen.load(spec), 3), spec, _fixed_problem(mask, seq_q), DEVICE)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5, 6, 7, 100])
def test_split_boundaries(num_splits):
    """97 keys in blocks of 16: chunks of 1..7 blocks, a short last chunk, and more splits asked than blocks."""
    spec = decode_spec(head_dim=32, mask="causal", gqa=2, block_n=16)
    problem = Problem(batch=1, heads_kv=2, seq_q=3, seq_k=97, magnitude=4.0, seed=num_splits)
    check_forward(with_splits(fagen.load(spec), num_splits), spec, problem, DEVICE)


@pytest.mark.parametrize("mask, problem", [
    ("none", Problem(batch=1, heads_kv=1, seq_q=3, seq_k=0, seed=1)),  # an empty cache
    ("causal", Problem(batch=1, heads_kv=2, seq_q=9, seq_k=4, seed=2)),  # rows i < 5 see nothing
    ("padding", Problem(batch=3, heads_kv=1, seq_q=2, seq_k=70, seqlens_q=(2, 2, 0), seqlens_k=(0, 1, 70),
                        poison=True, seed=3)),
    ("causal+padding", Problem(batch=2, heads_kv=1, seq_q=4, seq_k=50, seqlens_q=(4, 3), seqlens_k=(1, 0),
                               poison=True, seed=4)),
])
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_empty_and_length_one_caches(mask, problem, num_splits):
    """KV lengths 0 and 1: rows that see no key give out = 0 and lse = -inf, and empty splits add nothing."""
    spec = decode_spec(head_dim=32, mask=mask, gqa=2, block_n=16)
    (q, k, v), kwargs = problem.inputs(spec, DEVICE)
    out, lse = fagen.load(spec).forward_split(q, k, v, num_splits=num_splits, **kwargs)
    vis = reference.visible(mask, problem.batch, problem.seq_q, problem.seq_k, device=DEVICE,
                            **{k_: v_ for k_, v_ in kwargs.items() if k_.startswith("seqlens")})
    empty = ~vis.any(-1)  # [B, Sq]
    assert empty.any(), "the problem must contain rows that see no key"
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out.float()[empty.unsqueeze(1).expand(-1, out.shape[1], -1)] == 0).all()
    assert (lse[empty.unsqueeze(1).expand_as(lse)] == float("-inf")).all()
    check_forward(with_splits(fagen.load(spec), num_splits), spec, problem, DEVICE)


@pytest.mark.parametrize("mask", list(Mask))
def test_decode_agrees_with_prefill(mask):
    """The two kinds are interchangeable: same inputs, outputs within the dtype's tolerance of each other."""
    dtype = DType.BF16
    decode = decode_spec(head_dim=64, mask=mask, dtype=dtype, gqa=4, block_n=32)
    prefill = fagen.KernelSpec(head_dim=64, mask=mask, dtype=dtype, gqa=4, block_m=16, block_n=32)
    problem = _fixed_problem(mask, seq_q=7, seed=5)
    (q, k, v), kwargs = problem.inputs(decode, DEVICE)
    d_out, d_lse = fagen.load(decode).forward_split(q, k, v, num_splits=4, **kwargs)
    p_out, p_lse = fagen.load(prefill).forward(q, k, v, **kwargs)
    compare("out", d_out, p_out, **TOLERANCE[dtype])
    compare("lse", d_lse, p_lse, atol=1e-4, rtol=1e-4)


def test_strided_inputs():
    """q/k/v as [B, S, H, D] views transposed to [B, H, S, D] (not contiguous) give the reference result."""
    spec = decode_spec(head_dim=32, mask="causal", gqa=4, block_n=16)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 8, 32, generator=g).half().to(DEVICE).transpose(1, 2)
    k = torch.randn(2, 45, 2, 32, generator=g).half().to(DEVICE).transpose(1, 2)
    v = torch.randn(2, 45, 2, 32, generator=g).half().to(DEVICE).transpose(1, 2)
    assert not q.is_contiguous()
    out, lse = fagen.load(spec).forward_split(q, k, v, num_splits=3)
    ref_out, ref_lse = reference.attention(q, k, v, mask="causal")
    compare("out", out, ref_out, **TOLERANCE[DType.FP16])
    compare("lse", lse, ref_lse, atol=1e-4, rtol=1e-4)


def test_tree_parents_and_bool_mask_agree():
    spec = decode_spec(head_dim=16, mask="tree", gqa=2, block_n=16)
    mod = fagen.load(spec)
    parents = torch.tensor([[-1, 0, 0, 1, 3, -1, 5, 6, 2, 8, 9]], dtype=torch.int32)
    problem = Problem(batch=1, heads_kv=1, seq_q=11, seq_k=60, parents=(tuple(parents[0].tolist()),), seed=5)
    (q, k, v), _ = problem.inputs(spec, DEVICE)
    a = mod.forward(q, k, v, tree_mask=reference.ancestors_from_parents(parents).to(DEVICE))
    b = mod.forward(q, k, v, tree_mask=parents.to(DEVICE))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_split_heuristic():
    mod = fagen.load(decode_spec(head_dim=128, gqa=4, dtype="bf16"))
    # The shapes on an H100 (132 SMs): batch 8 x 8 KV heads needs splits; batch 32 x 8 fills the GPU.
    assert mod.num_splits_for(8 * 8, 32768, 132) > 1
    assert mod.num_splits_for(32 * 8, 8192, 132) == 1
    assert mod.num_splits_for(1, 10, 132) == 1  # a single block of keys is never split
    assert mod.num_splits_for(1, 100_000, 132) <= mod.MAX_SPLITS
    assert mod.tile_rows(1) == 1 and mod.tile_rows(4) == 16 and mod.tile_rows(20) == 32
    assert mod.tile_rows(8 * 16) == mod.BLOCK_M == 64  # the cap: 128 packed rows take two tiles
    assert mod.MAX_SEQ_Q == axes.DECODE_MAX_SEQ_Q


def test_select_rule():
    assert select.prefers_decode(1, 4096) and select.prefers_decode(16, 256)
    assert not select.prefers_decode(17, 4096)  # too many queries: prefill
    assert not select.prefers_decode(1, 100)  # a short cache: prefill's grid is enough
    assert not select.prefers_decode(0, 4096)
    assert select.kind_for(4, 8192) is Kind.DECODE and select.kind_for(512, 8192) is Kind.PREFILL


def test_spec_rules():
    spec = decode_spec(head_dim=128)
    assert spec.name.startswith("decode_fwd_full_d128_m64n64") and spec.direction == "fwd"
    assert fagen.KernelSpec.from_json(spec.to_json()) == spec
    with pytest.raises(fagen.SpecError, match="direction: got 'bwd'; decode kernels are forward-only"):
        decode_spec(head_dim=64, direction="bwd")
    with pytest.raises(fagen.SpecError, match="block_m"):
        decode_spec(head_dim=64, block_m=8)


@pytest.mark.parametrize("kwargs, message", [
    ({"seq_q": 17}, "seq_q: 17 query tokens, but decode kernels take 1 to 16; use a kind='prefill' spec"),
    ({"num_splits": 0}, "num_splits: expected a positive int"),
    ({"num_splits": 2.0}, "num_splits: expected a positive int"),
    ({"dtype": torch.float32}, "q: dtype torch.float32"),
])
def test_bad_inputs_raise_clear_errors(kwargs, message):
    spec = decode_spec(head_dim=32, gqa=2)
    mod = fagen.load(spec)
    (q, k, v), _ = Problem(batch=1, heads_kv=1, seq_q=kwargs.get("seq_q", 2), seq_k=40).inputs(spec, DEVICE)
    if "dtype" in kwargs:
        q = q.to(kwargs["dtype"])
    with pytest.raises(mod.InputError, match=message):
        mod.forward_split(q, k, v, num_splits=kwargs.get("num_splits"))


@pytest.mark.parametrize("mutant", [m for m in MUTANTS if Kind.DECODE in m.kinds], ids=lambda m: m.name)
def test_decode_mutants_are_caught(mutant):
    """Each deliberately broken decode kernel fails check_forward on a problem with several uneven splits."""
    spec = decode_spec(head_dim=32, mask="padding", gqa=4, block_n=16)
    assert mutant.applies(spec)
    broken = runtime.load_source(mutant.apply(fagen.generate(spec)), f"mutant_{mutant.name.replace('-', '_')}")
    # Twice, on fresh inputs: the second launch reuses the first one's workspace and ticket counters (and may get
    # the first one's output memory back from the allocator, so its inputs differ).
    problems = [Problem(batch=2, heads_kv=1, seq_q=2, seq_k=90, seqlens_q=(2, 1), seqlens_k=(90, 75), seed=seed)
                for seed in (9, 10)]
    for problem in problems:
        check_forward(with_splits(fagen.load(spec), 4), spec, problem, DEVICE)  # the intact kernel passes
    with pytest.raises(PropertyFailure):
        for problem in problems:
            check_forward(with_splits(broken, 4), spec, problem, DEVICE)


def test_bench_script_smoke(capsys):
    """scripts/bench_decode.py --smoke runs end to end (on the CPU through the interpreter) and checks outputs."""
    path = Path(__file__).resolve().parent.parent / "scripts" / "bench_decode.py"
    bench = runtime.load_source(path.read_text(), "bench_decode_script")
    assert bench.main(["--smoke", "--splits", "auto", "3", "--block-n", "16", "--sets", "1"]) == 0
    assert "best fagen config per case" in capsys.readouterr().out
