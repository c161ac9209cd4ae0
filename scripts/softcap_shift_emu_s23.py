"""CPU emulation of the Gluon softcap forward's arithmetic (twenty-third session, [Note] Softcap fixed shift in
fagen/templates/gluon/attention.py.j2): per 128-key block S = q k^T in fp32, t = tanh(S * scale / cap), p = exp2(t Q - m)
in fp32, P rounded to bf16 for P V (fp32 accumulation), l summed from p or from the rounded P; the running max (the
product) against the fixed shift (cap_fixed_max). Prints the largest error over the largest output against float64
(fagen.verify.reference) at round B's odd-length checks.

    PYTHONPATH=$PWD python3 scripts/softcap_shift_emu_s23.py
"""
import torch, math
from fagen.verify import reference
torch.manual_seed(0)
def run(q, k, v, cap, mask, mode, BN=128):
    # q [H, Sq, D] bf16, etc. emulate the Gluon softcap forward's arithmetic in fp32 / bf16
    H, Sq, D = q.shape; Sk = k.shape[1]
    scale = 1 / math.sqrt(D); Q = cap / math.log(2); cap_in = scale / cap
    qf, kf, vf = q.float(), k.float(), v.float()
    if mode == "product":
        m = torch.full((H, Sq), -float("inf"))
    else:
        m = torch.full((H, Sq), Q - min(max(2 * Q - 96, 0), 64))
    l = torch.zeros(H, Sq); o = torch.zeros(H, Sq, D)
    rows = torch.arange(Sq)[:, None]
    for s0 in range(0, Sk, BN):
        cols = torch.arange(s0, min(s0 + BN, Sk))[None, :]
        S = qf @ kf[:, s0:s0 + BN].transpose(-1, -2)
        t = torch.tanh(S * cap_in)
        vis = torch.ones_like(t, dtype=torch.bool)
        if mask == "causal":
            vis = (cols <= rows + (Sk - Sq)).expand_as(t)
        t = torch.where(vis, t, torch.tensor(-float("inf")))
        if mode == "product":
            mn = torch.maximum(m, t.amax(-1) * Q)
            mu = torch.where(mn == -float("inf"), torch.zeros_like(mn), mn)
            p = torch.exp2(t * Q - mu[..., None])
            alpha = torch.exp2(m - mu)
            P = p.to(torch.bfloat16).float()
            l = l * alpha + (P if "lr" in mode else p).sum(-1)
            o = o * alpha[..., None] + P @ vf[:, s0:s0 + BN]
            m = mn
        else:
            p = torch.exp2(t * Q - m[..., None])
            P = p.to(torch.bfloat16).float()
            l = l + (P if "lr" in mode else p).sum(-1)
            o = o + P @ vf[:, s0:s0 + BN]
    seen = l != 0
    out = torch.where(seen[..., None], o / torch.where(seen, l, 1)[..., None], 0).to(torch.bfloat16)
    return out
for (mask, Sq, Sk, cap) in (("causal", 1000, 1000, 50.0), ("causal", 1300, 777, 20.0), ("none", 777, 1300, 50.0), ("none", 129, 2049, 20.0)):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, Sq, 128, generator=g).mul(2.5).to(torch.bfloat16)
    k = torch.randn(4, Sk, 128, generator=g).mul(2.5).to(torch.bfloat16)
    v = torch.randn(4, Sk, 128, generator=g).mul(2.5).to(torch.bfloat16)
    ro, rl = reference.attention(q[None].double(), k[None].double(), v[None].double(), mask=mask, softcap=cap)
    ro = ro[0]
    res = []
    for mode in ("product", "fix", "fix-lr", "product-lr"):
        o = run(q, k, v, cap, mask, mode)
        res.append(f"{mode} {((o.double() - ro).abs().max() / ro.abs().max()).item():.2e}")
    print(mask, Sq, Sk, cap, " | ".join(res))
