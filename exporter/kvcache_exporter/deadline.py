"""`asyncio.timeout` for a scope entered again and again (a poll each second, bounded at 5 s),
with one timer kept across the entries instead of one made and cancelled per entry.

Why (issue 30): the loop keeps a cancelled timer in its heap until its time comes, so each
`asyncio.timeout` of a poll cost a timer made, cancelled and later popped, ~8 µs with a warm
cache and two bounds a poll (the poll's deadline and its GET's). Here an exit leaves the timer
running; an entry whose deadline is no earlier than the running timer's keeps it, and a timer
that fires finds the open scope's deadline later (it moves there), none open (it stops), or
its own (the scope expires, exactly as `asyncio.timeout` expires). A 1 s poll bounded at 5 s
makes one timer every 5 polls.

A timer that would fire before the next entry (the gap between the last two entries from now)
is cancelled at the exit instead: firing with no scope open, it only woke the idle loop (a poll's
second blocking wait, one poll in 5, on a sidecar); a cancelled timer leaves the heap when its
time comes, without a wake.
"""

from __future__ import annotations

import asyncio
import math
from types import TracebackType


class Deadline:
    """One bound, reused: `async with deadline.within(seconds):` is `asyncio.timeout(seconds)`
    (TimeoutError out of the scope when it runs past; a cancel from elsewhere stays a cancel).
    A scope opened while another is open (two tasks at once) gets a plain `asyncio.timeout`."""

    __slots__ = (
        "_at",
        "_cancelling",
        "_entered",
        "_expired",
        "_gap",
        "_handle",
        "_loop",
        "_seconds",
        "_task",
        "_when",
    )

    def __init__(self) -> None:
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._when = math.inf  # when the running timer fires
        self._task: asyncio.Task | None = None  # the task in the open scope
        self._at = math.inf  # the open scope's deadline
        self._seconds = 0.0
        self._cancelling = 0
        self._expired = False
        self._entered: float | None = None  # the last entry's loop time
        self._gap = 0.0  # between the last two entries (none yet: a timer is kept)

    def within(self, seconds: float) -> Deadline | asyncio.Timeout:
        if self._task is not None:
            return asyncio.timeout(seconds)
        self._seconds = seconds
        return self

    async def __aenter__(self) -> Deadline:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a Deadline is used inside a task")
        self._task, self._cancelling, self._expired = task, task.cancelling(), False
        now = loop.time()
        self._gap = 0.0 if self._entered is None else now - self._entered
        self._entered = now
        self._at = at = now + self._seconds
        if self._handle is None or self._loop is not loop or self._when > at:
            if self._handle is not None:
                self._handle.cancel()
            self._handle, self._loop, self._when = loop.call_at(at, self._fire), loop, at
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        task, self._task = self._task, None
        if self._handle is not None and self._loop is not None and self._when < self._loop.time() + self._gap:
            self._handle.cancel()  # it would fire before the next entry: a wake of the idle loop
            self._handle, self._when = None, math.inf
        if self._expired and task is not None:
            self._expired = False
            if task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc

    def _fire(self) -> None:
        when, self._handle, self._when = self._when, None, math.inf
        task = self._task
        if task is None or self._expired:
            return
        if self._at > when:  # a later scope's deadline: the timer moves there
            self._handle, self._when = task.get_loop().call_at(self._at, self._fire), self._at
            return
        self._expired = True
        task.cancel()
