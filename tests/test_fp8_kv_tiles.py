"""The tiles and the V conversion an fp8 KV cache's decode kernel gets by default ([Note] fp8 decode tiles in
fagen/backends/triton.py, [Note] V converted once in the decode template): on sm_90 a dense cache with its own V
takes 128-key blocks and converts V once (an e4m3 d128 cache 64-key blocks on 2 warps since the nineteenth session,
[Note] fp8 decode tiles by shape); a paged one 64-key blocks on 2 warps (eighteenth session; 128 keys on 8 warps from
the ninth), V converted once; another arch, wide head dims and the bf16 cache keep their tiles; MLA's latent cache
keeps its own (and converts its tile once, as before)."""

import pytest

import fagen


def _decode(**fields):
    return fagen.KernelSpec(kind="decode", dtype="bf16", gqa=4, **fields)


def _v_once(spec) -> bool:
    line = next(x for x in fagen.generate(spec).splitlines() if x.startswith("V_ONCE = "))
    return line.startswith("V_ONCE = tl.constexpr(True")


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dense_fp8_cache_takes_its_tile_and_converts_v_once_on_sm90(kv, head_dim):
    """e4m3 d128: 64-key blocks on 2 warps (nineteenth session, [Note] fp8 decode tiles by shape); the others 128-key
    blocks on 4 warps (eighth session)."""
    spec = _decode(head_dim=head_dim, kv_dtype=kv)
    want = (64, 64, 2, 3) if (kv, head_dim) == ("fp8_e4m3", 128) else (64, 128, 4, 3)
    assert (spec.block_m, spec.block_n, spec.num_warps, spec.num_stages) == want, spec.name
    assert _v_once(spec)


def test_other_fp8_caches_and_the_bf16_cache_keep_their_tiles():
    bf16 = _decode(head_dim=128)
    assert (bf16.block_n, bf16.num_stages) == (64, 3)
    paged = _decode(head_dim=128, kv_dtype="fp8_e4m3", layout="paged")  # [Note] Paged fp8 decode tiles
    assert (paged.block_m, paged.block_n, paged.num_warps, paged.num_stages) == (64, 64, 2, 3) and _v_once(paged)
    old = _decode(head_dim=128, kv_dtype="fp8_e4m3", layout="paged", block_n=128, num_warps=8)  # before s18
    assert _v_once(old)
    paged128 = _decode(head_dim=128, kv_dtype="fp8_e4m3", layout="paged", block_n=128, num_warps=4, num_stages=2)
    assert not _v_once(paged128)  # 128-key paged blocks keep V in the operand (round A: 80 against 84%)
    paged_bf16 = _decode(head_dim=128, layout="paged")
    assert (paged_bf16.block_n, paged_bf16.num_stages) == (128, 2)
    sm80 = _decode(head_dim=128, kv_dtype="fp8_e4m3", arch="sm_80")
    assert (sm80.block_n, sm80.num_stages) == (64, 3)  # Ada's 99 KB would not hold the 105 KB of n128s3
    wide = _decode(head_dim=256, kv_dtype="fp8_e4m3")
    assert wide.block_n != 128 or wide.num_stages != 3
    given = _decode(head_dim=128, kv_dtype="fp8_e4m3", block_n=32)
    assert (given.block_n, given.num_stages) == (32, 3)  # a field the spec sets stays
    mla = fagen.KernelSpec(head_dim=576, head_dim_v=512, shared_kv=True, kind="decode", gqa=16, dtype="bf16",
                           layout="paged", kv_dtype="fp8_e4m3")
    assert (mla.block_m, mla.block_n, mla.num_warps, mla.num_stages) == (16, 32, 4, 3) and _v_once(mla)
