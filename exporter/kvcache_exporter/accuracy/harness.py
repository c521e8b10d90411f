"""Runs cases through a backend and compares the sidecar's per-request attribution with the truth.

The sidecar's path is `serve`'s own (server.py, derive/state.py): a poll state's KV-event part, whose
sequence cursor, event view, group model (derive/units.py) and miss attribution (derive/attribution.py)
take each decoded batch; `end_poll` hands the group model's hit unit to the attribution. After each
request's batches the delta of `Attribution.totals.tokens` is that request's miss tokens by cause, read
generically (a cause added to the attribution shows up here unasked), with the tokens it says a host
tier restored; its largest cause is the named one, "hit" when it has none.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..derive.attribution import Attribution
from ..derive.kv_events import EventState
from ..derive.state import KvEventsState, PollState
from ..derive.units import UnitView
from ..sources.kv_events_decode import Batch, KvEventDrain
from .workload import FAULTS, KINDS, Request, Shape

HIT, DECODE, TIER_RESTORED = "hit", "decode", "tier_restored"
CANNOT_SHOW = "cannot_show"  # an injected change no whole hit unit holds: not counted (`can_show`)


class Backend(Protocol):
    shape: Shape

    def begin(self, case: int) -> None:
        """Case `case` (numbered from 0) starts: a backend with several engines picks the case's."""
        ...

    def send(self, request: Request) -> tuple[list[Batch], tuple[int, ...]]:
        """Do the request's `before` action, send it (generating `request.answer` tokens, at least one);
        return the KV-event batches it caused, decoded, and the token ids it generated."""
        ...


class Sidecar:
    """The attribution as `serve` wires it, fed batch by batch: a stream (and attribution) a DP rank,
    added as its first batch arrives."""

    def __init__(self) -> None:
        self.state = PollState(retention=60.0)
        self.parts: dict[int, KvEventsState] = {}
        self.part = self._part(0)
        self.attribution: Attribution = self.part.attribution  # rank 0's (the only one without DP)
        self.clock = 0.0

    def _part(self, rank: int) -> KvEventsState:
        if rank not in self.parts:
            labels = {"engine": str(rank)} if rank else None
            self.parts[rank] = self.state.add_kv_events(EventState(), labels, Attribution(), UnitView())
        return self.parts[rank]

    def feed(self, batches: Sequence[Batch]) -> dict[str, int]:
        """Apply one request's batches as one poll; its miss tokens by cause (only those that moved)."""
        before = self._counted()
        self.clock += 1.0
        for rank in sorted({b.dp_rank or 0 for b in batches} | set(self.parts)):  # every stream, every poll
            mine = tuple(b for b in batches if (b.dp_rank or 0) == rank)
            self._part(rank).ingest(KvEventDrain(mine), self.clock)
        self.state.end_poll(self.clock)
        after = self._counted()
        return {cause: n - before.get(cause, 0) for cause, n in after.items() if n != before.get(cause, 0)}

    def _counted(self) -> dict[str, int]:
        """Miss tokens by cause, and the tokens loaded back from a host tier: not a miss, but what the
        sidecar says happened to them (serve exports them apart)."""
        counted: Counter[str] = Counter()
        for part in self.parts.values():
            totals = part.attribution.totals
            counted.update({**totals.tokens, TIER_RESTORED: totals.tier_restored_tokens})
        return dict(counted)

    def decode_tokens(self) -> int:
        return sum(part.attribution.totals.decode_tokens for part in self.parts.values())


def named(delta: dict[str, int], decode: int = 0) -> str:
    """The cause with the most miss tokens (ties: the first by name); with none, "decode" when the
    request's stores were read as decode filling a block (not a prompt miss), else "hit"."""
    if not any(delta.values()):
        return DECODE if decode else HIT
    return max(sorted(delta), key=delta.__getitem__)


@dataclass(frozen=True)
class Outcome:
    kind: str
    expected: str
    named: str
    tokens: dict[str, int]


