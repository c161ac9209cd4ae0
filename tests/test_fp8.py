"""The fp8 (e4m3) Gluon forward on any machine: its spec limits, the module it renders, its host checks (descales,
out_dtype, the V transpose). The sm_90 build is in test_fp8_compile.py; the kernel against float64 on an H100 in
scripts/gpu_fp8.py and the GPU test at the end here. Also the fp8 KV cache's conversion in the decode kernels (its
asm emulated over all 256 bytes) and its decode steps (scripts/gpu_fp8kv.py runs both on a GPU)."""

import inspect

import pytest
import torch

import fagen
from fagen.runtime import hopper
from fagen import backends
from fagen.spec import targets
from fagen.spec.axes import DType
from fagen.spec.kernel import KernelSpec, SpecError
from test_fp8_wgs import full_switch

E4M3 = torch.float8_e4m3fn
from _env import DEVICE, ON_GPU

ON_HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)


def fp8(**fields) -> KernelSpec:
    return KernelSpec(**{"backend": "gluon", "head_dim": 128, "dtype": "fp8_e4m3", **fields})


# -- the spec ------------------------------------------------------------------------------------------------
def test_fp8_spec_defaults_name_and_round_trip():
    s = fp8(mask="causal", gqa=4)
    assert (s.block_m, s.block_n, s.num_warps, s.num_stages) == (128, 128, 8, 2)  # d128: 2 K/V slots (twelfth session)
    assert s.name == "attn_fwd_causal_d128_m128n128w8s2_g4_fp8_e4m3_gluon"
    assert fp8(head_dim=64).num_stages == 2
    assert KernelSpec.from_json(s.to_json()) == s and s.dtype is DType.FP8_E4M3
    assert fp8(head_dim=64, window=True).switches == ("window", )
    assert DType.FP8_E4M3 not in DType.portable() and DType.FP8_E4M3.itemsize == 1


@pytest.mark.parametrize("fields,field,words", [
    (dict(backend="triton"), "backend", "backend 'gluon'"),
    (dict(backend="cuda"), "backend", "backend 'gluon'"),
    (dict(kind="decode"), "kind", "kind 'prefill'"),
    (dict(direction="bwd"), "direction", "direction 'fwd'"),
    (dict(mask="causal", softcap=True), "softcap", "window switch only"),
    (dict(head_dim=96), "head_dim", "64 or 128"),
    (dict(mask="tree"), "mask", "'padding' and 'causal+padding'"),
    (dict(mask="padding", window=True), "mask", "padding masks are its plain forward's"),
    (dict(layout="varlen"), "layout", "backend 'triton'"),
    (dict(mask="causal", alibi=True), "alibi", "window and softcap switches only"),
])
def test_fp8_limits_are_spec_errors_naming_the_field(fields, field, words):
    with pytest.raises(SpecError) as e:
        fp8(**fields)
    assert e.value.field == field and words in str(e.value), str(e.value)


def test_fp8_shared_memory_formula_counts_one_byte_operands_and_a_two_byte_out():
    """Q (two buffers per warpgroup) and the K/V ring at 1 byte, the O buffers at 2 (bf16/fp16 out); the compiled
    size is checked against it in test_fp8_compile.py. (The 128-key loop: FP8_FULL_N192 off, [Note] fp8 full-mask
    192-key steps; test_fp8_full_n192.py counts the 192-key steps'.)"""
    with full_switch(False):
        assert backends.smem_bytes(fp8(num_stages=4)) == (2 * 64 * 2 + 2 * 4 * 128) * 128 + 2 * 64 * 2 * 128 + 1024 \
            == 197632
        assert backends.smem_bytes(fp8()) == (2 * 64 * 2 + 2 * 2 * 128) * 128 + 2 * 64 * 2 * 128 + 1024 == 132096
    assert backends.smem_bytes(KernelSpec(backend="gluon", head_dim=128, dtype="bf16")) == 230400  # unchanged
    for d in (64, 128):  # every ring the gluon limits allow fits at 1 byte an element
        for bn in (64, 128):
            assert backends.smem_bytes(fp8(head_dim=d, block_n=bn, num_stages=4)) <= targets.ARCH_SMEM_LIMIT["sm_90"]


