"""Benchmark workloads: cases, the FLOP and byte counts they are scored by, the standard suite (inputs:
fagen/bench/inputs.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fagen.runtime import hopper as hopper_rule
from fagen.runtime.kinds import prefers_decode
from fagen.spec import tables
from fagen.spec.axes import Direction, DType, Kind, Mask
from fagen.spec.kernel import SCORE_SWITCHES, KernelSpec

METRICS = ("tflops", "gbs", "ms")  # what a case's table cell shows; ms is "lower is better"
BWD_FACTOR = 2.5  # backward FLOPs = 2.5 x forward (two matmuls forward, five backward: 5/2)
Q_MAGNITUDE = 3.0  # q ~ 3 N(0, 1): logits of std 3 make softmax peaky, so a wrong mask moves outputs by O(1)


# -- cases -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BenchCase:
    """One benchmark problem: shapes, mask data, what is timed and which number the table shows."""

    name: str
    head_dim: int
    mask: Mask
    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    dtype: DType = DType.BF16
    direction: Direction = Direction.FWD  # bwd: the backward pass alone is timed (fwd+bwd is recorded too)
    seqlens_q: tuple[int, ...] | None = None
    seqlens_k: tuple[int, ...] | None = None
    parents: tuple[tuple[int, ...], ...] | None = None  # tree: parent of each node per batch entry, -1 = root
    metric: str = "tflops"
    overrides: tuple[tuple[str, Any], ...] = ()  # spec fields given on the command line (block sizes ...)
    # Score switches (docs/scores.md): window (left, right) with None for an unbounded side, the softcap, and
    # whether ALiBi slopes / attention sinks are used (their values are drawn in make_inputs).
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    alibi: bool = False
    sinks: bool = False
    hopper: bool = True  # False: keep the Triton forward on sm_90 (a baseline row for the switch rows)
    peers: bool = True  # False: only fagen runs (a baseline row of fagen itself)
    # Serving (docs/serving.md): V's head dim (None: head_dim), an fp8 KV cache for decode rows (its scales are
    # drawn per KV head in make_inputs), and decode's split rule: None the kernel's default (DECODE_BATCH_INVARIANT), True
    # asks for it, False for the batch-dependent split rule.
    head_dim_v: int | None = None
    kv_dtype: str | None = None
    batch_invariant: bool | None = None
    # MLA's absorbed decode (docs/serving.md, "MLA absorbed decode"): k is one latent cache head_dim wide, V its first
    # head_dim_v columns (v=None in the call); an fp8 latent has one scale a KV head (k_scale only).
    shared_kv: bool = False
    # A paged KV cache (vLLM's layout [num_pages, page_size, Hkv, D], its pages in a random order; make_inputs builds
    # it beside the dense k, v the reference reads): the page size, or None for a dense cache. Decode rows only.
    page_size: int | None = None

    def __post_init__(self):
        put = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass
        put("mask", Mask(self.mask))
        put("dtype", DType(self.dtype))
        put("direction", Direction(self.direction))
        for name in ("seqlens_q", "seqlens_k"):
            if getattr(self, name) is not None:
                put(name, tuple(int(x) for x in getattr(self, name)))
        if self.parents is not None:
            put("parents", tuple(tuple(int(x) for x in p) for p in self.parents))
        put("overrides", tuple((str(k), v) for k, v in self.overrides))
        if self.head_dim_v is None:
            put("head_dim_v", self.head_dim)
        if self.window is not None:
            if len(self.window) != 2 or any(w is not None and (isinstance(w, bool) or int(w) != w or w < 0)
                                            for w in self.window):
                raise ValueError(f"case {self.name}: window must be (left, right), ints >= 0 or None, "
                                 f"got {self.window!r}")
            put("window", tuple(None if w is None else int(w) for w in self.window))
        if self.softcap is not None:
            if not self.softcap > 0:
                raise ValueError(f"case {self.name}: softcap must be positive, got {self.softcap!r}")
            put("softcap", float(self.softcap))
        if self.metric not in METRICS:
            raise ValueError(f"case {self.name}: metric must be one of {METRICS}, got {self.metric!r}")
        if self.heads_kv < 1 or self.heads_q % self.heads_kv:
            raise ValueError(f"case {self.name}: {self.heads_q} query heads are not a multiple of "
                             f"{self.heads_kv} KV heads")
        if self.mask.padded and (self.seqlens_q is None or self.seqlens_k is None):
            raise ValueError(f"case {self.name}: mask {self.mask} needs seqlens_q and seqlens_k")
        if self.mask is Mask.TREE and (self.parents is None or self.seq_k < self.seq_q):
            raise ValueError(f"case {self.name}: a tree case needs parents and seq_k >= seq_q")
        if self.page_size is not None and (self.page_size < 1 or self.page_size & (self.page_size - 1)
                                           or self.seq_k % self.page_size or self.mask.padded
                                           or not prefers_decode(self.seq_q, self.seq_k)):
            raise ValueError(f"case {self.name}: page_size must be a power of two dividing seq_k, in an unpadded "
                             f"decode case, got {self.page_size!r}")
        if self.shared_kv and not (self.head_dim_v < self.head_dim and prefers_decode(self.seq_q, self.seq_k)):
            raise ValueError(f"case {self.name}: shared_kv is a decode case with head_dim_v < head_dim")

    @property
    def gqa(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def switches(self) -> tuple[str, ...]:
        """The score switches this case uses, in the spec's order."""
        return tuple(name for name in SCORE_SWITCHES if getattr(self, name) not in (None, False))  # fields by switch

    @property
    def decode(self) -> bool:
        """A decode-shaped case: the same rule fagen.attention uses to pick the decode kernel."""
        return prefers_decode(self.seq_q, self.seq_k)

    def spec(self, device: str | torch.device | None = None, hopper: bool = True) -> tuple[KernelSpec, str]:
        """fagen's spec for this case, and a note on which kernel serves it.

        With no spec field pinned (no overrides) and `hopper`, a prefill case on an sm_90 device (`device`, default:
        the current CUDA device when there is one) takes the Gluon forward or backward where it wins ([Note] Hopper
        selection in fagen/runtime/hopper.py; FAGEN_HOPPER=0 turns it off). The tuner passes hopper=False.
        """
        kind, note = Kind.PREFILL, ""
        if self.decode and self.direction is Direction.FWD:
            kind, note = Kind.DECODE, "decode kernel"
        fields = dict(head_dim=self.head_dim, mask=self.mask, gqa=self.gqa, dtype=self.dtype,
                      direction=self.direction, kind=kind, **{name: True for name in self.switches})
        if self.head_dim_v != self.head_dim:
            fields["head_dim_v"] = self.head_dim_v
        if self.kv_dtype is not None:
            fields["kv_dtype"] = self.kv_dtype
        if self.shared_kv:
            fields["shared_kv"] = True
        if self.page_size is not None:
            fields["layout"] = "paged"
        if self.dtype is DType.FP8_E4M3:  # the fp8 forward is the gluon backend's alone (README "fp8 forward")
            fields["backend"] = "gluon"
        fields.update(self.overrides)  # explicit flags win
        if fields["kind"] != kind:
            note = f"{fields['kind']} kernel (as asked)"
        spec = KernelSpec(**fields)
        if not self.hopper and not note:
            note = "Triton forward (no Hopper selection)"
        if hopper and self.hopper and not self.overrides and spec.shared_kv and self.batch * self.heads_q * \
                self.seq_q * self.seq_k >= hopper_rule.LATENT_MIN_WORK:  # as fagen.attention's latent decode
            gluon = hopper_rule.latent_decode_spec(spec, torch.device(device or ("cuda" if torch.cuda.is_available()
                                                                                 else "cpu")),
                                                   self.heads_q * self.seq_q)
            if gluon is not None and self.heads_kv == 1:
                return gluon, f"gluon MLA decode ({hopper_rule.ENV}=0 for the Triton one)"
        if hopper and self.hopper and not self.overrides and spec.kind is Kind.PREFILL:  # hopper_rule decides
            if device is None:  # (score switches included); with gradients the gluon backward's rule
                device = "cuda" if torch.cuda.is_available() else "cpu"
            bwd = spec.direction is Direction.BWD
            gluon = (hopper_rule.backward_spec if bwd else hopper_rule.forward_spec)(spec, torch.device(device))
            if gluon is not None:
                return gluon, (f"gluon Hopper {'backward, deterministic' if bwd else 'forward'} ({hopper_rule.ENV}=0 "
                               "for the Triton one)")
        return spec, note

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(mask=self.mask.value, dtype=self.dtype.value, direction=self.direction.value,
                 overrides=[list(o) for o in self.overrides], window=None if self.window is None else list(self.window))
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchCase:
        if d.get("window") is not None:
            d = {**d, "window": tuple(d["window"])}
        if d.get("overrides"):  # JSON made the spec fields' tuples lists (mod_tensors (): a worker's spec unhashable)
            d = {**d, "overrides": tuple((k, _tuples(v)) for k, v in d["overrides"])}
        return cls(**d)


