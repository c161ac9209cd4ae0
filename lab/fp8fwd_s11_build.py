"""sm_90 builds of fp8 forward variants on the CPU (eleventh session, issue 28): ptxas registers / spills and the
SASS of the unmasked loop (instruction mix a step). Usage:
    PYTHONPATH=$PWD python lab/fp8fwd_s11_build.py MASK 'VARIANT_JSON' ['FIELDS_JSON'] [--sass]
"""
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))


def build(mask, variant, fields, sass=False, patch=()):
    import gpu_fp8_fwd_s7 as s7
    import sm90
    from fagen.runtime.loader import load_source
    sp = s7.spec_of(mask, **fields)
    src = s7.render_with(sp, variant)
    for pat, rep in patch:
        src, n = re.subn(pat, rep, src, flags=re.M)
        assert n, pat
    t = time.time()
    m = load_source(src, f"{sp.name}_lab{abs(hash((json.dumps(variant, sort_keys=True), json.dumps(fields, sort_keys=True), patch)))}")
    ck = m.compile_for()
    res, log, dump = sm90.ptxas(ck.asm["ptx"], sass=sass)
    r = res["_attn_fwd_hopper"]
    out = dict(shared=ck.metadata.shared, regs=r.registers, spills=r.spill_stores + r.spill_loads,
               stack=r.stack, secs=round(time.time() - t, 1))
    if sass:
        out["loops"] = sass_loops(dump)
    return out, ck, dump


def sass_loops(dump):
    """Per SASS loop holding QGMMA: instruction count and top opcodes."""
    lines = [l for l in dump.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", l)]
    addr = []
    for l in lines:
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", l)
        if m:
            addr.append((int(m.group(1), 16), m.group(2)))
    idx = {a: i for i, (a, _) in enumerate(addr)}
    res = []
    for j, (a, ins) in enumerate(addr):
        m = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*|)0x([0-9a-f]+)", ins)
        if not m:
            m2 = re.search(r"\bBRA\b.*?`\(\.L_x_(\d+)\)", ins)
            continue
        tgt = int(m.group(1), 16)
        if tgt in idx and idx[tgt] < j:
            body = [x for _, x in addr[idx[tgt]:j + 1]]
            if sum("GMMA" in x for x in body) >= 2:
                ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for x in body)
                res.append((len(body), dict(ops.most_common(14))))
    return res


def main_patch():
    """python lab/fp8fwd_s11_build.py --n256 MASK VARIANT_JSON: block_n 256, 2 stages, by patching the render."""
    mask, variant = sys.argv[2], json.loads(sys.argv[3])
    out, ck, dump = build(mask, variant, {}, sass=True,
                          patch=((r"^BLOCK_N = 128$", "BLOCK_N = 256"), (r"^STAGES = 4$", "STAGES = 2")))
    print(json.dumps(out))


if __name__ == "__main__" and sys.argv[1] == "--n256":
    main_patch()
elif __name__ == "__main__":
    mask = sys.argv[1]
    variant = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    fields = json.loads(sys.argv[3]) if len(sys.argv) > 3 and not sys.argv[3].startswith("--") else {}
    out, ck, dump = build(mask, variant, fields, sass="--sass" in sys.argv)
    print(json.dumps(out))
    if "--dump" in sys.argv:
        Path("/tmp/fp8fwd_s11.sass").write_text(dump)
        Path("/tmp/fp8fwd_s11.ptx").write_text(ck.asm["ptx"])

