"""The Triton backend: the default one, for every head dim, dtype, mask, layout, kind and direction.

Its tiles come per target arch ([Note] Tiles per arch); its shared memory is estimated from the tiles the kernels
stage ([Note] Shared-memory filter); the build checks it per arch, the spec does not.
"""

from __future__ import annotations

from fagen.backends.base import KernelBackend, fit
from fagen.spec import targets, tuned
from fagen.spec.axes import Backend, DType, Direction, Kind, KVDType, Layout, Mask


# [Note] fp8 decode tiles by shape (nineteenth session; docs/serving.md, "fp8 decode tiles by shape"). On the H200
# the dense fp8 decode is bound by its instructions, not by the memory (m64n128w4s3 0.78 / 0.77 of copy at the
# serving suite's b32 kv8k / b8 kv32k, the bf16 cache 1.05): its speed follows the wave efficiency of its programs
# and how many share an SM. With DENSE_FP8_TWO_WARPS an e4m3 d128 cache on sm_90 takes 64-key blocks on 2 warps (54
# KB, 179 registers: 4 programs an SM), whose split rule counts 4 programs an SM and takes the smallest split count
# within 95% of the best wave efficiency (SPLIT_WAVES in the decode template; 85% took 7 splits at b8 x 8 KV heads,
# 448 programs on 528 slots); where that rule chooses the count, one query a sequence, B x KV heads below 80% of
# the second tile's 792 slots and chunks of 1024 keys or more take SHAPE_TILE, 32-key blocks on one warp (36 KB, 6
# an SM). Forced counts (forward_split, Plans) and batch_invariant=True keep the spec's tile (the invariant chunks
# follow the sequence's length and the spec only). H200, e7aa689f:scripts/gpu_fp8dec_s19.py, speed against m64n128w4s3 over
# 12 shapes (b8-b128, kv 4k-32k, Hq 32 / Hkv 8), per pass, median of 3: round B 1.020 (b8 kv4k) to 1.151, the suite's
# rows 0.890 / 0.871 of copy (1.140x / 1.135x); round A, the two tiles apart, 0.987-1.093 and 0.905-1.155.
# batch_invariant=True on the 2-warp tile 1.171x / 1.090x at the suite's rows. e5m2, d64 and more query rows a
# tile were not measured: they keep m64n128w4s3.
DENSE_FP8_TWO_WARPS = True
# [Note] MLA Gluon dK/dV (twenty-second session; fagen/templates/gluon/mla_dkdv.py, docs/serving.md): the MLA
# backward's (dense 192/128, causal or no mask, bf16/fp16) dK/dV in a Gluon kernel on sm_90 (a TMA producer warp,
# two compute warpgroups of 64 keys), beside the Triton preprocess and dQ kernel. On, those specs' renders carry it
# and launch it where the call fits (the Triton dK/dV otherwise); False: every render as before it. H200, causal b4
# h16 s4096 bf16 (scripts/gpu_mlabwd_s22.py), against the Triton pair per pass, do_bench: round A (2 passes) 1.057,
# `fagen.attention` 1.086; round B (27 passes) 1.048 [q1 1.020, q3 1.062], `fagen.attention` 1.044 (0.933x cuDNN
# against 0.892x); back to back 1.007 / 1.017 [0.995, 1.032]. Same checks as the pair (float64, exact zeros, bits).
MLA_GLUON_DKDV = True
# [Note] MLA 192/128 decode tiles (twenty-third session; docs/serving.md, "MLA 192/128 decode (twenty-third
# session)"). The MLA decode of its own V (d_qk 192, d_v 128, a dense bf16/fp16 cache; Hq 16 over one KV head in the
# serving suite) took the wide decode default m32n32w4s2 (33 KB, 80-96 registers), whose split rule counts 2 programs
# an SM: one 32-key block in flight a program, 2 a SM, and the cache read at 0.62-0.68 of copy on the H200 (cuDNN
# 0.62-0.90). With MLA192_DECODE those specs on sm_90 take MLA192_DECODE_TILE (block_n, num_warps, num_stages,
# programs an SM), and their split rule counts its programs an SM (PROGRAMS_PER_SM in the decode template, through
# decode_programs_per_sm: any arch, for a spec on that tile). H200 (scripts/gpu_mla192dec_s23.py, per pass against
# m32n32w4s2 at 2): round A, the suite's b128 kv4k / b64 kv8k / b32 kv32k, m32n32w4s3 at 3 an SM 1.438 / 1.429 /
# 1.607, m32n64w4s3 at 2 1.433 / 1.436 / 1.556, m32n32w4s4 at 2 1.437 / 1.438 / 1.514; counting 4 an SM on the
# 3-stage tile (a second wave) 1.09 / 1.06 / 1.13. Round B (5 passes, the product's render on at each tile):
# m32n64w4s3 at 2 (106 KB, 128 registers, no spills) 1.439 / 1.433 / 1.588 (0.973 / 0.964 / 0.987 of copy; 1.55x /
# 1.12x / 1.09x cuDNN), b8 kv32k 1.427, b16 kv8k 1.371, b128 kv8k 1.472, b32 kv4k 1.394, b1 kv32k 1.081, Hq 128 Sq 2
# b32 kv8k causal 1.415; m32n32w4s3 at 3 1.425 / 1.418 / 1.603, b8 kv32k 1.325, b1 1.109, Sq 2 1.339. The 64-key
# tile's rule counts 2 an SM, the template's own count; with 32 rows a tile (Hq 128 Sq 2) it takes 116 KB, 1 an SM.
MLA192_DECODE = True
MLA192_DECODE_TILE = (64, 4, 3, 2)