def _tuples(v: Any) -> Any:
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def causal_pairs(len_q: int, len_k: int) -> int:
    """Visible (query, key) pairs of a bottom-right causal mask: query i sees keys j <= i + len_k - len_q."""
    return window_pairs(len_q, len_k, None, 0)


def window_pairs(len_q: int, len_k: int, left: int | None, right: int | None) -> int:
    """Visible (query, key) pairs of one sequence when query i (aligned: a = i + len_k - len_q) sees the keys
    a - left <= j <= a + right of 0 <= j < len_k; None is an unbounded side (causal is right = 0)."""
    if len_q <= 0 or len_k <= 0:
        return 0
    a = torch.arange(len_q, dtype=torch.int64) + (len_k - len_q)
    lo = a - left if left is not None else torch.zeros_like(a)
    hi = a + right if right is not None else torch.full_like(a, len_k - 1)
    return int((hi.clamp(max=len_k - 1) - lo.clamp(min=0) + 1).clamp(min=0).sum())


def _sides(case: BenchCase) -> tuple[int | None, int | None]:
    """(left, right) bounds of the case's mask and window together (causal bounds the right side at 0)."""
    left, right = case.window if case.window is not None else (None, None)
    if case.mask.causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def tree_depths(parents: tuple[int, ...]) -> list[int]:
    """Ancestors-or-self count of each node (parents come before their children)."""
    depth: list[int] = []
    for i, p in enumerate(parents):
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


