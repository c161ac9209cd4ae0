"""Verification of the varlen and paged layouts (README "Layouts"): random serving-shaped inputs, the float64
reference run on their gathered dense equivalent, and the checks.

Every case is drawn with Hypothesis from the semantics, not from the kernels: sequence lengths include 0 and 1 and
lengths that are not multiples of the block sizes; pages are shuffled, may be shared between sequences (a shared
prompt prefix), the last page of a sequence is partly filled, page sizes run from 1 to 256; every cache slot that no
sequence uses holds NaN, which must never reach an output.
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import strategies as st

from fagen.spec import tables
from fagen.spec.axes import Kind, Layout, Mask
from fagen.spec.kernel import KernelSpec
from fagen.verify import reference
from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare, compare_grad


@dataclasses.dataclass
class LayoutCase:
    """One drawn input set. lens_q/lens_k per sequence; pages: the block table rows (paged)."""

    lens_q: list[int]
    lens_k: list[int]
    heads_kv: int
    page_size: int = 0
    shared: bool = False  # paged: sequences after the first reuse its first pages (a shared prompt prefix)
    seed: int = 0
    parents: list[list[int]] | None = None  # tree decode: each sequence's draft tree (parent of node i < i, -1 root)

    @property
    def batch(self) -> int:
        return len(self.lens_q)


def cases(spec: KernelSpec, max_len: int = 40, max_batch: int = 4) -> st.SearchStrategy[LayoutCase]:
    """Input sets for a varlen or paged spec. Decode specs get one query count (1..16) for every sequence."""
    lens = st.one_of(st.sampled_from([0, 1]), st.integers(0, max_len))

    @st.composite
    def case(draw):
        batch = draw(st.integers(1, max_batch))
        if spec.kind is Kind.DECODE:
            sq = draw(st.integers(1, 16))
            lens_q = [sq] * batch
        else:
            lens_q = [draw(lens) for _ in range(batch)]
        lens_k = [draw(lens) for _ in range(batch)]
        parents = None
        if spec.mask is Mask.TREE:  # the Sq queries are the last Sq cached keys: a draft tree per sequence
            lens_k = [max(k, lens_q[0]) for k in lens_k]
            parents = [[draw(st.integers(-1, i - 1)) for i in range(lens_q[0])] for _ in range(batch)]
        if spec.mask.causal and spec.layout is Layout.PAGED:
            # chunked prefill / decode: the new queries are the last of the cached keys (rows may still be empty)
            lens_k = [max(k, q) if draw(st.booleans()) else k for q, k in zip(lens_q, lens_k)]
        page = draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 256])) if spec.layout is Layout.PAGED else 0
        return LayoutCase(lens_q, lens_k, heads_kv=draw(st.integers(1, 2)), page_size=page,
                          shared=spec.layout is Layout.PAGED and draw(st.booleans()),
                          seed=draw(st.integers(0, 2**31 - 1)), parents=parents)

    return case()


def cu_seqlens(lens: list[int], device) -> torch.Tensor:
    """int32 [B + 1] prefix sums of `lens` (the varlen layout's cu_seqlens)."""
    return torch.tensor([0] + list(torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()), dtype=torch.int32,
                        device=device)


@dataclasses.dataclass
class LayoutInputs:
    """The module's inputs for a case, and each sequence's dense q, k, v (what the reference sees)."""

    args: tuple
    kwargs: dict
    dense: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per sequence: q [Sq, Hq, D], k/v [Sk, Hkv, D]
    scores: dict  # the score switches' inputs (README "Score modifiers"), for the module and the reference alike
    mods: object = None  # a modded spec's captured values (fagen.verify.mods_eval.ModValues), in kwargs["mods"] too


def _scores(spec: KernelSpec, hq: int, gen: torch.Generator, device) -> dict:
    """Random values for the spec's score switches: window extents 0..24 (right 0 half the time), a cap 5..30,
    ALiBi slopes 0..0.5 and sink logits -2..2 per query head."""
    scores = {}
    ints = lambda hi: int(torch.randint(0, hi + 1, (1,), generator=gen))  # noqa: E731
    if spec.window:
        scores["window"] = (ints(24), 0 if ints(1) else ints(24))
    if spec.softcap:
        scores["softcap"] = 5.0 + 25.0 * float(torch.rand(1, generator=gen))
    if spec.alibi:
        scores["alibi_slopes"] = (0.5 * torch.rand(hq, generator=gen)).to(device)
    if spec.sinks:
        scores["sinks"] = (4.0 * torch.rand(hq, generator=gen) - 2.0).to(device)
    if spec.kv_dtype is not None:  # fp8 cache scales, per tensor or per KV head, 1/8 .. 8 (log-uniform)
        hkv = hq // spec.gqa
        draw = lambda n: torch.exp2(torch.rand(n, generator=gen) * 6.0 - 3.0)  # noqa: E731
        per_head = bool(torch.randint(0, 2, (1,), generator=gen))
        for name in ("k_scale", "v_scale"):
            scores[name] = draw(hkv).to(device) if per_head else float(draw(1))
    return scores


def make_inputs(spec: KernelSpec, case: LayoutCase, device) -> LayoutInputs:
    inputs = _make_inputs(spec, case, device)
    if spec.modded:  # captured values from the case's seed; the reference reads the spec's mods off them
        from fagen.verify.mods_eval import mod_values

        hq = inputs.args[0].shape[1]
        inputs.mods = mod_values(spec, case.seed, max(case.lens_q + case.lens_k + [1]), hq, case.batch, device)
        inputs.kwargs["mods"] = inputs.mods
    return inputs


def _make_inputs(spec: KernelSpec, case: LayoutCase, device) -> LayoutInputs:
    gen = torch.Generator().manual_seed(case.seed)
    dtype = getattr(torch, tables.TORCH_DTYPE[spec.dtype])
    d, hkv = spec.head_dim, case.heads_kv
    hq = hkv * spec.gqa
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    qs = [rnd(n, hq, d) for n in case.lens_q]
    ks = [rnd(n, hkv, d) for n in case.lens_k]
    vs = [rnd(n, hkv, spec.head_dim_v) for n in case.lens_k]
    if spec.kv_dtype is not None:  # an fp8 cache: the reference dequantizes it with the scales (in `scores`)
        kv_dtype = getattr(torch, tables.TORCH_KV_DTYPE[spec.kv_dtype])
        ks, vs = [t.float().to(kv_dtype) for t in ks], [t.float().to(kv_dtype) for t in vs]
    else:
        kv_dtype = dtype
    if spec.layout is Layout.VARLEN:
        kwargs = dict(cu_seqlens_q=cu_seqlens(case.lens_q, device), cu_seqlens_k=cu_seqlens(case.lens_k, device),
                      max_seqlen_q=max(case.lens_q), max_seqlen_k=max(case.lens_k))
        args = tuple(torch.cat(t).to(device) for t in (qs, ks, vs))
        return LayoutInputs(args, kwargs, list(zip(qs, ks, vs)), _scores(spec, hq, gen, device))
    # Paged: each sequence's pages, shuffled over a cache with spare pages; a shared prefix reuses sequence 0's.
    page = case.page_size
    n_pages = [-(-n // page) for n in case.lens_k]
    width = max(max(n_pages), 1) + 1  # one spare table column: entries past a sequence's pages are never read
    shared = min(n_pages) if case.shared and case.batch > 1 else 0  # pages every sequence has
    total = sum(n_pages) - shared * (case.batch - 1) + 2  # two pages no sequence uses
    order = torch.randperm(total, generator=gen)
    table = torch.full((case.batch, width), -1, dtype=torch.int32)  # unused entries: -1, as engines leave them
    k_cache = torch.full((total, page, hkv, d), float("nan"), dtype=kv_dtype)
    v_cache = torch.full((total, page, hkv, spec.head_dim_v), float("nan"), dtype=kv_dtype)
    nxt = 0
    for b, n in enumerate(n_pages):
        for p in range(n):
            if p < shared and b > 0:
                table[b, p] = table[0, p]  # the shared prompt prefix: same pages, same keys
            else:
                table[b, p] = order[nxt]
                nxt += 1
    slots = [(table[b, torch.arange(n) // page].long(), torch.arange(n) % page) for b, n in enumerate(case.lens_k)]
    for b, (rows, slot) in enumerate(slots):  # later sequences overwrite shared slots; each writes all it reads
        k_cache[rows, slot], v_cache[rows, slot] = ks[b], vs[b]
    kwargs = dict(block_table=table.to(device), seqlens_k=torch.tensor(case.lens_k, dtype=torch.int32, device=device))
    if case.parents is not None:
        kwargs["tree_mask"] = reference.ancestors_from_parents(torch.tensor(case.parents)).to(device)
    if spec.kind is Kind.DECODE:
        q = torch.stack([x.transpose(0, 1) for x in qs]).to(device)  # [B, Hq, Sq, D]
    else:
        q = torch.cat(qs).to(device)
        kwargs.update(cu_seqlens_q=cu_seqlens(case.lens_q, device), max_seqlen_q=max(case.lens_q))
    # the dense keys each sequence sees: what its pages hold (shared pages: the last writer's keys)
    dense = [(qs[b], k_cache[rows, slot], v_cache[rows, slot]) for b, (rows, slot) in enumerate(slots)]
    return LayoutInputs((q, k_cache.to(device), v_cache.to(device)), kwargs, dense, _scores(spec, hq, gen, device))


def reference_sequence(spec: KernelSpec, q, k, v, scores: dict | None = None, tree=None, mods=None, b: int = 0):
    """float64 (out [Sq, Hq, D], lse [Hq, Sq]) of one sequence: the dense reference with batch 1 (tree: its
    bool [Sq, Sq] ancestor-or-self mask). mods: a modded spec's values (ModValues), seen by sequence b: the mods get
    b and, in decode and paged kernels, q_idx = i + lk - lq (README "User mods")."""
    mask = spec.mask if spec.mask in (Mask.CAUSAL, Mask.TREE) else Mask.NONE
    if tree is not None:
        scores = dict(scores or {}, tree_mask=tree.cpu()[None])
    scores = {name: value.cpu() if isinstance(value, torch.Tensor) else value for name, value in (scores or {}).items()}
    if mods is not None:
        fns = reference.sequence_mods(mods.score_mod, mods.mask_mod, b)
        absolute = spec.kind is Kind.DECODE or spec.layout is Layout.PAGED
        scores.update(score_mod=fns[0], mask_mod=fns[1], mod_positions="absolute" if absolute else "row")
    out, lse = reference.attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                   mask=mask, **scores)
    return out[0].transpose(0, 1), lse[0]


def check_forward(module, spec: KernelSpec, case: LayoutCase, device) -> None:
    """Run forward() and compare every sequence's out and lse with the reference; raises PropertyFailure."""
    inputs = make_inputs(spec, case, device)
    args, scores, ref_scores = inputs.args, inputs.scores, inputs.scores
    if spec.shared_kv:  # one latent cache: v=None, V its first head_dim_v columns under k's scale
        args, scores = (*args[:2], None), {n: t for n, t in scores.items() if n != "v_scale"}
        ref_scores = dict(scores, **({"v_scale": scores["k_scale"]} if "k_scale" in scores else {}))
    out, lse = module.forward(*args, **inputs.kwargs, **scores)
    row = 0
    tol = TOLERANCE[spec.dtype]
    for b, (q, k, v) in enumerate(inputs.dense):
        tree = inputs.kwargs["tree_mask"][b] if "tree_mask" in inputs.kwargs else None
        v = k[..., :spec.head_dim_v] if spec.shared_kv else v
        want_out, want_lse = reference_sequence(spec, q, k, v, ref_scores, tree, inputs.mods, b)
        n = case.lens_q[b]
        if spec.kind is Kind.DECODE:
            got_out, got_lse = out[b].transpose(0, 1), lse[b]
        else:
            got_out, got_lse = out[row:row + n], lse[:, row:row + n]
            row += n
        compare(f"out (sequence {b})", got_out.cpu(), want_out, atol=tol["atol"], rtol=tol["rtol"])
        compare(f"lse (sequence {b})", got_lse.cpu(), want_lse, **LSE_TOLERANCE)  # -inf rows must match exactly


def check_backward(module, spec: KernelSpec, case: LayoutCase, device) -> None:
    """Varlen: gradients of attention() against the reference's, sequence by sequence."""
    inputs = make_inputs(spec, case, device)
    q, k, v = (t.detach().requires_grad_() for t in inputs.args)
    sinks = inputs.scores.get("sinks")
    scores = dict(inputs.scores, sinks=sinks.detach().clone().requires_grad_()) if sinks is not None else inputs.scores
    out = module.attention(q, k, v, **inputs.kwargs, **scores)
    gen = torch.Generator().manual_seed(case.seed + 1)
    dout = torch.randn(out.shape, generator=gen).to(out.dtype).to(device)
    out.backward(dout)
    wants = []
    ref_scores = dict(inputs.scores)
    if sinks is not None:
        ref_scores["sinks"] = sinks.detach().cpu().double().requires_grad_()
    for b, (qb, kb, vb) in enumerate(inputs.dense):
        qd, kd, vd = (t.double().requires_grad_() for t in (qb, kb, vb))
        o, _ = reference_sequence(spec, qd, kd, vd, ref_scores, mods=inputs.mods, b=b)
        wants.append((o, qd, kd, vd))
    cq, ck = inputs.kwargs["cu_seqlens_q"].cpu(), inputs.kwargs["cu_seqlens_k"].cpu()
    for b, (o, qd, kd, vd) in enumerate(wants):
        o.backward(dout[cq[b]:cq[b + 1]].cpu().double())
        for name, got, want in (("dq", q.grad[cq[b]:cq[b + 1]], qd.grad), ("dk", k.grad[ck[b]:ck[b + 1]], kd.grad),
                                ("dv", v.grad[ck[b]:ck[b + 1]], vd.grad)):
            compare_grad(f"{name} (sequence {b})", got.cpu(), want, spec.dtype)
    if sinks is not None:
        compare_grad("dsinks", scores["sinks"].grad.cpu(), ref_scores["sinks"].grad, spec.dtype)


# The properties of varlen and paged specs (`fagen verify --property` takes these names too).
LAYOUT_PROPERTIES = {"layout-reference": "each sequence's out and lse match the float64 reference on its gathered "
                                         "dense equivalent",
                     "layout-bwd-reference": "each sequence's gradients (and dsinks) match float64 autograd"}


@dataclasses.dataclass
class LayoutVerdict:
    """`fagen verify` on one varlen or paged spec: the property run, and the failure if any."""

    spec: KernelSpec
    property: str  # "layout-reference" (forward) or "layout-bwd-reference"
    examples: int
    seconds: float
    failure: str | None = None

    @property
    def passed(self) -> bool:
        return self.failure is None

    def to_dict(self) -> dict:
        return {"spec": self.spec.name, "property": self.property, "examples": self.examples,
                "seconds": round(self.seconds, 3), "passed": self.passed, "failure": self.failure}


def verify_layout_spec(spec: KernelSpec, *, examples: int, seed: int, device, scale: str,
                       mutant: str | None = None, properties=None) -> list[LayoutVerdict]:
    """Search `examples` drawn cases of a varlen or paged spec against the gathered dense reference (forward, and
    for bwd specs the gradients); each failure is shrunk by Hypothesis to a small case and reported in words.
    properties: the LAYOUT_PROPERTIES names to run (None: every one that applies)."""
    import time

    from fagen.runtime.loader import load
    from fagen.verify.tolerances import PropertyFailure

    module = load(spec) if mutant is None else _mutant(spec, mutant)
    checks = [("layout-reference", check_forward)]
    if spec.direction.value == "bwd":
        checks.append(("layout-bwd-reference", check_backward))
    if properties is not None:
        checks = [(name, check) for name, check in checks if name in properties]
    verdicts = []
    for name, check in checks:
        seen: list[LayoutCase] = []
        run = _search(module, spec, check, seen, examples, scale, device)
        run._hypothesis_internal_use_seed = seed
        start = time.perf_counter()
        try:
            run()
            failure = None
        except PropertyFailure as e:
            failure = f"{e} (case: {seen[-1]})"
        verdicts.append(LayoutVerdict(spec, name, len(seen), time.perf_counter() - start, failure))
    return verdicts


def _search(module, spec, check, seen, examples, scale, device):
    from hypothesis import HealthCheck, Phase, given, settings

    @settings(max_examples=examples, deadline=None, database=None, report_multiple_bugs=False,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink])
    @given(cases(spec, max_len=40 if scale == "cpu" else 2048))
    def run(case):
        seen.append(case)
        check(module, spec, case, device)

    return run


def _mutant(spec: KernelSpec, name: str):
    from fagen.verify.engine import mutant_module

    return mutant_module(spec, name)
