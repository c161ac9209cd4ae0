"""The fp8 forward's row max as a tree, fifteenth session (issue 28): GluonBackend.variant fp8_max_tree ([Note] fp8
row max as a tree in fagen/templates/gluon/attention.py.j2; 2: the row sum too). The render (only where on: fp8 d128 block_n 128 with two
warpgroups, not the 192-key steps; bf16 unchanged), and the sm_90 build on the CPU: no spills, the product's shared
memory, the same 68 max.f32 a step loop, and the longest chain of dependent max.f32 in each step loop a tree's (<= 8:
5 levels, 2 shuffle rounds, the running max) where the product's is triton's chain (> 30). The kernels against
float64 and bit for bit against the product (and a mutant that must go red) run in scripts/gpu_fp8fwd_s15.py."""

import re

import pytest

import fagen
from fagen.spec.kernel import KernelSpec
from test_fp8_wgs import variant
from test_hopper_compile import build_sm90


def render(mask="causal", dtype="fp8_e4m3", head_dim=128, **fields):
    return fagen.generate(KernelSpec(backend="gluon", head_dim=head_dim, mask=mask, dtype=dtype, **fields))


def test_renders_only_where_on():
    with variant(fp8_max_tree=0):
        before, bf16, n192 = render(), render(dtype="bf16"), render(mask="none")
    assert "_row_tree" not in before
    with variant(fp8_max_tree=1):
        src = render()
        assert render(dtype="bf16") == bf16
        assert "_row_tree(s_acc, False)" in render(window=True)
        assert "_row_tree" not in render(mask="none", head_dim=64)  # d64: three warpgroups
    step = src[src.index("def _softmax("):src.index("\n\n\n", src.index("def _softmax("))]
    assert step.count("_row_tree(s_acc, False)") == 2 and "gl.max(s_acc, 1)" not in step  # both branches
    assert "gl.sum(p, 1)" in step and "_row_tree(p, True)" not in step
    with variant(fp8_max_tree=2):  # the row sum too
        step = render()
    step = step[step.index("def _softmax("):step.index("\n\n\n", step.index("def _softmax("))]
    assert step.count("_row_tree(s_acc, False)") == 2 and "l_i = l_i * alpha + _row_tree(p, True)" in step
    with variant(fp8_max_tree=1, fp8_n192=1):
        assert "_row_tree" not in render(mask="none")
    with variant(fp8_n192=1):
        assert "_row_tree" not in render(mask="none")
    assert "_row_tree" not in n192


_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import fagen
from fagen import backends
from fagen.spec.kernel import KernelSpec
from fagen.codegen import render
from fagen.runtime.loader import load_source
from sm90 import loops, ptxas


def depth(body, op="max"):
    # the longest chain of dependent op.f32 (through shuffles: a shfl's output takes its input's depth)
    d = {}
    for line in body.splitlines():
        m = re.match(r"\s*" + op + r"\.f32\s+(%r\d+),\s*(%r\d+|\S+),\s*(%r\d+|\S+);", line)
        if m:
            d[m.group(1)] = 1 + max(d.get(m.group(2), 0), d.get(m.group(3), 0))
            continue
        m = re.match(r"\s*shfl\.sync\.\w+\.b32\s+(%r\d+),\s*(%r\d+),", line)
        if m and m.group(2) in d:
            d[m.group(1)] = d[m.group(2)]
    return max(d.values(), default=0)


out = {}
for key, fields in json.loads(sys.argv[2]).items():
    fields = dict(fields)
    backends.GLUON.variant["fp8_max_tree"] = fields.pop("tree", 0)
    spec = KernelSpec(backend="gluon", **{"head_dim": 128, "dtype": "fp8_e4m3", **fields})
    render.render.cache_clear()
    mod = load_source(fagen.generate(spec), spec.name + "_" + key)
    ck = mod.compile_for()
    ptx = ck.asm["ptx"]
    res = ptxas(ptx)[0]["_attn_fwd_hopper"]
    bodies = loops(ptx, min_wgmma=2, innermost=True)
    out[key] = dict(spills=res.spill_stores + res.spill_loads, stack=res.stack, shared=ck.metadata.shared,
                    max=[body.count("max.f32") for body in bodies], depth=[depth(body) for body in bodies],
                    add_depth=[depth(body, "add") for body in bodies],
                    bar=[body.count("bar.sync") for body in bodies], sts=[body.count("st.shared") for body in bodies])
print("RESULT " + json.dumps(out))
"""
MODULES = {"product": dict(mask="none"), "tree": dict(mask="none", tree=1), "tree_causal": dict(mask="causal", tree=1),
           "tree2": dict(mask="none", tree=2)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, MODULES, "fp8-max-tree-sm90")


@pytest.mark.parametrize("key", list(MODULES))
def test_builds_without_spills(built, key):
    r = built[key]
    assert r["spills"] == 0 and r["stack"] == 0 and len(r["max"]) == 4, r  # two step loops a consumer warpgroup


@pytest.mark.parametrize("key", ["tree", "tree2"])
def test_the_tree_moves_no_data_and_keeps_the_max_count(built, key):
    base, tree = built["product"], built[key]
    assert tree["shared"] == base["shared"], (base, tree)
    assert tree["max"] == base["max"] and tree["bar"] == base["bar"] and tree["sts"] == base["sts"], (base, tree)


def test_the_row_max_is_a_tree(built):
    """The product's row max is a chain (31 max.f32 a row, then the shuffles); the tree's is 5 levels deep."""
    assert min(built["product"]["depth"]) > 30, built["product"]
    for key in ("tree", "tree_causal", "tree2"):
        assert max(built[key]["depth"]) <= 8, built[key]


def test_the_row_sum_is_a_tree_at_2(built):
    """fp8_max_tree 2: the row sum's adds too (the product's: a chain of 31 a row, then the shuffles)."""
    assert min(built["product"]["add_depth"]) > 30 and min(built["tree"]["add_depth"]) > 30, built["tree"]
    assert max(built["tree2"]["add_depth"]) <= 9, built["tree2"]


def test_depth_reads_a_chain():
    ns = {}
    exec(_SCRIPT[_SCRIPT.index("def depth("):_SCRIPT.index("\n\n\nout = {}")], {"re": re}, ns)
    body = "\n".join(f"    max.f32 %r{i + 1}, %r{i}, %r{100 + i};" for i in range(1, 9))
    assert ns["depth"](body) == 8
    assert ns["depth"]("    max.f32 %r3, %r1, %r2;\n    max.f32 %r6, %r4, %r5;\n    max.f32 %r7, %r3, %r6;") == 2
