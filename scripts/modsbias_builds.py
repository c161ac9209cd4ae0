"""sm_90 builds on the CPU (triton's bundled ptxas) of the bias rows' Gluon kernels (issue 26, docs/mods.md "Bias
rows (tenth session)"): the row-free ALiBi and the relative bias, forward and backward, with variant levers set for
the render. Prints spills, registers and a few SASS op counts per build.

    PYTHONPATH=$PWD python3 scripts/modsbias_builds.py [key ...]
"""
import json
import os
import re
import sys
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

ALIBI = dict(score_mod="score + kv_idx * exp2(-((h + 1) * 8.0 / H))", mod_scalars=[["H", "int"]])
RELBIAS = dict(score_mod="score + rel_bias[h, q_idx - kv_idx + max_len - 1]", mod_tensors=[["rel_bias", "fp32", 2]],
               mod_scalars=[["max_len", "int"]])
BUILDS = {  # key: (direction, fields, levers, compile keywords)
    "fwd-alibi": ("fwd", ALIBI, {}, {}),
    "fwd-alibi-add": ("fwd", ALIBI, {"fwd_mod_add": 1}, {}),
    "fwd-alibi-cols": ("fwd", ALIBI, {"fwd_mod_add": 2}, {}),
    "fwd-plain": ("fwd", {}, {}, {}),
    "fwd-rel": ("fwd", RELBIAS, {}, {}),
    "fwd-rel-add": ("fwd", RELBIAS, {"fwd_mod_add": 1}, {}),
    "bwd-alibi": ("bwd", ALIBI, {}, {}),
    "bwd-alibi-fixed": ("bwd", ALIBI, {"bwd_mod_fixed": 1}, {}),
    "bwd-plain": ("bwd", {}, {}, {}),
    "bwd-rel-free": ("bwd", RELBIAS, {}, {"mod_free": True}),
    "bwd-rel-free-fixed": ("bwd", RELBIAS, {"bwd_mod_fixed": 1}, {"mod_free": True}),
    "bwd-rel-free-split": ("bwd", RELBIAS, {"bwd_mod_split": 1}, {"mod_free": True}),
    "bwd-rel-free-split-fold": ("bwd", RELBIAS, {"bwd_mod_split": 1, "bwd_mod_fold": 1}, {"mod_free": True}),
    "bwd-alibi-fold": ("bwd", ALIBI, {"bwd_mod_fold": 1}, {}),
    "bwd-rel-free-split-fixed": ("bwd", RELBIAS, {"bwd_mod_split": 1, "bwd_mod_fixed": 1}, {"mod_free": True}),
}

BUILDS["bwd-rel-unit-split-fold"] = ("bwd", RELBIAS, {"bwd_mod_split": 1, "bwd_mod_fold": 1}, {"mod_free": 2})
BUILDS["bwd-rel-unit-split"] = ("bwd", RELBIAS, {"bwd_mod_split": 1}, {"mod_free": 2})
BUILDS["bwd-rel-unit-split-fixed"] = ("bwd", RELBIAS, {"bwd_mod_split": 1, "bwd_mod_fixed": 1}, {"mod_free": 2})
EDITS: dict = {}


def build(key):
    from sm90 import ptxas

    from fagen import backends
    from fagen.codegen.render import render
    from fagen.runtime.loader import load_source
    from fagen.spec.kernel import KernelSpec

    direction, fields, lever, kw = BUILDS[key]
    spec = KernelSpec(backend="gluon", direction=direction, head_dim=128, dtype="bf16", mask="none", **fields)
    saved = {k: backends.GLUON.variant[k] for k in lever}
    backends.GLUON.variant.update(lever)
    render.cache_clear()
    try:
        src = render(spec).files[".py"]
    finally:
        backends.GLUON.variant.update(saved)
        render.cache_clear()
    for a, b in EDITS.get(key, ()):
        assert a in src, a
        src = src.replace(a, b)
    mod = load_source(src, spec.name + "_" + key.replace("-", "_"))
    ck = mod.compile_for() if direction == "fwd" else mod.compile_backward_for(deterministic=True, **kw)
    res, log, sass = ptxas(ck.asm["ptx"], sass=True)
    r = next(iter(res.values()))
    ops = Counter(m.group(1).split(".")[0] for m in re.finditer(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass, re.M))
    from sm90 import loops

    body = loops(ck.asm["ptx"], 2, innermost=True)
    loop = [Counter(m.group(1) for m in re.finditer(r"^\s*(?:@%p\d+\s+)?([a-z]+(?:\.[a-z0-9]+)*)", b, re.M)) for b in body]
    loop = [{k: v for k, v in c.items() if k.split(".")[0] in ("cvt", "fma", "mul", "add", "ex2", "ld", "sub", "max")
             and v >= 8} for c in loop]
    sass_loops = []  # SASS loops holding HGMMA: instructions, spill loads/stores inside
    sl = [l for l in sass.splitlines() if re.match(r"^\s+/\*[0-9a-f]{4,}\*/", l)]
    addr = [int(re.match(r"^\s+/\*([0-9a-f]{4,})\*/", l).group(1), 16) for l in sl]
    for j, l in enumerate(sl):
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", l)
        if m and int(m.group(1), 16) < addr[j]:
            i = addr.index(int(m.group(1), 16)) if int(m.group(1), 16) in addr else None
            if i is not None:
                seg = sl[i:j + 1]
                if sum("HGMMA" in x for x in seg) >= 2:
                    sass_loops.append((len(seg), sum("STL" in x for x in seg), sum("LDL" in x for x in seg)))
    sass_loops = sorted(sass_loops)[:2]
    sizes = [sum(1 for l in b.splitlines() if l.strip() and not l.strip().startswith(("$", "//", "{", "}", ".")))
             for b in body]
    return dict(sass_loops=sass_loops, loop_instrs=sizes, loops=loop, spills=r.spill_stores, regs=r.registers, shared=ck.metadata.shared,
                ops={k: ops[k] for k in ("I2FP", "I2F", "FMUL", "FFMA", "FADD", "MUFU", "LDG", "LDS", "STL", "LDL", "IMAD", "IADD3")})


if __name__ == "__main__":
    for key in sys.argv[1:] or list(BUILDS):
        try:
            print(key, json.dumps(build(key)), flush=True)
        except Exception as e:  # noqa: BLE001
            print(key, "ERROR", type(e).__name__, str(e)[:300], flush=True)
