"""User mods in the Triton kernels: fagen.attention(score_mod=, mask_mod=, block_mask=) forward and backward against
the float64 reference running the same functions; built-in switches written as mods against the switch kernels;
a changed closure number compiles nothing new."""

import pytest
import torch

import fagen
from fagen.bench import gym_mods as g
from fagen.mods import lower as lowering
from _env import DEVICE
from mods_kernel import TOL
from fagen.runtime import loader, mods as trace_cache
from fagen.runtime.resolve import AttentionError
from fagen.verify import reference


@pytest.fixture(autouse=True)
def _run_the_mods(monkeypatch):
    """These tests compare the modded kernels themselves (with the switch kernels too): lowering off
    (tests/test_mods_lower.py runs it)."""
    monkeypatch.setattr(lowering, "ENABLED", False)


def _qkv(b, hq, hkv, sq, sk, d=32, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=gen).to(DEVICE, dtype).requires_grad_()
    k, v = (torch.randn(b, hkv, sk, d, generator=gen).to(DEVICE, dtype).requires_grad_() for _ in range(2))
    return q, k, v, torch.randn(b, hq, sq, d, generator=gen).to(DEVICE, dtype)


def _check(q, k, v, do, dtype=torch.float32, **kw):
    """fagen against the reference (float64, the same functions): out and dq, dk, dv."""
    out = fagen.attention(q, k, v, **kw)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_kw = {key: val for key, val in kw.items() if key != "block_mask"}
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = reference.attention(qd, kd, vd, **ref_kw)
    want = want[0] if isinstance(want, tuple) else want
    want_grads = torch.autograd.grad(want, (qd, kd, vd), do.double())
    tol = TOL[dtype]
    assert (out.double() - want).abs().max().item() < tol
    for name, got, ref in zip("qkv", grads, want_grads):
        err = (got.double() - ref).abs().max().item()
        assert err < 4 * tol, f"d{name}: {err}"
    return out


def test_score_mod_with_a_captured_float_tensor_gqa_causal():
    q, k, v, do = _qkv(2, 4, 2, 45, 70)
    rel = torch.randn(4, 2 * 70 - 1, device=DEVICE)
    _check(q, k, v, do, mask="causal", score_mod=g.generate_relative_bias(rel, 70))


def test_mask_mod_with_a_captured_int_tensor_with_and_without_a_block_mask():
    q, k, v, do = _qkv(1, 2, 2, 70, 70)
    mask_mod = g.generate_doc_mask_mod(g.causal_mask, g.length_to_offsets([13, 30, 27], DEVICE))
    _check(q, k, v, do, mask_mod=mask_mod)
    block_mask = fagen.create_block_mask(mask_mod, None, None, 70, 70, device=DEVICE, block_size=16)
    assert 0 < block_mask.sparsity() < 1
    _check(q, k, v, do, mask_mod=mask_mod, block_mask=block_mask)


@pytest.mark.parametrize("block", [32, 128])
def test_a_block_mask_with_a_builtin_mask_gqa_and_coarse_blocks(block):
    """Partial blocks run the mask_mod and full ones do not, in two loops over the block mask's lists ([Note] Partial
    and full lists), within the built-in causal mask's key range (bottom-right: Sk > Sq), under GQA; block 128 makes
    each block-mask block several kernel tiles."""
    q, k, v, do = _qkv(1, 4, 2, 150, 170)
    mask_mod = g.generate_sliding_window(100)
    block_mask = fagen.create_block_mask(mask_mod, None, None, 150, 170, device=DEVICE, block_size=block)
    classes = set(block_mask.classes.unique().tolist())
    assert classes == ({0, 1, 2} if block == 32 else {0, 1}), classes
    _check(q, k, v, do, mask="causal", mask_mod=mask_mod, block_mask=block_mask)


