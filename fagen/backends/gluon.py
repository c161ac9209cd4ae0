"""The Gluon (Hopper) backend: a warp-specialised sm_90 forward (TMA, wgmma, mbarriers), and a backward.

[Note] Gluon tiles. fagen/templates/gluon/attention.py.j2 runs a persistent CTA of two consumer warpgroups
(block_m / 2 = 64 query rows each: one wgmma M tile) and one producer warp; num_warps counts the consumer warps
(the producer warp is added). K/V stream through a ring of num_stages slots of block_n keys, loaded by TMA. The
limits are those of the variants docs/hopper.md measured.
"""

from __future__ import annotations

from fagen.backends.base import KernelBackend
from fagen.spec import targets
from fagen.spec.axes import Backend, Direction, DType, Kind, Mask, SpecError


def smem_bytes(head_dim: int, block_m: int, block_n: int, num_stages: int, q_stages: int = 2,
               o_via_q: int = 0) -> int:
    """Shared memory of the Gluon (Hopper) forward (fagen/templates/gluon/attention.py.j2, [Note] Roles).

    A program owns block_m query rows, block_m / 2 per consumer warpgroup. Each warpgroup has q_stages Q buffers
    and one O staging buffer (none with o_via_q: O goes through the tile's Q buffer, [Note] O via Q); the K/V
    ring holds num_stages K and V tiles of block_n rows; 2 bytes an element, plus 1 KB for the mbarriers and
    triton's scratch. d128 m128 n128 s2: 230,400 bytes (compiled: 229,752); with o_via_q, q_stages 1, s3:
    230,400 too (32 KB of Q + 192 KB of K/V)."""
    half = block_m // 2
    o_buffers = 0 if o_via_q else 1
    return 2 * (2 * (q_stages + o_buffers) * half + 2 * num_stages * block_n) * head_dim + 1024


