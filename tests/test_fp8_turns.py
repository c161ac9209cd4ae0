"""The fp8 forward's warpgroup turns, fifteenth session (issue 28): GluonBackend.variant fp8_turns ([Note] fp8
warpgroup turns in fagen/templates/gluon/attention.py.j2), FA3's scheduler barriers. The render (only where on: fp8,
two warpgroups, not the 192-key steps or S a step ahead; bf16 unchanged), and the sm_90 build on the CPU: no spills,
and in each step loop a warpgroup syncs on its own named barrier (14 + WG, 256 threads) before its first wgmma and
arrives on the other's after its last wgmma, before any wgmma wait; warpgroup 1 arrives once on 14 before its first
tile. The kernels against float64 and bit for bit against the product run in scripts/gpu_fp8fwd_s15.py."""

import pytest

import fagen
from fagen.spec.kernel import KernelSpec
from test_fp8_wgs import variant
from test_hopper_compile import build_sm90


def render(mask="causal", dtype="fp8_e4m3", head_dim=128, **fields):
    return fagen.generate(KernelSpec(backend="gluon", head_dim=head_dim, mask=mask, dtype=dtype, **fields))


def test_renders_only_where_on():
    with variant(fp8_turns=0):
        before, bf16 = render(), render(dtype="bf16")
    assert "_turn(" not in before
    with variant(fp8_turns=1):
        src = render()
        assert render(dtype="bf16") == bf16
        assert "_turn(n, \"sync\", _BAR_TURN + WG)" in render(window=True)
        assert "_turn(" not in render(mask="none", head_dim=64)  # d64: three warpgroups
    with variant(fp8_turns=1, fp8_s_ahead=1):
        assert "_turn(" not in render(mask="none")
    with variant(fp8_turns=1, fp8_n192=1):
        assert "_turn(" not in render(mask="none")
    step = src[src.index("def _consumer_step("):src.index("\n\n\n", src.index("def _consumer_step("))]
    assert step.index('_turn(n, "sync", _BAR_TURN + WG)') < step.index("s_tok = warpgroup_mma(")
    assert step.index("o_tok = warpgroup_mma(") < step.index('_turn(n, "arrive", _BAR_TURN + 1 - WG)') < \
        step.index("warpgroup_mma_wait(")
    assert src.count("CAUSAL, WG)") == 2  # the unmasked and masked loops' calls pass the warpgroup


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

out = {}
for key, fields in json.loads(sys.argv[2]).items():
    fields = dict(fields)
    backends.GLUON.variant["fp8_turns"] = fields.pop("turns", 0)
    spec = KernelSpec(backend="gluon", **{"head_dim": 128, "dtype": "fp8_e4m3", **fields})
    render.render.cache_clear()
    mod = load_source(fagen.generate(spec), spec.name + "_" + key)
    ptx = mod.compile_for().asm["ptx"]
    res = ptxas(ptx)[0]["_attn_fwd_hopper"]
    orders = []
    for body in loops(ptx, min_wgmma=2, innermost=True):
        lines = body.splitlines()
        idx = lambda pat: [i for i, l in enumerate(lines) if re.search(pat, l)]  # noqa: E731
        mma, wait = idx(r"wgmma\.mma_async"), idx(r"wgmma\.wait_group")
        sync, arrive = idx(r"\bbar\.sync 1[45], 256;"), idx(r"\bbar\.arrive 1[45], 256;")
        ids = [re.search(r"bar\.(?:sync|arrive) (1[45])", lines[i]).group(1) for i in sync + arrive]
        orders.append(dict(sync=len(sync), arrive=len(arrive), ids=ids,
                           sync_first=bool(sync) and max(sync) < min(mma),
                           arrive_between=bool(arrive) and max(mma) < min(arrive) < min(wait)))
    out[key] = dict(spills=res.spill_stores + res.spill_loads, stack=res.stack, loops=orders,
                    arrive14=len(re.findall(r"\bbar\.arrive 14, 256;", ptx)),
                    arrive15=len(re.findall(r"\bbar\.arrive 15, 256;", ptx)),
                    sync14=len(re.findall(r"\bbar\.sync 14, 256;", ptx)),
                    sync15=len(re.findall(r"\bbar\.sync 15, 256;", ptx)))
print("RESULT " + json.dumps(out))
"""
MODULES = {"product": dict(mask="none"), "turns": dict(mask="none", turns=1),
           "turns_causal": dict(mask="causal", turns=1)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, MODULES, "fp8-turns-sm90")


@pytest.mark.parametrize("key", list(MODULES))
def test_builds_without_spills(built, key):
    r = built[key]
    assert r["spills"] == 0 and r["stack"] == 0 and len(r["loops"]) == 4, r  # two step loops a warpgroup


@pytest.mark.parametrize("key", ["turns", "turns_causal"])
def test_each_step_syncs_before_its_issues_and_hands_over_after(built, key):
    r = built[key]
    for loop in r["loops"]:
        assert loop["sync"] == 1 and loop["arrive"] == 1 and loop["sync_first"] and loop["arrive_between"], r
        assert loop["ids"] in (["14", "15"], ["15", "14"]), r  # its own barrier, then the other's
    # per warpgroup: a sync and an arrive in each of its two loops; warpgroup 1's one arrive on 14 before its tiles
    assert (r["sync14"], r["sync15"], r["arrive14"], r["arrive15"]) == (2, 2, 3, 2), r
    assert not any(loop["sync"] or loop["arrive"] for loop in built["product"]["loops"])
