"""The Gluon backward's GQA levers (fagen/templates/gluon/backward.py.j2; ninth session, docs/hopper.md "GQA and d64 in
the Gluon backward (ninth session)"): the query block major steps ([Note] GQA step order in the backward), the split
of a KV head's query heads over programs ([Note] GQA split in the backward) and the L2 sections of the tile order
([Note] L2 sections in the backward). Renders and host code on the CPU; the kernels run in
scripts/gpu_gluon_bwd_gqa64.py."""

import re

import pytest
import torch

import fagen
from fagen import backends
from fagen.codegen import render
from fagen.runtime.loader import load_source
from fagen.runtime import hopper, resolve
from fagen.spec.kernel import KernelSpec
from _env import ON_GPU
from test_hopper_selection import as_if_hopper  # noqa: F401 (a fixture)


def source(gqa=4, mask="causal", head_dim=128, product=False, **variant):
    """The render with `variant` over the product's (product=False: without the GQA causal keys, bwd_gqa)."""
    if not product:
        variant.setdefault("bwd_gqa", {})
    saved = dict(backends.GLUON.variant)
    backends.GLUON.variant.update(variant)
    render.render.cache_clear()
    try:
        return fagen.generate(KernelSpec(backend="gluon", direction="bwd", head_dim=head_dim, mask=mask, gqa=gqa,
                                         dtype="bf16"))
    finally:
        backends.GLUON.variant.clear()
        backends.GLUON.variant.update(saved)
        render.render.cache_clear()


def test_the_gqa_levers_are_off_by_default_and_render_nothing_where_they_do_not_apply():
    default = source()
    assert "g = f % GQA" not in default and "off_hkv // " not in default and "span = " not in default
    assert "\nBWD_KV_SPLIT = 1 " in default
    mha = source(gqa=1)
    assert source(gqa=1, bwd_gqa_order=1, bwd_gqa_split=2) == mha  # no query heads to reorder or split
    assert source(gqa=4, bwd_gqa_split=8) == default  # a split must divide gqa


def _run(lines, **names):
    """Execute rendered kernel lines as Python (gl.minimum -> min) in `names`; returns the names afterwards."""
    text = "\n".join(line.strip() for line in lines).replace("gl.minimum", "min")
    exec(text, {}, names)
    return names


def test_query_block_major_steps_visit_every_head_and_block_once():
    """[Note] GQA step order in the backward: the steps' (head, query block) pairs, from the rendered lines."""
    src = source(bwd_gqa_order=1)
    assert src.count("            g = f % GQA\n            m0 = lo + (f // GQA) * BLOCK_M\n") == 4  # 2 kernels
    lines = ["g = f % GQA", "m0 = lo + (f // GQA) * BLOCK_M"]
    for gqa, steps in ((4, 7), (8, 1), (2, 64)):
        seen = [(r["g"], r["m0"]) for r in (_run(lines, f=f, GQA=gqa, lo=128, BLOCK_M=64)
                                            for f in range(gqa * steps))]
        assert sorted(seen) == [(g, 128 + 64 * m) for g in range(gqa) for m in range(steps)]
        assert [m for _, m in seen] == sorted(m for _, m in seen)  # query block major: blocks never go back


