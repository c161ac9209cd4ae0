"""A test harness: a tiny Triton kernel that evaluates an emitted mod over a (B, H, Sq, Sk) grid, so emitted code
is checked against the user's own Python function evaluated by torch (under TRITON_INTERPRET=1 on the CPU)."""

import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

from fagen.mods import emit, ir

# The modded kernels' tests' max abs error against the float64 reference (test_mods_kernels, test_mods_layouts):
# fp32, kernel rounding over D <= 32; fp16, its inputs' rounding.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}

_KERNEL = '''
import triton
import triton.language as tl
{helpers}

@triton.jit
def mod_kernel(out_ptr, score_ptr, {args}NH: tl.constexpr, SQ: tl.constexpr, SK: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // NH
    h = pid % NH
    q_idx = tl.arange(0, SQ)[:, None]
    kv_idx = tl.arange(0, SK)[None, :]
    offs = pid * SQ * SK + q_idx * SK + kv_idx
    score = tl.load(score_ptr + offs)
    value = {expr}
    tl.store(out_ptr + offs, (value + tl.zeros([SQ, SK], tl.int32)).to(tl.float32))
'''
_TORCH_DTYPE = {"i32": torch.int32, "fp32": torch.float32}


def run(tree: ir.Node, tensors: dict, scalars: dict, score: torch.Tensor) -> torch.Tensor:
    """The tree's value over score's [B, H, Sq, Sk] grid (Sq, Sk powers of two), as float32."""
    names = {"score": "score", "b": "b", "h": "h", "q_idx": "q_idx", "kv_idx": "kv_idx"}
    args, values = [], []
    for name, t in sorted(tensors.items()):
        ref = emit.TensorRef(f"t_{name}", tuple(f"t_{name}_s{i}" for i in range(t.dim())),
                             tuple(f"t_{name}_n{i}" for i in range(t.dim())))
        names[name] = ref
        args += [ref.ptr, *ref.strides, *ref.sizes]
        values += [t, *t.stride(), *t.shape]
    for name, v in sorted(scalars.items()):
        names[name] = f"s_{name}"
        args.append(f"s_{name}")
        values.append(v)
    src = _KERNEL.format(helpers=emit.TRITON_HELPERS, args="".join(a + ", " for a in args),
                         expr=emit.to_triton(tree, names))
    path = Path(tempfile.mkdtemp(prefix="fagen-mods-")) / "mod_kernel.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"mod_kernel_{abs(hash(src))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    B, H, SQ, SK = score.shape
    out = torch.empty(B, H, SQ, SK, dtype=torch.float32, device=score.device)
    module.mod_kernel[(B * H,)](out, score.float().contiguous(), *values, NH=H, SQ=SQ, SK=SK)
    return out


def indices(B, H, SQ, SK):
    """Broadcast int64 index tensors b, h, q_idx, kv_idx, as the float64 reference passes them."""
    return (torch.arange(B).view(-1, 1, 1, 1), torch.arange(H).view(1, -1, 1, 1),
            torch.arange(SQ).view(1, 1, -1, 1), torch.arange(SK).view(1, 1, 1, -1))
