"""A time budget for applying one poll's KV events (issue 23): the poll publishes vLLM's series only
once every source is in, so a drain that takes long to apply would leave them all stale. The
drain is applied in slices of about CHUNK_HASHES block hashes; once the budget is spent, the rest
of its batches are dropped as `budget_exceeded` (counted, their seqs skipped, never "missed").
Pure apart from the clock it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from ..sources.kv_events_decode import Batch, Dropped, KvEventDrain

CHUNK_HASHES = 8_192  # ~10 ms of attribution: how often the clock is read


def within_budget(
    drain: KvEventDrain, seconds: float | None, clock: Callable[[], float]
) -> Iterator[KvEventDrain]:
    """`drain` in slices to apply one after the other, while `seconds` last (None: no budget).
    The clock is read before each slice, so a slice is applied only when asked for."""
    if seconds is None:
        yield drain
        return
    items, start, deadline = drain.items, 0, clock() + seconds
    for stop in _slice_ends(items):
        if clock() > deadline:
            yield KvEventDrain(as_dropped(items[start:], "budget_exceeded"))
            return
        yield KvEventDrain(items[start:stop])
        start = stop


def _slice_ends(items: Sequence[Batch | Dropped]) -> Iterator[int]:
    hashes = 0
    for i, item in enumerate(items, 1):
        if isinstance(item, Batch):
            hashes += sum(len(event.block_hashes) for event in item.events)  # weight()'s hashes, alone
        if hashes >= CHUNK_HASHES or i == len(items):
            yield i
            hashes = 0


def as_dropped(items: Sequence[Batch | Dropped], reason: str) -> tuple[Dropped, ...]:
    """Every batch of `items` as a drop of `reason`, a run of consecutive seqs as one; drops kept."""
    out: list[Dropped] = []
    for item in items:
        last = out[-1] if out else None
        if isinstance(item, Dropped):
            out.append(item)
        elif (
            last is not None
            and last.reason == reason
            and last.seq is not None
            and (last.seq + last.count == item.seq)
        ):
            out[-1] = last._replace(count=last.count + 1)
        else:
            out.append(Dropped(reason, item.seq))
    return tuple(out)