def test_l2_sections_deal_every_tile_once_and_keep_the_turns_deadlock_free():
    """[Note] L2 sections in the backward: the rendered tile -> (key block, pair) map is a bijection, each section
    key block major, and (n - 1, pair) has a smaller tile index than (n, pair) ([Note] Fixed-order dQ's condition)."""
    src = source(bwd_sections=8, bwd_fixed=1)
    assert "\nBWD_GRID_ALL = 1 " in src and "span = " not in source(bwd_sections=8)  # not with the chain
    body = src[src.index("    span = 8 * "):src.index("    off_b = bh // num_heads_kv")].splitlines()
    for num_bh, seq_k in ((32, 4096), (30, 640), (3, 900), (8, 128)):
        nk = -(-seq_k // 128)
        got = [_run(body, tile=t, num_bh=num_bh, seq_k=seq_k, BLOCK_N=128) for t in range(num_bh * nk)]
        index = {(r["n_blk"], r["bh"]): t for t, r in enumerate(got)}
        assert sorted(index) == [(n, bh) for n in range(nk) for bh in range(num_bh)], (num_bh, nk)
        assert all(index[(n - 1, bh)] < index[(n, bh)] for n in range(1, nk) for bh in range(num_bh))
        # a section's pairs: 8 (the last one the rest), consecutive
        first = [r["bh"] for r in got[:8 * nk]]
        assert set(first) == set(range(min(8, num_bh)))


def test_the_split_loads_the_real_kv_head_and_stores_float32_partials_without_tma():
    src = source(bwd_gqa_split=2)
    assert "\nBWD_KV_SPLIT = 2 " in src
    assert src.count("[off_b, off_hkv // 2, n0, 0]") == 4  # K and V, in both kernels' producers
    assert "_BWD_KERNELS = {0: (_attn_bwd_hopper, 0), 1: (_attn_bwd_hopper_u, 0)}" in src  # no TMA epilogue
    assert src.count("gl.store(DK + kv_base + kv_offs, dk.to(DK.dtype.element_ty)") == 2
    assert "GQA=GQA // BWD_KV_SPLIT" in src and '"GQA": GQA // BWD_KV_SPLIT' in src


@pytest.mark.parametrize("split", [2, 4])
def test_the_split_host_sums_the_float32_partials_in_a_fixed_order(monkeypatch, split):
    """_launch_backward hands the kernels float32 dK, dV partials per virtual KV head (hkv x split) and returns their
    sum over the split in q's dtype; the kernels are a stand-in that fills the partials."""
    spec = KernelSpec(backend="gluon", direction="bwd", head_dim=128, mask="causal", gqa=4, dtype="bf16")
    mod = load_source(source(bwd_gqa_split=split), f"{spec.name}_split{split}_test")
    calls = []

    def fake_host(do, q, k, v, out, lse, scale, dq, dk, dv, dq_mode):
        assert dk.dtype == dv.dtype == torch.float32 and dk.shape == (2, 3 * split, 200, 128), dk.shape
        torch.manual_seed(len(calls))
        dk.copy_(torch.randn(dk.shape)), dv.copy_(torch.randn(dv.shape)), dq.copy_(torch.randn(dq.shape))
        calls.append((dk.clone(), dv.clone(), dq.clone(), dq_mode))

    monkeypatch.setattr(mod, "_bwd_host", fake_host)
    torch.manual_seed(0)
    q, do, out = (torch.randn(2, 12, 150, 128).bfloat16() for _ in range(3))
    k, v = (torch.randn(2, 3, 200, 128).bfloat16() for _ in range(2))
    lse = torch.randn(2, 12, 150)
    for det in (True, False):
        dq, dk, dv = mod._launch_backward(do, q, k, v, out, lse, 0.09, None, None, None, deterministic=det)
        pk, pv, pq, mode = calls[-1]
        assert mode == (mod.BWD_DET_MODE if det else 1)
        assert torch.equal(dq, pq)
        for got, part in ((dk, pk), (dv, pv)):
            want = part[:, 0::split].clone()
            for i in range(1, split):  # the virtual heads of KV head h are h * split + i, summed in order of i
                want += part[:, i::split]
            assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())


def test_the_split_and_the_step_order_pass_the_virtual_heads_to_the_fast_launch():
    """The fast host path launches the main kernel over hkv x split virtual KV heads with GQA / split query heads
    each (the plain path too); the preprocess keeps the real GQA (the fixed-point dQ's per KV head bounds)."""
    src = source(bwd_gqa_split=4)
    fast = src[src.index("def _run_backward_fast("):src.index("def _bwd_host(")]
    plain = src[src.index("def _run_backward("):src.index("def _run_backward_fast(")]
    for path in (fast, plain):
        assert "hkv, sk = k.shape[1] * BWD_KV_SPLIT, k.shape[2]" in path
        assert re.search(r"num_tiles( - split)?, num_bh, hkv, sq, sk, sq_pad", path)  # split: [Note] Split tail
        assert "GQA=GQA // BWD_KV_SPLIT" in path


