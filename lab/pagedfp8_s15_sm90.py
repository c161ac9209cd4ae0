"""Lab (fifteenth session; lab/pagedfp8_sm90.py without the fourteenth session's whole-rows HEADS): the paged fp8
decode's _decode_split built for sm_90 on the CPU (no GPU) at other tiles: ptxas's registers and spills, shared
memory, SASS lines, the TTGIR's cp.async count. d128 gqa 4 e4m3, per-head scales, bf16 q, ROWS32 1, not DIRECT.

    PYTHONPATH=$PWD python3 lab/pagedfp8_s15_sm90.py [block_n,num_warps,num_stages ...]   # default 128,8,3
"""
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import fagen  # noqa: E402
from fagen.runtime.loader import load_source  # noqa: E402
from sm90 import ptxas  # noqa: E402

PTR = {"Q": "*bf16", "K": "*fp8e4nv", "V": "*fp8e4nv", "Dst": "*fp32", "DstLse": "*fp32", "Out": "*bf16",
       "Lse": "*fp32", "Counter": "*i32", "SeqlensK": "*i32", "KScale": "*fp32", "VScale": "*fp32",
       "BlockTable": "*i32"}
NONE = ("SeqlensQ", "TreeMask", "KTok", "VTok")
FLOAT = ("qk_scale", "k_scale", "v_scale")


def build(h, direct=False, spec_kw=None, maxnreg=None):
    spec = fagen.KernelSpec(head_dim=128, gqa=4, kind="decode", layout="paged", dtype="bf16", kv_dtype="fp8_e4m3",
                            **(spec_kw or {}))
    m = load_source(fagen.generate(spec), f"{spec.name}_lab_sm90")
    fn = m._decode_split
    rows = m.tile_rows(4)
    consts = dict(HEAD_DIM=128, BLOCK_D=128, HEAD_DIM_V=128, BLOCK_DV=128, ROWS=rows, BLOCK_N=spec.block_n,
                  GQA=4, DOT=True, DIRECT=direct, SPLITS_PER_SEQ=0, UPCAST=False, ROWS32=1)
    sig, cx, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        n = p.name
        if p.is_constexpr:
            sig[n] = "constexpr"
            cx[n] = consts[n]
        elif n == "seq_q":  # Triton specialises an int argument equal to 1 (a decode step's one query)
            sig[n] = "constexpr"
            cx[n] = 1
        elif n in NONE:
            sig[n] = "constexpr"
            cx[n] = None
        elif n in PTR:
            sig[n] = PTR[n]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in FLOAT:
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if n.startswith("stride_") and n not in ("stride_qm", "stride_om", "stride_dm", "stride_tb", "stride_tm"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 128),
                        options=dict(num_warps=spec.num_warps, num_stages=spec.num_stages,
                                                                              **({} if maxnreg is None else dict(maxnreg=maxnreg))))
    res, _, sass = ptxas(ck.asm["ptx"].replace(".maxntid", f".maxnreg {maxnreg}\n.maxntid") if maxnreg and
                         ".maxnreg" not in ck.asm["ptx"] else ck.asm["ptx"], sass=True)
    r = next(iter(res.values()))
    import subprocess
    import tempfile
    from sm90 import BIN
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:  # Triton's own cubin: its registers
        f.write(ck.asm["cubin"])
        f.flush()
        use = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                             text=True).stdout
    regs = int(re.search(r"REG:(\d+)", use).group(1))
    ttgir = ck.asm["ttgir"]
    return dict(h=h, direct=direct, regs=regs, ptxas_regs=r.registers, spills=r.spill_stores + r.spill_loads, smem=ck.metadata.shared,
                sass=len([ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]),
                cp_async=ttgir.count("async_copy_global_to_local"), local_alloc=ttgir.count("local_alloc"),
                convert=ttgir.count("convert_layout"))


if __name__ == "__main__":
    import itertools
    for a in sys.argv[1:] or ["128,8,3"]:
        n, w, st = (int(x) for x in a.split(","))
        try:
            print(a, build(1, spec_kw=dict(block_n=n, num_warps=w, num_stages=st)), flush=True)
        except Exception as e:  # noqa: BLE001
            print(a, dict(error=f"{type(e).__name__}: {str(e)[:300]}"), flush=True)
