"""The pure half of the KV-event source (no I/O): decoding vLLM's messages and the EventState they feed.

Wire format (`vllm/distributed/kv_events.py`):
A live message is `[topic, seq, payload]` (or `[seq, payload]`): `seq` is an 8-byte big-endian
counter (24 bytes with the snapshot extension: seq + publisher id), `payload` is msgpack of a
`KVEventBatch`. vLLM changed the encoding over time, so both forms are accepted:

* batch: array `[ts, events, data_parallel_rank?]` or a map with those keys;
* event: a map tagged by `type` (vLLM 0.32) or an array whose first element is the tag
  (`array_like=True`, older vLLM); `block_hashes` is the second element in both array forms.

Unknown extra fields are ignored; block hashes are ints (default) or bytes. The common vLLM 0.32
shape goes through a typed msgspec decoder that skips `token_ids` (about 10x faster than decoding
everything); any other shape falls back to an untyped decode and explicit checks.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec

from .base import Sample, SourceError

log = logging.getLogger(__name__)

KNOWN_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
DROP_REASONS = ("rate_limited", "too_many_blocks", "parse_error")
_WITH_HASHES = {"BlockStored", "BlockRemoved"}
_SEQ_SIZES = (8, 24)


class _Stored(msgspec.Struct, tag_field="type", tag="BlockStored", gc=False):
    block_hashes: list[int | bytes]


class _Removed(msgspec.Struct, tag_field="type", tag="BlockRemoved", gc=False):
    block_hashes: list[int | bytes]


class _Cleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", gc=False):
    pass


class _MapEventsBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


_TAGS = {cls: cls.__struct_config__.tag for cls in (_Stored, _Removed, _Cleared)}
_fast_decoder = msgspec.msgpack.Decoder(_MapEventsBatch)
_any_decoder = msgspec.msgpack.Decoder()


class Event(NamedTuple):
    type: str
    block_hashes: tuple[int | bytes, ...] = ()


class Batch(NamedTuple):
    seq: int
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None = None


class KvEventDecodeError(SourceError):
    """A message that is not a KV-event batch. `seq` is set when the sequence frame was readable."""

    def __init__(self, message: str, seq: int | None = None):
        super().__init__("parse_error", message)
        self.seq = seq


def peek_seq(frames: list[bytes]) -> int | None:
    """The message's sequence number without decoding the payload, or None if unreadable."""
    if len(frames) not in (2, 3) or len(frames[-2]) not in _SEQ_SIZES:
        return None
    return int.from_bytes(frames[-2][:8], "big")


def decode_message(frames: list[bytes]) -> Batch:
    """Decode one ZMQ multipart message; raise KvEventDecodeError on anything malformed."""
    seq = peek_seq(frames)
    if seq is None:
        raise KvEventDecodeError(f"expected [topic,] seq(8 bytes), payload; got {len(frames)} frames")
    try:
        fast = _fast_decoder.decode(frames[-1])
    except msgspec.DecodeError:
        try:
            ts, events, dp_rank = _batch_fields(_any_decoder.decode(frames[-1]))
            return Batch(seq, ts, tuple(_event(e) for e in events), dp_rank)
        except (msgspec.DecodeError, ValueError, TypeError) as err:
            raise KvEventDecodeError(f"batch seq {seq}: {err}", seq) from err
    events = tuple(Event(_TAGS[type(e)], tuple(getattr(e, "block_hashes", ()))) for e in fast.events)
    return Batch(seq, fast.ts, events, fast.data_parallel_rank)


def _batch_fields(raw: Any) -> tuple[float, list, int | None]:
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events, dp_rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        ts, events, dp_rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    else:
        raise ValueError("payload is neither a batch array nor a batch map")
    if not _is_number(ts) or not isinstance(events, list):
        raise ValueError("batch needs a numeric ts and a list of events")
    if dp_rank is not None and not _is_int(dp_rank):
        raise ValueError(f"data_parallel_rank is {dp_rank!r}")
    return float(ts), events, dp_rank


