"""The serving fields of a spec (head_dim_v, kv_dtype): validation, names, round-trips; and the float64 reference's
own handling of a V head dim unlike q's and of a quantized cache. No kernel runs here."""

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fagen.spec import KernelSpec, SpecError
from fagen.verify import reference
from fagen.verify.strategies import Problem


def test_head_dim_v_defaults_to_head_dim_and_stays_out_of_names_and_hashes():
    plain = KernelSpec(head_dim=128, mask="causal", dtype="bf16")
    same = KernelSpec(head_dim=128, head_dim_v=128, mask="causal", dtype="bf16")
    assert plain.head_dim_v == 128 and plain == same and plain.hash == same.hash and plain.name == same.name
    assert "head_dim_v" not in plain.to_dict() and "kv_dtype" not in plain.to_dict()
    assert plain.name == "attn_fwd_causal_d128_m128n128w8s3_g1_bf16"  # the catalog's names do not move


@pytest.mark.parametrize("d, dv", [(192, 128), (128, 64), (64, 128), (40, 24)])
def test_head_dim_v_names_and_round_trips(d, dv):
    spec = KernelSpec(head_dim=d, head_dim_v=dv, mask="causal", dtype="bf16", direction="bwd")
    assert f"_d{d}v{dv}_" in spec.name
    assert spec.to_dict()["head_dim_v"] == dv
    for back in (KernelSpec.from_json(spec.to_json()), KernelSpec.from_toml(spec.to_toml())):
        assert back == spec and back.hash == spec.hash
    assert spec.hash != KernelSpec(head_dim=d, mask="causal", dtype="bf16", direction="bwd").hash


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_kv_dtype_names_and_round_trips(kv, layout):
    spec = KernelSpec(head_dim=128, gqa=4, dtype="bf16", kind="decode", layout=layout, kv_dtype=kv)
    assert spec.name.endswith(f"_bf16_kv{kv[4:]}")
    assert KernelSpec.from_json(spec.to_json()) == spec and KernelSpec.from_toml(spec.to_toml()) == spec
    assert spec.hash != dataclasses.replace(spec, kv_dtype=None).hash


@pytest.mark.parametrize("fields, field, fragment", [
    (dict(head_dim_v=12), "head_dim_v", "multiple of 8 from 16 to 256"),
    (dict(head_dim_v=264), "head_dim_v", "multiple of 8"),
    (dict(head_dim_v=True), "head_dim_v", "multiple of 8"),
    (dict(head_dim_v="128"), "head_dim_v", "multiple of 8"),
    (dict(head_dim_v=128, backend="cuda", dtype="bf16"), "head_dim_v", "use backend 'triton'"),
    (dict(head_dim_v=128, backend="gluon", dtype="bf16"), "head_dim_v", "use backend 'triton'"),
    (dict(kv_dtype="fp8"), "kv_dtype", "one of 'fp8_e4m3', 'fp8_e5m2'"),
    (dict(kv_dtype="fp8_e4m3"), "kv_dtype", "use kind 'decode'"),
    (dict(kv_dtype="fp8_e4m3", kind="decode", dtype="fp32"), "dtype", "use dtype 'bf16' or 'fp16'"),
])
def test_serving_field_errors_name_the_field_and_the_fix(fields, field, fragment):
    with pytest.raises(SpecError) as info:
        KernelSpec(**{"head_dim": 64, **fields})
    assert info.value.field == field and fragment in str(info.value)


def _direct(q, k, v, scale):
    """softmax(scale q k^T) v written out, float64: the textbook formula, no masks."""
    s = q.double() @ k.double().transpose(-1, -2) * scale
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)


@given(d=st.sampled_from([16, 40, 64]), dv=st.sampled_from([8, 24, 64, 96]), sq=st.integers(1, 9),
       sk=st.integers(1, 13), seed=st.integers(0, 2**16))
def test_reference_takes_a_v_head_dim_unlike_q(d, dv, sq, sk, seed):
    """out is [..., Dv]; the default scale follows q's head dim; mask and GQA work as with one head dim."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 4, sq, d, generator=gen), torch.randn(2, 2, sk, d, generator=gen)
    v = torch.randn(2, 2, sk, dv, generator=gen)
    out, lse = reference.attention(q, k, v)
    want, want_lse = _direct(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), d ** -0.5)
    assert out.shape == (2, 4, sq, dv)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    causal, _ = reference.attention(q, k, v, mask="causal")
    assert causal.shape == (2, 4, sq, dv)


def test_reference_dequantizes_per_tensor_and_per_head():
    k = torch.randn(2, 3, 5, 16).to(torch.float8_e4m3fn)
    per_head = torch.tensor([0.5, 2.0, 8.0])
    got = reference.dequantize(k, per_head)
    assert torch.equal(got[:, 1], k[:, 1].double() * 2.0) and torch.equal(got[:, 2], k[:, 2].double() * 8.0)
    assert torch.equal(reference.dequantize(k, 0.25), k.double() * 0.25)
    q, v = torch.randn(2, 6, 3, 16), torch.randn(2, 3, 5, 16).to(torch.float8_e5m2)
    out, _ = reference.attention(q, k, v, k_scale=per_head, v_scale=0.5)
    want, _ = reference.attention(q, reference.dequantize(k, per_head), v.double() * 0.5)
    assert torch.equal(out, want)


def test_problems_draw_fp8_caches_and_v_head_dims():
    spec = KernelSpec(head_dim=32, head_dim_v=16, kind="decode", dtype="bf16", kv_dtype="fp8_e5m2", gqa=2)
    for scales in ("tensor", "head"):
        (q, k, v), kw = Problem(batch=2, heads_kv=3, seq_q=2, seq_k=7, kv_scales=scales, seed=5).inputs(spec)
        assert q.dtype == torch.bfloat16 and k.dtype == v.dtype == torch.float8_e5m2
        assert v.shape == (2, 3, 7, 16) and k.shape == (2, 3, 7, 32)
        if scales == "head":
            assert kw["k_scale"].shape == (3,) and kw["k_scale"].dtype == torch.float32
        else:
            assert isinstance(kw["k_scale"], float) and isinstance(kw["v_scale"], float)
        assert Problem.from_json(Problem(batch=1, heads_kv=1, seq_q=1, seq_k=1, kv_scales=scales).to_json()) \
            .kv_scales == scales


def test_serving_bench_rows_build_their_specs_and_count_bytes_read():
    from fagen.bench.serving import serving_rows
    from fagen.bench.workloads import fwd_flops, kv_bytes

    rows = {c.name: c for c in serving_rows()}
    for case in rows.values():
        spec, _ = case.spec("cpu")
        assert spec.head_dim_v == case.head_dim_v and (spec.kv_dtype is not None) == (case.kv_dtype is not None)
    bf16, fp8 = rows["decode-d128-kv8k-b32-splits" if "decode-d128-kv8k-b32-splits" in rows else
                     "decode-d128-kv4k-b32-splits"], rows["decode-d128-kv8k-b32-fp8"]
    per_key = lambda c: kv_bytes(c) / (c.batch * c.seq_k)  # noqa: E731
    assert per_key(fp8) * 2 == per_key(bf16)  # one byte an element read, against two
    mla = rows["fwd-mla-d192v128-causal-s4k"]
    assert fwd_flops(mla) == 2 * (192 + 128) * 16 * 4 * 4096 * 4096 / 2