@pytest.mark.parametrize("block", [16, 128])
def test_a_block_mask_that_reads_b_and_h_walks_its_work_order_under_gqa(block):
    """[Note] Work order: the forward's programs take (head, query block) items from the block mask's list, heaviest
    first; a mask that reads b and h has one list per b over every (head, query block), and block 128 makes each
    block-mask row several kernel tiles (the grid covers the rows' tiles, the last past Sq). The mask shows keys
    past Sk: the partial blocks' loop hides them with the built-in mask's range check (MASKED != 0 in _fwd_mod)."""
    q, k, v, do = _qkv(2, 4, 2, 70, 90)
    starts = torch.tensor([[0, 30, 50, 10], [60, 5, 20, 40]], device=DEVICE)

    def mask_mod(b, h, q_idx, kv_idx):
        return ((kv_idx >= starts[b, h]) & (q_idx - kv_idx <= 20)) | (kv_idx == h)  # true past Sk too

    block_mask = fagen.create_block_mask(mask_mod, 2, 4, 70, 90, device=DEVICE, block_size=block)
    assert block_mask.shape[:2] == (2, 4)
    _check(q, k, v, do, mask_mod=mask_mod, block_mask=block_mask)


def test_the_forward_alone_takes_its_own_tiles_where_an_arch_lists_them(monkeypatch):
    """[Note] Forward tiles: a MODDED_FWD_TILES entry gives the forward without gradient a forward-only twin at its
    tiles (here a CPU stand-in for sm_90's), which matches the reference with a block mask and a captured tensor."""
    from fagen.runtime import modded
    from fagen.runtime.mods import prepare
    from fagen.spec.axes import Layout

    q, k, v, _ = _qkv(1, 2, 2, 70, 70, d=128)  # the table's keys are for head_dim > 64
    mask_mod = g.generate_doc_mask_mod(g.causal_mask, g.length_to_offsets([13, 30, 27], DEVICE))
    mods = prepare(mask_mod=mask_mod)
    _, spec, _ = modded._mods_spec(q, k, v, "none", (), mods, Layout.DENSE)
    monkeypatch.setattr(modded, "gpu_arch", lambda: None)  # as the interpreter, also on a GPU machine
    assert modded._forward_spec(spec, mods.fields, True) is None  # no arch (the interpreter): its own forward
    monkeypatch.setattr(modded, "gpu_arch", lambda: "sm_90")
    monkeypatch.setitem(modded.MODDED_FWD_TILES, ("sm_90", "mask", True, True), {"block_m": 32, "block_n": 16})
    monkeypatch.setitem(modded.MODDED_FWD_TILES, ("sm_90", "mask", True, False), {})
    assert fagen.load(modded._forward_spec(spec, mods.fields, False)).BLOCK_M == 64  # {}: the spec's tiles, fwd
    twin = fagen.load(modded._forward_spec(spec, mods.fields, True))
    assert (twin.BLOCK_M, twin.BLOCK_N) == (32, 16) and twin.NAME.startswith("attn_fwd_")
    block_mask = fagen.create_block_mask(mask_mod, None, None, 70, 70, device=DEVICE, block_size=16)
    visible = (block_mask.classes != 0).float().mean().item()
    assert block_mask.density == visible and 0 < visible < 1  # short rows: density * Sk keys per row
    out, lse = twin.forward(q.detach(), k.detach(), v.detach(), mods=mods.values, block_mask=block_mask)
    want, want_lse = reference.attention(*(t.detach().double() for t in (q, k, v)), mask_mod=mask_mod)
    assert (out.double() - want).abs().max().item() < TOL[torch.float32]
    assert (lse.double() - want_lse).abs().max().item() < TOL[torch.float32]


def test_a_module_refuses_a_block_mask_built_for_other_keys():
    """The kernels read each list row up to its length from Sk: a block mask of another Sk (or a hand-made list
    of the wrong dtype) is one clear error at the module's entry, never a read past the lists."""
    from fagen.runtime.modded import module_for
    from fagen.runtime.mods import prepare

    q, k, v, _ = _qkv(1, 2, 2, 64, 64)
    mask_mod = g.generate_sliding_window(10)
    mods = prepare(mask_mod=mask_mod)
    module, _ = module_for(q, k, v, "none", (), mods)
    other = fagen.create_block_mask(mask_mod, None, None, 64, 200, device=DEVICE)
    with pytest.raises(Exception, match=r"do not fit q \(1, 2, 64, 32\) and k \(1, 2, 64, 32\)"):
        module.forward(q, k, v, mods=mods.values, block_mask=other)
    good = fagen.create_block_mask(mask_mod, None, None, 64, 64, device=DEVICE).kernel_form(DEVICE, 64, 64)
    with pytest.raises(Exception, match="expected int8 classes and int32 lists"):
        module.forward(q, k, v, mods=mods.values, block_mask=(good[0], good[1].long(), *good[2:]))


