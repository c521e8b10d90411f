"""`serve --fleet.publish nats://...`: this replica's KV residency deltas and prefix-cache counters
on NATS JetStream, for `aggregate --fleet.source` (docs/fleet.md, "On NATS"; fleet_wire.py).

`offer` (called from the poll's KV-event ingest, in a worker thread) turns each decoded batch into
one delta per hash range it touches and queues them, bounded in messages and bytes: past the bound
a delta is dropped and counted (`buffer_full`), and its seq stays used, so the aggregator sees the
gap. One asyncio task sends the queue. Nothing here ever waits on NATS in the poll or a scrape:
with NATS down the sidecar counts drops and serves /metrics as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import urlsplit

from . import catalog as c
from . import fleet_wire as wire
from .collector import Poll
from .fleet_resync import Held, chunked, held_at, replayed
from .logs import Throttled
from .samples import Sample
from .sources.base import SourceError
from .sources.engine_events import decode_engine_message
from .sources.kv_events_decode import Batch, Dropped, KvEventDrain, SeqCursor
from .sources.vllm_snapshot import VllmSnapshot

STREAM_NAME_IN_USE = 10058  # JetStream's error code: a stream of that name exists, otherwise made
GPU_MEDIA = (None, "GPU")  # a lower tier's events (vLLM's CPU, SGLang's CPU_PINNED) are not the pool's
log = logging.getLogger("kvcache_exporter.fleet")

MAX_BUFFERED = 65_536  # deltas: at ~2 a batch, minutes of a busy replica's stream
MAX_BUFFERED_BYTES = 64 * 1024 * 1024
PUBLISH_TIMEOUT = 2.0  # one JetStream ack; past it the delta is sent again
PUBLISH_ATTEMPTS = 3  # late acks before the delta is dropped (publish_error)
IDLE_SECONDS = 0.05
STOP_SECONDS = 5.0  # close() waits this long for its tasks
FLUSH_HASHES = 16_384  # a range's delta is sent at this many hashes: 32-byte hashes stay under 1 MiB
STREAM_MAX_AGE = 6 * 3600.0  # the pool's stream when a sidecar creates it: `aggregate` sets its own
STREAM_MAX_BYTES = 8 * 1024**3
DROP_REASONS = ("buffer_full", "publish_error", "not_connected", "internal_error")


@dataclass(frozen=True)
class NatsOptions:
    """How to reach NATS: the URL (nats:// or tls://; user:password@ is read from it by nats-py),
    a credentials file (JWT + NKey seed, .creds) or an NKey seed file, a CA file for TLS."""

    url: str
    credentials_file: str | None = None
    nkey_seed_file: str | None = None
    tls_ca_file: str | None = None

    @property
    def where(self) -> str:
        """The URL without its user and password, for logs and errors."""
        parts = urlsplit(self.url)
        return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()

    def connect_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"servers": [self.url], "max_reconnect_attempts": -1, "connect_timeout": 2}
        if self.credentials_file:
            kwargs["user_credentials"] = self.credentials_file
        if self.nkey_seed_file:
            kwargs["nkeys_seed"] = self.nkey_seed_file
        if self.tls_ca_file or self.url.startswith("tls://"):
            import ssl

            kwargs["tls"] = ssl.create_default_context(cafile=self.tls_ca_file)
        return kwargs


_logged: set[str] = set()
SUBJECT = re.compile(r'((?:publish|subscription|subscribe) to )"[^"]*"')  # a permission error's subject


def log_once(message: str) -> None:
    """A warning the first time it is seen: NATS down retries every second, not a line a second."""
    if message not in _logged and len(_logged) < 1000:
        _logged.add(message)
        log.warning("%s (logged once)", message)


def described(err: BaseException) -> str:
    """An error as a log line may show it: its type and its text (nats-py's JetStream errors carry
    their code and description only in the text), a permission error's subject left out."""
    text = str(err)
    return SUBJECT.sub(r'\1"…"', f"{type(err).__name__}: {text}" if text else type(err).__name__)


async def connect(options: NatsOptions, name: str) -> Any:
    """A NATS connection that reconnects forever and logs its state changes once each."""
    import nats  # here: serve without --fleet.publish never loads it

    async def error_cb(err: Exception) -> None:  # subjects left out: a refused pool logs once, not per range
        log_once(f"NATS {options.where}: {described(err)}")

    return await nats.connect(name=name, error_cb=error_cb, **options.connect_kwargs())


def stopping() -> bool:
    """Whether this task was asked to stop: a cancel that lands inside nats-py can come out as a
    return or another error (its flush and next_msg catch CancelledError; so can 3.11's wait_for
    when its wait ends at the same moment), so a loop that goes on after one checks this."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def stop(tasks: Sequence[asyncio.Task], seconds: float = STOP_SECONDS) -> None:
    """Cancel the tasks and wait for them, at most `seconds`: one that will not stop is logged and
    left, never waited on forever (a shutdown that hangs is worse than a task left behind)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    pending = {task for task in tasks if not task.done()}
    while pending and (left := deadline - loop.time()) > 0:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(left, 0.5))
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: its error was logged where it happened
    if pending:
        log.warning("%d NATS task(s) did not stop within %g s; left running", len(pending), seconds)


