"""Hypothesis strategies that draw only valid specs and problems, and the inputs a problem stands for."""

from __future__ import annotations

import dataclasses
import json

import torch
from hypothesis import strategies as st

from fagen.spec.axes import DType, Direction, Kind, Mask
from fagen.spec import KernelSpec
from fagen.spec.axes import DECODE_MAX_SEQ_Q
from fagen.spec.tables import TORCH_DTYPE, TORCH_KV_DTYPE

# Shape scales: "cpu" keeps the interpreter fast; "gpu" is realistic (up to 4096 x 4096, D 128).
SCALES = {
    "cpu": dict(batch=2, heads_kv=2, seq=(0, 1, 2, 15, 16, 17, 31, 33, 47, 64, 70), max_seq=72, tree=24),
    "gpu": dict(batch=2, heads_kv=2, seq=(0, 1, 63, 64, 127, 1000, 1024, 2047, 2049, 4096), max_seq=4096, tree=160),
}
# Backward on a GPU: the float64 autograd reference holds several [B, Hq, Sq, Sk] tensors, so big problems keep
# B * Hkv * Sq * Sk <= max_elems (one batch entry and KV head at 4096 x 4096).
SCALES["gpu-bwd"] = dict(SCALES["gpu"], batch=2, heads_kv=2, max_elems=2**24)
CPU_HEAD_DIMS = (16, 24, 40, 64)


def scale_config(spec: KernelSpec, scale: str) -> dict:
    """SCALES[scale]; on the CPU, lengths stretch with a big-block spec so problems still span several blocks."""
    cfg = SCALES[scale]
    small, big = sorted((spec.block_m, spec.block_n))
    if scale != "cpu":
        return cfg
    cfg = dict(cfg, tree=big + 8)  # a tree that spills into a second query block
    if big <= 32:
        return cfg
    # Tails on both sides of each block edge, two key blocks and a ragged third; the interpreter stays ~1 s.
    seq = (0, 1, 2, small - 1, small + 1, big - 1, big + 1, big + small + 3, 2 * big + 5)
    return dict(cfg, seq=tuple(sorted(set(seq))), max_seq=2 * big + 8)
