"""Which replicas each session stored blocks on, from the `session_id` vLLM puts on `BlockStored`
(0.32+, when a request has one). Pure, no I/O.

Ground truth beside the `prefix_affinity` estimate: a session whose blocks landed on two or more
replicas was split by the router. Bounded: two generations of at most `max_sessions / 2` sessions
each, a session's replicas as a bitmask of the fleet view's replica bits. A generation ends when
it is full or older than `retention`; a session seen again moves to the new one, so the sessions
counted are those seen within the last one to two retentions, at most `max_sessions` (a stream of
fresh ids only turns the generations over faster). A session id is at most 256 characters (the
decoder's bound): measured 21 MiB at most at the default bound, 7 MiB for UUID ids.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_SESSIONS = 65_536


def split(mask: int) -> bool:
    """Two or more replica bits set."""
    return bool(mask & (mask - 1))


def spread(masks: Iterable[int]) -> tuple[int, int]:
    """(sessions, sessions seen on two or more replicas)."""
    sessions = splits = 0
    for mask in masks:
        sessions += 1
        splits += split(mask)
    return sessions, splits


def split_ratio(sessions: int, splits: int) -> float | None:
    """None without sessions: no session ids is unknown, never 0."""
    return splits / sessions if sessions else None


class SessionSpread:
    def __init__(self, max_sessions: int = MAX_SESSIONS, retention: float = 3600.0):
        self.generation_size = max(1, max_sessions // 2)
        self.retention = retention
        self._current: dict[str, int] = {}
        self._previous: dict[str, int] = {}
        self._started: float | None = None

    def seen(self, session: str, bit: int) -> None:
        mask = self._current.get(session)
        if mask is None:
            mask = self._previous.pop(session, 0)
            if len(self._current) >= self.generation_size:
                self._turn()
        self._current[session] = mask | bit

    def age(self, now: float) -> None:
        """Called once a poll: a generation older than `retention` ends."""
        if self._started is None:
            self._started = now
        elif now - self._started >= self.retention:
            self._turn()
            self._started = now

    def forget(self, bit: int) -> None:
        """A replica left the pool: its bit is handed to the next one, so it leaves every mask."""
        for generation in (self._current, self._previous):
            for session, mask in generation.items():
                if mask & bit:
                    generation[session] = mask & ~bit

    def counts(self) -> tuple[int, int]:
        """(sessions, split sessions); a session whose only replica left counts, unsplit."""
        return spread([*self._current.values(), *self._previous.values()])

    def replicas_of(self, session: str) -> int:
        """The replica bits `session` stored blocks on; 0 once it is forgotten (or never seen)."""
        return self._current.get(session) or self._previous.get(session, 0)

    def __len__(self) -> int:
        return len(self._current) + len(self._previous)

    def _turn(self) -> None:
        self._previous, self._current = self._current, {}
