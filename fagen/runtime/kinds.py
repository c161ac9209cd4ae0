"""Which kernel kind serves a problem: the one rule that fagen.attention and fagen bench use to pick decode."""

from __future__ import annotations

from fagen.spec.axes import DECODE_MAX_SEQ_Q, Kind

# Below this many keys a prefill grid (one program per query block and head) already has work for every SM and
# the split/merge round trip buys nothing; above it the decode kernel's KV splits keep the GPU busy.
DECODE_MIN_SEQ_K = 256


def prefers_decode(seq_q: int, seq_k: int) -> bool:
    """True when the split-KV decode kernel should serve `seq_q` queries against `seq_k` keys.

    Decode kernels take 1..DECODE_MAX_SEQ_Q (16) queries: one generation step or a small speculative tree.
    They pay off once the KV cache is long (seq_k >= DECODE_MIN_SEQ_K): there the prefill grid, with a single
    query block per head, leaves most SMs idle while one program streams the whole cache. Both kinds give the
    same results (the tests check them against each other), so this choice is about speed only.
    """
    return 1 <= seq_q <= DECODE_MAX_SEQ_Q and seq_k >= DECODE_MIN_SEQ_K


def kind_for(seq_q: int, seq_k: int) -> Kind:
    """The kernel kind for a problem's shapes: Kind.DECODE where prefers_decode, else Kind.PREFILL."""
    return Kind.DECODE if prefers_decode(seq_q, seq_k) else Kind.PREFILL
