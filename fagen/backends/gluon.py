"""The Gluon (Hopper) backend: a warp-specialised sm_90 forward (TMA, wgmma, mbarriers), bf16/fp16 and fp8 e4m3.

[Note] Gluon tiles. fagen/templates/gluon/attention.py.j2 runs a persistent CTA of two consumer warpgroups
(block_m / 2 = 64 query rows each: one wgmma M tile) and one producer warp; num_warps counts the consumer warps
(the producer warp is added). K/V stream through a ring of num_stages slots of block_n keys, loaded by TMA. The
limits are those of the variants docs/hopper.md measured.
"""

from __future__ import annotations

from fagen.backends.base import KernelBackend
from fagen.backends.gluon_decode import DecodeRules
from fagen.spec import targets
from fagen.spec.axes import Backend, Direction, DType, Kind, Layout, Mask, SpecError
# [Note] fp8 full-mask 192-key steps: True gives a plain fp8 d128 MHA full-mask forward 192-key steps with warpgroup
FP8_FULL_N192 = True  # turns 4 (variant_for); causal unchanged. H200 +3.4%: docs/hopper.md, fp8 forward (twenty-first)
FP8_N256: dict = {}  # mask -> fp8_n256 mode (+ turns 4; variant_for, over FP8_FULL_N192). Off: hopper.md, twenty-second
CAP_MAX_FIRST = 1  # [Note] Softcap forward levers (variant cap_max_first). H200 1.021 / 1.022x: hopper.md, twenty-third
D64_S_AHEAD = True  # [Note] The d64 forward's levers: the d64 bf16 causal MHA forward, S ahead (H200 1.067x Triton)


def smem_bytes(head_dim: int, block_m: int, block_n: int, num_stages: int, itemsize: int = 2,
               head_dim_v: int | None = None, warpgroups: int = 2) -> int:
    """Shared memory of the Gluon (Hopper) forward (fagen/templates/gluon/attention.py.j2, [Note] Roles).

    A program owns block_m query rows, block_m / 2 per consumer warpgroup. Each warpgroup has two Q buffers and
    one O staging buffer; the K/V ring holds num_stages K and V tiles of block_n rows; 2 bytes an element, plus
    1 KB for the mbarriers and triton's scratch. d128 m128 n128 s2: 230,400 bytes (compiled: 229,752). fp8
    (itemsize 1): Q and K/V at 1 byte, O still 2 (bf16/fp16 out). MLA (head_dim_v < head_dim): V and O are
    head_dim_v wide; d192 v128 m128 n64 s2: 214,016 bytes; a deeper ring ("lean") keeps one Q buffer per
    warpgroup and stages O in it (block_n x num_stages over 64 x 2): n128 s2 214,016 bytes too. warpgroups: the
    consumer warpgroups of block_m / 2 rows each (fp8 with variant fp8_wgs 3: three, [Note] fp8 three warpgroups in
    the template); each brings its two Q buffers and its O buffer."""
    half = block_m // 2
    dv = head_dim if head_dim_v is None else head_dim_v
    lean = dv != head_dim and block_n * num_stages > 128  # the template's `lean` ([Note] Gluon MLA widths)
    q_buffers, o_bytes = (1, 0) if lean else (2, 2 * warpgroups * half * dv)
    return (itemsize * (warpgroups * q_buffers * half + num_stages * block_n) * head_dim
            + itemsize * num_stages * block_n * dv + o_bytes + 1024)


# [Note] Gluon mod tiles. A score_mod that reads a captured tensor at an index using q_idx or kv_idx (KernelSpec.
# mod_gathers: a relative bias `bias[h, q_idx - kv_idx + c]`) holds one loaded value (and its address) per score in
# the consumer's registers beside S, O and P: at d128 with block_n 128 it compiled with 3436 spilled words (ptxas,
# sm_90), with block_n 64 and 4 K/V slots (the same 229 KB of shared memory) with none. A load per row or per head
# (ALiBi's `slopes[h]`) keeps the measured default tiles, as do mods of numbers only (softcap). Compile-only
# numbers: tests/test_gluon_mods.py.


