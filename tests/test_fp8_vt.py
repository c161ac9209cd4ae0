"""The fp8 forward's in-kernel V transpose (GluonBackend.variant fp8_vt 1, [Note] fp8 V in-kernel in
fagen/templates/gluon/attention.py.j2; twelfth session): the producer partition, 4 warps, transposes V's rows into the
Vt slots in shared memory instead of the host's transpose_v pass. The render (what reads the switch, the host's V
descriptor), the host's rule and shared memory, and the sm_90 build on the CPU: no spills, the producer at 32
registers, Vt written by stmatrix with no 16-bit or byte stores. The kernel against float64, and bit for bit against
the product, runs in scripts/gpu_fp8fwd_s12.py on an H100 (with a mutant that leaves Vt's keys in order, which must
fail there)."""

import pytest

import fagen
from fagen import backends
from fagen.spec import targets
from fagen.spec.kernel import KernelSpec
from test_fp8_wgs import full_128, variant
from test_hopper_compile import build_sm90


@pytest.fixture(autouse=True)
def _full_128():  # the 128-key full-mask loop ([Note] fp8 full-mask 192-key steps: FP8_FULL_N192 off here)
    yield from full_128()


def render(mask="causal", dtype="fp8_e4m3", head_dim=128, **fields):
    return fagen.generate(KernelSpec(backend="gluon", head_dim=head_dim, mask=mask, dtype=dtype, **fields))


def test_vt_in_kernel_renders_only_under_its_switch():
    """The switch changes the d128 fp8 render on two warpgroups only: a 4-warp producer at 32 registers with
    _vt_put, V's rows passed to the kernel (its descriptor K's: box [BLOCK_N, HEAD_DIM]) instead of transpose_v's Vt;
    d64 (three warpgroups), the 192-key steps, block_n 64 and bf16 render as without it."""
    with variant(fp8_vt=0):
        before = {m: render(m) for m in ("causal", "none")}
        others = [render(head_dim=64), render(block_n=64), render(dtype="bf16")]
        with variant(fp8_n192=1):
            n192 = render()
    assert all("def _vt_put(" not in s and "vt = transpose_v(v)" in s for s in before.values())
    with variant(fp8_vt=1):
        for mask in ("causal", "none"):
            src = render(mask)
            assert "def _vt_put(" in src and "LOADER_REGS = 32\n" in src and "[4, 4], [CONSUMER_REGS, LOADER_REGS]" in src
            assert "vt = v if _tma_ready(v) else v.contiguous()" in src and "vt = transpose_v(v)" not in src
            assert src.count("_descriptor(vt, BLOCK_N)") == 2 and "_descriptor(vt, HEAD_DIM, BLOCK_N)" not in src
            assert src.count("_vt_put(n - 1,") == 2  # after the next block's loads, and at the tile's end
        assert render(window=True, gqa=4).count("_vt_put(n - 1,") == 2
        step = src[src.index("def _consumer_step("):]
        assert step.index("mbarrier.wait(v_ready") < step.index("s_tok = warpgroup_mma(")
    with variant(fp8_vt=2):  # a step's S issued before its wait for Vt
        step = render()[render().index("def _consumer_step("):]
        assert step.index("s_tok = warpgroup_mma(") < step.index("mbarrier.wait(v_ready") < step.index("o_tok =")
    with variant(fp8_vt=1):
        assert [render(head_dim=64), render(block_n=64), render(dtype="bf16")] == others
        with variant(fp8_n192=1):
            assert render() == n192


