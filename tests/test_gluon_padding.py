"""Padding masks in the Gluon forward ([Note] Gluon padding masks in fagen/templates/gluon/attention.py.j2; twenty-
second session): the render carries the padding code only where the mask is on, the spec limits, and the sm_90
builds (bf16 and fp8, d128 and d64) without spills. The kernels run in scripts/gpu_gluonpad_s22.py (float64 checks,
NaN in the padding, compute-sanitizer): Gluon kernels do not run in the interpreter."""

import dataclasses

import pytest

from fagen import backends
from fagen.codegen.render import render
from fagen.errors import SpecError
from fagen.spec.kernel import KernelSpec
from test_hopper_compile import build_sm90

PAD_MARKS = ("SeqlensQ", "SeqlensK", "_lengths(", "rows_q", "[Note] Gluon padding masks")


def gluon(**fields) -> KernelSpec:
    return KernelSpec(backend="gluon", **{"head_dim": 128, "dtype": "bf16", **fields})


@pytest.mark.parametrize("fields", [dict(mask="none"), dict(mask="causal"), dict(mask="causal", gqa=4),
                                    dict(mask="none", dtype="fp8_e4m3"), dict(mask="causal", dtype="fp8_e4m3"),
                                    dict(mask="causal", window=True), dict(mask="causal", direction="bwd"),
                                    dict(mask="causal", head_dim=192, head_dim_v=128)])
def test_renders_without_padding_carry_none_of_its_code(fields):
    """The none/causal renders stay the plain kernel's (byte for byte the twenty-first session's: 44 renders compared
    with main's when the masks came in, docs/hopper.md): no lengths, no rebinding, no V zeroing."""
    src = render(gluon(**fields)).source
    assert not [m for m in PAD_MARKS + ("_zero_pad_keys",) if m in src]


