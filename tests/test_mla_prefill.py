"""MLA prefill (head_dim 192, head_dim_v 128; docs/serving.md, "MLA prefill"): the Triton kernels' split head dim
([Note] Split head dim in fagen/templates/triton/attention.py.j2) against the float64 reference on the CPU
interpreter, the sm_90 tiles ([Note] MLA prefill tiles in fagen/backends/triton.py) compiled without more spills
than claimed, and the Gluon forward's spec rules and sm_90 build ([Note] Gluon MLA widths)."""

import pytest
import torch

import fagen
from _env import DEVICE, ON_GPU
from fagen import backends
from fagen.codegen.render import render
from fagen.runtime.loader import load
from fagen.spec.axes import DType, SpecError
from fagen.spec.kernel import KernelSpec
from fagen.verify import reference
from fagen.verify.tolerances import GRAD_TOLERANCE, TOLERANCE, compare

SMALL = dict(block_m=16, block_n=16)
# (head_dim, head_dim_v): MLA's, and a split whose high part (8 columns) is padded to 16 and masked
PAIRS = [(192, 128), (136, 64)]


def _inputs(d, dv, sq, sk, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, sq, d, generator=gen).to(dtype)
    k = torch.randn(1, 1, sk, d, generator=gen).to(dtype)
    v = torch.randn(1, 1, sk, dv, generator=gen).to(dtype)
    do = torch.randn(1, 2, sq, dv, generator=gen).to(dtype)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), do.to(DEVICE)


@pytest.mark.parametrize("d, dv", [(192, 128), (136, 64), (40, 24)])
def test_split_head_dim_renders_only_for_a_q_dim_that_is_no_power_of_two_beside_its_own_v_dim(d, dv):
    lo = 1 << (d.bit_length() - 1)
    hi = max(16, 1 << (d - lo - 1).bit_length())
    for direction in ("fwd", "bwd"):
        spec = KernelSpec(head_dim=d, head_dim_v=dv, mask="causal", dtype="bf16", direction=direction)
        src = render(spec).files[".py"]
        assert f"D_LO = tl.constexpr({lo})" in src and f"D_HI = tl.constexpr({hi})" in src
        for other in (dict(head_dim=d), dict(head_dim=128, head_dim_v=64), dict(head_dim=64, head_dim_v=128)):
            plain = render(KernelSpec(mask="causal", dtype="bf16", direction=direction, **other)).files[".py"]
            assert "D_LO" not in plain


@pytest.mark.parametrize("d, dv", PAIRS, ids=lambda p: str(p))
@pytest.mark.parametrize("mask, sq, sk", [("causal", 40, 40), ("causal", 24, 40), ("none", 40, 24)])
def test_split_forward_matches_float64(d, dv, mask, sq, sk):
    spec = KernelSpec(head_dim=d, head_dim_v=dv, mask=mask, dtype="bf16", gqa=2, **SMALL)
    q, k, v, _ = _inputs(d, dv, sq, sk, torch.bfloat16)
    out, lse = load(spec).forward(q, k, v)
    ref_out, ref_lse = reference.attention(q.double(), k.double(), v.double(), mask=mask)
    compare("out", out, ref_out, **TOLERANCE[DType.BF16])
    compare("lse", lse, ref_lse, **TOLERANCE[DType.BF16])


def _check_grads(spec, q, k, v, do, mask, dtype, module=None):
    """The spec's module's (or `module`'s) dq, dk, dv against the float64 reference's, at dtype's gradient
    tolerance."""
    module = load(spec) if module is None else module
    out, lse = module.forward(q, k, v)
    grads = module.backward(do, q, k, v, out, lse)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference.attention(*ref_in, mask=mask)
    ref_out.backward(do.double())
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_in):
        unit = max(1.0, want.grad.abs().max().item())
        tol = GRAD_TOLERANCE[dtype]
        compare(name, got, want.grad, atol=tol["atol"] * unit, rtol=tol["rtol"])


