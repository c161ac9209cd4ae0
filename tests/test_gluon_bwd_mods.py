"""The Gluon backward (fagen/templates/gluon/backward.py.j2) with the window and softcap switches and a score_mod
([Note] Gluon backward mods in fagen/backends/gluon.py; docs/mods.md, "The Gluon backward"): the spec rules, the
rendered code (the mod printed from the parsed tree, its derivative in dS, the captured values threaded as typed
kernel arguments, never the user's text), and sm_90 builds without a GPU. Gluon kernels cannot run under the
interpreter: `scripts/gpu_mods_bwd_s6.py --gluon` checks each feature against float64 on an H100."""

import re

import pytest

from fagen import backends
from fagen.codegen.mod_args import ModCode
from fagen.codegen.render import render
from fagen.spec.axes import SpecError
from fagen.spec.kernel import KernelSpec

from _env import ON_GPU
from test_hopper_compile import build_sm90

RELBIAS = dict(score_mod="score + bias[h, q_idx - kv_idx + 4095]", mod_tensors=[["bias", "fp32", 2]])
ALIBI = dict(score_mod="score + kv_idx * s", mod_scalars=[["s", "float"]])  # the API's alibi-rowfree form
SWISH = dict(score_mod="where(score > 0.0, score, score * sigmoid(score))")  # its derivative enters dS
NAMES = ("off_b", "h0 + g", "qrows[None, :]", "keys[:, None]")  # the compute step's b, h, q_idx, kv_idx


def bwd(**fields) -> KernelSpec:
    return KernelSpec(backend="gluon", direction="bwd", **{"head_dim": 128, "dtype": "bf16", "mask": "causal",
                                                            **fields})


def backward_part(spec) -> str:
    """The rendered backward (the module's forward precedes it)."""
    return render(spec).source.split("# Backward: three kernels.", 1)[1]


def test_the_gluon_backward_takes_the_window_softcap_and_a_score_mod_and_refuses_the_rest_in_one_line(monkeypatch):
    for fields in (dict(window=True), dict(mask="none", window=True), dict(softcap=True), RELBIAS, ALIBI, SWISH,
                   dict(window=True, softcap=True, **ALIBI)):
        assert bwd(**fields).direction == "bwd"
    refusals = {"alibi": dict(alibi=True), "sinks": dict(sinks=True), "mask_mod": dict(mask_mod="q_idx >= kv_idx")}
    for field, fields in refusals.items():
        with pytest.raises(SpecError) as e:
            bwd(**fields)
        assert "\n" not in str(e.value) and str(e.value).startswith(field + ":"), e.value
    # the wave order counts a causal or full frontier only ([Note] Wave order)
    monkeypatch.setitem(backends.GLUON.variant, "bwd_order", 1)
    with pytest.raises(SpecError, match="^window: .*bwd_order 0"):
        bwd(window=True)
    assert bwd(softcap=True).softcap


def test_the_render_holds_the_tree_s_gluon_code_and_not_the_user_s_text():
    spec = bwd(score_mod="score+bias[h,q_idx-kv_idx+4095]", mod_tensors=[["bias", "fp32", 2]])  # user spelling
    src, part = render(spec).source, backward_part(spec)
    add = ModCode(spec).additive(*NAMES)
    assert add and "gl.load(mt0 + _mod_index(" in add and "tl." not in add, add
    assert f"xadd = ({add}) * 1.4426950408889634" in part and "st = st + xadd" in part  # score + X: X / ln 2
    assert "score+bias" not in src
    # no Triton kernel computes the mod: the only @triton.jit functions are the fixed-point bound's (host launch code)
    jitted = re.findall(r"@triton\.jit\ndef (\w+)\(", part)
    assert jitted and set(jitted) <= {"_bwd_kv_bound_rows"}, jitted
    assert part.count("@triton.jit") == len(jitted)
    # the captured values: typed kernel arguments through the main kernel, both compute warpgroups, not specialised
    assert part.count("seq_k, mt0, mt0_s0, mt0_s1, mt0_n0, mt0_n1") >= 4
    assert '"sq_pad", "mt0_s0", "mt0_s1", "mt0_n0", "mt0_n1"])' in part
    assert "torch.is_grad_enabled() and any(t.requires_grad for t in (mt0, ))" in part  # no bias gradient here
    # additive mods leave dS alone; the rest multiply it by d score_mod / d score at the natural score
    assert "through the score_mod" not in part
    swish = bwd(mask="none", **SWISH)
    d = ModCode(swish).dscore("score", *NAMES)
    part = backward_part(swish)
    assert d and "gl." in d and "tl." not in d, d
    assert f"dst = gl.where(pt == 0.0, 0.0, dst * ({d}))" in part
    assert f"st = ({ModCode(swish).score('score', *NAMES)}) * 1.4426950408889634" in part
    assert "score = st * 0.6931471805599453" in part and "pt = gl.exp2(st - lse2[None, :])" in part