def mla192_decode(spec) -> bool:
    """Whether `spec` is the decode MLA192_DECODE covers: d_qk 192, d_v 128, a dense bf16/fp16 cache of its own V."""
    return (spec.kind is Kind.DECODE and (spec.head_dim, spec.head_dim_v) == (192, 128) and spec.kv_dtype is None
            and not spec.shared_kv and spec.layout is Layout.DENSE and spec.dtype is not DType.FP32)


def decode_programs_per_sm(spec) -> int | None:
    """The split rule's programs an SM a lever sets for a decode spec (the template's PROGRAMS_PER_SM): with
    MLA192_DECODE, MLA192_DECODE_TILE's for a spec on its tile ([Note] MLA 192/128 decode tiles); else None (the
    template's own count)."""
    if MLA192_DECODE and mla192_decode(spec) and (spec.block_n, spec.num_warps, spec.num_stages) \
            == tuple(MLA192_DECODE_TILE[:3]):
        return MLA192_DECODE_TILE[3]
    return None


class TritonBackend(KernelBackend):
    backend = Backend.TRITON
    templates = {Kind.PREFILL: "triton/attention.py.j2", Kind.DECODE: "triton/decode.py.j2"}
    layouts = (Layout.DENSE, Layout.VARLEN, Layout.PAGED)

    def default_config(self, spec, arch: str, given: dict) -> dict:
        if spec.shared_kv:
            # [Note] Latent decode tiles. MLA's absorbed decode (shared_kv, d576 v512); block_m caps the packed rows
            # (gqa x Sq) of one tile. Timed on the H100 by scripts/gpu_mla_sweep.py (2026-11-26, paged 64, every
            # tile checked against float64; % of copy bandwidth at h16 sq1 b128 kv32k / b128 kv4k / b32 kv32k /
            # b32 kv4k, batch-invariant splits of 256+ keys; docs/serving.md): m64n32w8s2 (the default before)
            # 73/58/68/46, n32w4s3 89/66/76/46, n64w8s2 88/65/77/43, n32w8s3 86/61/77/48; with 1024-key chunks
            # n32w4s3 88/75/76/63, the best mean in every split form. A 16-row tile at n32 w4 s3 spills nothing
            # (sm_90 ptxas: 188-220 registers, 92 KB); 64 rows at w4 spill 372 words, so block_m 16: Hq 16 with
            # Sq > 1 runs 16-row tiles, each reading the cache (from L2 after the first).
            # Hq 128 (gqa >= 64), Sq 2, b64 kv4k causal, TF/s with one split / 4096-key chunks: n64w8s2 223 / 212,
            # n32w8s3 192 / 202, n32w8s2 (before) 165 / 169, 32-row tiles (mma.sync) 97. n64w8s2's 217 KB of shared
            # memory fits sm_90 only; its spills (118 words) sit outside the unmasked key loop (SASS). With split scores
            # (sixth session, [Note] Split scores in the decode template) n64w8s2 runs 258-270 TF/s at b64-b128
            # (n32w8s3 232-239, n32w8s2 187-193, n16w8s4 159-162), still 217 KB.
            if spec.gqa >= 64 and arch == "sm_90":
                return {"block_m": 64, "block_n": 64, "num_warps": 8, "num_stages": 2, **given}
            if spec.gqa >= 64:
                return {"block_m": 64, "block_n": 32, "num_warps": 8, "num_stages": 2, **given}
            return {"block_m": 16, "block_n": 32, "num_warps": 4, "num_stages": 3, **given}
        if (spec.head_dim, spec.head_dim_v) == (192, 128) and spec.kind is Kind.PREFILL and spec.mask != Mask.TREE \
                and spec.dtype is not DType.FP32 and targets.TILE_FAMILY.get(arch) == "sm_90":
            # [Note] MLA prefill tiles (192/128, sm_90). H100, causal b4 h16 s4096 bf16, TF/s, with [Note] Split head
            # dim (scripts/gpu_mla_prefill.py, 2026-11-26 14:23 UTC; cuDNN through SDPA in the same run: fwd 580,
            # bwd 417): fwd m128n64w8s3 456, m128n128w8s2 411, m128n64w8s2 (the default before) 338, m64n128w4s2
            # 305, m64n128w8s2 233; bwd m128n64w8s2 243, m64n64w8s3 199, m64n64w8s2 (the default before) 184,
            # m128n32w8s2 156, m64n32w8s2 117. sm_90 ptxas: fwd m128n64w8s3 162 registers, 0 spills, 170 KB;
            # bwd m128n64w8s2 dK/dV 255 registers and 10 spilled words, dQ 237 and 0, 122/161 KB. Before the
            # split (one 256-wide tile, benchmarks/serving.md): fwd m128n64w8s2 326, bwd m64n64w8s2 163. Second run
            # (15:12 UTC, cuDNN fwd 568, bwd 414): bwd m128n64w8s3 251 against m128n64w8s2 242, so 3 stages both ways.
            # Sixth session ([Note] MLA backward steps; docs/serving.md): bwd m128n128w8s2, 128 keys per dK/dV program
            # stepping 32 queries, both gradient kernels at 3 stages: H100 (6cce75b:scripts/gpu_mla_bwd.py, 21:22 UTC,
            # cuDNN 400 TF/s) with dQ 32-key steps 327 TF/s against m128n64w8s3's 246; dK/dV 1.53 ms (2 stages
            # 1.67, 64-key programs 3.2-3.4), dQ with 64-key steps at 3 stages 1.03 ms (32-key 1.16). sm_90 ptxas: no
            # spills (dK/dV 255 registers, 142 KB; dQ 241, 201 KB); the module's forward m128n128w8s2 at 2 stages
            # (3 need 288 KB) ran 409 TF/s against m128n64w8s3's 413.
            tiles = dict(block_m=128, block_n=64, num_warps=8, num_stages=3)
            if spec.direction is Direction.BWD:
                tiles = dict(block_m=128, block_n=128, num_warps=8, num_stages=2)
            return fit(tiles, lambda c: tile_bytes(spec.head_dim, spec.dtype, spec.direction, c["block_m"],
                                                   c["block_n"], c["num_stages"], spec.head_dim_v),
                       targets.smem_limit(arch), given)
        if MLA192_DECODE and mla192_decode(spec) and targets.TILE_FAMILY.get(arch) == "sm_90":
            bn, nw, ns, _ = MLA192_DECODE_TILE  # [Note] MLA 192/128 decode tiles
            return {"block_m": 32, "block_n": bn, "num_warps": nw, "num_stages": ns, **given}
        if spec.kv_dtype is not None and spec.layout is Layout.DENSE and max(spec.head_dim, spec.head_dim_v) <= 128 \
                and targets.TILE_FAMILY.get(arch) == "sm_90":
            # [Note] fp8 decode tiles. An fp8 key is half a bf16 key's bytes, so 128-key blocks keep as many bytes in
            # flight a stage as the bf16 cache's 64-key ones; with V converted once ([Note] V converted once in the
            # decode template) sm_90 ptxas gives 168 registers and 105 KB (two programs an SM). H100 (eighth
            # session, scripts/gpu_fp8kv_s7.py round A, d128 h32/8 e4m3, % of copy at b32 kv8k / b128 kv8k / b32
            # kv32k): m64n128w4s3 90 / 100 / 98 against m64n64w4s3 (before) 91 / 94 / 99; n128s2 85 / 93 / 92,
            # n64s4 89 / 89 / 97 (both converted once); e5m2 n128s3 90 / 99 / 98 (92 / 94 / 99 before). Those are
            # do_bench's, whose L2 flush costs ~17 us a call; round B back to back: 96 / 100 / 100 against 96 / 95 /
            # 100 before (docs/serving.md, "128-key tiles"). Paged caches keep theirs (V converted once lost there).
            if DENSE_FP8_TWO_WARPS and spec.kv_dtype is KVDType.FP8_E4M3 \
                    and spec.head_dim == spec.head_dim_v == 128:  # [Note] fp8 decode tiles by shape
                return {"block_m": 64, "block_n": 64, "num_warps": 2, "num_stages": 3, **given}
            return {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 3, **given}
        if spec.kv_dtype is not None and spec.layout is Layout.PAGED and not spec.shared_kv \
                and max(spec.head_dim, spec.head_dim_v) <= 128 and targets.TILE_FAMILY.get(arch) == "sm_90":
            # [Note] Paged fp8 decode tiles (ninth session; docs/serving.md, "Paged fp8 KV, ninth session"): 128-key
            # blocks on 8 warps (100 registers, 104 KB: 16 warps an SM) with V converted once (the decode template
            # converts V once for paged blocks of at most 64 keys or on 8 warps). H100 round B (scripts/gpu_fp8kv_s9.py,
            # % of copy back to back, page 16 b32 kv8k / b128 kv8k / b32 kv32k, page 64 b32 kv8k / b128 kv4k): 87 / 90 /
            # 92 / 89 / 89 against m64n128w4s2 (the default before) 83 / 87 / 87 / 86 / 87; n64s5 w4 72-82.
            # Eighteenth session (docs/serving.md, "Paged fp8 decode (eighteenth session)"): on the H200 the kernel,
            # not the memory, is the limit (m64n128w8s3 0.650 of copy, the bf16 paged row 1.00), and fewer warps a
            # program repeat less of the step: 64-key blocks on 2 warps (187 registers, 54 KB: 4 programs an SM, which
            # the split rule counts, [Note] Split heuristic in the decode template; 19 SASS a key against 27) read
            # 0.810 of copy against 0.650 (scripts/gpu_pagedfp8_s18.py round A, 1.246x the old default's speed).
            return {"block_m": 64, "block_n": 64, "num_warps": 2, "num_stages": 3, **given}
        return default_config(max(spec.head_dim, spec.head_dim_v), spec.dtype, spec.direction, spec.kind,
                              mask=spec.mask, arch=arch, layout=spec.layout, window=spec.window, given=given,
                              head_dim_v=spec.head_dim_v)

    def smem_bytes(self, spec) -> int:
        return smem_bytes(spec)

    def tma_loads(self, spec) -> bool:
        return tma_loads(spec)

    def aot_missing(self, spec) -> str | None:
        if spec.kind is Kind.DECODE:
            return ("decode kernels have no ahead-of-time build: their tile rows and split count follow each call's "
                    "query and KV lengths, so they compile at first use (fagen.load(spec))")
        return None