def test_fp8_is_the_gluon_forward_wherever_it_exists():
    """No other fp8 kernel: selected for every case of its limits ($FAGEN_HOPPER and the bf16 wins do not apply)."""
    for fields in (dict(), dict(mask="causal"), dict(head_dim=64, gqa=8), dict(mask="causal", window=True)):
        assert hopper.selected(fp8(**fields)), fields
    assert hopper.forward_spec(fp8(), torch.device("cpu")) is None  # not a Hopper device


def test_fagen_verify_refuses_fp8_in_one_line():
    from click.testing import CliRunner
    from fagen.cli import main
    r = CliRunner().invoke(main, ["verify", "--head-dim", "128", "--dtype", "fp8_e4m3", "--backend", "gluon",
                                  "--device", DEVICE])
    assert r.exit_code == 2 and "dtype 'fp8_e4m3'" in r.output and "scripts/gpu_fp8.py" in r.output, r.output


# -- the module ----------------------------------------------------------------------------------------------
def test_fp8_module_renders_the_e4m3_path_and_bf16_modules_do_not():
    src = fagen.generate(fp8(mask="causal", gqa=2))
    n192 = backends.GLUON.fp8_n192(fp8(mask="causal", gqa=2))  # [Note] fp8 192-key steps: Vt in 64-key boxes
    for word in ("torch.float8_e4m3fn", "gl.float8e4nv", "instr_shape=[16, n, 32]", "k_width=4", "def transpose_v(",
                 "v_smem.index(3 * sp).permute((1, 0))" if n192 else "v_smem.index(sp).permute((1, 0))",
                 "[off_b, off_hkv, 0, start_n + c * 64]" if n192 else "[off_b, off_hkv, 0, start_n]",
                 "q_descale=None", "KDescale + off_hkv * kd_h", "v_scale / l_safe"):
        assert word in src, word
    assert src.count("custom_op") == 1  # its own operator ([Note] fp8 operator; tests/test_gluon_bwd_host.py)
    compile(src, "rendered", "exec")
    bf16 = fagen.generate(KernelSpec(backend="gluon", head_dim=128, mask="causal", gqa=2, dtype="bf16"))
    for word in ("float8", "Descale", "transpose_v", "k_width=4", "permute((1, 0)), o_acc"):
        assert word not in bf16, word


def _inputs(b=1, hq=4, hkv=2, sq=40, sk=37, d=128):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, hq, sq, d, generator=g).to(E4M3)
    k, v = (torch.randn(b, hkv, sk, d, generator=g).to(E4M3) for _ in range(2))
    return q, k, v


def test_fp8_module_checks_inputs_before_the_device():
    """Every input check fires on CPU tensors, each naming its argument; then the device check refuses the CPU."""
    mod = fagen.load(fp8(mask="causal", gqa=2))
    params = inspect.signature(mod.forward).parameters
    assert list(params)[3:8] == ["scale", "q_descale", "k_descale", "v_descale", "out_dtype"]
    q, k, v = _inputs()
    one, per_q, per_kv = (torch.ones(n) for n in (1, 4, 2))
    bad = [
        (dict(q=q.to(torch.bfloat16)), "dtype"),
        (dict(q_descale=torch.ones(1, dtype=torch.float64)), "q_descale: expected a float32"),
        (dict(q_descale=per_kv), r"q_descale: .*\[4\]"),
        (dict(k_descale=per_q), r"k_descale: .*\[2\]"),
        (dict(v_descale=torch.ones(1, 2)), "v_descale"),
        (dict(v_descale=1.0), "v_descale"),
        (dict(out_dtype=torch.float32), "out_dtype"),
        (dict(out_dtype=E4M3), "out_dtype"),
        (dict(out=torch.empty(1, 4, 40, 128, dtype=torch.float16), out_dtype=torch.bfloat16), "out: expected"),
        (dict(lse=torch.empty(1, 4, 40)[..., ::2]), "lse"),
        (dict(scale=0.0), "scale"),
    ]
    for kw, words in bad:
        args = dict(q=q, k=k, v=v)
        args.update(kw)
        with pytest.raises(mod.InputError, match=words):
            mod.forward(args.pop("q"), args.pop("k"), args.pop("v"), **args)
    if not torch.cuda.is_available():
        for kw in (dict(), dict(q_descale=one, k_descale=per_kv, v_descale=per_kv, out_dtype=torch.float16),
                   dict(out=torch.empty(1, 4, 40, 128, dtype=torch.float16))):
            with pytest.raises(mod.InputError, match="CUDA device of compute capability 9.0"):
                mod.forward(q, k, v, **kw)


