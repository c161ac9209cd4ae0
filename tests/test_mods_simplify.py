"""[Note] Mask algebra (fagen/mods/simplify.py): the rewritten tree has the tree's value everywhere, the document mask
loses its dependent loads, and the emitted kernel code (which sees the rewritten tree) still computes the user's
function."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fagen
import mods_kernel
from _env import DEVICE
from fagen.bench import gym_mods as g
from fagen.codegen.mod_args import ModCode
from fagen.mods import emit, ir
from fagen.mods.simplify import simplify
from fagen.mods.text import ModTensor, parse, to_text
from fagen.mods.trace import trace_mask_mod
from fagen.verify.mods_eval import _function
from fagen.verify.mods_reference import mask_mod_visible

DOC = ("(document_id[q_idx] == document_id[kv_idx]) & "
       "(q_idx - offsets[document_id[q_idx]] >= kv_idx - offsets[document_id[kv_idx]])")
TENSORS = (ModTensor("document_id", "i32", 1), ModTensor("offsets", "i32", 1))


def test_the_document_mask_reads_one_tensor_per_side():
    tree = parse(DOC, "mask_mod", TENSORS, ())
    assert to_text(simplify(tree)) == "(document_id[q_idx] == document_id[kv_idx]) & (q_idx >= kv_idx)"
    refs = {n: emit.TensorRef(f"p_{n}", (f"s_{n}",), (f"n_{n}",)) for n in ("document_id", "offsets")}
    code = emit.to_triton(simplify(tree), {"b": "b", "h": "h", "q_idx": "q", "kv_idx": "kv", **refs})
    assert "p_offsets" not in code and code.count("p_document_id") == 2
    # the kernels' code is printed from ModCode's trees: rewritten there, once, before hoisting
    spec = fagen.KernelSpec(head_dim=16, dtype="fp32", mask_mod=DOC, mod_tensors=[list(t) for t in TENSORS])
    assert ModCode(spec).mask_tree == simplify(tree)


def test_what_is_not_exact_stays():
    floats = parse("(bias[q_idx] == bias[kv_idx]) & (1.0 / bias[q_idx] > 1.0 / bias[kv_idx])", "mask_mod",
                   (ModTensor("bias", "fp32", 1),), ())
    assert simplify(floats) == floats  # 0.0 == -0.0, yet 1 / 0.0 != 1 / -0.0
    either = parse(DOC.replace(") & (", ") | ("), "mask_mod", TENSORS, ())
    assert "offsets" in to_text(simplify(either))  # only a conjunction may assume its equality
    both = parse("(d[q_idx + kv_idx] == d[kv_idx]) & (o[d[kv_idx]] > 0)", "mask_mod",
                 (ModTensor("d", "i32", 1), ModTensor("o", "i32", 1)), ())
    assert simplify(both) == both  # no side free of kv_idx to keep


# Random masks of the document family: an equality of two gathers, a comparison of sums that read through them.
_side = st.sampled_from(["q_idx", "kv_idx"])


@st.composite
def _masks(draw):
    a, b = draw(_side), draw(_side)
    ka, kb = draw(st.integers(-3, 3)), draw(st.integers(-3, 3))
    op = draw(st.sampled_from(ir.COMPARE))
    left = f"{a} + {ka} - o[d[{a}]]" if draw(st.booleans()) else f"{a} - o[d[{b}]] + {ka}"
    right = f"{b} + {kb} - o[d[{b}]]" if draw(st.booleans()) else f"o[d[{a}]] - {b}"
    rel = draw(st.sampled_from(["==", "!="]))  # only == may be assumed by the conjunction
    eq = f"d[{a} + {ka}] {rel} d[{b}]" if draw(st.booleans()) else f"d[{a}] {rel} d[{b}]"
    text = f"({eq}) & ({left} {op} {right})" if draw(st.booleans()) else f"({left} {op} {right}) & ({eq})"
    return parse(text, "mask_mod", (ModTensor("d", "i32", 1), ModTensor("o", "i32", 1)), ())


@settings(max_examples=60, deadline=None)
@given(_masks(), st.integers(0, 2**16))
def test_simplified_masks_keep_their_value(tree, seed):
    gen = torch.Generator().manual_seed(seed)
    values = {"d": torch.randint(-3, 4, (9,), generator=gen, dtype=torch.int32),  # few ids: many equal pairs
              "o": torch.randint(-20, 20, (7,), generator=gen, dtype=torch.int32)}  # indices clamp past the ends
    want = mask_mod_visible(_function(tree, values, score=False), 1, 1, 12, 12)
    got = mask_mod_visible(_function(simplify(tree), values, score=False), 1, 1, 12, 12)
    assert torch.equal(got, want), (to_text(tree), to_text(simplify(tree)))


def test_the_emitted_document_mask_is_the_gym_function():
    """gym's own document mask, traced, emitted (rewritten) and run by the interpreter, against the function itself."""
    offsets = g.length_to_offsets([5, 3, 6, 2], "cpu")
    mask_mod = g.generate_doc_mask_mod(g.causal_mask, offsets)
    traced = trace_mask_mod(mask_mod)
    assert "offsets" not in emit.to_triton(simplify(traced.mask_mod), _refs(traced))
    score = torch.zeros(1, 1, 16, 16, device=DEVICE)  # compiled on a GPU machine, the interpreter elsewhere
    tensors = {n: v.to(DEVICE, torch.int32) for n, v in traced.values.items() if torch.is_tensor(v)}
    got = (mods_kernel.run(simplify(traced.mask_mod), tensors, {}, score) != 0).cpu()
    want = mask_mod_visible(mask_mod, 1, 1, 16, 16)
    assert torch.equal(got, want.expand_as(got))


def _refs(traced):
    names = {"b": "b", "h": "h", "q_idx": "q", "kv_idx": "kv"}
    for n, v in traced.values.items():
        if torch.is_tensor(v):
            names[n] = emit.TensorRef(f"p_{n}", tuple(f"s{i}" for i in range(v.dim())),
                                      tuple(f"n{i}" for i in range(v.dim())))
    return names