def test_the_switches_render_their_code_only_where_on():
    plain = backward_part(bwd())
    for word in ("tcap", "_bwd_first", "top", "win_left", "mt0", "score ="):
        assert word not in plain, word
    assert "pt = gl.exp2(st * qk_scale - lse2[None, :])" in plain
    cap = backward_part(bwd(mask="none", softcap=True))
    assert "tcap = _tanh(st * cap_in)" in cap and "dst = dst * (1.0 - tcap * tcap)" in cap
    assert "cap_out, (win_left, win_right, cap_in, ))" in cap  # qk_scale = cap / ln 2 ([Note] Gluon score switches)
    win = backward_part(bwd(window=True))
    assert win.count("if (m0 < split) | (m0 >= top):") == 2  # the deterministic and unordered kernels
    assert "turn = n_blk - _bwd_first(m0, seq_q, seq_k, win_left, BLOCK_N)" in win
    assert "(keys[:, None] >= i_al - win_left) & (keys[:, None] <= i_al + win_right)" in win
    assert '"sq_pad", "win_left", "win_right"])' in win
    assert "f = GQA * steps - 1 - i" in win  # the product's bwd_window keys (the chain since the flip): descending


def test_the_window_desc_lever_reverses_every_partition_s_steps(monkeypatch):
    monkeypatch.setitem(backends.GLUON.variant, "bwd_window_desc", 1)
    render.cache_clear()
    try:
        assert backward_part(bwd(window=True)).count("f = GQA * steps - 1 - i") == 6  # 3 partitions x 2 kernels
        assert "GQA * steps - 1 - i" not in backward_part(bwd())  # a window's lever only
    finally:
        render.cache_clear()


BUILDS = {"plain-causal": dict(mask="causal"), "plain-none": dict(mask="none"),
          "window": dict(mask="causal", window=True), "softcap": dict(mask="none", softcap=True),
          "alibi": dict(mask="none", **ALIBI), "relbias": dict(mask="none", **RELBIAS),
          "relbias-free": dict(mask="none", _free=True, **RELBIAS)}  # MOD_FREE ([Note] Clamp-free problems)

_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import re
import fagen
from fagen.runtime.loader import load_source
from fagen.spec.kernel import KernelSpec
from sm90 import ptxas
from fagen import backends

backends.GLUON.variant["bwd_d128"] = {}  # the plain renders as the chain's, which the mods' renders share
out = {}
for key, fields in json.loads(sys.argv[2]).items():
    free = {"mod_free": True} if fields.pop("_free", False) else {}
    spec = KernelSpec(backend="gluon", direction="bwd", head_dim=128, dtype="bf16", **fields)
    ck = load_source(fagen.generate(spec), f"{spec.name}_{key}").compile_backward_for(deterministic=True, **free)
    res = next(iter(ptxas(ck.asm["ptx"])[0].values()))
    out[key] = dict(shared=ck.metadata.shared, spills=res.spill_stores,
                    setmaxnreg=sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)",
                                                                   ck.asm["ptx"])}))
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, BUILDS, "gluon-bwd-mods")


def test_the_mod_builds_fit_and_spill_about_as_the_plain_ones(built):
    """ptxas sm_90, deterministic mode, bytes of spill stores (the plain kernels spill too: 240 registers per
    compute thread, docs/hopper.md): plain causal 660, window 680; plain none 112, softcap 148, ALiBi 128. A
    relative bias (a [64, 64] gather per warpgroup and step: [Note] Clamp-free tiles) 784; its clamp-free kernel
    (MOD_FREE, the clamped read not compiled: [Note] Clamp-free problems) 544."""
    assert built["window"]["spills"] <= built["plain-causal"]["spills"] * 1.1 + 64, built
    for key in ("softcap", "alibi"):
        assert built[key]["spills"] <= built["plain-none"]["spills"] * 1.5 + 64, built
    assert built["relbias"]["spills"] <= 1400, built
    assert built["relbias-free"]["spills"] < built["relbias"]["spills"], built
    for r in built.values():
        assert r["shared"] <= 227 * 1024 and {240, 24} <= set(r["setmaxnreg"]), r