def default_config(head_dim: int, dtype: DType, direction: Direction, kind: Kind, mask: Mask | None = None,
                   arch: str = tuned.DEFAULT_ARCH, layout: Layout = Layout.DENSE, window: bool = False,
                   given: dict | None = None, head_dim_v: int | None = None) -> dict:
    """Block sizes, warps and stages used on `arch` when a spec leaves them unset.

    [Note] Tiles per arch
    The tuned table (fagen/spec/tuned.json, written by `fagen tune`) wins for its (arch, head_dim, mask, dtype,
    direction, kind); otherwise the hand defaults of the arch's family (targets.TILE_FAMILY) apply, shrunk by
    `fit` until the shared-memory estimate fits the arch (stages to 2, then block_n to 32, then block_m to 64);
    the fields in `given` (what the spec sets) stay as given.
    sm_90's are the H100's tuned winners; sm_80's were chosen with ptxas so that no catalog kernel spills on
    sm_80 and every one fits its 163 KB (tests/test_arch_defaults.py compiles them).
    """
    config = _tuned_or_hand(head_dim, dtype, direction, kind, mask, arch, layout, window)
    return fit(config, lambda c: tile_bytes(head_dim, dtype, direction, c["block_m"], c["block_n"], c["num_stages"],
                                            head_dim_v), targets.smem_limit(arch), given)


