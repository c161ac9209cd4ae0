"""fp16 dots for an fp8 KV cache read by bf16 queries ([Note] fp16 dots in the decode template): the tiles convert to
fp16, q and P go into fp16 scaled by powers of two, and the result must stay the float64 reference's on the
dequantized cache at bf16's tolerance even where fp16's range would break an unscaled q or P: queries far above
fp16's largest value or far below its normals (with a score scale that keeps the scores moderate), and per-token
v scales far above 1 (P * vs past 65504) or far below (P * vs in fp16's subnormals)."""

import pytest
import torch

import fagen
from _env import DEVICE
from fagen.runtime.loader import load_source
from fagen.verify import reference
from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
D, DV = 40, 24  # MLA's 576 / 512 scaled down (tests/test_fp8_pertoken.py)
HD = 32  # a cache with its own v
LENS = (50, 23)  # not multiples of the key block (16)
ON = ("_F16_DOTS = False", "_F16_DOTS = True")
LAZY = ("LAZY_RESCALE = tl.constexpr(False)", "LAZY_RESCALE = tl.constexpr(True)")


def _f16(spec: fagen.KernelSpec, lazy: bool):
    """The spec's module with fp16 dots (and the lazy rescale on or off), whatever the defaults."""
    source = fagen.generate(spec)
    for switch, on in ((ON, True), (LAZY, lazy)):
        assert switch[0] in source or switch[1] in source, f"the fp8 decode render has no {switch[0]!r}"
        source = source.replace(*switch) if on else source.replace(*reversed(switch))
    return load_source(source, f"{spec.name}_f16test{int(lazy)}")


def _spec(kv, shared, layout):
    mask = "padding" if layout == "dense" else "none"  # dense: ragged lengths
    if shared:
        return fagen.KernelSpec(head_dim=D, head_dim_v=DV, shared_kv=True, kind="decode", gqa=4, dtype="bf16",
                                mask=mask, layout=layout, kv_dtype=kv, block_n=16)
    return fagen.KernelSpec(head_dim=HD, kind="decode", gqa=4, dtype="bf16", mask=mask, layout=layout,
                            kv_dtype=kv, block_n=16)


def _log_uniform(gen, lo, hi, *shape):
    return torch.exp2(lo + torch.rand(*shape, generator=gen) * (hi - lo))