def test_descale_head_strides():
    """One element: head stride 0 (every head reads it); one per head: its own stride, views included."""
    mod = fagen.load(fp8(gqa=2))
    dev = torch.device("cpu")
    assert mod._check_descale("q_descale", None, 4, dev)[1] == 0
    assert mod._check_descale("q_descale", torch.ones(1), 4, dev)[1] == 0
    assert mod._check_descale("q_descale", torch.ones(4), 4, dev)[1] == 1
    assert mod._check_descale("k_descale", torch.ones(2, 3)[:, 1], 2, dev)[1] == 3


def p_permuted(p):
    """P's columns as the kernel's _p_operand reorders them ([Note] fp8 P permutation), in torch."""
    return p.reshape(p.shape[0], p.shape[1] // 32, 2, 2, 2, 2, 2).permute(0, 1, 2, 4, 5, 3, 6).reshape(p.shape)


@pytest.mark.parametrize("sk", [1, 37, 130])
def test_transpose_v_is_v_with_keys_contiguous_and_tma_strides(sk):
    """Vt [B, Hkv, D, Sk rounded up to 32]: V transposed with its keys in P's order within each 32 ([Note] fp8 P
    permutation), zeros past Sk, unit key stride, every other stride a multiple of 16 bytes (TMA). The kernel's P
    times it is P V: checked with P reordered as _p_operand does. _P_PERM = 0: V transposed, a view of Sk columns."""
    mod = fagen.load(fp8(gqa=2))
    v = torch.randn(2, sk, 3, 128).to(E4M3).to(DEVICE).transpose(1, 2)  # [B, Hkv, Sk, D], heads inside rows
    width = (sk + 31) // 32 * 32
    vt = mod.transpose_v(v)
    assert vt.shape == (2, 3, 128, width) and vt.dtype is E4M3 and vt.stride(-1) == 1
    assert all(s % 16 == 0 for s in vt.stride()[:3]) and mod._tma_ready(vt)
    p = torch.rand(64, width, dtype=torch.float64)
    p[:, sk:] = 0  # keys past Sk: the kernel's P is 0 there
    want = p[:, :sk] @ v.double().cpu()
    close = lambda a: torch.allclose(a, want, rtol=1e-12, atol=1e-12)  # noqa: E731 - the same products, reordered
    assert close(p_permuted(p) @ vt.double().cpu().transpose(-1, -2))
    assert not close(p @ vt.double().cpu().transpose(-1, -2)) or sk == 1  # the order matters
    mod._P_PERM = 0
    try:
        vt = mod.transpose_v(v)
    finally:
        mod._P_PERM = 1
    assert vt.shape == (2, 3, 128, sk) and mod._tma_ready(vt)
    assert torch.equal(vt.view(torch.uint8), v.transpose(2, 3).view(torch.uint8))


# -- the GPU script's checker -------------------------------------------------------------------------------
def _gpu_script():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "scripts" / "gpu_fp8.py"
    spec = importlib.util.spec_from_file_location("gpu_fp8", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mask,gqa,sq,sk", [("none", 1, 100, 100), ("causal", 2, 100, 70)])
def test_the_gpu_checker_passes_e4m3_numerics_and_fails_a_bf16_p(mask, gqa, sq, sk):
    """scripts/gpu_fp8.py's check() with the kernel replaced by its emulation: P rounded to e4m3 passes; P kept in
    bf16 (a kernel that silently computes P V in bf16) fails on the fingerprint, though it is more accurate."""
    gpu_fp8 = _gpu_script()
    rows = {}
    for name, p_dtype in (("e4m3", E4M3), ("bf16", torch.bfloat16)):
        rows[name] = gpu_fp8.check(64, mask, gqa, 1, 1, sq, sk, outliers=True, per_head=gqa > 1, device="cpu",
                                   forward=gpu_fp8.emulated_forward(mask, p_dtype))
    assert rows["e4m3"]["pass"] and rows["e4m3"]["fingerprint"] < 0.2, rows["e4m3"]
    assert not rows["bf16"]["pass"] and rows["bf16"]["fingerprint"] > 2, rows["bf16"]
    # the bf16 P is closer to the reference: RMSE alone cannot tell
    assert rows["bf16"]["rmse"] < rows["e4m3"]["rmse"] / 3
    assert rows["e4m3"]["empty_ok"] and rows["e4m3"]["empty_rows"] == gqa * max(sq - sk, 0)


# -- on an H100/H200 -----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="runs on an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("head_dim,gqa", [(128, 1), (128, 4), (64, 2)])
def test_fp8_matches_the_float64_reference_on_the_dequantized_inputs(mask, head_dim, gqa):
    """RMSE within the README bound, and far closer to the e4m3-P emulation than to a bf16-P one (the kernel does
    not silently compute P V in bf16): scripts/gpu_fp8.py's checks at test sizes."""
    gpu_fp8 = _gpu_script()
    for sq, sk in [(97, 97), (200, 333), (333, 200), (1000, 1000)]:
        row = gpu_fp8.check(head_dim=head_dim, mask=mask, gqa=gqa, batch=2, kv_heads=2, sq=sq, sk=sk, outliers=False,
                            per_head=gqa > 1)
        assert row["pass"], row


# -- the fp8 KV cache's conversion (decode kind) ----------------------------------------------------------------------
KV_TORCH = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _lanes(words, qtype):
    """uint32 words as pairs of 16-bit lanes (low lane first) read as qtype, in float64."""
    halves = torch.stack([words & 0xFFFF, words >> 16], -1).to(torch.int32).to(torch.int16)
    return halves.view(qtype).double().view(-1)


def _from_lanes(values, qtype):
    """float64 pairs (low lane first) rounded to qtype and packed into uint32 words."""
    halves = values.view(-1, 2).to(qtype).view(torch.int16).to(torch.int64) & 0xFFFF
    return halves[:, 0] | halves[:, 1] << 16


def _run_asm(asm, words, qtype):
    """Emulate the conversion's PTX (the few instructions it uses) on uint32 words of 4 packed bytes ($2); returns
    ($0, $1). prmt: result byte i = byte (selector nibble i) of {b, a}; fma.rn.{bf16,f16}x2 per lane in float64,
    rounded once to the lane type."""
    regs = {"$2": words}
    val = lambda x: regs[x] if x in regs else torch.full_like(words, int(x, 0))  # noqa: E731
    for line in asm.splitlines():
        line = line.split("//")[0].strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *src = [x.strip() for x in rest.split(",")]
        if op == "prmt.b32":
            a, b, sel = val(src[0]), val(src[1]), int(src[2], 0)
            both = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
            out = torch.zeros_like(words)
            for i in range(4):
                assert (sel >> 4 * i) & 8 == 0, "sign-replicating prmt modes are not emulated"
                out |= both[(sel >> 4 * i) & 7] << 8 * i
        elif op == "and.b32":
            out = val(src[0]) & val(src[1])
        elif op == "or.b32":
            out = val(src[0]) | val(src[1])
        elif op == "shr.b32":
            out = val(src[0]) >> int(src[1], 0)
        elif op == "mov.b32":
            out = val(src[0])
        elif op in ("fma.rn.bf16x2", "fma.rn.f16x2"):
            lane = torch.bfloat16 if op == "fma.rn.bf16x2" else torch.float16
            a, b, c = (_lanes(val(x), lane) for x in src)
            out = _from_lanes(a * b + c, lane)
        else:
            raise AssertionError(f"the emulator does not know {op!r}: teach it, then trust this test again")
        regs[dst] = out & 0xFFFFFFFF
    return regs["$0"], regs["$1"]


def test_fp8_cache_conversion_is_exact_over_all_256_bytes():
    """e4m3 into bf16, the decode module's one conversion asm ([Note] fp8 conversion), emulated over every byte:
    bitwise torch's .to() for each finite value (subnormals and both zeros included), NaN as +-480."""
    src = fagen.generate(KernelSpec(head_dim=64, kind="decode", dtype="bf16", kv_dtype="fp8_e4m3"))
    asm = src.split('asm="""', 1)[1].split('"""', 1)[0]
    data = torch.arange(256, dtype=torch.int64)
    words = data[0::4] | data[1::4] << 8 | data[2::4] << 16 | data[3::4] << 24  # element i in byte i (pack=4)
    lo, hi = _run_asm(asm, words, torch.bfloat16)
    halves = torch.stack([lo & 0xFFFF, lo >> 16, hi & 0xFFFF, hi >> 16], -1).view(-1)
    got = halves.to(torch.int32).to(torch.int16).view(torch.bfloat16)
    want = data.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.bfloat16)
    finite = torch.isfinite(want)
    assert int(finite.sum()) == 254
    assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16)), \
        [(int(b), float(g), float(w)) for b, g, w in zip(data[finite], got[finite], want[finite]) if g != w][:4]
    assert {int(b): float(g) for b, g in zip(data[~finite], got[~finite])} == {0x7F: 480.0, 0xFF: -480.0}