@dataclass
class Table:
    """One shape's confusion matrix: kind -> named cause -> requests."""

    shape: str
    counts: dict[str, Counter[str]] = field(default_factory=dict)

    def add(self, outcome: Outcome) -> None:
        self.counts.setdefault(outcome.kind, Counter())[outcome.named] += 1

    def scored(self, kind: str) -> int:
        counts = self.counts.get(kind, Counter())
        return sum(counts.values()) - counts[CANNOT_SHOW]

    def cannot_show(self, kind: str) -> int:
        return self.counts.get(kind, Counter())[CANNOT_SHOW]

    def right(self, kind: str) -> int:
        return self.counts.get(kind, Counter())[KINDS[kind][0]]

    def misnamed(self, kind: str) -> Counter[str]:
        counts = self.counts.get(kind, Counter()).items()
        return Counter({c: n for c, n in counts if c not in (KINDS[kind][0], CANNOT_SHOW)})

    @property
    def injected_kinds(self) -> list[str]:
        """Kinds that carry a change (not an append-only turn or an exact repeat)."""
        return [k for k in KINDS if k in self.counts and KINDS[k][0] in FAULTS]

    def faulted_appends(self) -> int:
        """Append-only turns given a fault cause (a cause that tells on-call to fix something)."""
        return sum(n for cause, n in self.counts.get("append_turn", Counter()).items() if cause in FAULTS)

    def to_json(self) -> dict:
        return {"shape": self.shape, "counts": {k: dict(sorted(v.items())) for k, v in self.counts.items()}}

    @classmethod
    def from_json(cls, data: dict) -> Table:
        return cls(data["shape"], {k: Counter(v) for k, v in data["counts"].items()})


def run(backend: Backend, cases: Iterable[list[Request]], sidecar: Sidecar | None = None) -> list[Outcome]:
    """Every case's requests in order through `backend`; the scored ones' outcomes. A request that
    follows the one before re-renders what that one generated (`Request.sent`)."""
    sidecar = sidecar or Sidecar()
    outcomes = []
    for number, case in enumerate(cases):
        backend.begin(number)
        prompt: tuple[int, ...] = ()
        answer: tuple[int, ...] = ()
        first: Sequence[Batch] = ()  # the case's first request's batches
        fill: list[Batch] = []  # the setup requests' batches after it
        for index, request in enumerate(case):
            cached = (*prompt, *answer)  # what the case's last request left in the cache
            request = request.sent(prompt, answer)
            decode = sidecar.decode_tokens()
            batches, answer = backend.send(request)
            if index == 0:
                first = batches
            elif request.expected is None:
                fill.extend(batches)
            prompt = request.prompt
            delta = sidecar.feed(batches)
            if request.expected is not None:
                name = named(delta, sidecar.decode_tokens() - decode)
                dropped = request.kind != "window_dropped" or window_part_dropped(first, fill)
                if request.expected in FAULTS and not (
                    dropped and can_show(request, cached, backend.shape.unit)
                ):
                    name = CANNOT_SHOW
                outcomes.append(Outcome(request.kind, request.expected, name, delta))
    return outcomes


def held_blocks(batches: Iterable[Batch]) -> tuple[set, set]:
    """The (group, hash) of the blocks these batches stored on the GPU: sliding-window groups',
    full-attention groups'."""
    window: set = set()
    full: set = set()
    for batch in batches:
        for e in batch.events:
            if e.type == "BlockStored" and e.medium in (None, "GPU"):
                (window if e.window else full).update((e.group, h) for h in e.block_hashes)
    return window, full


def removed_blocks(batches: Iterable[Batch]) -> set:
    """The (group, hash) of the GPU blocks these batches removed."""
    return {
        (e.group, h)
        for batch in batches
        for e in batch.events
        if e.type == "BlockRemoved" and e.medium in (None, "GPU")
        for h in e.block_hashes
    }


def window_part_dropped(prompt: Sequence[Batch], fill: Sequence[Batch]) -> bool:
    """Whether a fill's events removed a block of the window part `prompt` stored and none of its
    full part: decided from the setup requests' events, never from the scored request's outcome (a
    window_dropped case whose fill did not is not counted: `cannot_show`)."""
    window, full = held_blocks(prompt)
    removed = removed_blocks(fill)
    return bool(removed & window) and not removed & full


def can_show(request: Request, cached: Sequence[int], unit: int) -> bool:
    """Whether an injected change can reach the KV-event stream, from the case alone (never the
    outcome): vLLM stores whole hit units only, so a prompt shorter than one stores nothing, and a
    change in the prompt's content (no action before it, no other identity) that lies past its last
    whole unit leaves every unit it stores as the cache held them (`cached`: the case's previous
    prompt and its answer): no hit it could have had is lost."""
    whole = len(request.prompt) // unit * unit
    if not whole:
        return False
    if request.before is not None or request.identity is not None:
        return True
    same = next(
        (i for i, (a, b) in enumerate(zip(request.prompt, cached, strict=False)) if a != b),
        min(len(request.prompt), len(cached)),
    )
    return same < whole


def tabulate(shape: str, outcomes: Iterable[Outcome]) -> Table:
    table = Table(shape)
    for outcome in outcomes:
        table.add(outcome)
    return table
