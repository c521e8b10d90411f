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
from zmq.utils.monitor import recv_monitor_message

from ..logs import Throttled
from .base import SourceError
from .engine_events import decode_engine_message
from .kv_events_decode import MAX_BATCH_BYTES, Batch, KvEventDecodeError, KvEventDrain, decode_message, weight
from .kv_intake import MAX_PENDING, MAX_PENDING_HASHES, MAX_PENDING_TOKENS, KvIntake, queue_drop

__all__ = [
    "MAX_PENDING",
    "Batch",
    "KvEventDecodeError",
    "KvEventDrain",
    "KvEventSubscriber",
    "decode_message",
    "queue_drop",
    "rank_endpoint",
    "subscriber_mode",
]

log = logging.getLogger(__name__)

END_OF_REPLAY = -1
RETRY_SECONDS = 1.0
REPLAY_BACKOFF_SECONDS = 30.0
POLL_MS = 100  # how often the receive thread looks at its stop flag when the stream is idle
REFUSED_LOG_SECONDS = 60.0
# libzmq's own bound on one message. Past it libzmq reads and discards the message without a word
# (no monitor event, the connection kept: only the next message's seq gap shows it, as missed), so
# it is set 16x above the bytes bound the decoder refuses at (MAX_BATCH_BYTES, 4 MiB), where the
# refusal is ours, counted by reason and logged: what one message may cost in memory at most.
ZMQ_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# libzmq's receive queue counts messages, not bytes: with room for thousands, a burst of valid
# messages just under MAX_BATCH_BYTES sat there whole (236 MiB) before the intake could refuse any.
# It holds as many as ZMQ_QUEUE_BYTES takes at that bound; past it libzmq stops reading the
# connection, so the rest waits in the kernel's socket buffers and at the publisher (TCP
# backpressure), whose own high-water mark drops past it: a sequence gap here, counted missed.
ZMQ_QUEUE_BYTES = 8 * 1024 * 1024
RCV_HWM = max(1, ZMQ_QUEUE_BYTES // MAX_BATCH_BYTES)
PEER_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


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
    sub.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # larger: discarded by libzmq, seen as a gap
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
        max_message_bytes: int = ZMQ_MAX_MESSAGE_BYTES,
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
        self.intake = KvIntake(
            max_batches_per_second, max_pending_hashes, max_pending_tokens, with_tokens, clock,
            engine=engine, on_error=self._log_dropped,
        )  # fmt: skip
        self.healthy = False
        self.problem: SourceError | None = None  # why the socket is not reading, for collect()
        self.last_endpoint: str | None = None  # the address actually bound (resolves a `:*` port)
        self.last_message_time: float | None = None  # time.time() of the last message received
        self._ctx = zmq.Context()
        self._sub: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._peers = 0  # publishers connected now, as the socket monitor tells (thread only)
        self._ever_connected = False
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._replay_paused_until = 0.0
        self._logged: set[str] = set()
        self._refused_log = Throttled(log, REFUSED_LOG_SECONDS)
        self._dropped_log = Throttled(log, REFUSED_LOG_SECONDS)

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
    def publisher_state(self) -> str:
        """connected, disconnected or never_connected (kv_event_streams.PUBLISHER_STATES)."""
        if self._peers > 0:
            return "connected"
        return "disconnected" if self._ever_connected else "never_connected"

    @property
    def queued(self) -> int:
        """Messages the next collect hands over, applied or dropped (a run of drops by its count)."""
        return self.intake.queued

    def drain(self) -> KvEventDrain:
        return self.intake.drain()

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
        self._monitor = sub.get_monitor_socket(PEER_EVENTS)
        self._sub, self.healthy, self.problem = sub, True, None

    def _close(self) -> None:
        if self._sub is not None:
            if self._monitor is not None:
                self._sub.disable_monitor()
                self._monitor.close(linger=0)
                self._monitor, self._peers = None, 0
            self._sub.close(linger=0)
            self._sub = None
        self.healthy = False

    def _watch_peers(self) -> None:
        """Publishers connecting and leaving, from the socket monitor (never blocks)."""
        while self._monitor is not None and self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self._peers = max(self._peers - 1, 0)
            else:
                self._peers += 1
                self._ever_connected = True

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
        self._refused_log.warning(
            "KV events refused (%s), the rest of the batch kept: %s",
            ", ".join(sorted(set(batch.refused))),
            batch.problem,
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._sub is None:
                    self._open()
                assert self._sub is not None
                if self._sub.poll(POLL_MS):
                    self._drain(self._sub)
                self._watch_peers()
            except Exception as err:  # the exporter must outlive any socket or stream trouble
                self._fail(err)
                self._close()
                self._stop.wait(RETRY_SECONDS)

    def _drain(self, sub: zmq.Socket) -> None:
        """Everything queued now: the rate is enforced as messages are taken off the socket, and a
        dropped message costs one receive and one bucket check, so the thread keeps up with a flood."""
        while not self._stop.is_set():
            try:  # not copied: a batch decoded keeps libzmq's message, one dropped frees it
                frames = [frame.buffer for frame in sub.recv_multipart(zmq.NOBLOCK, copy=False)]
            except zmq.Again:
                return
            self.last_message_time = time.time()
            if (batch := self.intake.take(frames)) is not None:
                self._handle(batch)

    def _log_dropped(self, err: KvEventDecodeError) -> None:
        self._dropped_log.warning("KV-event message dropped (%s): %s", err.reason, err)

    def _handle(self, batch: Batch) -> None:
        if batch.refused:
            self._log_refused(batch)
        lost = self.intake.cursor.gap(batch.seq)
        replayed = []
        if lost and self.replay_endpoint and time.monotonic() >= self._replay_paused_until:
            replayed = self._replay(lost)
        for each in (*replayed, batch):
            self.intake.put(each)

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
        room = self.intake.room()
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
                self.intake.drop(err.reason, None)
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
