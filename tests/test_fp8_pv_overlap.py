"""The Gluon forward's tenth-session switches (fagen/templates/gluon/attention.py.j2, fagen/backends/gluon.py): the
softmax under the P V (GluonBackend.variant fp8_pv_overlap, and pv_overlap for bf16/fp16: [Note] fp8 softmax under
the P V; measured slower, off) and the d64 override (fp8_d64, read through variant_for: three warpgroups). The
kernel against float64 runs in scripts/gpu_fp8fwd_s10.py on an H100; here the render's order and what reads what."""

import re

import fagen
from fagen import backends
from fagen.backends.gluon import smem_bytes
from fagen.spec.kernel import KernelSpec
from test_fp8_wgs import variant


def render(mask="causal", dtype="fp8_e4m3", head_dim=128, **fields):
    return fagen.generate(KernelSpec(backend="gluon", head_dim=head_dim, mask=mask, dtype=dtype, **fields))


def body(src, name):
    start = src.index(f"def {name}(")
    return src[start:src.index("\n\n\n", start)]


def test_d64_override_reaches_the_render_the_host_and_the_shared_memory():
    g = backends.GLUON
    d64, d128 = (KernelSpec(backend="gluon", head_dim=d, mask="causal", dtype="fp8_e4m3") for d in (64, 128))
    with variant(fp8_d64={}):
        assert g.variant_for(d64)["fp8_wgs"] == g.variant["fp8_wgs"]  # no override: the variant as it is
        assert g.smem_bytes(d64) == smem_bytes(64, d64.block_m, d64.block_n, d64.num_stages, 1, 64, 2)
    assert g.variant["fp8_d64"] == {"fp8_wgs": 3}  # the product (round A: +11% / +16% at d64 s16k)
    with variant(fp8_d64={"fp8_wgs": 3}):
        assert g.variant_for(d64)["fp8_wgs"] == 3 and g.variant_for(d128)["fp8_wgs"] == g.variant["fp8_wgs"]
        src64, src128 = render(head_dim=64), render(head_dim=128)
        assert "def _consumer2(" in src64 and "def _consumer2(" not in src128
        assert re.search(r"n_m = _cdiv\(sq, 3 \* BLOCK_M\)", src64)
        bf16 = KernelSpec(backend="gluon", head_dim=64, mask="causal", dtype="bf16")
        assert g.variant_for(bf16)["fp8_wgs"] == g.variant["fp8_wgs"]  # the override is the fp8 forward's
        want = smem_bytes(64, d64.block_m, d64.block_n, d64.num_stages, 1, 64, 3)
        assert g.smem_bytes(d64) == want


def test_pv_overlap_puts_the_softmax_in_a_block_of_its_own_before_the_p_v_wait():
    """[Note] fp8 softmax under the P V: the step's softmax inside `if qk_scale == qk_scale:` (a branch neither LLVM
    nor ptxas folds), the P V's wait after it; the else arm's values are NaN exactly when the scale is."""
    with variant(fp8_pv_overlap=1):
        for mask in ("causal", "none"):
            step = body(render(mask), "_consumer_step")
            guard = step.index("    if qk_scale == qk_scale:")
            call = step.index("        p, alpha, m_i, l_i = _softmax(")
            assert step.index("s_acc = warpgroup_mma_wait(1") < guard < call < step.index("o_acc = warpgroup_mma_wait(0")
            arm = step[step.index("    else:\n", call):step.index("o_acc = warpgroup_mma_wait(0")]
            assert all(f"{v} = " in arm and "* qk_scale" in arm for v in ("p", "alpha", "m_i", "l_i"))
            assert "fp8 softmax under the P V" in render(mask)
        late_bf16 = render("causal", "bf16")
    assert late_bf16 == render("causal", "bf16") and "qk_scale == qk_scale" not in render("causal")


def test_pv_overlap_for_bf16_is_its_own_switch():
    """pv_overlap puts the bf16/fp16 step's softmax in the same block (a measurement variant) and leaves fp8 alone;
    fp8_pv_overlap leaves bf16 alone."""
    with variant(pv_overlap=1):
        bf16, fp8 = render("causal", "bf16"), render("causal")
    step = body(bf16, "_consumer_step")
    assert step.index("    if qk_scale == qk_scale:") < step.index("o_acc, p_prev = warpgroup_mma_wait(0")
    assert "qk_scale == qk_scale" not in fp8
    with variant(fp8_pv_overlap=1):
        assert "qk_scale == qk_scale" not in render("causal", "bf16")
