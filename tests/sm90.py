"""What the sm_90 build scripts of the tests share (test_hopper_compile, test_gluon_mods, test_fp8_compile,
test_mods_kernels): triton's bundled ptxas on a PTX text, and the PTX loops that issue wgmma. The scripts run in a
fresh interpreter (build_sm90 in test_hopper_compile.py) and import this module by path."""
import os
import re
import subprocess
import tempfile

import triton

from fagen.aot.nvcc import parse_resources

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PTXAS = os.environ.get("TRITON_PTXAS_PATH") or os.path.join(BIN, "ptxas")


def ptxas(ptx: str, sass: bool = False):
    """`ptxas -arch=sm_90a -v` of a PTX text: (resources per kernel, ptxas's log, the cubin's SASS if asked)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        r = subprocess.run([PTXAS, "-arch=sm_90a", "-v", path, "-o", path + ".cubin"], capture_output=True, text=True)
        dump = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path + ".cubin"], capture_output=True,
                              text=True).stdout if sass else ""
    log = r.stdout + r.stderr
    return parse_resources(log), log, dump


def loops(ptx: str, min_wgmma: int = 1, innermost: bool = False) -> list[str]:
    """The bodies of the PTX's loops (a label .. a backward branch to it) that hold at least min_wgmma wgmma ops;
    with innermost, only those that hold no other such loop. A loop laid out in pieces (its back edge branching
    forward) is not found."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"^(\$L__BB\d+_\d+):", l))}
    regions = []
    for j, l in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", l)
        if m and m.group(1) in labels and labels[m.group(1)] < j:
            regions.append((labels[m.group(1)], j))
    body = lambda r: "\n".join(lines[r[0]:r[1] + 1])  # noqa: E731
    found = [r for r in regions if body(r).count("wgmma.mma_async") >= min_wgmma]
    if innermost:
        found = [r for r in found if not any(o != r and r[0] <= o[0] and o[1] <= r[1] for o in found)]
    return [body(r) for r in found]


