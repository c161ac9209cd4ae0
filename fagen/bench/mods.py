"""`fagen bench --suite mods`: attention-gym's mods through fagen.attention against FlexAttention with the same
functions and the same block mask, forward and backward, plus the costs only mods have.

[Note] Mods rows. Every row runs the same user functions (fagen/bench/gym_mods.py's, written as attention-gym writes
them) through fagen.attention(score_mod=, mask_mod=, block_mask=) and through torch.compile'd flex_attention with
flex's create_block_mask of the same mask_mod; both block masks are built once per row and their build time is
reported beside the row (`mask_ms`: fagen's generated classifier against flex's create_block_mask). Outputs are
compared with each other before timing. Rates are useful TF/s: 4 * D per visible (query, key) pair forward, 2.5x
that backward, with the pairs counted from the block mask's elementwise evaluation (fagen's classes, partial
blocks evaluated in torch). Extra rows:
  builtin-as-mod   causal (mask_mod q_idx >= kv_idx) and softcap (a score_mod) against mask="causal" and
                   softcap=: the same problem through the switch kernel (target: within 5%), once as fagen.attention
                   runs them (lowered to the switch, fagen/mods/lower.py) and once with lowering off (the modded
                   kernels); every row records what its mods were lowered to (`lowered_to`, None: not lowered);
  cold-first-call  a mod no cache has seen, in a process that ran attention before: seconds to its first result
                   with fresh caches (target <= 3 s) and in a second process on the filled caches (target <= 0.3 s);
                   Flex the same way; and from a process's start ([Note] Cold rows);
  changed-scalar   a sliding window whose closure number changes every call: kernels compiled during the loop
                   (target: 0) and host time per call against an unchanged call (target <= 1.2x).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable

import torch

from fagen.bench.mods_table import TARGETS, line as _line, table  # noqa: F401 - TARGETS: the suite's
from fagen.bench.rounds import SUITE_ROUNDS, summarize, time_parts
from fagen.bench.timing import measure



@dataclasses.dataclass(frozen=True)
class ModsShape:
    batch: int = 1
    heads: int = 16
    seq: int = 8192
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16


def _gym():
    """attention-gym's example mods (fagen/bench/gym_mods.py, which the tests use too)."""
    from fagen.bench import gym_mods

    return gym_mods


