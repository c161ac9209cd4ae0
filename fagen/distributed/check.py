"""The collective input check of fagen.distributed: every rank raises the same error before any data moves.

[Note] Why one collective. A rank whose input is refused must not leave the other ranks waiting in a ring step or an
all-to-all that it never joins. So a call validates its local input without raising, then one small all_gather of
(refused?, the problem's fields) runs on every rank; if any rank's input was refused, or a field differs between
ranks, every rank raises a ContextParallelError (the refused rank's own message; the others name that rank and
its message, fetched with all_gather_object on this error path only). Only then does any tensor data move.
"""

from __future__ import annotations

import struct

import torch
import torch.distributed as dist

from fagen.distributed.common import _DTYPE_CODES, MASKS
from fagen.distributed.shard import LAYOUTS, ContextParallelError

FIELDS = 16  # every call gathers this many ints per rank (a refused rank sends zeros): one message size for all
SAME_SHARDS = ("cut the sequence into equal shards with fagen.distributed.shard (pad it to a multiple of the number "
               "of chunks), or the packed rows with plan.shard")


def float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_float(x: int) -> float:
    return struct.unpack("<d", struct.pack("<q", x))[0]


SHOW = {"dtype": lambda x: str(_DTYPE_CODES[x]), "mask": lambda x: MASKS[x], "layout": lambda x: LAYOUTS[x],
        "scale": _bits_float, "plan": lambda x: f"{x:#x}", "call": lambda x: ("dense", "packed (plan=)")[x]}
HINTS = {"q shard length": SAME_SHARDS, "k/v shard length": SAME_SHARDS,
         "dtype": "cast every rank's q, k and v to one dtype",
         "plan": "build the plan from the same cu_seqlens, balance and mask on every rank"}


def _device(group) -> torch.device:
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def agree(group, error: ContextParallelError | None, fields: list[tuple[str, int]], *, show=None,
          hints=None) -> None:
    """Collective over `group`: raise the same ContextParallelError on every rank if any rank's `error` is set or
    one of `fields` (name, int) differs across ranks; return otherwise. `show` maps a field name to a function
    that renders its int for the message; `hints` maps a field name to the fix to suggest."""
    world = dist.get_world_size(group)
    if len(fields) >= FIELDS:
        raise ValueError(f"agree: at most {FIELDS - 1} fields")
    mine = [1 if error is not None else 0] + [0 if error is not None else int(v) for _, v in fields]
    mine += [0] * (FIELDS - len(mine))
    mine_t = torch.tensor(mine, dtype=torch.int64, device=_device(group))
    every = [torch.empty_like(mine_t) for _ in range(world)]
    dist.all_gather(every, mine_t, group=group)
    every = [t.tolist() for t in every]
    refused = [r for r, row in enumerate(every) if row[0]]
    if refused:
        messages = [None] * world
        dist.all_gather_object(messages, None if error is None else str(error), group=group)
        if error is not None:
            raise ContextParallelError(str(error))
        r = refused[0]
        raise ContextParallelError(f"rank {r} of the group refused its input, so every rank stops: {messages[r]}")
    for i, (name, _) in enumerate(fields, start=1):
        values = [row[i] for row in every]
        if len(set(values)) == 1:
            continue
        if show and name in show:
            values = [show[name](x) for x in values]
        per_rank = ", ".join(f"rank {r}: {x}" for r, x in enumerate(values))
        hint = (hints or {}).get(name, "pass the same value on every rank")
        raise ContextParallelError(f"{name} differs across the ranks of the group ({per_rank}); {hint}")


def agree_or_raise(group, error: ContextParallelError | None, fields: list[tuple[str, int]], check_ranks: bool, *,
                   show=None, hints=None) -> None:
    """A local check's outcome: with check_ranks and more than one rank in `group`, agree() over it (every rank
    raises the same error, or none does); otherwise this rank's `error`, if any, raised here alone."""
    if check_ranks and dist.get_world_size(group) > 1:
        agree(group, error, fields, show=show, hints=hints)
    elif error is not None:
        raise error


def require_initialized() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise ContextParallelError("torch.distributed is not initialized; call torch.distributed.init_process_group "
                                   "first (launch with torchrun), or use fagen.attention on one device")


__all__ = ["agree", "agree_or_raise", "require_initialized", "float_bits", "FIELDS", "SAME_SHARDS", "SHOW", "HINTS"]
