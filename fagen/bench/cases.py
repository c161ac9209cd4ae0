"""What every implementation of a bench case shares: the case context (inputs, dense mask, reference slices),
the prepared callable, the options, and the two ways an implementation declines a case."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch

from fagen.bench.inputs import InputSet, make_inputs, set_bytes
from fagen.bench.workloads import BenchCase
from fagen.spec.axes import Direction, Mask
from fagen.bench import IMPLS  # noqa: F401 (re-exported for impls.py and report.py)
from fagen.verify import reference

STATUSES = ("ok", "unsupported", "unavailable", "error", "skipped")
SET_BUDGET = 4 << 30  # bytes of rotating input sets on a GPU
RESTART_EXIT = 3  # a worker's exit status after a CUDA error poisoned its context (fagen.bench.runner starts another)


class Unsupported(Exception):
    """An implementation cannot compute this case (a backend refuses the mask, a module has no backward)."""


class Unavailable(Exception):
    """An implementation cannot run here at all (needs CUDA, a package is missing)."""


class CaseContext:
    """What every implementation of one case shares: the device, the input sets, the dense mask, the reference."""

    def __init__(self, case: BenchCase, device: torch.device, n_sets: int, seed: int = 0):
        self.case, self.device = case, device
        if device.type == "cuda":
            n_sets = max(1, min(n_sets, SET_BUDGET // max(1, set_bytes(case))))
        self.sets = [make_inputs(case, device, seed + i) for i in range(n_sets)]
        self._dense: torch.Tensor | None = None
        self._refs: dict | None = None
        self._slices: list | None = None

    def dense_mask(self) -> torch.Tensor:
        """bool [B, Sq, Sk]: the visibility mask written out, window included (for peers that need a dense mask)."""
        if self._dense is None:
            c, kw = self.case, self.sets[0].kwargs
            self._dense = reference.visible(c.mask, c.batch, c.seq_q, c.seq_k, seqlens_q=kw.get("seqlens_q"),
                                            seqlens_k=kw.get("seqlens_k"), tree_mask=kw.get("tree_mask"),
                                            window=c.window, device=self.device)
        return self._dense

    # [Note] Reference slices
    # The float64 reference of a whole 16k case does not fit in memory, but heads and batch entries are
    # independent: one KV group (its gqa query heads and its KV head) of one batch entry is a complete
    # sub-problem, gradients included. We check the first group of the first entry and the last of the last.
    # When even one group does not fit (a 32k forward, or GQA 8 at 8k), a forward without padding or tree is cut
    # by query rows too, into pieces that are exact sub-problems of the contract's bottom-right alignment
    # (i_aligned = i + Sk - Sq): the last n rows against every key (n + Sk - n = the alignment of rows Sq - n..),
    # and, when no row sees a key right of its aligned position (causal, or a window with right = 0), the first
    # n rows against keys [0, n + Sk - Sq), which holds every key they see and keeps their alignment.
    def slices(self) -> list[tuple[int, int, int, int, int]]:
        """(batch entry, KV group, first row, end row, end key) of each checked sub-problem; [] if none fits."""
        if self._slices is None:
            c = self.case
            groups = sorted({(0, 0), (c.batch - 1, c.heads_kv - 1)})
            self._slices = [(b, g, 0, c.seq_q, c.seq_k) for b, g in groups]
            if not self._fits(c.seq_q, c.seq_k):
                self._slices = self._row_slices()
        return self._slices

    def _fits(self, rows: int, keys: int) -> bool:
        c = self.case
        need = c.gqa * rows * keys * 8 * (16 if c.direction is Direction.BWD else 12)  # float64 temporaries
        if self.device.type == "cuda":
            return need < 0.6 * torch.cuda.mem_get_info(self.device)[0]
        return need < (2 << 30)

    def _row_slices(self) -> list[tuple[int, int, int, int, int]]:
        c = self.case
        if c.direction is Direction.BWD or c.mask not in (Mask.NONE, Mask.CAUSAL):
            return []
        shift = c.seq_k - c.seq_q
        right = c.window[1] if c.window is not None else None
        bounded = c.mask is Mask.CAUSAL or right == 0  # no row sees past its aligned position
        rows = next((n for n in (1024, 512, 256, 128, 64, 32, 16) if n < c.seq_q and self._fits(n, c.seq_k)), None)
        if rows is None:
            return []
        out = [(c.batch - 1, c.heads_kv - 1, c.seq_q - rows, c.seq_q, c.seq_k)]
        if bounded and rows + shift > 0 and rows < c.seq_q:
            out.insert(0, (0, 0, 0, rows, rows + shift))
        return out

    def reference_fits(self) -> bool:
        return bool(self.slices())

    def slice_of(self, s: InputSet, b: int, g: int, r0: int = 0, r1: int | None = None,
                 kend: int | None = None) -> tuple[torch.Tensor, ...]:
        G = self.case.gqa
        q = s.q[b:b + 1, g * G:(g + 1) * G, r0:r1]
        if s.paged is not None:  # a paged case keeps no dense copy: KV head g's keys of sequence b, through its table
            pages = s.paged["block_table"][b].long()
            return q, *(s.paged[c][pages].flatten(0, 1)[:kend, g:g + 1].transpose(0, 1)[None]
                        for c in ("k_cache", "v_cache"))
        return (q, s.k[b:b + 1, g:g + 1, :kend],
                None if s.v is None else s.v[b:b + 1, g:g + 1, :kend])  # None: a shared latent cache

    def score_slice(self, s: InputSet, g: int) -> dict:
        """The score arguments of KV group g's query heads (per-head slopes and sinks cut to the group; an fp8
        cache's per-KV-head scales cut to KV head g)."""
        G = self.case.gqa
        cut = lambda name, t: t[g:g + 1] if name in ("k_scale", "v_scale") else t[g * G:(g + 1) * G]  # noqa: E731
        return {name: (cut(name, t) if isinstance(t, torch.Tensor) else t) for name, t in s.scores.items()}

    def references(self, inputs: InputSet | None = None) -> dict:
        """{slice: (out, lse, grads or None)} in float64 for input set 0 (computed once per case), or for `inputs`:
        what a Prepared with its own `inputs` computes on (not kept)."""
        if inputs is not None:
            return self._references_of(inputs)
        if self._refs is None:
            self._refs = self._references_of(self.sets[0])
        return self._refs

    def _references_of(self, s: InputSet) -> dict:
        c, refs = self.case, {}
        for sl in self.slices():
            b, g, r0, r1, kend = sl
            q, k, v = self.slice_of(s, b, g, r0, r1, kend)
            kw = {name: t[b:b + 1] for name, t in s.kwargs.items()}
            kw.update(self.score_slice(s, g))
            if c.direction is Direction.BWD:
                q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
                out, lse = reference.attention(q, k, v, mask=c.mask, **kw)
                dout = s.dout[b:b + 1, g * c.gqa:(g + 1) * c.gqa].double()
                grads = torch.autograd.grad(out, (q, k, v), dout)
                refs[sl] = (out.detach(), lse.detach(), grads)
            else:
                latent = {"head_dim_v": c.head_dim_v} if v is None else {}
                out, lse = reference.attention(q, k, v, mask=c.mask, **kw, **latent)
                refs[sl] = (out, lse, None)
        return refs


