"""vLLM's KV-cache event stream (ZMQ PUB) as a source: the async subscriber. See docs/kv-events.md.

`KvEventSubscriber` owns the SUB socket (and a DEALER for replay) and feeds the pure `EventState`
(kv_events_decode.py), which turns decoded batches into counters and the set of resident block hashes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import zmq
import zmq.asyncio

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


def subscriber_mode(vllm_endpoint: str) -> str:
    """Our SUB's mode for vLLM's `endpoint`: its PUB binds on wildcards and ipc/inproc, else connects."""
    binds = "*" in vllm_endpoint or "::" in vllm_endpoint or vllm_endpoint.startswith(("ipc://", "inproc://"))
    return "connect" if binds else "bind"


class KvEventSubscriber:
    """Subscribes to one vLLM publisher (one data-parallel rank) in a background task that never raises.

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
    ):
        if mode not in ("bind", "connect"):
            raise ValueError(f"mode must be 'bind' or 'connect', not {mode!r}")
        self.endpoint, self.mode, self.topic = endpoint, mode, topic
        self.replay_endpoint = replay_endpoint
        self.max_message_bytes = max_message_bytes
        self.replay_timeout = replay_timeout
        self.state = EventState(max_blocks, max_batches_per_second)
        self.healthy = False
        self.last_endpoint: str | None = None  # the address actually bound (resolves a `:*` port)
        self.last_message_time: float | None = None  # time.time() of the last message received
        self._ctx = zmq.asyncio.Context()
        self._sub: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self._replay_paused_until = 0.0
        self._logged: set[str] = set()

    def start(self) -> None:
        """Open the socket now (errors are retried by the loop) and run the receive loop."""
        if self._task is None:
            with contextlib.suppress(zmq.ZMQError):
                self._open()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-events")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._close()
        self._ctx.destroy(linger=0)

    def samples(self) -> list[Sample]:
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

    async def _run(self) -> None:
        while True:
            try:
                if self._sub is None:
                    self._open()
                assert self._sub is not None
                await self._handle(await self._sub.recv_multipart())
            except asyncio.CancelledError:
                raise
            except Exception as err:  # the exporter must outlive any socket or stream trouble
                self._fail(err)
                self._close()
                await asyncio.sleep(RETRY_SECONDS)

    async def _handle(self, frames: list[bytes]) -> None:
        self.last_message_time = time.time()
        state = self.state
        if not state.admit():
            state.drop("rate_limited", peek_seq(frames))
            return
        try:
            batch = decode_message(frames)
        except KvEventDecodeError as err:
            log.debug("dropping KV-event message: %s", err)
            state.drop("parse_error", err.seq)
            return
        gap = state.missing(batch.seq)
        if gap and self.replay_endpoint and time.monotonic() >= self._replay_paused_until:
            for replayed in await self._replay(gap):
                state.apply(replayed)
        state.apply(batch)

    async def _replay(self, gap: range) -> list[Batch]:
        """Ask vLLM's replay ROUTER for `gap`; return what it had, in order, within replay_timeout."""
        got: list[Batch] = []
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        try:
            dealer.connect(self.replay_endpoint)
            await asyncio.wait_for(self._fetch(dealer, gap, got), self.replay_timeout)
        except (TimeoutError, zmq.ZMQError) as err:
            self._log_once(f"KV-event replay from {self.replay_endpoint} failed: {err!r}")
            if not got:
                self._replay_paused_until = time.monotonic() + REPLAY_BACKOFF_SECONDS
        finally:
            dealer.close(linger=0)
        return got

    async def _fetch(self, dealer: zmq.asyncio.Socket, gap: range, got: list[Batch]) -> None:
        # The empty frame makes the request [identity, b"", start] at the ROUTER, as vLLM expects.
        await dealer.send_multipart([b"", gap.start.to_bytes(8, "big")])
        while True:
            # Replies are [b"", (topic,) seq, payload]; some vLLM versions add the topic frame.
            frames = await dealer.recv_multipart()
            if len(frames) < 2 or int.from_bytes(frames[-2], "big", signed=True) == END_OF_REPLAY:
                return
            try:
                batch = decode_message(frames[-2:])
            except KvEventDecodeError as err:
                self.state.drop("parse_error")
                log.debug("dropping replayed KV-event message: %s", err)
                continue
            if batch.seq >= gap.stop:
                return  # the live stream delivers the rest
            if batch.seq >= gap.start:
                got.append(batch)