def _problem(gen, kv, shared, layout, q_log2, tok_log2):
    """q (its values times 2^q_log2), the cache(s) with per-token scales log-uniform over 2^tok_log2 (None: one
    scale a tensor; "blocks": log-uniform 2^-1 .. 2 times 2^-12 .. 2^12 a key block, v's only where k has its
    own), the call's keywords and each sequence's float64 dequantized (k, v)."""
    d = D if shared else HD
    b, n_max, page = len(LENS), max(LENS), 16
    q = (torch.randn(b, 4, 1, d, generator=gen) * 2.0 ** q_log2).bfloat16()
    width = -(-n_max // page)
    caches, scales = [], []
    for which in range(1 if shared else 2):
        if layout == "dense":
            c = torch.randn(b, 1, n_max, d, generator=gen).to(FP8[kv])
        else:
            c = torch.randn(b * width, page, 1, d, generator=gen).to(FP8[kv])
        caches.append(c)
        if tok_log2 == "blocks" and which == 0 and not shared:  # k's moderate, v's by blocks
            scales.append(_log_uniform(gen, -3, 3, *c.shape[:-1]))
        elif tok_log2 == "blocks":  # each key block's scales 2^-12 .. 2^12 apart: P's scale changes block to block
            s = _log_uniform(gen, -1, 1, *c.shape[:-1])
            blocks = torch.arange(s.numel()).view(s.shape) // 16 if layout == "dense" else \
                torch.arange(s.shape[0]).view(-1, 1, 1).expand(s.shape)  # pages of 16 keys: one block each
            scales.append(s * torch.exp2(torch.randint(-12, 13, (int(blocks.max()) + 1,), generator=gen)
                                          .double()[blocks]).float())
        else:
            scales.append(0.7 if tok_log2 is None else _log_uniform(gen, *tok_log2, *c.shape[:-1]))
    if layout == "dense":
        kw = dict(seqlens_q=torch.ones(b, dtype=torch.int32), seqlens_k=torch.tensor(LENS, dtype=torch.int32))
        table = None
    else:
        table = torch.randperm(b * width, generator=gen).to(torch.int32).view(b, width)
        kw = dict(block_table=table, seqlens_k=torch.tensor(LENS, dtype=torch.int32))

    def seq(i, c, s):
        x = reference.dequantize(c, s)
        if layout == "dense":
            return x[i:i + 1, :, :LENS[i]]
        return x[table[i].long()].reshape(-1, 1, d)[:LENS[i]].transpose(0, 1)[None]
    keys = [(seq(i, caches[0], scales[0]), None if shared else seq(i, caches[1], scales[1])) for i in range(b)]
    return q, caches, scales, kw, keys


CASES = [  # (kv, shared, layout, q's log2 magnitude, per-token scales' log2 range or None, score scale)
    ("fp8_e4m3", True, "paged", 0, (-3, 3), None),
    ("fp8_e4m3", True, "dense", 0, None, None),
    ("fp8_e4m3", True, "paged", 17, (-3, 3), 2.0 ** -19),  # |q| past 65504: unscaled, q overflows fp16
    ("fp8_e4m3", True, "paged", -20, (-3, 3), 2.0 ** 18),  # |q| below 2^-14: unscaled, q is fp16 subnormals
    ("fp8_e4m3", True, "paged", 0, (10, 14), None),  # vs up to 2^14: P * vs past 65504
    ("fp8_e5m2", True, "paged", 0, (-26, -18), None),  # vs down to 2^-26: P * vs in fp16's subnormals
    ("fp8_e4m3", True, "paged", 0, "blocks", 2.0 ** -14),  # the accumulator rescaled as P's scale changes
    ("fp8_e4m3", False, "dense", 0, "blocks", None),
    ("fp8_e4m3", False, "dense", 0, (-3, 3), None),
    ("fp8_e5m2", False, "paged", 17, (10, 14), 2.0 ** -19),
    ("fp8_e4m3", False, "paged", -20, (-26, -18), 2.0 ** 18),
]


@pytest.mark.parametrize("lazy", [False, True], ids=["rescale", "lazy"])
@pytest.mark.parametrize("kv,shared,layout,q_log2,tok_log2,scale", CASES, ids=str)
def test_fp16_dots_match_the_dequantized_reference_across_fp16s_range(kv, shared, layout, q_log2, tok_log2, scale,
                                                                       lazy):
    """out within atol * max(1, T) + rtol * |o| of the reference (T: the reference on |V|, as in
    test_fp8_pertoken.py) and lse within its tolerance, for MLA's latent cache and a cache with its own v, dense
    (ragged lengths) and paged, with q and per-token scales where an unscaled fp16 q or P would overflow or
    underflow; one-scale caches too; with the accumulator rescaled every block and only where alpha != 1 ([Note]
    Lazy rescale)."""
    gen = torch.Generator().manual_seed(sum(map(ord, f"{kv}{shared}{layout}{q_log2}{tok_log2}")))
    module = _f16(_spec(kv, shared, layout), lazy)
    q, caches, scales, kw, keys = _problem(gen, kv, shared, layout, q_log2, tok_log2)
    dev = [c.to(DEVICE) for c in caches]
    sc = [s.to(DEVICE) if isinstance(s, torch.Tensor) else s for s in scales]
    kw = {k: v.to(DEVICE) for k, v in kw.items()}
    args = (q.to(DEVICE), dev[0], None if shared else dev[1])
    scale_kw = dict(k_scale=sc[0]) if shared else dict(k_scale=sc[0], v_scale=sc[1])
    for splits in (None, 1):  # the split rule (here one key block a split), and one split: P's scale changes in it
        out, lse = module.forward_split(*args, num_splits=splits, scale=scale, **scale_kw, **kw)
        assert torch.isfinite(out).all(), splits
        _check(q, keys, out, lse, shared, scale)


def _check(q, keys, out, lse, shared, scale):
    for i, (k, v) in enumerate(keys):
        extra = dict(head_dim_v=DV) if shared else {}
        want, want_lse = reference.attention(q[i:i + 1].double(), k, v, scale=scale, **extra)
        terms, _ = reference.attention(q[i:i + 1].double(), k, (k[..., :DV] if shared else v).abs(), scale=scale)
        unit = terms.clamp(min=1.0)
        compare(f"out (sequence {i})", out[i:i + 1].cpu().double() / unit, want / unit, **TOLERANCE["bf16"])
        compare(f"lse (sequence {i})", lse[i:i + 1].cpu(), want_lse, **LSE_TOLERANCE)