@pytest.mark.parametrize("q_dtype,kv", [("fp16", "fp8_e4m3"), ("bf16", "fp8_e5m2"), ("fp16", "fp8_e5m2")])
def test_other_fp8_caches_convert_with_tritons_cast(q_dtype, kv):
    """Only e4m3 into bf16 takes the asm ([Note] fp8 conversion: Triton's own casts are as lean elsewhere)."""
    src = fagen.generate(KernelSpec(head_dim=64, kind="decode", dtype=q_dtype, kv_dtype=kv))
    convert = src.split("def _fp8_to(x)", 1)[1].split("\n\n\n", 1)[0]
    assert "inline_asm_elementwise" not in convert
    assert f"return x.to({'tl.bfloat16' if q_dtype == 'bf16' else 'tl.float16'})" in src


def test_decode_steps_never_replay_a_kernel_built_for_the_other_scale_form(monkeypatch):
    """[Note] Decode steps on the CPU: the GPU's fast launches replaced by fakes that record which form (a float,
    KScale None; or a per-head tensor) each launched kernel was built for. A step replayed across forms read per-head
    scales as 1.0 or a scale through a null pointer on the H100 (the fp8 latent cache's wrong values and fault)."""
    spec = KernelSpec(head_dim=32, kind="decode", dtype="fp16", gqa=2, kv_dtype="fp8_e4m3", block_n=16)
    m = fagen.load(spec)
    at = m._decode_split.arg_names.index("KScale")
    launches = []  # (built for a float, called with a float, replayed)

    class Built:
        def __init__(self, fn):
            pass

        def __getitem__(self, grid):
            return self

        def __call__(self, *args, **consts):
            launches.append((args[at] is None, args[at] is None, False))
            return (None, (0, 0), None, None, (), 0, args[at] is None)  # a direct entry ([Note] Fast launches)

    def replay(entry, grid, device, args):
        launches.append((entry[-1], args[at] is None, True))

    monkeypatch.setattr(m, "_fast", Built)
    monkeypatch.setattr(m, "_launch_entry", replay)
    monkeypatch.setattr(m, "_STEPS", {})
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 1, 32, generator=g).half().to(DEVICE)
    k, v = (torch.randn(2, 2, 40, 32, generator=g).to(E4M3).to(DEVICE) for _ in range(2))
    per_head = torch.tensor([0.5, 2.0], device=DEVICE)
    for scales in (dict(k_scale=0.5, v_scale=2.0), dict(k_scale=per_head, v_scale=per_head),
                   dict(k_scale=0.5, v_scale=2.0), dict(k_scale=per_head, v_scale=per_head)):
        m.forward(q, k, v, **scales)
    assert [r for _, _, r in launches] == [False, False, True, True], launches  # each form built once, then replayed
    assert all(built == called for built, called, _ in launches), launches