@pytest.mark.parametrize("d, dv", PAIRS, ids=lambda p: str(p))
@pytest.mark.parametrize("mask, sq, sk", [("causal", 40, 40), ("none", 24, 40)])
def test_split_backward_matches_float64(d, dv, mask, sq, sk):
    spec = KernelSpec(head_dim=d, head_dim_v=dv, mask=mask, dtype="fp32", gqa=2, direction="bwd", **SMALL)
    q, k, v, do = _inputs(d, dv, sq, sk, torch.float32, seed=1)
    _check_grads(spec, q, k, v, do, mask, DType.FP32)


@pytest.mark.parametrize("mask, gqa, sq, sk", [("causal", 1, 150, 150), ("causal", 2, 70, 150), ("none", 2, 150, 97)])
def test_mla_backward_at_its_own_tiles_matches_float64(mask, gqa, sq, sk):
    # [Note] MLA backward steps: the product's tiles (128 keys per dK/dV program stepping 32 queries, 128 queries per
    # dQ program stepping 64 keys), not SMALL's; lengths that are not multiples of 32, 64 or 128, Sq != Sk, GQA
    spec = KernelSpec(head_dim=192, head_dim_v=128, mask=mask, dtype="bf16", gqa=gqa, direction="bwd")
    src = render(spec).files[".py"]
    assert "DKDV_BLOCK_N = 128 " in src and "DKDV_BLOCK_M = 32 " in src and "DQ_BLOCK_N = 64 " in src
    assert src.count("_NUM_STAGES = 3\n") == 2  # one stage deeper than the spec's 2
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, gqa, sq, 192, generator=gen).bfloat16().to(DEVICE)
    k = torch.randn(1, 1, sk, 192, generator=gen).bfloat16().to(DEVICE)
    v = torch.randn(1, 1, sk, 128, generator=gen).bfloat16().to(DEVICE)
    do = torch.randn(1, gqa, sq, 128, generator=gen).bfloat16().to(DEVICE)
    _check_grads(spec, q, k, v, do, mask, DType.BF16)


@pytest.mark.skipif(not ON_GPU, reason="a property of the tensor cores' sums: the interpreter's numpy dot sums in a "
                                         "shape-dependent order (tests/test_backward.py)")
def test_mla_rows_that_see_one_key_get_exactly_zero_dq_and_dk_at_its_own_tiles():
    # [Note] Exact delta at the MLA's tiles: delta must equal dP from the gradient kernels bitwise, so a row that
    # sees one key (Sk = 1) gets dQ = dK = 0 exactly
    spec = KernelSpec(head_dim=192, head_dim_v=128, mask="none", dtype="bf16", gqa=2, direction="bwd")
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 150, 192, generator=gen).bfloat16().to(DEVICE)
    k = torch.randn(2, 2, 1, 192, generator=gen).bfloat16().to(DEVICE)
    v = torch.randn(2, 2, 1, 128, generator=gen).bfloat16().to(DEVICE)
    do = torch.randn(2, 4, 150, 128, generator=gen).bfloat16().to(DEVICE)
    mod = load(spec)
    out, lse = mod.forward(q, k, v)
    dq, dk, dv = mod.backward(do, q, k, v, out, lse)
    assert dq.abs().max().item() == 0 and dk.abs().max().item() == 0, (dq.abs().max(), dk.abs().max())
    assert dv.abs().max().item() > 0


