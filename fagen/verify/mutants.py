"""Deliberately broken variants: each is a small edit of a rendered source that a verifier must catch."""

from __future__ import annotations

import dataclasses

from fagen.spec.axes import Direction, Kind, Layout, Mask
from fagen.spec import KernelSpec


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    what: str  # the bug, in words
    masks: tuple[Mask, ...]  # specs it applies to
    old: str  # text in the rendered source ...
    new: str  # ... and its broken replacement
    min_gqa: int = 1  # a head-mapping bug is invisible while every query head has its own KV head
    kinds: tuple[Kind, ...] = (Kind.PREFILL,)  # kernel kinds whose source it edits
    directions: tuple[Direction, ...] = tuple(Direction)  # bwd-only mutants edit code a fwd spec does not have
    switches: tuple[str, ...] = ()  # score switches (or "score_mod" / "mask_mod") the spec must have
    layouts: tuple[Layout, ...] = (Layout.DENSE,)  # layouts whose source has the edited code

    def applies(self, spec: KernelSpec) -> bool:
        return (spec.mask in self.masks and spec.gqa >= self.min_gqa and spec.kind in self.kinds
                and spec.direction in self.directions and all(getattr(spec, s) for s in self.switches)
                and spec.layout in self.layouts)

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
           "off_hkv = off_h // GQA", "off_hkv = off_h % (num_heads // GQA)", min_gqa=2),
    Mutant("dropped-rescale", "the accumulator is not rescaled when the running max grows", tuple(Mask),
           "acc = acc * alpha[:, None] + tl.dot", "acc = acc + tl.dot"),
    Mutant("tree-ignores-bits", "the tree part is treated as fully visible", (Mask.TREE,),
           "!= 0)) & (cols[None, :] < seq_k)", "!= 2)) & (cols[None, :] < seq_k)"),
    Mutant("padding-keys-unmasked", "keys past seqlens_k are attended (the key padding mask is missing)",
           (Mask.PADDING, Mask.CAUSAL_PADDING), "len_k = tl.load(SeqlensK + off_b)\n", "len_k = seq_k\n"),
    Mutant("padding-loads-garbage", "K/V loads ignore seqlens_k: padding is read, then weighted by p = 0",
           (Mask.PADDING, Mask.CAUSAL_PADDING), "shape=[tl.maximum(len_k, 1), ", "shape=[seq_k, "),  # K's and V's descriptors
    Mutant("causal-padding-global-shift", "causal+padding aligned with the padded lengths, not each sequence's",
           (Mask.CAUSAL_PADDING,), "shift = len_k - len_q\n", "shift = seq_k - seq_q\n"),
    Mutant("lse-base-2", "lse stored in base 2 (the ln 2 factor is dropped)", tuple(Mask),
           "* 0.6931471805599453, float(\"-inf\"))", "* 1.0, float(\"-inf\"))"),
    Mutant("no-finite-stand-in", "a row whose first masked block is empty computes exp2(-inf - -inf) = NaN",
           (Mask.TREE,), "m_use = tl.where(m_new == float(\"-inf\"), 0.0, m_new)", "m_use = m_new"),
    # Decode (split-KV): what breaks when the splits or their merge are wrong. They show up only with several
    # splits, which forward() picks for long caches and forward_split(num_splits=...) forces.
    Mutant("decode-merge-no-rescale", "the merge adds each split's output without its 2^(lse_s - max) weight",
           tuple(Mask), "acc = acc * alpha[:, None] + o_s * beta[:, None]", "acc = acc * alpha[:, None] + o_s",
           kinds=(Kind.DECODE,)),
    Mutant("decode-split-overlap", "each split also reads the first block of the next split's keys",
           tuple(Mask), "hi = tl.minimum(tl.minimum(s0 + chunk, seq_k), kv_hi)",
           "hi = tl.minimum(tl.minimum(s0 + chunk + BLOCK_N, seq_k), kv_hi)", kinds=(Kind.DECODE,)),
    Mutant("decode-last-split-dropped", "the merge stops one split early", tuple(Mask),
           "n_used = (kv_hi + chunk - 1) // chunk", "n_used = kv_hi // chunk", kinds=(Kind.DECODE,)),
    Mutant("decode-ticket-not-reset", "the merging split leaves its counter set, so the next launch never merges",
           tuple(Mask), "            tl.store(counter, 0)\n", "", kinds=(Kind.DECODE,)),
    Mutant("bwd-causal-off-by-one", "dK/dV kernel: causal mask lets each row see one key past its diagonal",
           (Mask.CAUSAL, Mask.CAUSAL_PADDING), "<= rows[None, :] + shift", "<= rows[None, :] + shift + 1",
           directions=(Direction.BWD,)),
    Mutant("bwd-no-empty-row-guard", "backward: lse = -inf of empty rows is not replaced by +inf before exp2",
           tuple(Mask), 'tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)',
           "lse * 1.4426950408889634", directions=(Direction.BWD,)),
    # Score switches (issue 15).
    Mutant("window-off-by-one", "the window's left edge excludes key i_aligned - left",
           tuple(Mask), "cols[None, :] >= offs_m[:, None] + wshift - win_left",
           "cols[None, :] > offs_m[:, None] + wshift - win_left", switches=("window",)),
    Mutant("window-top-left", "the window is aligned top-left (i_aligned = i, ignoring len_k - len_q)",
           tuple(Mask), "    wshift = len_k - len_q\n", "    wshift = 0\n", switches=("window",)),
    Mutant("window-skips-a-block", "block skipping starts one key block past the window's first block",
           tuple(Mask), "lo = tl.minimum(tl.maximum(m0 + wshift - win_left, 0) // BLOCK_N * BLOCK_N, hi)",
           "lo = tl.minimum(tl.maximum(m0 + wshift - win_left, 0) // BLOCK_N * BLOCK_N + BLOCK_N, hi)",
           switches=("window",)),
    Mutant("softcap-after-mask", "the mask is applied before the softcap: masked scores become -cap, not -inf",
           tuple(Mask), ', qk, float("-inf"))\n            m_new', ", qk, -cap_out)\n            m_new",
           switches=("softcap",)),
    Mutant("alibi-sign-flipped", "ALiBi adds +slope * |j - i_aligned| instead of subtracting it", tuple(Mask),
           "qk = qk - slope2 * tl.abs(", "qk = qk + slope2 * tl.abs(", switches=("alibi",)),
    Mutant("sink-left-out", "the sink is left out of the softmax denominator (and so of lse)", tuple(Mask),
           "l_i = l_i * alpha + tl.math.exp2(sink2 - m_fu)", "l_i = l_i * alpha", switches=("sinks",)),
    Mutant("bwd-sink-grad-dropped", "backward: the sinks' gradient is returned as zeros", tuple(Mask),
           "_sink_grad(do, out, lse, sinks, delta[:, :, :sq])", "torch.zeros_like(sinks)",
           directions=(Direction.BWD,), switches=("sinks",)),
    Mutant("bwd-softcap-no-chain", "backward: dS skips the softcap's factor 1 - tanh^2", tuple(Mask),
           "ds_t = ds_t * (1.0 - tanh_s * tanh_s)", "ds_t = ds_t", directions=(Direction.BWD,),
           switches=("softcap",)),
)