GPU_HEAD_DIMS = (64, 80, 128)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One attention problem: shapes, per-sequence lengths or a tree, and the seed of its data.

    Plain ints and tuples only, so a failing problem prints as JSON a person can replay.
    """

    batch: int
    heads_kv: int
    seq_q: int
    seq_k: int
    seqlens_q: tuple[int, ...] | None = None
    seqlens_k: tuple[int, ...] | None = None
    parents: tuple[tuple[int, ...], ...] | None = None  # tree: parent index per node, -1 for a root
    magnitude: float = 1.0  # multiplies q: large values give large-magnitude logits
    scale: float | None = None  # softmax scale passed to the kernel; None means the default 1/sqrt(D)
    poison: bool = False  # fill padding with NaN: it must never reach a valid output
    seed: int = 0
    # Score switches (only for specs that have them): window (left, right), None for an unbounded side; the cap;
    # ALiBi slopes and sink logits drawn from the seed (fp32 [Hq]).
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    alibi: bool = False
    sinks: bool = False
    # fp8 KV cache specs (kv_dtype): the scales' form, "tensor" (one float each for k and v) or "head" (float32
    # [Hkv]); their values come from the seed. None for other specs.
    kv_scales: str | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Problem:
        d = json.loads(text)
        for key in ("seqlens_q", "seqlens_k"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        if d.get("parents") is not None:
            d["parents"] = tuple(tuple(p) for p in d["parents"])
        if d.get("window") is not None:
            d["window"] = tuple(d["window"])
        return cls(**d)

    def score_kwargs(self, heads: int, device: str = "cpu") -> dict:
        """window / softcap / alibi_slopes / sinks kwargs; slopes and sinks come from their own stream of the seed,
        so the q, k, v of a problem do not depend on its switches."""
        gen = torch.Generator().manual_seed(self.seed ^ 0xA11B1)
        kwargs: dict = {}
        if self.window is not None:
            kwargs["window"] = self.window
        if self.softcap is not None:
            kwargs["softcap"] = self.softcap
        if self.alibi:  # positive, up to 0.5 per key: strong enough to move every row
            kwargs["alibi_slopes"] = (torch.rand(heads, generator=gen) * 0.5).to(device)
        if self.sinks:  # from well below to well above a typical row's lse
            kwargs["sinks"] = (torch.randn(heads, generator=gen) * 3.0).to(device)
        return kwargs

    def kv_scale_kwargs(self, device: str = "cpu") -> dict:
        """k_scale / v_scale of an fp8 cache: from 1/8 to 8 (log-uniform), so that a kernel that drops a scale
        or applies one to the wrong tensor or head is off by far more than any tolerance."""
        if self.kv_scales is None:
            return {}
        gen = torch.Generator().manual_seed(self.seed ^ 0xF8)
        draw = lambda n: torch.exp2(torch.rand(n, generator=gen) * 6.0 - 3.0)  # noqa: E731
        if self.kv_scales == "tensor":
            return {"k_scale": float(draw(1)), "v_scale": float(draw(1))}
        return {"k_scale": draw(self.heads_kv).to(device), "v_scale": draw(self.heads_kv).to(device)}

    def inputs(self, spec: KernelSpec, device: str = "cpu") -> tuple[tuple[torch.Tensor, ...], dict]:
        """(q, k, v), kwargs: fresh normal data from this problem's seed, in the spec's dtype."""
        gen = torch.Generator().manual_seed(self.seed)
        dtype = getattr(torch, TORCH_DTYPE[spec.dtype])
        d, hq = spec.head_dim, self.heads_kv * spec.gqa

        def normal(*shape):
            return torch.randn(*shape, generator=gen, dtype=torch.float32)

        q = normal(self.batch, hq, self.seq_q, d) * self.magnitude
        k = normal(self.batch, self.heads_kv, self.seq_k, d)
        v = normal(self.batch, self.heads_kv, self.seq_k, spec.head_dim_v)
        kwargs: dict = {} if self.scale is None else {"scale": self.scale}
        if self.seqlens_q is not None:
            kwargs["seqlens_q"] = torch.tensor(self.seqlens_q, dtype=torch.int32, device=device)
            kwargs["seqlens_k"] = torch.tensor(self.seqlens_k, dtype=torch.int32, device=device)
            if self.poison:
                for b, (lq, lk) in enumerate(zip(self.seqlens_q, self.seqlens_k)):
                    q[b, :, lq:] = float("nan")
                    k[b, :, lk:] = float("nan")
                    v[b, :, lk:] = float("nan")
        if self.parents is not None:
            kwargs["tree_mask"] = torch.tensor(self.parents, dtype=torch.int32, device=device)
        kwargs.update(self.score_kwargs(hq, device))
        if spec.modded:  # captured values from the seed; the reference reads the spec's mods off them
            from fagen.verify.mods_eval import mod_values

            kwargs["mods"] = mod_values(spec, self.seed, max(self.seq_q, self.seq_k), hq, self.batch, device)
            if spec.kind is Kind.DECODE:  # decode mods see q_idx = i + lk - lq (README "User mods"); no block mask
                kwargs["mods"].positions = "absolute"
            elif spec.mask_mod is not None and self.seed % 3:  # two problems in three skip blocks by a block mask
                from fagen.mods.ir import names_in
                from fagen.mods.text import parse
                from fagen.runtime.block_mask import from_text

                used_s, used_t = names_in(parse(spec.mask_mod, "mask_mod", spec.mod_tensors, spec.mod_scalars))
                tensors = tuple(t for t in spec.mod_tensors if t[0] in used_t)
                scalars = tuple(s for s in spec.mod_scalars if s[0] in used_s)
                kwargs["block_mask"] = from_text(spec.mask_mod, tensors, scalars, kwargs["mods"], self.batch, hq,
                                                 self.seq_q, self.seq_k, device=device, block_size=16)
        if spec.kv_dtype is not None:  # the cache in fp8 (its values times the scales are what attention sees)
            kv_dtype = getattr(torch, TORCH_KV_DTYPE[spec.kv_dtype])
            kwargs.update(self.kv_scale_kwargs(device))
            return (q.to(dtype).to(device), k.to(kv_dtype).to(device), v.to(kv_dtype).to(device)), kwargs
        return tuple(t.to(dtype).to(device) for t in (q, k, v)), kwargs


def specs(masks=tuple(Mask), dtypes=DType.portable(), directions=(Direction.FWD,), head_dims=CPU_HEAD_DIMS,
          gqas=(1, 2, 4), blocks=(16, 32), kinds=(Kind.PREFILL,), window=(False,), softcap=(False,),
          alibi=(False,), sinks=(False,)) -> st.SearchStrategy[KernelSpec]:
    """Valid specs. On the CPU keep blocks small so short sequences still span several blocks.

    blocks=None keeps the spec's default (tuned) block sizes: on a GPU each new spec is a compile.
    window, softcap, alibi, sinks: the values each score switch may take.
    """
    block = st.none() if blocks is None else st.sampled_from(blocks)
    return st.builds(
        KernelSpec,
        head_dim=st.sampled_from(head_dims),
        mask=st.sampled_from(list(masks)),
        gqa=st.sampled_from(gqas),
        dtype=st.sampled_from(list(dtypes)),
        direction=st.sampled_from(list(directions)),
        block_m=block,
        block_n=block,
        kind=st.sampled_from(list(kinds)),
        window=st.sampled_from(window),
        softcap=st.sampled_from(softcap),
        alibi=st.sampled_from(alibi),
        sinks=st.sampled_from(sinks),
    )


@st.composite
def problems(draw, spec: KernelSpec, scale: str = "cpu") -> Problem:
    """Problems for `spec`: lengths that are not multiples of the blocks, Sq != Sk, lengths 0 and 1, trees."""
    cfg = scale_config(spec, scale)
    seq = st.one_of(st.sampled_from(cfg["seq"]), st.integers(0, cfg["max_seq"]))
    batch = draw(st.integers(1, cfg["batch"]))
    heads_kv = draw(st.integers(1, cfg["heads_kv"]))
    extra = {}
    if spec.mask is Mask.TREE:
        edges = [e for e in (1, spec.block_n - 1, spec.block_n + 1, spec.block_m + 1) if e <= cfg["tree"]]
        n = draw(st.one_of(st.integers(1, cfg["tree"]), st.sampled_from(edges)))  # nodes; edges: just past a block
        seq_q, seq_k = n, n + draw(st.one_of(st.just(0), seq))  # no prefix: the first key block is all tree
        # A root, the previous node (chains) or any earlier node: forests, deep chains and bushy trees.
        parent = lambda i: st.one_of(st.just(-1), st.just(i - 1), st.integers(-1, i - 1))  # noqa: E731
        extra["parents"] = tuple(tuple(draw(parent(i)) if i else -1 for i in range(n)) for _ in range(batch))
    else:
        seq_q = draw(seq)
        seq_k = draw(st.one_of(st.just(seq_q), seq))
    if spec.mask.padded:
        extra["seqlens_q"] = tuple(draw(st.integers(0, seq_q)) for _ in range(batch))
        extra["seqlens_k"] = tuple(draw(st.integers(0, seq_k)) for _ in range(batch))
        extra["poison"] = draw(st.booleans())
    if "max_elems" in cfg and batch * heads_kv * seq_q * seq_k > cfg["max_elems"]:
        batch, heads_kv = 1, 1
        extra = {key: (val[:1] if isinstance(val, tuple) else val) for key, val in extra.items()}
    extra.update(draw(score_switches(spec, max(seq_q, seq_k))))
    return Problem(batch=batch, heads_kv=heads_kv, seq_q=seq_q, seq_k=seq_k,
                   magnitude=draw(st.sampled_from((1.0, 1.0, 4.0, 16.0))),
                   scale=draw(st.sampled_from((None, None, 0.05, 0.3))),
                   seed=draw(st.integers(0, 2**31 - 1)), **extra)


@st.composite
def score_switches(draw, spec: KernelSpec, longest: int) -> dict:
    """Problem fields for the spec's score switches: windows from empty (0, 0) through one block to wider than
    the sequence and unbounded sides; caps that bite and caps that do not."""
    extra: dict = {}
    if spec.window:
        side = st.one_of(st.sampled_from((0, 1, spec.block_n - 1, spec.block_n, spec.block_m + 1)),
                         st.integers(0, longest + 2), st.none())
        extra["window"] = (draw(side), draw(side))
    if spec.softcap:
        extra["softcap"] = draw(st.sampled_from((0.5, 2.0, 5.0, 30.0)))
    extra["alibi"] = spec.alibi
    extra["sinks"] = spec.sinks
    return extra


# Decode: 1..DECODE_MAX_SEQ_Q queries against KV caches long enough to span several splits of several blocks.
DECODE_SCALES = {
    "cpu": dict(batch=2, heads_kv=2, seq_k=(0, 1, 2, 15, 16, 17, 63, 65, 97, 131), max_seq_k=160),
    "gpu": dict(batch=4, heads_kv=4, seq_k=(0, 1, 63, 64, 1000, 4097, 8191, 16384, 32769), max_seq_k=33000),
}


@st.composite
def decode_problems(draw, spec: KernelSpec, scale: str = "cpu") -> Problem:
    """Problems for a decode spec: Sq from 1 to 16, KV lengths 0 and 1 and not multiples of any block or split."""
    cfg = DECODE_SCALES[scale]
    batch = draw(st.integers(1, cfg["batch"]))
    seq_q = draw(st.integers(1, DECODE_MAX_SEQ_Q))
    cache = draw(st.one_of(st.sampled_from(cfg["seq_k"]), st.integers(0, cfg["max_seq_k"])))
    extra = {}
    if spec.mask is Mask.TREE:  # the queries are the last seq_q keys; `cache` keys come before them
        seq_k = seq_q + cache
        extra["parents"] = tuple(
            tuple(draw(st.integers(-1, i - 1)) if i else -1 for i in range(seq_q)) for _ in range(batch))
    else:
        seq_k = cache
    if spec.mask.padded:
        extra["seqlens_q"] = tuple(draw(st.integers(0, seq_q)) for _ in range(batch))
        edges = st.sampled_from(sorted({0, min(1, seq_k), seq_k}))  # empty, one key, full
        extra["seqlens_k"] = tuple(draw(st.one_of(edges, st.integers(0, seq_k))) for _ in range(batch))
        extra["poison"] = draw(st.booleans())
    extra.update(draw(score_switches(spec, seq_k)))
    if spec.kv_dtype is not None:
        extra["kv_scales"] = draw(st.sampled_from(("tensor", "head")))
    return Problem(batch=batch, heads_kv=draw(st.integers(1, cfg["heads_kv"])), seq_q=seq_q, seq_k=seq_k,
                   magnitude=draw(st.sampled_from((1.0, 1.0, 4.0, 16.0))),
                   seed=draw(st.integers(0, 2**31 - 1)), **extra)
