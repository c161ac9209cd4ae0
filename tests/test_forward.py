"""Generated forward kernels against the float64 reference: properties, edge cases and input errors."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fagen
from fagen.verify import reference
from fagen.spec.axes import DType, Mask
from fagen.verify.strategies import GPU_HEAD_DIMS, Problem, problems, specs
from fagen.verify.properties import check_forward
from _env import DEVICE, ON_GPU, SCALE

# On a GPU every new spec is a compile: keep default blocks and two gqa values there.
HEAD_DIMS = GPU_HEAD_DIMS if ON_GPU else (16, 24, 40, 64)
BLOCKS = None if ON_GPU else (16, 32)
GQAS = (1, 4) if ON_GPU else (1, 2, 4)


@pytest.mark.parametrize("dtype", list(DType.portable()))
@pytest.mark.parametrize("mask", list(Mask))
@given(data=st.data())
def test_forward_matches_reference(mask, dtype, data):
    spec = data.draw(specs(masks=[mask], dtypes=[dtype], head_dims=HEAD_DIMS, blocks=BLOCKS, gqas=GQAS), label="spec")
    problem = data.draw(problems(spec, SCALE), label="problem")
    check_forward(fagen.load(spec), spec, problem, DEVICE)


@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("dtype", list(DType.portable()))
@pytest.mark.parametrize("mask", list(Mask))
def test_every_mask_dtype_gqa_with_odd_head_dim(mask, dtype, gqa):
    """Fixed coverage: every mask x dtype x gqa 1/4, head_dim 40 (not a power of two), ragged lengths."""
    spec = fagen.KernelSpec(head_dim=40, mask=mask, dtype=dtype, gqa=gqa, block_m=16, block_n=16)
    sq, sk = (9, 9 + 37) if mask is Mask.TREE else (37, 53)
    problem = Problem(batch=2, heads_kv=2, seq_q=sq, seq_k=sk, seed=7,
                      seqlens_q=(37, 20) if mask.padded else None, seqlens_k=(53, 1) if mask.padded else None,
                      parents=((-1, 0, 1, 1, 0, 4, -1, 6, 2),) * 2 if mask is Mask.TREE else None)
    check_forward(fagen.load(spec), spec, problem, DEVICE)


@pytest.mark.parametrize("mask, problem", [
    ("causal", Problem(batch=1, heads_kv=1, seq_q=40, seq_k=7, seed=1)),  # rows i < 33 see nothing
    ("padding", Problem(batch=2, heads_kv=1, seq_q=20, seq_k=20, seqlens_q=(20, 5), seqlens_k=(0, 20), seed=2)),
    ("causal+padding", Problem(batch=1, heads_kv=1, seq_q=30, seq_k=30, seqlens_q=(25,), seqlens_k=(3,),
                               poison=True, seed=3)),
    ("none", Problem(batch=1, heads_kv=1, seq_q=5, seq_k=0, seed=4)),
])
def test_rows_that_see_no_key_give_zero_and_minus_inf(mask, problem):
    spec = fagen.KernelSpec(head_dim=32, mask=mask, block_m=16, block_n=16)
    (q, k, v), kwargs = problem.inputs(spec, DEVICE)
    out, lse = fagen.load(spec).forward(q, k, v, **kwargs)
    vis = reference.visible(mask, problem.batch, problem.seq_q, problem.seq_k, device=DEVICE,
                            **{k_: v_ for k_, v_ in kwargs.items() if k_.startswith("seqlens")})
    empty = ~vis.any(-1)  # [B, Sq]
    assert empty.any(), "the problem must contain rows that see no key"
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out.float()[empty.unsqueeze(1).expand(-1, out.shape[1], -1)] == 0).all()
    assert (lse[empty.unsqueeze(1).expand_as(lse)] == float("-inf")).all()
    check_forward(fagen.load(spec), spec, problem, DEVICE)


def test_strided_inputs():
    """q/k/v as [B, S, H, D] views transposed to [B, H, S, D] (not contiguous) give the same result."""
    spec = fagen.KernelSpec(head_dim=32, mask="causal", gqa=2, block_m=16, block_n=16)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 33, 4, 32, generator=g).half().to(DEVICE).transpose(1, 2)
    k = torch.randn(2, 21, 2, 32, generator=g).half().to(DEVICE).transpose(1, 2)
    v = torch.randn(2, 21, 2, 32, generator=g).half().to(DEVICE).transpose(1, 2)
    assert not q.is_contiguous()
    out, lse = fagen.load(spec).forward(q, k, v)
    ref_out, ref_lse = reference.attention(q, k, v, mask="causal")
    torch.testing.assert_close(out.double(), ref_out, atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


def test_tree_parents_and_bool_mask_agree():
    spec = fagen.KernelSpec(head_dim=16, mask="tree", block_m=16, block_n=16)
    mod = fagen.load(spec)
    parents = torch.tensor([[-1, 0, 0, 1, 3, -1, 5] + list(range(6, 40))], dtype=torch.int32)
    tree = reference.ancestors_from_parents(parents)
    assert torch.equal(mod.tree_mask_from_parents(parents), tree)
    problem = Problem(batch=1, heads_kv=1, seq_q=41, seq_k=60, parents=(tuple(parents[0].tolist()),), seed=5)
    (q, k, v), _ = problem.inputs(spec, DEVICE)
    a = mod.forward(q, k, v, tree_mask=tree.to(DEVICE))
    b = mod.forward(q, k, v, tree_mask=parents.to(DEVICE))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _inputs(spec, b=1, hkv=1, sq=8, sk=8):
    (q, k, v), _ = Problem(batch=b, heads_kv=hkv, seq_q=sq, seq_k=sk).inputs(spec, DEVICE)
    return q, k, v


@pytest.mark.parametrize("mutate, kwargs, message", [
    (lambda q, k, v: (q.float(), k, v), {}, "q: dtype torch.float32"),
    (lambda q, k, v: (q[..., :16], k, v), {}, "head_dim 16"),
    (lambda q, k, v: (q[:, :1], k, v), {}, "heads: q has 1 heads"),
    (lambda q, k, v: (q, k, v[:, :, :3]), {}, "k and v must have one shape"),
    (lambda q, k, v: (q[0], k, v), {}, "expected 4 dims"),
    (lambda q, k, v: (q, k, v), {"seqlens_q": torch.tensor([3], dtype=torch.int32)}, "has no padding"),
    (lambda q, k, v: (q, k, v), {"tree_mask": torch.ones(1, 8, 8, dtype=torch.bool)}, "takes no tree"),
    (lambda q, k, v: (q, k, v), {"scale": float("nan")}, "scale: expected a positive finite float"),
    (lambda q, k, v: (q, k, v), {"scale": -0.1}, "scale: expected a positive finite float"),
])
def test_bad_inputs_raise_clear_errors(mutate, kwargs, message):
    spec = fagen.KernelSpec(head_dim=32, mask="causal", gqa=2, block_m=16, block_n=16)
    mod = fagen.load(spec)
    q, k, v = mutate(*_inputs(spec))
    kwargs = {k_: (v_.to(DEVICE) if isinstance(v_, torch.Tensor) else v_) for k_, v_ in kwargs.items()}
    with pytest.raises(mod.InputError, match=message.replace("(", r"\(")):
        mod.forward(q, k, v, **kwargs)


@pytest.mark.parametrize("mask, kwargs, message", [
    ("padding", {}, "needs seqlens_q"),
    ("padding", {"seqlens_q": torch.tensor([9]), "seqlens_k": torch.tensor([8])}, r"lie in \[0, 8\]"),
    ("padding", {"seqlens_q": torch.tensor([1.0]), "seqlens_k": torch.tensor([8])},
     "expected an int32 or int64 tensor"),
    ("padding", {"seqlens_q": torch.tensor([1, 2]), "seqlens_k": torch.tensor([8])}, r"expected shape \(1,\)"),
    ("tree", {}, "needs tree_mask"),
    ("tree", {"tree_mask": torch.ones(1, 4, 4, dtype=torch.bool)}, r"expected bool \[1, 8, 8\]"),
    ("tree", {"tree_mask": torch.tensor([[0, 0, 1, 2, 3, 4, 5, 6]], dtype=torch.int32)}, "earlier node"),
])
def test_bad_mask_inputs_raise_clear_errors(mask, kwargs, message):
    spec = fagen.KernelSpec(head_dim=32, mask=mask, block_m=16, block_n=16)
    mod = fagen.load(spec)
    kwargs = {k_: v_.to(DEVICE) for k_, v_ in kwargs.items()}
    with pytest.raises(mod.InputError, match=message):
        mod.forward(*_inputs(spec), **kwargs, check=True)


# [Note] Value checks are opt-in (check=True or FAGEN_CHECK=1): they read device values, which a CUDA graph
# capture forbids. Without them a bad length or tree is the caller's contract to keep; the kernel still never
# reads out of bounds (lengths clamp to the tensor, a bad tree is read as some tree).
@pytest.mark.parametrize("tree, message", [
    ([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 1]], "not ancestor-closed"),  # 2 sees 1, not 1's root 0
    ([[1, 0, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], "must see itself"),
    ([[1, 1, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], "sees a later node"),
    ([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 1, 1]], "not ancestor-closed"),  # 3 sees 1 and 2: a DAG
])
def test_a_bool_tree_that_breaks_the_contract_is_refused_with_check(tree, message):
    spec = fagen.KernelSpec(head_dim=32, mask="tree", block_m=16, block_n=16)
    mod = fagen.load(spec)
    bad = torch.tensor([tree], dtype=torch.bool, device=DEVICE)
    with pytest.raises(mod.InputError, match=message):
        mod.forward(*_inputs(spec, sq=4, sk=9), tree_mask=bad, check=True)
    mod.forward(*_inputs(spec, sq=4, sk=9), tree_mask=bad)  # unchecked by default: no host sync, no error


def test_a_valid_bool_tree_passes_the_check_and_equals_its_parent_pointers():
    spec = fagen.KernelSpec(head_dim=32, mask="tree", block_m=16, block_n=16)
    mod = fagen.load(spec)
    parents = torch.tensor([[-1, 0, 0, 1, -1, 4]], dtype=torch.int32, device=DEVICE)
    tree = mod.tree_mask_from_parents(parents)
    q, k, v = _inputs(spec, sq=6, sk=11)
    a = mod.forward(q, k, v, tree_mask=tree, check=True)
    b = mod.forward(q, k, v, tree_mask=parents, check=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_value_checks_follow_fagen_check(monkeypatch):
    spec = fagen.KernelSpec(head_dim=32, mask="padding", block_m=16, block_n=16)
    mod = fagen.load(spec)
    lens = {"seqlens_q": torch.tensor([9], device=DEVICE), "seqlens_k": torch.tensor([8], device=DEVICE)}
    mod.forward(*_inputs(spec), **lens)  # off by default
    monkeypatch.setattr(mod, "CHECK", True)  # what FAGEN_CHECK=1 at import sets
    with pytest.raises(mod.InputError, match=r"lie in \[0, 8\]"):
        mod.forward(*_inputs(spec), **lens)
    mod.forward(*_inputs(spec), **lens, check=False)  # an explicit argument wins


@pytest.mark.parametrize("mask", ["none", "causal", "padding", "tree"])
def test_nan_in_a_valid_key_propagates_like_the_reference(mask):
    """Issue 18: NaN in k[..., 7, :] used to turn 13 causal rows into out = 0, lse = -inf."""
    spec = fagen.KernelSpec(head_dim=32, mask=mask, block_m=16, block_n=16, dtype="fp32")
    problem = Problem(batch=1, heads_kv=2, seq_q=20, seq_k=27, seed=7,
                      seqlens_q=(20,) if spec.mask.padded else None, seqlens_k=(25,) if spec.mask.padded else None,
                      parents=((-1,) + tuple(range(19)),) if mask == "tree" else None)
    from fagen.verify.properties import check_nan_propagates

    check_nan_propagates(fagen.load(spec), spec, problem, DEVICE)
    (q, k, v), kwargs = problem.inputs(spec, DEVICE)
    k[0, 0, 7, 3] = float("nan")
    out, lse = fagen.load(spec).forward(q, k, v, **kwargs)
    sees = torch.isnan(lse[0, 0])
    assert sees.any() and torch.isnan(out[0, 0][sees]).all()
    assert torch.isfinite(lse[0, 1]).all()  # the other KV head's query heads never see the NaN key


def test_tree_needs_enough_keys():
    spec = fagen.KernelSpec(head_dim=32, mask="tree", block_m=16, block_n=16)
    with pytest.raises(fagen.load(spec).InputError, match="needs at least 8 keys"):
        fagen.load(spec).forward(*_inputs(spec, sq=8, sk=5), tree_mask=torch.ones(1, 8, 8, dtype=torch.bool))
