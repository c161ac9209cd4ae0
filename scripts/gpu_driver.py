"""The one CUDA driver wrapper, the one nvcc command and the one autograd on a GPU: checks, then one timing.

    PYTHONPATH=$PWD python3 scripts/gpu_driver.py        # < 2 minutes on an H100; a JSON summary to $OUT if set

Checks (each against the float64 reference, or bit for bit against another path):
- cuda_jit_big / cuda_jit_small: the CUDA backend's launcher compiles with nvcc_command on first use and launches
  through CudaDriver (fagen/runtime/driver.py), above 48 KB of dynamic shared memory (the opt-in path) and below.
- cuda_thread_stream: the same launch from a new thread (no CUDA context current there) on a side stream.
- cuda_use_cubin: `fagen build`'s cubin (nvcc.compile_spec) is byte-identical to the launcher's and gives the same bits.
- prebuilt_triton: `fagen compile` cubins launched by fagen.runtime.prebuilt through the same CudaDriver.
- compile_fwd_bwd / compile_decode: fagen.attention under torch.compile(fullgraph=True, Inductor), which traces
  into the module's own operators and autograd (fagen/runtime/ops.py), against eager.
Timing: the CUDA backend, d128 bf16 causal B1 H16 S8192 forward, with the cache preference CudaDriver sets above
48 KB (PREFER_SHARED, as Triton's loader does) and with none (what the cuda-python launcher did before).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import fagen  # noqa: E402
from fagen.aot import nvcc  # noqa: E402
from fagen.runtime import driver  # noqa: E402
from fagen.verify import reference  # noqa: E402
from fagen.verify.strategies import Problem  # noqa: E402
from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare  # noqa: E402

CHECKS: list = []  # (name, function returning a detail string), run in this order by main()


def row(name):
    def wrap(fn):
        CHECKS.append((name, fn))
        return fn
    return wrap


def run_check(name, fn) -> dict:
    start = time.perf_counter()
    try:
        result = {"check": name, "ok": True, "detail": fn()}
    except Exception as e:  # noqa: BLE001 - a failed check is a row, the others still run
        traceback.print_exc()
        result = {"check": name, "ok": False, "detail": f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"}
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(f"{name}: {'PASS' if result['ok'] else 'FAIL'} {result['detail']}", flush=True)
    return result


def arch():
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def against_reference(module, spec, problem):
    (q, k, v), kw = problem.inputs(spec, "cuda")
    q, k, v = (t.cuda() for t in (q, k, v))
    out, lse = module.forward(q, k, v, **kw)
    want_out, want_lse = reference.attention(q.double(), k.double(), v.double(), mask=spec.mask, **kw)
    err = compare("out", out, want_out, **TOLERANCE[spec.dtype])
    compare("lse", lse, want_lse, **LSE_TOLERANCE)
    return (q, k, v), kw, out, lse, err


RAGGED = Problem(batch=2, heads_kv=2, seq_q=1000, seq_k=1531, seed=1)  # lengths no multiple of any block
BIG = fagen.KernelSpec(head_dim=128, mask="causal", dtype="bf16", gqa=2, backend="cuda")  # > 48 KB shared memory
SMALL = fagen.KernelSpec(head_dim=64, mask="none", dtype="fp16", gqa=2, backend="cuda", block_m=64, block_n=32,
                         num_warps=4, num_stages=3)


@row("cuda_jit_big")
def _():
    assert fagen.load(BIG).SMEM_BYTES > 48 * 1024
    *_, err = against_reference(fagen.load(BIG), BIG, RAGGED)
    return f"smem {fagen.load(BIG).SMEM_BYTES} B, max|err| {err:.2e}"


@row("cuda_jit_small")
def _():
    assert fagen.load(SMALL).SMEM_BYTES <= 48 * 1024
    *_, err = against_reference(fagen.load(SMALL), SMALL, RAGGED)
    return f"smem {fagen.load(SMALL).SMEM_BYTES} B, max|err| {err:.2e}"


@row("cuda_thread_stream")
def _():
    module = fagen.load(BIG)
    (q, k, v), kw, out, lse, _ = against_reference(module, BIG, RAGGED)
    got = {}

    def run():  # a new thread: no context current until the driver makes the primary one current
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.default_stream())
        with torch.cuda.stream(side):
            got["out"], _ = module.forward(q, k, v, **kw)
        side.synchronize()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert torch.equal(got["out"], out), "a launch from another thread on a side stream differs"
    return "bitwise equal to the main thread's"


@row("cuda_use_cubin")
def _():
    module = fagen.load(BIG)
    (q, k, v), kw, out, _, _ = against_reference(module, BIG, RAGGED)
    jit = next(module.SOURCE.parent.glob(f"{module.SOURCE.stem}.*.{arch()}.cubin")).read_bytes()
    built = nvcc.compile_spec(BIG, arch(), tempfile.mkdtemp())
    assert built.cubin.read_bytes() == jit, "fagen build's cubin differs from the launcher's (two nvcc lines?)"
    module.use_cubin(built.cubin, arch())
    assert torch.equal(module.forward(q, k, v, **kw)[0], out)
    return "same cubin bytes, same bits"


@row("prebuilt_triton")
def _():
    spec = fagen.KernelSpec(head_dim=128, mask="causal", gqa=2, dtype="bf16")
    out_dir = Path(tempfile.mkdtemp())
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "fagen", "compile", "--head-dim", "128", "--mask", "causal",
                           "--gqa", "2", "--dtype", "bf16", "--arch", arch(), "-o", str(out_dir)],
                          capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    module = fagen.load(spec, build_dir=out_dir)
    from fagen.runtime.prebuilt import PrebuiltKernel

    assert any(isinstance(v, PrebuiltKernel) for v in vars(module).values())
    *_, err = against_reference(module, spec, RAGGED)
    return f"max|err| {err:.2e}"


@row("compile_fwd_bwd")
def _():
    torch._dynamo.reset()
    spec = fagen.KernelSpec(head_dim=64, mask="causal", gqa=2, dtype="bf16")
    (q, k, v), _ = Problem(batch=2, heads_kv=2, seq_q=300, seq_k=377, seed=3).inputs(spec, "cuda")

    def layer(q, k, v):
        return fagen.attention(q, k, v, mask="causal", softcap=20.0).float().square().sum()

    grads = []
    for f in (torch.compile(layer, fullgraph=True), layer):
        leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
        f(*leaves).backward()
        grads.append([t.grad for t in leaves])
    errs = [compare(f"d{n}", a, b, atol=2e-2, rtol=2e-2, expected="eager")
            for n, a, b in zip("qkv", *grads)]
    return f"grads vs eager max|err| {max(errs):.2e}"


@row("compile_decode")
def _():
    torch._dynamo.reset()
    spec = fagen.KernelSpec(head_dim=128, mask="causal", gqa=4, dtype="bf16")
    (q, k, v), _ = Problem(batch=3, heads_kv=2, seq_q=4, seq_k=4100, seed=4).inputs(spec, "cuda")
    q, k, v = (t.cuda() for t in (q, k, v))
    f = torch.compile(lambda q, k, v: fagen.attention(q, k, v, mask="causal"), fullgraph=True)
    err = compare("out", f(q, k, v), fagen.attention(q, k, v, mask="causal"), **TOLERANCE[spec.dtype],
                  expected="eager")
    return f"vs eager max|err| {err:.1e}"


def timing():
    import triton.testing

    spec = fagen.KernelSpec(head_dim=128, mask="causal", dtype="bf16", backend="cuda")
    module = fagen.load(spec)
    b, h, s, d = 1, 16, 8192, 128
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    module.forward(q, k, v)
    index = torch.cuda.current_device()
    _, function = module._loaded[index]
    cuda = driver.cuda_driver()
    flops = 4 * b * h * s * s * d / 2
    result = {}
    for label, config in (("prefer_shared", 1), ("prefer_none", 0), ("prefer_shared_again", 1)):
        cuda.check(cuda.lib.cuFuncSetCacheConfig(function, config), "cuFuncSetCacheConfig")
        ms = triton.testing.do_bench(lambda: module.forward(q, k, v), warmup=50, rep=300)
        result[label] = round(flops / ms / 1e9, 1)
    return result


def main():
    print(f"GPU {torch.cuda.get_device_name()} ({arch()}), torch {torch.__version__}, {nvcc.nvcc_version()}")
    rows = [run_check(name, fn) for name, fn in CHECKS]
    try:
        tf = timing()
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        tf = {"error": f"{type(e).__name__}: {e}"}
    print("\n| check | result | s | detail |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['check']} | {'PASS' if r['ok'] else 'FAIL'} | {r['seconds']} | {r['detail']} |")
    print(f"\nCUDA backend d128 bf16 causal B1 H16 S8192 forward, TF/s: {tf}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_driver.json").write_text(json.dumps({"rows": rows, "tflops": tf}, indent=1))
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
