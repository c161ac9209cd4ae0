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
