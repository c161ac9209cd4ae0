"""Interleaved timing rounds: a case's implementations timed in turn, several rounds, the order balanced over them."""

from __future__ import annotations

import statistics
from typing import Callable, Optional, Sequence

# [Note] Interleaved rounds
# The H100 runs the dense rows at its 700 W power cap, and its SM clock moves between 1.38 and 1.98 GHz from one
# do_bench pass to the next: one row moves 5-15% between passes, and a row timed right after a bf16 row reads 5-9%
# low (docs/hopper.md, "fp8 forward: the full mask and the spread (fourteenth session)"). Timed one after another,
# fagen's column first, a row's ratio to its peers moved by several % with the order. So with `rounds` > 1 a case's
# implementations are checked first, all of them, and then timed in rounds: each round times every implementation
# once (warm-up `warmup_ms / rounds`, repetitions `rep_ms / rounds`: the suite's total time stays what it was), in
# round r's row of a balanced Latin square (`order`), so over its rows each implementation takes each place in the
# order once and follows each other implementation equally often, and all of them sample the clock's drift alike; a
# record's `ms` is the median of its rounds' medians, and the record keeps the rounds (`rounds_ms`) and their spread
# (`ms_min`, `ms_max`). `rounds` = 1 is the earlier bench: each implementation checked and timed in turn, do_bench's
# loop, fagen's column first.
# Until the nineteenth session the rows were plain rotations (round r started at r mod n, then on round the circle):
# every place once, but with three or more implementations each was always timed right after the same one, and the
# H200 showed that a row's reading follows what ran just before it (identical kernels read 1.01-1.07x the product
# sorted by their predecessor: docs/serving.md, "MLA backward (nineteenth session)"). Williams' design fixes both:
# row 0 is 0, 1, n-1, 2, n-2, ..., row r adds r mod n to each entry, and for an odd n rows n..2n-1 are rows 0..n-1
# reversed (the period: n rows for an even n, 2n for an odd one). With two implementations it is the rotation.

ROUNDS = 5  # `fagen bench --rounds`'s default
# The mods and layouts suites' rounds when --rounds is not given ([Note] Mods rounds in fagen/bench/mods.py): ROUNDS
# since the sixteenth session's round A (H100): the old order read the window row's backward at 1.074 in one run and
# 0.689 in the next (one slow fagen pass, 0.816 ms against 0.52-0.53), where the rounds' median kept 1.056 through a
# round in which Flex ran 1.5-1.9x slow; elsewhere the two orders agreed within 0.02-0.03 (docs/mods.md, "House
# (sixteenth session)").
SUITE_ROUNDS = ROUNDS


def order(n: int, r: int) -> list[int]:
    """The indices of n implementations in round r's order: row r of Williams' balanced Latin square ([Note]
    Interleaved rounds): every place once and every predecessor equally often over its period (n rows, or 2n for
    an odd n)."""
    first = [0 if i == 0 else (i + 1) // 2 if i % 2 else n - i // 2 for i in range(n)]
    row = [(x + r) % n for x in first]
    return row[::-1] if n % 2 and (r // n) % 2 else row


def interleave(names: Sequence[str], rounds: int, time_one: Callable[[str, int], dict],
               fatal: Callable[[BaseException], bool] = lambda e: False
               ) -> tuple[dict[str, list[dict]], dict[str, BaseException], str | None]:
    """time_one(name, r) for every name in every round, in round r's order (`order`). Returns (each name's results
    round by round, the exception of each name that raised (it is left out of the later rounds), the name whose
    exception `fatal` calls fatal (the rounds stop there), or None)."""
    results: dict[str, list[dict]] = {name: [] for name in names}
    failed: dict[str, BaseException] = {}
    for r in range(rounds):
        for i in order(len(names), r):
            name = names[i]
            if name in failed:
                continue
            try:
                results[name].append(time_one(name, r))
            except Exception as e:  # noqa: BLE001 - one implementation failing must not stop the others
                failed[name] = e
                if fatal(e):
                    return results, failed, name
    return results, failed, None


def summarize(per_round: list[dict], keys: Sequence[str] = ("ms", "fwdbwd_ms"),
              spread: Sequence[str] = ("ms",)) -> dict:
    """A record's timing fields from its rounds' {key: ms}: each key's median over the rounds, with the rounds
    themselves (`rounds_ms` for "ms", `fwdbwd_rounds_ms` for "fwdbwd_ms", `fwd_rounds_ms` for "fwd_ms") and, for the
    keys of `spread`, their spread (`ms_min`, `ms_max`; `fwd_ms_min`, `fwd_ms_max`)."""
    out: dict = {}
    for key in keys:
        values = [t[key] for t in per_round if t.get(key) is not None]
        if not values:
            continue
        out[key] = float(statistics.median(values))
        out[rounds_key(key)] = [round(v, 5) for v in values]
    for key in spread:
        if key in out:
            out[key + "_min"], out[key + "_max"] = min(out[rounds_key(key)]), max(out[rounds_key(key)])
    return out


def rounds_key(key: str) -> str:
    """The field of a timing key's rounds: "ms" -> "rounds_ms", "fwd_ms" -> "fwd_rounds_ms"."""
    return key.removesuffix("ms") + "rounds_ms"


Timer = Callable[[Optional[dict]], float]  # ms of one timed part, given its memo (None: one round, the earlier loop)


def time_parts(setups: dict[str, Callable[[], dict[str, Timer]]], rounds: int
               ) -> tuple[dict[str, list[dict]], dict[str, BaseException]]:
    """The suites' rows that time parts per implementation (the mods suite: a block mask, a forward, a backward;
    the layouts suite: one call): setups[name]() readies an implementation (compiles, checks) and returns its parts
    {key: timer}. rounds 1: each implementation readied and timed in turn, its parts in order, the timers given no
    memo (the earlier loops). More: every implementation readied first, in order, then all timed in `rounds`
    interleaved rounds (`interleave`), each part with its own memo, kept across the rounds (the timers take their
    1/rounds share of the warm-up and repetitions). Returns (each name's {key: ms} round by round, the exception of
    each name that raised, in its setup or a round)."""
    parts: dict[str, dict[str, Timer]] = {}
    failed: dict[str, BaseException] = {}
    if rounds > 1:
        for name, setup in setups.items():
            try:
                parts[name] = setup()
            except Exception as e:  # noqa: BLE001 - recorded, the others go on
                failed[name] = e
    memos: dict[str, dict] = {name: {} for name in setups}

    def one(name: str, r: int) -> dict:
        if name not in parts:
            parts[name] = setups[name]()
        return {key: timer(None if rounds == 1 else memos[name].setdefault(key, {}))
                for key, timer in parts[name].items()}

    results, more, _ = interleave([n for n in setups if n not in failed], rounds, one)
    return results, {**failed, **more}