def test_vt_rule_is_the_templates_and_counts_its_shared_memory():
    """GluonBackend.fp8_vt (the host's rule, the V descriptor in fagen/codegen/args.py and smem_bytes by it) agrees
    with the template's vt_in; the two row buffers add 32 KB, within sm_90's shared memory at the default 4 stages."""
    g = backends.GLUON
    cases = [dict(mask=m, head_dim=d, window=w, block_n=bn, gqa=q) for m in ("causal", "none") for d in (64, 128)
             for w in (False, True) for bn in (64, 128) for q in (1, 4)]
    for on in (0, 1):
        for n192 in (0, 1):
            with variant(fp8_vt=on, fp8_n192=n192):
                for c in cases:
                    spec = KernelSpec(backend="gluon", dtype="fp8_e4m3", **c)
                    src = render(**c)
                    assert g.fp8_vt(spec) == ("def _vt_put(" in src) == ("_descriptor(vt, BLOCK_N)" in src), (on, c)
                    if g.fp8_vt(spec):
                        with variant(fp8_vt=0):
                            base = g.smem_bytes(spec)
                        assert base + 2 * 128 * 128 == g.smem_bytes(spec) <= targets.ARCH_SMEM_LIMIT["sm_90"], c


_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import fagen
from fagen import backends
backends.gluon.FP8_FULL_N192 = False  # the 128-key full-mask loop ([Note] fp8 full-mask 192-key steps)
backends.gluon.FP8_N256.clear()  # and not the 256-key steps ([Note] fp8 256-key steps)
from fagen.spec.kernel import KernelSpec
from fagen.codegen import render
from fagen.runtime.loader import load_source
from sm90 import ptxas

backends.GLUON.variant["fp8_vt"] = 1
out = {}
for key, fields in json.loads(sys.argv[2]).items():
    spec = KernelSpec(backend="gluon", **{"head_dim": 128, "dtype": "fp8_e4m3", **fields})
    render.render.cache_clear()
    src = fagen.generate(spec)
    if os.environ.get("FAGEN_TEST_VT_MUTANT"):  # a thread's four keys consecutive: no longer four contiguous P columns
        src = src.replace("reg_bases=[[1, 0], [8, 0],", "reg_bases=[[1, 0], [2, 0],").replace(
            "lane_bases=[[2, 0], [4, 0],", "lane_bases=[[8, 0], [4, 0],")
    mod = load_source(src, spec.name + "_" + key)
    ck = mod.compile_for()
    ptx = ck.asm["ptx"]
    res = ptxas(ptx)[0]["_attn_fwd_hopper"]
    out[key] = dict(spills=res.spill_stores + res.spill_loads, stack=res.stack, shared=ck.metadata.shared,
                    stmatrix=len(re.findall(r"^\s*stmatrix\.", ptx, flags=re.M)),
                    narrow=len(re.findall(r"^\s*st\.shared\.(?:v\d\.)?[bu](?:8|16)\s", ptx, flags=re.M)),
                    maxnreg=sorted(set(int(x) for x in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", ptx))),
                    shfl=ptx.count("shfl.sync"))
print("RESULT " + json.dumps(out))
"""
MODULES = {"full": dict(mask="none"), "causal": dict(mask="causal")}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, MODULES, "fp8-vt-sm90")


@pytest.mark.parametrize("key", ["full", "causal"])
def test_vt_in_kernel_builds_and_stores_vt_by_stmatrix(built, key):
    """ptxas (sm_90): no spill (the producer's warps at 32 registers beside consumers at 240 / 232), the
    Vt writes as stmatrix (4 per 32 keys, two copies of _vt_put) and never as 16-bit or byte stores (a thread's
    keys 4j..4j+3 instead of bits 0 and 3 of the key: 128 st.shared.b16 in the build), no shuffle beyond the product's,
    the 32 KB of row buffers within sm_90's shared memory (beside the product's 2-slot K/V ring since 84e83fe)."""
    r = built[key]
    assert r["stmatrix"] >= 8 and r["narrow"] == 0, r
    assert r["spills"] == 0 and r["stack"] == 0, r
    assert 32 in r["maxnreg"], r
    assert r["shfl"] <= 36 * 2, r
    assert 164000 < r["shared"] <= 166000, r  # the 2-slot ring (84e83fe) plus the 32 KB of row buffers: 164.3-164.4 KB
