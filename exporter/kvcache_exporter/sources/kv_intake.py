"""One KV-event publisher's intake between two polls, as serve's subscriber and the aggregator's
lanes both take messages in: rate-limited on arrival (a token bucket), bounded in work (block
hashes, token ids) and in items, decoded only when it still fits, queued in arrival order with the
refusals counted (runs of drops merged), drained by the poll. Its `cursor` follows the sequence of
what was taken in, so a subscriber knows which batches to ask replay for.

The receiving thread calls `take`, `put` and `drop`; the poll calls `drain` (guarded by `lock`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .engine_events import VLLM, decode_engine_message
from .kv_events_decode import (
    MAX_BATCH_BYTES,
    Batch,
    Dropped,
    KvEventDecodeError,
    KvEventDrain,
    SeqCursor,
    TokenBucket,
    peek_seq,
    weight,
)

MAX_PENDING = 100_000  # items queued between two polls; past it, messages are only counted
# The work queued between two polls (dropped past it as `budget_exceeded`): what one poll applies
# and what the queue holds in memory (a decoded hash ~45-110 bytes, a token id ~36). A saturated
# H200 stores ~15k blocks/s (16 token ids each) and removes as many: a 5 s poll queues ~150k hashes
# and ~1.2M token ids, within these. Worst case ~60 + 75 MiB, ~1 s of attribution.
MAX_PENDING_HASHES = 1 << 19
MAX_PENDING_TOKENS = 1 << 21


class KvIntake:
    def __init__(
        self,
        max_batches_per_second: float = 20000,
        max_pending_hashes: int = MAX_PENDING_HASHES,
        max_pending_tokens: int = MAX_PENDING_TOKENS,
        with_tokens: bool = False,
        clock: Callable[[], float] = time.monotonic,
        engine: str = VLLM,
        on_error: Callable[[KvEventDecodeError], object] = lambda err: None,
    ):
        self.with_tokens = with_tokens  # decode parents and token ids too: miss attribution needs them
        self.engine = engine  # whose media and page rules its events follow (engine_events.py)
        self.on_error = on_error  # told of each message refused undecodable or too heavy (a log line)
        # token ids left undecoded cost neither memory nor apply time: bounded only when decoded
        self.bounds = (max_pending_hashes, max_pending_tokens if with_tokens else 1 << 62)
        self.lock = threading.Lock()
        self.cursor = SeqCursor()  # the receiving thread's: what was taken in or dropped
        self._bucket = TokenBucket(max_batches_per_second, clock)
        self._items: list[Batch | Dropped] = []
        self._work = (0, 0)  # (hashes, token ids) of the queued batches

    def take(self, frames: list[bytes]) -> Batch | None:
        """The message decoded, or None when it was refused (rate, room or a decode error: queued as a
        drop). A refused message costs one bucket check, so a flood is shed before it is decoded."""
        if not self._bucket.take():
            self.drop("rate_limited", peek_seq(frames))
            return None
        # not even decoded: the next poll has all the work it may have (a message over the bytes
        # bound is named as such below, at the same cost, whenever it arrives)
        if self.full() and not over_bytes(frames):
            self.drop("budget_exceeded", peek_seq(frames))
            return None
        try:
            return decode_engine_message(frames, self.with_tokens, self.engine)
        except KvEventDecodeError as err:
            self.drop(err.reason, err.seq)  # parse_error or batch_too_heavy
            self.on_error(err)
            return None

    def full(self) -> bool:
        with self.lock:
            return any(queued >= bound for queued, bound in zip(self._work, self.bounds, strict=True))

    def room(self) -> list[int]:
        """Hashes and token ids the queue still takes."""
        with self.lock:
            return [bound - queued for bound, queued in zip(self.bounds, self._work, strict=True)]

    def put(self, batch: Batch) -> None:
        """Queue a decoded batch, or count it as dropped when it does not fit."""
        hashes, tokens = weight(batch.events)
        with self.lock:
            if len(self._items) >= MAX_PENDING:
                reason = "rate_limited"
            else:
                hashes, tokens = self._work[0] + hashes, self._work[1] + tokens
                reason = None if hashes <= self.bounds[0] and tokens <= self.bounds[1] else "budget_exceeded"
            if reason is None:
                self._items.append(batch)
                self._work = (hashes, tokens)
                self.cursor.advance(batch.seq)
                return
        self.drop(reason, batch.seq)

    def drop(self, reason: str, seq: int | None) -> None:
        with self.lock:
            self.cursor.skip(seq, 1)
            queue_drop(self._items, reason, seq)

    def drain(self) -> KvEventDrain:
        with self.lock:
            drained, self._items, self._work = self._items, [], (0, 0)
        return KvEventDrain(tuple(drained))

    @property
    def queued(self) -> int:
        """Messages the next drain hands over, applied or dropped (a run of drops by its count)."""
        with self.lock:
            return sum(item.count if isinstance(item, Dropped) else 1 for item in self._items)


def over_bytes(frames: list[bytes]) -> bool:
    return bool(frames) and len(frames[-1]) > MAX_BATCH_BYTES


def queue_drop(pending: list[Batch | Dropped], reason: str, seq: int | None) -> None:
    """Queue a drop, merged into the last one when it continues it (a flood costs one item); past
    MAX_PENDING items every drop is one run of rate_limited."""
    if len(pending) >= MAX_PENDING:
        reason, seq = "rate_limited", None
    last = pending[-1] if pending else None
    if isinstance(last, Dropped) and last.reason == reason and _continues(last, seq):
        pending[-1] = last._replace(count=last.count + 1)
    else:
        pending.append(Dropped(reason, seq))


def _continues(last: Dropped, seq: int | None) -> bool:
    if last.seq is None or seq is None:
        return last.seq is None and seq is None
    return last.seq + last.count == seq