@pytest.mark.parametrize("programs", [1, 6, 8, 32])
def test_mla_backward_work_order_runs_every_program_once(programs, monkeypatch):
    # [Note] MLA work order: programs taken in groups of (head, batch) pairs, block-major, a group the fewest pairs
    # (a power of two) with GROUP_PROGRAMS blocks or more. 5 batches of 1 KV head (dK/dV: 5 pairs of 3 key blocks)
    # and 2 query heads (dQ: 10 pairs of 2 query blocks): 6 gives groups of 2 and 4, 8 of 4 (partial last groups),
    # 32 one group of every pair. Outputs start as NaN, so a program that never runs (or runs another's block)
    # leaves NaN or a wrong sum
    from fagen.runtime.loader import load_source

    spec = KernelSpec(head_dim=40, head_dim_v=24, mask="causal", dtype="fp32", gqa=2, direction="bwd", **SMALL)
    src = render(spec).files[".py"]
    assert src.count("GROUP_PROGRAMS = tl.constexpr(128)\n") == 1 and src.count("# [Note] MLA work order") == 2
    patched = src.replace("GROUP_PROGRAMS = tl.constexpr(128)", f"GROUP_PROGRAMS = tl.constexpr({programs})")
    module = load_source(patched, f"mla_work_order_{programs}")
    monkeypatch.setattr(module, "_new_out", lambda t: torch.full_like(t, float("nan")))
    gen = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(5, h, s, d, generator=gen).to(DEVICE) for h, s, d in
                   ((2, 20, 40), (1, 33, 40), (1, 33, 24), (2, 20, 24)))
    _check_grads(spec, q, k, v, do, "causal", DType.FP32, module)


def test_mla_defaults_on_sm90_and_elsewhere():
    fwd = KernelSpec(head_dim=192, head_dim_v=128, mask="causal", dtype="bf16")
    bwd = KernelSpec(head_dim=192, head_dim_v=128, mask="causal", dtype="bf16", direction="bwd")
    assert fwd.name == "attn_fwd_causal_d192v128_m128n64w8s3_g1_bf16"  # [Note] MLA prefill tiles: the H100's best
    assert bwd.name == "attn_bwd_causal_d192v128_m128n128w8s2_g1_bf16"  # [Note] MLA backward steps
    assert "m64n32w4s2" in fwd.for_arch("sm_80").name  # sm_80 keeps its fitted wide tile
    # 128/64 and 64/128 take d128's tiles, which fit sm_90 by fagen's estimate
    for d, dv in ((128, 64), (64, 128)):
        for direction in ("fwd", "bwd"):
            spec = KernelSpec(head_dim=d, head_dim_v=dv, mask="causal", dtype="bf16", direction=direction)
            assert "m128n128w8s3" in spec.name and backends.smem_bytes(spec) <= 227 * 1024


# -- the Gluon forward ---------------------------------------------------------------------------------------------
def test_gluon_takes_mla_192_128_with_its_own_default_tile():
    spec = KernelSpec(backend="gluon", head_dim=192, head_dim_v=128, mask="causal", dtype="bf16")
    assert spec.name == "attn_fwd_causal_d192v128_m128n128w8s2_g1_bf16_gluon"  # the lean n128 s2 (H100's best)
    n64 = KernelSpec(backend="gluon", head_dim=192, head_dim_v=128, mask="causal", dtype="bf16", block_n=64)
    # Q 2 x 2 x 64 x 192, K 2 x 64 x 192, V 2 x 64 x 128, O 2 x 64 x 128, bf16, + 1 KB
    assert backends.smem_bytes(n64) == 2 * (4 * 64 * 192 + 2 * 64 * 192 + 2 * 64 * 128 + 2 * 64 * 128) + 1024
    # selected where the H100 run timed it faster than the Triton forward: causal bf16 ([Note] Gluon selection rule)
    assert backends.GLUON.selected(spec)
    assert not backends.GLUON.selected(KernelSpec(backend="gluon", head_dim=192, head_dim_v=128, mask="none",
                                                  dtype="bf16"))
    assert not backends.GLUON.selected(KernelSpec(backend="gluon", head_dim=192, head_dim_v=128, mask="causal",
                                                  dtype="fp16"))
    # lean (a deeper K/V ring): one Q buffer per warpgroup and no O buffer
    lean = KernelSpec(backend="gluon", head_dim=192, head_dim_v=128, mask="causal", dtype="bf16", block_n=128)
    assert backends.smem_bytes(lean) == 2 * (2 * 64 * 192 + 2 * 128 * 192 + 2 * 128 * 128) + 1024


