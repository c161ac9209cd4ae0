"""A user mod's kernel arguments: each captured tensor (pointer, one stride and one size per dimension) and each
runtime scalar, named by position so that no user name reaches a kernel identifier.

[Note] Mod argument names. Captured tensors are `mt<i>` (pointer), `mt<i>_s<d>` (stride of dim d) and
`mt<i>_n<d>` (size of dim d), and scalars `ms<j>`, with i and j the positions in the spec's sorted declarations.
User names are identifiers of letters, digits and `_`, so prefixing them could collide (tensor `a` with stride
`a_s0` and a tensor named `a_s0`); positions cannot. Every int among them (strides, sizes, int scalars) is listed
in `no_specialize`: Triton specialises an int argument equal to 1 or divisible by 16, so a captured length or a
closure int changing from 64 to 65 would otherwise compile a new kernel ([Note] Runtime scalars in docs/mods.md).

[Note] Captured strides. The attention kernels (fagen.codegen.signatures.mod_jit) list the strides in
do_not_specialize_on_alignment instead: Triton then still specialises a stride equal to 1, so the innermost
dimension of a contiguous captured tensor costs no multiply per element (a relative bias's gather is one per
score), and never specialises on divisibility by 16. A stride is the tensor's layout, not a closure value: it
changes (and compiles a second kernel) only when the caller passes a tensor laid out differently. The AOT build
keeps every stride an i32, correct for any layout.
"""

from __future__ import annotations

import dataclasses

from fagen.mods import ir
from fagen.mods.emit import TRITON_HELPERS, TensorRef, to_triton
from fagen.mods.text import ModScalar, ModTensor


@dataclasses.dataclass(frozen=True)
class ModArgs:
    """The kernel parameters of a spec's captured tensors and scalars, in declaration order."""

    tensors: tuple[ModTensor, ...]
    scalars: tuple[ModScalar, ...]

    def refs(self) -> dict:
        """to_triton's names for the captured values (each tensor a TensorRef, each scalar its parameter)."""
        out: dict = {}
        for i, t in enumerate(self.tensors):
            out[t.name] = TensorRef(f"mt{i}", tuple(f"mt{i}_s{d}" for d in range(t.rank)),
                                    tuple(f"mt{i}_n{d}" for d in range(t.rank)))
        for j, s in enumerate(self.scalars):
            out[s.name] = f"ms{j}"
        return out

    def params(self) -> list[str]:
        """The parameter names, in order: per tensor its pointer, strides and sizes; then the scalars."""
        names = []
        for i, t in enumerate(self.tensors):
            names += [f"mt{i}", *(f"mt{i}_s{d}" for d in range(t.rank)), *(f"mt{i}_n{d}" for d in range(t.rank))]
        return names + [f"ms{j}" for j in range(len(self.scalars))]

    def no_specialize(self) -> list[str]:
        """The int parameters (strides, sizes, int scalars): Triton must not specialise them by value."""
        names = []
        for i, t in enumerate(self.tensors):
            names += [*(f"mt{i}_s{d}" for d in range(t.rank)), *(f"mt{i}_n{d}" for d in range(t.rank))]
        return names + [f"ms{j}" for j, s in enumerate(self.scalars) if s.type == ir.INT]

    def legend(self) -> list[str]:
        """`mt0 = bias (fp32, rank 2)` lines for the generated source's header (names are validated identifiers)."""
        return [f"mt{i} = {t.name} ({t.dtype}, rank {t.rank})" for i, t in enumerate(self.tensors)] + \
            [f"ms{j} = {s.name} ({s.type})" for j, s in enumerate(self.scalars)]


def host_values(args: ModArgs, values: dict) -> list:
    """The launch values of `params()` from the captured values (name -> tensor or number)."""
    out: list = []
    for t in args.tensors:
        x = values[t.name]
        out += [x, *x.stride(), *x.shape]
    return out + [values[s.name] for s in args.scalars]