def visible_pairs(case: BenchCase) -> int:
    """Visible (query, key) pairs of one head summed over the batch: the work a mask leaves."""
    b, sq, sk = case.batch, case.seq_q, case.seq_k
    if case.mask is Mask.TREE:
        prefix = sk - sq  # tree: every node sees the prefix, then its ancestors and itself
        if case.window is None:
            return sum(sq * prefix + sum(tree_depths(p)) for p in case.parents)
        # with a window (aligned by the prefix length): the prefix keys and the ancestors inside it
        return sum(window_pairs(sq, sk, *case.window) - window_pairs(sq, sq, *case.window)  # prefix part
                   + sum(_window_ancestors(p, *case.window)) for p in case.parents)
    if case.mask.padded:
        return sum(window_pairs(lq, lk, *_sides(case)) for lq, lk in zip(case.seqlens_q, case.seqlens_k))
    return b * window_pairs(sq, sk, *_sides(case))


def _window_ancestors(parents: tuple[int, ...], left: int | None, right: int | None) -> list[int]:
    """Per node, its ancestors-or-self at tree positions p with i - left <= p <= i + right (ancestors come first,
    so p <= i and only `left` binds)."""
    out = []
    for i in range(len(parents)):
        n, p = 0, i
        while p >= 0:
            n += left is None or p >= i - left
            p = parents[p]
        out.append(n)
    return out


def fwd_flops(case: BenchCase) -> float:
    """Forward FLOPs: 4 * D per visible pair and head (QK^T and PV, 2 FLOPs per multiply-add); with a V head dim
    Dv unlike D, 2 * (D + Dv).

    Unmasked and causal cases follow the peers' convention (4*B*H*Sq*Sk*D, halved for causal with Sq == Sk);
    padding, tree and windows count only the visible ("useful", visited) pairs.
    """
    if case.mask is Mask.CAUSAL and case.seq_q == case.seq_k and case.window is None:
        pairs = case.batch * case.seq_q * case.seq_k / 2
    else:
        pairs = visible_pairs(case)
    return 2.0 * (case.head_dim + case.head_dim_v) * case.heads_q * pairs


