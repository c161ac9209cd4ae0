"""fagen.distributed: context parallelism on fagen kernels over torch.distributed.

See docs/distributed.md. ring_attention passes K/V shards around a ring of ranks; ulysses_attention swaps sequence
shards for head shards with an all-to-all and runs each head on the whole sequence; hybrid_attention runs Ulysses
inside groups and the ring across them. shard/gather cut a full tensor into this rank's shard and put shards back
together ("contiguous" or "zigzag"); plan_documents cuts packed documents (cu_seqlens) across ranks, balanced.
"""

from fagen.distributed.hybrid import HybridGroups, hybrid_attention, hybrid_groups
from fagen.distributed.packing import BALANCES, DocumentPlan, plan_documents
from fagen.distributed.ring import MASKS, ring_attention
from fagen.distributed.shard import LAYOUTS, ContextParallelError, chunk_ids, gather, shard, shard_for_group, unshard
from fagen.distributed.ulysses import ulysses_attention

__all__ = ["ring_attention", "ulysses_attention", "hybrid_attention", "hybrid_groups", "HybridGroups", "shard",
           "unshard", "gather", "shard_for_group", "chunk_ids", "ContextParallelError", "LAYOUTS", "MASKS",
           "BALANCES", "DocumentPlan", "plan_documents"]
