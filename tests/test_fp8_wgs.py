"""The fp8 Gluon forward's consumer warpgroups (GluonBackend.variant fp8_wgs; [Note] fp8 three warpgroups in
fagen/templates/gluon/attention.py.j2): every place that counts them agrees in the render (partitions, Q and O
buffers, the `empty` barriers' arrivals, the rows of a tile on the device and on the host), the bf16 forward never
reads the switch, and the shared-memory formula counts the warpgroups' buffers. Also the O rescale skip's switch
(fp8_o_skip, [Note] fp8 O rescale skip). The sm_90 build of the product's
setting is in test_fp8_compile.py; the kernel against float64 in scripts/gpu_fp8_fwd_s9.py on an H100."""

import contextlib
import re

import pytest

import fagen
from fagen import backends
from fagen.codegen import render
from fagen.spec import targets
from fagen.spec.kernel import KernelSpec


@contextlib.contextmanager
def variant(**changes):
    """GluonBackend.variant changed for the renders inside (the render cache cleared on the way in and out)."""
    saved = dict(backends.GLUON.variant)
    backends.GLUON.variant.update(changes)
    render.render.cache_clear()
    try:
        yield
    finally:
        backends.GLUON.variant.clear()
        backends.GLUON.variant.update(saved)
        render.render.cache_clear()


@contextlib.contextmanager
def full_switch(on):
    """fagen.backends.gluon.FP8_FULL_N192 set for the renders inside ([Note] fp8 full-mask 192-key steps), and the
    256-key steps' table FP8_N256 empty (it takes precedence; [Note] fp8 256-key steps)."""
    from fagen.backends import gluon
    saved, n256 = gluon.FP8_FULL_N192, dict(gluon.FP8_N256)
    gluon.FP8_FULL_N192 = on
    gluon.FP8_N256.clear()
    render.render.cache_clear()
    try:
        yield
    finally:
        gluon.FP8_FULL_N192 = saved
        gluon.FP8_N256.update(n256)
        render.render.cache_clear()


def full_128():
    """The body of an autouse fixture for test modules whose levers are measured on the 128-key full-mask loop: the
    switch off while they render ([Note] fp8 full-mask 192-key steps)."""
    with full_switch(False):
        yield


def counts(src: str) -> dict:
    """What the render says about the number of consumer warpgroups, one entry per place that encodes it."""
    ws = src[src.index("gl.warp_specialize(["):]
    ws = ws[:ws.index("\n\n")]
    one = lambda pattern: {int(x) for x in re.findall(r"^ +" + pattern, src, flags=re.M)}  # noqa: E731 (code only)
    return {
        "partitions": len(re.findall(r"\(_consumer\d, \(", ws)),
        "worker_warps": re.search(r"\[([\d, ]+)\], \[CONSUMER_REGS", ws).group(1).count("4"),
        "q_buffers": one(r"q_smem = gl\.allocate_shared_memory\(dtype, \[(\d+), BLOCK_M, HEAD_DIM\]"),
        "o_buffers": one(r"o_smem = gl\.allocate_shared_memory\(o_desc\.dtype, \[(\d+), BLOCK_M"),
        "q_barriers": one(r"q_ready = gl\.allocate_shared_memory\(gl\.int64, \[(\d+), 1\]"),
        "empty_arrivals": one(r"mbarrier\.init\([kv]_empty\.index\(i\), count=(\d+)\)"),
        "q_loads": one(r"for w in gl\.static_range\((\d+)\):"),
        "q_index": one(r"qi = \(t % 2\) \* (\d+) \+ (?:w|WG)"),
        "tile_rows": one(r"return off_b, off_h, m_blk \* \((\d+) \* BLOCK_M\)"),
        "key_range_rows": one(r"hi = gl\.maximum\(gl\.minimum\(seq_k, m0 \+ (\d+) \* BLOCK_M \+ shift"),
        "host_rows": one(r"n_m = _cdiv\(sq, (\d+) \* BLOCK_M\)"),
    }


@pytest.mark.parametrize("wgs", [2, 3])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_every_count_of_consumer_warpgroups_agrees(wgs, mask):
    spec = KernelSpec(backend="gluon", head_dim=128, dtype="fp8_e4m3", mask=mask, block_n=64)
    with variant(fp8_wgs=wgs):
        src = fagen.generate(spec)
    c = counts(src)
    assert c == {"partitions": wgs, "worker_warps": wgs - 1, "q_buffers": {2 * wgs}, "o_buffers": {wgs},
                 "q_barriers": {2 * wgs}, "empty_arrivals": {wgs}, "q_loads": {wgs}, "q_index": {wgs},
                 "tile_rows": {wgs}, "key_range_rows": {wgs}, "host_rows": {wgs}}, c
    compile(src, "rendered", "exec")
    regs = backends.GLUON.variant["fp8_wg3_regs"] if wgs == 3 else None
    if regs:  # 12 consumer warps at regs[0] and the producer's warpgroup at regs[1] within the register file
        assert f"CONSUMER_REGS = {regs[0]}\nLOADER_REGS = {regs[1]}\n" in src
        assert 3 * 128 * regs[0] + 128 * regs[1] <= 65536, regs


def test_bf16_forward_never_reads_the_switch():
    spec = KernelSpec(backend="gluon", head_dim=128, dtype="bf16", mask="causal")
    before = fagen.generate(spec)
    with variant(fp8_wgs=3):
        assert fagen.generate(spec) == before
    assert counts(before)["partitions"] == 2


def test_shared_memory_counts_each_warpgroups_q_and_o_buffers():
    spec = KernelSpec(backend="gluon", head_dim=128, dtype="fp8_e4m3", block_n=64, num_stages=4)
    with variant(fp8_wgs=3):
        three = backends.smem_bytes(spec)
    with variant(fp8_wgs=2):
        two = backends.smem_bytes(spec)
    # a warpgroup more: two Q buffers of 64 x 128 e4m3 and an O buffer of 64 x 128 bf16
    assert three - two == 2 * 64 * 128 + 64 * 128 * 2 and three == 164864
    with variant(fp8_wgs=3):  # block_n 128 with 4 slots still fits sm_90 (compiled: 229,992 bytes)
        assert backends.smem_bytes(KernelSpec(backend="gluon", head_dim=128, dtype="fp8_e4m3", block_n=128,
                                              num_stages=4)) <= targets.ARCH_SMEM_LIMIT["sm_90"]


@pytest.mark.parametrize("skip", [0, 1])
def test_o_rescale_is_skipped_only_under_the_switch_and_only_in_fp8(skip):
    """[Note] fp8 O rescale skip: with fp8_o_skip 1 the loop step rescales O only when some alpha of the warpgroup
    is below 1 (bit for bit the same O: alpha is exactly 1 where no row's max moved); the epilogue and bf16 keep
    theirs."""
    rescale = "o_acc = o_acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]"
    with variant(fp8_o_skip=skip):
        src = fagen.generate(KernelSpec(backend="gluon", head_dim=128, dtype="fp8_e4m3", mask="causal"))
        bf16 = fagen.generate(KernelSpec(backend="gluon", head_dim=128, dtype="bf16", mask="causal"))
    step = src[src.index("def _consumer_step("):src.index("def _consumer(")]
    guarded = f"    if gl.min(alpha, 0) < 1.0:  # [Note] fp8 O rescale skip: some row's max moved\n        {rescale}\n"
    assert (guarded in step) == bool(skip) and step.count(rescale) == 1, step[-600:]
    assert f"\n    {rescale}\n" in bf16 and "gl.min(alpha" not in bf16
    compile(src, "rendered", "exec")