class GluonBackend(DecodeRules, KernelBackend):
    backend = Backend.GLUON
    templates = {Kind.PREFILL: "gluon/attention.py.j2", Kind.DECODE: "gluon/mla_decode.py.j2"}
    layouts = (Layout.DENSE, Layout.PAGED)  # paged: the MLA decode only ([Note] Gluon MLA decode)
    name_suffix = "_gluon"
    supported = {
        "head_dim": ((64, 128, 192), "the gluon backend supports head_dim 64 or 128 (a TMA box of whole 16-byte "
                                     "rows, one wgmma N tile), and 192 with head_dim_v 128 (MLA prefill); use "
                                     "backend 'triton' for other head dims"),
        "mask": ((Mask.NONE, Mask.CAUSAL, Mask.PADDING, Mask.CAUSAL_PADDING), "the gluon backend supports masks "
                 "'none', 'causal', and 'padding' / 'causal+padding' in the forward; use backend 'triton' for tree masks"),
        "dtype": ((DType.FP16, DType.BF16, DType.FP8_E4M3), "the gluon backend computes fp16, bf16 and fp8_e4m3 "
                                                            "on tensor cores; use backend 'triton' for fp32"),
        "direction": ((Direction.FWD, Direction.BWD), "the gluon backend has a forward and a backward"),
        "block_m": ((128,), "the gluon backend takes block_m 128: two consumer warpgroups of 64 rows"),
        "block_n": ((64, 128), "the gluon backend supports block_n 64 or 128 (a TMA box side is a power of two)"),
        "num_warps": ((8,), "the gluon backend runs 8 consumer warps (two warpgroups) plus its producer warp"),
        "num_stages": ((2, 3, 4), "the gluon backend rings K/V through 2, 3 or 4 shared-memory slots"),
    }
    # [Note] Gluon MLA widths (gluon/attention.py.j2): the one pair of head dims that may differ; 192 only with it.
    mla_dims = (192, 128)
    # Score switches of the gluon forward ([Note] Gluon score switches in gluon/attention.py.j2); ALiBi, sinks: 'triton'.
    switches = ("window", "softcap")
    switches_why = "the gluon backend has the window and softcap switches only; use backend 'triton'"
    smem_limit = targets.ARCH_SMEM_LIMIT["sm_90"]
    smem_why = ("block_n {spec.block_n}, head_dim {spec.head_dim}; sm_90 gives a block at most {limit}: use fewer "
                "stages or block_n 64")
    # its launch takes host TMA descriptors: no prebuilt launcher yet
    no_aot = ("backend 'gluon' has no ahead-of-time build yet; the module compiles itself on first use on sm_90 "
              "(compile_for() builds it without a GPU)")
    # The gluon forward's register budgets (setmaxnreg): 240 per consumer thread, 24 for the producer (docs/hopper.md,
    # "Variants measured"). The variant switches measured beside them (ping-pong, late K/V releases, O via Q, joined
    # releases, one Q buffer, a K/V ring deeper than the spec's) were slower or no faster and left the template
    # (docs/hopper.md, "What left the product"). fwd_s_ahead, _turns, _wgs: [Note] The d64 forward's levers.
    # tile_schedule_all: render the tile schedule ([Note] Tile schedule in the template, _SCHED) for every causal
    # bf16/fp16 forward without mods or the window, not only MLA's; off in the product (d128 keeps its loop and order),
    # on only where scripts/gpu_mla_prefill.py renders d128 variants to time them.
    # causal_order: the _SCHED the product renders for a causal spec without the window or a mod (bf16, fp16 and
    # fp8, d64 and d128; MLA keeps 1, paired), or None for the plain loop ([Note] Gluon tile order).
    # fp8_p_cvt: 2 P carried in fp32 and rounded to e4m3 right before its P V, 0 rounded by triton's cast and carried in
    # e4m3 ([Note] fp8 P rounding in the template). H100, d128 B1 H16 s16k causal / full TF/s (scripts/gpu_fp8_fwd_s7.py,
    # seventh session): 0 733 / 733, 2 824 / 825. bf16/fp16 renders do not read it. The seventh session's warpgroup turns
    # (FA3's scheduler barrier) measured no faster and left the template (docs/hopper.md, "fp8 forward, seventh session"). 3
    # (the product since the eleventh session): P carried as int32 words of four e4m3 keys ([Note] fp8 P packed carry; the
    # same out bit for bit as 2). H100, B1 H16 s16k causal / full TF/s (scripts/gpu_fp8fwd_s11.py): round A d128 2 -> 3 770
    # -> 887 / 775 -> 869, round B 809 -> 795 / 839 -> 762 with the rows' order reversed; both together 1.06x / 1.01x
    # (docs/hopper.md, "fp8 forward (eleventh session)"). fp8_wgs: the fp8 forward's consumer warpgroups, 2 or 3 ([Note] fp8
    # three warpgroups in the template; 3 gives the workers fp8_wg3_regs); fp8_o_skip: 1 rescales O only where a row's max
    # moved ([Note] fp8 O rescale skip). H100, d128 s16k causal / full (scripts/gpu_fp8_fwd_s9.py, ninth session, round A):
    # 2 WGs 825 / 854 TF/s, 3 WGs at block_n 64 823 / 819 (docs/hopper.md, "fp8 forward, ninth session"). bf16/fp16 renders
    # read neither. fp8_pv_overlap: 1 computes the step's softmax in a block of its own, so ptxas keeps the P V's wait after
    # it ([Note] fp8 softmax under the P V; lost on the H100: docs/hopper.md, "fp8 forward, tenth session"). fp8_d64: the
    # fp8_* keys a d64 fp8 forward render takes (variant_for): three warpgroups (at block_n 128: no spills at d64). H100,
    # d64 B1 H16 s16k causal / full TF/s, 2 -> 3 WGs: ninth session round B 509 -> 565 / (unmeasured); tenth session round A
    # (scripts/gpu_fp8fwd_s10.py) 505 -> 563 / 519 -> 599 (+11% / +16%). pv_overlap: fp8_pv_overlap for the bf16/fp16
    # forward (measurement only; the note is the fp8 one). fp8_n192: 1 gives the fp8 d128 forward (not the window) 192-key
    # steps over 2 stages, P carried packed ([Note] fp8 192-key steps; GluonBackend.fp8_n192), 2 the same with S in three
    # 64-key parts over 3 stages. Round A: 1 813 / 806 TF/s against 887 / 869 at 128 keys (off). fp8_vt: 1 transposes V in
    # the kernel ([Note] fp8 V in-kernel). fp8_pass_evict, fp8_vt_pad: transpose_v's levers ([Note] fp8 V pass levers in
    # fp8_host.py.j2); fp8_full_order: the tile order (_SCHED, 0 none) of an fp8 full-mask forward (tile_order).
    # docs/hopper.md, thirteenth session. (fp8_exp_poly, fp8_o_warp_skip, fp8_lazy_max: lost in the 13th-14th sessions,
    # removed in the 15th; fp8_l_mma read NaN: removed; docs/hopper.md.) fp8_tail_split: C > 0 runs an fp8 full-mask
    # forward's last partial round of tiles as a second launch over C key chunks, combined by lse ([Note] fp8 tail split;
    # 14th session: C 8 / 4 2914 / 2913 us a call against 2915; 24th, 192-key steps: C 8 -0.8% a call: off). fp8_s_ahead: 1
    # issues S_{n+1} inside step n after its exponentials ([Note] fp8 S a step ahead; bit for bit the product's). H100, the
    # bench's measure, causal / full (scripts/gpu_fp8mma_s14.py, fourteenth session): round A 0.973x / 0.969x the product,
    # exp_poly 8 + o_warp_skip 0.976x / 0.969x: off. fp8_turns: 1-5 the two consumer warpgroups take turns by named barriers
    # ([Note] fp8 warpgroup turns). fp8_n256: 1-3 cuDNN's 256-key steps ([Note] fp8 256-key steps; turns 4 only on top).
    # bwd_*: the gluon backward's levers ([Note] Gluon backward levers).
    # fwd_tail_first 1: a non-causal score_mod forward reads its last key block first, then one unmasked loop ([Note]
    # Tail block first: issue 26's cold first call, H200 3.46 -> 2.12 s; on since the nineteenth session, docs/mods.md).
    variant = {"consumer_regs": 240, "loader_regs": 24, "tile_schedule_all": False, "causal_order": 3,
               "fp8_p_cvt": 3, "fp8_wgs": 2, "fp8_wg3_regs": (160, 24), "fp8_o_skip": 0,
               "fp8_pv_overlap": 0, "fp8_d64": {"fp8_wgs": 3}, "fp8_n192": 0, "fp8_vt": 0,
               "fp8_pass_evict": 0, "fp8_vt_pad": 0, "fp8_full_order": 0, "cap_turns": 0, "cap_max_first": CAP_MAX_FIRST,
               "fwd_s_ahead": 0, "fwd_turns": 0, "fwd_wgs": 2, "fp8_s_ahead": 0, "fp8_turns": 0, "fp8_n256": 0, "fp8_tail_split": 0,
               "pv_overlap": 0, "fwd_tail_first": 1, "pad_empty": 1, "pad_order": 2,  # [Note] Gluon padding masks
               "bwd_order": 0, "bwd_snake": 0, "bwd_named": 0, "bwd_epi_tma": 0, "bwd_fixed": 0, "bwd_window_desc": 0,
               "bwd_mod_early": 0, "bwd_window_fixed": 0, "bwd_prefix": 2, "bwd_window_chain": 0, "bwd_window_pending": 2,
               "bwd_window_relaxed": 0, "bwd_window_pdl": 0, "bwd_fixed_fma": 0, "bwd_grid": 0, "bwd_spt": 0, "bwd_fixed_tma": 0,
               "bwd_unordered_levers": {"bwd_named": 2, "bwd_epi_tma": 1, "bwd_snake": 1}, "bwd_full_levers": {},
               "fp8lat_lazy": 0, "fp8lat_early_fetch": 0, "fp8lat_stage": 7, "fp8lat_short": 8, "fp8lat_merge_cols": 64, "fp8lat_seesaw": 1}
    # fp8lat_*: [Note] Lazy block max, [Note] Early first block, [Note] Staged chunks in
    # fagen/templates/gluon/mla_decode_fp8.py.j2. fp8lat_stage K: chunks 0..K-1 by cp.async through shared memory
    # (fourteenth session; 7 since both rounds: per token +4.9-8.7 points at the three large shapes, per tensor
    # +3.1-5.6). The L2 prefetch (fp8lat_l2_prefetch, _l2_first, _l2_tensor) and the load hints (fp8lat_ld) lost in
    # two sessions and were removed in the fifteenth (docs/serving.md, thirteenth and fourteenth sessions).
    # fp8lat_short N: launches whose splits take at most N blocks run the unstaged form with evict_first ([Note]
    # Short splits; fifteenth session: 8 since both rounds); fp8lat_merge_cols C: the split merge's programs take C of the
    # 512 columns each ([Note] Merge by column blocks; fifteenth session: 64 since both rounds, b32 kv4k +16%, b32 kv32k +3.5-4%).

    # [Note] Gluon tile order. The persistent forward deals its tiles in an order ([Note] Tile schedule in the
    # template): causal query blocks differ in work, so the order decides how evenly the programs finish. H100,
    # d128 bf16 causal B1 H16 s16k (fifth session, scripts/gpu_mla_prefill.py): the tile counter (2, FA3's dynamic
    # scheduler) 685 TF/s, L2 sections (3) 673, the plain loop 598; MLA 192/128 causal b4 h16 s4k: paired (1) 664,
    # sections 655, counter 631, the loop 541. Sixth session (scripts/gpu_fwd_sched.py, H100, one run): d128 causal
    # s16k sections 691 TF/s, paired 648, the loop 615, the counter 594 / 607 (two rows of the same kernel: the
    # noise is a few %); GQA 32/8 causal b4 s4k all orders 581..608; d64 causal 431..449. So causal specs take
    # sections (3, best or second in both runs) and MLA keeps paired; mask none and the window keep the plain loop
    # (docs/hopper.md, "Tile order").

    # [Note] Gluon selection rule. The cases where the H100 measurements of docs/hopper.md show the gluon forward
    # beating the Triton one: a prefill forward, head_dim 128, bf16, mask none (any gqa: +5% full s16k) or causal with
    # gqa > 1 (+13% gqa 32/8 causal s4k). MHA causal only with a tile order (variant causal_order, [Note] Gluon tile
    # order): without one the Triton forward won it (s16k 558-562 / 543-550 TF/s); with sections 691 against 615 (sixth
    # session), the Triton one 582. d64 causal MHA with S ahead only (D64_S_AHEAD; -7% on the H100 and level on the H200
    # without it; H200 1.067x the Triton forward with it, twenty-third session), not fp16 (496 vs 493 TF/s, a tie), not
    # tree masks (no such kernel); padding masks (selected_pad_masks; H200, twenty-second session, rounds A / B: the
    # suite's fwd-causalpad-d128-s8k 444 / 442 vs 363 / 392 TF/s, twin 505 / 521 vs 451 / 465; docs/hopper.md). Score
    # switches: causal with the window alone (any gqa), where the gluon forward's block skipping measured +9% over the
    # Triton one (window 4096 at s32k, d128 bf16, MHA: 540 vs 497 TF/s, same run; docs/hopper.md, "Score switches in the
    # forward"); causal with the softcap alone (H200, twenty-second session: the suite's row 1.12x the Triton forward
    # per pass, 502 vs 447 TF/s; H100, fifteenth: a tie), not window with softcap (not measured), never ALiBi or sinks
    # (the gluon forward has neither). fp8 has no other kernel: an fp8 spec is always this backend's. Where and when the
    # rule applies (the device, $FAGEN_HOPPER, the problem size): [Note] Hopper selection in fagen/runtime/hopper.py.
    # MLA prefill (192/128): causal bf16, any gqa (select_mla below: 543 against 453 TF/s on the H100, lean n128 s2).
    selected_head_dims, selected_dtypes = (128,), (DType.BF16,)
    selected_masks = (Mask.NONE, Mask.CAUSAL)
    selected_pad_masks = (Mask.PADDING, Mask.CAUSAL_PADDING)  # the forward only (the gluon backward has none)
    selected_switches = ((("window",), Mask.CAUSAL), (("softcap",), Mask.CAUSAL))  # switch sets, masks (any gqa)
    # A score_mod (no mask_mod, no switch) at the selected head dims, dtypes and masks: the H100 run of
    # scripts/gpu_gluon_mods.py measured the gluon modded forward at 1.27-1.78x the Triton one (softcap, ALiBi,
    # relative bias, a head bias; causal and full, S8192; docs/mods.md, "Gluon").
    select_score_mods = True
    # MLA prefill (head_dim 192, head_dim_v 128; [Note] Gluon MLA widths): bf16, causal, no switch, no mod, any gqa.
    # H100, causal b4 h16 s4096 (scripts/gpu_mla_prefill.py, 2026-11-26 14:23 UTC): the gluon forward (n64, 2 slots)
    # 504 TF/s against the best Triton tile's 456 (m128n64w8s3, the default) and cuDNN's 580, same run, checked
    # against float64. Mask none was not timed: the Triton forward keeps it.
    select_mla, selected_mla_masks = True, (Mask.CAUSAL,)

    # [Note] Gluon backward rule. The gluon backward (fagen/templates/gluon/backward.py.j2: FA3's schedule, a dQ warp
    # with TMA reduce-adds) exists for head_dim 128, bf16/fp16, masks none/causal, any gqa, dense, no switch or mod.
    # H100, bf16, TF/s through fagen.attention, Triton backward / deterministic / unordered (docs/hopper.md, "The
    # Gluon backward in the product", round A): d128 causal B1 H16 s16k 423 / 461 / 466; full 420 / 469 / 532; GQA
    # 32/8 causal B4 s4k 360 / 373 (the lab kernel's unordered adds: 292 against 368). So with gradients the
    # deterministic mode serves d128 bf16 none/causal, any gqa (bwd_selected); deterministic=False takes the unordered
    # adds where they won, everywhere but GQA causal (unordered_selected: there the deterministic mode serves, as
    # asked or not). Not d64 (no kernel: the lab's d64 build lost to Triton, 316 vs 398), not fp16 (not measured).
    bwd_head_dims = (128,)
    # [Note] Gluon backward at d64 (ninth session): other head dims, selected per (mask, gqa > 1) case where measured
    # to win, plain specs only (no switch, no mod); a d64 render reads the variant keys of variant["bwd_d64"] over
    # the others (variant_for). H100, bf16, TF/s, one process (scripts/gpu_gluon_bwd_gqa64.py round A; docs/hopper.md,
    # "GQA and d64 in the Gluon backward (ninth session)"), the fixed-point dQ (deterministic) against the Triton
    # backward, the chain and cuDNN: causal B1 H32 s16k 407 / 379 / 316 / 457; full 372 (GRID 1: 393) / 368 / 327 /
    # 442; GQA 32/8 causal B4 s4k 362 / 318 / 267 / 365. GQA 32/8 full at d64: not measured, not selected.
    bwd_case_head_dims: dict = {64: ((Mask.CAUSAL, False), (Mask.NONE, False), (Mask.CAUSAL, True))}
    # The GQA levers of the ninth session ([Note] GQA step order / GQA split / L2 sections in the backward, in the
    # template): bwd_gqa_order 1 query block major steps, bwd_gqa_split s programs per KV head's query heads,
    # bwd_sections n (batch, KV head) pairs per L2 section; bwd_d64 the variant keys a d64 render takes instead
    # (variant_for). Measured in docs/hopper.md, "GQA and d64 in the Gluon backward (ninth session)".
    # bwd_block_m: queries per step (64; 128 built for d64 only: shared 199 KB, spills ~400 B).
    # bwd_gqa: the keys a d128 GQA causal backward render takes over the others (variant_for); bwd_d128 (tenth
    # session) those of a d128 MHA one, none or causal ({}: the chain): the fixed-point dQ with its qmul rows by TMA
    # and L2 sections of 4 heads (H100 measurements: docs/hopper.md, "The deterministic backward at d128 (tenth
    # session)": causal 541-543 against the chain's 462-465, full 522-527 against 452-455; bwd_gqa's qmul rows by TMA
    # 458 against 421 at GQA 32/8 causal B4 s4k).
    # bwd_ring (eleventh session): the Q/dO ring's slots (STAGES; 2 measured best at d128), for d64's short steps;
    # bwd_dq_slots 2: two dQ slots a warpgroup (d64, named-barrier kernels; [Note] Two dQ slots in the template).
    # Both off: round A (scripts/gpu_bwdstd_s11.py, H100, d64 causal B1 H32 s16k deterministic, medians of three
    # passes, TF/s) over bwd_d64 with the qmul rows by TMA (452): ring 3 450, ring 4 443, two dQ slots 440; round B
    # ring 3 446 against 455.
    variant.update({"bwd_gqa_order": 0, "bwd_gqa_split": 1, "bwd_sections": 0, "bwd_block_m": 64, "bwd_ring": 2,
                    "bwd_dq_slots": 1, "bwd_d64": {"bwd_fixed": 1, "bwd_sections": 8, "bwd_fixed_tma": 1,
                                                   "bwd_full_levers": {"bwd_named": 2, "bwd_epi_tma": 1}},
                    "bwd_gqa": {"bwd_fixed": 1, "bwd_sections": 4, "bwd_fixed_tma": 1},
                    "bwd_d128": {"bwd_fixed": 1, "bwd_fixed_tma": 1, "bwd_sections": 4,
                                 "bwd_full_levers": {"bwd_named": 2, "bwd_epi_tma": 1, "bwd_dq_swap": 1}}})
    # The full levers (twelfth session, H100 d128 H16 B1 s16k deterministic / unordered: 552 / 549 against 530 / 556)
    # and dq_swap (twenty-second): docs/hopper.md. bwd_d64 takes the qmul rows by TMA (eleventh session, H100 d64 causal
    # B1 H32 s16k: 452-455 TF/s against 418-419 without, cuDNN 441-442; docs/hopper.md, "The standard suite's backward
    # rows"); sections of 8 (ninth session, scripts/gpu_gluon_bwd_gqa64.py round B).

    def variant_for(self, spec) -> dict:
        """The variant a render of `spec` reads (the template's `gluon`): `variant`, with bwd_d64's keys over it for
        a head_dim 64 backward ([Note] Gluon backward at d64), bwd_gqa's for a d128 GQA causal one and bwd_d128's for
        a d128 MHA one, plain specs only (no switch, no mod); fp8_d64's for a d64 fp8 forward; FP8_N256 / _FULL_N192."""
        if spec.direction is Direction.FWD and spec.dtype is DType.FP8_E4M3 and spec.head_dim == 64:
            return {**self.variant, **self.variant["fp8_d64"]}  # [Note] fp8 three warpgroups: d64's own count
        if self._d64_plain(spec):  # [Note] The d64 forward's levers: S a step ahead (causal and none, MHA)
            return {**self.variant, "fwd_s_ahead": 1}
        plain = spec.direction is Direction.FWD and spec.dtype is DType.FP8_E4M3 and spec.head_dim == spec.block_n == 128 \
            and spec.gqa == 1 and not (spec.window or spec.switches or spec.modded)
        if plain and (spec.mask.value in FP8_N256 or FP8_FULL_N192 and spec.mask is Mask.NONE):  # [Note] fp8 256-key
            n256 = FP8_N256.get(spec.mask.value, 0)  # steps; else [Note] fp8 full-mask 192-key steps
            return {**self.variant, "fp8_turns": 4, **({"fp8_n256": n256} if n256 else {"fp8_n192": 1})}
        if (spec.direction is Direction.BWD and spec.switches == ("window",) and not spec.modded
                and self.variant["bwd_window"]):  # [Note] Switches on the fast backward path
            return {**self.variant, **self.variant["bwd_window"]}
        if spec.direction is not Direction.BWD or spec.switches or spec.modded:  # the fixed-point dQ's bound holds
            return self.variant  # for plain softmax gradients ([Note] Fixed-point dQ), not for a score_mod's dS
        if spec.head_dim == 64 and self.variant["bwd_d64"]:
            return {**self.variant, **self.variant["bwd_d64"]}
        if spec.head_dim == 128 and spec.gqa > 1 and spec.mask is Mask.CAUSAL and self.variant["bwd_gqa"]:
            return {**self.variant, **self.variant["bwd_gqa"]}
        if spec.head_dim == 128 and spec.gqa == 1 and self.variant["bwd_d128"]:
            return {**self.variant, **self.variant["bwd_d128"]}
        return self.variant
    # The head dims the gluon backward renders and builds (_check_bwd): d64 too (the template's tiles do not depend
    # on D: [64, D / 2] dQ halves, [128, D] K/V; the lab's v1 at d64 built without spills and ran, docs/hopper.md),
    # selected only where measured to win (bwd_head_dims).
    bwd_built_head_dims = (64, 128)
    # [Note] Gluon backward mods: the switch sets and score_mods the gluon backward can take (check_more) that the rule
    # also picks, as measured (scripts/gpu_mods_bwd_s6.py --gluon against the Triton backward, docs/mods.md, "The
    # Gluon backward"): bwd_selected_switches, the switch tuples picked ((), always); bwd_select_score_mods, a
    # score_mod without a mask_mod (its captured tensors without gradient: the caller's condition). Off until the
    # H100 rows are in; fagen/runtime/hopper.py's backward_spec builds the twin with these fields ([Note] Gluon
    # backward selection there). Ninth session: a score_mod on (H100, round B of the eighth, backward TF/s at B1 H16
    # S8192 deterministic, Gluon / Triton: ALiBi row-free 477 / 429, relative bias 254 / 204); the window and the
    # softcap switch off until timed (scripts/gpu_mods_bwd_s9.py). The window switch: not selected (H100, round B of
    # the ninth session, the bench's sliding window, backward TF/s: Triton 266, Gluon chain descending 269, fixed-point
    # 153, unordered 223, Flex 288); were it listed, only in bwd_window_cases (mask, gqa) and without a score_mod.
    # Eleventh session: selected, on the render of variant bwd_window below (round A, H100, the bench's sliding window
    # B1 H16 S8192, backward ms through fagen.attention: 0.533 against the Triton backward's 0.614 and Flex's 0.563).
    bwd_selected_switches: tuple = ((), ("window",))
    bwd_window_cases = ((Mask.CAUSAL, 1),)
    bwd_select_score_mods = True
    # bwd_unordered_switches: switch sets picked only for deterministic=False (the unordered dQ adds won there, the
    # deterministic mode did not), where unordered_selected gives that mode.
    bwd_unordered_switches: tuple = ()
    # bwd_window (eleventh session, docs/mods.md "The window's backward (eleventh session)"): the keys a backward
    # render with the window switch alone (no other switch, no mod) takes (variant_for); {} none. The fixed-point dQ
    # with its qmul rows by TMA, on the fast host path with the bound kernel ([Note] The bound kernel in
    # fagen/templates/host/gluon_bwd_launch.py; the eleventh session's own window path until the twelfth). H100,
    # round A (scripts/gpu_window_s11.py; B1 H16 S8192 d128 bf16, causal, window (1024, 0); backward ms, one
    # process): this render through fagen.attention 0.533 (1.06x Flex's 0.563; kernels 0.522: main 0.403, bound
    # 0.036, conversion 0.034, preprocess 0.027), with sections of 4 0.529, the Triton backward 0.614 (0.92x), the
    # same render on the plain host path 1.306; deterministic=False (the unordered adds) 0.474 (1.19x).
    # Flipped in the eighteenth session (H200, scripts/gpu_window_s18.py rounds A and B, shuffled passes through
    # fagen.attention on the suite's mask_mod): the store chain with the spun turn and the dQ conversion as the main
    # kernel's programmatic dependent ("pdl") 0.4397 / 0.4386 ms against this render's 0.5076 / 0.4942 (per pass
    # 0.872 / 0.887) and Flex's 0.5646 / 0.5529 (1.28x / 1.26x); the suite's mod_rows 0.439 against 0.497; bit for
    # bit the chain without pdl ("spin", 0.962 of its time); deterministic=False 0.995 of this render's. docs/mods.md.
    variant["bwd_window"] = {"bwd_window_desc": 1, "bwd_window_chain": 2, "bwd_window_pending": 0,
                             "bwd_window_relaxed": 2, "bwd_window_pdl": 1}
    # bwd_window_chain (seventeenth session, [Note] Window chain): 1 a window render's deterministic mode as the chain
    # (mode 0) on the unordered kernel's levers, with bwd_window_desc 1 and without bwd_window_fixed; 2 and the first
    # adder's store (no accumulator fill); bwd_window_pending 0 the chain's publish after the step's own adds;
    # bwd_window_relaxed 1 the turn polled by relaxed loads, 2 in one asm loop. Off (round A: docs/mods.md).
    # bwd_window_pdl 1 (eighteenth session, [Note] Window conversion overlap): with a chain, mode 0's dQ conversion
    # launched as a programmatic dependent of the main kernel, each program waiting on its query block's counter.
    # Issue 26's bias rows (tenth session, docs/mods.md "Bias rows (tenth session)"): fwd_mod_add 1, an additive
    # score_mod (`score + X`) in the Gluon forward as one FMA onto the log2-domain score ([Note] Additive mods in the
    # Gluon forward); bwd_mod_fixed 1, an additive score_mod's deterministic dQ as fixed-point adds ([Note]
    # Fixed-point dQ: its bound holds, dS = P (dP - delta) as without a mod; 2: all but GQA causal specs).
    # bwd_mod_split 1: the clamp-free reads' offsets as one pointer per key plus the queries' int32 offsets ([Note]
    # Split offsets in fagen/mods/emit.py).
    # bwd_mod_fold 1: an additive score_mod's P as exp2(fma(S, qk_scale, X / ln 2 - lse2)).
    # H100 round A (scripts/gpu_modsbias_s10.py, B1 H16 S8192 d128 bf16, TF/s, Flex in the same process): ALiBi fwd
    # 572 -> 615 with fwd_mod_add 2 (Flex 442: 1.30x -> 1.39x; fwd_mod_add 1 571); ALiBi bwd 465 -> 539 with
    # bwd_mod_fixed (Flex 406: 1.15x -> 1.33x; with bwd_mod_fold 477); relative bias bwd 292 -> 346 with
    # bwd_mod_split (Flex 268: 1.09x -> 1.29x; with the fold 347, and bwd_mod_fixed on top 342); relative bias fwd
    # 294 with fwd_mod_add 1 or without (Flex 215). So fwd_mod_add 2, bwd_mod_fixed 2 and bwd_mod_split 1 are on;
    # bwd_mod_fold stays off.
    variant.update({"fwd_mod_add": 2, "bwd_mod_fixed": 2, "bwd_mod_split": 1, "bwd_mod_fold": 0})
    variant.update({"bwd_prefix_tma": 1})  # bwd_prefix beside the qmul rows by TMA (eleventh session; see below)

    # bwd_mod_early 1: a score_mod's clamp-free read (MOD_FREE, [Note] Clamp-free problems in fagen/mods/emit.py)
    # issued before the S MMA's wait instead of after it (ninth session: scripts/gpu_mods_bwd_s9.py times both).
    # bwd_window_fixed 1: a window switch's deterministic dQ as fixed-point adds ([Note] Fixed-point dQ), not a
    # chain that queues each key block behind the one before ([Note] Window in the backward); no score_mod.
    # bwd_prefix 1: plain causal MHA d128 renders take the prefix-LM length at run time (0 from the public path), so
    # the prefix split's backward is one launch (fagen/mods/split.py's PREFIX_ONE_BWD; [Note] Prefix rows in the
    # backward, tenth session); 2: the same, and that launch's dQ as fixed-point adds (mode 2, rendered beside the
    # chain, which the plain causal calls keep). bwd_prefix_tma 1 (eleventh session): the prefix argument also in a
    # render with the qmul rows by TMA (bwd_fixed_tma, the d128 default's), whose deterministic mode is mode 2 itself.
    # H100, prefix-LM B1 H16 S8192 P 2048 backward, Flex in the same process (scripts/gpu_pfxtma_s11.py round A):
    # one launch of the d128 default with the prefix 1.379 / 1.423 ms (1.37x / 1.34x Flex's 1.894 / 1.912) against
    # the two calls it replaces 1.617 ms (1.17x) and the tenth session's one launch (chain render, mode 2 without
    # TMA rows) 1.604 (1.18x); the plain causal call through it (P = 0) bitwise the render without the prefix.
    # [Note] Gluon backward levers (variant bwd_*, rendered by fagen/templates/gluon/backward.py.j2 only where on; the
    # designs in lab/gluon_bwd.py): bwd_order 1, the dQ turns by arrival within a wave ([Note] Wave order); bwd_snake
    # 1, odd waves of tiles in reverse; bwd_named 1, the dQ handoff through named barriers (2: also the dS^T exchange);
    # bwd_epi_tma 1, dK/dV stored by TMA through the dQ slot; bwd_unordered_levers, the levers of the unordered mode's
    # own kernel in causal specs (a dict of those keys; {}: the deterministic mode's kernel serves both); bwd_full_levers
    # the same for plain full specs, with bwd_persist 1 (modes 1, 2 on the persistent grid, not one program per
    # tile; twelfth session, docs/hopper.md). All off: on the lab kernel (H100, docs/hopper.md) none
    # won in the deterministic mode at all three cases; their sum won only unordered at d128 causal (520 vs 469). The
    # product's unordered causal kernel takes named 2 + TMA epilogue + snake ("u-nes"): round B of the seventh session
    # (scripts/gpu_gluon_bwd_product.py, H100, d128 causal B1 H16 s16k, one process) 540 TF/s against 458-460 for
    # the unordered kernel without levers (and 467 deterministic), checked against float64 (300x300 causal).
    # bwd_fixed ([Note] Fixed-point dQ in the template; eighth session): the deterministic mode's dQ as fixed-point
    # int32 adds in any order (the unordered mode's kernel and levers, no turns), 1 for every spec, 2 for every spec
    # but GQA causal (where the unordered adds lost), 0 the fixed-order float32 adds. Round A (H100, 03:30 UTC,
    # scripts/gpu_gluon_bwd_product.py): the fixed render passed float64 at d128 causal Sq > Sk, full, GQA 4 causal
    # and d64 causal (dq errors equal to the default render's to 3 digits), the exact zeros, bitwise over 3 runs, and
    # its mutant (the row scale left out) was caught. Round B (same script, one process; TF/s chain / fixed /
    # unordered / cuDNN): d128 causal B1 H16 s16k 473 / 475 / 546 / 553, full 471 / 453 / 551 / 558, GQA 32/8 causal
    # B4 s4k 372 / 274 / 362 / 461, d64 causal B1 H32 s16k 317 / 390 / 430 / 438 (Triton 359). So 0: a tie at d128
    # causal, a loss at full and GQA; d64, where it wins, is not selected (docs/hopper.md, "The deterministic
    # backward without a chain").
    # bwd_fixed_fma 1 (ninth session, [Note] FMA rounding): the fixed-point dQ rounded by an FFMA and an IADD instead
    # of cvt.rni (units 2^8 coarser), 2 by the FFMA alone (the postprocess takes the offsets out); bwd_grid 1: one CTA
    # per tile in the deterministic mode (FA3's grid); bwd_spt 1 (causal): tiles shortest first, dQ turns descending
    # (FA3's deterministic causal; [Note] Launch order); bwd_order d > 1 (full mask): the wave order with neighbours at
    # most d steps apart (lab ORDER d). All 0: round A (H100,
    # scripts/gpu_gluon_bwd_order.py, d128 B1 H16 s16k causal / full, TF/s): the chain 452 / 456, bwd_grid 453 (full),
    # bwd_grid + bwd_spt 251 (causal), bwd_order 4 431 (full), bwd_fixed + bwd_fixed_fma 2 498 / 500 (cuDNN 582 / 533),
    # and the FMA units too coarse at s16k (dq 1.1e-2 from the chain's at full).
    # Measured in docs/hopper.md, "The deterministic backward's launch order (ninth session)".
    # bwd_fixed_tma 1 (tenth session, [Note] qmul rows by TMA): the fixed-point dQ's qmul rows by TMA into a ring slot;
    # bwd_fixed_fma 3 ([Note] Two-limb FMA rounding): cvt's units rounded on the FMA pipe in two limbs. Measured in
    # docs/hopper.md, "The deterministic backward at d128 (tenth session)".

    # [Note] Gluon MLA decode, the spec's limits and the rule: DecodeRules in fagen/backends/gluon_decode.py.

    def default_config(self, spec, arch: str, given: dict) -> dict:
        """The measured default (docs/hopper.md), on sm_90 only. d128: 2 K/V slots, all that fits beside Q (two
        buffers per warpgroup) and O (H100: 630 TF/s full, 568 causal at s16k bf16); d64: 3 slots. fp8: 2 slots
        (H100, twelfth session, 7 rotated passes: d128 round A 859 / 848 TF/s causal / full against 792 / 772 with
        4; d64 round B 589 / 605 against 563 / 545: docs/hopper.md, "fp8 forward (twelfth session)")."""
        if spec.kind is Kind.DECODE:  # [Note] Gluon MLA decode
            return dict(self.decode_launch)
        if spec.dtype is DType.FP8_E4M3:
            return {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2}
        if (spec.head_dim, spec.head_dim_v) == self.mla_dims:  # [Note] Gluon MLA widths; H100, 15:12 UTC, causal
            # b4 h16 s4k: the lean n128 s2 543 TF/s (cuDNN 568), n64 s2 500, lean n64 s3 499, lean n64 s4 483
            return {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2}
        if spec.mod_gathers:  # [Note] Gluon mod tiles
            return {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 4}
        return {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2 if spec.head_dim >= 128 else 3}

    def tile_order(self, spec) -> int | None:
        """The tile order (_SCHED) the product renders for `spec`, or None for the plain loop ([Note] Gluon tile order):
        MLA causal 1 (paired); other causal specs without the window or a mod causal_order; fp8 full fp8_full_order,
        padding masks pad_order (0: none); the template computes the same ({% set order %} in gluon/attention.py.j2)."""
        if spec.modded or spec.window:
            return None
        if spec.mask is Mask.NONE and spec.dtype is DType.FP8_E4M3 and spec.kind is Kind.PREFILL:  # full_plain
            return self.variant["fp8_full_order"] or None
        if spec.mask is not Mask.CAUSAL:  # a padding mask: pad_order (0: none; [Note] Gluon padding masks)
            return (self.variant["pad_order"] or None) if spec.mask.padded else None
        if (spec.head_dim, spec.head_dim_v) == self.mla_dims:
            return 1
        return self.variant["causal_order"]

    def tile_schedule(self, spec) -> bool:
        """Whether the forward of `spec` renders the tile schedule (_SCHED, the tile counter argument; [Note] Tile
        schedule in fagen/templates/gluon/attention.py.j2, which tests the same rule): where the product has a tile
        order, or with the variant's tile_schedule_all any spec without a mod (a measurement variant)."""
        if spec.modded:
            return False
        return self.tile_order(spec) is not None or bool(self.variant["tile_schedule_all"])

    def fp8_n192(self, spec) -> bool:
        """The template's n192 / n256: 192- or 256-key steps (fp8 d128, two warpgroups, block_n 128, no window)."""
        v = self.variant_for(spec)
        return (spec.dtype is DType.FP8_E4M3 and bool(v["fp8_n192"] or v["fp8_n256"]) and not spec.window and spec.head_dim == 128
                and v["fp8_wgs"] == 2 and spec.block_n == 128)

    def fp8_vt(self, spec) -> bool:  # the template's `vt_in`: fp8 d128 on two warpgroups at block_n 128, no 192
        v = self.variant_for(spec)
        return spec.dtype is DType.FP8_E4M3 and bool(v["fp8_vt"]) and spec.head_dim == 128 and spec.block_n == 128 \
            and v["fp8_wgs"] == 2 and not self.fp8_n192(spec)

    def smem_bytes(self, spec) -> int:
        if spec.kind is Kind.DECODE:
            return self.decode_smem(spec)
        if self.fp8_n192(spec):  # [Note] fp8 192-key steps: Q and O, K in two 128-row slots and Vt a stage (thirds, fp8_n192
            v = self.variant_for(spec)  # 2: 3 x 6 64-row slots); fp8_n256: K and Vt in two 128-key slots a stage, 2 stages
            return (2 * 2 * 64 * 2 + (4 * 256 if v["fp8_n256"] else 896 if v["fp8_n192"] == 1 else 1152)) * spec.head_dim + 1024
        wgs = self.variant_for(spec)["fp8_wgs"] if spec.dtype is DType.FP8_E4M3 else 2  # [Note] fp8 three warpgroups
        return 2 * 128 * 128 * self.fp8_vt(spec) + smem_bytes(spec.head_dim, spec.block_m, spec.block_n, spec.num_stages, spec.dtype.itemsize,
                          spec.head_dim_v, wgs)

    def check_more(self, spec) -> None:
        if spec.direction is Direction.BWD:
            self._check_bwd(spec)
        mla = (spec.head_dim, spec.head_dim_v) == self.mla_dims
        if spec.mask.padded and (spec.direction is Direction.BWD or spec.kind is Kind.DECODE or mla or spec.switches
                                 or spec.modded or self.fp8_vt(spec)):  # [Note] Gluon padding masks in the template
            raise SpecError("mask", spec.mask.value, "the gluon backend's padding masks are its plain forward's (head_dim "
                                                     "64/128, no switch or mod); use backend 'triton' for the rest")
        if spec.head_dim_v != spec.head_dim and not mla:
            raise SpecError("head_dim_v", spec.head_dim_v, f"the gluon backend takes head_dim_v = head_dim, or "
                                                           f"{self.mla_dims[1]} with head_dim {self.mla_dims[0]} "
                                                           "(MLA prefill); use backend 'triton' for other pairs")
        if spec.head_dim == self.mla_dims[0] and not mla:
            raise SpecError("head_dim_v", spec.head_dim_v, f"the gluon backend takes head_dim {spec.head_dim} with "
                                                           f"head_dim_v {self.mla_dims[1]} only (MLA prefill); use "
                                                           "backend 'triton' for other V widths")

    def _check_bwd(self, spec) -> None:
        """The gluon backward's limits ([Note] Gluon backward rule): head_dim 64 or 128, bf16/fp16; the window and
        softcap switches and a score_mod ([Note] Gluon backward mods); the mask_mod is refused for every gluon spec."""
        if spec.head_dim not in self.bwd_built_head_dims or spec.head_dim_v != spec.head_dim:
            raise SpecError("head_dim", spec.head_dim, "the gluon backward supports head_dim 64 and 128 (head_dim_v "
                                                       "equal); use backend 'triton' for other head dims")
        if spec.dtype not in (DType.BF16, DType.FP16):
            raise SpecError("dtype", str(spec.dtype), "the gluon backward computes bf16 and fp16; use direction "
                                                      "'fwd' for fp8, backend 'triton' for fp32")
        # [Note] Gluon backward mods: the window and softcap switches (ALiBi and sinks are refused for every gluon
        # spec, fagen/spec/kernel.py) and a score_mod (its captured tensors get no gradient there: fagen.attention
        # keeps a learned bias on the Triton backward); the wave order ([Note] Wave order) counts a causal or full
        # frontier only, so a window renders without it.
        levers = (self.variant["bwd_order"], self.variant["bwd_unordered_levers"].get("bwd_order", 0))
        if spec.window and any(levers):
            raise SpecError("window", True, "the gluon backward's wave order (variant bwd_order) has no window; "
                                            "set bwd_order 0, or use backend 'triton'")
        if self.variant["bwd_spt"] and self.variant["bwd_order"] and spec.mask is Mask.CAUSAL and not spec.window:
            raise SpecError("mask", "causal", "the gluon backward's launch order (variant bwd_spt) and wave order "
                                              "(bwd_order) both set the dQ turns; set one of them to 0")

    def bwd_selected(self, spec, unordered: bool = False) -> bool:
        """Whether the measured rule ([Note] Gluon backward rule) picks the gluon backward (its deterministic mode;
        unordered: deterministic=False, which also takes bwd_unordered_switches) for the case of `spec` with
        gradients (machine not considered)."""
        switches = spec.switches in self.bwd_selected_switches or (
            unordered and spec.switches in self.bwd_unordered_switches and self.unordered_selected(spec.mask, spec.gqa))
        head_dim = (spec.head_dim in self.bwd_head_dims  # [Note] Gluon backward at d64
                    or ((spec.mask, spec.gqa > 1) in self.bwd_case_head_dims.get(spec.head_dim, ())
                        and not spec.switches and not spec.modded))
        return (spec.kind is Kind.PREFILL and head_dim and spec.head_dim_v == spec.head_dim
                and spec.layout is Layout.DENSE and spec.dtype in self.selected_dtypes
                and spec.mask in self.selected_masks
                and switches and spec.mask_mod is None
                and (not spec.window or (spec.mask, spec.gqa) in self.bwd_window_cases and spec.score_mod is None)
                and (spec.score_mod is None or self.bwd_select_score_mods))

    def unordered_selected(self, mask, gqa: int) -> bool:
        """Whether deterministic=False takes the gluon backward's unordered dQ adds for a selected case of this mask
        and gqa ([Note] Gluon backward rule): not GQA causal, where they lost, unless its render has L2 sections
        (variant bwd_gqa: [Note] L2 sections in the backward)."""
        return not (Mask(mask) is Mask.CAUSAL and gqa > 1) or bool(self.variant["bwd_gqa"].get("bwd_sections"))

    @staticmethod
    def _d64_plain(spec) -> bool:  # a plain d64 MHA bf16/fp16 forward ([Note] The d64 forward's levers)
        return (D64_S_AHEAD and spec.direction is Direction.FWD and spec.head_dim == spec.head_dim_v == 64 and spec.gqa
                == 1 and spec.dtype in (DType.BF16, DType.FP16) and spec.mask in (Mask.NONE, Mask.CAUSAL)
                and not (spec.switches or spec.modded))

    def selected(self, spec) -> bool:
        """Whether the measured rule ([Note] Gluon selection rule) picks the gluon forward for the case of `spec`."""
        if spec.dtype is DType.FP8_E4M3:  # the only fp8 kernel: selected wherever it exists
            return (spec.kind is Kind.PREFILL and spec.direction is Direction.FWD and spec.head_dim in (64, 128)
                    and (spec.mask in self.selected_masks or spec.mask.padded) and spec.switches in ((), ("window",)))
        if (spec.head_dim, spec.head_dim_v) == self.mla_dims:
            return (self.select_mla and spec.kind is Kind.PREFILL and spec.direction is Direction.FWD
                    and spec.dtype in self.selected_dtypes and spec.mask in self.selected_mla_masks
                    and not spec.switches and not spec.modded)
        if self._d64_plain(spec) and spec.kind is Kind.PREFILL:  # the d64 causal MHA forward with S ahead
            return spec.mask is Mask.CAUSAL and spec.dtype in self.selected_dtypes
        if not (spec.kind is Kind.PREFILL and spec.direction is Direction.FWD and spec.head_dim_v == spec.head_dim
                and spec.head_dim in self.selected_head_dims and spec.dtype in self.selected_dtypes):
            return False
        if spec.modded:
            return (self.select_score_mods and spec.mask_mod is None and not spec.switches
                    and spec.mask in self.selected_masks)
        if spec.switches:
            return (spec.switches, spec.mask) in self.selected_switches
        mha_causal = spec.mask is Mask.CAUSAL and spec.gqa == 1
        return spec.mask in self.selected_masks + self.selected_pad_masks and not (mha_causal and self.tile_order(spec) is None)
