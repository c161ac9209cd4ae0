"""Mods lowered to switch calls on views (fagen/mods/lower.py, `run_split`): a dilated window ([Note] Dilated
windows: one window switch call over d strided subsequences) and the prefix-LM mask ([Note] Prefix rows: two
switch calls on row slices). Each agrees with the float64 reference and with the unlowered mod kernel (out, and
the gradients where it lowers with them), and calls the views cannot serve keep the mod."""

import pytest
import torch

import fagen
from fagen.bench import gym_mods as g
from fagen.mods import lower as lowering
from fagen.mods import split
from fagen.mods.trace import trace
from _env import DEVICE
from mods_kernel import TOL
from fagen.runtime import modded
from fagen.verify import reference

DIL = 3  # module globals: runtime scalars of the mods below
WIN = 7


def _decide(mask_mod, mask="none", sq=48, sk=48, scores=(), ok=True, score_mod=None):
    t = trace(score_mod=score_mod, mask_mod=mask_mod)
    fields = (t.score_text, t.mask_text, t.tensors, t.scalars)
    p = split.plan(fields, t.score_mod, t.mask_mod)
    if p is None:
        return None
    offset = lowering.alignment(mask, sq, sk, None, None, False)
    low = lowering.lower(p, fields, (t.score_mod, t.mask_mod), t.values, mask=mask, offset=offset,
                         scores=dict.fromkeys(scores), block_mask=True, splits=lambda kind, n: ok)
    return None if low is None else (low.mask, low.scores, low.fields and low.fields[:2], low.split)