def test_a_d64_backward_renders_the_bwd_d64_keys_over_the_variant():
    """[Note] Gluon backward at d64: variant["bwd_d64"]'s keys apply to head_dim 64 backward renders only."""
    plain64, plain128 = source(gqa=1, head_dim=64, bwd_d64={}), source(gqa=1)
    assert "\nBWD_BLOCK_M = 64\n" in plain64 and "_cvt_rni(" not in plain64
    d64 = {"bwd_d64": {"bwd_fixed": 1, "bwd_block_m": 128}}
    got = source(gqa=1, head_dim=64, **d64)
    assert "\nBWD_BLOCK_M = 128 " in got and "gl.static_assert(BLOCK_M == 128)" in got and "_cvt_rni(" in got
    assert "BWD_DET_MODE = 2" in got
    assert source(gqa=1, **d64) == plain128
    fwd = KernelSpec(backend="gluon", head_dim=64, mask="causal", dtype="bf16")
    # a d64 forward reads none of bwd_d64's keys (only the S-ahead of [Note] The d64 forward's levers, where on)
    assert {k: v for k, v in backends.GLUON.variant_for(fwd).items() if k != "fwd_s_ahead"} == {
        k: v for k, v in backends.GLUON.variant.items() if k != "fwd_s_ahead"}


def test_a_switch_or_a_score_mod_keeps_the_default_variant():
    """The fixed-point dQ's bound holds for plain softmax gradients only ([Note] Fixed-point dQ): a score_mod may scale
    dS past it, so bwd_d64 / bwd_gqa (fixed-point, sections) apply to plain specs, and a modded or switch spec of the
    same shape renders the default variant (the fixed-order chain)."""
    g = backends.GLUON
    plain = KernelSpec(backend="gluon", direction="bwd", head_dim=128, mask="causal", gqa=4, dtype="bf16")
    assert g.variant_for(plain)["bwd_fixed"] == 1 and g.variant_for(plain)["bwd_sections"] == 4
    for other in (dict(score_mod="score * 2.0"), dict(softcap=True)):
        spec = KernelSpec(backend="gluon", direction="bwd", head_dim=128, mask="causal", gqa=4, dtype="bf16", **other)
        assert g.variant_for(spec) is g.variant, other
    d64 = KernelSpec(backend="gluon", direction="bwd", head_dim=64, mask="none", dtype="bf16", score_mod="score + 1.0")
    assert g.variant_for(d64) is g.variant


def test_the_d64_backward_renders_the_fixed_point_dq_by_default():
    """The product's d64 render ([Note] Gluon backward at d64): the fixed-point dQ is its deterministic mode; d128
    MHA's by its own keys (bwd_d128, tenth session; without them the chain)."""
    assert "BWD_DET_MODE = 2" in source(gqa=1, head_dim=64) and "BWD_DET_MODE = 0" in source(gqa=1, bwd_d128={})


@pytest.mark.parametrize("mask,gqa,dtype,picked", [
    ("causal", 1, "bf16", True), ("none", 1, "bf16", True), ("causal", 4, "bf16", True),
    ("none", 4, "bf16", False),  # GQA full at d64: not measured
    ("causal", 1, "fp16", False),  # not measured
])
def test_a_faked_sm90_picks_the_gluon_backward_at_d64_where_measured(as_if_hopper, mask, gqa, dtype,  # noqa: F811
                                                                     picked):
    """[Note] Gluon backward at d64: H100 round A, the fixed-point render against the Triton backward (causal 407 vs
    379, full 372-393 vs 368, GQA causal 362 vs 318 TF/s)."""
    spec = KernelSpec(head_dim=64, dtype=dtype, direction="bwd", mask=mask, gqa=gqa)
    want = KernelSpec(backend="gluon", direction="bwd", head_dim=64, dtype=dtype, mask=mask, gqa=gqa)
    assert hopper.backward_spec(spec, torch.device("cuda")) == (want if picked else None)
    # a switch or another head dim keeps the Triton backward
    assert hopper.backward_spec(KernelSpec(head_dim=64, dtype=dtype, direction="bwd", mask=mask, gqa=gqa,
                                           softcap=True), torch.device("cuda")) is None
    assert hopper.backward_spec(KernelSpec(head_dim=96, dtype=dtype, direction="bwd", mask=mask, gqa=gqa),
                                torch.device("cuda")) is None


