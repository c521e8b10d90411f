"""The KV-event view: counters, sequence tracking and the resident block set, fed batch by batch.

The subscriber (sources/kv_events.py) receives and decodes in the background; each poll drains what
arrived into the poll state's part for that publisher (derive/state.py), which applies each batch to
this view first: the view reads the stream's sequence (its `cursor`, the one reader) and returns
the mark, which the part hands on to miss attribution.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

from .. import catalog as c
from ..samples import Sample
from ..sources.kv_events_decode import (
    DROP_REASONS,
    IN_ORDER,
    KNOWN_TYPES,
    REFUSAL_REASONS,
    Batch,
    Dropped,
    KvEventDrain,
    Mark,
    SeqCursor,
)

log = logging.getLogger(__name__)


class EventState:
    """No I/O. `clock` only paces the log line about sequence resets."""

    def __init__(self, max_blocks: int = 1_000_000, clock: Callable[[], float] = time.monotonic):
        self.max_blocks = max_blocks
        self.batches = 0
        self.events: Counter[str] = Counter()
        self.missed = 0
        self.dropped: Counter[str] = Counter()
        self.restarts = 0
        self.resident: set[int | bytes] = set()  # the block hashes vLLM holds, as the events tell
        self.cursor = SeqCursor()  # the stream's sequence, read once: apply and drop return its marks
        self._clock = clock
        self._quiet_until = float("-inf")

    @property
    def cached_blocks(self) -> int:
        return len(self.resident)

    def missing(self, seq: int) -> range:
        """Sequence numbers lost before `seq` (SeqCursor.gap)."""
        return self.cursor.gap(seq)

    def ingest(self, drain: KvEventDrain) -> None:
        for item in drain.items:
            if isinstance(item, Dropped):
                self.drop(item.reason, item.seq, item.count)
            else:
                self.apply(item)

    def drop(self, reason: str, seq: int | None = None, count: int = 1) -> Mark:
        """`count` messages dropped on purpose from `seq` on: counted, never as missed."""
        self.dropped[reason] += count
        mark = self.cursor.skip(seq, count)
        self.mark(mark)
        return mark

    def mark(self, mark: Mark) -> None:
        """What the sequence said: lost batches counted, a restart empties the view."""
        self.missed += mark.lost
        if mark.restart:
            self.restarts += 1
            self.resident.clear()
            now = self._clock()
            if now >= self._quiet_until:  # a hostile publisher flipping seqs gets one line a minute
                self._quiet_until = now + 60.0
                log.info("KV-event sequence jumped back or far ahead: new publisher, cache view reset")

    def apply(self, batch: Batch) -> Mark:
        """The batch applied; what the sequence said before it."""
        mark = IN_ORDER if batch.continued else self.cursor.advance(batch.seq)  # its start advanced it
        if mark is not IN_ORDER:
            self.mark(mark)
        if not batch.continued:  # the rest of a batch cut by the poll budget: counted with its start
            self.batches += 1
        for reason in batch.refused:  # single events the decoder left out, their batch kept
            self.dropped[reason] += 1
        overflow, blocks, removals, removed = False, self.resident, 0, []
        for event in batch.events:
            kind = event.type
            if kind == "BlockRemoved":  # the most common: one per evicted block, applied together
                removed += event.block_hashes
                removals += 1
                continue
            if removed:
                blocks.difference_update(removed)
                removed = []
            if kind == "BlockStored":
                overflow |= self._store(event.block_hashes)
            elif kind == "AllBlocksCleared":
                blocks.clear()
            else:
                kind = "other"
            self.events[kind] += 1
        if removed:
            blocks.difference_update(removed)
        if removals:
            self.events["BlockRemoved"] += removals
        if overflow:
            self.dropped["too_many_blocks"] += 1
        return mark

    def _store(self, hashes: tuple[int | bytes, ...]) -> bool:
        """Add hashes up to max_blocks; True when some did not fit."""
        if len(self.resident) + len(hashes) <= self.max_blocks:
            self.resident.update(hashes)
            return False
        overflow = False
        for block_hash in hashes:
            if len(self.resident) < self.max_blocks:
                self.resident.add(block_hash)
            else:
                overflow |= block_hash not in self.resident
        return overflow


def kv_event_samples(state: EventState, labels: dict[str, str] | None = None) -> list[Sample]:
    base = labels or {}
    events = {t: state.events[t] for t in KNOWN_TYPES} | dict(state.events)
    dropped = {r: state.dropped[r] for r in (*DROP_REASONS, *REFUSAL_REASONS)} | dict(state.dropped)
    return [
        Sample(c.KV_EVENTS_BATCHES_TOTAL, base, state.batches),
        *(Sample(c.KV_EVENTS_TOTAL, {**base, "type": t}, n) for t, n in events.items()),
        Sample(c.KV_EVENTS_MISSED_BATCHES_TOTAL, base, state.missed),
        Sample(c.KV_EVENTS_PUBLISHER_RESTARTS_TOTAL, base, state.restarts),
        *(Sample(c.KV_EVENTS_DROPPED_TOTAL, {**base, "reason": r}, n) for r, n in dropped.items()),
        Sample(c.KV_EVENTS_CACHED_BLOCKS, base, state.cached_blocks),
    ]
