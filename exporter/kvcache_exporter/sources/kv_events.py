"""vLLM's KV-cache event stream (ZMQ PUB) as a source: the subscriber. See docs/kv-events.md.

`KvEventSubscriber` owns the SUB socket (and a DEALER for replay) in a thread of its own, which
receives, rate-limits on arrival, decodes, fills gaps by replay and queues each batch (bounded in
batches, block hashes and token ids: past the bound a message is dropped before it is decoded).
Nothing of that work runs on the event loop, so a flood of events never delays a scrape.
`collect()` (the Source protocol) drains the queue for the poll state, which applies the batches
to the event view (derive/kv_events.py) and to any other consumer (miss attribution, the fleet
view); it raises while the socket is down, keeping the queue for the next poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable

import zmq

from .base import SourceError
from .engine_events import decode_engine_message
from .kv_events_decode import (
    Batch,
    Dropped,
    KvEventDecodeError,
    KvEventDrain,
    TokenBucket,
    decode_message,
    gap,
    peek_seq,
    weight,
)

__all__ = [
    "Batch",
    "KvEventDecodeError",
    "KvEventDrain",
    "KvEventSubscriber",
    "decode_message",
    "rank_endpoint",
    "subscriber_mode",
]

log = logging.getLogger(__name__)

END_OF_REPLAY = -1
RCV_HWM = 10_000
RETRY_SECONDS = 1.0
REPLAY_BACKOFF_SECONDS = 30.0
POLL_MS = 100  # how often the receive thread looks at its stop flag when the stream is idle
REFUSED_LOG_SECONDS = 60.0
MAX_PENDING = 100_000  # batches queued between two polls; past it, messages are only counted
# The work queued between two polls (dropped past it as `budget_exceeded`): what one poll applies
# and what the queue holds in memory (a decoded hash ~45-110 bytes, a token id ~36). A saturated
# H200 stores ~15k blocks/s (16 token ids each) and removes as many: a 5 s poll queues ~150k hashes
# and ~1.2M token ids, within these. Worst case ~60 + 75 MiB, ~1 s of attribution.
MAX_PENDING_HASHES = 1 << 19
MAX_PENDING_TOKENS = 1 << 21


def subscriber_mode(vllm_endpoint: str) -> str:
    """Our SUB's mode for vLLM's `endpoint`: its PUB binds on wildcards and ipc/inproc, else connects."""
    binds = "*" in vllm_endpoint or "::" in vllm_endpoint or vllm_endpoint.startswith(("ipc://", "inproc://"))
    return "connect" if binds else "bind"


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Where data-parallel rank `rank` publishes, as vLLM derives it (offset_endpoint_port): a tcp
    port plus the rank (port 0 stays 0), `_dp<rank>` after ipc/inproc addresses; rank 0 unchanged."""
    if rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return endpoint
    return f"{base}:{int(port) + rank}"


