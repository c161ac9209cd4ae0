"""The d128 full backward's Q/dO ring depth (variant bwd_full_levers' bwd_ring R, twenty-second session; [Note] Full
ring in fagen/templates/gluon/backward.py.j2, docs/hopper.md "The d128 full backward: the profile (twenty-second
session)"): it renders only in a plain full render and only as BWD_RING_SLOTS, and the sm_90 builds of R 3 fit the
per-block shared memory and spill no more than the product's. On an H200: scripts/gpu_bwdfull_s22.py."""

import difflib
import os
import subprocess
import sys
import textwrap

import pytest

import fagen
from fagen import backends
from fagen.codegen import render

from _env import ON_GPU

D128 = {"bwd_fixed": 1, "bwd_fixed_tma": 1, "bwd_sections": 4}
LEVERS = {"bwd_named": 2, "bwd_epi_tma": 1}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMEM_PER_BLOCK = 232448  # sm_90's largest dynamic shared memory a block may take (227 KB)
RING = 3  # the lever's depth built below


def _source(ring=None, mask="none", levers=None, **fields):
    """The d128 bf16 backward render with bwd_full_levers = the default's (+ bwd_ring `ring`)."""
    from fagen.spec.kernel import KernelSpec
    levers = dict(LEVERS if levers is None else levers, **({} if ring is None else {"bwd_ring": ring}))
    saved = dict(backends.GLUON.variant)
    backends.GLUON.variant.update(bwd_d128={**D128, "bwd_full_levers": levers}, bwd_full_levers=levers)
    render.render.cache_clear()
    try:
        return fagen.generate(KernelSpec(backend="gluon", direction="bwd", head_dim=128, mask=mask, dtype="bf16",
                                         **fields))
    finally:
        backends.GLUON.variant.clear()
        backends.GLUON.variant.update(saved)
        render.render.cache_clear()


def test_renders_only_where_on():
    """Off (absent or 0) is the default render; on, a plain full render differs in BWD_RING_SLOTS' line only; causal
    and switched renders do not read the key (seen red with the mask condition dropped from the template's `ring`)."""
    off, on = _source(), _source(3)
    assert "\nBWD_RING_SLOTS = 2 " in off and "\nBWD_RING_SLOTS = 3 " in on
    assert _source(0) == off
    diff = [d for d in difflib.unified_diff(off.splitlines(), on.splitlines(), n=0, lineterm="")
            if d[:1] in "+-" and not d.startswith(("+++", "---"))]
    assert len(diff) == 2 and all("BWD_RING_SLOTS = " in d for d in diff), diff
    for spec in (dict(mask="causal"), dict(softcap=True)):
        assert _source(3, **spec) == _source(None, **spec)


_BUILD = textwrap.dedent(r"""
    import sys, json, re
    sys.path.insert(0, {tests!r})
    from test_gluon_bwd_ring import _source
    from fagen.runtime.loader import load_source
    from sm90 import ptxas
    def reloads(dump):  # LDL in the SASS step loops: the innermost loops holding HGMMA
        ins = [(int(a, 16), x.strip()) for a, x in re.findall(r"/\*([0-9a-f]{{4,}})\*/\s+([^;]*);", dump)]
        at = {{a: i for i, (a, _) in enumerate(ins)}}
        spans = []
        for j, (_, x) in enumerate(ins):
            b = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", x)
            if b and int(b.group(1), 16) in at and at[int(b.group(1), 16)] < j:
                spans.append((at[int(b.group(1), 16)], j))
        has = lambda r: any("HGMMA" in y for _, y in ins[r[0]:r[1] + 1])
        inner = [r for r in spans if has(r) and not any(o != r and r[0] <= o[0] and o[1] <= r[1] and has(o)
                                                        for o in spans)]
        return [sum("LDL" in y for _, y in ins[r[0]:r[1] + 1]) for r in inner]
    out = {{}}
    for ring in (None, {ring}):
        m = load_source(_source(ring), f"bwd_ring_test_{{ring}}")
        for det in (True, False):
            ck = m.compile_backward_for(deterministic=det)
            res, _, dump = ptxas(ck.asm["ptx"], sass=True)
            res = next(iter(res.values()))
            out[f"{{ring}} {{det}}"] = [res.registers, res.spill_stores, res.spill_loads, ck.metadata.shared,
                                        reloads(dump)]
    print("BUILD " + json.dumps(out))
""")


@pytest.mark.skipif(ON_GPU, reason="faked sm_90 build (CPU)")
def test_sm90_builds_of_ring_3_fit_and_spill_no_more(tmp_path):
    """R 3, both modes: one more Q/dO slot (32 KB) and row slots in shared memory, within the per-block limit
    (232,112 / 231,328 B); the product's registers; spill bytes and step-loop reloads no more than the product's
    (ptxas: 32/36 against 116/108 B in mode 2). Seen red with R 4 (shared memory past the limit)."""
    import json
    env = dict(os.environ, PYTHONPATH=ROOT, TRITON_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", _BUILD.format(tests=os.path.join(ROOT, "tests"), ring=RING)], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.split("BUILD ", 1)[1])
    for det in ("True", "False"):
        (regs, st, ld, smem, loops), (regs3, st3, ld3, smem3, loops3) = got[f"None {det}"], got[f"{RING} {det}"]
        assert regs3 == regs == 168, got
        assert smem + 32768 <= smem3 <= SMEM_PER_BLOCK, got
        assert st3 <= st and ld3 <= ld, got
        assert len(loops3) == len(loops) and all(a <= b for a, b in zip(loops3, loops)), got