def _tile_functions(spec):
    """_bwd_tile and _bwd_first of the rendered backward as plain Python: their bodies use only ints, //, and
    gl.minimum / gl.maximum, and every // there divides a value >= 0 (so Python's floor is the GPU's truncation)."""
    import types

    part = backward_part(spec)
    gl = types.SimpleNamespace(minimum=min, maximum=max, constexpr=None)
    ns = {"gl": gl}
    for name in ("_bwd_tile", "_bwd_first"):
        body = part.split(f"def {name}(", 1)[1].split("\n\n\n", 1)[0]
        exec(f"def {name}(" + body, ns)  # noqa: S102 - our own rendered text
    return ns["_bwd_tile"], ns["_bwd_first"]


@pytest.mark.parametrize("mask", ["causal", "none"])
def test_the_window_tiles_visit_every_visible_pair_and_skip_the_mask_only_inside(mask):
    """[Note] Window in the backward, against brute force over small shapes: a tile (key block) visits every query
    block one of whose rows sees one of its keys; a step it runs unmasked has every row seeing every key; the key
    blocks that visit a query block are an interval that starts at _bwd_first (the fixed-order dQ's turn 0)."""
    import random

    import numpy as np

    tile, first = _tile_functions(bwd(mask=mask, window=True))
    rnd, BM, BN, UNB = random.Random(0), 64, 128, 1 << 30
    sizes = (1, 63, 64, 65, 127, 128, 129, 200, 255, 256, 257, 383, 384, 385, 640)  # around the block edges
    for _ in range(300):
        sq, sk = rnd.choice(sizes), rnd.choice(sizes)
        left = rnd.choice((0, 1, 36, 37, 63, 64, 65, 127, 128, 129, 200, UNB))
        right = rnd.choice((0, 1, 5, 63, 64, 65, 130, UNB))
        if left == right == UNB:
            left = 64
        n_kblk, sq_pad = (sk + BN - 1) // BN, (sq + BM - 1) // BM * BM
        a = np.arange(sq_pad)[:, None] + (sk - sq)  # i_aligned of every row, the padding rows too
        j = np.arange(n_kblk * BN)[None, :]
        vis = (j >= a - left) & (j <= a + right) & (j < sk) & ((j <= a) if mask == "causal" else True)
        real = vis & (np.arange(sq_pad)[:, None] < sq)
        visits = {}
        for n in range(n_kblk):
            _, _, _, _, lo, split, hi, top = tile(n, 1, 1, sq, sk, left, right, BM, BN, 1, mask == "causal")
            for m0 in range(0, sq_pad, BM):
                block = (slice(m0, m0 + BM), slice(n * BN, n * BN + BN))
                if real[block].any():
                    assert lo <= m0 < hi, (sq, sk, left, right, n, m0, lo, hi)
                if lo <= m0 < hi:
                    visits.setdefault(m0, []).append(n)
                    if split <= m0 < top:  # unmasked: every row sees every key (none past Sk)
                        assert vis[block].all(), (sq, sk, left, right, n, m0, split, top)
        for m0, ns in visits.items():
            assert ns == list(range(first(m0, sq, sk, left, BN), ns[-1] + 1)), (sq, sk, left, right, m0, ns)