@pytest.mark.parametrize("fields, field, fragment", [
    (dict(head_dim=192), "head_dim_v", "head_dim_v 128 only"),
    (dict(head_dim=128, head_dim_v=64), "head_dim_v", "use backend 'triton'"),
    (dict(head_dim=192, head_dim_v=64), "head_dim_v", "use backend 'triton'"),
    (dict(head_dim=192, head_dim_v=128, dtype="fp8_e4m3"), "head_dim", "fp8 forward supports head_dim 64 or 128"),
    (dict(head_dim=192, head_dim_v=128, block_n=128, num_stages=3), "num_stages", "shared memory"),
    (dict(head_dim=192, head_dim_v=128, direction="bwd"), "head_dim", "the gluon backward supports head_dim 64 and 128"),
])
def test_gluon_mla_limits_name_the_field(fields, field, fragment):
    with pytest.raises(SpecError) as info:
        KernelSpec(**{"backend": "gluon", "mask": "causal", "dtype": "bf16", **fields})
    assert info.value.field == field and fragment in str(info.value), str(info.value)


_GLUON_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import fagen
from fagen.spec.kernel import KernelSpec
from sm90 import ptxas

out = {}
for key, fields in json.loads(sys.argv[2]).items():
    mod = fagen.load(KernelSpec(backend="gluon", **fields))
    ck = mod.compile_for()
    res = ptxas(ck.asm["ptx"])[0]["_attn_fwd_hopper"]
    out[key] = dict(shared=ck.metadata.shared, spills=res.spill_stores + res.spill_loads, stack=res.stack,
                    wgmma=ck.asm["ptx"].count("wgmma.mma_async"), tma=ck.asm["ptx"].count("cp.async.bulk.tensor"))
print("RESULT " + json.dumps(out))
"""


def test_gluon_mla_builds_for_sm90_within_its_formula_without_spills(tmp_path_factory):
    from test_hopper_compile import build_sm90

    fields = dict(head_dim=192, head_dim_v=128, mask="causal", dtype="bf16")
    modules = {"mla": dict(fields, block_n=64), "lean_n128": dict(fields, block_n=128),
               "lean_s3": dict(fields, block_n=64, num_stages=3)}
    built = build_sm90(tmp_path_factory, _GLUON_SCRIPT, modules, "gluon-mla")
    for key, r in built.items():
        formula = backends.smem_bytes(KernelSpec(backend="gluon", **modules[key]))
        assert formula - 1024 <= r["shared"] <= formula <= 227 * 1024, (key, r)
        # ptxas counts bytes: the paired tile order's index arithmetic ([Note] Tile schedule) spills a few words of
        # the lean tiles (n128 s2: 28 stored, 84 loaded, 24 of stack; n64 s3: 24 / 48 / 24); n64 s2 none
        allowed = {"mla": (0, 0), "lean_n128": (112, 24), "lean_s3": (72, 24)}[key]
        assert r["spills"] <= allowed[0] and r["stack"] <= allowed[1], (key, r)
    r = built["mla"]
    # S in 3 chained K = 64 parts (4 wgmma each) and P V (4 at block_n 64), in the prologue, two step loops and
    # the epilogue of 2 warpgroups: the same count as one K = 192 S
    assert r["wgmma"] >= 2 * (12 + 2 * (12 + 4) + 4), r
    assert r["tma"] >= 3 + 3 + 1 + 1, r  # Q and K in 3 chunks each, V, the O store


def _tile_order(mod, progs, name="_paired_tile"):
    """A rendered tile-order function as plain Python over ints, with `progs` programs ([Note] Tile schedule)."""
    import types

    fn = getattr(mod, name).fn
    fake_gl = types.SimpleNamespace(num_programs=lambda axis: progs, maximum=max, minimum=min)
    return types.FunctionType(fn.__code__, {**fn.__globals__, "gl": fake_gl})


def test_gluon_mla_paired_tile_order_deals_every_tile_once_in_balanced_pairs():
    """The persistent loop's tile t of program p is t = p + i * progs; _paired_tile maps it to (batch * heads + head,
    query block). Every tile exactly once, at any grid and count, and (the point of it) at the bench's shape each
    program's work, in key blocks, within 4% of the mean where heavy-first by batch (the order before) was 15% over."""
    mod = load(KernelSpec(backend="gluon", head_dim=192, head_dim_v=128, mask="causal", dtype="bf16"))
    assert "_SCHED = 1" in open(mod.__file__).read()  # paired: the default since the H100 run (664 vs 541 TF/s)
    for progs in (1, 3, 7, 132):
        order = _tile_order(mod, progs)
        for n_bh in (1, 2, 5, 64):
            for n_m in (1, 2, 3, 5, 32, 33):
                got = sorted(order(t, n_bh * n_m, n_m) for t in range(n_bh * n_m))
                assert got == [(bh, m) for bh in range(n_bh) for m in range(n_m)], (progs, n_bh, n_m)
    order, progs, n_bh, n_m = _tile_order(mod, 132), 132, 64, 32  # b4 h16 s4096 on an H100's 132 SMs
    work = [sum(order(t, n_bh * n_m, n_m)[1] + 1 for t in range(p, n_bh * n_m, progs)) for p in range(progs)]
    assert max(work) <= 1.04 * sum(work) / progs, max(work) / (sum(work) / progs)


