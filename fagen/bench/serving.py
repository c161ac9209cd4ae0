"""`fagen bench --suite serving`: the rows of issue 27 (MLA head dims, the fp8 KV cache, batch-invariant decode)."""

from __future__ import annotations

from fagen.bench.workloads import BenchCase, make_case


# [Note] Serving rows (issue 27; docs/serving.md)
# MLA prefill at DeepSeek's shape (d_qk 192, d_v 128, 128 heads would be one layer; 16 here, batch x seq = 16k as in
# the standard table), forward and backward, against SDPA (cuDNN takes 192/128 on Hopper) and Flex. Decode at the
# issue's memory-bound shapes (Hq 16 over one KV head, as MLA's absorbed form reads one latent cache; here as a
# d192/128 GQA-16 decode until the 576/512 form exists) and the compute-bound Hq 128 Sq 2. The fp8 rows repeat
# the bf16 decode rows with an fp8_e4m3 cache (GB/s counts the bytes read: 1 per element). The batch-invariant
# rows pair each decode row at b1 and b32 under batch_invariant=False (the split rule) with the same row under
# batch_invariant=True: the cost is their ratio.
# Decode rows other than the bf16 baselines run fagen alone (no peer takes an fp8 cache or the flag).
# The absorbed rows (ninth session) are MLA's real decode: d_qk 576, d_v 512, one latent cache (dense here) read
# once for K and V (case.shared_kv: v=None), GB/s over the latent bytes (1 a value for fp8, with one scale a KV head),
# at the memory-bound Hq 16 Sq 1 and the compute-bound Hq 128 Sq 2; on sm_90 the spec is what fagen.attention picks
# (hopper.latent_decode_spec: the gluon MLA decode for bf16, Hq 16 as one padded tile; the Triton decode for fp8).
# The paged fp8 row (eleventh session) is decode-d128-kv8k-b32-fp8 on vLLM's paged layout: pages of 16 keys
# [num_pages, 16, Hkv, D] in a random order, e4m3, per-KV-head scales (issue 27's paged case).
def serving_rows(quick: bool = False) -> list[BenchCase]:
    s = (lambda n: max(1, n // 64)) if quick else (lambda n: n)
    sk = (lambda n: max(256, n // 64)) if quick else (lambda n: n)  # decode rows stay decode-shaped (Sk >= 256)
    b = (lambda n: min(n, 2)) if quick else (lambda n: n)
    mla = dict(head_dim=192, head_dim_v=128)
    rows = [
        make_case("fwd-mla-d192v128-causal-s4k", **mla, mask="causal", batch=b(4), heads_q=16, heads_kv=16,
                  seq_q=s(4096), seq_k=s(4096)),
        make_case("bwd-mla-d192v128-causal-s4k", **mla, mask="causal", batch=b(4), heads_q=16, heads_kv=16,
                  seq_q=s(4096), seq_k=s(4096), direction="bwd"),
    ]
    for kv, batch in ((4096, 128), (8192, 64), (32768, 32)):
        rows.append(make_case(f"decode-mla-d192v128-h16-kv{kv // 1024}k-b{batch}", **mla, mask="none",
                              batch=b(batch), heads_q=16, heads_kv=1, seq_q=1, seq_k=sk(kv)))
    rows.append(make_case("decode-mla-d192v128-h128-sq2-kv8k-b32", **mla, mask="causal", batch=b(32), heads_q=128,
                          heads_kv=1, seq_q=2, seq_k=sk(8192), metric="tflops", peers=False))
    latent = dict(head_dim=576, head_dim_v=512, shared_kv=True, heads_kv=1, peers=False)
    for kv_dtype in (None, "fp8_e4m3"):
        tag = "-fp8" if kv_dtype else ""
        for kv, batch in ((4096, 128), (32768, 32)):
            rows.append(make_case(f"decode-mla-absorbed-h16-kv{kv // 1024}k-b{batch}{tag}", **latent, mask="none",
                                  batch=b(batch), heads_q=16, seq_q=1, seq_k=sk(kv), kv_dtype=kv_dtype))
        rows.append(make_case(f"decode-mla-absorbed-h128-sq2-kv8k-b32{tag}", **latent, mask="causal", batch=b(32),
                              heads_q=128, seq_q=2, seq_k=sk(8192), kv_dtype=kv_dtype, metric="tflops"))
    d128 = dict(head_dim=128, mask="none", heads_q=32, heads_kv=8, seq_q=1)
    for name, batch, kv in (("kv8k-b32", 32, 8192), ("kv32k-b8", 8, 32768)):
        rows.append(make_case(f"decode-d128-{name}-fp8", **d128, batch=b(batch), seq_k=sk(kv), kv_dtype="fp8_e4m3",
                              peers=False))
    rows.append(make_case("decode-d128-kv8k-b32-fp8-paged16", **d128, batch=b(32), seq_k=sk(8192),
                          kv_dtype="fp8_e4m3", page_size=16, peers=False))
    for name, batch, kv in (("kv4k-b1", 1, 4096), ("kv32k-b1", 1, 32768), ("kv4k-b32", 32, 4096),
                            ("kv32k-b32", 32, 32768)):
        for inv in (False, True):
            rows.append(make_case(f"decode-d128-{name}{'-invariant' if inv else '-splits'}", **d128, batch=b(batch),
                                  seq_k=sk(kv), batch_invariant=inv, peers=False))
    return rows


def serving_suite(quick: bool = False) -> list[BenchCase]:
    """`--suite serving`: the rows of issue 27 (MLA head dims, the fp8 cache, the cost of batch invariance)."""
    return serving_rows(quick)
