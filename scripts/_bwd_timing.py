"""The backward GPU scripts' shared pieces (twelfth session): a render under variant overrides (optionally a mutant's
text edit), random inputs, the float64 reference gradients written from the semantics, the relative error, cuDNN's
backward through SDPA, and timing in rotated passes with medians.

Rotation: last session's rounds saw an 8-11% penalty on whichever row ran first in a pass, so pass p times the rows
starting at row p (mod the row count); a row's number is the median of its passes (the upper of the middle two for
an even count), its ratio the median over cuDNN's median.
"""

from __future__ import annotations

import re


def module(spec_fields: dict, over: dict, mut: tuple[str, str] | None = None, tag: str = ""):
    """The gluon module of KernelSpec(**spec_fields) rendered with GLUON.variant updated by `over` (restored after);
    `mut`: (text, replacement) applied to the source, which must contain the text (a mutant)."""
    import fagen
    from fagen import backends
    from fagen.codegen import render as _render
    from fagen.runtime.loader import load_source
    from fagen.spec.kernel import KernelSpec
    spec = KernelSpec(**spec_fields)
    if not over and not mut:
        return fagen.load(spec)
    saved = dict(backends.GLUON.variant)
    backends.GLUON.variant.update(over)
    _render.render.cache_clear()
    try:
        source = fagen.generate(spec)
    finally:
        backends.GLUON.variant.clear()
        backends.GLUON.variant.update(saved)
        _render.render.cache_clear()
    tag = tag or re.sub(r"\W", "", "_".join(f"{k}{v}" for k, v in over.items())) or "def"
    if mut:
        assert mut[0] in source, "the mutant's text is not in the render"
        source, tag = source.replace(mut[0], mut[1]), tag + "_mut"
    return load_source(source, f"{spec.name}_{tag}")


def inputs(d, b, hq, hkv, sq, sk, seed=0):
    """q, k, v, dO: standard normal in bf16, from a seeded CUDA generator."""
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, generator=g, device="cuda").bfloat16()
            for shape in ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d), (b, hq, sq, d))]


def reference(q, k, v, do, causal, scale):
    """float64 gradients (dq, dk, dv) by hand from softmax attention's definition (no autograd graph: s16k fits),
    bottom-right causal; GQA: K, V repeated, dK, dV summed over each KV head's query heads."""
    import torch
    gqa = q.shape[1] // k.shape[1]
    q, do = q.double(), do.double()
    k, v = (t.double().repeat_interleave(gqa, dim=1) for t in (k, v))
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        sq, sk = q.shape[-2], k.shape[-2]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s.masked_fill_(j > i + (sk - sq), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num_(0.0)
    del s
    o = p @ v
    dv = p.transpose(-1, -2) @ do
    dp = do @ v.transpose(-1, -2)
    delta = (do * o).sum(-1, keepdim=True)
    dp.sub_(delta).mul_(p)  # dS
    del p
    dq = (dp @ k) * scale
    dk = (dp.transpose(-1, -2) @ q) * scale
    b, h, sk, d = dk.shape
    return dq, dk.view(b, h // gqa, gqa, sk, d).sum(2), dv.view(b, h // gqa, gqa, sk, d).sum(2)


def rel(a, b):
    """Relative L2 error of a against the float64 b."""
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def cudnn_backward(q, k, v, do, causal):
    """A closure of cuDNN's backward (SDPA's cuDNN backend) on a retained graph: returns (dq, dk, dv)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal,
                                                               enable_gqa=q.shape[1] != k.shape[1])
    return lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)


def cudnn_forward(q, k, v, causal):
    """A closure of cuDNN's forward (SDPA's cuDNN backend)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                    enable_gqa=q.shape[1] != k.shape[1])
    return run


def rotated(labels: list[str], passes: int):
    """(pass, label) in timing order: pass p starts at row p mod len(labels)."""
    n = len(labels)
    return [(p, labels[(p + r) % n]) for p in range(passes) for r in range(n)]


def median(xs):
    """The median; for an even count the upper of the middle two (the earlier scripts' rule)."""
    return sorted(xs)[len(xs) // 2]


def medians_table(case: str, tfs: dict[str, list[float]], peer: str = "cudnn", log=print):
    """One markdown row per label: its passes, the median and the median over the peer's median."""
    med = {k: median(v) for k, v in tfs.items() if v}
    for label, vals in tfs.items():
        if not vals:
            continue
        ratio = f"{med[label] / med[peer]:.3f}x" if peer in med else "-"
        log(f"| {case} | {label} | {' / '.join(f'{x:.0f}' for x in vals)} | {med[label]:.0f} | {ratio} |")