def _tuned_or_hand(head_dim: int, dtype: DType, direction: Direction, kind: Kind, mask: Mask | None, arch: str,
                   layout: Layout, window: bool) -> dict:
    """The tuned entry of `arch`, else its family's hand default (sm_90's: the bf16 winners of the H100 table, so
    fp16 and other head dims follow them: d128 m128n128w8s3, 547 TF/s full and 524 causal at s16k with TMA; d64
    m128n128w4s3, 448 causal). Windowed d64 forwards take their own tile, before the table (whose keys have no
    score switches): see [Note] Windowed d64 tiles.
    """
    wide = head_dim > 128 or dtype is DType.FP32
    if window and head_dim <= 64 and not wide and direction is Direction.FWD and kind is Kind.PREFILL:
        # [Note] Windowed d64 tiles. The window's width is a runtime argument, so the spec only knows that there
        # is one. The d64 models with windowed layers use small windows (gpt-oss: 128 keys, alternate layers),
        # where a 128 x 128 tile loads 2-3 key blocks (256-384 keys) per 128-key window, every one of them with
        # mask arithmetic. H100, gpt-oss layer (d64, causal window 128, sinks, GQA 64/8, s8k, bf16;
        # benchmarks/scores.md): m128n128w4s3 (the plain d64 tile) 68-69 TF/s, 0.88x FlexAttention (78);
        # m64n32w4s3 104-105 TF/s (1.33-1.35x Flex, three runs); m64n16 98, m64n32s4 101, m64n64 90, m128n32 83,
        # m32 blocks 48-67. A wide window pays for the small tile: d64 causal window 4096 at s16k runs 349 TF/s
        # on it against 379 on m128n128w4s3 (0.92x); a caller who knows its window is wide sets the blocks.
        return {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 3}
    found = tuned.lookup(head_dim, mask, dtype, direction, kind, arch=arch)
    if found is not None:
        return found
    if kind is not Kind.DECODE and not wide and targets.TILE_FAMILY.get(arch) == "sm_80":
        return _sm80_config(head_dim, direction, mask, layout)
    if kind is Kind.DECODE:
        # block_m caps the query rows of one tile (gqa * Sq packed; the launcher shrinks it to fit), block_n is
        # keys per step. Memory-bound: stages keep K/V loads in flight. At 4 warps the fp32 accumulator of a
        # 64 x 128 tile is 64 registers a thread; 128 rows spill (sm_90 ptxas), so more rows take more tiles.
        if wide:
            return {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 2}
        if layout is Layout.PAGED:
            # [Note] Paged decode tiles. Each block's rows are gathered through the block table, a dependent load
            # before K/V: wider blocks amortise it. H100, d128 bf16 32/8 heads, page 16 (scripts/paged_sweep.py,
            # 2026-11-23): n128 w4 s2 2904 / 2868 GB/s (KV 8k x b32 / 32k x b8), n64 w4 s3 2799 / 2788,
            # n32 2380 / 2374; dense decode (n64 w4 s3) 2952 / 2920 on the same problems.
            return {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 2}
        return {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3}
    if direction is Direction.BWD:
        # block_n = keys per dK/dV program, block_m = queries per dQ program; each steps over the other axis in
        # tiles of at most 64 (fagen/templates/triton/backward.py.j2, [Note] Backward tiles). The forward of a bwd module
        # runs with the same values, so d128 takes the forward's best tile. H100 sweep: docs/backward.md.
        if wide:
            return {"block_m": 64, "block_n": 32, "num_warps": 8, "num_stages": 2}
        if head_dim <= 64:
            return {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3}
        if mask == Mask.TREE:  # measured only for correctness; m128n64w8s2 spilled 216 words (sm_90), this none
            return {"block_m": 64, "block_n": 32, "num_warps": 8, "num_stages": 2}
        return {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3}
    if wide and dtype is not DType.FP32 and targets.TILE_FAMILY.get(arch) == "sm_90":
        # [Note] Wide forward tiles on sm_90. H100, MLA 192/128 causal, b4 h16 s4k bf16 (scripts/gpu_serving.py,
        # benchmarks/serving.md, 2026-11-26): m128n64w8s2 326 TF/s against 150 for m64n32w4s2. ptxas (sm_90): d192v128
        # 155 registers, 161 KB; d192 and d256 236 registers, 193 KB; no spills. d256 itself was not timed.
        return {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2}
    if wide:
        return {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}
    if head_dim <= 64 and mask == Mask.TREE:
        # m128n128w4s3 spilled 2380 words on sm_80 and 1138 on sm_90 (ptxas, d64 fp16): the masked steps stage
        # tree-mask tiles too. m128n64w8s2 spills none on either (fagen compile --arch sm_80,sm_90, 2026-11-23).
        return {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2}
    if head_dim <= 64:
        return {"block_m": 128, "block_n": 128, "num_warps": 4, "num_stages": 3}
    return {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3}