def sass_step_loops(dump: str, qgmma: int = 8) -> list[list[str]]:
    """The SASS step loops of a cuobjdump listing: the innermost loops (a target .. a backward BRA to it) that hold
    `qgmma` QGMMA instructions; each a list of its instructions."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", dump)]
    at = {a: i for i, (a, _) in enumerate(ins)}
    regions = []
    for j, (_, x) in enumerate(ins):
        m = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", x)
        if m and int(m.group(1), 16) in at and at[int(m.group(1), 16)] < j:
            regions.append((at[int(m.group(1), 16)], j))
    count = lambda r: sum("QGMMA" in y for _, y in ins[r[0]:r[1] + 1])  # noqa: E731
    inner = [r for r in regions if count(r) and not any(o != r and r[0] <= o[0] and o[1] <= r[1] and count(o)
                                                         for o in regions)]
    return [[y for _, y in ins[r[0]:r[1] + 1]] for r in inner if count(r) == qgmma]


def step_barriers(body: list[str]) -> dict:
    """Where a SASS step loop's named barriers of 256 threads sit: the instruction indexes of its QGMMA, wgmma waits
    (WARPGROUP.DEPBAR), MUFU.EX2, BAR.SYNC / BAR.ARV / BAR.RED of 0x100 threads (index, barrier id), the count of
    mbarrier phase checks, and the consumer warpgroup (triton's partition barrier of 128 threads: 0x0 the default
    partition, warpgroup 0; 0x2 worker 0, warpgroup 1)."""
    idx = lambda pat: [i for i, l in enumerate(body) if re.search(pat, l)]  # noqa: E731
    named = lambda op: [(i, int(re.search(r"(0x[0-9a-f]+), 0x100\b", body[i]).group(1), 16))  # noqa: E731
                        for i in idx(rf"\bBAR\.{op}\S*\s+0x[0-9a-f]+, 0x100\b")]
    parts = {re.search(r"\bBAR\.SYNC\S*\s+(0x[0-9a-f]+), 0x80\b", body[i]).group(1)
             for i in idx(r"\bBAR\.SYNC\S*\s+0x[0-9a-f]+, 0x80\b")}
    return dict(n=len(body), qgmma=idx(r"\bQGMMA\b"), waits=idx(r"WARPGROUP\.DEPBAR"), mufu=idx(r"\bMUFU\.EX2\b"),
                sync=named("SYNC"), arrive=named("ARV"), red=named("RED"), phasechk=len(idx(r"SYNCS\.PHASECHK")),
                wg={"0x0": 0, "0x2": 1}.get(parts.pop() if len(parts) == 1 else "", None))


def _ur_writes(x: str) -> set:
    """The uniform registers a SASS instruction writes: its first operand where that is a UR (two with .64 / .WIDE)."""
    m = re.match(r"^(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s+UR(\d+)\b", x)
    if not m:
        return set()
    return {int(m.group(3)) + i for i in range(2 if (".64" in m.group(2) or ".WIDE" in m.group(2)) else 1)}


def _qgmma_urs(x: str) -> set:
    """The uniform registers a QGMMA's gdesc[URx] reads: URx..URx+3 (A and B descriptors), URx+2..+3 with A in
    registers."""
    m = re.search(r"\bQGMMA\S*\s+R\d+,\s*(R\d+,\s*)?gdesc\[UR(\d+)\]", x)
    if not m:
        return set()
    b = int(m.group(2))
    return {b + 2, b + 3} if m.group(1) else {b, b + 1, b + 2, b + 3}


def stale_descriptors(dump: str) -> list:
    """QGMMA descriptor registers that a tile's iteration may read before writing them ([Note] fp8 256-key steps:
    ptxas 12.x placed the Q descriptors of the masked loop in the unmasked loop's preheader, so a tile whose unmasked
    loop ran 0 times read the previous tile's). A tile loop is an innermost loop (a backward BRA, no EXIT inside)
    around two or more QGMMA loops; in it, every UR a QGMMA reads must be written on every path from the loop's head
    (the back edge cut), or nowhere in the loop (a loop invariant). Returns (address, instruction, URs) of each
    offending QGMMA."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", dump)]
    at = {a: i for i, (a, _) in enumerate(ins)}

    def succ(i):
        x = ins[i][1]
        if re.search(r"\bEXIT\b", x) and not x.startswith("@"):
            return []
        m = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", x)
        out = [at[int(m.group(1), 16)]] if m and int(m.group(1), 16) in at else []
        return out if out and not x.startswith("@") else out + ([i + 1] if i + 1 < len(ins) else [])
    nxt = [succ(i) for i in range(len(ins))]
    exits = [i for i, (_, x) in enumerate(ins) if re.search(r"\bEXIT\b", x)]
    q = [i for i, (_, x) in enumerate(ins) if "QGMMA" in x]
    back = [(h, j) for j in range(len(ins)) for h in nxt[j] if h <= j and not any(h <= e <= j for e in exits)]
    loops = [(h, j) for h, j in back if any(h <= k <= j for k in q)]
    tiles = [(h, j) for h, j in loops if sum(h <= h2 and j2 <= j and (h2, j2) != (h, j) for h2, j2 in loops) >= 2]
    tiles = [t for t in tiles if not any(o != t and o[0] <= t[0] and t[1] <= o[1] for o in tiles)]
    bad = []
    for h, j in tiles:
        written = set().union(*(_ur_writes(ins[k][1]) for k in range(h, j + 1)))
        state, work = {h: frozenset()}, [h]  # URs written on every path from h (must-defined, back edge cut)
        while work:
            i = work.pop()
            cur = state[i] | _ur_writes(ins[i][1])
            for s in nxt[i]:
                if s != h and h <= s <= j and (s not in state or not state[s] <= cur):
                    state[s] = frozenset(cur if s not in state else state[s] & cur)
                    work.append(s)
        for k in range(h, j + 1):
            miss = sorted(r for r in _qgmma_urs(ins[k][1]) if r in written and r not in state.get(k, written))
            if miss:
                bad.append((hex(ins[k][0]), ins[k][1], miss))
    return bad