def test_the_clamp_free_condition_holds_exactly_where_every_index_of_the_tile_is_inside():
    """[Note] Clamp-free tiles (fagen/mods/emit.py): the emitted tile condition, run as Python over random tiles,
    is true exactly where brute force finds every index of an affine load inside its tensor (the strides small);
    loads indexed otherwise give no condition, and the unclamped read drops _mod_index only."""
    import random
    import types

    import numpy as np

    def spec(text, scalars=()):
        return bwd(mask="none", score_mod=text, mod_tensors=[["bias", "fp32", 2]],
                   mod_scalars=[[s, "int"] for s in scalars])
    names = ("off_b", "hh", "q_idx", "kv_idx")
    ranges = (("qlo", "qhi"), ("klo", "khi"))
    gl = types.SimpleNamespace(minimum=min, maximum=max)
    cases = {"score + bias[h, q_idx - kv_idx + 4095]": lambda q, k, h, c: (h, q - k + 4095),
             "score + bias[h, kv_idx - q_idx + c]": lambda q, k, h, c: (h, k - q + c),
             "score + bias[h + 1, c * q_idx - 2 * kv_idx]": lambda q, k, h, c: (h + 1, c * q - 2 * k)}
    rnd = random.Random(1)
    for text, index in cases.items():
        code = ModCode(spec(text, ("c",) if "c" in text.replace("score", "") else ()))
        cond = code.in_range("off_b", "hh", *ranges)
        fast = code.additive(*names, unclamped=True)
        assert "_mod_index" not in fast and "_mod_index" in code.additive(*names), (fast, text)
        hits = 0
        for _ in range(400):
            qlo, klo = rnd.randint(-50, 9000), rnd.randint(-50, 9000)
            env = dict(gl=gl, qlo=qlo, qhi=qlo + rnd.choice((0, 63)), klo=klo, khi=klo + rnd.choice((0, 63)),
                       hh=rnd.randint(-2, 17), ms0=rnd.randint(-3, 3), mt0_n0=16, mt0_n1=8191, mt0_s0=8191,
                       mt0_s1=1)
            got = eval(cond.replace(".to(gl.int64)", ""), env)  # noqa: S307 - our own rendered text
            q = np.arange(env["qlo"], env["qhi"] + 1)[:, None]
            k = np.arange(env["klo"], env["khi"] + 1)[None, :]
            i0, i1 = index(q, k, env["hh"], env["ms0"])
            inside = bool(np.all((i0 >= 0) & (i0 < 16)) and np.all((i1 >= 0) & (i1 < 8191)))
            assert bool(got) == inside, (text, env)
            hits += inside
        assert 0 < hits < 400, (text, hits)  # both kinds of tile were drawn
    for text in ("score + bias[h, q_idx // 2]", "score + bias[h, q_idx * kv_idx]", "score + bias[h, abs(q_idx)]"):
        assert ModCode(spec(text)).in_range("off_b", "hh", *ranges) is None, text


@pytest.mark.skipif(ON_GPU, reason="CPU tensors with sm_90 faked: its Triton path needs the interpreter")
def test_the_prefix_split_asks_for_the_big_backward_per_call_from_its_own_pairs():
    """[Note] Split calls' backward (fagen/mods/split.py): with gradients the prefix split resolves each call with
    big_bwd from that call's pairs (B x H x rows x keys) against bwd_min_work; without it, never."""
    import torch

    from fagen.mods import split
    from fagen.runtime.resolve import resolve

    asked = []

    def recording(*args):
        asked.append(args[3:])  # (mask, decode, switches, forward_only, big_bwd)
        return resolve(*args[:6])  # this machine's Triton bwd modules serve either way

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 45, 16, generator=g).requires_grad_() for _ in range(3))
    p = 15  # "none" over 15 x 15 keys: 1 x 2 x 225 = 450 pairs; causal rows [15, 45) over 45 keys: 2700
    for min_work, big in ((1000, [False, True]), (100, [True, True]), (5000, [False, False]), (None, [False, False])):
        asked.clear()
        out = split.run_split(("prefix", p), None, q, k, v, mask="none", resolve=recording, bwd_min_work=min_work)
        assert [a[0] for a in asked] == ["none", "causal"] and [a[-1] for a in asked] == big, (min_work, asked)
        assert out.shape == q.shape


def test_the_rule_picks_switches_and_score_mods_only_where_listed(monkeypatch):
    """GluonBackend.bwd_selected_switches / bwd_select_score_mods ([Note] Gluon backward mods): off, the rule is the
    plain one's; on, it picks the listed switch sets and a score_mod, never a mask_mod."""
    gluon = backends.GLUON
    win, rel = KernelSpec(head_dim=128, dtype="bf16", direction="bwd", mask="causal", window=True), \
        KernelSpec(head_dim=128, dtype="bf16", direction="bwd", mask="none", **RELBIAS)
    monkeypatch.setattr(type(gluon), "bwd_select_score_mods", False)
    monkeypatch.setattr(type(gluon), "bwd_selected_switches", ((),))
    assert not gluon.bwd_selected(win) and not gluon.bwd_selected(rel)
    monkeypatch.setattr(type(gluon), "bwd_selected_switches", ((), ("window",)))
    monkeypatch.setattr(type(gluon), "bwd_select_score_mods", True)
    assert gluon.bwd_selected(win) and gluon.bwd_selected(rel)
    assert not gluon.bwd_selected(KernelSpec(head_dim=128, dtype="bf16", direction="bwd", softcap=True))
    assert not gluon.bwd_selected(KernelSpec(head_dim=128, dtype="bf16", direction="bwd", mask_mod="q_idx >= kv_idx"))
