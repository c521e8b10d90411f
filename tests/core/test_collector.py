"""The poll loop's one wrapper: every source timed and accounted for, and no exception ends the loop."""

import asyncio
import logging
import threading
import time

import pytest

from kvcache_exporter import catalog as c
from kvcache_exporter.collector import Exporter, Poll, target_polls
from kvcache_exporter.derive.registry import DERIVATIONS, DeriveOptions
from kvcache_exporter.derive.state import PollState
from kvcache_exporter.sources.base import SourceError
from tests.replay import ReplaySource, seed_snapshots


class Broken:
    """A source with a bug: it raises what no source should."""

    name = "broken"

    def __init__(self):
        self.calls = 0

    async def collect(self):
        self.calls += 1
        if self.calls == 3:
            raise SourceError("timeout", "slow")
        raise KeyError("le")

    def close(self):
        raise RuntimeError("cannot close either")


class Hung:
    """A source that never answers (a driver call that blocks forever)."""

    name = "hung"

    async def collect(self):
        await asyncio.Event().wait()

    def close(self):
        pass


def exporter_with(texts, extra_polls=(), derivations=DERIVATIONS, deadline=None):
    now = [0.0]
    state = PollState(retention=120)
    polls = target_polls(state, {"t": ReplaySource(texts)})
    polls += [Poll(source, lambda snapshot, ts: None) for source in extra_polls]
    exporter = Exporter(
        polls,
        state,
        DeriveOptions(),
        interval=10,
        clock=lambda: now[0],
        derivations=derivations,
        deadline=deadline,
    )
    return exporter, now


def sample(exporter, name, **labels):
    found = [s.value for s in exporter.latest if s.name == name and s.labels == labels]
    return found[0] if found else None


def test_a_source_raising_anything_is_an_internal_error_logged_once(shared_fixtures, caplog):
    texts = [s["text"] for s in seed_snapshots(shared_fixtures)][:4]
    broken = Broken()
    exporter, now = exporter_with(texts, [broken])
    caplog.set_level(logging.DEBUG, logger="kvcache_exporter")
    for _ in texts:
        asyncio.run(exporter.poll_once())
        now[0] += 10
    asyncio.run(exporter.close())  # its close raising does not stop the others closing
    assert sample(exporter, c.EXPORTER_ERRORS_TOTAL, collector="broken", reason="internal_error") == 3
    assert sample(exporter, c.EXPORTER_ERRORS_TOTAL, collector="broken", reason="timeout") == 1
    assert sample(exporter, c.EXPORTER_COLLECTOR_SUCCESS, collector="broken") == 0
    assert sample(exporter, c.VLLM_UP) == 1  # the other source is untouched
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # once per reason change: internal_error, timeout, internal_error again; one for the close
    crash = "collector failed: KeyError: 'le'"
    assert warnings[:3] == [crash, "collector failed: slow", crash]
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1 and tracebacks[0].levelno == logging.DEBUG


def test_a_derivation_raising_costs_only_its_own_series(shared_fixtures, caplog):
    texts = [s["text"] for s in seed_snapshots(shared_fixtures)][:3]

    def explodes(state, options):
        raise ZeroDivisionError("bug")

    exporter, now = exporter_with(texts, derivations={**DERIVATIONS, "explodes": explodes})
    caplog.set_level(logging.WARNING, logger="kvcache_exporter")
    for _ in texts:
        asyncio.run(exporter.poll_once())
        _ = exporter.latest  # a scrape: the derivations run at the first read after a poll
        now[0] += 10
    assert sample(exporter, c.EXPORTER_ERRORS_TOTAL, collector="derive", reason="internal_error") == 3
    assert sample(exporter, c.VLLM_UP) == 1
    assert any(s.name == c.PREFIX_CACHE_QUERY_TOKENS_TOTAL for s in exporter.latest)
    assert [r.getMessage() for r in caplog.records] == ["derivation failed: ZeroDivisionError: bug"]