@pytest.mark.parametrize("mask", ["padding", "causal+padding"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp8_e4m3"])
def test_padding_renders_thread_the_lengths_and_keep_padding_out_of_p_v(mask, dtype):
    src = render(gluon(mask=mask, dtype=dtype)).source
    assert all(m in src for m in PAD_MARKS), [m for m in PAD_MARKS if m not in src]
    assert "seqlens_q, seqlens_k," in src  # the launch passes the lengths (the host args of GLUON_FWD)
    assert ("CAUSAL = 1" in src) == (mask == "causal+padding")
    # bf16/fp16: the epilogue's V slot zeroing; fp8: Vt written with zeros past each sequence's length
    assert ("_zero_pad_keys(v_smem.index(sp)" in src) == (dtype != "fp8_e4m3")
    assert ("len_k = tl.minimum(tl.maximum(tl.load(SeqlensK + off_b), 0), seq_k)" in src) == (dtype == "fp8_e4m3")


def test_the_padding_levers_are_on():
    """pad_empty 1 and pad_order 2 are the product's since the twenty-second session (the lead's flip after round B:
    "eo" 1.089x the Gluon padding forward per pass on the suite row, 486 TF/s; docs/hopper.md)."""
    assert backends.GLUON.variant["pad_empty"] == 1 and backends.GLUON.variant["pad_order"] == 2


def test_pad_empty_renders_only_where_set(monkeypatch):
    """GluonBackend.variant pad_empty ([Note] Gluon padding masks): off, the padding render has no Q counter of its
    own; on, the padding render has it and the plain render is unchanged."""
    spec = gluon(mask="causal+padding")
    monkeypatch.setitem(backends.GLUON.variant, "pad_empty", 0)
    assert "o_zero = " not in render(spec).source and "tq = 0" not in render(spec).source
    plain = render(gluon(mask="causal")).source
    monkeypatch.setitem(backends.GLUON.variant, "pad_empty", 1)
    src = render(spec).source
    assert "o_zero = (hi <= 0).to(gl.int32)" in src and "_load_q(q_desc, q_smem, q_ready, q_empty, tq," in src
    assert render(gluon(mask="causal")).source == plain


def test_pad_order_deals_padding_tiles_through_the_counter_only_where_set(monkeypatch):
    """GluonBackend.variant pad_order 2: a padding render takes the tile counter (_SCHED 2) and its launch the counter
    argument (GluonBackend.tile_order, the template's rule); 0: the plain loop, no counter."""
    spec = gluon(mask="causal+padding")
    monkeypatch.setitem(backends.GLUON.variant, "pad_order", 0)
    assert backends.GLUON.tile_order(spec) is None and "_SCHED = " not in render(spec).source
    plain = render(gluon(mask="causal")).source
    monkeypatch.setitem(backends.GLUON.variant, "pad_order", 2)
    for mask in ("padding", "causal+padding"):
        src = render(gluon(mask=mask)).source
        assert backends.GLUON.tile_order(gluon(mask=mask)) == 2 and "_SCHED = 2" in src
        assert "seqlens_q, seqlens_k, tile_counter," in src and "num_tiles, rows_k" in src
    assert render(gluon(mask="causal")).source == plain and backends.GLUON.tile_order(gluon(mask="none")) is None


@pytest.mark.parametrize("fields,words", [
    (dict(mask="padding", direction="bwd"), "plain forward's"),
    (dict(mask="causal+padding", window=True), "plain forward's"),
    (dict(mask="padding", softcap=True), "plain forward's"),
    (dict(mask="causal+padding", head_dim=192, head_dim_v=128), "plain forward's"),
    (dict(mask="causal+padding", dtype="fp8_e4m3", window=True), "plain forward's"),
    (dict(mask="tree"), "tree masks"),
    (dict(mask="tree", dtype="fp8_e4m3"), "'padding' and 'causal+padding'"),
])
def test_padding_limits_are_spec_errors_naming_the_mask(fields, words):
    with pytest.raises(SpecError) as e:
        gluon(**fields)
    assert e.value.field == "mask" and words in str(e.value), str(e.value)


@pytest.mark.parametrize("fields,picked", [
    (dict(mask="causal+padding"), True), (dict(mask="padding", gqa=4), True),
    (dict(mask="causal+padding", head_dim=64), False), (dict(mask="padding", dtype="fp16"), False),
    (dict(mask="causal+padding", dtype="fp8_e4m3"), True), (dict(mask="padding", dtype="fp8_e4m3", head_dim=64), True),
])
def test_the_rule_picks_the_padding_masks_where_measured(fields, picked):
    """[Note] Gluon selection rule: bf16 d128 padding masks (any gqa) since the twenty-second session's H200 rounds
    (the suite's row 1.22x the Triton forward per pass, the padding twin 1.13x); fp8 has no other kernel."""
    assert backends.GLUON.selected(gluon(**fields)) == picked


def test_the_suite_row_takes_the_gluon_forward_on_hopper(monkeypatch):
    from fagen.bench.workloads import standard_suite
    from fagen.runtime import hopper
    monkeypatch.delenv(hopper.ENV, raising=False)
    monkeypatch.setattr(hopper, "is_hopper", lambda device: True)
    monkeypatch.setattr(hopper, "gluon_missing", lambda: None)
    row = {c.name: c for c in standard_suite()}["fwd-causalpad-d128-s8k"]
    spec, note = row.spec("cuda")
    assert spec.backend.value == "gluon" and spec.mask.value == "causal+padding", (spec.name, note)
    assert not backends.GLUON.bwd_selected(dataclasses.replace(spec, direction="bwd", backend="triton"))


_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import fagen
from fagen.spec.kernel import KernelSpec
from sm90 import ptxas

out = {}
for key, fields in json.loads(sys.argv[2]).items():
    mod = fagen.load(KernelSpec(backend="gluon", **fields))
    ptx = mod.compile_for().asm["ptx"]
    res = ptxas(ptx)[0]["_attn_fwd_hopper"]
    # the epilogue's V zeroing: a proxy fence right before a barrier of the warpgroup's 128 threads (the next
    # instruction, .loc lines and labels aside), once per consumer warpgroup
    # (pad_empty's render puts the barrier behind an unconditional branch and two predicate setups: followed)
    lines = [x.strip() for x in ptx.splitlines()]
    lines = [x for x in lines if x and not x.startswith(("//", ".loc"))]
    ins, at = [], {}
    for x in lines:
        label = re.match(r"(\$L\w+):", x)
        if label:
            at[label.group(1)] = len(ins)
        elif not x.startswith("$L"):
            ins.append(x)

    def after(i):  # the next instruction, through unconditional branches and over predicate setups
        j = i + 1
        for _ in range(8):
            m = re.match(r"bra\.uni\s+(\$L\w+);", ins[j])
            if m and at.get(m.group(1), len(ins)) < len(ins):
                j = at[m.group(1)]
            elif ins[j].startswith("setp."):
                j += 1
            else:
                break
        return ins[j]
    fenced = sum(a.startswith("fence.proxy.async") and after(i).startswith("bar.sync") and after(i).endswith(", 128;")
                 for i, a in enumerate(ins[:-1]))
    out[key] = dict(spills=res.spill_stores + res.spill_loads, stack=res.stack, fenced=fenced,
                    transpose=bool(mod.compile_transpose_for()) if fields["dtype"] == "fp8_e4m3" else None)
print("RESULT " + json.dumps(out))
"""
BUILDS = {f"{mask} {dtype} d{d}": dict(mask=mask, dtype=dtype, head_dim=d)
          for mask in ("padding", "causal+padding") for dtype in ("bf16", "fp8_e4m3") for d in (128, 64)}
BUILDS["causal bf16 d128"] = dict(mask="causal", dtype="bf16", head_dim=128)  # the plain kernel's fences (the O store)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, BUILDS, "gluon-padding-sm90")


@pytest.mark.parametrize("key", [k for k in BUILDS if "padding" in k])
def test_padding_builds_for_sm90_without_spills(built, key):
    r = built[key]
    assert r["spills"] == 0 and r["stack"] == 0, r
    if BUILDS[key]["dtype"] == "fp8_e4m3":
        assert r["transpose"], r  # transpose_v with the lengths builds too
    else:  # the V zeroing's fence, then the barrier of the warpgroup's 128 threads: one more per warpgroup
        assert r["fenced"] == built["causal bf16 d128"]["fenced"] + 2, (r, built["causal bf16 d128"])
