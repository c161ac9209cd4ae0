"""The gluon backend's decode: MLA's absorbed decode (shared_kv, head_dim 576, head_dim_v 512), bf16/fp16 caches
(fagen/templates/gluon/mla_decode.py.j2) and fp8 e4m3 latent caches (fagen/templates/gluon/mla_decode_fp8.py.j2):
the spec's limits, the template of a spec, and the measured rule. GluonBackend (fagen/backends/gluon.py) takes these
as a base class."""

from __future__ import annotations

from fagen.spec.axes import DType, Kind, KVDType, Layout, Mask, SpecError


class DecodeRules:
    # [Note] Gluon MLA decode. fagen/templates/gluon/mla_decode.py.j2: MLA's absorbed decode (shared_kv, head_dim
    # 576 with head_dim_v 512) as FlashMLA's seesaw (two warpgroups of 64 packed query rows, a loader warp, 64-key
    # blocks in pairs; the lab's lab/gluon_mla_decode_ss.py). The spec: bf16/fp16, mask none/causal, no switch,
    # dense or paged; its launch fields are fixed (decode_launch: a program's 64 rows, 64-key blocks, 4 warps a
    # warpgroup partition, 2 slots). Its inputs also need Hq x Sq a multiple of 64, one KV head and pages of a
    # multiple of 64 keys (the module's fits(q, k)). The rule (decode_selected): bf16, causal or none, where Hq x Sq
    # is a multiple of 64 (fagen/runtime/hopper.py, latent_decode_spec). H100, page 64, the product modules
    # (scripts/gpu_mla_glu.py, round A; docs/serving.md, "The Gluon MLA decode in the product"): Hq 128 Sq 2 kv8192
    # b32 / b64 527 / 546 TF/s against the Triton decode's 251 / 266; Hq 128 Sq 1 b64 493 against 256; Hq 64 Sq 1
    # b64 262-306 against 213.
    # [Note] Gluon fp8 latent decode (twelfth session). With kv_dtype fp8_e4m3 the spec renders
    # fagen/templates/gluon/mla_decode_fp8.py.j2 (the eleventh session's register-A lab kernel,
    # lab/gluon_mla_decode_f8r.py, with fp16 dots, partial row sums and the late page clamp: one warpgroup of 16
    # query rows a program, two programs an SM); e5m2 keeps the Triton decode. select_fp8_latent: whether the rule
    # picks it (fagen/runtime/hopper.py also bounds the rows: LATENT_FP8_MAX_ROWS). H100, round A of
    # scripts/gpu_fp8lat_s12.py (2026-11-27 16:58 UTC; docs/serving.md, "MLA decode, twelfth session"): the serving
    # bench's fp8 latent rows (fagen.bench's run_case, do_bench) h16 kv4k b128 1491 -> 1935 GB/s, h16 kv32k b32
    # 1341 -> 2076 GB/s; paged page 64, CUDA graphs, per token b128 kv4k / b32 kv32k / b128 kv32k / b32 kv4k 1317 /
    # 1169 / 1394 / 934 -> 2135 / 2240 / 2477 / 1309 GB/s (per tensor 1418 / 1272 / 1528 / 1000 -> 2078 / 2167 /
    # 2403 / 1311); Hq 128 Sq 2 b32 kv8k 199 (Triton) against 188 TF/s: LATENT_FP8_MAX_ROWS 16. Thirteenth session:
    # fagen.attention routes an e4m3 cache here too (docs/serving.md, "MLA fp8 latent decode (thirteenth session)").
    # Twenty-third session: variant fp8lat_seesaw (on since its H200 run) adds the seesaw of mla_decode.py.j2 over the e4m3 cache
    # to that module (fagen/templates/gluon/mla_seesaw.j2, [Note] Seesaw fp8 conversion: a converter warpgroup turns
    # each fp8 part into f16 in shared memory, Q into f16 too, [Note] Seesaw f16 operands, since the twenty-fourth
    # session; SEESAW_CVT 0 the bf16 conversion with the bf16 matmuls unchanged) for Hq x Sq a multiple of 64, and the
    # rule (latent_decode_spec) sends those rows to it (docs/serving.md, "MLA fp8 latent decode at 64-row programs").
    # H200, the suite's row decode-mla-absorbed-h128-sq2-kv8k-b32-fp8 (scripts/gpu_mlafp8c_s23.py, round B again):
    # the Triton decode 207 TF/s, the fp8 seesaw 324 (SEESAW_ORDER 0) / 337 (1), the bf16 seesaw's row 535.
    decode_dims = (576, 512)
    decode_launch = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}
    select_mla_decode = True
    select_fp8_latent = True
    decode_templates = {None: "gluon/mla_decode.py.j2", KVDType.FP8_E4M3: "gluon/mla_decode_fp8.py.j2"}

    def template_for(self, spec) -> str:
        if spec.kind is Kind.DECODE:
            return self.decode_templates[spec.kv_dtype]
        return super().template_for(spec)

    def check(self, spec) -> None:
        if spec.kind is Kind.DECODE:
            return self._check_decode(spec)
        if spec.layout is not Layout.DENSE:
            raise SpecError("layout", str(spec.layout), "the gluon prefill forward and backward read dense q/k/v (the "
                                                        "paged layout is the MLA decode's, kind 'decode'); use "
                                                        "backend 'triton' for varlen and paged layouts")
        return super().check(spec)

    def _check_decode(self, spec) -> None:
        """The gluon decode's limits ([Note] Gluon MLA decode): each refusal names the field and says that backend
        'triton' serves the case."""
        if not spec.shared_kv or (spec.head_dim, spec.head_dim_v) != self.decode_dims:
            raise SpecError("backend", str(spec.backend), "the gluon decode is MLA's absorbed decode only (shared_kv, "
                                                          f"head_dim {self.decode_dims[0]}, head_dim_v "
                                                          f"{self.decode_dims[1]}); set backend 'triton' for other "
                                                          "decode kernels")
        if spec.dtype not in (DType.BF16, DType.FP16):
            raise SpecError("dtype", str(spec.dtype), "the gluon decode computes bf16 and fp16; use backend 'triton'")
        if spec.kv_dtype is not None and spec.kv_dtype not in self.decode_templates:
            raise SpecError("kv_dtype", str(spec.kv_dtype), "the gluon decode reads a cache of the query's dtype or "
                                                            "fp8_e4m3 ([Note] Gluon fp8 latent decode); use backend "
                                                            "'triton' for an fp8_e5m2 cache")
        if spec.mask not in (Mask.NONE, Mask.CAUSAL):
            raise SpecError("mask", str(spec.mask), "the gluon decode supports masks 'none' and 'causal'; use "
                                                    "backend 'triton' for padding and tree masks")
        if spec.switches:
            raise SpecError(spec.switches[0], True, "the gluon decode has no score switches; use backend 'triton'")
        for name, value in self.decode_launch.items():
            if getattr(spec, name) != value:
                raise SpecError(name, getattr(spec, name), f"the gluon decode's tiles are fixed ({name} {value}: "
                                                           "[Note] Gluon MLA decode); leave it unset")

    def decode_selected(self, spec) -> bool:
        """Whether the measured rule ([Note] Gluon MLA decode, [Note] Gluon fp8 latent decode) picks the gluon
        decode for the case of `spec` (machine and query rows not considered)."""
        select = self.select_fp8_latent if spec.kv_dtype is KVDType.FP8_E4M3 else (
            self.select_mla_decode and spec.kv_dtype is None)
        return (select and spec.kind is Kind.DECODE and spec.shared_kv
                and (spec.head_dim, spec.head_dim_v) == self.decode_dims and spec.dtype is DType.BF16
                and spec.mask in (Mask.NONE, Mask.CAUSAL) and not spec.switches and not spec.modded)

    def decode_smem(self, spec) -> int:
        """Shared memory of a decode program: bf16, Q 72 KB, two slots of 72 KB, P 8 KB, the row stats and barriers;
        fp8, V's 8 fp16 chunks 64 KB, Q 18 KB, P 2 KB and triton's scratch, and 4 KB a staged chunk (variant
        fp8lat_stage, [Note] Staged chunks); with variant fp8lat_seesaw the module's seesaw, the bf16 one's."""
        seesaw = 2 * (64 * 576 + 2 * 64 * 576 + 64 * 64) + 8 * 64 * 4 + 1024
        if spec.kv_dtype is not None:
            own = 2 * (64 * 512 + 9 * 16 * 64 + 64 * 16) + 1024 + 4096 * self.variant.get("fp8lat_stage", 0)
            return max(own, seesaw) if self.variant.get("fp8lat_seesaw") else own
        return seesaw