def cases(shape: ModsShape, device) -> list[tuple[str, Callable | None, Callable | None, list]]:
    """(name, score_mod, mask_mod, tensors that get a gradient) per row; tensors live on `device`."""
    g, s, h = _gym(), shape.seq, shape.heads
    gen = torch.Generator(device="cpu").manual_seed(0)
    rel = (torch.randn(h, 2 * s - 1, generator=gen) * 0.1).to(device)
    lengths, left = [], s
    while left > 0:  # packed documents of random lengths (64 .. s/4)
        n = min(left, int(torch.randint(64, max(65, s // 4), (1,), generator=gen)))
        lengths.append(n)
        left -= n
    offsets = g.length_to_offsets(lengths, device)
    learned = (torch.randn(h, 2 * s - 1, generator=gen) * 0.1).to(device).requires_grad_()
    return [
        ("relative-bias", g.generate_relative_bias(rel, s), None, []),
        ("alibi", g.generate_alibi_bias(h), None, []),
        ("softcap", g.generate_tanh_softcap(30.0), None, []),
        ("document+causal", None, g.generate_doc_mask_mod(g.causal_mask, offsets), []),
        ("prefix-lm", None, g.generate_prefix_lm_mask(s // 4), []),
        ("sliding-window+causal", None, g.generate_sliding_window(1024), []),
        ("dilated", None, g.generate_dilated_sliding_window(1024, 4), []),
        ("learned-bias+grad", g.generate_relative_bias(learned, s), g.causal_mask, [learned]),
    ]


def _inputs(shape: ModsShape, device, grad: bool):
    gen = torch.Generator(device="cpu").manual_seed(1)
    q, k, v = (torch.randn(shape.batch, shape.heads, shape.seq, shape.head_dim, generator=gen)
               .to(device, shape.dtype).requires_grad_(grad) for _ in range(3))
    return q, k, v, torch.randn_like(q)


def _visible_pairs(bm, mask_mod, shape) -> int:
    """Visible (q, kv) pairs per (b, h) summed: full blocks count whole, partial blocks evaluated elementwise."""
    if bm is None:
        return shape.batch * shape.heads * shape.seq * shape.seq
    from fagen.verify.mods_reference import mask_mod_visible

    c = bm.classes
    per = int((c == 2).sum()) * bm.block_m * bm.block_n  # rough at the tails; the partial blocks are exact
    for b, hh, i, j in (c == 1).nonzero().tolist():
        rows = slice(i * bm.block_m, min((i + 1) * bm.block_m, shape.seq))
        cols = slice(j * bm.block_n, min((j + 1) * bm.block_n, shape.seq))
        vis = _tile_visible(mask_mod, b, hh, rows, cols, c.device)
        per += int(vis.sum())
    scale = (shape.batch // c.shape[0]) * (shape.heads // c.shape[1])
    return per * scale


def _tile_visible(mask_mod, b, h, rows, cols, device):
    qi = torch.arange(rows.start, rows.stop, device=device)[:, None]
    ki = torch.arange(cols.start, cols.stop, device=device)[None, :]
    bi = torch.tensor(b, device=device)
    hi = torch.tensor(h, device=device)
    return torch.vmap(torch.vmap(lambda x, y: mask_mod(bi, hi, x, y), in_dims=(None, 0)), in_dims=(0, None))(
        qi[:, 0], ki[0])


def _time(fn, device, rep_ms, memo=None, rounds=1) -> float:
    """Median ms of fn(): 10 ms of warm-up and rep_ms of repetitions, or with a `memo` one of `rounds` interleaved
    rounds (a 1/rounds share of both; [Note] Interleaved rounds in fagen/bench/rounds.py)."""
    return measure(lambda i: fn(), 1, torch.device(device), 10.0 / rounds, rep_ms / rounds, memo=memo)


# [Note] Mods rounds. A mod row times fagen and Flex each on three parts (the block mask's build, the forward, the
# backward on a kept graph). With `rounds` > 1 (`fagen bench --suite mods --rounds N`, default SUITE_ROUNDS) both sides
# are readied first (block masks, Flex's compile, one forward and one backward each, the outputs compared) and then
# timed in N rounds, the order of the two rotated each round, each part's warm-up and repetitions a 1/N share of the
# row's (10 ms and --rep's 100 ms): fagen.bench.rounds.time_parts. A side's `fwd_ms` (`bwd_ms`, the `*_mask_ms`) is
# the median of its rounds; the side keeps the rounds (`fwd_rounds_ms`, ...) and their spread (`fwd_ms_min`,
# `fwd_ms_max`, ...), the row `rounds` and the ratios of each round (`fwd_x_rounds`, `bwd_x_rounds`: Flex's ms over
# fagen's in the same round, where the round's clock cancels). rounds 1: each side readied and timed in turn, fagen
# first (the earlier suite).
def _parts(attend, q, k, v, do, leaves, device, rep_ms, rounds, mask=None) -> tuple[dict, torch.Tensor]:
    """A side's timed parts ({key: timer(memo)}) and its output with a graph kept for the backward; readies the
    forward without and with a gradient and the backward (compiles outside the timing)."""
    grad = lambda: torch.autograd.grad(out, (q, k, v, *leaves), do, retain_graph=True)  # noqa: E731
    with torch.no_grad():
        attend(q, k, v)
    FWD_LOWERED[0] = _lowered()  # without a gradient some mods lower further (fagen/mods/split.py)
    out = attend(q, k, v)
    grad()

    def timer(fn):
        return lambda memo: _time(fn, device, rep_ms, memo, rounds if memo is not None else 1)

    def fwd():
        with torch.no_grad():
            return attend(q, k, v)

    parts = {} if mask is None else {"mask_ms": timer(mask)}
    return parts | {"fwd_ms": timer(fwd), "bwd_ms": timer(grad)}, out


def mod_rows(device, shape: ModsShape, log=print, rep_ms=100.0, flex=True, only=None, rounds=1) -> list[dict]:
    """The mod rows, fagen against Flex ([Note] Mods rounds: `rounds` interleaved rounds, 1: in turn)."""
    records = []
    for name, score_mod, mask_mod, leaves in cases(shape, device):
        if only is not None and name not in only:
            continue
        row = {"case": name, "kind": "mods", "shape": dataclasses.asdict(shape) | {"dtype": str(shape.dtype)}}
        try:
            q, k, v, do = _inputs(shape, device, True)
            got: dict = {}
            setups = {"fagen": lambda: _fagen_side(row, got, q, k, v, do, leaves, score_mod, mask_mod, shape,
                                                   device, rep_ms, rounds)}
            if flex and device == "cuda":
                setups["flex"] = lambda: _flex_side(row, got, q, k, v, do, leaves, score_mod, mask_mod, shape,
                                                    device, rep_ms, rounds)
            times, failed = time_parts(setups, rounds)
            if "fagen" in failed:
                raise failed["fagen"]
            if failed:  # Flex cannot run the mod (the learned bias's backward): fagen's side stands, against float64
                row["flex_error"] = _error(failed.pop("flex"))
                del setups["flex"]
                row["max_diff_vs_float64"] = _float64_diff(got["out"], q, k, v, score_mod, mask_mod)
            fl = got["flops"]
            keys = ("mask_ms", "fwd_ms", "bwd_ms")
            for side in setups:
                t = summarize(times[side], keys, keys) if rounds > 1 else times[side][0]
                mask_ms = t.pop("mask_ms", None)
                if mask_ms is not None:
                    row[f"{side}_mask_ms"] = mask_ms
                row[side] = {"fwd_ms": t["fwd_ms"], "bwd_ms": t["bwd_ms"], "fwd_TF/s": fl / t["fwd_ms"] / 1e9,
                             "bwd_TF/s": 2.5 * fl / t["bwd_ms"] / 1e9} | {k: t[k] for k in t if k not in keys}
            if leaves:
                ours = got["ours"]
                g1 = torch.autograd.grad(ours(q, k, v), leaves, do)
                g2 = torch.autograd.grad(ours(q, k, v), leaves, do)
                row["bias_grad_bitwise_repeatable"] = all(torch.equal(a, b) for a, b in zip(g1, g2))
            if "flex" in row:
                row["fwd_x"] = row["flex"]["fwd_ms"] / row["fagen"]["fwd_ms"]
                row["bwd_x"] = row["flex"]["bwd_ms"] / row["fagen"]["bwd_ms"]
                if rounds > 1:
                    for d in ("fwd", "bwd"):
                        row[f"{d}_x_rounds"] = [round(p / f, 4) for p, f in zip(
                            [t[d + "_ms"] for t in times["flex"]], [t[d + "_ms"] for t in times["fagen"]])]
            if rounds > 1:
                row["rounds"] = rounds
        except Exception as e:  # a row that cannot run is recorded, and the suite goes on
            row["error"] = _error(e)
        log(_line(row))
        records.append(row)
    return records


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def _float64_diff(out, q, k, v, score_mod, mask_mod) -> float:
    """fagen's output against the float64 reference of the same mods (fagen.verify.reference), where Flex gives none."""
    from fagen.verify import reference

    with torch.no_grad():
        want, _ = reference.attention(q.detach().double(), k.detach().double(), v.detach().double(),
                                      score_mod=score_mod, mask_mod=mask_mod)
    return (out.double() - want).abs().max().item()


def _fagen_side(row, got, q, k, v, do, leaves, score_mod, mask_mod, shape, device, rep_ms, rounds) -> dict:
    """fagen's side of a mod row readied: its block mask (the first build timed once), the lowering of its mods
    (`lowered_to`, `bwd_lowered_to`) and its output (got["out"]); returns its timed parts."""
    import fagen

    bm, mask = None, None
    if mask_mod is not None:
        t0 = time.perf_counter()
        bm = fagen.create_block_mask(mask_mod, None, None, shape.seq, shape.seq, device=device)
        torch.cuda.synchronize() if device == "cuda" else None
        row["fagen_first_mask_ms"] = (time.perf_counter() - t0) * 1e3
        row["sparsity"] = bm.sparsity()
        mask = lambda: fagen.create_block_mask(mask_mod, None, None, shape.seq, shape.seq, device=device)  # noqa
    ours = lambda q, k, v: fagen.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod,  # noqa: E731
                                           block_mask=bm)
    parts, got["out"] = _parts(ours, q, k, v, do, leaves, device, rep_ms, rounds, mask)
    row["lowered_to"] = FWD_LOWERED[0]
    if _lowered() != FWD_LOWERED[0]:
        row["bwd_lowered_to"] = _lowered()  # with a gradient
    got["ours"], got["flops"] = ours, 4.0 * shape.head_dim * _visible_pairs(bm, mask_mod, shape)
    return parts


def _flex_side(row, got, q, k, v, do, leaves, score_mod, mask_mod, shape, device, rep_ms, rounds) -> dict:
    """Flex's side: torch.compile'd flex_attention with flex's block mask of the same mask_mod, its output compared
    with fagen's (`max_diff_vs_flex`); returns its timed parts."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from fagen.bench.peers import configure_dynamo

    configure_dynamo()
    compiled = torch.compile(flex_attention, dynamic=False)
    bm, mask = None, None
    if mask_mod is not None:
        bm = create_block_mask(mask_mod, None, None, shape.seq, shape.seq, device=device)
        mask = lambda: create_block_mask(mask_mod, None, None, shape.seq, shape.seq, device=device)  # noqa: E731
    attend = lambda q, k, v: compiled(q, k, v, score_mod=score_mod, block_mask=bm)  # noqa: E731
    parts, out = _parts(attend, q, k, v, do, leaves, device, rep_ms, rounds, mask)
    row["max_diff_vs_flex"] = (out.float() - got["out"].float()).abs().max().item()
    return parts


def builtin_rows(device, shape: ModsShape, log=print, rep_ms=100.0, rounds=1) -> list[dict]:
    """A built-in switch written as a mod against the switch kernel, on the same inputs: as fagen.attention runs
    the mod (lowered to the switch) and with lowering off (the modded kernels); [Note] Mods rounds."""
    import fagen
    from fagen.mods import lower

    g = _gym()
    q, k, v, do = _inputs(shape, device, True)
    pairs = [("causal as mask_mod", dict(mask="causal"), dict(mask_mod=g.causal_mask, block_mask=None)),
             ("softcap as score_mod", dict(softcap=30.0), dict(score_mod=g.generate_tanh_softcap(30.0)))]
    records = []
    for name, switch, mod in pairs:
        for lowering in (True, False):
            row, got = {"case": name + ("" if lowering else " (lowering off)"), "kind": "builtin-as-mod"}, {}
            try:
                lower.ENABLED = lowering
                if "mask_mod" in mod:
                    mod["block_mask"] = fagen.create_block_mask(mod["mask_mod"], None, None, shape.seq, shape.seq,
                                                                device=device)

                def side(kw, key):
                    parts, got[key] = _parts(lambda q, k, v: fagen.attention(q, k, v, **kw), q, k, v, do, [],
                                             device, rep_ms, rounds)
                    if key == "b":
                        got["lowered_to"] = _lowered()  # what the mod became (with a gradient)
                    return parts

                times, failed = time_parts({"switch": lambda: side(switch, "a"), "mod": lambda: side(mod, "b")},
                                           rounds)
                if failed:
                    raise next(iter(failed.values()))
                keys = ("fwd_ms", "bwd_ms")
                t = {s: summarize(times[s], keys, keys) if rounds > 1 else times[s][0] for s in times}
                fa, ba, fb, bb = t["switch"]["fwd_ms"], t["switch"]["bwd_ms"], t["mod"]["fwd_ms"], t["mod"]["bwd_ms"]
                row.update(switch_fwd_ms=fa, mod_fwd_ms=fb, switch_bwd_ms=ba, mod_bwd_ms=bb,
                           lowered_to=got["lowered_to"], fwd_ratio=fa / fb, bwd_ratio=ba / bb,
                           max_diff=(got["a"].float() - got["b"].float()).abs().max().item())
                if rounds > 1:
                    row["rounds"] = rounds
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            finally:
                lower.ENABLED = True
            log(_line(row))
            records.append(row)
    return records


FWD_LOWERED: list = [None]  # what the last _fwd_bwd_ms's forward (no gradient) lowered its mods to


def _lowered():
    """What fagen.attention's last call with mods lowered them to ("causal+window(1024,0)"), None: not lowered."""
    from fagen.runtime import modded

    return modded.LOWERED[0]


# [Note] Cold rows. The issue's target is "first call of a new mod, cold caches: <= 3 s to first result (Flex:
# 10-15 s); warm: <= 0.3 s": the cost of a *new mod*, in a process that already imported fagen, initialised CUDA and
# ran attention. So each child process below first runs one plain call (untimed; it compiles the plain kernel, and
# with it Triton's one-time costs: its key, its CUDA utilities), then times the first call with a mod whose
# expression holds a literal no cache has seen (a closure number would be a runtime scalar of a kernel compiled
# before). cold: fresh FAGEN_CACHE_DIR and TRITON_CACHE_DIR; warm: a second process on the caches the first filled.
# Flex runs the same way (torch.compile(flex_attention) of a plain call first, then the new score_mod) with a fresh
# TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR. The row also keeps the process-start figure (the clock started after
# `import torch`, so it also counts importing fagen, CUDA's start and the plain kernel's work) that it reported alone
# before: start_cold_s, start_warm_s. scripts/gpu_coldstart.py breaks both down by phase.
_COLD = r"""
import sys, time, json, torch
t0 = time.perf_counter()
mode, seq, device = sys.argv[1], int(sys.argv[2]), sys.argv[3]
mod = eval(sys.argv[4], {"torch": torch})  # score + where(q_idx >= kv_idx, <a new literal>, -0.5)
def sync():
    torch.cuda.synchronize() if device == "cuda" else None
q = torch.randn(1, 16, seq, 128, device=device, dtype=torch.bfloat16)
if mode == "flex":
    from torch.nn.attention.flex_attention import flex_attention
    attend = torch.compile(flex_attention, dynamic=False)
else:
    import fagen
    attend = fagen.attention
if mode != "start":  # [Note] Cold rows: a process that ran attention before
    attend(q, q, q)
    sync()
    t0 = time.perf_counter()
with torch.no_grad():
    out = attend(q, q, q, score_mod=mod)
sync()
print(json.dumps({"s": time.perf_counter() - t0}))
"""


def cold_rows(device, seq=4096, log=print, flex=True) -> list[dict]:
    """Seconds to the first result of a new mod ([Note] Cold rows): cold and warm caches, in a process that ran
    attention before (the target) and from a process's start; Flex's the same way (on cuda, with flex)."""
    stamp = time.time_ns() % 10**6 / 10**6  # a new literal: a new spec no cache holds
    row = {"case": "cold-first-call", "kind": "cold"}
    runs = [("start", "start", "fagen"), ("", "newmod", "fagen")] + ([("flex_", "flex", "flex")]
                                                                     if flex and device == "cuda" else [])
    try:
        for i, (prefix, mode, cache) in enumerate(runs):
            code = f"lambda score, b, h, q_idx, kv_idx: score + torch.where(q_idx >= kv_idx, {i + stamp!r}, -0.5)"
            with tempfile.TemporaryDirectory() as tmp:
                env = dict(os.environ, FAGEN_CACHE_DIR=os.path.join(tmp, "fagen"),
                           TRITON_CACHE_DIR=os.path.join(tmp, "tr"), TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "ind"))
                for caches in ("cold", "warm"):
                    key = f"{prefix}_{caches}_s" if mode == "start" else f"{prefix}{caches}_s"
                    t0 = time.perf_counter()
                    res = subprocess.run([sys.executable, "-c", _COLD, mode, str(seq), device, code], env=env,
                                         capture_output=True, text=True, timeout=300)
                    if res.returncode:
                        raise RuntimeError(f"{mode} {caches}: " + (res.stderr.strip().splitlines()[-1]
                                                                   if res.stderr.strip() else "failed"))
                    row[key] = json.loads(res.stdout.strip().splitlines()[-1])["s"]
                    row[key.removesuffix("_s") + "_wall_s"] = time.perf_counter() - t0
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    log(_line(row))
    return [row]


def scalar_rows(device, shape: ModsShape, log=print, calls=200) -> list[dict]:
    """A closure number that changes every call: compiles during the loop, and host time against no change; as
    fagen.attention runs it (lowered to the window switch) and, under `lowering_off`, on the modded kernels."""
    from fagen.mods import lower

    small = dataclasses.replace(shape, seq=1024) if shape.seq > 1024 else shape
    q, k, v, _ = _inputs(small, device, False)
    row = {"case": "changed-scalar", "kind": "scalar"}
    try:
        for lowering in (True, False):
            lower.ENABLED = lowering
            try:
                got = _changed_scalar(q, k, v, device, calls)
            finally:
                lower.ENABLED = True
            if lowering:
                row.update(got)
            else:
                row["lowering_off"] = got
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    log(_line(row))
    return [row]


def _changed_scalar(q, k, v, device, calls) -> dict:
    import fagen

    g = _gym()
    with torch.no_grad():
        fagen.attention(q, k, v, mask_mod=g.generate_sliding_window(100))
        before = _compiled_kernels()
        fixed = g.generate_sliding_window(100)
        times = {}
        for label, make in (("unchanged", lambda i: fixed), ("changed", lambda i: g.generate_sliding_window(
                100 + i % 64))):
            fns = [make(i) for i in range(calls)]
            for fn in fns[:5]:
                fagen.attention(q, k, v, mask_mod=fn)
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()  # host time: the launches queue up, no sync inside the loop
            for fn in fns:
                fagen.attention(q, k, v, mask_mod=fn)
            times[label] = (time.perf_counter() - t0) / calls * 1e6
            if device == "cuda":
                torch.cuda.synchronize()
        return dict(unchanged_us=times["unchanged"], changed_us=times["changed"], lowered_to=_lowered(),
                    host_ratio=times["changed"] / times["unchanged"], new_compiles=_compiled_kernels() - before)


def _compiled_kernels() -> int:
    """Compiled kernel variants held by every loaded generated module's @triton.jit functions."""
    import triton

    n = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("fagen_generated"):
            continue
        for obj in vars(module).values():
            if isinstance(obj, triton.runtime.jit.JITFunction):
                caches = getattr(obj, "device_caches", None) or {}
                n += sum(len(c[0]) if isinstance(c, tuple) else len(c) for c in caches.values())
    return n


ROWS = ("relative-bias", "alibi", "softcap", "document+causal", "prefix-lm", "sliding-window+causal", "dilated",
        "learned-bias+grad", "builtin-as-mod", "cold-first-call", "changed-scalar")  # `--case` names


def run(device, log=print, quick=False, names=(), flex=True, rounds=SUITE_ROUNDS) -> list[dict]:
    """The suite's rows; `names`: only these names of ROWS (`fagen bench --suite mods --case NAME`); flex=False
    leaves FlexAttention out (`--skip-flex`); `rounds`: the timed rows' interleaved rounds ([Note] Mods rounds;
    `--rounds`, at most 2 with `quick`)."""
    unknown = sorted(set(names) - set(ROWS))
    if unknown:
        raise click_error(f"--case: no mods row {unknown[0]!r}; rows: {', '.join(ROWS)}")
    want = set(names or ROWS)
    if quick:  # a CPU smoke run through the interpreter: tiny shapes, no peers
        shape = ModsShape(batch=1, heads=2, seq=80, head_dim=32, dtype=torch.float32)
        rep, flex, calls, rounds = 1.0, False, 3, min(rounds, 2)
    else:
        shape, rep, calls = ModsShape(), 100.0, 200
    records = []
    if want & set(ROWS[:8]):
        records += mod_rows(device, shape, log=log, rep_ms=rep, flex=flex, only=want, rounds=rounds)
    if "builtin-as-mod" in want:
        records += builtin_rows(device, shape, log=log, rep_ms=rep, rounds=rounds)
    if "cold-first-call" in want and (not quick or names):  # quick: only when named (two interpreter processes)
        records += cold_rows(device, seq=64 if quick else 4096, log=log, flex=flex)
    if "changed-scalar" in want:
        records += scalar_rows(device, shape, log=log, calls=calls)
    log(table(records))
    return records


def click_error(message: str) -> Exception:
    import click

    return click.UsageError(message)