@pytest.mark.parametrize("gqa", [1, 2])
def test_gluon_mla_section_tile_order_deals_every_tile_once_heavy_first_within_l2_sections(gqa):
    """_SCHED 3's order (the tile counter hands out t = 0, 1, ...): every tile once, heavy first within a section of
    heads whose K and V fit 32 MB (8 KV heads at Sk 4096: 8 x 4096 x 320 x 2 bytes = 21 MB), times gqa."""
    mod = load(KernelSpec(backend="gluon", head_dim=192, head_dim_v=128, mask="causal", dtype="bf16", gqa=gqa))
    order = _tile_order(mod, 132, "_section_tile")
    for seq_k in (1, 4096, 1 << 20):
        for n_bh in (1, 3, 16, 64 + 6):
            for n_m in (1, 2, 5, 32):
                got = [order(t, n_bh * n_m, n_m, seq_k) for t in range(n_bh * n_m)]
                assert sorted(got) == [(bh, m) for bh in range(n_bh) for m in range(n_m)], (seq_k, n_bh, n_m)
    got = [order(t, 64 * 32, 32, 4096) for t in range(64 * 32)]
    assert got[:8 * gqa] == [(bh, 31) for bh in range(8 * gqa)] and got[8 * gqa] == (0, 30), got[:8 * gqa + 1]


def test_gluon_tile_schedule_renders_with_its_counter_where_the_backend_rule_says(monkeypatch):
    """The template's `paired` and GluonBackend.tile_schedule (which gives the kernel its TileCounter) agree: MLA
    causal always, other causal specs without the window where the product has an order (causal_order); every other
    spec without mods (mask none, fp8, the window) only under the measurement variant."""
    from fagen.codegen import render as render_mod

    def rendered(**fields):
        src = render(KernelSpec(backend="gluon", dtype=fields.pop("dtype", "bf16"), **fields)).files[".py"]
        signature = src[src.index("def _attn_fwd_hopper("):].split("):", 1)[0]
        return "_SCHED = " in src, "TileCounter" in signature

    cases = [(dict(head_dim=192, head_dim_v=128, mask="causal"), True, True),
             (dict(head_dim=192, head_dim_v=128, mask="none"), False, True),
             (dict(head_dim=128, mask="causal"), True, True),  # [Note] Gluon tile order: causal_order
             (dict(head_dim=128, mask="causal", dtype="fp8_e4m3"), True, True),
             (dict(head_dim=128, mask="none"), False, True),
             (dict(head_dim=64, mask="causal", window=True, softcap=True), False, True)]
    for flag in (False, True):
        monkeypatch.setitem(backends.GLUON.variant, "tile_schedule_all", flag)
        render_mod.render.cache_clear()
        for fields, plain, with_flag in cases:
            want = with_flag if flag else plain
            assert backends.GLUON.tile_schedule(KernelSpec(backend="gluon", **{"dtype": "bf16", **fields})) == want
            assert rendered(**fields) == (want, want), (flag, fields)
    render_mod.render.cache_clear()