class ModCode:
    """What a template emits for a spec's mods: Triton expressions of the score_mod, its d/d score and the mask_mod
    at given kernel names, all printed from the parsed trees by fagen.mods.emit (never from the user's text)."""

    def __init__(self, spec) -> None:
        from fagen.mods.grad import d_score
        from fagen.mods.text import parse

        self.args = ModArgs(tuple(ModTensor(*t) for t in spec.mod_tensors),
                            tuple(ModScalar(*s) for s in spec.mod_scalars))
        decls = (self.args.tensors, self.args.scalars)
        self.score_tree = parse(spec.score_mod, "score_mod", *decls) if spec.score_mod is not None else None
        self.mask_tree = parse(spec.mask_mod, "mask_mod", *decls) if spec.mask_mod is not None else None
        self.dscore_tree = d_score(self.score_tree) if self.score_tree is not None else None
        self.helpers = TRITON_HELPERS
        # [Note] Captured-tensor gradients: one (tensor position, load, derivative) per distinct load of a float
        # tensor in the score_mod; the dK/dV kernel writes each load's dS * derivative and its element's linear
        # index into a workspace the host reduces in a fixed order (fagen/templates/triton/mods.j2).
        from fagen.mods.grad import d_loads

        self.grad_loads = []
        if self.score_tree is not None:
            for i, t in enumerate(self.args.tensors):
                if t.dtype in ("fp32", "fp16", "bf16"):
                    self.grad_loads += [(i, load, deriv) for load, deriv in d_loads(self.score_tree, t.name)]

    def _names(self, score, b, h, q_idx, kv_idx) -> dict:
        return {"score": score, "b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx, **self.args.refs()}

    def score(self, score: str, b: str, h: str, q_idx: str, kv_idx: str) -> str:
        return to_triton(self.score_tree, self._names(score, b, h, q_idx, kv_idx))

    def dscore(self, score: str, b: str, h: str, q_idx: str, kv_idx: str) -> str | None:
        """d score_mod / d score, or None where it is the constant 1 (additive mods: dS passes through)."""
        tree = self.dscore_tree
        if isinstance(tree, ir.Const) and tree.value == 1:
            return None
        return to_triton(tree, self._names(score, b, h, q_idx, kv_idx))

    def visible(self, b: str, h: str, q_idx: str, kv_idx: str) -> str:
        return to_triton(self.mask_tree, self._names("", b, h, q_idx, kv_idx))

    def grad_stores(self, ds: str, p: str, score: str, h: str, q_idx: str, kv_idx: str, pad: str) -> str:
        """The dK/dV loop's stores of each captured-tensor load's dS * derivative and linear element index into its
        workspace pair (MG<k>, MGI<k>) at the element's (b, h, q, kv) position, where the host asked for them."""
        lines = []
        names = self._names(score, "off_b", h, q_idx, kv_idx)
        for k, (i, load, deriv) in enumerate(self.grad_loads):
            linear = "0"
            for d, index in enumerate(load.index):
                clamped = f"_mod_index({to_triton(index, names)}, mt{i}_n{d})"
                linear = (f"({linear}) * mt{i}_n{d} + " if d else "") + clamped
            value = f"tl.where({p} == 0.0, 0.0, {ds} * ({to_triton(deriv, names)}))"
            lines += [f"if MG{k} is not None:",
                      f"    gpos = ((off_b * num_heads + {h}).to(tl.int64) * seq_q + {q_idx}) * seq_k + {kv_idx}",
                      f"    gin = ({q_idx} < seq_q) & ({kv_idx} < seq_k)",
                      f"    tl.store(MG{k} + gpos, {value}, mask=gin)",
                      f"    tl.store(MGI{k} + gpos, ({linear}).to(tl.int64) + gpos * 0, mask=gin)"]
        return "".join(pad + line + "\n" for line in lines)
