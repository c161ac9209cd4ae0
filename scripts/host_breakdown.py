"""Host time of a warm call, piece by piece (issue 13, benchmarks/latency.md): each piece timed alone, best of 5
rounds of 2000 calls, on the latency suite's two cases. Needs a CUDA device: python3 scripts/host_breakdown.py"""
import time, torch, fagen
from fagen.runtime.resolve import resolve
from fagen.runtime.kinds import prefers_decode

def t(label, f, n=2000):
    try:
        _t(label, f, n)
    except Exception as e:  # one broken probe must not hide the others
        print(f"  {label:48s} failed: {type(e).__name__}: {e}", flush=True)


def _t(label, f, n):
    for _ in range(20): f()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(5):
        s = time.perf_counter()
        for _ in range(n): f()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - s) / n * 1e6)
    print(f"  {label:48s} {best:7.2f} us", flush=True)

dev = "cuda"
for name, (b, hq, hkv, sq, sk, mask) in {"decode": (1, 32, 8, 1, 1024, "none"), "prefill": (1, 32, 8, 128, 128, "causal")}.items():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, sq, 128, generator=g).to(dev, torch.bfloat16)
    k = torch.randn(b, hkv, sk, 128, generator=g).to(dev, torch.bfloat16); v = torch.randn_like(k)
    mod = resolve(q, k, v, mask, prefers_decode(sq, sk))
    print(name, mod.NAME, flush=True)
    with torch.no_grad():
        fagen.attention(q, k, v, mask=mask)
        out, lse = mod.forward(q, k, v)
        causal = mask == "causal"
        t("sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))
        t("fagen.attention", lambda: fagen.attention(q, k, v, mask=mask))
        t("module.forward", lambda: mod.forward(q, k, v))
        t("module.forward(out=, lse=)", lambda: mod.forward(q, k, v, out=out, lse=lse))
        t("module._launch (no checks)", lambda: mod._launch(q, k, v, 0.088, None, None, None))
        t("module._launch(out=, lse=)", lambda: mod._launch(q, k, v, 0.088, None, None, None, out=out, lse=lse))
        t("_check_qkv", lambda: mod._check_qkv(q, k, v))
        t("torch.empty(q.shape, bf16)", lambda: torch.empty(q.shape, dtype=q.dtype, device=q.device))
        t("torch.empty_like(q)", lambda: torch.empty_like(q))
        t("q.stride() x5", lambda: (q.stride(), k.stride(), v.stride(), out.stride(), lse.stride()))
        t("_raw_stream", lambda: mod._raw_stream(0))
        t("is_current_stream_capturing", torch.cuda.is_current_stream_capturing)
        t("_check_buffers(out, lse)", lambda: mod._check_buffers(q, out, lse))
        t("_check_mask_inputs", lambda: mod._check_mask_inputs(q, k, None, None, None))
        t("q.new_empty(lse shape, float32)", lambda: q.new_empty(q.shape[:3], dtype=torch.float32))
        t("_new_out(q) (empty_like)", lambda: mod._new_out(q))
        if name == "decode" and mod._STEPS:
            key, step = next(iter(mod._STEPS.items()))
            split_grid, (launch, flags, function, metadata, tail, _), split_ints, ws_shape = step
            ws = mod._workspace(ws_shape, q.device, 0)
            s = mod._raw_stream(0)
            t("split launcher C call, tensors", lambda: launch(*split_grid, s, function, *flags, None, None, metadata, None, None, None, q, k, v, ws[0], ws[1], out, lse, ws[2], None, None, None, 0.1, *split_ints, *tail))
            ptrs = [x.data_ptr() for x in (q, k, v, ws[0], ws[1], out, lse, ws[2])]
            t("split launcher C call, int pointers", lambda: launch(*split_grid, s, function, *flags, None, None, metadata, None, None, None, *ptrs, None, None, None, 0.1, *split_ints, *tail))
            print("  decode steps cached:", len(mod._STEPS), "workspace", ws_shape, flush=True)
        if name == "prefill":
            t("_tma_ready(k)", lambda: mod._tma_ready(k))
            print("  forward steps cached:", len(getattr(mod, "_STEPS", {})), flush=True)
            entries = [e for e in mod._KERNELS.values() if e]
            print("  prefill kernel entries (launch, direct, scratch bytes):",
                  [(type(e[0]).__name__, e[1] is not None, e[5]) for e in entries], flush=True)
