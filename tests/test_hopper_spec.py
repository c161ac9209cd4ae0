"""The Hopper (Gluon, sm_90) forward, fagen's backend 'gluon': its spec limits and the module it renders, on any
machine. Gluon kernels cannot run in Triton's interpreter: on the CPU the module is imported and its host checks run;
selection is in test_hopper_selection.py, the sm_90 build in test_hopper_compile.py, the kernel on an H100/H200 in
test_hopper_gpu.py."""

import inspect

import pytest
import torch

import fagen
from fagen import backends
from fagen.backends import gluon as gluon_backend
from fagen.spec import targets
from fagen.spec.kernel import KernelSpec, SpecError


def gluon(**fields) -> KernelSpec:
    return KernelSpec(backend="gluon", **{"head_dim": 128, "dtype": "bf16", **fields})


# -- the spec ------------------------------------------------------------------------------------------------
def test_default_gluon_spec():
    s = gluon(mask="causal", gqa=4)
    assert (s.block_m, s.block_n, s.num_warps, s.num_stages) == (128, 128, 8, 2)
    assert s.name == "attn_fwd_causal_d128_m128n128w8s2_g4_bf16_gluon"
    assert gluon(head_dim=64).num_stages == 3
    assert KernelSpec.from_json(s.to_json()) == s


@pytest.mark.parametrize("fields,field", [
    # (padding masks: the gluon forward's since the twenty-second session; tests/test_gluon_padding.py has their limits)
    (dict(head_dim=96), "head_dim"), (dict(mask="tree"), "mask"),
    (dict(dtype="fp32"), "dtype"), (dict(direction="bwd", head_dim=192, head_dim_v=128), "head_dim"),
    (dict(block_n=32), "block_n"),
    (dict(block_m=64), "block_m"), (dict(num_warps=4), "num_warps"), (dict(num_stages=3), "num_stages"),
    (dict(kind="decode"), "backend"),
])
def test_gluon_limits_are_spec_errors_naming_the_field(fields, field):
    with pytest.raises(SpecError) as e:
        gluon(**fields)
    assert e.value.field == field
    assert "triton" in str(e.value) or field in ("block_m", "block_n", "num_warps", "num_stages", "backend")


@pytest.mark.parametrize("fields", [dict(softcap=True), dict(window=True), dict(window=True, softcap=True),
                                    dict(mask="none", window=True, head_dim=64)])
def test_gluon_forward_takes_window_and_softcap(fields):
    s = gluon(**{"mask": "causal", **fields})
    assert s.switches == tuple(n for n in ("window", "softcap") if fields.get(n))
    assert s.name.endswith("_bf16_gluon") and KernelSpec.from_json(s.to_json()) == s


@pytest.mark.parametrize("fields,field,words", [
    (dict(alibi=True), "alibi", "window and softcap switches only"),
    (dict(sinks=True, window=True), "sinks", "window and softcap switches only"),
])
def test_gluon_refuses_other_switches_naming_the_field(fields, field, words):
    with pytest.raises(SpecError) as e:
        gluon(mask="causal", **fields)
    assert e.value.field == field and words in str(e.value) and "backend 'triton'" in str(e.value)


@pytest.mark.parametrize("fields,field", [(dict(head_dim=192, head_dim_v=128), "head_dim"),
                                          (dict(alibi=True), "alibi"),
                                          (dict(mask="causal", sinks=True), "sinks"),
                                          (dict(dtype="fp8_e4m3"), "direction")])
def test_the_gluon_backward_limits_name_the_field(fields, field):
    """The gluon backward ([Note] Gluon backward rule): head_dim 64 or 128, bf16/fp16, the window and softcap switches
    ([Note] Gluon backward mods); anything else names the field and the way out."""
    with pytest.raises(SpecError) as e:
        gluon(direction="bwd", **fields)
    assert e.value.field == field and ("backend 'triton'" in str(e.value) or "direction 'fwd'" in str(e.value))
    s = gluon(direction="bwd", mask="causal", gqa=4)
    assert s.name == "attn_bwd_causal_d128_m128n128w8s2_g4_bf16_gluon" and KernelSpec.from_json(s.to_json()) == s
    assert gluon(direction="bwd", softcap=True).softcap and gluon(direction="bwd", mask="causal", window=True).window


def test_shared_memory_formula():
    """[Note] Roles: two Q buffers and one O buffer per warpgroup beside the K/V ring (the compiled size is checked
    against it in test_hopper_compile.py); the spec refuses a ring that does not fit sm_90."""
    assert gluon_backend.smem_bytes(128, 128, 128, 2) == 2 * (2 * 3 * 64 + 2 * 2 * 128) * 128 + 1024 == 230400
    assert backends.smem_bytes(gluon(head_dim=64)) == gluon_backend.smem_bytes(64, 128, 128, 3)
    for d, bn, st in ((128, 128, 2), (64, 128, 3), (128, 64, 4), (64, 64, 4)):
        assert backends.smem_bytes(gluon(head_dim=d, block_n=bn, num_stages=st)) <= targets.ARCH_SMEM_LIMIT["sm_90"]
    with pytest.raises(SpecError, match="shared memory"):
        gluon(num_stages=3)


