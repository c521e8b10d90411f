"""Deadline: asyncio.timeout's behaviour for a scope entered again and again, one timer across entries."""

import asyncio

import pytest

from kvcache_exporter.deadline import Deadline

LONG = 30.0  # a sleep no test waits out: the bound under test ends it, or the test fails by its guard


async def bounded(deadline: Deadline, seconds: float, sleep: float) -> str:
    try:
        async with deadline.within(seconds):
            await asyncio.sleep(sleep)
    except TimeoutError:
        return "timeout"
    return "done"


def run(main):
    async def guarded():
        async with asyncio.timeout(5.0):
            return await main()

    return asyncio.run(guarded())


def test_a_scope_past_its_bound_is_a_timeout_and_one_within_it_is_not():
    deadline = Deadline()

    async def main():
        return [await bounded(deadline, 0.05, LONG), await bounded(deadline, 5.0, 0.01)]

    assert run(main) == ["timeout", "done"]


def test_a_shorter_bound_after_a_longer_one_gets_its_own_timer():
    deadline = Deadline()

    async def main():
        first = await bounded(deadline, 10.0, 0.0)  # leaves its timer running, 10 s out
        return [first, await bounded(deadline, 0.05, LONG)]

    assert run(main) == ["done", "timeout"]


def test_a_longer_bound_after_a_shorter_one_is_not_cut_at_the_old_timer():
    deadline = Deadline()

    async def main():
        first = await bounded(deadline, 0.05, 0.0)  # its timer fires at 0.05 s, within the next scope
        return [first, await bounded(deadline, 0.6, 0.2), await bounded(deadline, 0.1, LONG)]

    assert run(main) == ["done", "done", "timeout"]


def test_many_entries_share_one_timer():
    deadline = Deadline()

    async def main():
        loop = asyncio.get_running_loop()
        before = len(loop._scheduled)  # the loop's timer heap
        for _ in range(50):
            await bounded(deadline, 5.0, 0.0)
        return len(loop._scheduled) - before

    assert run(main) == 1  # asyncio.timeout makes 50, each cancelled at its exit


def test_a_cancel_from_elsewhere_stays_a_cancel():
    deadline = Deadline()

    async def main():
        task = asyncio.create_task(bounded(deadline, 5.0, LONG))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await bounded(deadline, 0.05, LONG)  # the Deadline still bounds the next scope

    assert run(main) == "timeout"


def test_two_scopes_at_once_are_each_bounded():
    deadline = Deadline()

    async def main():
        return await asyncio.gather(bounded(deadline, 0.05, LONG), bounded(deadline, 0.1, LONG))

    assert run(main) == ["timeout", "timeout"]


def test_a_deadline_outlives_its_event_loop():
    deadline = Deadline()

    async def short():
        return await bounded(deadline, 0.05, 0.0)  # its timer, 0.05 s out, never fires: the loop ends

    async def longer():
        return await bounded(deadline, 0.2, LONG)

    assert run(short) == "done"
    assert run(longer) == "timeout"  # a timer of this loop, not the dead one of the first


def test_a_timer_due_before_the_next_entry_does_not_wake_the_idle_loop(monkeypatch):
    """Entries 0.1 s apart bounded at 0.35 s: the kept timer would fire between two entries, with
    no scope open, only to stop; the exit before it cancels it (the next entry makes another)."""
    deadline, idle_fires = Deadline(), []
    fire = Deadline._fire

    def counted(self):
        if self._task is None:
            idle_fires.append(self._when)
        fire(self)

    monkeypatch.setattr(Deadline, "_fire", counted)

    async def main():
        done = []
        for _ in range(8):
            done.append(await bounded(deadline, 0.35, 0.0))
            await asyncio.sleep(0.1)
        return done

    assert run(main) == ["done"] * 8
    assert idle_fires == []