def test_a_score_mod_runs_the_plain_phases_of_a_builtin_window():
    """Without a mask_mod the loops are the plain kernels' phases: masked edges of the window, an unmasked middle."""
    q, k, v, do = _qkv(1, 4, 2, 150, 170)
    rel = torch.randn(4, 2 * 170 - 1, device=DEVICE)
    _check(q, k, v, do, mask="causal", window=(70, 0), score_mod=g.generate_relative_bias(rel, 170))


@pytest.mark.parametrize("case", ["alibi-causal-gqa", "softcap-padding"])
def test_a_score_mod_without_tensors_runs_the_plain_dkdv_phases(case):
    """A score_mod that reads no captured tensor runs the dK/dV loop as the plain kernel's three phases ([Note]
    Modded dK/dV phases): the built-in mask and row checks at the edges [lo, split) and [full, hi), neither in
    between; several query and key blocks each, lengths off the blocks, GQA, bottom-right causal, padding."""
    if case == "alibi-causal-gqa":
        q, k, v, do = _qkv(1, 4, 2, 150, 170)
        _check(q, k, v, do, mask="causal", score_mod=g.generate_alibi_bias(4))
    else:
        q, k, v, do = _qkv(2, 2, 2, 100, 90)
        lens_q, lens_k = torch.tensor([100, 61], device=DEVICE), torch.tensor([90, 37], device=DEVICE)
        _check(q, k, v, do, mask="causal+padding", seqlens_q=lens_q, seqlens_k=lens_k,
               score_mod=g.generate_tanh_softcap(5.0))


@pytest.mark.parametrize("block", [None, 16, 64])
def test_a_mask_mod_showing_keys_the_builtin_mask_hides(block):
    """Partial blocks run the mask_mod per element and the built-in mask only outside its unmasked range: a mask_mod
    that shows future keys (every even distance) under the built-in bottom-right causal mask and padding, GQA,
    lengths off the blocks; without a block mask, with one of kernel-sized and of coarse blocks."""
    q, k, v, do = _qkv(2, 4, 2, 70, 90)
    lens_q, lens_k = torch.tensor([70, 41], device=DEVICE), torch.tensor([90, 57], device=DEVICE)
    mask_mod = g.generate_dilated_sliding_window(200, 2)
    kw = dict(mask="causal+padding", seqlens_q=lens_q, seqlens_k=lens_k, mask_mod=mask_mod)
    if block is not None:
        kw["block_mask"] = fagen.create_block_mask(mask_mod, None, None, 70, 90, device=DEVICE, block_size=block)
    _check(q, k, v, do, **kw)


def test_scalars_and_both_mods_with_padding_in_fp16():
    q, k, v, do = _qkv(2, 2, 1, 37, 50, dtype=torch.float16)
    lens_q = torch.tensor([37, 20], device=DEVICE)
    lens_k = torch.tensor([50, 33], device=DEVICE)
    _check(q, k, v, do, dtype=torch.float16, mask="causal+padding", seqlens_q=lens_q, seqlens_k=lens_k,
           score_mod=g.generate_tanh_softcap(7.5), mask_mod=g.generate_dilated_sliding_window(9, 2))


def test_a_mod_that_hides_a_whole_row_gives_zero_and_minus_inf():
    q, k, v, do = _qkv(1, 2, 2, 20, 20)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= 5) & (kv_idx <= q_idx)

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx == 7, -float("inf"), score)

    out = _check(q, k, v, do, mask_mod=mask_mod, score_mod=score_mod)
    assert out[0, :, :5].abs().max() == 0 and out[0, :, 7].abs().max() == 0


