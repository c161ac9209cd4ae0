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
import functools

from fagen.mods import ir
from fagen.mods.grad import COLUMN, DIAGONAL, ROW, SCORE, TILE
from fagen.mods.emit import GLUON_HELPERS, TRITON_HELPERS, TensorRef, in_range, to_gluon, to_triton
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


# [Note] Hoisted loads. A key loop's program has fixed b, h and query rows (the forward and dQ), or fixed b and key
# columns (dK/dV, whose loop also walks the heads of a GQA group). A subtree of a mod that reads a captured tensor
# and depends on nothing else that varies in the loop (document_id[q_idx], q_idx - offsets[document_id[q_idx]])
# is the same on every step: `hoist` replaces each largest such subtree by a placeholder (a Scalar named `_mod<p><k>`,
# a name no user name can take), and the kernel computes it once before the loop into `mod<p><k>` ([BLOCK_M, 1],
# [BLOCK_N, 1] or a scalar), so the loop loads only what varies with its steps.
def hoist(tree: ir.Node, fixed: frozenset, prefix: str) -> tuple[ir.Node, tuple[tuple[str, ir.Node], ...]]:
    """(tree with its loop-invariant loads replaced by placeholders, ((placeholder name, subtree), ...))."""
    found: list[tuple[str, ir.Node]] = []

    def inputs(n: ir.Node) -> set:
        own = {n.name} if isinstance(n, ir.Input) else set()
        return own.union(*(inputs(c) for c in n.children()))

    def loads(n: ir.Node) -> bool:
        return isinstance(n, ir.Load) or any(loads(c) for c in n.children())

    def walk(n: ir.Node) -> ir.Node:
        if loads(n) and inputs(n) <= fixed:
            for name, sub in found:
                if sub == n:
                    return ir.Scalar(name, n.type)
            found.append((f"_mod{prefix}{len(found)}", n))
            return ir.Scalar(found[-1][0], n.type)
        changes = {}
        for f in dataclasses.fields(n):
            value = getattr(n, f.name)
            if isinstance(value, ir.Node):
                changes[f.name] = walk(value)
            elif isinstance(value, tuple) and value and all(isinstance(v, ir.Node) for v in value):
                changes[f.name] = tuple(walk(v) for v in value)
        return dataclasses.replace(n, **changes) if changes else n

    return walk(tree), tuple(found)


def _has_tanh(n: ir.Node) -> bool:
    return (isinstance(n, ir.Unary) and n.op == "tanh") or any(_has_tanh(c) for c in n.children())


def _reads_score(n: ir.Node) -> bool:
    return (isinstance(n, ir.Input) and n.name == "score") or any(_reads_score(c) for c in n.children())


