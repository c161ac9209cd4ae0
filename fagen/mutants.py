"""Deliberately broken variants: each is a small edit of a rendered source that a verifier must catch."""

from __future__ import annotations

import dataclasses

from fagen.enums import Direction, Mask
from fagen.spec import KernelSpec


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    what: str  # the bug, in words
    masks: tuple[Mask, ...]  # specs it applies to
    old: str  # text in the rendered source ...
    new: str  # ... and its broken replacement
    directions: tuple[Direction, ...] = tuple(Direction)  # bwd-only mutants edit code a fwd spec does not have

    def applies(self, spec: KernelSpec) -> bool:
        return spec.mask in self.masks and spec.direction in self.directions

    def apply(self, source: str) -> str:
        if self.old not in source:
            raise ValueError(f"mutant {self.name}: pattern not found in the rendered source")
        return source.replace(self.old, self.new)


MUTANTS = (
    Mutant("causal-off-by-one", "causal alignment off by one (j < i + shift instead of j <= i + shift)",
           (Mask.CAUSAL, Mask.CAUSAL_PADDING), "<= offs_m[:, None] + shift", "< offs_m[:, None] + shift"),
    Mutant("causal-top-left", "causal aligned top-left (ignores Sk - Sq)",
           (Mask.CAUSAL,), "shift = len_k - len_q\n", "shift = 0\n"),
    Mutant("no-padding-rows", "padding rows not zeroed", (Mask.PADDING, Mask.CAUSAL_PADDING),
           "seen = seen & (offs_m < len_q)", "seen = seen"),
    Mutant("unmasked-tail", "keys past the end of the tail block are not masked out", (Mask.NONE, Mask.PADDING),
           "tl.where((cols[None, :] < len_k), qk", "tl.where((cols[None, :] < len_k + BLOCK_N), qk"),
    Mutant("wrong-gqa-head", "query head h reads KV head h % Hkv instead of h // gqa", tuple(Mask),
           "off_hkv = off_h // GQA", "off_hkv = off_h % (num_heads // GQA)"),
    Mutant("dropped-rescale", "the accumulator is not rescaled when the running max grows", tuple(Mask),
           "acc = acc * alpha[:, None] + tl.dot", "acc = acc + tl.dot"),
    Mutant("tree-ignores-bits", "the tree part is treated as fully visible", (Mask.TREE,),
           "!= 0)) & (cols[None, :] < seq_k)", "!= 2)) & (cols[None, :] < seq_k)"),
    Mutant("bwd-causal-off-by-one", "dK/dV kernel: causal mask lets each row see one key past its diagonal",
           (Mask.CAUSAL, Mask.CAUSAL_PADDING), "<= rows[None, :] + shift", "<= rows[None, :] + shift + 1",
           (Direction.BWD,)),
    Mutant("bwd-no-empty-row-guard", "backward: lse = -inf of empty rows is not replaced by +inf before exp2",
           tuple(Mask), 'tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)',
           "lse * 1.4426950408889634", (Direction.BWD,)),
)
