"""How a gateway picks a replica: one rule shared by the simulator's API server, its fleet and the
analyzer's replays, so an offline replay routes exactly as the simulated pool did."""

from __future__ import annotations

import zlib
from collections.abc import Iterable


def route(routing: str, replicas: int, session: str | None, turn: int) -> int:
    """The replica of one request: CRC32 of its session under session routing, else round-robin by `turn`
    (the count of round-robin requests before it)."""
    if routing == "session" and session:
        return zlib.crc32(session.encode()) % replicas
    return turn % replicas


def route_all(sessions: Iterable[str | None], replicas: int, routing: str) -> list[int]:
    """The replica of each request in order; round-robin counts only the requests it routes."""
    out, turn = [], 0
    for session in sessions:
        sticky = routing == "session" and bool(session)
        out.append(route(routing, replicas, session, turn))
        turn += not sticky
    return out
