"""Every replica's KV-event stream through one ZMQ context, a few SUB sockets and one thread.

A SUB socket per replica (and a context each, as before) costs ~8 file descriptors a replica:
300 replicas exhausted the usual 1,024. Here one SUB socket ("lane") connects to many replicas'
publishers, and each message is told apart by its sender's IP address (libzmq's `Peer-Address`
message property). So a lane holds at most one endpoint per IP address; a second endpoint on one
address (two ranks of one host) goes to another lane, and an endpoint that names a host (or is
not tcp) gets a lane of its own, whose messages need no telling apart. The cost is one descriptor
per connected publisher, one per lane and a fixed few for the context: 1,000 pod IPs, ~1,010.

The thread receives, rate-limits and decodes; `drain(name)` hands a replica's batches to the
poll loop. Lanes change only in the thread (ZMQ sockets stay in one thread): add and remove queue
a command that the thread applies within POLL_MS.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import zmq

from ..sources.base import SourceError
from ..sources.engine_events import decode_engine_message
from ..sources.kv_events import MAX_PENDING, POLL_MS, queue_drop, subscriber_socket
from ..sources.kv_events_decode import (
    Batch,
    Dropped,
    KvEventDecodeError,
    KvEventDrain,
    TokenBucket,
    peek_seq,
    weight,
)

log = logging.getLogger("kvcache_exporter.aggregate")

BURST = 256  # messages taken off one lane before the next lane's turn
RECONNECT_MAX_MS = 10_000


def peer_key(endpoint: str) -> str | None:
    """The IP address a tcp endpoint connects to (what Peer-Address reports), None for a host name
    or another transport: those get a lane of their own."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or not parts.hostname:
        return None
    try:
        return str(ipaddress.ip_address(parts.hostname))
    except ValueError:
        return None


def _normalized(address: str | None) -> str | None:
    try:
        return str(ipaddress.ip_address(address)) if address else None
    except ValueError:
        return None


@dataclass
class _Inbox:
    """One replica's batches since the last drain (guarded by FleetEvents.lock), at most
    `max_hashes` block hashes of them: past it a batch is dropped as budget_exceeded."""

    bucket: TokenBucket
    max_hashes: int
    engine: str = "vllm"  # whose media and page rules its events follow (sources/engine_events.py)
    items: list[Batch | Dropped] = field(default_factory=list)
    hashes: int = 0

    def full(self) -> bool:
        return self.hashes >= self.max_hashes

    def put(self, item: Batch) -> None:
        hashes = weight(item.events)[0]
        if len(self.items) >= MAX_PENDING:
            self.drop("rate_limited", item.seq)
        elif self.hashes + hashes > self.max_hashes:
            self.drop("budget_exceeded", item.seq)
        else:
            self.items.append(item)
            self.hashes += hashes

    def drop(self, reason: str, seq: int | None) -> None:
        queue_drop(self.items, reason, seq)


@dataclass
class _Lane:
    socket: zmq.Socket
    shared: bool  # several IP-literal endpoints, one per address; else exactly one endpoint
    by_peer: dict[str | None, str] = field(default_factory=dict)  # peer IP -> replica name
    endpoints: dict[str, str] = field(default_factory=dict)  # replica name -> endpoint