# -- the module contract -------------------------------------------------------------------------------------
def test_render_is_deterministic_and_shares_the_host_code():
    spec = gluon(mask="causal", gqa=4)
    src = fagen.generate(spec)
    assert src == fagen.generate(gluon(mask="causal", gqa=4))
    assert src.startswith("# Generated by fagen") and spec.to_json() in src.splitlines()[1]
    assert "CAUSAL = 1" in src and "GQA = 4" in src
    for name in ("class InputError(ValueError)", "def _launch_forward(", "_launch = _launch_forward",
                 "def forward(q, k, v, *, scale=None, seqlens_q=None, seqlens_k=None, tree_mask=None, out=None",
                 "@torch.library.custom_op(_OP + \"_fwd\"", "def compile_for("):
        assert name in src, name
    compile(src, "rendered", "exec")


def test_module_checks_inputs_like_the_triton_module():
    """Imported on the CPU (no kernel runs): same forward signature; every input check fires before the device
    check, which refuses anything but a CUDA device."""
    mod = fagen.load(gluon(mask="causal", gqa=2))
    tri = fagen.load(KernelSpec(head_dim=128, mask="causal", gqa=2, dtype="bf16"))
    assert inspect.signature(mod.forward) == inspect.signature(tri.forward)
    q = torch.zeros(1, 4, 8, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(mod.InputError, match="dtype"):
        mod.forward(q.float(), k, k)
    with pytest.raises(mod.InputError, match="heads"):
        mod.forward(q, k[:, :1].repeat(1, 3, 1, 1), k[:, :1].repeat(1, 3, 1, 1))
    with pytest.raises(mod.InputError, match="no padding"):
        mod.forward(q, k, k, seqlens_q=torch.ones(1, dtype=torch.int32), seqlens_k=torch.ones(1, dtype=torch.int32))
    with pytest.raises(mod.InputError, match="scale"):
        mod.forward(q, k, k, scale=-1.0)
    if not torch.cuda.is_available():
        with pytest.raises(mod.InputError, match="CUDA device of compute capability 9.0"):
            mod.forward(q, k, k)


def test_switch_modules_render_only_with_their_switches():
    """A spec without switches renders none of their code (its source is unchanged); window and softcap render the
    block skipping, the boundary mask, and tanh.approx with the cap folded into qk_scale."""
    plain = fagen.generate(gluon(mask="causal"))
    for word in ("win_left", "cap_in", "_tanh", "w_lo", "_score_launch", "window=None"):
        assert word not in plain, word
    cap = fagen.generate(gluon(mask="causal", softcap=True))
    assert "tanh.approx.f32" in cap and "cap_out, num_tiles" in cap and "w_lo" not in cap
    win = fagen.generate(gluon(mask="causal", window=True))
    assert "lo, hi, w_lo, w_hi = _key_range(" in win and "def _tanh" not in win
    assert "range(gl.maximum(w_lo, lo + BLOCK_N), w_hi, BLOCK_N)" in win
    assert '"win_left", "win_right"]' in win  # window extents are not specialized: one kernel for every window
    for src in (cap, win):
        compile(src, "rendered", "exec")


@pytest.mark.parametrize("switches", [("softcap", ), ("window", ), ("window", "softcap")])
def test_switch_module_checks_scores_like_the_triton_module(switches):
    """Same forward signature and the same messages for bad score inputs as the Triton module (the shared
    _check_scores); every check fires before the device check."""
    on = {name: True for name in switches}
    mod = fagen.load(gluon(mask="causal", **on))
    tri = fagen.load(KernelSpec(head_dim=128, mask="causal", dtype="bf16", **on))
    assert inspect.signature(mod.forward) == inspect.signature(tri.forward)
    # On the inputs' device: the Triton module checks the device before the scores, so CPU tensors on a GPU
    # machine (no interpreter) would stop it at the device check.
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.zeros(1, 2, 8, 128, dtype=torch.bfloat16, device=dev)
    good = dict(window=(4, 0) if "window" in switches else None, softcap=30.0 if "softcap" in switches else None)
    bad = [dict(alibi_slopes=torch.ones(2, device=dev)), dict(sinks=torch.ones(2, device=dev))]
    if "window" in switches:
        bad += [dict(window=(-1, 0)), dict(window=(4, )), dict(window=(1.5, 0)), dict(window=None)]
    else:
        bad += [dict(window=(4, 0))]  # built without it
    if "softcap" in switches:
        bad += [dict(softcap=0.0), dict(softcap=float("inf")), dict(softcap=True), dict(softcap=None)]
    else:
        bad += [dict(softcap=30.0)]
    seen = 0
    for kw in bad:
        args = {**good, **kw}
        with pytest.raises(tri.InputError) as want:
            tri.forward(q, q, q, **args)
        with pytest.raises(mod.InputError) as got:
            mod.forward(q, q, q, **args)
        assert str(got.value).replace(mod.NAME, "NAME") == str(want.value).replace(tri.NAME, "NAME"), kw
        seen += "device" not in str(got.value)
    assert seen == len(bad)
    if not torch.cuda.is_available():
        with pytest.raises(mod.InputError, match="CUDA device of compute capability 9.0"):
            mod.forward(q, q, q, **good)