def _event(raw: Any) -> Event:
    if isinstance(raw, dict):
        tag, hashes = raw.get("type"), raw.get("block_hashes")
    elif isinstance(raw, list) and raw:
        tag, hashes = raw[0], raw[1] if len(raw) > 1 else None
    else:
        raise ValueError(f"event is {type(raw).__name__}, not a map or tagged array")
    if not isinstance(tag, str):
        raise ValueError(f"event tag is {tag!r}")
    if tag not in _WITH_HASHES:
        return Event(tag)
    if not isinstance(hashes, list) or not all(_is_int(h) or isinstance(h, bytes) for h in hashes):
        raise ValueError(f"{tag} needs block_hashes as a list of ints or bytes")
    return Event(tag, tuple(hashes))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return _is_int(value) or isinstance(value, float)


class TokenBucket:
    """`rate` tokens per second, bursts up to one second's worth; rate <= 0 means unlimited."""

    def __init__(self, rate: float, clock: Callable[[], float]):
        self.rate, self.clock = rate, clock
        self.tokens, self.last = float(rate), clock()

    def take(self) -> bool:
        if self.rate <= 0:
            return True
        now = self.clock()
        self.tokens = min(self.rate, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class EventState:
    """Counters, sequence tracking and the resident block set, fed one batch at a time. No I/O."""

    def __init__(
        self,
        max_blocks: int = 1_000_000,
        max_batches_per_second: float = 20000,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_blocks = max_blocks
        self.batches = 0
        self.events: Counter[str] = Counter()
        self.missed = 0
        self.dropped: Counter[str] = Counter()
        self.restarts = 0
        self._blocks: set[int | bytes] = set()
        self._next: int | None = None  # the seq expected next; None before the first batch
        self._bucket = TokenBucket(max_batches_per_second, clock)

    @property
    def cached_blocks(self) -> int:
        return len(self._blocks)

    def is_resident(self, block_hash: int | bytes) -> bool:
        return block_hash in self._blocks

    def admit(self) -> bool:
        """Whether the rate bound lets one more batch in; the caller drops it otherwise."""
        return self._bucket.take()

    def missing(self, seq: int) -> range:
        """Sequence numbers lost before `seq`. A seq below the expected one is a new publisher
        (vLLM restarted and counts from 0 again), whose batches before `seq` are the ones lost."""
        if self._next is None:
            return range(0)  # joining a running stream: what came before is not a gap
        return range(self._next if seq >= self._next else 0, seq)

    def drop(self, reason: str, seq: int | None = None) -> None:
        self.dropped[reason] += 1
        if seq is not None:
            self._advance(seq)

    def apply(self, batch: Batch) -> None:
        self._advance(batch.seq)
        self.batches += 1
        overflow = False
        for event in batch.events:
            self.events[event.type if event.type in KNOWN_TYPES else "other"] += 1
            if event.type == "BlockStored":
                overflow |= self._store(event.block_hashes)
            elif event.type == "BlockRemoved":
                self._blocks.difference_update(event.block_hashes)
            elif event.type == "AllBlocksCleared":
                self._blocks.clear()
        if overflow:
            self.dropped["too_many_blocks"] += 1

    def samples(self) -> list[Sample]:
        events = {t: self.events[t] for t in KNOWN_TYPES} | dict(self.events)
        dropped = {r: self.dropped[r] for r in DROP_REASONS} | dict(self.dropped)
        return [
            Sample("kvcache_kv_events_batches_total", {}, self.batches),
            *(Sample("kvcache_kv_events_total", {"type": t}, n) for t, n in events.items()),
            Sample("kvcache_kv_events_missed_batches_total", {}, self.missed),
            *(Sample("kvcache_kv_events_dropped_total", {"reason": r}, n) for r, n in dropped.items()),
            Sample("kvcache_kv_events_cached_blocks", {}, self.cached_blocks),
        ]

    def _advance(self, seq: int) -> None:
        gap = self.missing(seq)
        if self._next is not None and seq < self._next:
            log.info(
                "KV-event sequence went back from %d to %d: new publisher, cache view reset", self._next, seq
            )
            self.restarts += 1
            self._blocks.clear()
        self.missed += len(gap)
        self._next = seq + 1

    def _store(self, hashes: tuple[int | bytes, ...]) -> bool:
        """Add hashes up to max_blocks; True when some did not fit."""
        if len(self._blocks) + len(hashes) <= self.max_blocks:
            self._blocks.update(hashes)
            return False
        overflow = False
        for block_hash in hashes:
            if len(self._blocks) < self.max_blocks:
                self._blocks.add(block_hash)
            else:
                overflow |= block_hash not in self._blocks
        return overflow
