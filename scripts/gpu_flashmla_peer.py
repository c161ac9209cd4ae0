"""FlashMLA beside fagen's MLA absorbed decode (issue 27: "if FlashMLA can travel to the GPU machine, time it in the
same run"), one table.

FlashMLA ships compiled inside the `sglang-kernel` wheel (about 400 MB, past the GPU machine's 64 MiB carry). Its
FlashMLA extension alone is 15 MB (1.1 MB as .tar.xz): `sgl_kernel/flashmla_ops.abi3.so` and its wrapper
`sgl_kernel/flash_mla.py` from sglang-kernel 0.4.5, the last release built for torch 2.11 and CUDA 13 (the GPU
machine's; 0.4.6.post1 is built for torch 2.13 and does not load there: an undefined torch::Library::_def).
Put them in a folder `sgl_kernel/` (with an empty `__init__.py`) under $FLASHMLA_DIR:

    pip download --no-deps -d /tmp/w sglang-kernel==0.4.5      # on a machine with the package index
    mkdir -p /tmp/fm/sgl_kernel && touch /tmp/fm/sgl_kernel/__init__.py
    unzip -j /tmp/w/sglang_kernel-*.whl 'sgl_kernel/flash_mla.py' 'sgl_kernel/flashmla_ops.abi3.so' -d /tmp/fm/sgl_kernel
    FLASHMLA_DIR=/tmp/fm PYTHONPATH=$PWD python3 scripts/gpu_flashmla_peer.py     # H100, under ~100 s

Phases, each a child process with a timeout (scripts/_phases.py):
1. load: import FlashMLA; on failure print why (an ABI mismatch is a row, not a crash).
2. time: Hq 128 Sq 2 (b32, b64; kv 8192) and Hq 16 Sq 1 (b64 kv8192, b128 kv4096), page 64, causal, bf16: FlashMLA
   and fagen's paged latent decode modules (Triton, and Gluon where its `fits` takes the shape), FlashMLA checked
   against fagen's last (max |diff|) and fagen's against float64 on the first sequence; TF/s (2 (576 + 512) flops
   a visible query-key pair) and GB/s of the latent cache read, against a device copy's. do_bench for both (the
   same L2 flush for both).
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
D, DV, PAGE = 576, 512, 64
SCALE = 192 ** -0.5
CASES = [(32, 128, 2, 8192), (64, 128, 2, 8192), (64, 16, 1, 8192), (128, 16, 1, 4096)]
T0 = time.time()


def emit(*cols):
    print("ROW\t" + "\t".join(str(c) for c in cols), flush=True)


def flashmla():
    """FlashMLA's (metadata, forward) from $FLASHMLA_DIR/sgl_kernel, or raise with the loader's reason."""
    where = os.environ.get("FLASHMLA_DIR", os.path.join(ROOT, ".peer"))
    sys.path.insert(0, where)
    import torch  # noqa: F401 - FlashMLA's extension links against torch's libraries
    from sgl_kernel import flash_mla
    if flash_mla._flashmla_import_error is not None:
        raise RuntimeError(f"flashmla_ops did not load: {flash_mla._flashmla_import_error}")
    return flash_mla


def phase_load():
    try:
        fm = flashmla()
        emit("load", "FlashMLA", "ok", os.path.dirname(fm.__file__))
    except Exception as e:  # noqa: BLE001
        emit("load", "FlashMLA", "FAILED", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")


def paged(b, hq, sq, n, seed=5):
    import torch
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = b * (n // PAGE)
    q = torch.randn(b, hq, sq, D, device="cuda", generator=gen).bfloat16()
    cache = torch.randn(pages, PAGE, 1, D, device="cuda", generator=gen).bfloat16()
    table = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).view(b, n // PAGE)
    lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    lens[0] = n - 37  # a length that is not a multiple of the page
    return q, cache, table, lens


def phase_time():
    import torch
    from triton.testing import do_bench

    import fagen
    from fagen.verify import reference
    try:
        fm = flashmla()
    except Exception as e:  # noqa: BLE001
        fm = None
        emit("time", "FlashMLA", "-", "-", f"not loaded: {str(e).splitlines()[0][:150]}")
    nbytes0 = 1 << 30
    src = torch.empty(nbytes0 // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy = 2 * nbytes0 / do_bench(lambda: dst.copy_(src), warmup=10, rep=40) / 1e6
    emit("time", "copy 1 GiB", "torch copy_", f"{copy:.0f} GB/s", "read + write")
    for b, hq, sq, n in CASES:
        q, cache, table, lens = paged(b, hq, sq, n)
        name = f"h{hq} sq{sq} b{b} kv{n} page{PAGE}"
        seen = sum(sq * int(x) - sq * (sq - 1) // 2 for x in lens.tolist())
        flops, nbytes = 2 * (D + DV) * hq * seen, int(lens.sum()) * D * 2

        def value(ms):
            return f"{flops / ms / 1e9:.1f} TF/s, {nbytes / ms / 1e6:.0f} GB/s ({nbytes / ms / 1e6 / copy:.0%} of copy)"

        out = None
        for backend in ("triton", "gluon"):
            mod = fagen.load(fagen.KernelSpec(head_dim=D, head_dim_v=DV, shared_kv=True, kind="decode", gqa=hq,
                                              dtype="bf16", mask="causal", layout="paged", backend=backend))
            why = mod.fits(q, cache) if hasattr(mod, "fits") else None
            if why is not None:
                emit("time", name, f"fagen {backend}", "-", f"not taken: {why[:90]}")
                continue

            def mine():
                return mod.forward(q, cache, None, block_table=table, seqlens_k=lens, scale=SCALE)
            try:
                o1 = mine()[0]
                keys = cache[table[0].long()].double().reshape(-1, 1, D)[:int(lens[0])].transpose(0, 1)[None]
                want = reference.attention(q[:1].double(), keys, None, head_dim_v=DV, mask="causal", scale=SCALE)[0]
                err = (o1[:1].double() - want).abs().max().item()
                ms = do_bench(mine, warmup=10, rep=40)
                out = o1
                emit("time", name, f"fagen {backend}", value(ms), f"{ms * 1e3:.1f} us; max err vs float64 (seq 0) {err:.1e}")
            except Exception as e:  # noqa: BLE001
                emit("time", name, f"fagen {backend}", "-", f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:150]}")
        if fm is None:
            continue
        try:
            qf = q.transpose(1, 2).contiguous()  # FlashMLA: q [b, sq, hq, d]
            meta, splits = fm.get_mla_metadata(lens, sq * hq, 1)

            def theirs():
                return fm.flash_mla_with_kvcache(qf, cache, table, lens, DV, meta, splits, softmax_scale=SCALE,
                                                 causal=True)
            o2 = theirs()[0].transpose(1, 2)
            diff = "-" if out is None else f"{(o2.float() - out.float()).abs().max().item():.1e}"
            ms = do_bench(theirs, warmup=10, rep=40)
            emit("time", name, "FlashMLA (sglang-kernel 0.4.5)", value(ms), f"{ms * 1e3:.1f} us; max |diff| vs fagen {diff}")
        except Exception as e:  # noqa: BLE001
            emit("time", name, "FlashMLA", "-", f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:150]}")


def main():
    from _phases import child_env, run_phase
    rows = []

    def on_line(line):
        print(line, end="", flush=True)
        if line.startswith("ROW\t"):
            rows.append(line.rstrip("\n").split("\t")[1:])
    env = child_env("/tmp/fc-flashmla", ROOT)
    for name, limit in (("load", 30), ("time", 70)):
        rc, _ = run_phase(os.path.abspath(__file__), name, limit, env, on_line)
        print(f"[{time.time() - T0:5.1f}s] phase {name}: {rc}", flush=True)
    print("\n| phase | case | impl | value | note |\n|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r + [""] * (5 - len(r))) + " |")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--phase":
        {"load": phase_load, "time": phase_time}[sys.argv[2]]()
    else:
        main()