# User mods (docs/mods.md, [Note] Mods in the kernels in triton/mods.j2). In the kernels, every input a mod reads is
# emitted in parentheses (`(cols[None, :])`), which the built-in masks' code never is: these edit the mods only.
MOD_MUTANTS = (
    Mutant("mod-dropped-from-backward", "dQ skips d score_mod / d score (the backward treats the mod as additive)",
           tuple(Mask), "0.0, ds * (", "0.0, ds + 0.0 * (", directions=(Direction.BWD,), switches=("score_mod",)),
    Mutant("mod-kv-idx-off-by-one", "the forward's mods read kv_idx + 1", tuple(Mask), "(cols[None, :])",
           "(cols[None, :] + 1)", switches=("score_mod",)),
    Mutant("mask-mod-before-alignment", "the forward's mods see q_idx bottom-right aligned (q_idx + Sk - Sq, the "
           "built-in causal mask's alignment) instead of the row", tuple(Mask), "(offs_m[:, None])",
           "(offs_m[:, None] + len_k - len_q)", switches=("mask_mod",)),
    Mutant("block-mask-partial-as-full", "blocks the block mask cuts skip the mask_mod, as full ones do",
           tuple(Mask), "UPCAST, TMA, 2)  # the partial blocks", "UPCAST, TMA, 1)  # the partial blocks",
           switches=("mask_mod",)),
)

# Mods on the decode and paged kernels, whose mods see q_idx = i + lk - lq (README "User mods"): caught by the layouts'
# search with captured values (fagen/verify/layouts.py, tests/test_mods_layouts.py).
LAYOUT_MOD_MUTANTS = (
    Mutant("decode-mod-row-position", "the decode kernel's mods see the query's row i, not its position i + lk - lq",
           tuple(Mask), "q_pos = (offs_i + (len_k - len_q))[:, None]", "q_pos = offs_i[:, None]",
           kinds=(Kind.DECODE,), directions=(Direction.FWD,), layouts=(Layout.DENSE, Layout.PAGED)),
    Mutant("paged-prefill-mod-row-position", "the paged prefill's mods see the query's row, not its position among "
           "the cached keys", (Mask.NONE, Mask.CAUSAL), "(offs_m + (len_k - len_q))[:, None]", "offs_m[:, None]",
           directions=(Direction.FWD,), layouts=(Layout.PAGED,)),
)