class GluonBackend(KernelBackend):
    backend = Backend.GLUON
    templates = {Kind.PREFILL: "gluon/attention.py.j2"}
    name_suffix = "_gluon"
    supported = {
        "head_dim": ((64, 128), "the gluon backend supports head_dim 64 or 128 (a TMA box of whole 16-byte rows, "
                                "one wgmma N tile); use backend 'triton' for other head dims"),
        "mask": ((Mask.NONE, Mask.CAUSAL), "the gluon backend supports masks 'none' and 'causal'; use backend "
                                           "'triton' for padding and tree masks"),
        "dtype": ((DType.FP16, DType.BF16), "the gluon backend computes fp16 and bf16 on tensor cores; use "
                                            "backend 'triton' for fp32"),
        "direction": ((Direction.FWD, Direction.BWD), "the gluon backend has a forward and a backward"),
        "block_m": ((128,), "the gluon backend takes block_m 128: two consumer warpgroups of 64 rows"),
        "block_n": ((64, 128), "the gluon backend supports block_n 64 or 128 (a TMA box side is a power of two)"),
        "num_warps": ((8,), "the gluon backend runs 8 consumer warps (two warpgroups) plus its producer warp"),
        "num_stages": ((2, 3, 4), "the gluon backend rings K/V through 2, 3 or 4 shared-memory slots"),
    }
    # Score switches of the gluon forward ([Note] Gluon score switches in fagen/templates/gluon/attention.py.j2);
    # ALiBi, sinks and every switch of the gluon backward are backend 'triton' only.
    switches = ("window", "softcap")
    switches_why = "the gluon backend has the window and softcap switches only (forward); use backend 'triton'"
    smem_limit = targets.ARCH_SMEM_LIMIT["sm_90"]
    smem_why = ("block_n {spec.block_n}, head_dim {spec.head_dim}; sm_90 gives a block at most {limit}: use fewer "
                "stages or block_n 64")
    # its launch takes host TMA descriptors: no prebuilt launcher yet
    no_aot = ("backend 'gluon' has no ahead-of-time build yet; the module compiles itself on first use on sm_90 "
              "(compile_for() builds it without a GPU)")
    # The gluon backward (fagen/templates/gluon/backward.py.j2): head_dim 128 only (its tiles and registers are laid
    # out for it; docs/hopper.md, phase 3).
    bwd_head_dims = (128,)
    # The kernel's variant switches, fixed at their measured defaults (docs/hopper.md, "Variants measured"): two Q
    # buffers per warpgroup, no ping-pong token, K released after S and V after its P V, 240 registers per consumer
    # thread and 24 for the producer; O staged in its own buffer (o_via_q 0), separate K and V `empty` barriers
    # (kv_join 0), the ring depth of the spec (kv_stages 0 = spec.num_stages). Not spec fields: the templates read
    # them as `gluon`, and scripts/hopper_render.py overrides them to measure variants (o_via_q/kv_join: [Note] O
    # via Q, [Note] Joined release in fagen/templates/gluon/attention.py.j2).
    variant = {"q_stages": 2, "pingpong": 0, "v_late": 0, "k_late": 0, "consumer_regs": 240, "loader_regs": 24,
               "o_via_q": 0, "kv_join": 0, "kv_stages": 0}

    # [Note] Gluon selection rule. The cases where the H100 measurements of docs/hopper.md show the gluon forward
    # beating the Triton one: a prefill forward, head_dim 128, bf16, mask none (any gqa: +5% full s16k) or causal
    # with gqa > 1 (+13% gqa 32/8 causal s4k). Not MHA causal: the Triton forward won it in the three latest runs
    # (s16k Triton / Gluon TF/s: 558 / 550 in benchmarks/hopper/6-integration, 559 / 543 and 562 / 543 in
    # benchmarks/scores.md), so phase 1's +3% did not hold. Not d64 (-7%), not fp16 (496 vs 493 TF/s, a tie), not
    # padding/tree masks (no such kernel). With score switches: causal with the window switch alone (any gqa),
    # where the gluon forward's block skipping measured +9% over the Triton one (window 4096 at s32k, d128 bf16,
    # MHA: 540 vs 497 TF/s, same run; docs/hopper.md, "Score switches in the forward"). Not the softcap (470 vs
    # 477 TF/s, a tie lost), not window with softcap (not measured), never ALiBi or sinks (the gluon forward has
    # neither). The backward is selected for no case by default (slower than the Triton backward everywhere:
    # d128 causal s16k bf16 298 vs 433 TF/s); opted in, it serves bwd_selected's cases. Where and when the rule
    # applies (the device, $FAGEN_HOPPER, the problem size): [Note] Hopper selection in fagen/runtime/hopper.py.
    selected_head_dims = (128,)
    selected_dtypes = (DType.BF16,)
    selected_masks = (Mask.NONE, Mask.CAUSAL)
    selected_switches = (("window",), Mask.CAUSAL)  # the one switch set selected, and its mask (any gqa)
    bwd_selected_head_dims = (128,)
    bwd_selected_dtypes = (DType.BF16,)
    bwd_selected_masks = (Mask.NONE, Mask.CAUSAL)

    def default_config(self, spec, arch: str, given: dict) -> dict:
        """The measured default (docs/hopper.md), on sm_90 only. d128: 2 K/V slots, all that fits beside Q (two
        buffers per warpgroup) and O (H100: 630 TF/s full, 568 causal at s16k bf16); d64: 3 slots."""
        return {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2 if spec.head_dim >= 128 else 3}

    def smem_bytes(self, spec) -> int:
        return smem_bytes(spec.head_dim, spec.block_m, spec.block_n, spec.num_stages)

    def check_more(self, spec) -> None:
        if spec.direction is Direction.BWD:
            for name in spec.switches:
                raise SpecError(name, True, "the gluon backward has no score switches; use backend 'triton', or "
                                            "direction 'fwd' for the gluon forward")
            if spec.head_dim not in self.bwd_head_dims:
                raise SpecError("head_dim", spec.head_dim, "the gluon backward supports head_dim 128; use backend "
                                "'triton' for other head dims")

    def selected(self, spec) -> bool:
        """Whether the measured rule ([Note] Gluon selection rule) picks the gluon forward for the case of `spec`."""
        if not (spec.kind is Kind.PREFILL and spec.direction is Direction.FWD
                and spec.head_dim in self.selected_head_dims and spec.dtype in self.selected_dtypes):
            return False
        if spec.switches:
            return (spec.switches, spec.mask) == self.selected_switches
        return spec.mask in self.selected_masks and not (spec.mask is Mask.CAUSAL and spec.gqa == 1)

    def bwd_selected(self, spec) -> bool:
        """Whether the gluon backward serves the case of `spec` once opted in ($FAGEN_HOPPER_BWD=1)."""
        return (spec.kind is Kind.PREFILL and not spec.switches and spec.head_dim in self.bwd_selected_head_dims
                and spec.dtype in self.bwd_selected_dtypes and spec.mask in self.bwd_selected_masks)
