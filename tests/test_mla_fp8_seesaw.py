"""The seesaw MLA decode over an e4m3 latent cache (twenty-third session; [Note] Seesaw fp8 conversion in
fagen/templates/gluon/mla_seesaw.j2, variant fp8lat_seesaw of the gluon backend, on since the twenty-third
session): the bf16 seesaw's render kept byte for byte (the seesaw's device code moved into the include), the fp8 render without the variant unchanged
and with it the seesaw kernel, its host dispatch and split rule, the use-time rule (hopper.latent_decode_spec, the
serving bench's row) and the sm_90 builds (ptxas: shared memory, spills, the warpgroups' 44 wgmma a pair, the
register split). On an H100/H200, scripts/gpu_mlafp8c_s23.py checks the kernel against float64. Twenty-fourth session
(docs/serving.md "MLA fp8 seesaw: the conversion's place"): SEESAW_CVT 2, f16 operands ([Note] Seesaw f16
operands), the default since its H200 rounds B and C, and SEESAW_CVT 0, the bf16 conversion it replaced: their
protocol in both converter orders, their sm_90 builds, the default pinned; the switches that lost on the H200 (the
bit conversion, the split halves, orders 2 and 3, the fp8 loader, the diagnostic without conversion) left the
template, and a build asking for one fails. On the H200 scripts/gpu_seesaw8_s24.py (the rounds' record)."""

import hashlib

import pytest
import torch

import fagen
from fagen import backends
from fagen.runtime import hopper
from fagen.spec.kernel import KernelSpec

from _env import ON_GPU
from test_hopper_compile import build_sm90

D, DV = 576, 512


def spec(backend="gluon", **kw):
    fields = dict(head_dim=D, head_dim_v=DV, shared_kv=True, kind="decode", gqa=128, dtype="bf16", mask="causal",
                  layout="paged", backend=backend, kv_dtype="fp8_e4m3")
    return KernelSpec(**{**fields, **kw})


@pytest.fixture
def seesaw(monkeypatch):
    monkeypatch.setattr(backends.GLUON, "variant", {**backends.GLUON.variant, "fp8lat_seesaw": 1})


# sha256 of the bf16 seesaw module's render before the seesaw's device code moved into gluon/mla_seesaw.j2 (main at
# b2a3fb7f): the include renders the same bytes
BF16_RENDERS = {
    ("paged", "causal", 128): "781ba51004cfc1909d1bc0bb7ba5ea6bce51d7c7fea3edbbc398fbb92e115f94",
    ("dense", "none", 16): "0640e2d4871300df1fb025e9600cfcbb99b9c92d17df595f3f8bda5f8a32139d",
    ("dense", "causal", 128): "2176153f0f8d9ad45bc879c0eebe4d6298f60583cf43cef399f06d9d01926861",
}
FP8_RENDER = ("paged", "causal", 128, "49ae0a35e5d9e141aff62803aaa6bc8054b9de333fe969362c7b65f476c0d749")


@pytest.mark.parametrize("key", list(BF16_RENDERS))
def test_the_bf16_seesaw_renders_byte_for_byte_as_before(key):
    from fagen.codegen.render import render

    layout, mask, gqa = key
    src = render(spec(kv_dtype=None, layout=layout, mask=mask, gqa=gqa)).source
    assert hashlib.sha256(src.encode()).hexdigest() == BF16_RENDERS[key]
    assert "_converter" not in src and "_mla_decode_ss8" not in src and "fp8lat_seesaw" not in src