async def ensure_stream(
    js: Any, name: str, subjects: str, max_age: float, max_bytes: int, replicas: int = 1
) -> None:
    """The pool's stream, created if absent: file storage, limits retention, the oldest discarded,
    on `replicas` JetStream servers (an existing stream is left as it is)."""
    from nats.js import api
    from nats.js.errors import BadRequestError, NotFoundError

    config = api.StreamConfig(
        name=name,
        subjects=[subjects],
        retention=api.RetentionPolicy.LIMITS,
        discard=api.DiscardPolicy.OLD,
        max_age=max_age,
        max_bytes=max_bytes,
        max_msg_size=wire.MAX_DELTA_BYTES,
        storage=api.StorageType.FILE,
        num_replicas=replicas,
    )
    try:
        await js.stream_info(name)
    except NotFoundError:
        try:
            await js.add_stream(config)
        except BadRequestError as err:  # a sidecar or shard created it meanwhile: theirs stands
            if err.err_code != STREAM_NAME_IN_USE:
                raise


class FleetPublisher:
    """One sidecar's publisher; a Source (collect publishes the counters) for serve's poll loop."""

    name = "fleet_publish"

    def __init__(
        self,
        options: NatsOptions,
        pool: str,
        replica: str,
        prefix: str = "kvcache",
        sampling: float = 1.0,
        counters: Callable[[], VllmSnapshot | None] = lambda: None,
        max_buffered: int = MAX_BUFFERED,
        max_buffered_bytes: int = MAX_BUFFERED_BYTES,
        clock: Callable[[], float] = time.time,
    ):
        self.options, self.pool, self.replica, self.prefix = options, pool, replica, prefix
        self.sampling, self.kept = sampling, wire.kept_space(sampling)
        self.counters, self.clock = counters, clock
        self.max_buffered, self.max_buffered_bytes = max_buffered, max_buffered_bytes
        self.lock = threading.Lock()  # offer runs in the poll's worker thread, the sender in the loop
        self._offering = threading.Lock()
        self._queue: deque[tuple[str, bytes, float]] = deque()  # subject, payload, monotonic enqueue time
        self._bytes = 0
        self._sending = False
        self._attempts = 0  # late acks of the queue's head
        self.published = 0
        self.dropped: Counter[str] = Counter()
        self.epoch, self.cause = time.time_ns(), "start"
        self._announce = True  # the next enqueue sends every range a delta of the new epoch
        self._cursors: dict[int, SeqCursor] = {}  # vLLM's seq per engine: its restarts
        self._subjects = [wire.delta_subject(prefix, pool, r, replica) for r in range(wire.RANGES)]
        self._seqs: dict[tuple[int, int], int] = {}  # (engine, range) -> next delta seq in this epoch
        self._replays: dict[int, Callable[[], tuple[str | None, str]]] = {}  # engine -> its replay endpoint
        self._held: dict[int, Held] = {}  # engine -> where its held batches begin (fleet_resync.py)
        self.resyncs: Counter[str] = Counter()
        self.resynced_blocks = 0
        self._resync_log = Throttled(log, 60.0)
        self._kinds: dict[int, str] = {}  # rank -> its engine (vllm, sglang, trtllm), said in each delta
        self._nc: Any = None
        self._js: Any = None
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    # --- the poll's side (any thread) -------------------------------------------------------

    def offer(self, engine: int, drain: KvEventDrain | None) -> None:
        """One engine's drained batches as deltas on the queue, one per hash range they touch (a
        poll's worth in one message per range: per-message costs stay off the per-block path);
        never blocks on NATS. While a resync is pending the batches are held (fleet_resync.py)."""
        with self._offering:  # one engine's batches at a time: ranks poll in threads of their own
            if self._held:
                self._resync()
            if drain is None:
                return
            if self._held:
                self._hold(engine, drain.items)
                return
            self._offer(engine, drain.items)

    def _offer(
        self, engine: int, items: Sequence[Batch | Dropped], skip: int = 0, advanced: bool = False
    ) -> None:
        """`items` as deltas; the first one's first `skip` events were published before and its seq
        read already if `advanced` (a resync resuming inside a batch). Stops at a hold."""
        cursor = self._cursors.setdefault(engine, SeqCursor())
        pending, ts = PendingDeltas(self.kept), 0.0
        # Equal keys as one object: a range whose last change has this key extends it (a store, a
        # removal elsewhere, a store again: one change in each range the removal did not touch).
        interned: dict[tuple, tuple] = {}
        key, run = None, []  # consecutive like changes, handed to `pending` at once
        origin = (0, skip, advanced, cursor.next)  # where `pending` begins: (item, skip, advanced, cursor)
        for i, item in enumerate(items):
            if i == 0 and advanced:
                restart = False
            elif isinstance(item, Dropped):  # lost upstream: serve's own kv_events series count it
                restart = cursor.skip(item.seq, item.count).restart
            else:
                restart = cursor.advance(item.seq).restart
            if restart:
                pending.add(key, run)
                key, run = None, []
                if not self._enqueue(engine, ts, pending):
                    return self._hold_from(engine, items, origin)
                self._new_epoch("restart")
                origin = (i, 0, True, cursor.next)
            if isinstance(item, Dropped):
                continue
            ts = item.ts
            events = item.events[skip:] if i == 0 and skip else item.events
            for index, event in enumerate(events):
                kind = event.type
                if kind != "AllBlocksCleared" and event.medium not in GPU_MEDIA:
                    continue  # a lower tier's copy (vLLM's CPU, SGLang's CPU_PINNED): not the pool's GPUs
                if kind == "BlockStored":
                    now = (True, event.group, event.lora_name, event.session_id)
                elif kind == "BlockRemoved":
                    now = (False, event.group, event.lora_name, None)
                elif kind == "AllBlocksCleared":
                    pending.add(key, run)
                    key, run = None, []
                    if not self._enqueue(engine, ts, pending):
                        return self._hold_from(engine, items, origin)
                    self._new_epoch("cleared")
                    done = index + 1 + (skip if i == 0 else 0)
                    origin = (i, done, True, cursor.next)
                    continue
                else:
                    continue
                if now != key:
                    pending.add(key, run)
                    key, run = interned.setdefault(now, now), []
                run += event.block_hashes
            if pending.hashes + len(run) >= FLUSH_HASHES:
                pending.add(key, run)
                key, run = None, []
                if not self._enqueue(engine, ts, pending):
                    return self._hold_from(engine, items, origin)
                origin = (i + 1, 0, False, cursor.next)
        pending.add(key, run)
        if not self._enqueue(engine, ts, pending):
            self._hold_from(engine, items, origin)

    # --- holding and resyncing after a buffer overflow (fleet_resync.py) -------------------

    def _replayable(self, engine: int) -> bool:
        source = self._replays.get(engine)
        return source is not None and source()[0] is not None

    def _hold_from(self, engine: int, items: Sequence[Batch | Dropped], origin: tuple) -> None:
        """A hold from `origin` (the item, events and cursor where the unqueued deltas began)."""
        index, skip, advanced, cursor = origin
        if index >= len(items):
            return  # nothing of `items` is held: the next offer starts a hold if one is pending
        item = items[index]
        seq = item.seq if item.seq is not None else (cursor or 0)
        held = held_at(seq, skip, advanced, cursor)
        before = self._held.get(engine)
        if before is not None:  # a resync overflowing again: it resumes from here, the live part stays
            held.live, held.last, held.restarted, held.cleared = (
                before.live,
                before.last,
                before.restarted,
                before.cleared,
            )
        else:
            for k, each in enumerate(items[index:]):
                held.saw(each, first=k == 0)
        self._held[engine] = held

    def _hold(self, engine: int, items: Sequence[Batch | Dropped]) -> None:
        """Live items while a resync is pending: read for their sequence only."""
        held = self._held.get(engine)
        for item in items:
            if held is None:
                if item.seq is None:
                    continue
                cursor = self._cursors.setdefault(engine, SeqCursor())
                held = self._held[engine] = held_at(item.seq, 0, False, cursor.next)
            held.saw(item)

    def _resync(self) -> None:
        """Once NATS has taken the buffer: each held engine's batches again from vLLM's replay."""
        if not self.connected:
            return
        with self.lock:
            if self._queue or self._sending:
                return
        for engine in sorted(self._held):
            held = self._held.pop(engine)
            source = self._replays.get(engine)
            endpoint, kind = source() if source is not None else (None, "vllm")
            if not held.waiting:
                continue
            if endpoint is None or held.restarted:
                self._give_up(
                    engine, held, "vLLM restarted meanwhile" if held.restarted else "no replay endpoint"
                )
                continue
            self._replay(engine, held, endpoint, kind)

    def _replay(self, engine: int, held: Held, endpoint: str, kind: str) -> None:
        cursor = self._cursors.setdefault(engine, SeqCursor())
        cursor.next = held.cursor
        decode = partial(decode_engine_message, with_tokens=True, engine=kind)
        skip, advanced, last = held.skip, held.advanced, None
        try:
            with contextlib.closing(replayed(endpoint, held.seq, decode)) as batches:
                for chunk in chunked(batches, held.last):
                    self._offer(engine, chunk, skip, advanced)
                    self.resynced_blocks += sum(len(e.block_hashes) for b in chunk for e in b.events)
                    if engine in self._held:  # overflowed again: resumes from there next poll
                        again = self._held[engine]
                        again.live, again.last, again.restarted = held.live, held.last, held.restarted
                        return
                    last, skip, advanced = chunk[-1].seq, 0, False
        except Exception as err:  # zmq errors, a bug: what was sent stands, the rest next poll
            log.debug("replay from %s failed: %r", endpoint, err)
        if last is None:
            return self._give_up(engine, held, f"vLLM's replay at {endpoint} no longer has batch {held.seq}")
        if last == held.last:
            cursor.next = held.live.next
            self.resyncs["done"] += 1
            log.info("resynced %d batches from vLLM's replay at %s", last - held.seq + 1, endpoint)
            return
        held.seq, held.skip, held.advanced, held.cursor = (
            last + 1,
            0,
            False,
            cursor.next,
        )  # the rest next poll
        self._held[engine] = held

    def _give_up(self, engine: int, held: Held, why: str) -> None:
        """No resync: on with a gap in each range's numbering, which the shards count as missed."""
        self._cursors.setdefault(engine, SeqCursor()).next = held.live.next
        with self.lock:
            for r in range(wire.RANGES):
                self._seqs[(engine, r)] = self._seqs.get((engine, r), 0) + 1
        if held.restarted or held.cleared:
            self._new_epoch("restart" if held.restarted else "cleared")
        self.resyncs["failed"] += 1
        self._resync_log.warning(
            "KV events lost in the NATS outage not resent (%s): the shards count a gap", why
        )

    def tee(
        self,
        engine: int,
        into: Callable[[KvEventDrain | None, float], None],
        kind: str = "vllm",
        replay: Callable[[], tuple[str | None, str]] | None = None,
    ):
        """`into` (the poll state's ingest) with this engine's batches offered first; `kind` is the
        engine publishing them (its deltas say so: a shard keys each engine's hashes apart); `replay`
        says where the engine's replay endpoint is now, and its kind (None: no resync)."""
        self._kinds[engine] = kind
        if replay is not None:
            self._replays[engine] = replay

        def ingest(drain: KvEventDrain | None, ts: float) -> None:
            try:
                self.offer(engine, drain)
            except Exception:  # a bug here must not cost the sidecar its own view of the events
                self.dropped["internal_error"] += 1
                log.exception("publishing KV events failed")
            into(drain, ts)

        return ingest

    def _new_epoch(self, cause: str) -> None:
        with self.lock:
            self.epoch, self.cause = max(self.epoch + 1, time.time_ns()), cause
            self._seqs.clear()
            self._announce = True

    def _enqueue(self, engine: int, ts: float, pending: PendingDeltas) -> bool:
        """Each range's pending changes as one delta on the queue (`pending` is emptied). False, with
        nothing queued or numbered, when the buffer can't take them all and vLLM's replay can resend
        them later (a hold begins); without replay what doesn't fit is dropped and its seq stays used."""
        now = time.monotonic()
        holds = self._replayable(engine)
        with self.lock:
            cause = wire.CAUSES.index(self.cause)
            kind = self._kinds.get(engine, "vllm")
            deltas = pending.deltas()
            if self._announce:  # a new epoch reaches every range, so every shard forgets the old
                carrying = dict(deltas)
                deltas = ((r, carrying.get(r, [])) for r in range(wire.RANGES))
            out = []
            for r, changes in deltas:
                seq = self._seqs.get((engine, r), 0)
                payload = wire.encode_delta(
                    self.pool,
                    self.replica,
                    engine,
                    r,
                    self.epoch,
                    cause,
                    seq,
                    self.sampling,
                    ts,
                    changes,
                    kind,
                )
                out.append((r, seq, payload))
            size = sum(len(payload) for _, _, payload in out)
            if holds and self._overflows(len(out), size):
                return False
            self._announce = False
            for r, seq, payload in out:
                self._seqs[(engine, r)] = seq + 1  # taken even when dropped: the consumer sees the gap
                self._put(self._subjects[r], payload, now)
        self._wake_sender()
        return True

    def _overflows(self, messages: int, size: int) -> bool:
        """Whether that many messages don't fit now, though they would in the empty buffer."""
        never = messages > self.max_buffered or size > self.max_buffered_bytes
        now = len(self._queue) + messages > self.max_buffered or self._bytes + size > self.max_buffered_bytes
        return now and not never

    def _put(self, subject: str, payload: bytes, now: float) -> None:
        if len(self._queue) >= self.max_buffered or self._bytes + len(payload) > self.max_buffered_bytes:
            self.dropped["buffer_full"] += 1
            return
        self._queue.append((subject, payload, now))
        self._bytes += len(payload)

    def _wake_sender(self) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: shutting down
                loop.call_soon_threadsafe(self._wake.set)

    # --- the event loop's side --------------------------------------------------------------

    _loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Connect and send in the background (needs the running loop); NATS may be down."""
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.ensure_future(self._run())

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    async def _run(self) -> None:
        while self._nc is None and not stopping():
            try:
                self._nc = await connect(self.options, f"kvcache-publish-{self.pool}-{self.replica}")
                self._js = self._nc.jetstream()
                try:
                    await self._ensure_stream()
                except Exception as err:  # no permission: the aggregator or the operator makes it
                    log.info("NATS stream %s not checked: %s", wire.stream_name(self.prefix, self.pool), err)
            except Exception as err:  # NATS down at start: keep counting, try again
                log_once(f"NATS {self.options.where}: not connected ({err}); retrying every second")
                await asyncio.sleep(1.0)
        while not stopping():
            if not self.connected:  # reconnecting: the buffer holds (and bounds) what waits
                await asyncio.sleep(IDLE_SECONDS)
                continue
            item = self._next()
            if item is None:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), IDLE_SECONDS * 20)
                continue
            subject, payload, _ = item
            try:
                await self._js.publish(subject, payload, timeout=PUBLISH_TIMEOUT)
                self.published += 1
                self._attempts = 0
            except Exception as err:
                log.debug("publishing %s failed: %s", subject, err)
                await self._failed(item, err)
            finally:
                self._sending = False

    async def _failed(self, item: tuple[str, bytes, float], err: Exception) -> None:
        """A delta not acked: sent again while NATS is away, the stream is missing (JetStream still
        starting, or deleted: made again) or the ack was late (a shard drops a second copy); lost
        only after PUBLISH_ATTEMPTS late acks or an error that another try cannot mend."""
        from nats.js.errors import NoStreamResponseError

        if not self.connected or isinstance(err, NoStreamResponseError):
            self._again(item)
            if self.connected:
                stream = wire.stream_name(self.prefix, self.pool)
                log_once(f"NATS {self.options.where}: no stream {stream} answers; holding")
                await asyncio.sleep(1.0)
                with contextlib.suppress(Exception):
                    await self._ensure_stream()
            else:
                await asyncio.sleep(IDLE_SECONDS)
            return
        self._attempts += 1
        if isinstance(err, asyncio.TimeoutError) and self._attempts < PUBLISH_ATTEMPTS:
            self._again(item)
            return
        self._attempts = 0
        self.dropped["publish_error"] += 1

    async def _ensure_stream(self) -> None:
        stream = wire.stream_name(self.prefix, self.pool)
        subjects = f"{self.prefix}.{self.pool}.>"
        await ensure_stream(self._js, stream, subjects, STREAM_MAX_AGE, STREAM_MAX_BYTES)

    def _again(self, item: tuple[str, bytes, float]) -> None:
        with self.lock:
            self._queue.appendleft(item)
            self._bytes += len(item[1])

    def _next(self) -> tuple[str, bytes, float] | None:
        with self.lock:
            if not self._queue:
                return None
            item = self._queue.popleft()
            self._bytes -= len(item[1])
            self._sending = True
            return item

    async def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued was sent (acked or dropped); False if `timeout` came first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if not self._queue and not self._sending:
                    return True
            await asyncio.sleep(0.002)
        return False

    def lag(self) -> float:
        """Seconds the oldest queued delta has waited: 0 when the queue is empty."""
        with self.lock:
            return time.monotonic() - self._queue[0][2] if self._queue else 0.0

    async def collect(self) -> None:
        """Once a poll: the replica's prefix-cache counters (from the last /metrics poll) on NATS;
        SourceError while NATS is not reachable (collector_success{collector="fleet_publish"} 0)."""
        if not self.connected:
            raise SourceError("nats_error", f"NATS {self.options.where}: not connected")
        snapshot = self.counters()
        if snapshot is None:
            return
        summed = wire.replica_counters(snapshot)
        counters = wire.Counters(
            wire.VERSION,
            self.pool,
            self.replica,
            self.clock(),
            summed.counters["query_tokens"],
            summed.counters["hit_tokens"],
            wire.block_size(snapshot),
            summed.start_time,
        )
        subject = wire.counters_subject(self.prefix, self.pool, self.replica)
        with self.lock:
            self._put(subject, wire.encode(counters), time.monotonic())
        self._wake_sender()

    def samples(self) -> list[Sample]:
        with self.lock:
            buffered = len(self._queue)
            dropped = dict(self.dropped)
        out = [
            Sample(c.FLEET_PUBLISHED_TOTAL, {}, float(self.published)),
            Sample(c.FLEET_PUBLISH_BUFFERED, {}, float(buffered)),
            Sample(c.FLEET_PUBLISH_LAG_SECONDS, {}, self.lag()),
        ]
        out += [
            Sample(c.FLEET_PUBLISH_DROPPED_TOTAL, {"reason": r}, float(dropped.get(r, 0)))
            for r in DROP_REASONS
        ]
        out += [
            Sample(c.FLEET_PUBLISH_RESYNCS_TOTAL, {"result": r}, float(self.resyncs[r]))
            for r in ("done", "failed")
        ]
        out.append(Sample(c.FLEET_PUBLISH_RESYNCED_BLOCKS_TOTAL, {}, float(self.resynced_blocks)))
        out.append(Sample(c.FLEET_PUBLISH_RESYNC_PENDING, {}, float(bool(self._held))))
        return out

    async def close(self) -> None:
        if self._task is not None:
            await stop([self._task])
            self._task = None
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
            self._nc = None


class PendingDeltas:
    """One drain's changes by hash range, in order, as wire.Change tuples (kind, hashes, group,
    adapter, session) for encode_delta: a change like the range's last one (the same key object)
    extends it, so a block costs a few operations."""

    def __init__(self, kept: int):
        self.kept = kept
        self.changes: list[list[tuple]] = [[] for _ in range(wire.RANGES)]
        self.keys: list[tuple | None] = [None] * wire.RANGES  # the key each range's last change has
        self.last: list[list] = [[] for _ in range(wire.RANGES)]  # the hashes of each range's last change
        self.hashes = 0

    def add(self, key: tuple | None, hashes: Sequence[int | bytes]) -> None:
        """The hashes of one change (`key`: kind, group, adapter, session) onto their ranges."""
        if not hashes or key is None:
            return
        self.hashes += len(hashes)
        if self.kept == wire.SPACE:  # unsampled int hashes, the common case: the range is the top bits
            keys, last, changes, mask, shift = self.keys, self.last, self.changes, wire.MASK, SHIFT
            stored, group, adapter, session = key
            try:
                for block_hash in hashes:  # _put, inlined: this loop is the publisher's per-block cost
                    r = (block_hash & mask) >> shift
                    if keys[r] is key:
                        last[r].append(block_hash)
                    else:
                        keys[r] = key
                        last[r] = run = [block_hash]
                        changes[r].append((stored, run, group, adapter, session))
                return
            except TypeError:  # a bytes hash: it and the rest the general way (ints before it are placed)
                hashes = hashes[hashes.index(block_hash) :]
        for block_hash in hashes:
            r = wire.range_of(wire.hash_position(block_hash), self.kept)
            if r is not None:  # else outside the sample: sampling before publishing
                self._put(r, key, block_hash)

    def _put(self, r: int, key: tuple, block_hash: int | bytes) -> None:
        if self.keys[r] is not key:
            self.keys[r], self.last[r] = key, []
            stored, group, adapter, session = key
            self.changes[r].append((stored, self.last[r], group, adapter, session))
        self.last[r].append(block_hash)

    def deltas(self) -> Iterator[tuple[int, list[tuple]]]:
        """(range, its changes) for every range with changes; then empty."""
        for r, changes in enumerate(self.changes):
            if changes:
                yield r, changes
                self.changes[r], self.keys[r] = [], None
        self.hashes = 0


SHIFT = 64 - wire.RANGE_BITS


class PublishPoll(Poll):
    """The publisher in serve's loop: its health series, plus what it sent, dropped and buffers."""

    source: FleetPublisher

    def samples(self) -> list[Sample]:
        return super().samples() + self.source.samples()
