"""Basic auth against bcrypt hashes, off the event loop and at the same cost for every username.

bcrypt is slow on purpose (a cost-12 check is ~250 ms): run on the loop, 40 wrong-password clients
stalled a scrape for 12 s. Checks run in a small thread pool; a burst beyond its queue is refused
at once; a recent success (keyed on a hash of user and password) skips bcrypt, since Prometheus
sends the same credentials every scrape. An unknown user is checked against a dummy hash of the
real hashes' cost, so the answer time does not tell which usernames exist.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import bcrypt

Verify = Callable[[bytes, bytes], bool]


def _checkpw(password: bytes, hashed: bytes) -> bool:
    try:
        return bcrypt.checkpw(password, hashed)
    except ValueError:
        return False


def dummy_hash(users: Mapping[str, bytes]) -> bytes:
    """A well-formed hash nobody's password matches, at the highest cost among the users'."""
    cost = max((int(h[4:6]) for h in users.values()), default=4)
    return bcrypt.gensalt(rounds=cost) + b"." * 31


def credentials(header: str) -> tuple[str, str] | None:
    if not header.startswith("Basic "):
        return None
    try:
        user, sep, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return (user, password) if sep else None


class Authenticator:
    def __init__(
        self,
        users: Mapping[str, bytes],
        *,
        threads: int = 2,
        max_pending: int = 16,
        success_ttl: float = 60.0,
        verify: Verify = _checkpw,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.users, self.dummy = dict(users), dummy_hash(users)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="bcrypt")
        self.max_pending, self.pending = max_pending, 0
        self.success_ttl, self.verify, self.clock = success_ttl, verify, clock
        self.recent: dict[bytes, float] = {}  # sha256(user, password) -> when it expires

    async def check(self, header: str) -> str:
        """ "ok", "unauthorized" or "busy" (too many checks queued: refused without bcrypt)."""
        given = credentials(header)
        if given is None:
            return "unauthorized"
        user, password = given
        key = hashlib.sha256(f"{user}\0{password}".encode()).digest()
        if self.recent.get(key, 0.0) > self.clock():
            return "ok"
        if self.pending >= self.max_pending:
            return "busy"
        hashed = self.users.get(user)
        self.pending += 1
        try:
            loop = asyncio.get_running_loop()
            matched = await loop.run_in_executor(
                self.pool, self.verify, password.encode(), hashed or self.dummy
            )
        finally:
            self.pending -= 1
        if not (matched and hashed is not None):
            return "unauthorized"
        self._remember(key)
        return "ok"

    def _remember(self, key: bytes) -> None:
        now = self.clock()
        self.recent = {k: t for k, t in self.recent.items() if t > now}  # few entries: users x passwords
        if len(self.recent) < 64:
            self.recent[key] = now + self.success_ttl

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