@pytest.mark.parametrize("switch", ["causal", "softcap", "window", "alibi"])
def test_a_builtin_switch_written_as_a_mod_agrees_with_the_switch_kernel(switch):
    q, k, v, do = _qkv(1, 4, 2, 40, 40)
    slopes = torch.rand(4, device=DEVICE)
    switch_kw, mod_kw = {
        "causal": (dict(mask="causal"), dict(mask_mod=g.causal_mask)),
        "softcap": (dict(softcap=6.0), dict(score_mod=g.generate_tanh_softcap(6.0))),
        "window": (dict(mask="causal", window=(9, 0)), dict(mask_mod=g.generate_sliding_window(9))),
        "alibi": (dict(alibi_slopes=slopes),
                  dict(score_mod=lambda s, b, h, q_idx, kv_idx: s - slopes[h] * torch.abs(kv_idx - q_idx))),
    }[switch]
    a = fagen.attention(q, k, v, **switch_kw)
    b = fagen.attention(q, k, v, **mod_kw)
    ga, gb = torch.autograd.grad(a, (q, k, v), do), torch.autograd.grad(b, (q, k, v), do)
    assert (a - b).abs().max().item() < 2e-6
    assert max((x - y).abs().max().item() for x, y in zip(ga, gb)) < 1e-5


def test_a_changed_closure_scalar_traces_renders_and_loads_nothing_new():
    q, k, v, _ = _qkv(1, 2, 2, 33, 33)
    with torch.no_grad():
        fagen.attention(q, k, v, mask_mod=g.generate_sliding_window(4))
        traces, modules = trace_cache.TRACES[0], len(loader._loaded)
        outs = [fagen.attention(q, k, v, mask_mod=g.generate_sliding_window(w)) for w in (16, 17, 1)]
    assert trace_cache.TRACES[0] == traces and len(loader._loaded) == modules
    assert not torch.equal(outs[0], outs[2])
    module = next(m for m in loader._loaded.values() if getattr(m, "_MOD_SCALARS", None) == (("window_size", int),))
    source = module.__loader__.get_source(module.__name__)
    assert '"ms0"' in source.split("def _attn_fwd(")[0].rsplit("@triton.jit", 1)[1]  # never specialised


def test_captured_float_tensors_get_their_gradient_bitwise_repeatable():
    q, k, v, do = _qkv(2, 4, 2, 33, 40)
    bias = (torch.randn(4, 79, device=DEVICE) * 0.5).requires_grad_()
    w = torch.randn(4, device=DEVICE).requires_grad_()

    def score_mod(score, b, h, q_idx, kv_idx):  # two loads of two learned tensors, one a product
        return score + bias[h, q_idx - kv_idx + 39] * w[h]

    block_mask = fagen.create_block_mask(g.causal_mask, None, None, 33, 40, device=DEVICE, block_size=16)
    kw = dict(mask="causal", score_mod=score_mod, mask_mod=g.causal_mask, block_mask=block_mask)
    got = [torch.autograd.grad(fagen.attention(q, k, v, **kw), (q, k, v, bias, w), do) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*got))  # deterministic: no atomics
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias, w)]
    want = reference.attention(*leaves[:3], mask="causal", mask_mod=g.causal_mask,
                               score_mod=lambda s, b, h, qi, ki: s + leaves[3][h, qi - ki + 39] * leaves[4][h])
    want = torch.autograd.grad(want[0] if isinstance(want, tuple) else want, leaves, do.double())
    for name, a, b in zip(("q", "k", "v", "bias", "w"), got[0], want):
        assert (a.double() - b).abs().max().item() < 1e-4, name


def test_what_is_refused_is_one_clear_error():
    q, k, v, _ = _qkv(1, 2, 2, 16, 16)
    other = fagen.create_block_mask(g.causal_mask, None, None, 16, 16, device=DEVICE)
    with pytest.raises(AttentionError, match="built for mask_mod"):
        fagen.attention(q, k, v, mask_mod=g.generate_sliding_window(3), block_mask=other)
    with pytest.raises(AttentionError, match="pass that mask_mod"):
        fagen.attention(q, k, v, block_mask=other)


@pytest.mark.parametrize("name", ["mod-dropped-from-backward", "mod-kv-idx-off-by-one", "mask-mod-before-alignment",
                                  "block-mask-partial-as-full"])
