"""vLLM's KV-cache event stream (ZMQ PUB) as a source: the subscriber. See docs/kv-events.md.

`KvEventSubscriber` owns the SUB socket (and a DEALER for replay) in a thread of its own, which
receives, rate-limits on arrival, decodes and applies each batch to the pure `EventState`
(kv_events_decode.py) and to any further sinks (miss attribution, the fleet view) under one lock.
Nothing of that work runs on the event loop, so a flood of events never delays a scrape: readers
take `lock` only for the microseconds a consistent view takes to copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence

import zmq

from .base import Sample
from .kv_events_decode import Batch, EventState, KvEventDecodeError, decode_message, peek_seq

__all__ = [
    "Batch",
    "EventState",
    "KvEventDecodeError",
    "KvEventSubscriber",
    "decode_message",
    "subscriber_mode",
]

log = logging.getLogger(__name__)

END_OF_REPLAY = -1
RCV_HWM = 10_000
RETRY_SECONDS = 1.0
REPLAY_BACKOFF_SECONDS = 30.0
POLL_MS = 100  # how often the receive thread looks at its stop flag when the stream is idle
Sink = Callable[[Batch], None]


def subscriber_mode(vllm_endpoint: str) -> str:
    """Our SUB's mode for vLLM's `endpoint`: its PUB binds on wildcards and ipc/inproc, else connects."""
    binds = "*" in vllm_endpoint or "::" in vllm_endpoint or vllm_endpoint.startswith(("ipc://", "inproc://"))
    return "connect" if binds else "bind"


class KvEventSubscriber:
    """Subscribes to one vLLM publisher (one data-parallel rank) in a thread that never raises.

    mode "bind" when vLLM's endpoint is a concrete tcp address (its PUB connects to us), "connect"
    when vLLM binds (`*`, `::`, ipc://, inproc://); see `subscriber_mode`.
    """

    def __init__(
        self,
        endpoint: str,
        mode: str = "bind",
        topic: str = "",
        replay_endpoint: str | None = None,
        max_batches_per_second: float = 20000,
        max_message_bytes: int = 16 * 1024 * 1024,
        max_blocks: int = 1_000_000,
        replay_timeout: float = 2.0,
        sinks: Sequence[Sink] = (),
    ):
        if mode not in ("bind", "connect"):
            raise ValueError(f"mode must be 'bind' or 'connect', not {mode!r}")
        self.endpoint, self.mode, self.topic = endpoint, mode, topic
        self.replay_endpoint = replay_endpoint
        self.max_message_bytes = max_message_bytes
        self.replay_timeout = replay_timeout
        self.state = EventState(max_blocks, max_batches_per_second)
        self.sinks: list[Sink] = [self.state.apply, *sinks]
        self.lock = threading.Lock()  # held while a batch is applied; take it for a consistent view
        self.healthy = False
        self.last_endpoint: str | None = None  # the address actually bound (resolves a `:*` port)
        self.last_message_time: float | None = None  # time.time() of the last message received
        self._ctx = zmq.Context()
        self._sub: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._replay_paused_until = 0.0
        self._logged: set[str] = set()

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

    def samples(self) -> list[Sample]:
        with self.lock:
            return self.state.samples()

    def _open(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, RCV_HWM)
        sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)  # larger messages: the peer is disconnected
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        try:
            (sub.bind if self.mode == "bind" else sub.connect)(self.endpoint)
        except zmq.ZMQError as err:
            sub.close(linger=0)
            self._fail(err)
            raise
        self.last_endpoint = sub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._sub, self.healthy = sub, True

    def _close(self) -> None:
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None
        self.healthy = False

    def _fail(self, err: Exception) -> None:
        self.healthy = False
        self._log_once(f"KV events {self.mode} {self.endpoint}: {err}")

    def _log_once(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            log.warning("%s (logged once)", message)

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
        state = self.state
        while not self._stop.is_set():
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.last_message_time = time.time()
            if not state.admit():
                with self.lock:
                    state.drop("rate_limited", peek_seq(frames))
                continue
            self._handle(frames)

    def _handle(self, frames: list[bytes]) -> None:
        try:
            batch = decode_message(frames)
        except KvEventDecodeError as err:
            log.debug("dropping KV-event message: %s", err)
            with self.lock:
                self.state.drop("parse_error", err.seq)
            return
        gap = self.state.missing(batch.seq)
        replayed = []
        if gap and self.replay_endpoint and time.monotonic() >= self._replay_paused_until:
            replayed = self._replay(gap)
        with self.lock:
            for each in (*replayed, batch):
                for sink in self.sinks:
                    sink(each)

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
        """Collect replayed batches of `gap` into `got`; False when the deadline passed first."""
        # The empty frame makes the request [identity, b"", start] at the ROUTER, as vLLM expects.
        dealer.send_multipart([b"", gap.start.to_bytes(8, "big")])
        while (left := deadline - time.monotonic()) > 0:
            if not dealer.poll(int(left * 1000) + 1):
                continue
            # Replies are [b"", (topic,) seq, payload]; some vLLM versions add the topic frame.
            frames = dealer.recv_multipart()
            if len(frames) < 2 or int.from_bytes(frames[-2], "big", signed=True) == END_OF_REPLAY:
                return True
            try:
                batch = decode_message(frames[-2:])
            except KvEventDecodeError as err:
                with self.lock:
                    self.state.drop("parse_error")
                log.debug("dropping replayed KV-event message: %s", err)
                continue
            if batch.seq >= gap.stop:
                return True  # the live stream delivers the rest
            if batch.seq >= gap.start:
                got.append(batch)
        return False
