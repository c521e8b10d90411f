"""The sidecar's answer on a trace: the misses by cause and the reorder estimate, by `serve`'s own rule.

The trace is replayed sequentially per replica through the simulator's engine with its KV events on;
every step's events go through vLLM's wire encoding (simulator/kv_events.py) and the sidecar's decoder
into `serve`'s wiring (accuracy/harness.Sidecar: poll state, group model, derive/attribution.py). So
the analyzer's cause table and "estimated live" row are what `serve` would say beside vLLM on the same
token stream: one rule set, offline and live (the analyzer/sidecar agreement test checks it against a
`simulate` + `serve` pair).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ..accuracy.harness import Sidecar
from ..derive.attribution import CAUSES
from ..derive.front_fields import FrontFields
from ..derive.layouts import LAYOUTS
from ..derive.reorder import reordered_hit_ratio
from ..simulator.engine import Engine, EngineConfig, Request
from ..simulator.streams import step_batches
from .replay import route
from .trace import TraceRequest

PARTIAL = "partial_block"  # computed prompt tokens in no stored block (the last, partial one)


@dataclass
class LiveView:
    prompt_tokens: int
    hit_tokens: int
    misses_by_cause: dict[str, int]
    """computed prompt tokens by the sidecar's causes (every cause, in rule order), and partial_block"""
    decode_tokens: int
    reorder_tokens: dict[str, int]
    """of the prefix_diverged tokens, those a reorder to each layout would hit (derive/layouts.py)"""
    field: tuple[str, str] | None = None
    """(kind, redacted shape) of the field that broke the prefix, as serve names it (front_fields.py)"""

    @property
    def reordered_estimate(self) -> float | None:
        """The sidecar's reorder estimate: (hits + prefix_diverged) / prompt tokens."""
        return reordered_hit_ratio(
            self.hit_tokens, self.prompt_tokens, self.misses_by_cause["prefix_diverged"]
        )

    def layout_estimate(self, layout: str) -> float | None:
        """The sidecar's estimate of a reorder to `layout` (derive/layouts.py's LAYOUTS)."""
        return reordered_hit_ratio(self.hit_tokens, self.prompt_tokens, self.reorder_tokens[layout])


class _Replica:
    def __init__(self, config: EngineConfig, index: int, decode=None) -> None:
        self.config, self.index = config, index
        self.sidecar = Sidecar()
        if decode is not None:  # every front named: no rate or CPU limit offline
            fields = FrontFields(decode, per_second=1 << 62, timer=lambda: 0.0)
            self.sidecar.attribution.fields = fields
        self.restart()

    def restart(self) -> None:
        """A new publisher with an empty cache: seq from 0, which the sidecar reads as a restart."""
        self.engine, self.seq, self.clock = Engine(self.config, self.index), 0, 0.0

    def run(self, request: Request) -> None:
        self.engine.add_request(request)
        batches, self.clock, self.seq = step_batches(self.engine, self.clock, self.seq, self.index)
        self.sidecar.feed(batches)


def live_view(
    requests: Sequence[TraceRequest],
    block_size: int,
    num_gpu_blocks: int,
    replicas: int = 1,
    routing: str = "round-robin",
    max_model_len: int | None = None,
    restarts: frozenset[int] = frozenset(),
    decode=None,
) -> LiveView:
    """One sidecar per replica (a KV-event stream is one engine's), as `serve` reads a DP deployment.
    `decode` (the model's tokenizer): the field that broke the prefix is named as serve names it."""
    longest = max((len(r.prompt_token_ids) + r.max_tokens for r in requests), default=1)
    config = EngineConfig(
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        max_model_len=max(max_model_len or 0, longest),
        max_num_batched_tokens=max(8192, longest),
    )
    fleet = [_Replica(config, i, decode) for i in range(replicas)]
    prompt_tokens = hit_tokens = 0
    for n, (r, replica) in enumerate(zip(requests, route(requests, replicas, routing), strict=True)):
        if n in restarts:
            for each in fleet:
                each.restart()
        sim = Request(str(n), list(r.prompt_token_ids), r.max_tokens, 0.0, forced_output=r.forced_output)
        try:
            fleet[replica].run(sim)
        except ValueError:  # never fits the pool: rejected, as the replays skip it
            continue
        prompt_tokens += len(r.prompt_token_ids)
        hit_tokens += max(sim.num_cached_tokens, 0)
    causes = dict.fromkeys(CAUSES, 0)
    for each in fleet:
        for cause, tokens in each.sidecar.attribution.totals.tokens.items():
            causes[cause] += tokens
    causes[PARTIAL] = max(prompt_tokens - hit_tokens - sum(causes.values()), 0)
    decoded = sum(each.sidecar.decode_tokens() for each in fleet)
    layouts = {
        layout: sum(each.sidecar.attribution.totals.reorder_tokens[layout] for each in fleet)
        for layout in LAYOUTS
    }
    return LiveView(prompt_tokens, hit_tokens, causes, decoded, layouts, _named(fleet))


def _named(fleet: Sequence[_Replica]) -> tuple[str, str] | None:
    """The kind with the most prefix_diverged tokens, and its most common redacted shape."""
    tokens: Counter[str] = Counter()
    shapes: Counter[tuple[str, str]] = Counter()
    for each in fleet:
        fields = each.sidecar.attribution.fields
        if fields is not None:
            tokens.update(fields.tokens)
            shapes.update({(seen["field"], shape): seen["fronts"] for shape, seen in fields.recent.items()})
    if not tokens or not tokens.most_common(1)[0][1]:
        return None
    kind = tokens.most_common(1)[0][0]
    return kind, max((n, shape) for (k, shape), n in shapes.items() if k == kind)[1] if shapes else ""