@pytest.mark.skipif(ON_GPU, reason="CPU tensors on a faked sm_90: on a GPU their Triton fallback has no interpreter")
def test_fagen_attention_takes_the_fixed_point_gluon_backward_at_d64(as_if_hopper):  # noqa: F811
    q = torch.zeros(1, 4, 8, 64, dtype=torch.bfloat16)
    big = resolve.resolve(q, q, q, "causal", False, big_bwd=True)
    assert big.NAME == "attn_bwd_causal_d64_m128n128w8s3_g1_bf16_gluon" and big.BWD_DET_MODE == 2
    small = resolve.resolve(q, q, q, "causal", False)
    assert not small.NAME.endswith("_gluon")


def test_gqa_causal_renders_the_fixed_point_dq_with_l2_sections_and_takes_unordered_adds():
    """Round B (H100): sections of 4 with one program per tile, 429 TF/s deterministic (the chain 367) and 510
    unordered (cuDNN 469); d64: sections of 8. MHA d128 (tenth session, bwd_d128): sections of 4 with the qmul rows
    by TMA."""
    gqa = source(product=True)
    assert "BWD_DET_MODE = 2" in gqa and "span = 4 * " in gqa and "\nBWD_GRID_ALL = 1 " in gqa
    d64 = source(gqa=1, head_dim=64, product=True)
    assert "span = 8 * " in d64 and "m_smem.index(s)" in d64  # eleventh session: d64's qmul rows by TMA too
    assert "\nBWD_FIXED_FAST = 1" in d64  # the fast host path keeps the qmul rows beside delta (_BWD_FAST_FIXED)
    mha = source(gqa=1, product=True)
    assert "BWD_DET_MODE = 2" in mha and "span = 4 * " in mha and "m_smem.index(s)" in mha
    assert "span = " not in source(gqa=4, mask="none", product=True)  # GQA full: not measured
    assert backends.GLUON.unordered_selected("causal", 4)


def test_the_ring_depth_is_a_variant_key_off_by_default():
    """Variant bwd_ring (eleventh session): the Q/dO ring's slots (the kernels' STAGES constexpr, which sizes the Q, dO,
    lse2, delta and qmul rings and their barriers); 2 renders the product's text, other depths reach the launches."""
    assert backends.GLUON.variant["bwd_ring"] == 2 and "bwd_ring" not in backends.GLUON.variant["bwd_d64"]
    plain = source(gqa=1, head_dim=64, product=True)
    assert "\nBWD_RING_SLOTS = 2  # Q/dO ring depth" in plain and "variant bwd_ring" not in plain
    for depth in (3, 4):
        got = source(gqa=1, head_dim=64, product=True, bwd_d64={**backends.GLUON.variant["bwd_d64"],
                                                                 "bwd_fixed_tma": 1, "bwd_ring": depth})
        assert f"\nBWD_RING_SLOTS = {depth}  # Q/dO ring depth" in got and "variant bwd_ring" in got
        assert got.count("STAGES=BWD_RING_SLOTS") == 2 and '"STAGES": BWD_RING_SLOTS' in got  # plain, fast paths
        kernels = got.count("\ndef _attn_bwd_hopper")  # causal: the unordered mode's own kernel too
        assert kernels == 2 and got.count("[STAGES, BLOCK_M, HEAD_DIM]") == 2 * kernels  # Q, dO
        assert got.count("[STAGES, 1, BLOCK_M]") == 3 * kernels  # lse2, delta, qmul


def _slots_source(**over):
    d64 = {**backends.GLUON.variant["bwd_d64"], "bwd_fixed_tma": 1, "bwd_dq_slots": 2, **over}
    return source(gqa=1, head_dim=64, product=True, bwd_d64=d64)


def _snippet(src, first, last):
    """The rendered lines from the one starting with `first` to the one starting with `last` (stripped)."""
    lines = [line.strip() for line in src.splitlines()]
    i = next(k for k, line in enumerate(lines) if line.startswith(first))
    j = next(k for k in range(i, len(lines)) if lines[k].startswith(last))
    return lines[i:j + 1]