def test_run_keeps_polling_after_an_unexpected_failure(shared_fixtures):
    texts = [s["text"] for s in seed_snapshots(shared_fixtures)][:50]
    exporter, _ = exporter_with(texts)
    exporter.interval = 0.01
    calls = []

    def end_poll(now):  # the poll state itself breaking: the loop must still go on
        calls.append(now)
        if len(calls) == 2:
            raise RuntimeError("state bug")

    exporter.state.end_poll = end_poll

    async def scenario():
        stop = asyncio.Event()
        task = asyncio.create_task(exporter.run(stop))
        while len(calls) < 4:
            await asyncio.sleep(0.01)
        stop.set()
        await task

    asyncio.run(scenario())
    assert sample(exporter, c.EXPORTER_ERRORS_TOTAL, collector="derive", reason="internal_error") == 1


def test_a_hung_source_times_out_and_the_others_are_polled(shared_fixtures):
    texts = [s["text"] for s in seed_snapshots(shared_fixtures)][:2]
    exporter, now = exporter_with(texts, [Hung()], deadline=0.2)
    for _ in texts:
        asyncio.run(exporter.poll_once())
        now[0] += 10
    assert sample(exporter, c.EXPORTER_ERRORS_TOTAL, collector="hung", reason="timeout") == 2
    assert sample(exporter, c.VLLM_UP) == 1


def test_a_source_without_a_name_fails_at_wiring_not_in_the_loop():
    class Nameless:
        async def collect(self):
            return None

    with pytest.raises(AttributeError):
        Poll(Nameless(), lambda snapshot, ts: None)


def test_an_offloaded_ingest_runs_beside_the_loop():
    """While a long ingest runs in its worker thread, the event loop (which answers scrapes) runs."""
    ingest, ticks = {}, []

    class Burst:
        name = "kv_events"

        async def collect(self):
            return "drain"

        def close(self):
            pass

    def slow_ingest(snapshot, ts):
        ingest["thread"], ingest["start"] = threading.get_ident(), time.monotonic()
        time.sleep(0.3)
        ingest["end"] = time.monotonic()

    async def scenario(offload):
        poll = Poll(Burst(), slow_ingest, offload=offload)

        async def ticker():
            while "end" not in ingest:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        await asyncio.gather(poll.run(time.monotonic, 5.0), ticker())
        return poll

    poll = asyncio.run(scenario(offload=True))
    assert poll.health.success and ingest["thread"] != threading.get_ident()
    assert sum(ingest["start"] < tick < ingest["end"] for tick in ticks) > 5
    ingest.clear()
    ticks.clear()
    asyncio.run(scenario(offload=False))  # the check can fail: inline, the loop stands still
    assert sum(ingest["start"] < tick < ingest["end"] for tick in ticks) == 0


def test_derivations_run_at_the_first_read_after_a_poll_and_not_in_a_workers_update(shared_fixtures):
    texts = [s["text"] for s in seed_snapshots(shared_fixtures)][:4]
    runs = []

    def counted(state, options):
        runs.append(state.now)
        return []

    class Slow:  # a source whose `into` runs in a worker thread (offload), as the KV events' do
        name = "slow"

        async def collect(self):
            return "snapshot"

        async def close(self):
            pass

    exporter, now = exporter_with(texts, derivations={**DERIVATIONS, "counted": counted})
    for _ in range(2):  # polls nobody reads cost no derivation
        asyncio.run(exporter.poll_once())
        now[0] += 10
    assert runs == []
    first = exporter.latest
    assert exporter.latest is first and runs == [10.0]  # one derivation per poll, however many reads
    read_in_thread = []
    exporter.polls.append(
        Poll(Slow(), lambda snapshot, ts: read_in_thread.append(exporter.latest), offload=True)
    )
    asyncio.run(exporter.poll_once())
    assert read_in_thread == [first] and runs == [10.0]  # mid-update: the last page, no derivation
    assert exporter.latest is not first and runs == [10.0, 20.0]