class FleetEvents:
    def __init__(
        self,
        topic: str = "",
        max_batches_per_second: float = 20000,
        max_pending_hashes: int = 131_072,
        max_message_bytes: int = 16 * 1024 * 1024,
    ):
        self.topic, self.rate, self.max_message_bytes = topic, max_batches_per_second, max_message_bytes
        self.max_pending_hashes = max_pending_hashes
        self.lock = threading.Lock()
        self.unknown_sender = 0  # messages from an address no replica has (one just removed)
        self._inboxes: dict[str, _Inbox] = {}
        self._problems: dict[str, SourceError] = {}  # why a replica's endpoint is not subscribed
        self._ctx = zmq.Context(io_threads=1)
        self._lanes: list[_Lane] = []  # the thread's only
        self._commands: queue.SimpleQueue[tuple[str, str, str]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the poll loop's side ---------------------------------------------------------------

    def add(self, name: str, endpoint: str, engine: str = "vllm") -> None:
        with self.lock:
            bucket = TokenBucket(self.rate, time.monotonic)
            self._inboxes[name] = _Inbox(bucket, self.max_pending_hashes, engine)
            self._problems[name] = SourceError("not_started", f"KV events {endpoint}: not subscribed yet")
        self._commands.put(("add", name, endpoint))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fleet-kv-events", daemon=True)
            self._thread.start()

    def remove(self, name: str) -> None:
        with self.lock:
            self._inboxes.pop(name, None)
            self._problems.pop(name, None)
        self._commands.put(("remove", name, ""))

    def healthy(self, name: str) -> bool:
        with self.lock:
            return name in self._inboxes and name not in self._problems

    def drain(self, name: str) -> KvEventDrain:
        """What replica `name` sent since the last drain; SourceError while it is not subscribed."""
        with self.lock:
            if (problem := self._problems.get(name)) is not None:
                raise problem
            inbox = self._inboxes.get(name)
            if inbox is None:
                raise SourceError("not_started", f"KV events of {name}: not watched")
            items, inbox.items, inbox.hashes = inbox.items, [], 0
        return KvEventDrain(tuple(items))

    def lanes(self) -> int:
        return len(self._lanes)

    async def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        self._close_lanes()
        self._ctx.term()

    # --- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        while not self._stop.is_set():
            try:
                self._apply_commands(poller)
                for sock, _ in poller.poll(POLL_MS):
                    self._receive(next(lane for lane in self._lanes if lane.socket is sock))
            except Exception:  # the thread must outlive any socket or stream trouble
                log.exception("KV-event receive loop failed; going on")
                self._stop.wait(POLL_MS / 1000)
        for lane in self._lanes:
            poller.unregister(lane.socket)

    def _apply_commands(self, poller: zmq.Poller) -> None:
        while True:
            try:
                command, name, endpoint = self._commands.get_nowait()
            except queue.Empty:
                return
            if command == "add":
                self._connect(poller, name, endpoint)
            else:
                self._disconnect(poller, name)

    def _connect(self, poller: zmq.Poller, name: str, endpoint: str) -> None:
        self._disconnect(poller, name)  # a changed endpoint: off its old lane first
        key = peer_key(endpoint)
        lane = next(
            (ln for ln in self._lanes if key is not None and ln.shared and key not in ln.by_peer), None
        )
        try:
            if lane is None:
                lane = _Lane(self._socket(), shared=key is not None)
                poller.register(lane.socket, zmq.POLLIN)
                self._lanes.append(lane)
            lane.socket.connect(endpoint)
        except zmq.ZMQError as err:
            reason = "fd_exhausted" if err.errno in (errno.EMFILE, errno.ENFILE) else "zmq_error"
            with self.lock:
                if name in self._inboxes:
                    self._problems[name] = SourceError(reason, f"KV events connect {endpoint}: {err}")
            if lane is not None and not lane.endpoints:
                self._drop_lane(poller, lane)
            return
        lane.by_peer[key] = name
        lane.endpoints[name] = endpoint
        with self.lock:
            self._problems.pop(name, None)

    def _disconnect(self, poller: zmq.Poller, name: str) -> None:
        for lane in self._lanes:
            endpoint = lane.endpoints.pop(name, None)
            if endpoint is None:
                continue
            lane.by_peer = {k: v for k, v in lane.by_peer.items() if v != name}
            if lane.endpoints:
                try:
                    lane.socket.disconnect(endpoint)
                except zmq.ZMQError:
                    pass  # not connected (yet): nothing to undo
            else:
                self._drop_lane(poller, lane)
            return

    def _drop_lane(self, poller: zmq.Poller, lane: _Lane) -> None:
        poller.unregister(lane.socket)
        lane.socket.close(linger=0)
        self._lanes.remove(lane)

    def _socket(self) -> zmq.Socket:
        sub = subscriber_socket(self._ctx, self.topic, self.max_message_bytes)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)  # a dead replica: back off, not 10/s
        return sub

    def _receive(self, lane: _Lane) -> None:
        for _ in range(BURST):
            try:
                frames = lane.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if lane.shared:
                name = lane.by_peer.get(_normalized(frames[-1].get("Peer-Address")))
            else:
                name = next(iter(lane.endpoints), None)
            self._handle(name, [frame.bytes for frame in frames])

    def _handle(self, name: str | None, frames: list[bytes]) -> None:
        with self.lock:
            inbox = self._inboxes.get(name) if name is not None else None
            if inbox is None:
                self.unknown_sender += 1
                return
            if not inbox.bucket.take():
                inbox.drop("rate_limited", peek_seq(frames))
                return
            if inbox.full():  # not even decoded: the next drain has all the work it may have
                inbox.drop("budget_exceeded", peek_seq(frames))
                return
        try:
            # outside the lock: the poll loop may drain meanwhile
            batch = decode_engine_message(frames, engine=inbox.engine)
        except KvEventDecodeError as err:
            with self.lock:
                inbox.drop(err.reason, err.seq)  # parse_error or batch_too_heavy
            return
        with self.lock:
            inbox.put(batch)

    def _close_lanes(self) -> None:
        for lane in self._lanes:
            lane.socket.close(linger=0)
        self._lanes.clear()