def _exec(lines, names):
    """Run rendered straight-line code with one-line `if` bodies in `names`."""
    code = []
    indent = 0
    for line in lines:  # the snippets hold one level of `if`: its body is the next line
        code.append("    " * indent + line)
        indent = 1 if line.split("  #")[0].endswith(":") else 0
    exec("\n".join(code), {}, names)
    return names


def test_two_dq_slots_render_at_d64_only_and_off_by_default():
    """[Note] Two dQ slots (variant bwd_dq_slots 2): d64's named-barrier kernel gets four float32 slots and the run-time
    ids of pair 1 (4 + w, 6 + w: not triton's 0-2 nor pair 0's 8-12); the default and d128 render none of it."""
    assert backends.GLUON.variant["bwd_dq_slots"] == 1
    assert "_named_bar_id" not in source(gqa=1, head_dim=64, product=True)
    assert source(gqa=1, product=True, bwd_dq_slots=2) == source(gqa=1, product=True)  # d128: does not fit
    src = _slots_source()
    assert src.count("dq_smem = gl.allocate_shared_memory(dq_desc.dtype, [4, BLOCK_M") == 1  # the _u kernel
    assert src.count("dq_smem = gl.allocate_shared_memory(dq_desc.dtype, [2, BLOCK_M") == 1  # the chain's
    assert "_named_bar_id(_BAR_DQ_FULL + WG - 4 * b, \"arrive\", 160)" in src


def test_two_dq_slots_consume_every_arrive_and_reuse_a_slot_only_once_its_handoff_is_read():
    """The compute warpgroup's rendered protocol over tiles of several lengths, against the dQ warp's (one arrive on
    both halves' empty ids of slot pair j % 2 per step): before each store into (or dK/dV staging in) a pair, every
    earlier handoff of that pair has been synced; at exit every arrive has been consumed (the barriers idle)."""
    src = _slots_source()
    step = _snippet(src, "b = j % 2  # [Note] Two dQ slots", "owed = owed | (1 << b)")
    epi = _snippet(src, "b = j % 2  # the slot of the next step", "slot = WG + 2 * b")
    end = _snippet(src, "if owed & 1:  # the dQ warp's arrives", "_named_bar_id(_BAR_DQ_EMPTY + WG - 4, \"sync\", 160)")
    for wg in (0, 1):
        for tiles in ([3], [1, 1, 1], [4, 0, 2, 5], [2, 3], [0], [1]):
            events = []
            bar = lambda bar_id, op, count: events.append((op, bar_id))  # noqa: E731
            ids = {8 + wg: ("full", 0), 4 + wg: ("full", 1), 10 + wg: ("empty", 0), 6 + wg: ("empty", 1)}
            slots = type("Slots", (), {"index": lambda self, i: type("Slot", (), {
                "store": lambda self, x: events.append(("store", i))})()})()
            names = dict(_named_bar_id=bar, _BAR_DQ_FULL=8, _BAR_DQ_EMPTY=10, WG=wg, owed=0, j=0, dq=None,
                         dq_smem=slots, fence_async_shared=lambda: None)
            stores, synced, uses = {0: 0, 1: 0}, {0: 0, 1: 0}, []
            for n in tiles:
                for _ in range(n):
                    _exec(step, names)
                    b = names["j"] % 2
                    assert [e for e in events if e[0] != "sync"] == [("store", wg + 2 * b), ("arrive", 8 + wg - 4 * b)]
                    for op, bar_id in (e for e in events if e[0] == "sync"):
                        assert ids[bar_id] == ("empty", b), events  # the sync before the store, on its own pair
                        synced[b] += 1
                    uses.append((b, stores[b], synced[b]))
                    stores[b] += 1
                    events.clear()
                    names["j"] += 1
                _exec(epi, names)
                b = names["slot"] - wg
                assert b in (0, 2), names
                for op, bar_id in events:
                    synced[ids[bar_id][1]] += 1
                events.clear()
                assert synced[b // 2] == stores[b // 2], (tiles, names)  # staging: the pair's adds are read
            _exec(end, names)
            for op, bar_id in events:
                synced[ids[bar_id][1]] += 1
            assert synced == stores, (tiles, synced, stores)  # every arrive of the dQ warp consumed
            # a store into pair b waits for all earlier handoffs of b (the one before it included)
            assert all(done == before for _, before, done in uses), (tiles, uses)