def test_each_mod_mutant_is_caught(name):
    """Each mutant of fagen/verify/mutants.py's MOD_MUTANTS, rendered into a module, fails the reference check."""
    from fagen.codegen.render import render
    from fagen.runtime.modded import module_for
    from fagen.runtime.mods import prepare
    from fagen.verify.mutants import MOD_MUTANTS

    mutant = next(m for m in MOD_MUTANTS if m.name == name)
    q, k, v, do = _qkv(1, 2, 2, 40, 56)
    mask_mod = g.generate_doc_mask_mod(g.causal_mask, g.length_to_offsets([20, 36], DEVICE))
    kw = dict(score_mod=g.generate_tanh_softcap(3.0), mask_mod=mask_mod)
    mods = prepare(**kw)
    module, _ = module_for(q, k, v, "none", (), mods)
    spec = fagen.KernelSpec.from_json(module.__loader__.get_source(module.__name__).splitlines()[1][len("# spec: "):])
    assert mutant.applies(spec)
    broken = loader.load_source(mutant.apply(render(spec).source), "mutant_" + name.replace("-", "_"))
    block_mask = fagen.create_block_mask(mask_mod, None, None, 40, 56, device=DEVICE, block_size=16)
    out = broken.attention(q, k, v, mods=mods.values, block_mask=block_mask)
    grads = torch.autograd.grad(out, (q, k, v), do)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = reference.attention(qd, kd, vd, **kw)
    want = want[0] if isinstance(want, tuple) else want
    want_grads = torch.autograd.grad(want, (qd, kd, vd), do.double())
    worst = max([(out.double() - want).abs().max().item()]
                + [(a.double() - b).abs().max().item() for a, b in zip(grads, want_grads)])
    assert worst > 1e-3, f"{name} was not caught (worst error {worst:.1e})"


_BWD_SM90 = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import torch
from fagen.aot.artifacts import _compile_kernel, _compiled_mode, import_for_compile
from fagen.bench import gym_mods as g
from fagen.runtime.modded import modded_spec
from fagen.runtime.mods import prepare
from fagen.spec.kernel import KernelSpec
from sm90 import loops, ptxas

mods = {"alibi": g.generate_alibi_bias(16), "relbias": g.generate_relative_bias(torch.zeros(16, 511), 256)}
base = KernelSpec(head_dim=128, dtype="bf16", direction="bwd", mask="none")
out = {}
for key in json.loads(sys.argv[2]):
    spec = modded_spec(base, prepare(score_mod=mods[key]).fields, arch="sm_90")
    entry = next(e for e in import_for_compile(spec).AOT_KERNELS if e["name"] == "_attn_bwd_dkdv")
    entry = dict(entry, signature=dict(entry["signature"]), constexprs=dict(entry["constexprs"]))
    for name in [n for n in entry["signature"] if n.startswith("MG")]:  # no gradient asked: as fagen.attention
        entry["signature"][name], entry["constexprs"][name] = "constexpr", None
    with _compiled_mode():
        ptx, _, record = _compile_kernel(spec, "sm_90", entry)
    ptx = ptx.decode()
    log = ptxas(ptx)[1]
    out[key] = dict(loops=len(loops(ptx)), serialized="wgmma.mma_async instructions are serialized" in log,
                    spills=record["spills"])
print("RESULT " + json.dumps(out))
"""


def test_the_score_mods_dkdv_loops_build_for_sm_90_without_serialised_wgmma(tmp_path_factory):
    """[Note] Modded dK/dV phases: ALiBi (no captured tensor) runs the plain kernel's three dK/dV loops, the relative
    bias (a gather) one; ptxas serialises neither's wgmma (three loops with a gather did, at every tile tried)."""
    from test_hopper_compile import build_sm90

    built = build_sm90(tmp_path_factory, _BWD_SM90, ["alibi", "relbias"], "mods-bwd-sm90")
    assert built["alibi"]["loops"] == 3 and built["relbias"]["loops"] == 1, built
    assert not built["alibi"]["serialized"] and not built["relbias"]["serialized"], built
    assert built["alibi"]["spills"] <= 64 and built["relbias"]["spills"] <= 64, built