def test_the_fp8_render_is_unchanged_without_the_variant_and_has_the_seesaw_with_it(seesaw, monkeypatch):
    from fagen.codegen.render import render

    layout, mask, gqa, digest = FP8_RENDER
    with_it = render(spec(layout=layout, mask=mask, gqa=gqa)).source
    monkeypatch.setattr(backends.GLUON, "variant", {**backends.GLUON.variant, "fp8lat_seesaw": 0})
    without = render(spec(layout=layout, mask=mask, gqa=gqa)).source
    assert hashlib.sha256(without.encode()).hexdigest() == digest
    assert "_mla_decode_ss8" not in without and "SEESAW_ROWS" not in without
    for part in ("def _mla_decode_ss8(", "def _converter(", "def _cvt_half(", "_fast_mla_decode_ss8 = _gluon(",
                 "seesaw = rows % SEESAW_ROWS == 0", "torch.float8_e4m3fn: gl.float8e4nv", "def _mla_decode_fp8("):
        assert part in with_it, part
    # the warpgroups wait on the conversions (conv), not on the TMA (ready): the converter alone waits on ready;
    # Q on q_wg (q_ready, or with SEESAW_CVT 2 the converter's signal once Q is f16)
    kernel = with_it[with_it.index("def _mla_decode_ss8("):]
    assert kernel.count("(_wg0, (qcl, qcr, qr, kcl, kcr, kr, p0_s, small, q_wg, conv, empty, sync,") == 1
    assert kernel.count("(_wg1, (qcl, qcr, qr, kcl, kcr, kr, p0_s, small, q_wg, conv, empty, sync,") == 1
    assert kernel.count("], [4, 4], [WG_REGS, CVT_REGS])") == 1


def test_f16_operands_are_the_default_and_the_losing_switches_are_gone(seesaw):
    """SEESAW_CVT 2 ([Note] Seesaw f16 operands) is the product's conversion (H200 rounds B and C: 1.094x, 1.092x the
    bf16 conversion); 0 (the bf16 conversion) stays a switch; the bit conversion (1), the diagnostic that converts
    nothing (9: wrong answers), the split halves, orders 2/3 and the fp8 loader are no longer in the render."""
    from fagen.codegen.render import render

    src = render(spec()).source
    assert "\nSEESAW_CVT = 2  #" in src and "\nSEESAW_ORDER = 1  #" in src
    assert fagen.load(spec(layout="dense")).SEESAW_CVT == 2
    for name in ("SEESAW_SPLIT", "SEESAW_LOADER", "CVT_REGS_L", "_loader8", "_converter8", "_scores_first8",
                 "0x7B807B80", "def _bf16(", "CVT == 9", "CVT == 1", "ORDER == 2", "ORDER == 3", "SPLIT:", "mid"):
        assert name not in src, name
    assert "gl.static_assert(CVT == 0 or CVT == 2)" in src and "gl.static_assert(ORDER == 0 or ORDER == 1)" in src
    # the f16 form: f16 buffers, Q converted by the converter, its power-of-two scale read by the warpgroups
    for part in ("dtype: gl.constexpr = gl.float16 if CVT == 2 else q256.dtype", "def _cvt_q(",
                 "_cvt_q(qcl, qcr, qr, qd, small)", "mbarrier.arrive(q_conv.index(0))",
                 "qk_scale = qk_scale * gl.max(small.slice(4 * 64, 64)", "return x.to(gl.float16)",
                 "return x.to(gl.float32).to(gl.bfloat16)"):
        assert part in src, part


