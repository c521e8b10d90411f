"""The aggregator's open-file budget: which replicas' KV events it may subscribe to and how many
/metrics polls may run at once, so that what it opens never meets the open-file limit (EMFILE).

What a replica costs (measured by `make bench`, tools/bench_fleet.py):
- its KV events on a lane shared with other IP addresses (one IP per pod): one descriptor, its TCP
  connection (a refused one holds one while it connects, and again at each retry);
- its KV events on an IP address every lane already has (replicas on one host, different ports):
  two, a SUB socket of its own (libzmq gives every socket a mailbox, an eventfd) and its
  connection. A shared socket tells messages apart by sender address only (Peer-Address has no
  port), so two publishers on one address never share one;
- its /metrics poll: one while it runs (no keep-alive), two where its URL names a host (the
  resolver opens a socket or file of its own meanwhile): `poll_fds` a slot, bounded by `poll_slots`.
Reserved besides: BASE_FDS (stdio, the event loop, our listener, ZMQ's context) and SCRAPE_RESERVE
connections to our own /metrics. A replica whose events do not fit is not subscribed: its
kv_events collector fails with reason fd_exhausted until descriptors free up; the rest still work.
"""

from __future__ import annotations

import ipaddress
import os
import resource
from collections import Counter
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from .events import peer_key

BASE_FDS = 16  # measured: stdio, the event loop, the listener, ZMQ's context, a log file
SCRAPE_RESERVE = 4  # connections to our own /metrics that always find a descriptor
MAX_POLL_SLOTS = 64


def open_file_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def open_now() -> int:
    """Descriptors this process holds now; 0 without procfs."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def raise_open_file_limit() -> int:
    """The soft open-file limit up to the hard one, as Go programs (Prometheus) do at start: 1,024
    is a common soft default. Returns the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


@dataclass
class FdBudget:
    """Subscriptions taken against `limit`, leaving BASE_FDS, SCRAPE_RESERVE and one poll slot.
    Lanes are counted as FleetEvents places endpoints: shared lanes as many as the most endpoints
    on one address, plus one lane per endpoint naming a host."""

    limit: int
    poll_fds: int = 1  # 2 once any /metrics URL names a host (set_poll_urls)
    subscribed: dict[Hashable, str | None] = field(default_factory=dict)  # stream -> its IP (None: own lane)
    per_address: Counter[str] = field(default_factory=Counter)

    def lanes(self) -> int:
        hosts = sum(1 for key in self.subscribed.values() if key is None)
        return max(self.per_address.values(), default=0) + hosts

    def in_use(self) -> int:
        return BASE_FDS + len(self.subscribed) + self.lanes()

    def cost(self, endpoint: str, bind: bool = False) -> int:
        """Descriptors subscribing to `endpoint` adds: its connection, and a lane if it needs one."""
        key = None if bind else peer_key(endpoint)
        new_lane = key is None or self.per_address[key] >= max(self.per_address.values(), default=0)
        return 1 + new_lane

    def full(self) -> bool:
        """Not even one more connection fits."""
        return self.in_use() + 1 + SCRAPE_RESERVE + self.poll_fds > self.limit

    def take(self, name: Hashable, endpoint: str, bind: bool = False) -> bool:
        """Subscribe `name` if its cost fits; False (nothing taken) when it does not. An endpoint we
        bind has a lane of its own."""
        if name in self.subscribed:
            return True
        if self.in_use() + self.cost(endpoint, bind) + SCRAPE_RESERVE + self.poll_fds > self.limit:
            return False
        key = self.subscribed[name] = None if bind else peer_key(endpoint)
        if key is not None:
            self.per_address[key] += 1
        return True

    def release(self, name: Hashable) -> None:
        if name not in self.subscribed:
            return
        key = self.subscribed.pop(name)
        if key is not None:
            self.per_address[key] -= 1
            if not self.per_address[key]:
                del self.per_address[key]

    def poll_slots(self, held: int = 0) -> int:
        """/metrics polls at once: what the limit leaves beyond the subscriptions (or what is `held`
        now, if more) and the scrapes; at least one, so a full budget polls one after another."""
        in_use = max(held, self.in_use())
        return max(1, min(MAX_POLL_SLOTS, (self.limit - in_use - SCRAPE_RESERVE) // self.poll_fds))

    def set_poll_urls(self, urls: Iterable[str]) -> None:
        self.poll_fds = 1 + any(not _is_ip(urlsplit(url).hostname or "") for url in urls)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
