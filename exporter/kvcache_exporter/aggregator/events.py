"""Every replica's KV-event stream through one ZMQ context, a few SUB sockets and one thread.

A SUB socket per replica (and a context each, as before) costs ~8 file descriptors a replica:
300 replicas exhausted the usual 1,024. Here one SUB socket ("lane") connects to many replicas'
publishers, and each message is told apart by its sender's IP address (libzmq's `Peer-Address`
message property). So a lane holds at most one endpoint per IP address; a second endpoint on one
address (two ranks of one host) goes to another lane, and an endpoint that names a host (or is
not tcp) gets a lane of its own, whose messages need no telling apart, as does an endpoint we bind
(a vLLM that connects out to its own host's address, followed where we run on that host). The cost
is one descriptor per connected publisher, one per lane and a fixed few for the context: 1,000 pod
IPs, ~1,010.

A name is a replica's stream: the replica, or (replica, rank) for each data-parallel rank.

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
from collections.abc import Hashable
from dataclasses import dataclass, field
from functools import partial
from urllib.parse import urlsplit

import zmq

from ..logs import Throttled
from ..sources.base import SourceError
from ..sources.kv_events import POLL_MS, ZMQ_MAX_MESSAGE_BYTES, subscriber_socket
from ..sources.kv_events_decode import KvEventDrain
from ..sources.kv_intake import KvIntake

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
class _Lane:
    socket: zmq.Socket
    shared: bool  # several IP-literal endpoints, one per address; else exactly one endpoint
    by_peer: dict[str | None, Hashable] = field(default_factory=dict)  # peer IP -> stream name
    endpoints: dict[Hashable, str] = field(default_factory=dict)  # stream name -> endpoint


class FleetEvents:
    def __init__(
        self,
        topic: str = "",
        max_batches_per_second: float = 20000,
        max_pending_hashes: int = 131_072,
        max_message_bytes: int = ZMQ_MAX_MESSAGE_BYTES,
    ):
        self.topic, self.rate, self.max_message_bytes = topic, max_batches_per_second, max_message_bytes
        self.max_pending_hashes = max_pending_hashes
        self.lock = threading.Lock()
        self.unknown_sender = 0  # messages from an address no replica has (one just removed)
        self._intakes: dict[Hashable, KvIntake] = {}
        self._problems: dict[Hashable, SourceError] = {}  # why a stream's endpoint is not subscribed
        self._ctx = zmq.Context(io_threads=1)
        self._lanes: list[_Lane] = []  # the thread's only
        self._commands: queue.SimpleQueue[tuple[str, Hashable, str, str]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dropped_log = Throttled(log)

    # --- the poll loop's side ---------------------------------------------------------------

    def add(self, name: Hashable, endpoint: str, mode: str = "connect", engine: str = "vllm") -> None:
        """Follow `endpoint`: connect (vLLM binds it) or bind (vLLM connects to it)."""
        with self.lock:
            self._intakes[name] = KvIntake(
                self.rate, self.max_pending_hashes, engine=engine, on_error=partial(self._log_drop, name)
            )
            self._problems[name] = SourceError("not_started", f"KV events {endpoint}: not subscribed yet")
        self._commands.put(("add", name, endpoint, mode))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fleet-kv-events", daemon=True)
            self._thread.start()

    def remove(self, name: Hashable) -> None:
        with self.lock:
            self._intakes.pop(name, None)
            self._problems.pop(name, None)
        self._commands.put(("remove", name, "", ""))

    def healthy(self, name: Hashable) -> bool:
        with self.lock:
            return name in self._intakes and name not in self._problems

    def drain(self, name: Hashable) -> KvEventDrain:
        """What replica `name` sent since the last drain; SourceError while it is not subscribed."""
        with self.lock:
            if (problem := self._problems.get(name)) is not None:
                raise problem
            intake = self._intakes.get(name)
        if intake is None:
            raise SourceError("not_started", f"KV events of {name}: not watched")
        return intake.drain()

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
                command, name, endpoint, mode = self._commands.get_nowait()
            except queue.Empty:
                return
            if command == "add":
                self._connect(poller, name, endpoint, mode)
            else:
                self._disconnect(poller, name)

    def _connect(self, poller: zmq.Poller, name: Hashable, endpoint: str, mode: str = "connect") -> None:
        self._disconnect(poller, name)  # a changed endpoint: off its old lane first
        key = peer_key(endpoint) if mode == "connect" else None
        lane = next(
            (ln for ln in self._lanes if key is not None and ln.shared and key not in ln.by_peer), None
        )
        try:
            if lane is None:
                lane = _Lane(self._socket(), shared=key is not None)
                poller.register(lane.socket, zmq.POLLIN)
                self._lanes.append(lane)
            (lane.socket.connect if mode == "connect" else lane.socket.bind)(endpoint)
        except zmq.ZMQError as err:
            reason = "fd_exhausted" if err.errno in (errno.EMFILE, errno.ENFILE) else "zmq_error"
            with self.lock:
                if name in self._intakes:
                    self._problems[name] = SourceError(reason, f"KV events {mode} {endpoint}: {err}")
            if lane is not None and not lane.endpoints:
                self._drop_lane(poller, lane)
            return
        lane.by_peer[key] = name
        lane.endpoints[name] = endpoint
        with self.lock:
            self._problems.pop(name, None)

    def _disconnect(self, poller: zmq.Poller, name: Hashable) -> None:
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

    def _handle(self, name: Hashable | None, frames: list[bytes]) -> None:
        with self.lock:
            intake = self._intakes.get(name) if name is not None else None
            if intake is None:
                self.unknown_sender += 1
                return
        if (batch := intake.take(frames)) is not None:  # decoded outside the lock: polls drain meanwhile
            intake.put(batch)

    def _log_drop(self, name: Hashable, err: Exception) -> None:
        reason = getattr(err, "reason", "parse_error")
        self._dropped_log.warning("KV-event message of %s dropped (%s): %s", name, reason, err)

    def _close_lanes(self) -> None:
        for lane in self._lanes:
            lane.socket.close(linger=0)
        self._lanes.clear()
