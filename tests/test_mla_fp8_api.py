"""fagen.attention over an fp8 e4m3 latent cache (README "MLA absorbed decode"): fagen.attention(q, kv_cache, None,
head_dim_v=..., k_scale=...), dense or paged (block_table with seqlens_k), per-tensor, per-head and per-token scales,
against float64 on the dequantized cache; the route (the Gluon fp8 latent decode on sm_90 where selected, the Triton
decode elsewhere) and the errors, each naming the wrong argument."""

import pytest
import torch

import fagen
from _env import DEVICE, ON_GPU
from fagen.runtime import api, hopper
from fagen.verify import reference
from fagen.verify.tolerances import TOLERANCE, compare

D, DV = (576, 512) if ON_GPU else (48, 32)
PAGE = 64 if ON_GPU else 16
FP8 = torch.float8_e4m3fn
NAN_BYTE = 0x7F  # e4m3's NaN


def _case(gen, lens, form, layout, hq=4, sq=2, nan_tails=True):
    """q [B, Hq, Sq, D] bf16, the e4m3 cache (dense [B, 1, Sk, D] or paged on shuffled pages with NaN past each
    length, in the bytes and the per-token scales), its scale and, per sequence, the dequantized keys (float64)."""
    b = len(lens)
    q = torch.randn(b, hq, sq, D, generator=gen).bfloat16()
    seqs = [(torch.randn(n, D, generator=gen) * 2).to(FP8) for n in lens]
    tok = [torch.exp2(torch.randint(-3, 4, (n,), generator=gen).float()) for n in lens]  # 1/8 .. 8
    if layout == "dense":
        sk = max(lens)
        assert all(n == sk for n in lens)
        cache = torch.stack(seqs)[:, None]
        scale = {"tensor": 0.75, "head": torch.tensor([1.5]), "token": torch.stack(tok)[:, None]}[form]
        extra = {}
    else:
        width = max(-(-n // PAGE) for n in lens)
        pages = b * width + 1
        cache = torch.zeros(pages, PAGE, 1, D, dtype=torch.uint8)
        cache[:] = NAN_BYTE if nan_tails else 0
        cache = cache.view(FP8)
        tscale = torch.full((pages, PAGE, 1), float("nan") if nan_tails else 1.0)
        order = torch.randperm(pages, generator=gen).tolist()
        table = torch.zeros(b, width, dtype=torch.int32)
        for i, n in enumerate(lens):
            for p in range(-(-n // PAGE)):
                page = order.pop()
                table[i, p] = page
                rows = slice(p * PAGE, min(n, (p + 1) * PAGE))
                cache.view(torch.uint8)[page, :rows.stop - rows.start, 0] = seqs[i][rows].view(torch.uint8)
                tscale[page, :rows.stop - rows.start, 0] = tok[i][rows]
        scale = {"tensor": 0.75, "head": torch.tensor([1.5]), "token": tscale}[form]
        extra = dict(block_table=table.to(DEVICE), seqlens_k=torch.tensor(lens, dtype=torch.int32, device=DEVICE))
    mul = {"tensor": lambda i: 0.75, "head": lambda i: 1.5, "token": lambda i: tok[i][:, None].double()}[form]
    keys = [seqs[i].double() * mul(i) for i in range(b)]
    scale = scale.to(DEVICE) if isinstance(scale, torch.Tensor) else scale
    return q.to(DEVICE), cache.to(DEVICE), scale, extra, keys


def _check(out, q, keys, mask="causal"):
    for i, k in enumerate(keys):
        want, _ = reference.attention(q[i:i + 1].cpu().double(), k[None, None], None, head_dim_v=DV, mask=mask)
        terms, _ = reference.attention(q[i:i + 1].cpu().double(), k[None, None], k[None, None, :, :DV].abs(),
                                       mask=mask)
        unit = terms.clamp(min=1.0)  # P V rounds P to q's type: an error relative to the terms (README "fp8 KV cache")
        compare(f"out (sequence {i})", out[i:i + 1].cpu().double() / unit, want / unit, **TOLERANCE["bf16"])


@pytest.mark.parametrize("form", ["tensor", "head", "token"])
@pytest.mark.parametrize("layout", ["paged", "dense"])
def test_fagen_attention_takes_an_e4m3_latent_cache(layout, form):
    """Ragged lengths not multiples of the page or block (paged: NaN past each end, pages shuffled), causal with two
    queries, every scale form, against float64 on the dequantized cache."""
    gen = torch.Generator().manual_seed(3)
    lens = [37, 70, 5] if layout == "paged" else [45, 45]
    q, cache, scale, extra, keys = _case(gen, lens, form, layout)
    with torch.no_grad():
        out = fagen.attention(q, cache, None, head_dim_v=DV, mask="causal", k_scale=scale, **extra)
    assert out.shape == (len(lens), 4, 2, DV) and out.dtype == torch.bfloat16
    _check(out, q, keys)


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_fagen_attention_takes_a_paged_bf16_latent_cache(mask):
    """The paged form with a cache of q's dtype (no scale): the keys' bf16 values against float64."""
    gen = torch.Generator().manual_seed(7)
    q, cache, scale, extra, keys = _case(gen, [29, 66], "tensor", "paged", nan_tails=False)
    bf16 = (cache.float() * 0.75).bfloat16()
    with torch.no_grad():
        out = fagen.attention(q, bf16, None, head_dim_v=DV, mask=mask, **extra)
    _check(out, q, [k.bfloat16().double() for k in keys], mask)


def test_the_fp8_cache_is_read_as_fp8_with_its_scale(monkeypatch):
    """The cache goes to an fp8 kernel (kv_dtype fp8_e4m3) as fp8 bytes under k_scale: the result is the scaled
    dequantized reference, which differs from one that drops the scale or reads the cache cast to bf16 unscaled; the
    spec fagen.attention builds has the cache's kv_dtype."""
    gen = torch.Generator().manual_seed(4)
    q, cache, scale, extra, keys = _case(gen, [50, 21], "tensor", "paged")
    asked = []
    keep = api._module
    monkeypatch.setattr(api, "_module", lambda spec: asked.append(spec) or keep(spec))
    with torch.no_grad():
        out = fagen.attention(q, cache, None, head_dim_v=DV, mask="causal", k_scale=4.0, **extra)
    assert [str(s.kv_dtype) for s in asked] == ["fp8_e4m3"] and str(asked[0].layout) == "paged"
    _check(out, q, [k / 0.75 * 4.0 for k in keys])  # _case's keys are under 0.75
    unscaled, _ = reference.attention(q[:1].cpu().double(), (keys[0] / 0.75)[None, None], None, head_dim_v=DV,
                                      mask="causal")
    assert (out[:1].cpu().double() - unscaled).abs().max() > 0.05


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_a_non_finite_query_value_stays_in_its_row(bad, monkeypatch):
    """README "The contract of every generated kernel": a NaN query gives NaN in its own row. Hq x Sq = 64 rows take
    the fp8 seesaw on sm_90, whose f16 operands scale a tile's Q by the tile's largest |q| ([Note] Seesaw f16
    operands): an inf or NaN there must leave the scale alone, so every other row keeps the finite call's bits."""
    gen = torch.Generator().manual_seed(11)
    q, cache, scale, extra, _ = _case(gen, [300, 77], "tensor", "paged", hq=64, sq=1)
    asked = []
    keep = api._module
    monkeypatch.setattr(api, "_module", lambda spec: asked.append(spec) or keep(spec))
    kw = dict(head_dim_v=DV, mask="none", k_scale=scale, batch_invariant=True, **extra)
    bad_q = q.clone()
    bad_q[0, 3, 0, 7] = bad
    with torch.no_grad():
        want = fagen.attention(q, cache, None, **kw)
        got = fagen.attention(bad_q, cache, None, **kw)
    if ON_GPU and hopper.is_hopper(q.device) and hopper.enabled() and not hopper.gluon_missing():
        assert "gluon" in {str(s.backend) for s in asked}, asked  # the Triton spec, then its gluon twin
    assert got[0, 3].isnan().all()
    rest = torch.ones(got.shape[:2], dtype=torch.bool)
    rest[0, 3] = False
    assert torch.equal(got[rest], want[rest])


def test_the_errors_name_the_argument():
    gen = torch.Generator().manual_seed(5)
    q, cache, scale, extra, keys = _case(gen, [20, 9], "tensor", "paged", nan_tails=False)
    bf16 = cache.to(torch.bfloat16)
    with torch.no_grad():
        with pytest.raises(fagen.AttentionError, match="k: an fp8 latent cache is float8_e4m3fn"):
            fagen.attention(q, cache.to(torch.float8_e5m2), None, head_dim_v=DV, k_scale=1.0, **extra)
        with pytest.raises(fagen.AttentionError, match="k_scale: only an fp8 latent cache"):
            fagen.attention(q, bf16, None, head_dim_v=DV, k_scale=1.0, **extra)
        with pytest.raises(fagen.AttentionError, match="seqlens_k: a paged latent cache"):
            fagen.attention(q, cache, None, head_dim_v=DV, block_table=extra["block_table"])
        with pytest.raises(fagen.AttentionError, match="block_table: fagen.attention takes a paged or fp8 cache"):
            fagen.attention(q, bf16, bf16, block_table=extra["block_table"])
        with pytest.raises(fagen.AttentionError, match="k_scale: fagen.attention takes a paged or fp8 cache"):
            fagen.attention(q, bf16, bf16, k_scale=1.0)
        with pytest.raises(ValueError, match="k_scale: per-token scales must be float32"):
            fagen.attention(q, cache, None, head_dim_v=DV, k_scale=torch.ones(cache.shape[:-1],
                                                                              dtype=torch.float16), **extra)
        with pytest.raises(ValueError, match="k_scale: expected a positive finite float"):
            fagen.attention(q, cache, None, head_dim_v=DV, k_scale=-1.0, **extra)
        with pytest.raises(ValueError, match="block_table: expected a torch.Tensor"):
            fagen.attention(q, cache, None, head_dim_v=DV, k_scale=1.0, block_table=[[0]],
                            seqlens_k=extra["seqlens_k"])


@pytest.mark.skipif(ON_GPU, reason="CPU tensors with sm_90 faked: the Triton path needs the interpreter")
def test_sm90_routes_an_e4m3_latent_cache_to_the_gluon_fp8_decode(monkeypatch):
    """With sm_90 faked, an e4m3 paged latent call of at most LATENT_FP8_MAX_ROWS rows (MLA's 576/512, pages of 64)
    reaches the gluon fp8 module (whose device check then refuses CPU tensors: the proof it was picked); with the
    selection off, or more rows, the Triton decode (interpreted) serves it."""
    from fagen import backends
    monkeypatch.setattr(hopper, "is_hopper", lambda device: True)
    monkeypatch.setattr(hopper, "gluon_missing", lambda: None)
    monkeypatch.setattr(hopper, "LATENT_MIN_WORK", 1)
    gen = torch.Generator().manual_seed(6)
    cache = (torch.randn(3, 64, 1, 576, generator=gen)).to(FP8)
    table = torch.tensor([[2], [0]], dtype=torch.int32)
    lens = torch.tensor([40, 9], dtype=torch.int32)
    q16 = torch.randn(2, 16, 1, 576, generator=gen).bfloat16()
    call = dict(head_dim_v=512, mask="causal", block_table=table, seqlens_k=lens, k_scale=0.5)
    with torch.no_grad(), pytest.raises(ValueError, match="this Gluon kernel .* runs on a CUDA device"):
        fagen.attention(q16, cache, None, **call)
    monkeypatch.setattr(backends.GLUON, "select_fp8_latent", False)
    with torch.no_grad():
        assert torch.isfinite(fagen.attention(q16[:, :2], cache, None, **call)).all()
