"""The fp8 forward's S a step ahead, fourteenth session (issue 28): GluonBackend.variant fp8_s_ahead ([Note] fp8 S a
step ahead in fagen/templates/gluon/attention.py.j2) issues S_{n+1} inside step n and waits for it at the step's end.
The render (only where on, fp8 d128 without the window; bf16 unchanged; where the issue sits), and the sm_90 build on
the CPU: ptxas serializes no wgmma, the step loops spill nothing, and in each step loop every exponential comes before
the P V's wait (the softmax runs under its own P V). The kernels against float64 and bit for bit against the product
run in scripts/gpu_fp8mma_s14.py on an H100."""

import pytest

import fagen
from fagen.spec.kernel import KernelSpec
from test_fp8_wgs import full_128, variant
from test_hopper_compile import build_sm90


@pytest.fixture(autouse=True)
def _full_128():  # the 128-key full-mask loop ([Note] fp8 full-mask 192-key steps: FP8_FULL_N192 off here)
    yield from full_128()


def render(mask="causal", dtype="fp8_e4m3", head_dim=128, **fields):
    return fagen.generate(KernelSpec(backend="gluon", head_dim=head_dim, mask=mask, dtype=dtype, **fields))


def _step(src):
    i = src.index("def _consumer_step_ahead(")
    return src[i:src.index("\n\n\n", i)]


def test_renders_only_where_on():
    with variant(fp8_s_ahead=0):
        before, bf16, window = render(), render(dtype="bf16"), render(window=True)
    assert "_consumer_step_ahead" not in before
    with variant(fp8_s_ahead=1):
        src = render()
        assert render(dtype="bf16") == bf16 and render(window=True) == window
        assert "_consumer_step_ahead" in render(mask="none")
    step = _step(src)
    assert step.index("s_tok = warpgroup_mma(q_s, ") > step.index("= _softmax(s_acc, ")  # after the exponentials
    assert "warpgroup_mma_wait(2" not in step  # nothing carried in flight across the back edge
    loop = src[src.index("if hi > BLOCK_N:  # [Note] fp8 S a step ahead"):]
    loop = loop[:loop.index("mbarrier.arrive(q_empty.index(qi))")]
    assert loop.count("_consumer_step_ahead(") == 3 and loop.count("CAUSAL, True)") == 2
    assert loop.count("True, CAUSAL, False)") == 1  # the peeled last block: masked, no S to issue


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


def sass_loops(dump):
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", dump)]
    at = {a: i for i, (a, _) in enumerate(ins)}
    regions = []
    for j, (a, x) in enumerate(ins):
        m = re.search(r"\bBRA\s+0x([0-9a-f]+)", x)
        if m and int(m.group(1), 16) in at and at[int(m.group(1), 16)] < j:
            regions.append((at[int(m.group(1), 16)], j))
    qg = lambda r: sum("QGMMA" in y for _, y in ins[r[0]:r[1] + 1])  # noqa: E731
    inner = [r for r in regions if qg(r) and not any(o != r and r[0] <= o[0] and o[1] <= r[1] and qg(o)
                                                      for o in regions)]  # the step loops, not the tile loop
    bodies = [[y for _, y in ins[r[0]:r[1] + 1]] for r in inner if qg(r) == 8]
    return [b for b in bodies if sum("WARPGROUP.DEPBAR" in y for y in b) == 2  # a step: S and P V (two waits),
            and not any(y.startswith("STSM") for y in b)]  # not a region of the tile loop's (its epilogue stores O)


out = {}
for key, fields in json.loads(sys.argv[2]).items():
    fields = dict(fields)
    backends.GLUON.variant["fp8_s_ahead"] = fields.pop("ahead", 0)
    spec = KernelSpec(backend="gluon", **{"head_dim": 128, "dtype": "fp8_e4m3", **fields})
    render.render.cache_clear()
    mod = load_source(fagen.generate(spec), spec.name + "_" + key)
    res, log, dump = ptxas(mod.compile_for().asm["ptx"], sass=True)
    loops = sass_loops(dump)
    under = []
    for body in loops:  # every MUFU.EX2 of the step before its first wgmma wait (the P V's)
        mufu = [i for i, y in enumerate(body) if y.startswith("MUFU.EX2")]
        wait = [i for i, y in enumerate(body) if "WARPGROUP.DEPBAR.LE" in y]
        under.append(bool(mufu and wait and mufu[-1] < wait[0]))
    out[key] = dict(serialized="serialized" in log, loops=len(loops), under=under, sizes=[len(b) for b in loops],
                    local=[sum(y.startswith(("LDL", "STL")) for y in body) for body in loops])
print("RESULT " + json.dumps(out))
"""
MODULES = {"product": dict(mask="none"), "ahead1": dict(mask="none", ahead=1),
           "ahead1_causal": dict(mask="causal", ahead=1)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, MODULES, "fp8-s-ahead-sm90")


@pytest.mark.parametrize("key", [k for k in MODULES if k != "product"])
def test_no_wgmma_serialized_no_spill_in_the_steps(built, key):
    r = built[key]
    assert not r["serialized"] and r["loops"] >= 2 and set(r["local"]) == {0}, r


@pytest.mark.parametrize("key", ["ahead1", "ahead1_causal"])
def test_the_exponentials_run_under_the_p_v(built, key):
    """ahead 1: in every step loop (unmasked and masked, both warpgroups) the last MUFU.EX2 precedes the first
    WARPGROUP.DEPBAR; the product waits for S (and ptxas for the P V) before its first exponential."""
    assert built[key]["under"] and all(built[key]["under"]), built[key]
    assert built["product"]["under"] and not any(built["product"]["under"]), built["product"]