# The diagonal class's diagonals per gather ([Note] Deterministic captured-tensor gradients in triton/mods.j2): a
# [DIAGONALS, BLOCK_M] gather of each diagonal's key per query. ptxas sm_90, the bench's learned bias (m128n64w8s2):
# 90 spilled words in the dK/dV kernel at 64 or 128 diagonals, 106 at 32; gathering each diagonal's query per key
# ([BLOCK_N, r] along the queries) spilled 122-192.
DIAGONALS = 64
# [Note] Diagonal sums through a scratch (twenty-third session, docs/mods.md "The learned bias's gradient"). DIAG_SUMS
# picks how a dense dK/dV tile [BLOCK_N keys j, BLOCK_M queries i] gets its diagonal sums (r = i - j + BLOCK_N - 1):
#   0: the tl.gather above, DIAGONALS diagonals at a time ([DIAGONALS, BLOCK_M] gathers of the tile);
#   1: the tile stored to a per-program scratch behind MG with its keys reversed ([i, BLOCK_N - 1 - j] at
#      i * BLOCK_N + BLOCK_N - 1 - j) and read back at i * (BLOCK_N - 1) + r, masked to the band: diagonal r is a
#      column of a [BLOCK_M, DIAGONALS] load, summed over the queries; two CTA barriers a step (the last step's reads
#      before the stores, the stores before the reads);
#   2: as 1 with rows of W = the chunks' width (a multiple of DIAG_CHUNK): [i, r] at i * W + r, zeros around the band
#      (the host zeroes the scratch once; the band is all a step writes), read unmasked and vectorised, DIAG_CHUNK
#      diagonals a load and a sum (256: the bench's 191 in one; 64 spilled 113 words, 256 63, ptxas sm_90);
#   3: a rotation: one tl.gather of the tile's own shape, [j', i] = tile[(j' + i) % BLOCK_N, i]: the wrap count
#      c = (j' + i) // BLOCK_N splits row j' into diagonals r = (c + 1) BLOCK_N - 1 - j', each a masked row sum (no
#      scratch, no barrier of ours);
#   4: 2 a step late in the flat loops: a step stores its tile into one of two buffers and sums the other's after
#      one barrier; the last tile after the loop (grad_pipe).
# Read at each render (render_state keys on it); varlen specs keep 0. H200, the mods suite's learned-bias+grad row
# (scripts/gpu_lbgrad_s23.py rounds B and C): the backward 0.470x the gather's with 1, 0.4785x with 2, 0.5945x with 3,
# 0.5651x with 4 (100 TF/s against 48 with 1 or 2); float64 checks passed (2-4 on the H200, 1 in the interpreter;
# 1's GPU results at S 8192 the product's: dq, dk, dv bitwise, d(bias) within 1.9e-7). On: 1 (no zero fill, half
# 2's scratch, wgmma not serialised; twenty-third session, docs/mods.md).
DIAG_SUMS = 1
DIAG_CHUNK = 256
# Its CTA barrier: bar.sync 0 as an asm statement with a side effect (tl.debug_barrier in the loop turns Triton's
# software pipelining of the Q and dO loads off: no cp.async, 62 KB less shared memory, ptxas sm_90). It passes x
# through, so what reads its result is ordered after it. The interpreter runs a program's tensor ops in order: none;
# ROCm (no PTX): tl.debug_barrier.
CTA_BARRIER = '''

_MOD_CTA_BARRIER = tl.constexpr(0 if os.environ.get("TRITON_INTERPRET", "0") == "1" else
                                 2 if torch.version.hip is not None else 1)  # (no PTX on ROCm)


@triton.jit
def _mod_cta_barrier(x):
    """bar.sync 0 (every thread of the program), returning x ([Note] Diagonal sums through a scratch)."""
    if _MOD_CTA_BARRIER == 2:
        tl.debug_barrier()
    if _MOD_CTA_BARRIER == 1:
        x = tl.inline_asm_elementwise("bar.sync 0;\\n\\tmov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False,
                                      pack=1)
    return x
'''


