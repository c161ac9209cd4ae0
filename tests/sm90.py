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
