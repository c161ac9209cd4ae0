"""fagen.distributed: context parallelism (ring attention) on fagen kernels over torch.distributed.

See docs/distributed.md. ring_attention runs attention over a sequence sharded across ranks; shard/gather cut a
full tensor into this rank's shard and put shards back together, in the "contiguous" or "zigzag" layout.
"""

from fagen.distributed.ring import MASKS, ring_attention
from fagen.distributed.shard import LAYOUTS, ContextParallelError, chunk_ids, gather, shard, shard_for_group, unshard

__all__ = ["ring_attention", "shard", "unshard", "gather", "shard_for_group", "chunk_ids", "ContextParallelError",
           "LAYOUTS", "MASKS"]
