"""A time budget for applying one poll's KV events (issue 23): the poll publishes vLLM's series only
once every source is in, so a drain that takes long to apply would leave them all stale. The
drain is applied in slices of about CHUNK_HASHES block hashes, a heavy batch cut between its events
(issue 33: one valid batch at every bound, 65,536 blocks with their token ids, is ~0.4 s of
attribution); once the budget is spent, the rest of the batch being applied is carried to the next
poll and the other batches are dropped as `budget_exceeded` (counted, their seqs skipped, never
"missed"). Pure apart from the clock it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from ..sources.kv_events_decode import Batch, Dropped, KvEventDrain

CHUNK_HASHES = 8_192  # ~10 ms of attribution: how often the clock is read


@dataclass
class Budget:
    """`seconds` of applying a poll (None: no limit), read on `clock`; `carry` is the rest of a batch
    the previous poll's budget ran out in, applied first by the next."""

    seconds: float | None
    clock: Callable[[], float]
    carry: tuple[Batch, ...] = ()

    def slices(self, drain: KvEventDrain) -> Iterator[KvEventDrain]:
        """The carry and `drain` in slices to apply one after the other while the budget lasts. The
        clock is read before each slice, so a slice is applied only when asked for."""
        items, self.carry = self.carry + drain.items, ()
        if self.seconds is None:
            yield KvEventDrain(items)
            return
        pieces, deadline = list(_pieces(items)), self.clock() + self.seconds
        for i, piece in enumerate(pieces):
            if self.clock() > deadline:
                rest = [item for later in pieces[i:] for item in later]
                self.carry = _joined([item for item in rest if _continues(item)])
                dropped = as_dropped([item for item in rest if not _continues(item)], "budget_exceeded")
                yield KvEventDrain(dropped)
                return
            yield KvEventDrain(piece)


def _continues(item: Batch | Dropped) -> bool:
    return isinstance(item, Batch) and item.continued


def _joined(parts: list[Batch]) -> tuple[Batch, ...]:
    if not parts:
        return ()
    return (parts[0]._replace(events=tuple(event for part in parts for event in part.events)),)


def _pieces(items: Sequence[Batch | Dropped]) -> Iterator[tuple[Batch | Dropped, ...]]:
    """Consecutive items of about CHUNK_HASHES hashes together; a heavier batch cut between events."""
    piece: list[Batch | Dropped] = []
    hashes = 0
    for item in items:
        for part in _cut(item) if isinstance(item, Batch) else (item,):
            piece.append(part)
            if isinstance(part, Batch):
                hashes += _hashes(part.events)
            if hashes >= CHUNK_HASHES:
                yield tuple(piece)
                piece, hashes = [], 0
    if piece:
        yield tuple(piece)


def _cut(batch: Batch) -> Iterator[Batch]:
    """The batch in parts of about CHUNK_HASHES hashes, the later ones `continued` (not counted again)."""
    events = batch.events
    if _hashes(events) <= CHUNK_HASHES:
        yield batch
        return
    start, hashes = 0, 0
    for i, event in enumerate(events, 1):
        hashes += len(event.block_hashes)
        if hashes >= CHUNK_HASHES or i == len(events):
            part = events[start:i]
            if start == 0:
                yield batch._replace(events=part)
            else:
                yield Batch(batch.seq, batch.ts, part, batch.dp_rank, continued=True)
            start, hashes = i, 0


def _hashes(events: Sequence) -> int:
    return sum(len(event.block_hashes) for event in events)  # weight()'s hashes, alone


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
