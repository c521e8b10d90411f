"""Basic auth against bcrypt hashes, off the event loop and at the same cost for every username.

bcrypt is slow on purpose (a cost-12 check is ~250 ms): run on the loop, 40 wrong-password clients
stalled a scrape for 12 s. Checks run in a small thread pool; a burst beyond its queue, or beyond
one client address's share of it, is refused at once (429). A success (keyed on a hash of user and
password) skips bcrypt for `success_ttl`, since Prometheus sends the same credentials every
scrape; after that, credentials that matched before are checked again in a lane of their own that
never refuses, so a wrong-password flood can slow a correct scrape but never turn it away. Only
matching credentials enter that lane, so a flood cannot fill it. An unknown user is checked
against a dummy hash of the real hashes' cost, so the answer time does not tell which usernames
exist.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import time
from collections import Counter
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
        max_pending_per_address: int = 4,
        success_ttl: float = 60.0,
        verify: Verify = _checkpw,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.users, self.dummy = dict(users), dummy_hash(users)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="bcrypt")
        self.known_pool = ThreadPoolExecutor(1, thread_name_prefix="bcrypt-known")
        self.max_pending, self.max_per_address = max_pending, max_pending_per_address
        self.pending: Counter[str] = Counter()  # client address -> checks queued or running
        self.success_ttl, self.verify, self.clock = success_ttl, verify, clock
        # sha256(user, password) of credentials that matched -> until when bcrypt is skipped. Kept
        # once expired: they choose the lane. Few entries (users x passwords), only correct ones.
        self.known: dict[bytes, float] = {}

    async def check(self, header: str, address: str = "") -> str:
        """ "ok", "unauthorized" or "busy" (too many unknown credentials queued: refused without
        bcrypt). Credentials that matched before are never "busy"."""
        given = credentials(header)
        if given is None:
            return "unauthorized"
        user, password = given
        key = hashlib.sha256(f"{user}\0{password}".encode()).digest()
        if key in self.known:
            if self.known[key] > self.clock():
                return "ok"
            return await self._verify(self.known_pool, key, user, password)
        if self.pending.total() >= self.max_pending or self.pending[address] >= self.max_per_address:
            return "busy"
        self.pending[address] += 1
        try:
            return await self._verify(self.pool, key, user, password)
        finally:
            self.pending[address] -= 1
            if not self.pending[address]:
                del self.pending[address]

    async def _verify(self, pool: ThreadPoolExecutor, key: bytes, user: str, password: str) -> str:
        hashed = self.users.get(user)
        loop = asyncio.get_running_loop()
        matched = await loop.run_in_executor(pool, self.verify, password.encode(), hashed or self.dummy)
        if not (matched and hashed is not None):
            return "unauthorized"
        if key in self.known or len(self.known) < 64:
            self.known[key] = self.clock() + self.success_ttl
        return "ok"

    def close(self) -> None:
        for pool in (self.pool, self.known_pool):
            pool.shutdown(wait=False, cancel_futures=True)