def flops(case: BenchCase) -> float:
    """FLOPs of what is timed: the forward, or the backward alone (2.5 x forward)."""
    return fwd_flops(case) * (BWD_FACTOR if case.direction is Direction.BWD else 1.0)


def kv_bytes(case: BenchCase) -> int:
    """Bytes of K and V a decode step must read: the valid keys of every KV head, once, at the cache's element size
    (1 for an fp8 cache: the bytes actually read)."""
    keys = sum(case.seqlens_k) if case.mask.padded else case.batch * case.seq_k
    size = 1 if case.kv_dtype is not None else case.dtype.itemsize
    if case.shared_kv:  # one latent row a key, read once for K and V
        return keys * case.heads_kv * case.head_dim * size
    return keys * case.heads_kv * (case.head_dim + case.head_dim_v) * size


def random_lengths(count: int, limit: int, seed: int) -> tuple[int, ...]:
    """`count` lengths drawn uniformly from [1, limit], reproducibly."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(int(x) for x in torch.randint(1, limit + 1, (count,), generator=gen))


def random_tree(batch: int, nodes: int, seed: int) -> tuple[tuple[int, ...], ...]:
    """Random token trees in tree order: node i's parent is uniform over the earlier nodes (node 0 is a root)."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(tuple(-1 if i == 0 else int(torch.randint(0, i, (1,), generator=gen)) for i in range(nodes))
                 for _ in range(batch))


def make_case(name: str, *, head_dim: int, mask: Mask | str, batch: int, heads_q: int, heads_kv: int,
              seq_q: int, seq_k: int, seed: int = 0, **kw) -> BenchCase:
    """A case whose padding lengths or tree are drawn from `seed` when the mask needs them."""
    mask = Mask(mask)
    if mask.padded and "seqlens_q" not in kw:
        if seq_q == seq_k:  # padded self-attention: a sequence has one length for its queries and its keys
            kw.update(seqlens_q=random_lengths(batch, seq_q, seed), seqlens_k=random_lengths(batch, seq_k, seed))
        else:  # decode against a cache, or cross lengths: drawn apart
            kw.update(seqlens_q=random_lengths(batch, seq_q, seed), seqlens_k=random_lengths(batch, seq_k, seed + 1))
    if mask is Mask.TREE and "parents" not in kw:
        kw["parents"] = random_tree(batch, seq_q, seed)
    if "metric" not in kw and prefers_decode(seq_q, seq_k):
        kw["metric"] = "gbs"
    return BenchCase(name=name, head_dim=head_dim, mask=mask, batch=batch, heads_q=heads_q, heads_kv=heads_kv,
                     seq_q=seq_q, seq_k=seq_k, **kw)


# Targets from issues 5 and 7 (H100, bf16): the table marks each row met or not.
TARGETS = {
    "fwd-d128-full-s16k": 630, "fwd-d128-causal-s16k": 560, "fwd-d64-causal-s16k": 440,
    "bwd-d128-causal-s16k": 420, "fwd-gqa-d128-causal-s4k": 550, "fwd-causalpad-d128-s8k": 450,
    "fwd-tree-d128-p16k-n128": 0.25, "decode-d128-kv8k-b32": 2800, "decode-d128-kv32k-b8": 2800,
}