# Layouts (README "Layouts"): caught by the layouts' own search (fagen/verify/layouts.py against the gathered dense
# reference, tests/test_layouts.py); `fagen verify` searches dense specs and runs MUTANTS only.
LAYOUT_MUTANTS = (
    Mutant("paged-wrong-page", "every sequence reads sequence 0's block table row (a wrong page index)",
           (Mask.NONE, Mask.CAUSAL), "table = BlockTable + off_b.to(tl.int64) * stride_btb", "table = BlockTable",
           kinds=(Kind.DECODE, Kind.PREFILL), directions=(Direction.FWD,), layouts=(Layout.PAGED,)),
    Mutant("paged-page-boundary", "slots off by one at a page boundary (key j reads slot (j + 1) % page_size)",
           (Mask.NONE, Mask.CAUSAL), "slot = (cols & ((1 << page_shift) - 1))",
           "slot = ((cols + 1) & ((1 << page_shift) - 1))", kinds=(Kind.DECODE, Kind.PREFILL),
           directions=(Direction.FWD,), layouts=(Layout.PAGED,)),
    Mutant("varlen-keys-one-sequence-off", "each sequence's keys start at the previous sequence's cu_seqlens_k",
           (Mask.NONE, Mask.CAUSAL), "k_row0 = tl.load(SeqlensK + off_b)",
           "k_row0 = tl.load(SeqlensK + tl.maximum(off_b - 1, 0))", layouts=(Layout.VARLEN,)),
    Mutant("varlen-queries-one-sequence-off", "each sequence's queries start at the next sequence's cu_seqlens_q",
           (Mask.CAUSAL, Mask.NONE), "q_row0 = tl.load(SeqlensQ + off_b)  # cu_seqlens_q ([Note] Layouts)\n",
           "q_row0 = tl.load(SeqlensQ + off_b + 1)\n", layouts=(Layout.VARLEN,)),
    Mutant("varlen-lse-ignores-row0", "lse rows of every sequence land at the first sequence's rows (the packed "
           "offset is dropped), so the backward recomputes P from another row's lse",
           (Mask.CAUSAL, Mask.NONE), "(off_h.to(tl.int64) * seq_q + q_row0)", "(off_h.to(tl.int64) * seq_q)",
           directions=(Direction.BWD,), layouts=(Layout.VARLEN,)),
    Mutant("paged-tree-global-prefix", "tree decode places the draft nodes at the table's last slots, not at each "
           "sequence's last cached keys", (Mask.TREE,), "prefix = len_k - seq_q\n", "prefix = seq_k - seq_q\n",
           kinds=(Kind.DECODE,), directions=(Direction.FWD,), layouts=(Layout.PAGED,)),
)

# The gluon backward (fagen/templates/gluon/backward.py.j2; sm_90 only, no interpreter): caught on an H100/H200 by
# the float64 comparison of tests/test_gluon_bwd_gpu.py and scripts/gpu_gluon_bwd_product.py.
GLUON_MUTANTS = (
    Mutant("gluon-bwd-dq-one-half", "the dQ warp adds both compute warpgroups' dQ halves into the first half's "
           "columns", (Mask.NONE, Mask.CAUSAL), "_tma_reduce_add(dq_desc, [off_b, h0 + g, m0, w * half],",
           "_tma_reduce_add(dq_desc, [off_b, h0 + g, m0, 0 * half],", directions=(Direction.BWD,)),
    # [Note] Fixed-point dQ (variant bwd_fixed): in renders with it only
    Mutant("gluon-bwd-fixed-no-scale", "the compute warpgroups round dQ to int32 without the row's scale (qmul)",
           (Mask.NONE, Mask.CAUSAL), "dq = _cvt_rni(dq * qm[:, None])", "dq = _cvt_rni(dq)",
           directions=(Direction.BWD,)),
    # [Note] FMA rounding (variant bwd_fixed_fma, ninth session): in renders with it only
    Mutant("gluon-bwd-fixed-fma-no-scale", "the FMA rounding of the fixed-point dQ leaves out the row's scale (qmul)",
           (Mask.NONE, Mask.CAUSAL), "dq = _fma_rni(dq, qm[:, None])", "dq = _fma_rni(dq, 1.0)",
           directions=(Direction.BWD,)),
    # [Note] qmul rows by TMA (bwd_fixed_tma, tenth session; the d128 MHA default): in renders with it only
    Mutant("gluon-bwd-fixed-tma-rows", "the producer brings the delta rows in place of the qmul rows",
           (Mask.NONE, Mask.CAUSAL), "[num_bh * GQA + off_b * num_heads + h0 + g, m0]",
           "[off_b * num_heads + h0 + g, m0]", directions=(Direction.BWD,)),
    # [Note] Two-limb FMA rounding (bwd_fixed_fma 3, tenth session): in renders with it only
    Mutant("gluon-bwd-fixed-fma-limb", "the two-limb FMA rounding puts its high limb one bit too low",
           (Mask.NONE, Mask.CAUSAL), "(h.to(gl.int32, bitcast=True) << 8)", "(h.to(gl.int32, bitcast=True) << 7)",
           directions=(Direction.BWD,)),
)