def _sm80_config(head_dim: int, direction: Direction, mask: Mask | None, layout: Layout) -> dict:
    """sm_80's prefill tiles for head_dim <= 128 in fp16/bf16 (mma.sync; 163 KB of shared memory a block).

    No A100 timing chose them: they are the largest tiles of the sm_90 rules' shape that fit and spill nothing
    in any catalog variant (ptxas of triton 3.6, 2026-11-26; `fagen build fagen/spec/catalog.toml`). The sm_90
    tiles spill on sm_80 (d64 causal m128n128w4s3: 78 words) or do not fit (d128 m128n128w8s3: 224 KB). Spills of
    the candidates, bf16: forward d64 causal m128n64w4s3 2 words, m128n64w8s3 0; d128 m128n64w8s3 0, tree 222
    (m64n64w8s2 2, m64n32w8s2 0), paged 6 (m128n64w8s2 0); backward d64 m64n64w4s3 16 (gqa 4, mask none),
    m64n64w8s3 0; d128 m64n64w4s3 16, m64n64w8s3 0; tree d64 m128n64w8s2 140, m64n32w4s2 0; tree d128
    m128n64w8s2 1404, m64n32w8s2 0. Decode kernels keep the sm_90 tiles (they fit: 112 KB dense, 144 KB paged).
    """
    tree = mask == Mask.TREE
    if direction is Direction.BWD:
        if tree:
            return {"block_m": 64, "block_n": 32, "num_warps": 4 if head_dim <= 64 else 8, "num_stages": 2}
        return {"block_m": 64, "block_n": 64, "num_warps": 8, "num_stages": 3}
    if tree:
        return ({"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2} if head_dim <= 64
                else {"block_m": 64, "block_n": 32, "num_warps": 8, "num_stages": 2})
    return {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2 if layout is Layout.PAGED else 3}


def smem_bytes(spec) -> int:
    """Shared memory a Triton spec's tiles need, estimated from the tiles the kernel stages (tile_bytes)."""
    return tile_bytes(spec.head_dim, spec.dtype, spec.direction, spec.block_m, spec.block_n, spec.num_stages,
                      spec.head_dim_v)


def tile_bytes(head_dim: int, dtype: DType, direction: Direction, block_m: int, block_n: int,
               num_stages: int, head_dim_v: int | None = None) -> int:
    """Shared memory a Triton config's tiles need, estimated from the tiles the kernel stages.

    [Note] Shared-memory filter
    Forward: the Q tile stays resident and each pipeline stage holds one K and one V tile:
    (block_m + 2 * num_stages * block_n) * D * bytes. Backward (fagen/templates/triton/backward.py.j2, [Note] Backward
    tiles): the dK/dV kernel keeps block_n rows of K and V resident and stages Q and dO tiles of min(block_m, 64)
    rows; the dQ kernel keeps block_m rows of Q and dO and stages K and V tiles of min(block_n, 64) rows; a bwd
    module's forward runs with the same config, so the largest of the three must fit. Triton's real use differs a
    little (d128 bf16 m128n128s3: estimated 224/160/160 KB, compiled 225/162/161). Decode kernels stage the same
    tiles as the forward. A config over the limit by this estimate is rejected before compiling; one that passes
    it and still does not fit fails in the compiler. With a V head dim of its own (head_dim_v), the V and dO tiles
    are that wide (padded the same way) and the Q and K tiles head_dim wide, in two parts where it is not a power of
    two ([Note] Split head dim in triton/attention.py.j2: 192 as 128 + 64). d192v128 bf16, estimated / compiled
    (sm_90): fwd m128n64s3 168 / 170 KB, bwd m64n64s2 dK/dV and dQ 120 / 122 and 121 KB.
    """
    d = 1 << (head_dim - 1).bit_length()  # the kernel pads D to a power of two
    dv = d if head_dim_v is None else 1 << (head_dim_v - 1).bit_length()
    if head_dim_v is not None and head_dim_v != head_dim and d != head_dim:  # [Note] Split head dim (templates)
        d = d // 2 + max(16, 1 << (head_dim - d // 2 - 1).bit_length())
    elements = block_m * d + num_stages * block_n * (d + dv)
    if direction is Direction.BWD:
        dkdv = block_n * (d + dv) + num_stages * min(block_m, 64) * (d + dv)
        dq = block_m * (d + dv) + num_stages * min(block_n, 64) * (d + dv)
        elements = max(elements, dkdv, dq)
    return elements * DType(dtype).itemsize


def tma_loads(spec) -> bool:
    """Whether the Triton prefill forward reads K/V through tensor descriptors (TMA on sm_90).

    [Note] TMA choice: `fagen tune` on the H100 (2026-11-22) with and without descriptors, best config each,
    bf16 TF/s: d128 full 547 vs 520, d128 causal 524 vs 475, d64 causal 448 vs 431, tree p16k+128 0.279 vs
    0.304 ms. ptxas (sm_90, d128 m128n128w8s3): 196 registers instead of 247, no spills either way. On sm_80 the
    descriptors lower to ordinary loads. The decode and backward kernels keep pointer loads, and so do paged caches
    (each key row is gathered through the block table).
    """
    return spec.kind is Kind.PREFILL and spec.layout is not Layout.PAGED