def subscriber_socket(ctx: zmq.Context, topic: str, max_message_bytes: int) -> zmq.Socket:
    """A SUB socket on `topic` as serve's subscriber and the aggregator's lanes both open it."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, RCV_HWM)
    sub.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # larger messages: the peer is disconnected
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    return sub


class KvEventSubscriber:
    """Subscribes to one vLLM publisher (one data-parallel rank) in a thread that never raises.

    mode "bind" when vLLM's endpoint is a concrete tcp address (its PUB connects to us), "connect"
    when vLLM binds (`*`, `::`, ipc://, inproc://); see `subscriber_mode`.
    """

    name = "kv_events"

    def __init__(
        self,
        endpoint: str,
        mode: str = "bind",
        topic: str = "",
        replay_endpoint: str | None = None,
        max_batches_per_second: float = 20000,
        max_message_bytes: int = 16 * 1024 * 1024,
        replay_timeout: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        with_tokens: bool = False,
        max_pending_hashes: int = MAX_PENDING_HASHES,
        max_pending_tokens: int = MAX_PENDING_TOKENS,
        engine: str = "vllm",
    ):
        if mode not in ("bind", "connect"):
            raise ValueError(f"mode must be 'bind' or 'connect', not {mode!r}")
        self.endpoint, self.mode, self.topic = endpoint, mode, topic
        self.replay_endpoint = replay_endpoint
        self.max_message_bytes = max_message_bytes
        self.replay_timeout = replay_timeout
        self.with_tokens = with_tokens  # decode parents and token ids too: miss attribution needs them
        self.engine = engine  # whose media and page rules its events follow (engine_events.py)
        self.max_pending = (max_pending_hashes, max_pending_tokens)
        self.lock = threading.Lock()  # guards the queue between the thread and collect()
        self.healthy = False
        self.problem: SourceError | None = None  # why the socket is not reading, for collect()
        self.last_endpoint: str | None = None  # the address actually bound (resolves a `:*` port)
        self.last_message_time: float | None = None  # time.time() of the last message received
        self._ctx = zmq.Context()
        self._sub: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._replay_paused_until = 0.0
        self._logged: set[str] = set()
        self._refused_quiet_until = float("-inf")
        self._bucket = TokenBucket(max_batches_per_second, clock)
        self._expected: int | None = None  # the seq expected next (thread only), to ask replay for gaps
        self._pending: list[Batch | Dropped] = []
        self._pending_work = (0, 0)  # (hashes, token ids) of the queued batches

    def start(self) -> None:
        """Open the socket now (errors are retried by the thread) and start receiving."""
        if self._thread is None:
            with contextlib.suppress(zmq.ZMQError):
                self._open()
            self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
            self._thread.start()

    async def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        self._close()
        self._ctx.destroy(linger=0)

    async def collect(self) -> KvEventDrain:
        """What arrived since the last collect; raises (keeping the queue) while the socket is down."""
        if not self.healthy:
            raise self.problem or SourceError("not_started", f"KV events {self.endpoint}: not subscribed")
        return self.drain()

    @property
    def queued(self) -> int:
        """Messages the next collect hands over, applied or dropped (a run of drops by its count)."""
        with self.lock:
            return sum(item.count if isinstance(item, Dropped) else 1 for item in self._pending)

    def drain(self) -> KvEventDrain:
        with self.lock:
            drained, self._pending, self._pending_work = self._pending, [], (0, 0)
        return KvEventDrain(tuple(drained))

    async def close(self) -> None:
        await self.stop()

    def _open(self) -> None:
        sub = subscriber_socket(self._ctx, self.topic, self.max_message_bytes)
        try:
            (sub.bind if self.mode == "bind" else sub.connect)(self.endpoint)
        except zmq.ZMQError as err:
            sub.close(linger=0)
            self._fail(err)
            raise
        self.last_endpoint = sub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._sub, self.healthy, self.problem = sub, True, None

    def _close(self) -> None:
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None
        self.healthy = False

    def _fail(self, err: Exception) -> None:
        """Logged by the poll loop, once per reason, when collect() raises it."""
        self.healthy = False
        reason = "zmq_error" if isinstance(err, zmq.ZMQError) else "internal_error"
        self.problem = SourceError(reason, f"KV events {self.mode} {self.endpoint}: {err}")

    def _log_once(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            log.warning("%s (logged once)", message)

    def _log_refused(self, batch: Batch) -> None:
        """One line a minute at most: a buggy engine refuses events in every batch."""
        now = time.monotonic()
        if now >= self._refused_quiet_until:
            self._refused_quiet_until = now + REFUSED_LOG_SECONDS
            log.warning(
                "KV events refused (%s), the rest of the batch kept: %s (next such line in %.0f s at the "
                "earliest)",
                ", ".join(sorted(set(batch.refused))),
                batch.problem,
                REFUSED_LOG_SECONDS,
            )

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._sub is None:
                    self._open()
                assert self._sub is not None
                if self._sub.poll(POLL_MS):
                    self._drain(self._sub)
            except Exception as err:  # the exporter must outlive any socket or stream trouble
                self._fail(err)
                self._close()
                self._stop.wait(RETRY_SECONDS)

    def _drain(self, sub: zmq.Socket) -> None:
        """Everything queued now: the rate is enforced as messages are taken off the socket, and a
        dropped message costs one receive and one bucket check, so the thread keeps up with a flood."""
        while not self._stop.is_set():
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.last_message_time = time.time()
            if not self._bucket.take():
                self._drop("rate_limited", peek_seq(frames))
                continue
            if self._queue_full():  # not even decoded: the next poll has all the work it may have
                self._drop("budget_exceeded", peek_seq(frames))
                continue
            self._handle(frames)

    def _handle(self, frames: list[bytes]) -> None:
        try:
            batch = decode_engine_message(frames, self.with_tokens, self.engine)
        except KvEventDecodeError as err:
            log.debug("dropping KV-event message: %s", err)
            self._drop(err.reason, err.seq)  # parse_error or batch_too_heavy
            return
        if batch.refused:
            self._log_refused(batch)
        lost = gap(self._expected, batch.seq)
        replayed = []
        if lost and self.replay_endpoint and time.monotonic() >= self._replay_paused_until:
            replayed = self._replay(lost)
        for each in (*replayed, batch):
            self._queue(each)

    def _queue_full(self) -> bool:
        hashes, tokens = self._pending_work
        return hashes >= self.max_pending[0] or tokens >= self.max_pending[1]

    def _queue(self, batch: Batch) -> None:
        if len(self._pending) >= MAX_PENDING:
            self._drop("rate_limited", batch.seq)
            return
        hashes, tokens = weight(batch.events)
        with self.lock:
            queued_hashes, queued_tokens = self._pending_work
            hashes, tokens = queued_hashes + hashes, queued_tokens + tokens
            fits = hashes <= self.max_pending[0] and tokens <= self.max_pending[1]
            if fits:
                self._pending.append(batch)
                self._pending_work = (hashes, tokens)
        if not fits:
            self._drop("budget_exceeded", batch.seq)
            return
        self._expected = batch.seq + 1

    def _drop(self, reason: str, seq: int | None) -> None:
        if seq is not None:
            self._expected = seq + 1
        with self.lock:
            queue_drop(self._pending, reason, seq)

    def _replay(self, gap: range) -> list[Batch]:
        """Ask vLLM's replay ROUTER for `gap`; return what it had, in order, within replay_timeout."""
        got: list[Batch] = []
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        try:
            dealer.connect(self.replay_endpoint)
            if not self._fetch(dealer, gap, got, time.monotonic() + self.replay_timeout):
                self._log_once(f"KV-event replay from {self.replay_endpoint} timed out")
                if not got:
                    self._replay_paused_until = time.monotonic() + REPLAY_BACKOFF_SECONDS
        except zmq.ZMQError as err:
            self._log_once(f"KV-event replay from {self.replay_endpoint} failed: {err!r}")
            self._replay_paused_until = time.monotonic() + REPLAY_BACKOFF_SECONDS
        finally:
            dealer.close(linger=0)
        return got

    def _fetch(self, dealer: zmq.Socket, gap: range, got: list[Batch], deadline: float) -> bool:
        """Collect replayed batches of `gap` into `got`; False when the deadline passed first.
        What the queue could not take is not fetched: the rest of the gap counts as missed."""
        # The empty frame makes the request [identity, b"", start] at the ROUTER, as vLLM expects.
        dealer.send_multipart([b"", gap.start.to_bytes(8, "big")])
        room = [bound - queued for bound, queued in zip(self.max_pending, self._pending_work, strict=True)]
        while (left := deadline - time.monotonic()) > 0:
            if not dealer.poll(int(left * 1000) + 1):
                continue
            # Replies are [b"", (topic,) seq, payload]; some vLLM versions add the topic frame.
            frames = dealer.recv_multipart()
            if len(frames) < 2 or int.from_bytes(frames[-2], "big", signed=True) == END_OF_REPLAY:
                return True
            try:
                batch = decode_engine_message(frames[-2:], self.with_tokens, self.engine)
            except KvEventDecodeError as err:
                self._drop(err.reason, None)
                log.debug("dropping replayed KV-event message: %s", err)
                continue
            if batch.seq >= gap.stop:
                return True  # the live stream delivers the rest
            if batch.seq >= gap.start:
                room = [r - w for r, w in zip(room, weight(batch.events), strict=True)]
                if min(room) < 0:
                    return True
                got.append(batch)
        return False


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