def test_the_seesaw_splits_follow_the_bf16_rule(seesaw):
    """Whole pairs of blocks a split, at most one wave of 64-row programs; batch_invariant: SEESAW_CHUNK keys a
    split whatever the batch; forced splits cover the blocks."""
    mod = fagen.load(spec(layout="dense"))
    assert mod.seesaw_splits(32, 256, 8192, sms=132) == (128, 1)  # the suite's row: 128 programs, one split
    assert mod.seesaw_splits(2, 64, 4096, sms=132) == (2, 32)
    for b, rows, span, n in ((3, 256, 1201, None), (1, 128, 777, 3), (8, 64, 100, 5)):
        per, splits = mod.seesaw_splits(b, rows, span, n, sms=132)
        blocks = -(-span // 64)
        assert per % 2 == 0 and (splits - 1) * per < blocks <= splits * per
    inv = {mod.seesaw_splits(b, 256, 8192, invariant=True, sms=132) for b in (1, 7, 32)}
    assert inv == {(mod.SEESAW_CHUNK // 64, 2)}


def test_the_rule_sends_multiples_of_64_rows_to_the_seesaw_only_with_the_variant(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(hopper, "is_hopper", lambda device: True)
    monkeypatch.setattr(hopper, "gluon_missing", lambda: None)
    triton_spec = spec("triton")
    assert backends.GLUON.variant["fp8lat_seesaw"] == 1  # on since its H200 run (twenty-third session)
    monkeypatch.setattr(backends.GLUON, "variant", {**backends.GLUON.variant, "fp8lat_seesaw": 0})
    assert hopper.latent_decode_spec(triton_spec, cuda, 256) is None
    assert hopper.latent_decode_spec(triton_spec, cuda, 16) == spec()
    monkeypatch.setattr(backends.GLUON, "variant", {**backends.GLUON.variant, "fp8lat_seesaw": 1})
    for rows in (64, 128, 256, 1024):
        assert hopper.latent_decode_spec(triton_spec, cuda, rows) == spec(), rows
    for rows in (32, 48, 80, 96, 200):
        assert hopper.latent_decode_spec(triton_spec, cuda, rows) is None, rows
    assert hopper.latent_decode_spec(triton_spec, cuda, 16) == spec()
    assert hopper.latent_decode_spec(spec("triton", kv_dtype="fp8_e5m2"), cuda, 256) is None
    monkeypatch.setenv(hopper.ENV, "0")
    assert hopper.latent_decode_spec(triton_spec, cuda, 256) is None


def test_the_bench_row_takes_the_seesaw_with_the_variant(monkeypatch):
    from fagen.bench.serving import serving_rows

    monkeypatch.setattr(hopper, "is_hopper", lambda device: True)
    monkeypatch.setattr(hopper, "gluon_missing", lambda: None)
    row = {c.name: c for c in serving_rows()}["decode-mla-absorbed-h128-sq2-kv8k-b32-fp8"]
    monkeypatch.setattr(backends.GLUON, "variant", {**backends.GLUON.variant, "fp8lat_seesaw": 0})
    assert row.spec("cuda")[0].backend.value == "triton"
    monkeypatch.setattr(backends.GLUON, "variant", {**backends.GLUON.variant, "fp8lat_seesaw": 1})
    got = row.spec("cuda")[0]
    assert got.backend.value == "gluon" and got.kv_dtype is not None and got.layout.value == "dense"


_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import fagen
from fagen import backends
from sm90 import loops, ptxas

backends.GLUON.variant = {**backends.GLUON.variant, "fp8lat_seesaw": 1}
out = {}
for key, (layout, mask, gqa, kw) in json.loads(sys.argv[2]).items():
    mod = fagen.load(fagen.KernelSpec(head_dim=576, head_dim_v=512, shared_kv=True, kind="decode", gqa=gqa,
                                      dtype="bf16", mask=mask, layout=layout, backend="gluon", kv_dtype="fp8_e4m3"))
    attrs = kw.pop("attrs", {})  # the module's switches (twenty-fourth session), for this build only
    keep = {name: getattr(mod, name) for name in attrs}
    for name, value in attrs.items():
        setattr(mod, name, value)
    try:
        ck = mod.compile_for(seesaw=True, **kw)
    except Exception as e:  # a switch the kernel refuses (its static_assert)
        out[key] = dict(error=f"{type(e).__name__}: {e}"[-2000:])
        continue
    finally:
        for name, value in keep.items():
            setattr(mod, name, value)
    ptx = ck.asm["ptx"]
    res, log, _ = ptxas(ptx)
    res = next(iter(res.values()))
    out[key] = dict(shared=ck.metadata.shared, spills=res.spill_stores + res.spill_loads, stack=res.stack,
                    serialized="C7514" in log or "C7515" in log, tma=ptx.count("cp.async.bulk.tensor"),
                    setmaxnreg=sorted({int(x) for x in
                                       re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
                    wgmma=[s.count("wgmma.mma_async") for s in loops(ptx, 30, innermost=True)])
print("RESULT " + json.dumps(out))
"""
BUILDS = {  # the product's default, SEESAW_CVT 2 ([Note] Seesaw f16 operands)
    "f16_dense_sq2_head": ("dense", "causal", 128, dict(seq_q=2, scales=1)),
    "f16_paged_sq2_token_split": ("paged", "causal", 128, dict(seq_q=2, scales=2, num_splits=3)),
    "f16_paged_none_h64_sq1_tensor_split": ("paged", "none", 64, dict(seq_q=1, scales=0, num_splits=3)),
    "f16_dense_sq2_head_order0": ("dense", "causal", 128, dict(seq_q=2, scales=1, attrs=dict(SEESAW_ORDER=0))),
    # SEESAW_CVT 0, the bf16 conversion (main's before the flip)
    "cvt0_dense_sq2_head": ("dense", "causal", 128, dict(seq_q=2, scales=1, attrs=dict(SEESAW_CVT=0))),
    "cvt0_paged_sq2_token_split": ("paged", "causal", 128, dict(seq_q=2, scales=2, num_splits=3, attrs=dict(
        SEESAW_CVT=0))),
    # the removed switches' values: refused by the kernel (the diagnostic's 9 gave wrong answers)
    "refused_cvt9": ("dense", "causal", 128, dict(seq_q=2, scales=1, attrs=dict(SEESAW_CVT=9))),
    "refused_cvt1": ("dense", "causal", 128, dict(seq_q=2, scales=1, attrs=dict(SEESAW_CVT=1))),
    "refused_order3": ("dense", "causal", 128, dict(seq_q=2, scales=1, attrs=dict(SEESAW_ORDER=3)))}
BUILT = [k for k in BUILDS if not k.startswith("refused")]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, BUILDS, "gluon-mla-fp8-seesaw")


@pytest.mark.skipif(ON_GPU, reason="builds for a faked sm_90 on the CPU (the GPU script runs the kernel)")
@pytest.mark.parametrize("key", BUILT)
def test_the_fp8_seesaw_builds_within_shared_memory(built, key):
    """The bf16 seesaw's shared memory and 6 more barriers (the fp8 bytes land in their 16-bit buffers; f16: one
    barrier more, Q's conversion), under 227 KB; spills as ptxas gives them (CVT 0: none with one scale; f16: 52 B,
    one 4-byte value reloaded; per token at most 96 B, warpgroup 0 at 224 registers); each warpgroup's pair loop 44
    wgmma as the bf16 seesaw's; warpgroup 1 at 232 registers, the converter at 48; the TMA of Q's 3 boxes and the
    parts' 10 (two [64, 128] fp8 boxes a latent half, one [64, 64] a rope)."""
    r = built[key]
    assert "error" not in r, r
    assert r["shared"] <= 2 * (64 * 576 + 2 * 64 * 576 + 64 * 64) + 8 * 64 * 4 + 1024 <= 232448, r
    assert r["spills"] <= (96 if "token" in key else 56 if "f16" in key else 0), r
    assert not r["serialized"], r
    assert r["wgmma"] == [44, 44], r
    assert {232, 48} <= set(r["setmaxnreg"]), r
    assert r["tma"] == 3 + 10, r


@pytest.mark.skipif(ON_GPU, reason="builds for a faked sm_90 on the CPU (the GPU script runs the kernel)")
@pytest.mark.parametrize("key", [k for k in BUILDS if k not in BUILT])
def test_the_removed_switches_do_not_build(built, key):
    """SEESAW_CVT 1 (the bit trick) and 9 (the diagnostic: no conversion, wrong answers), SEESAW_ORDER 3: the
    kernel's static_assert refuses them (a stale setting cannot build the wrong kernel)."""
    err = built[key].get("error", "")
    assert "CompileTimeAssertionFailure" in err, built[key]
    assert ("ORDER == 0 or ORDER == 1" if "order" in key else "CVT == 0 or CVT == 2") in err, err


def _converter_ops(src: str, n_blocks: int, order: int, fn: str = "_converter") -> list:
    """The converter's operations as the rendered `_converter` calls them, for one split of n_blocks blocks:
    ("tma", part, fill) and ("conv", part, fill), part = slot * 3 + t (t: 0 left, 1 right, 2 rope)."""
    import re
    body = src[src.index(f"def {fn}("):]
    body = body[:body.index("\n@gluon.jit")]
    lines = body[body.index("    for u in range("):].splitlines()
    n_pairs = (n_blocks + 1) // 2

    def ops_of(line, env):
        if "_issue8(" in line:
            return [("tma", int(re.search(r"ready\.index\((\d)\)", line).group(1)), env["u"])]
        if "_convert(" in line:
            m = re.search(r"conv, (\d), (\d), (u - 1|u|n_pairs - 1),", line)
            return [("conv", int(m.group(2)) * 3 + int(m.group(1)), eval(m.group(3), {}, env))]
        return []

    def run(block, env):
        out, stack = [], []  # (indent, condition value) of the enclosing ifs
        for line in block:
            if not line.strip() or line.strip().startswith("#"):
                continue
            indent = len(line) - len(line.lstrip())
            while stack and indent <= stack[-1][0]:
                stack.pop()
            if line.strip().startswith("if "):
                cond = line.strip()[3:].split(":")[0]
                stack.append((indent, eval(cond, {}, env)))
                continue
            if all(v for _, v in stack):
                out += ops_of(line, env)
        return out

    joined, buf = [], ""
    for line in lines[1:]:  # calls continued on the next line joined into one
        buf = buf + " " + line.strip() if buf else line
        if buf.count("(") == buf.count(")"):
            joined.append(buf)
            buf = ""
    end = next((k for k, x in enumerate(joined) if x.strip() and len(x) - len(x.lstrip()) <= 4), len(joined))
    loop, tail = joined[:end], joined[end:]  # the loop's body, then what follows it in the function
    ops = []
    for u in range(n_pairs):
        ops += run(loop, dict(u=u, has_b=2 * u + 1 < n_blocks, ORDER=order, n_blocks=n_blocks, n_pairs=n_pairs,
                              SCALES=0))
    ops += run(tail, dict(u=n_pairs, has_b=False, ORDER=order, n_blocks=n_blocks, n_pairs=n_pairs, SCALES=0))
    return ops


def _warpgroup_ops(w: int, n_blocks: int) -> list:
    """Warpgroup w's waits and arrivals in the seesaw ([Note] Seesaw pair, [Note] Seesaw order, [Note] Seesaw
    slots: gluon/mla_seesaw.j2's _wg, which the bf16 seesaw runs on the GPU): ("wait", barrier, completions needed)
    and ("arrive", barrier); the fp8 form waits on `conv` where the bf16 one waits on `ready`, and on `q` (q_wg:
    the TMA's q_ready, or with f16 operands the converter's signal once Q is converted)."""
    ops = [("wait", "q", 1), ("arrive", "sync4")]

    def scores(use, rest):
        own = [("wait", f"conv{w * 3 + 2}", use + 1), ("wait", f"conv{0 if w == 0 else 4}", use + 1)]
        return [("wait", f"conv{1 if w == 0 else 3}", use + 1)] if rest else own

    if w < n_blocks:
        ops += scores(0, False) + scores(0, True)
        ops += [("arrive", f"empty{w * 3 + 2}"), ("arrive", f"empty{w * 3 + 1 - w}")]
    for i in range((n_blocks + 1) // 2):
        if w == 1:
            ops += [("wait", "sync0", i + 1), ("arrive", "sync1")] + ([("wait", "sync4", 1)] if i == 0 else [])
            ops += [("arrive", "sync3"), ("wait", "sync2", i + 1), ("arrive", "empty4")]
        else:
            ops += [("arrive", "sync0"), ("arrive", "empty0"), ("wait", "sync1", i + 1), ("arrive", "sync2"),
                    ("wait", "sync3", i + 1)]
        if 2 * i + w + 2 < n_blocks:
            ops += scores(i + 1, False) + [("arrive", f"empty{3 - 2 * w}")] + scores(i + 1, True)
            ops += [("arrive", f"empty{w * 3 + 2}"), ("arrive", f"empty{w * 3 + 1 - w}")]
        else:
            ops += [("arrive", f"empty{3 - 2 * w}")]
    return ops


def _runs_to_the_end(src: str, n_blocks: int, order: int, f16: bool = False) -> bool:
    """The partitions' barrier protocol run until none can move: True when all finish (a TMA completes when
    issued; `conv` when its part is converted, once its TMA has landed). f16 ([Note] Seesaw f16 operands): the
    converter waits for Q's TMA and signals the warpgroups' `q` once Q is converted, before any part."""
    counts = {f"empty{s * 3 + t}": 2 if t == 1 - s else 1 for s in range(2) for t in range(3)}
    counts["sync4"] = 2
    done, arrivals = ({"q_ready": 1} if f16 else {"q": 1}), {}
    conv = [("wait", "q_ready", 1), ("arrive", "q")] if f16 else []
    for kind, part, fill in _converter_ops(src, n_blocks, order):
        if kind == "tma":  # the part's fill-th TMA waits for the previous fill's readers
            conv.append(("wait", f"empty{part}", fill))
            conv.append(("arrive", f"ready{part}"))
        else:
            conv += [("wait", f"ready{part}", fill + 1), ("arrive", f"conv{part}")]
    progs = [conv, _warpgroup_ops(0, n_blocks), _warpgroup_ops(1, n_blocks)]
    pcs = [0] * len(progs)
    moved = True
    while moved:
        moved = False
        for k, prog in enumerate(progs):
            while pcs[k] < len(prog):
                op = prog[pcs[k]]
                if op[0] == "wait" and done.get(op[1], 0) < op[2]:
                    break
                if op[0] == "arrive":
                    arrivals[op[1]] = arrivals.get(op[1], 0) + 1
                    if arrivals[op[1]] == counts.get(op[1], 1):
                        arrivals[op[1]] = 0
                        done[op[1]] = done.get(op[1], 0) + 1
                pcs[k] += 1
                moved = True
    return all(pc == len(p) for pc, p in zip(pcs, progs))


def test_the_converter_order_runs_the_protocol_to_the_end(seesaw):
    """[Note] Converter deadlock: the converter's calls as rendered, with the warpgroups' waits and arrivals, finish
    for 0..9 blocks a split in both orders (0, 1), with the bf16 conversion's Q (the TMA's) and the f16 operands' (the
    converter's signal once Q is converted, [Note] Seesaw f16 operands); the order first written (B_R converted after
    A_R's TMA) stops once a split has a second pair with a block b (4 blocks and more), which is what the twenty-third
    session's rounds A and B saw on the H200: the splits of 1 and 2 blocks passed, every split of 4 or more hung."""
    from fagen.codegen.render import render

    src = render(spec()).source
    q_conv = src[src.index("def _converter("):]
    assert q_conv.index("mbarrier.arrive(q_conv.index(0))") < q_conv.index("    for u in range(")  # Q before parts
    for order in (0, 1):
        for f16 in (False, True):
            assert [n for n in range(10) if not _runs_to_the_end(src, n, order, f16)] == [], (order, f16)
    cvt = "            _convert(kcl8, kcr8, kr8, kcl, kcr, kr, small, ready, conv, 1, 1, u, vb, KScale, row_b, " \
          "SCALES, CVT)\n"
    fixed = "        if has_b:  # before A_R's TMA: [Note] Converter deadlock\n" + cvt
    tma_ar = "        _issue8(k8l, kcr8.index(2), kcr8.index(3), ready.index(1), empty.index(1), u, row_a, 256, True)\n"
    assert src.count(fixed) == 1 and src.count(tma_ar) == 1
    old = src.replace(fixed, "").replace(tma_ar, tma_ar + "        if has_b:\n" + cvt)
    for f16 in (False, True):
        assert [n for n in range(10) if not _runs_to_the_end(old, n, 0, f16)] == [4, 5, 6, 7, 8, 9]