@pytest.mark.parametrize("mask_mod, kw, want", [
    (g.generate_dilated_sliding_window(6, 2), {}, ("none", {"window": (3, 3)}, None, ("dilated", 2))),
    (g.generate_dilated_sliding_window(7, 4), {}, ("none", {"window": (1, 1)}, None, ("dilated", 4))),  # 7 // 4
    (lambda b, h, q_idx, kv_idx: (q_idx - kv_idx <= WIN) & (q_idx >= kv_idx) & ((kv_idx - q_idx) % DIL == 0), {},
     ("causal", {"window": (WIN // DIL, 0)}, None, ("dilated", DIL))),
    (lambda b, h, q_idx, kv_idx: (q_idx - kv_idx) % 4 == 0, {}, ("none", {}, None, ("dilated", 4))),  # d problems
    (lambda b, h, q_idx, kv_idx: (q_idx - kv_idx) % 4 == 0, dict(mask="causal"), ("causal", {}, None, ("dilated", 4))),
    (g.generate_dilated_sliding_window(6, 2), dict(ok=False), None),  # the views cannot serve (block mask given)
    (g.generate_dilated_sliding_window(6, 2), dict(sq=40), None),  # Sq != Sk: the residues do not line up
    (g.generate_dilated_sliding_window(6, 2), dict(scores=("window",)), None),  # the call's own window
    (g.generate_dilated_sliding_window(6, 2), dict(scores=("sinks",)), None),  # sinks are per head
    (g.generate_dilated_sliding_window(6, 2), dict(score_mod=lambda s, b, h, q_idx, kv_idx: s + q_idx), None),
    (g.generate_dilated_sliding_window(6, 2), dict(score_mod=g.generate_tanh_softcap(5.0)),
     ("none", {"window": (3, 3), "softcap": 5.0}, None, ("dilated", 2))),
    (lambda b, h, q_idx, kv_idx: (torch.abs(q_idx - kv_idx) <= 6) & ((q_idx - kv_idx) % 2 == 1), {}, None),
    (lambda b, h, q_idx, kv_idx: (torch.abs(q_idx - kv_idx) <= 6) & ((q_idx + kv_idx) % 2 == 0), {}, None),
    (lambda b, h, q_idx, kv_idx: (torch.abs(q_idx - kv_idx) <= 6) & ((q_idx - kv_idx) % 2 == 0) & (h == 0), {},
     None),
])
def test_the_dilation_lowers_only_when_exact(mask_mod, kw, want):
    assert _decide(mask_mod, **kw) == want


def _qkv(b, hq, hkv, s, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, s, d, generator=gen).to(DEVICE).requires_grad_()
    k, v = (torch.randn(b, hkv, s, d, generator=gen).to(DEVICE).requires_grad_() for _ in range(2))
    return q, k, v, torch.randn(b, hq, s, d, generator=gen).to(DEVICE)


def _run(q, k, v, do, **kw):
    out = fagen.attention(q, k, v, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


@pytest.mark.parametrize("mask_mod, label", [
    (g.generate_dilated_sliding_window(10, 4), "dilated(4)+none+window(2,2)"),
    (lambda b, h, q_idx, kv_idx: (q_idx - kv_idx <= WIN) & (q_idx >= kv_idx) & ((q_idx - kv_idx) % DIL == 0),
     "dilated(3)+causal+window(2,0)"),
])
def test_a_dilated_window_runs_on_strided_views_and_agrees_with_the_mod(mask_mod, label, monkeypatch):
    s = 84  # divisible by 3 and 4, not by the blocks
    q, k, v, do = _qkv(2, 2, 2, s)
    bm = fagen.create_block_mask(mask_mod, None, None, s, s, device=DEVICE, block_size=16)
    monkeypatch.setattr(lowering, "ENABLED", False)
    unlowered = _run(q, k, v, do, mask_mod=mask_mod, block_mask=bm)
    monkeypatch.setattr(lowering, "ENABLED", True)
    got = _run(q, k, v, do, mask_mod=mask_mod, block_mask=bm)
    assert modded.LOWERED[0] == label
    assert max((a - b).abs().max().item() for a, b in zip(got, unlowered)) < 2e-5
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference.attention(*leaves, mask_mod=mask_mod)[0]
    ref = (ref, *torch.autograd.grad(ref, leaves, do.double()))
    for a, b in zip(got, ref):
        assert (a.double() - b).abs().max().item() < 4 * TOL[torch.float32]
    with torch.no_grad():  # the forward alone takes the same path
        out = fagen.attention(q, k, v, mask_mod=mask_mod, block_mask=bm)
    assert modded.LOWERED[0] == label and torch.equal(out, got[0])


@pytest.mark.parametrize("case", ["gqa", "indivisible", "unmergeable"])
def test_calls_the_views_cannot_serve_keep_the_mod(case):
    mm = g.generate_dilated_sliding_window(10, 4)
    if case == "gqa":
        q, k, v, _ = _qkv(1, 4, 2, 84)
    elif case == "indivisible":
        q, k, v, _ = _qkv(1, 2, 2, 86)
    else:  # B and H in no one stride: [B, H] as a transpose of [H, B]
        q, k, v = (x.detach().transpose(0, 1).contiguous().transpose(0, 1) for x in _qkv(2, 2, 2, 84)[:3])
    with torch.no_grad():
        out = fagen.attention(q, k, v, mask_mod=mm)
    assert modded.LOWERED[0] == "window(10,10)"  # the window alone, the dilation left a mask_mod
    ref = reference.attention(q.detach().double(), k.detach().double(), v.detach().double(), mask_mod=mm)[0]
    assert (out.double() - ref).abs().max().item() < 4 * TOL[torch.float32]


P = 9


@pytest.mark.parametrize("mask_mod, kw, want", [
    (g.generate_prefix_lm_mask(P), {}, ("none", {}, None, ("prefix", P))),
    (lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) | (kv_idx <= P - 1), {}, ("none", {}, None, ("prefix", P))),
    (lambda b, h, q_idx, kv_idx: (P + 2 > kv_idx) | (kv_idx <= q_idx), {}, ("none", {}, None, ("prefix", P + 2))),
    (lambda b, h, q_idx, kv_idx: ~(kv_idx >= 5) | (q_idx >= kv_idx), {}, ("none", {}, None, ("prefix", 5))),
    (g.generate_prefix_lm_mask(P), dict(mask="causal"), None),  # the built-in causal mask hides the prefix
    (g.generate_prefix_lm_mask(P), dict(sq=40), None),
    (g.generate_prefix_lm_mask(P), dict(ok=False), None),  # the views cannot serve (splittable says no)
    (lambda b, h, q_idx, kv_idx: (kv_idx < q_idx) | (q_idx >= kv_idx), {}, None),  # not a key limit
    (lambda b, h, q_idx, kv_idx: (kv_idx < P) | (q_idx > kv_idx), {}, None),  # the diagonal hidden
    (lambda b, h, q_idx, kv_idx: (kv_idx > P) | (q_idx >= kv_idx), {}, None),  # a suffix, not a prefix
])
def test_the_prefix_lm_mask_splits_only_when_exact(mask_mod, kw, want):
    assert _decide(mask_mod, **kw) == want


@pytest.mark.parametrize("prefix", [0, 1, 7, 30, 45, 60])
def test_prefix_lm_rows_run_as_two_switch_calls_and_agree_with_the_mod(prefix, monkeypatch):
    s = 45
    q, k, v, _ = _qkv(2, 2, 1, s)  # GQA: the slices keep the heads
    mm = g.generate_prefix_lm_mask(prefix)
    bm = fagen.create_block_mask(mm, None, None, s, s, device=DEVICE, block_size=16)
    with torch.no_grad():
        monkeypatch.setattr(lowering, "ENABLED", False)
        unlowered = fagen.attention(q, k, v, mask_mod=mm, block_mask=bm)
        monkeypatch.setattr(lowering, "ENABLED", True)
        got = fagen.attention(q, k, v, mask_mod=mm, block_mask=bm)
    assert modded.LOWERED[0] == f"prefix({prefix})"
    assert (got - unlowered).abs().max().item() < 2e-5
    ref = reference.attention(q.detach().double(), k.detach().double(), v.detach().double(), mask_mod=mm)[0]
    assert (got.double() - ref).abs().max().item() < TOL[torch.float32]


def _grads_agree(q, k, v, do, mm, label, monkeypatch, tol=4 * TOL[torch.float32]):
    """fagen.attention's out, dq, dk, dv lowered to `label` against the unlowered mod's and float64's."""
    s = q.shape[2]
    bm = fagen.create_block_mask(mm, None, None, s, s, device=DEVICE, block_size=16)
    monkeypatch.setattr(lowering, "ENABLED", False)
    unlowered = _run(q, k, v, do, mask_mod=mm, block_mask=bm)
    assert modded.LOWERED[0] is None
    monkeypatch.setattr(lowering, "ENABLED", True)
    got = _run(q, k, v, do, mask_mod=mm, block_mask=bm)
    assert modded.LOWERED[0] == label
    assert max((a - b).abs().max().item() for a, b in zip(got, unlowered)) < 2e-5
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference.attention(*leaves, mask_mod=mm)[0]
    ref = (ref, *torch.autograd.grad(ref, leaves, do.double()))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert (a.double() - b).abs().max().item() < tol, name


@pytest.mark.parametrize("prefix", [0, 7, 30, 45])
def test_prefix_lm_gradients_are_the_two_calls_backwards(prefix, monkeypatch):
    q, k, v, do = _qkv(1, 4, 2, 45)  # GQA; 45 rows: no whole block
    _grads_agree(q, k, v, do, g.generate_prefix_lm_mask(prefix), f"prefix({prefix})", monkeypatch)


def test_prefix_lm_with_a_softcap_is_one_autograd_node_with_gradients():
    q, k, v, do = _qkv(2, 2, 2, 45)
    mm, sm = g.generate_prefix_lm_mask(P), g.generate_tanh_softcap(4.0)
    out = fagen.attention(q, k, v, score_mod=sm, mask_mod=mm)
    assert modded.LOWERED[0] == f"prefix({P})+softcap" and type(out.grad_fn).__name__ == "PrefixBackward"
    got = (out, *torch.autograd.grad(out, (q, k, v), do))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference.attention(*leaves, score_mod=sm, mask_mod=mm)[0]
    ref = (ref, *torch.autograd.grad(ref, leaves, do.double()))
    for a, b in zip(got, ref):
        assert (a.double() - b).abs().max().item() < 4 * TOL[torch.float32]


def _docs(lengths):
    return g.length_to_offsets(lengths, DEVICE)


@pytest.mark.parametrize("mask_mod, kw, want", [
    (lambda: g.generate_doc_mask_mod(g.causal_mask, _docs([10, 20, 18])), {}, "document"),
    (lambda: (lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (DOC[kv_idx] == DOC[q_idx])), {}, "document"),
    (lambda: (lambda b, h, q_idx, kv_idx: (DOC[q_idx] == DOC[kv_idx]) & (q_idx > kv_idx)), {}, None),
    (lambda: (lambda b, h, q_idx, kv_idx: (DOC[q_idx] == DOC[kv_idx])), {}, None),  # not causal: not this split
    (lambda: (lambda b, h, q_idx, kv_idx: (DOC[q_idx] == DOC[kv_idx + 1]) & (q_idx >= kv_idx)), {}, None),
    (lambda: g.generate_doc_mask_mod(g.causal_mask, _docs([10, 20, 18])), dict(mask="causal"), None),
    (lambda: g.generate_doc_mask_mod(g.causal_mask, _docs([10, 20, 18])), dict(ok=False), None),
])
def test_the_document_mask_splits_only_when_exact(mask_mod, kw, want):
    got = _decide(mask_mod(), **kw)
    assert (got[3][0] if got and got[3] else None) == want


DOC = torch.tensor([0] * 10 + [1] * 20 + [2] * 18, device=DEVICE)


@pytest.mark.parametrize("lengths, split", [([10, 20, 15], True), ([45], True), ([1] * 45, True),
                                            ([7, 30, 8], True)])
def test_packed_documents_run_as_one_varlen_call_and_agree_with_the_mod(lengths, split, monkeypatch):
    s = sum(lengths)
    q, k, v, _ = _qkv(1, 4, 2, s)  # GQA
    mm = g.generate_doc_mask_mod(g.causal_mask, _docs(lengths))
    bm = fagen.create_block_mask(mm, None, None, s, s, device=DEVICE, block_size=16)
    with torch.no_grad():
        monkeypatch.setattr(lowering, "ENABLED", False)
        unlowered = fagen.attention(q, k, v, mask_mod=mm, block_mask=bm)
        monkeypatch.setattr(lowering, "ENABLED", True)
        got = fagen.attention(q, k, v, mask_mod=mm, block_mask=bm)
    assert modded.LOWERED[0] == "documents+causal"
    assert (got - unlowered).abs().max().item() < 2e-5
    ref = reference.attention(q.detach().double(), k.detach().double(), v.detach().double(), mask_mod=mm)[0]
    assert (got.double() - ref).abs().max().item() < TOL[torch.float32]


def test_document_ids_that_repeat_or_change_in_place_are_read_again():
    s = 40
    q, k, v, _ = _qkv(1, 2, 2, s)
    ids = torch.tensor([0] * 12 + [1] * 16 + [2] * 12, device=DEVICE)

    def mm(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    def check(label):
        with torch.no_grad():
            got = fagen.attention(q, k, v, mask_mod=mm)
        assert modded.LOWERED[0] == label
        ref = reference.attention(q.detach().double(), k.detach().double(), v.detach().double(), mask_mod=mm)[0]
        assert (got.double() - ref).abs().max().item() < TOL[torch.float32]
    check("documents+causal")
    ids[20:] = 5  # in place: new runs, read again
    check("documents+causal")
    ids[30:] = 0  # the value 0 fills two runs: not documents (the causal part alone lowers)
    check("causal")
    ids[30:] = 7
    check("documents+causal")


def test_document_ids_made_under_inference_mode_are_read_every_call():
    """Serving stacks build their tensors under torch.inference_mode(): such a tensor has no version counter, so the
    runs' memo (keyed by the version) must not be used for it, and an in-place change must still be seen."""
    s = 40
    q, k, v, _ = _qkv(1, 2, 2, s)
    with torch.inference_mode():
        ids = torch.tensor([0] * 12 + [1] * 16 + [2] * 12, device=DEVICE)

    def mm(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    def check(label):
        with torch.inference_mode():
            got = fagen.attention(q, k, v, mask_mod=mm)
        assert modded.LOWERED[0] == label
        ref = reference.attention(q.detach().double(), k.detach().double(), v.detach().double(), mask_mod=mm)[0]
        assert (got.double() - ref).abs().max().item() < TOL[torch.float32]
    check("documents+causal")
    with torch.inference_mode():
        ids[20:] = 5  # in place, no version bump: read again all the same
    check("documents+causal")
    with torch.inference_mode():
        ids[30:] = 0  # the value 0 fills two runs: not documents
    check("causal")


@pytest.mark.parametrize("lengths", [[10, 20, 15], [7, 30, 1, 13], [45]])
def test_packed_documents_gradients_are_the_varlen_backward(lengths, monkeypatch):
    q, k, v, do = _qkv(1, 4, 2, sum(lengths))  # GQA; runs and total not multiples of the blocks
    _grads_agree(q, k, v, do, g.generate_doc_mask_mod(g.causal_mask, _docs(lengths)), "documents+causal",
                 monkeypatch)


def test_packed_documents_in_a_batch_keep_the_mod_with_gradients():
    q, k, v, do = _qkv(2, 2, 2, 45)  # B = 2: no one varlen view
    mm = g.generate_doc_mask_mod(g.causal_mask, _docs([10, 20, 15]))
    got = _run(q, k, v, do, mask_mod=mm)
    assert modded.LOWERED[0] in (None, "causal")
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference.attention(*leaves, mask_mod=mm)[0]
    ref = (ref, *torch.autograd.grad(ref, leaves, do.double()))
    for a, b in zip(got, ref):
        assert (a.double() - b).abs().max().item() < 4 * TOL[torch.float32]


def test_packed_documents_with_a_softcap_split_with_gradients(monkeypatch):
    q, k, v, do = _qkv(1, 2, 2, 45)
    mm = g.generate_doc_mask_mod(g.causal_mask, _docs([13, 32]))
    sm = g.generate_tanh_softcap(5.0)
    got = _run(q, k, v, do, score_mod=sm, mask_mod=mm)
    assert modded.LOWERED[0] == "documents+causal+softcap"
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference.attention(*leaves, score_mod=sm, mask_mod=mm)[0]
    ref = (ref, *torch.autograd.grad(ref, leaves, do.double()))
    for a, b in zip(got, ref):
        assert (a.double() - b).abs().max().item() < 4 * TOL[torch.float32]


def _documents(monkeypatch, lengths=(7, 30, 1, 13)):
    """GQA inputs of documents off the blocks (51 rows), their mask_mod and block mask, and the varlen causal module
    the document split resolves, whose entries count their calls in `calls` ([Note] Document forward's host path)."""
    from fagen.runtime import api

    q, k, v, do = _qkv(1, 4, 2, sum(lengths))
    mm = g.generate_doc_mask_mod(g.causal_mask, _docs(list(lengths)))
    bm = fagen.create_block_mask(mm, None, None, q.shape[2], q.shape[2], device=DEVICE, block_size=16)
    module = api.resolve_varlen(*(t.squeeze(0).transpose(0, 1) for t in (q, k, v)), "causal")
    calls = []

    def counted(owner, name):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *args, **kw: (calls.append(name), real(*args, **kw))[1])
    for name in ("launch_forward", "forward", "attention"):
        counted(module, name)
    counted(split, "run_split")
    return q, k, v, do, mm, bm, calls


@pytest.mark.parametrize("check", [None, True])
def test_packed_documents_without_gradients_launch_the_varlen_module_once(check, monkeypatch):
    """[Note] Document forward's host path (fagen/runtime/api.py): without gradients the document split is one call
    of the varlen causal module's launch_forward (check=True: its forward, which reads the runs), not run_split's
    second pass through fagen.attention nor the module's autograd Function; out at float64's values."""
    q, k, v, do, mm, bm, calls = _documents(monkeypatch)
    with torch.no_grad():
        got = fagen.attention(q, k, v, mask_mod=mm, block_mask=bm, check=check)
    assert modded.LOWERED[0] == "documents+causal"
    assert calls == (["forward"] if check else ["launch_forward"])
    ref = reference.attention(q.detach().double(), k.detach().double(), v.detach().double(), mask_mod=mm)[0]
    assert got.shape == q.shape and (got.double() - ref).abs().max().item() < TOL[torch.float32]


def test_packed_documents_with_gradients_take_the_split_and_its_autograd_with_the_same_bits(monkeypatch):
    """With gradients the document split runs run_split and the varlen module's autograd Function (attention()),
    never the direct launch; its out is bitwise the direct launch's, and out, dq, dk, dv agree with float64's and
    the unlowered mod kernel's ([Note] Document forward's host path)."""
    q, k, v, do, mm, bm, calls = _documents(monkeypatch)
    with torch.no_grad():
        direct = fagen.attention(q, k, v, mask_mod=mm, block_mask=bm)
    assert calls == ["launch_forward"]
    calls.clear()
    out = fagen.attention(q, k, v, mask_mod=mm, block_mask=bm)
    assert out.requires_grad and modded.LOWERED[0] == "documents+causal"
    assert calls == ["run_split", "attention"]
    assert torch.equal(out.detach(), direct)
    _grads_agree(q, k, v, do, mm, "documents+causal", monkeypatch)


def test_the_varlen_launch_entry_checks_as_forward_but_never_reads_the_runs(monkeypatch):
    """The varlen module's launch_forward ([Note] Document forward's host path): q, k, v, the scale and cu_seqlens'
    dtype and shape checked as forward() checks them; cu_seqlens' values are not read, even with FAGEN_CHECK's
    CHECK on, where forward() refuses them; on sound runs, forward()'s bits."""
    q, k, v, _ = _qkv(1, 4, 2, 51)
    q, k, v = (t.detach().squeeze(0).transpose(0, 1) for t in (q, k, v))
    from fagen.runtime import api

    module = api.resolve_varlen(q, k, v, "causal")
    cu = torch.tensor([0, 7, 37, 38, 51], dtype=torch.int32, device=DEVICE)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=30, max_seqlen_k=30)
    out, lse = module.launch_forward(q, k, v, scale=0.2, **kw)
    want = module.forward(q, k, v, scale=0.2, **kw)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    for bad, match in ((dict(scale=-1.0), "scale"), (dict(cu_seqlens_q=cu.to(torch.int16)), "cu_seqlens_q"),
                       (dict(cu_seqlens_k=cu[:-1]), "cu_seqlens_k"), (dict(max_seqlen_q=-1), "max_seqlen_q")):
        with pytest.raises(module.InputError, match=match):
            module.launch_forward(q, k, v, **{**kw, "scale": None, **bad})
    with pytest.raises(module.InputError, match="q: dtype"):
        module.launch_forward(q.double(), k, v, **kw)
    monkeypatch.setattr(module, "CHECK", True)
    short = torch.tensor([0, 7, 37, 38, 50], dtype=torch.int32, device=DEVICE)  # ends before the packed rows
    with pytest.raises(module.InputError, match="last entry"):
        module.forward(q, k, v, **{**kw, "cu_seqlens_q": short})
    module.launch_forward(q, k, v, **{**kw, "cu_seqlens_q": short})  # not read: memory-safe, no error