def standard_suite(quick: bool = False) -> list[BenchCase]:
    """The table of issue 5 (bf16, hidden 2048 = heads x head_dim, batch x seq = 16k) plus issue 7's decode.

    `quick` shrinks every shape (sequences / 64, heads / 4, batch <= 2) for a smoke run; names stay.
    """
    s = (lambda n: max(1, n // 64)) if quick else (lambda n: n)
    h = (lambda n: max(1, n // 4)) if quick else (lambda n: n)
    b = (lambda n: min(n, 2)) if quick else (lambda n: n)
    nodes = 24 if quick else 128
    return [
        make_case("fwd-d128-full-s16k", head_dim=128, mask="none", batch=1, heads_q=h(16), heads_kv=h(16),
                  seq_q=s(16384), seq_k=s(16384)),
        make_case("fwd-d128-causal-s16k", head_dim=128, mask="causal", batch=1, heads_q=h(16), heads_kv=h(16),
                  seq_q=s(16384), seq_k=s(16384)),
        make_case("fwd-d64-causal-s16k", head_dim=64, mask="causal", batch=1, heads_q=h(32), heads_kv=h(32),
                  seq_q=s(16384), seq_k=s(16384)),
        make_case("bwd-d128-causal-s16k", head_dim=128, mask="causal", batch=1, heads_q=h(16), heads_kv=h(16),
                  seq_q=s(16384), seq_k=s(16384), direction="bwd"),
        make_case("fwd-gqa-d128-causal-s4k", head_dim=128, mask="causal", batch=b(4), heads_q=h(32),
                  heads_kv=h(8), seq_q=s(4096), seq_k=s(4096)),
        make_case("fwd-causalpad-d128-s8k", head_dim=128, mask="causal+padding", batch=b(8), heads_q=h(16),
                  heads_kv=h(16), seq_q=s(8192), seq_k=s(8192), seed=8192),
        make_case("fwd-tree-d128-p16k-n128", head_dim=128, mask="tree", batch=b(4), heads_q=h(32), heads_kv=h(8),
                  seq_q=nodes, seq_k=s(16384) + nodes, seed=128, metric="ms"),
        make_case("decode-d128-kv8k-b32", head_dim=128, mask="none", batch=b(32), heads_q=h(32), heads_kv=h(8),
                  seq_q=1, seq_k=s(8192)),
        make_case("decode-d128-kv32k-b8", head_dim=128, mask="none", batch=b(8), heads_q=h(32), heads_kv=h(8),
                  seq_q=1, seq_k=s(32768)),
        *score_rows(quick),
        *backward_rows(quick),
        *(make_case(f"fwd-fp8-d128-{name}-s16k", head_dim=128, mask=mask, batch=1, heads_q=h(16), heads_kv=h(16),
                    seq_q=s(16384), seq_k=s(16384), dtype="fp8_e4m3", peers=False)  # issue 28's fp8 forward: fagen
          for name, mask in (("causal", "causal"), ("full", "none"))),              # and cudnn-fp8 (SDPA takes no fp8)
    ]


def backward_rows(quick: bool = False) -> list[BenchCase]:
    """Issue 28's backward rows beside bwd-d128-causal-s16k: non-causal, GQA 32/8 and d64, each against cuDNN
    (RELATIVE_TARGETS: >= 0.95x in the deterministic mode, the one fagen ships)."""
    s = (lambda n: max(1, n // 64)) if quick else (lambda n: n)
    h = (lambda n: max(1, n // 4)) if quick else (lambda n: n)
    b = (lambda n: min(n, 2)) if quick else (lambda n: n)
    return [
        make_case("bwd-d128-full-s16k", head_dim=128, mask="none", batch=1, heads_q=h(16), heads_kv=h(16),
                  seq_q=s(16384), seq_k=s(16384), direction="bwd"),
        make_case("bwd-gqa-d128-causal-s4k", head_dim=128, mask="causal", batch=b(4), heads_q=h(32),
                  heads_kv=h(8), seq_q=s(4096), seq_k=s(4096), direction="bwd"),
        make_case("bwd-d64-causal-s16k", head_dim=64, mask="causal", batch=1, heads_q=h(32), heads_kv=h(32),
                  seq_q=s(16384), seq_k=s(16384), direction="bwd"),
    ]


# [Note] Score-switch rows (issue 15)
# A sliding window is scored on the keys it visits (fwd_flops counts visible pairs), so its TF/s is comparable
# with fagen's own dense causal at the same length: the baseline row fwd-d128-causal-s32k (fagen only). The
# softcap row is compared with fwd-d128-causal-s16k. RELATIVE_TARGETS holds these ratios: (impl or case, bound)
# means fagen's number on the row over that peer's on the same row, or over fagen's on that case, is >= bound.
# The gpt-oss row (d64, window 128, sinks, GQA 64/8) has peers only: FlexAttention (its sinks through the lse it
# returns) and SDPA with a float mask (its sinks as an extra key; fagen/bench/peers.py).
def copy_relative(case: BenchCase) -> bool:
    """A row whose target is a share of the copy of its bytes (RELATIVE_TARGETS naming "copy"): it runs the copy
    reference ([Note] Copy reference in fagen/bench/impls.py) and is timed as [Note] L2 flush in timing.py says."""
    return any(ref == "copy" for ref, _ in RELATIVE_TARGETS.get(case.name, ()))


RELATIVE_TARGETS = {
    "fwd-d128-win4k-s32k": (("flex", 1.3), ("fwd-d128-causal-s32k", 0.9)),
    "fwd-d128-softcap-causal-s16k": (("fwd-d128-causal-s16k", 0.9),),
    # Issue 28: the backward against cuDNN, >= 0.95x in the deterministic mode (the one fagen ships).
    **{case: (("sdpa-cudnn", 0.95),) for case in ("bwd-d128-causal-s16k", "bwd-d128-full-s16k",
                                                   "bwd-gqa-d128-causal-s4k", "bwd-d64-causal-s16k")},
    # Issue 28: the fp8 forward rows against fagen's own bf16 forward of the same shape.
    **{f"fwd-fp8-d128-{m}-s16k": ((f"fwd-d128-{m}-s16k", 1.5), ("cudnn-fp8", 1.0)) for m in ("causal", "full")},
    # Issue 27: an fp8 KV cache's decode at >= 95% of the copy of its bytes ([Note] Copy reference in impls.py).
    **{case: (("copy", 0.95),) for case in ("decode-d128-kv8k-b32-fp8", "decode-d128-kv32k-b8-fp8",
                                            "decode-d128-kv8k-b32-fp8-paged16")},
    # Issue 27: MLA's absorbed decode at the memory-bound shapes (Hq 16, Sq 1), >= 90% of copy with a bf16 latent
    # cache and, as every fp8 cache, >= 95% (counted in the bytes read) with an e4m3 one (twenty-third session).
    **{f"decode-mla-absorbed-h16-{kv}{tag}": (("copy", bound),) for kv in ("kv4k-b128", "kv32k-b32")
       for tag, bound in (("", 0.9), ("-fp8", 0.95))},
}
# Issue 28: the backward's faster mode (deterministic=False: the fagen-nondet column) against cuDNN, >= 1.0x for the
# causal, full and GQA 32/8 rows, beside the deterministic mode's >= 0.95x (RELATIVE_TARGETS). (impl, peer, bound):
# that impl's number on the row over the peer's; the table shows it where the run has the impl.
MODE_TARGETS = {case: (("fagen-nondet", "sdpa-cudnn", 1.0),)
                for case in ("bwd-d128-causal-s16k", "bwd-d128-full-s16k", "bwd-gqa-d128-causal-s4k")}
WINDOW = 4096  # the usual "window 4096": a query sees itself and the 4095 keys before it
SOFTCAP = 50.0  # Gemma 2's attention logit cap
GPT_OSS_WINDOW = 128


def score_rows(quick: bool = False, baselines: bool = False) -> list[BenchCase]:
    """The rows of issue 15 (bf16 forward): causal sliding window 4096 at 32k, softcap 50 at 16k, and a gpt-oss
    layer (d64, sinks, causal window 128, GQA 64/8, 8k). With `baselines`, fagen-only rows to compare with:
    the dense causal rows they are measured against, and the same on the Triton forward (no Hopper selection).
    """
    s = (lambda n: max(1, n // 64)) if quick else (lambda n: n)
    h = (lambda n: max(1, n // 4)) if quick else (lambda n: n)
    win, oss = (s(WINDOW), 16) if quick else (WINDOW, GPT_OSS_WINDOW)
    d128 = dict(head_dim=128, mask="causal", batch=1, heads_q=h(16), heads_kv=h(16))
    rows = [
        make_case("fwd-d128-causal-s32k", **d128, seq_q=s(32768), seq_k=s(32768), peers=False),
        make_case("fwd-d128-win4k-s32k", **d128, seq_q=s(32768), seq_k=s(32768), window=(win - 1, 0)),
        make_case("fwd-d128-softcap-causal-s16k", **d128, seq_q=s(16384), seq_k=s(16384), softcap=SOFTCAP),
        make_case("fwd-gptoss-d64-win128-sink-s8k", head_dim=64, mask="causal", batch=1, heads_q=h(64),
                  heads_kv=h(8), seq_q=s(8192), seq_k=s(8192), window=(oss - 1, 0), sinks=True),
    ]
    if baselines:
        rows += [
            make_case("fwd-d128-causal-s16k", **d128, seq_q=s(16384), seq_k=s(16384), peers=False),
            make_case("fwd-d128-causal-s16k-triton", **d128, seq_q=s(16384), seq_k=s(16384), peers=False,
                      hopper=False),
            make_case("fwd-d128-causal-s32k-triton", **d128, seq_q=s(32768), seq_k=s(32768), peers=False,
                      hopper=False),
        ]
    return rows


def scores_suite(quick: bool = False) -> list[BenchCase]:
    """`--suite scores`: the switch rows of the standard suite with their fagen-only baselines."""
    return score_rows(quick, baselines=True)


SUITES = {"standard": standard_suite, "scores": scores_suite}  # and "serving": fagen/bench/serving.py


def describe_case(c: BenchCase) -> str:
    """Shapes in one short line: ``fwd causal d128 b1 h16 sq16384 sk16384 bf16``."""
    heads = f"h{c.heads_q}" if c.gqa == 1 else f"h{c.heads_q}/{c.heads_kv}"
    side = lambda w: "inf" if w is None else str(w)  # noqa: E731
    extra = "".join([f" window {side(c.window[0])}/{side(c.window[1])}" if c.window else "",
                     f" softcap {c.softcap:g}" if c.softcap is not None else "", " alibi" * c.alibi,
                     " sinks" * c.sinks, " triton" * (not c.hopper),
                     f" kv {c.kv_dtype}" if c.kv_dtype else "", f" paged{c.page_size}" if c.page_size else "",
                     " latent" * c.shared_kv, " batch-invariant" * (c.batch_invariant is True),
                     " split-rule" * (c.batch_invariant is False)])
    dv = "" if c.head_dim_v == c.head_dim else f"v{c.head_dim_v}"
    return f"{c.direction} {c.mask} d{c.head_dim}{dv} b{c.batch} {heads} sq{c.seq_q} sk{c.seq_k} {c.dtype}{extra}"


HIDDEN = 2048  # heads x head_dim of the default shapes, as in the peers' table
TOKENS = 16384  # batch x seq of the default shapes


def case_from_spec(spec: KernelSpec, *, batch: int | None = None, heads: int | None = None,
                   seq_q: int | None = None, seq_k: int | None = None, overrides=(), seed: int = 0) -> BenchCase:
    """A case for one spec; unset shapes follow the peers' table (hidden 2048, batch x seq = 16k)."""
    decode, tree = spec.kind is Kind.DECODE, spec.mask is Mask.TREE
    if seq_q is None:
        seq_q = 1 if decode else 128 if tree else 4096
    if seq_k is None:
        seq_k = 8192 if decode else seq_q + 4096 if tree else seq_q
    if heads is None:
        heads = max(spec.gqa, HIDDEN // spec.head_dim // spec.gqa * spec.gqa)
    if heads < 1 or heads % spec.gqa:
        raise ValueError(f"--heads {heads} must be a positive multiple of gqa {spec.gqa}")
    if batch is None:
        batch = 8 if decode else 4 if tree else max(1, TOKENS // max(1, seq_q))
    for name, value in (("batch", batch), ("seq-q", seq_q), ("seq-k", seq_k)):
        if value < 1:
            raise ValueError(f"--{name} must be at least 1, got {value}")
    if tree and seq_k < seq_q:
        raise ValueError(f"a tree case needs --seq-k >= --seq-q (the {seq_q} nodes are the last keys), got {seq_k}")
    kv = f"/{heads // spec.gqa}" if spec.gqa > 1 else ""
    name = f"{spec.direction}-{tables.MASK_SHORT[spec.mask]}-d{spec.head_dim}-b{batch}-h{heads}{kv}-s{seq_q}x{seq_k}"
    metric = "gbs" if decode or prefers_decode(seq_q, seq_k) else "ms" if tree else "tflops"
    return make_case(name, head_dim=spec.head_dim, mask=spec.mask, batch=batch, heads_q=heads,
                     heads_kv=heads // spec.gqa, seq_q=seq_q, seq_k=seq_k, seed=seed, dtype=spec.dtype,
                     direction=spec.direction, overrides=tuple(overrides), metric=metric)