@dataclasses.dataclass
class Prepared:
    """An implementation ready to run one case: fn(input set) -> out, or (out, lse) when it gives lse."""

    fn: Callable[[InputSet], Any]
    context: Callable[[], Any] = contextlib.nullcontext  # entered around the check and the timing
    note: str = ""
    spec: str | None = None
    # the input set fn computes on in place of the one it is given, where it must convert it first (a per-tensor
    # fp8 peer re-quantizes per-head scaled K and V: peer_cudnn_fp8); the check's reference is taken from these
    inputs: Callable[[InputSet], InputSet] | None = None


@dataclasses.dataclass
class BenchOptions:
    device: str = "cuda"
    impls: tuple[str, ...] = IMPLS
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    sets: int = 3
    rounds: int = 1  # interleaved timing rounds a case ([Note] Interleaved rounds in fagen/bench/rounds.py); 1: in turn
    check: bool = True
    seed: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def out_of(result) -> torch.Tensor:
    return result[0] if isinstance(result, (tuple, list)) else result


def first_line(e: BaseException, limit: int = 200) -> str:
    """The gist of an exception on one line (a wrapper's "... raised:" line is joined with the next)."""
    text = f"{type(e).__name__}: {e}".strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = lines[0] if lines else type(e).__name__
    if line.endswith(":") and len(lines) > 1:
        line += " " + lines[1]
    return shorten(line, limit)


def shorten(text: str, limit: int) -> str:
    """text cut to at most `limit` characters at a word boundary, marked with "..." (never mid-word)."""
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit - 3)
    return text[:cut if cut > limit // 2 else limit - 3].rstrip(" ;,") + "..."
