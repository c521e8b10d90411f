"""After a NATS outage overflowed the sidecar's buffer: its batches again, from vLLM's replay endpoint
(docs/fleet.md, "NATS down"), for fleet_publish.FleetPublisher.

The publisher, at the first delta its buffer cannot take, stops publishing and remembers where
(`Held`: the batch, the events of it already published, its sequence before it); it publishes
nothing and changes nothing of its own numbering while it holds, so the shards see no gap. Once
NATS has taken the buffer it asks vLLM's replay ROUTER for the batches from there on (`replayed`)
and offers them as if they had just arrived: the shards get the same deltas, in the same order
and numbering, as without the outage. vLLM's replay keeps its last 10,000 batches (`buffer_steps`):
when it no longer has the first one, or vLLM restarted meanwhile, or no replay endpoint is known,
the resync fails and the publisher goes on with a gap in each range's numbering, which the shards
count as missed (the degradation without replay).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from .sources.kv_events_decode import IN_ORDER, Batch, Dropped, KvEventDecodeError, SeqCursor

REPLAY_TIMEOUT = 2.0  # one resync's wait for vLLM's replay, in the poll's worker thread
CHUNK_BATCHES = 256  # replayed batches offered at once: one delta per range per chunk
END_OF_REPLAY = -1


@dataclass
class Held:
    """Where one engine's publishing stopped: replay from batch `seq`, the first `skip` events of
    which were published (`advanced`: its seq already read); `cursor` is the engine's expected seq
    before it (SeqCursor.next). `live` reads the batches the stream handed over since, up to `last`."""

    seq: int
    skip: int = 0
    advanced: bool = False
    cursor: int | None = None
    live: SeqCursor = field(default_factory=SeqCursor)
    last: int | None = None
    restarted: bool = False  # vLLM restarted while held: its replay no longer has these batches
    cleared: bool = False  # vLLM cleared its cache while held: without replay, a new epoch

    def saw(self, item: Batch | Dropped, first: bool = False) -> None:
        """One item the live stream handed over while held (`first`: the batch the hold began in,
        its seq already read)."""
        if item.seq is None:
            return
        if isinstance(item, Dropped):
            mark = self.live.skip(item.seq, item.count)
        elif first and self.advanced:
            mark = IN_ORDER
        else:
            mark = self.live.advance(item.seq)
            self.cleared |= any(event.type == "AllBlocksCleared" for event in item.events)
        self.restarted |= mark.restart
        self.last = self.live.next - 1 if self.live.next is not None else self.last

    @property
    def waiting(self) -> bool:
        """Whether any batch is held at all (else nothing to replay)."""
        return self.last is not None and self.last >= self.seq


def held_at(seq: int, skip: int, advanced: bool, cursor: int | None) -> Held:
    """A hold from batch `seq` on; its live reading starts where the publisher's cursor was."""
    held = Held(seq, skip, advanced, cursor)
    held.live.next = seq + 1 if advanced else cursor
    return held


def chunked(batches: Iterable[Batch], last: int | None, size: int = CHUNK_BATCHES) -> Iterator[list[Batch]]:
    """The replayed batches up to `last` (the live stream hands over the rest), `size` at a time."""
    chunk: list[Batch] = []
    for batch in batches:
        if last is None or batch.seq > last:
            break
        chunk.append(batch)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def replayed(
    endpoint: str,
    start: int,
    decode,
    timeout: float = REPLAY_TIMEOUT,
    max_message_bytes: int = 64 * 1024 * 1024,
) -> Iterator[Batch]:
    """vLLM's replay of the batches from `start` on, decoded, in order; ends at vLLM's end marker,
    at the first gap (its ROUTER drops replies past its high-water mark: ask again from there) or
    when `timeout` passes. Undecodable batches end it too (the rest can't be placed in order)."""
    import zmq

    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    deadline = time.monotonic() + timeout
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])  # [identity, b"", start] at the ROUTER
        expected = start
        while (left := deadline - time.monotonic()) > 0:
            if not dealer.poll(int(left * 1000) + 1):
                continue
            frames = dealer.recv_multipart()  # [b"", (topic,) seq, payload]
            if len(frames) < 2 or int.from_bytes(frames[-2], "big", signed=True) == END_OF_REPLAY:
                return
            try:
                batch = decode(frames[-2:])
            except KvEventDecodeError:
                return
            if batch.seq < expected:
                continue  # before the start: vLLM sends its whole buffer from `start` on
            if batch.seq != expected:
                return
            expected += 1
            yield batch
    finally:
        dealer.close(linger=0)
