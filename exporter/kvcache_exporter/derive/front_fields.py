"""The field that broke the prefix, named live: attribution hands each diverged front it observes
(the stored event and where its known content starts) to `FrontFields.observe`, which samples
at most `per_second` fronts and BUSY_PER_SECOND of CPU a second, decodes the first
MAX_FRONT_TOKENS of the front with the model's tokenizer, names its first field (fields.py) and
counts the prefix_diverged tokens by it.

Nothing decoded is kept: only the redacted shape (fields.shape), in the few most recent shapes
(`recent`, for the opt-in /debug/fields endpoint) and in one log line a minute at most.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from .. import catalog as c
from ..samples import Sample
from .fields import Rules, classify, first_kind, shape

log = logging.getLogger(__name__)

MAX_FRONT_TOKENS = 64
BUSY_PER_SECOND = 0.01
"""CPU seconds a second naming may take (1 % of a core): hostile fronts cost up to ~5 ms each"""
MAX_RECENT = 32
LOG_EVERY_S = 60.0


class HasTokens(Protocol):
    token_ids: Sequence[int]


class FrontFields:
    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        rules: Rules | None = None,
        per_second: int = 20,
        clock: Callable[[], float] = time.monotonic,
        timer: Callable[[], float] = time.thread_time,
    ):
        self.decode, self.rules = decode, rules or Rules()
        self.per_second, self.clock, self.timer = per_second, clock, timer
        self.tokens = dict.fromkeys(self.rules.kinds, 0)
        self.sampled = self.skipped = 0
        self.recent: OrderedDict[str, dict] = OrderedDict()  # shape -> {field, fronts, offset}
        self._second, self._left, self._busy = -1.0, 0, 0.0
        self._logged = float("-inf")
        self._lock = threading.Lock()  # the poll applies events in a worker thread; /debug/fields reads

    def observe(self, event: HasTokens, start: int, served: int) -> None:
        """A diverged front: the event's tokens before `start` are per-request; `served` of its
        tokens were counted prefix_diverged. Its token ids are read (decoded from the wire, ~30 us
        for 1,024) only for the fronts sampled."""
        now = self.clock()
        if now - self._second >= 1.0:
            self._second, self._left, self._busy = now, self.per_second, 0.0
        if self._left <= 0 or self._busy >= BUSY_PER_SECOND or start <= 0:
            self.skipped += 1
            return
        self._left -= 1
        began = self.timer()
        text = self.decode(event.token_ids[: min(start, MAX_FRONT_TOKENS)])
        found = classify(text, self.rules)
        kind, redacted = first_kind(found), shape(text, found)
        self._busy += self.timer() - began
        with self._lock:
            self.sampled += 1
            self.tokens[kind] += served
            seen = self.recent.pop(redacted, None) or {"field": kind, "fronts": 0}
            seen["fronts"] += 1
            seen["front_tokens"] = start
            self.recent[redacted] = seen
            if len(self.recent) > MAX_RECENT:
                self.recent.popitem(last=False)
        if now - self._logged >= LOG_EVERY_S:
            self._logged = now
            log.info(
                "prefix diverged at a per-request field",
                extra={"field": kind, "front_tokens": start, "shape": redacted},
            )

    def samples(self) -> list[Sample]:
        with self._lock:
            return [
                Sample(c.PREFIX_DIVERGED_FIELD_TOKENS_TOTAL, {"field": k}, v) for k, v in self.tokens.items()
            ]

    def report(self) -> dict:
        """What /debug/fields shows: the counts and the most recent redacted shapes, newest first."""
        with self._lock:
            return {
                "fields": dict(self.tokens),
                "fronts": {"sampled": self.sampled, "skipped": self.skipped},
                "recent": [{"shape": s, **seen} for s, seen in reversed(self.recent.items())],
            }