class ModCode:
    """What a template emits for a spec's mods: Triton expressions of the score_mod, its d/d score and the mask_mod
    at given kernel names, all printed from the parsed trees by fagen.mods.emit (never from the user's text). A
    backend 'gluon' spec gets Gluon ones (to_gluon, GLUON_HELPERS; [Note] Gluon mods in fagen/mods/emit.py)."""

    def __init__(self, spec) -> None:
        from fagen.mods.grad import d_score
        from fagen.mods.simplify import simplify
        from fagen.mods.text import parse

        self.args = ModArgs(tuple(ModTensor(*t) for t in spec.mod_tensors),
                            tuple(ModScalar(*s) for s in spec.mod_scalars))
        decls = (self.args.tensors, self.args.scalars)
        # the kernels compute the trees as [Note] Mask algebra rewrites them (fagen/mods/simplify.py): the same
        # values with fewer loads; rewritten here, before the loops' invariant parts are hoisted out of them
        self.score_tree = simplify(parse(spec.score_mod, "score_mod", *decls)) if spec.score_mod is not None else None
        self.mask_tree = simplify(parse(spec.mask_mod, "mask_mod", *decls)) if spec.mask_mod is not None else None
        self.dscore_tree = d_score(self.score_tree) if self.score_tree is not None else None
        self.gluon = str(spec.backend) == "gluon"
        self.helpers = GLUON_HELPERS if self.gluon else TRITON_HELPERS
        self._to = to_gluon if self.gluon else to_triton
        self.packed = str(spec.layout) == "varlen"  # the captured-tensor gradients' workspace layout
        self.uses_tanh = any(_has_tanh(t) for t in (self.score_tree, self.mask_tree) if t is not None)
        # [Note] Captured-tensor gradients: one (tensor position, load, derivative) per distinct load of a float
        # tensor in the score_mod, and its index class (grad_classes); the dK/dV kernel sums each load's dS *
        # derivative over its tile along that class and writes the sums with their elements' linear indices into
        # workspaces the host reduces in a fixed order (grad_stores; grad_host in fagen/templates/triton/mods.j2).
        from fagen.mods.grad import d_loads, index_class

        self.grad_loads = []
        if self.score_tree is not None:
            for i, t in enumerate(self.args.tensors):
                if t.dtype in ("fp32", "fp16", "bf16"):
                    self.grad_loads += [(i, load, deriv) for load, deriv in d_loads(self.score_tree, t.name)]
        self.grad_classes = [index_class(load) for _, load, _ in self.grad_loads]
        on = DIAGONAL in self.grad_classes and not self.packed and not self.gluon  # the Triton backward's sums only
        self.diag_scratch = {1: 1, 2: 2, 4: 2}.get(DIAG_SUMS, 0) if on else 0
        self.diag_pipe = on and DIAG_SUMS == 4  # 2 a step late, in the flat loops (dkdv_flat: grad_pipe)
        self.diag_rotate = on and DIAG_SUMS == 3
        self.diagonals = DIAG_CHUNK if self.diag_scratch == 2 else DIAGONALS  # the diagonals a load (a gather) sums
        # the scratch's row length per query: 1 BLOCK_N (the band read masked), 2 the chunks' width (zeros outside)
        chunks = f"(((BLOCK_M + BLOCK_N - 2) // {self.diagonals} + 1) * {self.diagonals})"
        self.diag_width = {1: "BLOCK_N", 2: chunks}.get(self.diag_scratch)
        if self.diag_scratch:
            self.helpers += CTA_BARRIER

    def _names(self, score, b, h, q_idx, kv_idx) -> dict:
        return {"score": score, "b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx, **self.args.refs()}

    @functools.lru_cache(maxsize=None)
    def _hoisted(self, field: str, prefix: str, fixed: str):
        return hoist(self.score_tree if field == "score" else self.mask_tree, frozenset(fixed.split()), prefix)

    def _tree(self, field: str, hoisted: str | None, names: dict):
        """The field's tree, with its hoisted subtrees' placeholders named (hoisted: "prefix fixed inputs...")."""
        if not hoisted:
            return self.score_tree if field == "score" else self.mask_tree
        prefix, fixed = hoisted.split(" ", 1)
        tree, found = self._hoisted(field, prefix, fixed)
        names.update({name: name[1:] for name, _ in found})
        return tree

    def prelude(self, field: str, hoisted: str, b: str, h: str, q_idx: str, kv_idx: str, pad: str) -> str:
        """The assignments of a field's hoisted subtrees ([Note] Hoisted loads), one line each, before the loop."""
        if (self.score_tree if field == "score" else self.mask_tree) is None:
            return ""
        prefix, fixed = hoisted.split(" ", 1)
        names = self._names("", b, h, q_idx, kv_idx)
        return "".join(f"{pad}{name[1:]} = {self._to(sub, names)}\n"
                       for name, sub in self._hoisted(field, prefix, fixed)[1])

    def score(self, score: str, b: str, h: str, q_idx: str, kv_idx: str, hoisted: str | None = None) -> str:
        names = self._names(score, b, h, q_idx, kv_idx)
        return self._to(self._tree("score", hoisted, names), names)

    def dscore(self, score: str, b: str, h: str, q_idx: str, kv_idx: str) -> str | None:
        """d score_mod / d score, or None where it is the constant 1 (additive mods: dS passes through); Gluon code
        for a backend 'gluon' spec (the Gluon backward's dS)."""
        tree = self.dscore_tree
        if isinstance(tree, ir.Const) and tree.value == 1:
            return None
        return self._to(tree, self._names(score, b, h, q_idx, kv_idx))

    def additive(self, b: str, h: str, q_idx: str, kv_idx: str, hoisted: str | None = None,
                 unclamped: bool = False, split: dict | None = None) -> str | None:
        """X where the score_mod is `score + X` (or `X + score`) and X does not read the score, else None: the
        kernels then add X / ln 2 to the log2-domain score in one FMA, instead of leaving and re-entering that
        domain around the mod (a relative bias, ALiBi, a learned bias). unclamped (Gluon): its loads without
        _mod_index, for the tiles where `in_range` holds ([Note] Clamp-free tiles in fagen/mods/emit.py); split:
        with it, the positions as base + offsets ([Note] Split offsets)."""
        names = self._names("", b, h, q_idx, kv_idx)
        tree = self._tree("score", hoisted, names)
        if not (isinstance(tree, ir.Binary) and tree.op == "+"):
            return None
        for this, other in ((tree.a, tree.b), (tree.b, tree.a)):
            if this == ir.Input("score", ir.FLOAT) and not _reads_score(other):
                code = to_gluon(other, names, unclamped=True, split=split) if unclamped and self.gluon \
                    else self._to(other, names)
                return code if other.type == ir.FLOAT else f"({code}).to({'gl' if self.gluon else 'tl'}.float32)"
        return None

    def kv_slope(self, b: str, h: str) -> str | None:
        """A where the score_mod is `score + kv_idx * A` (either order of either sum or product) and A, a float, reads
        neither the score nor a position (the row-free ALiBi, fagen/mods/lower.py): the Gluon forward then adds
        X / ln 2 as float(kv_idx) times one scalar ([Note] Additive mods in the Gluon forward); else None."""
        tree = self.score_tree
        if not self.gluon or not (isinstance(tree, ir.Binary) and tree.op == "+"):
            return None
        kv = ir.Input("kv_idx", ir.INT)
        for this, other in ((tree.a, tree.b), (tree.b, tree.a)):
            if this == ir.Input("score", ir.FLOAT) and isinstance(other, ir.Binary) and other.op == "*":
                for x, a in ((other.a, other.b), (other.b, other.a)):
                    if x == kv and a.type == ir.FLOAT and not any(
                            isinstance(n, ir.Input) and n.name in ("score", "q_idx", "kv_idx") for n in ir.walk(a)):
                        return self._to(a, self._names("", b, h, "", ""))
        return None

    def host_unit_strides(self) -> str | None:
        """Python source over the host's mt<i>: every stride the split offsets multiply per score is 1 ([Note] Split
        offsets in fagen/mods/emit.py), or None where no load index reads q_idx affinely."""
        from fagen.mods.emit import q_dims

        dims = q_dims(self.score_tree) if self.gluon and self.score_tree is not None else None
        if not dims:
            return None
        pos = {t.name: i for i, t in enumerate(self.args.tensors)}
        return " and ".join(f"mt{pos[name]}.stride({d}) == 1" for name, d in dims)

    def in_range(self, b: str, h: str, q_range: tuple[str, str], kv_range: tuple[str, str]) -> str | None:
        """The tile-uniform condition under which the score_mod's loads may skip _mod_index ([Note] Clamp-free tiles
        in fagen/mods/emit.py), for a Gluon spec; q_range, kv_range: the tile's least and greatest row and key."""
        if not self.gluon or self.score_tree is None:
            return None
        return in_range(self.score_tree, self._names("", b, h, "", ""), {"q_idx": q_range, "kv_idx": kv_range})

    def host_in_range(self, b: tuple[str, str], h: tuple[str, str], q_range: tuple[str, str],
                      kv_range: tuple[str, str]) -> str | None:
        """Python source of the same condition over a whole problem, for the host ([Note] Clamp-free problems in
        fagen/mods/emit.py): each position a (least, greatest) pair of host int expressions; the captured tensors'
        sizes and strides and the scalars as the host's mt<i> and ms<j> names."""
        if not self.gluon or self.score_tree is None:
            return None
        names: dict = {"score": ""}
        for i, t in enumerate(self.args.tensors):
            names[t.name] = TensorRef(f"mt{i}", tuple(f"mt{i}.stride({d})" for d in range(t.rank)),
                                      tuple(f"mt{i}.shape[{d}]" for d in range(t.rank)))
        names.update({s.name: f"ms{j}" for j, s in enumerate(self.args.scalars)})
        return in_range(self.score_tree, names, {"b": b, "h": h, "q_idx": q_range, "kv_idx": kv_range}, host=True)

    def visible(self, b: str, h: str, q_idx: str, kv_idx: str, hoisted: str | None = None) -> str:
        names = self._names("", b, h, q_idx, kv_idx)
        return self._to(self._tree("mask", hoisted, names), names)

    def _linear(self, i: int, load, score: str, h: str, q: str, kv: str) -> str:
        """The linear element index of load (of tensor i) at (q, kv), clamped as the forward reads it."""
        names = self._names(score, "off_b", h, q, kv)
        out = "0"
        for d, index in enumerate(load.index):
            clamped = f"_mod_index({to_triton(index, names)}, mt{i}_n{d})"
            out = (f"({out}) * mt{i}_n{d} + " if d else "") + clamped
        return out

    def _scratch(self, k: int, bufs: int) -> str:
        """This program's scratch behind MG<k> ([Note] Diagonal sums through a scratch), `bufs` tiles a program."""
        chunks = "((BLOCK_M + BLOCK_N - 2) // BLOCK_M + 1)"
        return (f"MG{k} + ((tl.num_programs(2) * num_heads).to(tl.int64) * (g_nk * {chunks}) * g_len + ((off_b * "
                f"tl.num_programs(1) + off_h // GQA) * tl.num_programs(0) + n0 // BLOCK_N).to(tl.int64) * "
                f"({bufs} * BLOCK_M * {self.diag_width}))")

    def grad_pipe(self, part: str, pad: str) -> str:
        """DIAG_SUMS 4: lever 2 a step late ([Note] Diagonal sums through a scratch). 'init' before a flat loop (the
        tile waiting in the scratch: its query block g_pm, head g_ph, whether any g_has, its buffer g_par); 'read'
        after a step's dots (a barrier, then that tile summed into MG while the step's MMAs run); 'flush' after."""
        if part == "init":
            lines = ["g_pm = lo * 0  # the tile in the scratch: query block, head, whether any, buffer",
                     "g_ph = off_h * 0", "g_has = lo * 0", "g_par = lo * 0"]
        else:
            chunks = "((BLOCK_M + BLOCK_N - 2) // BLOCK_M + 1)"
            w, ch = self.diag_width, self.diagonals
            lines = ["g_tok = _mod_cta_barrier(n0 // BLOCK_N)  # the last stores seen, the reads before them done",
                     "if g_has != 0:",
                     "    g_nk = (seq_k + BLOCK_N - 1) // BLOCK_N",
                     f"    g_len = (stride_sh // BLOCK_M + {chunks} - 1) * BLOCK_M + (g_nk - 1) * BLOCK_N",
                     "    g_kb = g_nk - 1 - n0 // BLOCK_N",
                     "    g_bh = (off_b * num_heads + g_ph).to(tl.int64)",
                     "    g_i = tl.arange(0, BLOCK_M)"]
            for k, ((i, load, _), cls) in enumerate(zip(self.grad_loads, self.grad_classes)):
                if cls != DIAGONAL:
                    continue
                lines += [f"    g_ws = {self._scratch(k, 2)} + (g_par + g_tok - n0 // BLOCK_N) * (BLOCK_M * {w})",
                          f"    for g_c in tl.static_range(0, (BLOCK_M + BLOCK_N - 2) // {ch} + 1):",
                          f"        g_r = g_c * {ch} + tl.arange(0, {ch})",
                          f"        g_sum = tl.sum(tl.load(g_ws + g_i[:, None] * {w} + g_r[None, :]), 0)",
                          "        g_p = g_pm + g_r + g_kb * BLOCK_N",
                          "        g_keep = g_r < BLOCK_M + BLOCK_N - 1",
                          f"        g_row = (g_bh * g_nk + g_kb) * {chunks} + g_r // BLOCK_M",
                          f"        g_idx = {self._linear(i, load, '', 'g_ph', 'g_pm + g_r', 'n0 + BLOCK_N - 1')}",
                          f"        tl.store(MG{k} + g_row * g_len + g_p, g_sum, mask=g_keep)",
                          f"        tl.store(MGI{k} + g_bh * g_len + g_p, g_idx.to(tl.int64), mask=g_keep)"]
        return "".join(pad + line + "\n" for line in lines)

    def grad_stores(self, ds: str, p: str, score: str, h: str, q_idx: str, kv_idx: str, pad: str,
                    pipe: bool = False) -> str:
        """The dK/dV loop's stores of each captured-tensor load's dS * derivative into its workspace pair (MG<k>,
        MGI<k>), where the host asked for them: summed over the tile along its [Note] Gradient index classes
        (fagen/mods/grad.py) with one linear element index per sum, or one pair per score (SCORE). The tile is
        [BLOCK_N keys `cols`, BLOCK_M queries `rows`] of key block n0 and query block start_m; the layouts are
        grad_host's ([Note] Deterministic captured-tensor gradients in fagen/templates/triton/mods.j2)."""
        lines = []
        # dense: [B, Hq, Sq, Sk]; varlen: [B, Hq, S_pad, max_seqlen_k] per sequence (stride_sh is S_pad >= len_q)
        rows, keys, q_in, kv_in = ("stride_sh", "mg_sk", "len_q", "tl.minimum(len_k, mg_sk)") if self.packed else \
            ("seq_q", "seq_k", "seq_q", "seq_k")
        for k, ((i, load, deriv), cls) in enumerate(zip(self.grad_loads, self.grad_classes)):
            linear = functools.partial(self._linear, i, load, score, h)

            value = f"{ds} * ({to_triton(deriv, self._names(score, 'off_b', h, q_idx, kv_idx))})"
            gin = f"({q_idx} < {q_in}) & ({kv_idx} < {kv_in})"
            lines.append(f"if MG{k} is not None:  # {cls}")
            if cls == SCORE:
                lines += [f"    gpos = ((off_b * num_heads + {h}).to(tl.int64) * {rows} + {q_idx}) * {keys} + {kv_idx}",
                          f"    tl.store(MG{k} + gpos, tl.where({p} == 0.0, 0.0, {value}), mask={gin})",
                          f"    tl.store(MGI{k} + gpos, ({linear(q_idx, kv_idx)}).to(tl.int64) + gpos * 0, mask={gin})"]
                continue
            # the tile's values (0 outside the sequence and where P = 0), then its sums along the class
            lines += [f"    gval = tl.where(({p} != 0.0) & {gin}, {value}, 0.0)",
                      "    g_nk = (" + keys + " + BLOCK_N - 1) // BLOCK_N  # key blocks",
                      "    g_nq = stride_sh // BLOCK_M  # query blocks (S_pad: a multiple of BLOCK_M)",
                      f"    g_bh = (off_b * num_heads + {h}).to(tl.int64)",
                      "    g_in = start_m < stride_sh  # a block-mask block's steps may reach past S_pad"]
            if cls == TILE:
                lines += ["    gpos = (g_bh * g_nk + n0 // BLOCK_N) * g_nq + start_m // BLOCK_M",
                          "    if g_in:  # a branch, not a scalar mask (triton 3.9's interpreter refuses those)",
                          f"        tl.store(MG{k} + gpos, tl.sum(tl.sum(gval, 1), 0))",
                          f"        tl.store(MGI{k} + g_bh, ({linear('start_m', 'n0')}).to(tl.int64))"]
            elif cls == ROW:
                lines += ["    gpos = (g_bh * g_nk + n0 // BLOCK_N) * stride_sh + rows",
                          f"    tl.store(MG{k} + gpos, tl.sum(gval, 0), mask=rows < stride_sh)",
                          f"    tl.store(MGI{k} + g_bh * stride_sh + rows, ({linear('rows', 'n0')}).to(tl.int64), "
                          f"mask=rows < {q_in})"]
            elif cls == COLUMN:
                lines += ["    gpos = (g_bh * g_nq + start_m // BLOCK_M) * (g_nk * BLOCK_N) + cols",
                          "    if g_in:  # a branch, not a scalar in the mask (triton 3.9's interpreter refuses those)",
                          f"        tl.store(MG{k} + gpos, tl.sum(gval, 1))",
                          f"        tl.store(MGI{k} + g_bh * (g_nk * BLOCK_N) + cols, ({linear('start_m', 'cols')})"
                          f".to(tl.int64), mask=cols < {kv_in})"]
            else:  # DIAGONAL: r = i - j + BLOCK_N - 1 of query i, key j, gathered DIAGONALS diagonals at a time
                chunks = "((BLOCK_M + BLOCK_N - 2) // BLOCK_M + 1)"  # of BLOCK_M diagonals (a constexpr)
                lines += [f"    g_len = (g_nq + {chunks} - 1) * BLOCK_M + (g_nk - 1) * BLOCK_N  # diagonals per (b, h)",
                          "    g_kb = g_nk - 1 - n0 // BLOCK_N",
                          "    g_q = tl.arange(0, BLOCK_M)[None, :]"]
                if pipe and self.diag_pipe:  # the tile into the other buffer; summed at the next step's read
                    lines += ["    g_i = tl.arange(0, BLOCK_M)",
                              f"    g_ws = {self._scratch(k, 2)} + (1 - g_par) * (BLOCK_M * {self.diag_width})",
                              "    g_j = (BLOCK_N - 1) - tl.arange(0, BLOCK_N)  # the keys reversed",
                              f"    tl.store(g_ws + g_i[None, :] * {self.diag_width} + g_j[:, None] + g_i[None, :], gval)"]
                    continue
                if self.diag_scratch:  # [Note] Diagonal sums through a scratch
                    lines += ["    g_i = tl.arange(0, BLOCK_M)",
                              "    g_n = _mod_cta_barrier(n0 // BLOCK_N)  # the last step's reads are done",
                              "    g_ws = MG%d + ((tl.num_programs(2) * num_heads).to(tl.int64) * (g_nk * %s) * g_len"
                              % (k, chunks),
                              "            + ((off_b * tl.num_programs(1) + off_h // GQA) * tl.num_programs(0)"
                              f" + g_n).to(tl.int64) * (BLOCK_M * {self.diag_width}))  # this program's scratch",
                              "    g_j = (BLOCK_N - 1) - tl.arange(0, BLOCK_N)  # the keys reversed",
                              f"    tl.store(g_ws + g_i[None, :] * {self.diag_width} + g_j[:, None]"
                              + (" + g_i[None, :]" if self.diag_scratch == 2 else "") + ", gval)",
                              "    g_n = _mod_cta_barrier(g_n)  # the stores are seen"]
                if self.diag_rotate:  # [Note] Diagonal sums through a scratch, 3
                    lines += ["    g_src = tl.arange(0, BLOCK_N)[:, None] + tl.arange(0, BLOCK_M)[None, :]  # j' + i",
                              "    g_w = g_src // BLOCK_N  # the wraps",
                              "    g_rot = tl.gather(gval, g_src - g_w * BLOCK_N, 0)  # [j', i]: gval[(j' + i) % BLOCK_N, i]",
                              "    for g_c in tl.static_range(0, (BLOCK_M + BLOCK_N - 2) // BLOCK_N + 1):  # c wraps: r = "
                              "(c + 1) BLOCK_N - 1 - j'",
                              "        g_sum = tl.sum(tl.where(g_w == g_c, g_rot, 0.0), 1)",
                              "        g_r = g_c * BLOCK_N + (BLOCK_N - 1) - tl.arange(0, BLOCK_N)"]
                else:
                    lines += [f"    for g_c in tl.static_range(0, (BLOCK_M + BLOCK_N - 2) // {self.diagonals} + 1):"]
                if self.diag_scratch == 2:  # [i, i + BLOCK_N - 1 - j] = [i, r]: zeros outside the band, unmasked
                    lines += [f"        g_r = g_c * {self.diagonals} + tl.arange(0, {self.diagonals})",
                              f"        g_sum = tl.sum(tl.load(g_ws + (g_n - n0 // BLOCK_N) * BLOCK_M + g_i[:, None] * {self.diag_width}"
                              " + g_r[None, :]), 0)"]
                elif self.diag_scratch:  # keys reversed: [i, BLOCK_N - 1 - j], read at [i, r]
                    lines += [f"        g_r = g_c * {DIAGONALS} + tl.arange(0, {DIAGONALS})",
                              "        g_d = g_r[None, :] - g_i[:, None]  # [BLOCK_M, DIAGONALS]: BLOCK_N - 1 - the key",
                              "        g_ok = (g_d >= 0) & (g_d < BLOCK_N)  # (past S_pad: read, never stored)",
                              "        g_sum = tl.sum(tl.load(g_ws + (g_n - n0 // BLOCK_N) * BLOCK_M + g_i[:, None] * (BLOCK_N - 1)"
                              " + g_r[None, :], mask=g_ok, other=0.0), 0)"]
                elif not self.diag_rotate:
                    lines += [f"        g_r = g_c * {DIAGONALS} + tl.arange(0, {DIAGONALS})",
                              "        g_j = g_q - g_r[:, None] + (BLOCK_N - 1)  # the key of query i on diagonal r",
                              "        g_ok = (g_j >= 0) & (g_j < BLOCK_N)",
                              "        g_sum = tl.sum(tl.where(g_ok, tl.gather(gval, tl.where(g_ok, g_j, 0), 0), 0.0), 1)"]
                lines += [
                          "        g_p = start_m + g_r + g_kb * BLOCK_N  # the diagonal's place in its (b, h) line",
                          "        g_keep = g_r < BLOCK_M + BLOCK_N - 1",
                          f"        g_row = (g_bh * g_nk + g_kb) * {chunks} + g_r // BLOCK_M",
                          f"        g_idx = {linear('start_m + g_r', 'n0 + BLOCK_N - 1')}  # at one (q, kv) of each",
                          "        if g_in:  # a branch, not a scalar in the mask (triton 3.9's interpreter refuses those)",
                          f"            tl.store(MG{k} + g_row * g_len + g_p, g_sum, mask=g_keep)",
                          f"            tl.store(MGI{k} + g_bh * g_len + g_p, g_idx.to(tl.int64), mask=g_keep)"]
        if pipe and self.diag_pipe:  # this step's tile waits in the scratch
            lines += ["g_par = 1 - g_par", "g_pm = start_m + 0", f"g_ph = {h} + 0",
                      "g_has = (start_m < stride_sh).to(tl.int32)"]
        return "".join(pad + line + "\n" for line in lines)