def test_triton_mla_defaults_build_for_sm90_with_the_spills_claimed(tmp_path):
    from fagen.aot.build import build

    specs = [KernelSpec(head_dim=192, head_dim_v=128, mask="causal", dtype="bf16", direction=d) for d in ("fwd", "bwd")]
    report = build(specs, ["sm_90"], tmp_path, jobs=1, keep_going=True, manifest=False)
    assert not report.failures, report.failures
    kernels = {(r["name"], k["name"]): k for r in report.records for k in r["kernels"]}
    assert len(kernels) == 1 + 4, kernels  # the forward's kernel; the bwd module's forward, preprocess, dK/dV, dQ
    # [Note] MLA backward steps: no spills in any loop (the dK/dV kernel spilled 10 words at m128n64w8s3 with 64-wide
    # steps, 24 before the split head dim). [Note] MLA work order: the dK/dV kernel's work item (block, head, batch)
    # is computed, not read from the block index registers, and ptxas keeps 4 words of it in local memory, stored
    # before the query loops and reloaded between them (sm_90 SASS: 4 STL, 5 LDL, the loop bodies as before)
    claimed = {"_attn_bwd_dkdv": 4}
    for (variant, name), k in kernels.items():
        assert k["shared"] <= 227 * 1024, (variant, name, k)
        assert k["spills"] <= claimed.get(name, 0), (variant, name, k)


def test_hopper_selection_keeps_head_dim_v_and_follows_select_mla(monkeypatch):
    from fagen.runtime import hopper

    monkeypatch.setattr(hopper, "is_hopper", lambda device: True)
    monkeypatch.setattr(hopper, "gluon_missing", lambda: None)
    monkeypatch.delenv(hopper.ENV, raising=False)
    spec = KernelSpec(head_dim=192, head_dim_v=128, mask="causal", dtype="bf16", gqa=2, direction="bwd")
    monkeypatch.setattr(backends.GLUON, "select_mla", False)
    assert hopper.forward_spec(spec, "cuda") is None
    monkeypatch.setattr(backends.GLUON, "select_mla", True)
    twin = hopper.forward_spec(spec, "cuda")
    assert twin.backend.value == "gluon" and (twin.head_dim, twin.head_dim_v, twin.gqa) == (192, 128, 2)
    none = KernelSpec(head_dim=192, head_dim_v=128, mask="none", dtype="bf16")
    assert hopper.forward_spec(none, "cuda") is None  # not timed: the Triton forward keeps it
    # other V widths and the plain d128 rule are unchanged
    assert hopper.forward_spec(KernelSpec(head_dim=128, head_dim_v=64, mask="causal", dtype="bf16"), "cuda") is None
    assert hopper.forward_spec(KernelSpec(head_dim=128, mask="none", dtype="bf16"), "cuda").head_dim_v == 128


def test_fagen_attention_routes_forward_only_mla_causal_to_gluon(monkeypatch):
    """resolve() gives the gluon module for a forward-only causal 192/128 call on sm_90 (pretended), the Triton bwd
    module with gradients, and the Triton one for mask none."""
    from fagen.runtime import api, hopper, resolve

    monkeypatch.setattr(hopper, "is_hopper", lambda device: True)
    monkeypatch.setattr(hopper, "gluon_missing", lambda: None)
    monkeypatch.delenv(hopper.ENV, raising=False)
    monkeypatch.setattr(resolve, "_FAST", {})
    monkeypatch.setattr(api, "_FAST", resolve._FAST)
    q = torch.zeros(1, 2, 8, 192, dtype=torch.bfloat16)
    k, v = torch.zeros(1, 2, 8, 192, dtype=torch.bfloat16), torch.zeros(1, 2, 8, 128, dtype=torch.bfloat16)
    fwd = resolve.resolve(q, k, v, "causal", False, forward_only=True)
    assert fwd.NAME == "attn_fwd_causal_d192v128_m128n128w8s2_g1_bf16_gluon"
    assert resolve.resolve(q, k, v, "causal", False).NAME == "attn_bwd_causal_d192v128_m128n128w8s2_g1_bf16"
    assert not resolve.resolve(q, k, v, "none", False, forward_only=True).NAME.endswith("_gluon")
