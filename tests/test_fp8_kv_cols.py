"""Column-split latent scores for an fp8 latent cache ([Note] Column-split scores in the decode template): the latent
score q_c . v^T as a batched dot over SPLIT_COLS column slices (each slice's partial scores summed across the
slices) and P @ V accumulated by slice. The result must stay the float64 reference's on the dequantized cache at
bf16's tolerance, for every slice count the template may take, dense and paged, one scale a tensor and per token
(P's fp16 scale changing from one key block to the next included), through the split rule and one split, and with
query rows of more than one tile."""

import pytest
import torch

import fagen
from _env import DEVICE
from fagen.runtime.loader import load_source
from test_fp8_f16dots import DV, LENS, _check, _problem, _spec

COLS = "SPLIT_COLS = tl.constexpr({})"


def _cols(spec: fagen.KernelSpec, n: int):
    """The spec's module with SPLIT_COLS = n, whatever the default."""
    source = fagen.generate(spec)
    default = next((COLS.format(c) for c in (1, 2, 4, 8) if COLS.format(c) in source), None)
    assert default is not None, "the fp8 latent decode render has no SPLIT_COLS"
    return load_source(source.replace(default, COLS.format(n)), f"{spec.name}_cols{n}")


CASES = [  # (kv, layout, per-token scales' log2 range or None, score scale)
    ("fp8_e4m3", "paged", (-3, 3), None),
    ("fp8_e4m3", "dense", None, None),
    ("fp8_e5m2", "paged", None, None),
    ("fp8_e4m3", "paged", "blocks", 2.0 ** -14),  # P's scale changes block to block: the slices rescale together
]


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("kv,layout,tok_log2,scale", CASES, ids=str)
def test_column_split_scores_match_the_dequantized_reference(kv, layout, tok_log2, scale, n):
    """out within atol * max(1, T) + rtol * |o| of the reference (T: the reference on |V|) and lse within its
    tolerance, with the latent (DV = 24, a 32-column tile) split into n slices, at the split rule (one key block a
    split here) and one split."""
    gen = torch.Generator().manual_seed(sum(map(ord, f"{kv}{layout}{tok_log2}{n}")))
    module = _cols(_spec(kv, True, layout), n)
    q, caches, scales, kw, keys = _problem(gen, kv, True, layout, 0, tok_log2)
    sc = scales[0].to(DEVICE) if isinstance(scales[0], torch.Tensor) else scales[0]
    kw = {k: v.to(DEVICE) for k, v in kw.items()}
    for splits in (None, 1):
        out, lse = module.forward_split(q.to(DEVICE), caches[0].to(DEVICE), None, num_splits=splits, scale=scale,
                                        k_scale=sc, **kw)
        _check(q, keys, out, lse, True, scale)


def test_column_split_scores_with_rows_of_two_tiles():
    """gqa 4 x Sq 5 = 20 packed rows: two 16-row tiles, each with its own q slices and accumulator slices."""
    spec = fagen.KernelSpec(head_dim=40, head_dim_v=DV, shared_kv=True, kind="decode", gqa=4, dtype="bf16",
                            mask="causal", layout="paged", kv_dtype="fp8_e4m3", block_n=16, block_m=16)
    module = _cols(spec, 4)
    gen = torch.Generator().manual_seed(7)
    b, page, sq = len(LENS), 16, 5
    width = -(-max(LENS) // page)
    q = torch.randn(b, 4, sq, 40, generator=gen).bfloat16()
    cache = torch.randn(b * width, page, 1, 40, generator=gen).to(torch.float8_e4m3fn)
    ks = torch.exp2(torch.rand(cache.shape[:-1], generator=gen) * 6 - 3)
    table = torch.randperm(b * width, generator=gen).to(torch.int32).view(b, width)
    out, lse = module.forward(q.to(DEVICE), cache.to(DEVICE), None, block_table=table.to(DEVICE),
                              seqlens_k=torch.tensor(LENS, dtype=torch.int32, device=DEVICE), k_scale=ks.to(DEVICE))
    from fagen.verify import reference
    from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare
    for i, n in enumerate(LENS):
        keys = reference.dequantize(cache, ks)[table[i].long()].reshape(-1, 1, 40)[:n].transpose(0, 1)[None]
        want, want_lse = reference.attention(q[i:i + 1].double(), keys, None, head_dim_v=DV, mask="causal")
        terms, _ = reference.attention(q[i:i + 1].double(), keys, keys[..., :DV].abs(), mask="causal")
        unit = terms.clamp(min=1.0)
        compare(f"out {i}", out[i:i + 1].cpu().double() / unit, want / unit, **TOLERANCE["bf16"])
        compare(f"lse {i}", lse[i:i + 1].cpu(), want_lse, **LSE_TOLERANCE)
