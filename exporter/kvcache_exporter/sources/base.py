"""The Source protocol every source implements, and the errors a source raises.

A source is one module with one class:

    class MySource:
        name = "my_source"                      # the `collector` label of its health series
        async def collect(self) -> MySnapshot:  # a plain snapshot, or raise SourceError
        async def close(self) -> None:          # release sockets/handles

It returns a snapshot (plain data, no exported samples) or raises `SourceError(reason, message)`;
any other exception is caught by the poll loop and counted as `internal_error`. It is wired by
one row, a `kit.SourceKit` (its catalog entries, options, `wire` returning
`Poll(MySource(...), part.ingest)` for a part of the poll state it keeps in `state.parts`, and
the pure functions of its derivation module that turn that part into samples): see kit.py. The poll
loop (collector.py) times every collect(), records success, duration, last success and
errors_total{collector, reason}, and logs once per reason.

Pushed streams fit the same shape: the KV-event subscriber receives in the background and its
collect() drains what arrived since the last poll (see sources/kv_events.py).
"""

from __future__ import annotations

from typing import Protocol, TypeVar

SnapshotT = TypeVar("SnapshotT", covariant=True)


class Source(Protocol[SnapshotT]):
    name: str

    async def collect(self) -> SnapshotT: ...

    async def close(self) -> None: ...


class SourceError(Exception):
    """A source could not deliver a snapshot. `reason` becomes the errors counter's label."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class SourceUnavailable(SourceError):
    """The source cannot exist here (no NVML driver, no GPU): reported at debug level, not as an error."""

    def __init__(self, message: str):
        super().__init__("unavailable", message)
