"""The source kit: what a source declares beside its code, as one row.

A row (`SourceKit`) names a source's catalog entries, its options (rows of its command's option
table), how it is wired (`wire`: its polls, each into its part of the poll state), its
derivations (each costing only its own series when it fails), the longest its poll may take
(`timeout`, so the engine's deadline is past it) and what it does once the engine exists (`built`:
a source that adds polls later, a debug page).

Both servers are lists of rows, each built into the one engine (collector.Exporter) by `engine`:
`serve` is server.ROWS (the built-in sources, in poll and derivation order) followed by the
registered ones (KITS); `aggregate` is aggregator/rows.ROWS (its replicas and their discovery, the
fleet's KV-event intake, the NATS intake, the fleet view's derivations), wired into its pool.

A registered source (a plug-in) is its source module, its derivation module and one
`register(row)`, plus their tests; no product file is edited (tests/core/test_kit.py adds a toy one
that way). `register` appends its entries to catalog.CATALOG (so docs/metrics.md and the guard know
them), its options to config.OPTIONS (flags, environment twins, YAML keys, --help, README's table;
their values reach it as `Settings.source_options[attr]`) and its row to KITS.

A built-in source declares the same beside its code in a `*_kit.py` (entries, options, a typed
settings class, checks: sources/engine_kit.py, sources/kv_events_kit.py, sources/gpu_kit.py,
derive/cost_kit.py, derive/audit_kit.py, fleet_publish_kit.py; aggregate's rows in
fleet_view_kit.py); catalog.py, config.py and settings.py name each kit once, so its entries and
options keep their place in docs/metrics.md, --help and README's tables. A registered row is
serve's only: `register` adds to serve's tables.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import catalog, config
from .collector import Exporter

if TYPE_CHECKING:
    from .collector import Poll
    from .samples import Sample


@dataclass(frozen=True)
class SourceKit:
    """Its callables take (settings, state): serve's Settings and PollState, aggregate's
    PoolSettings and Aggregator (aggregator/pool.py)."""

    name: str
    metrics: tuple[catalog.Metric, ...] = ()
    options: tuple[config.Option, ...] = ()
    wire: Callable[[Any, Any], Sequence[Poll]] | None = None
    derivations: Mapping[str, Callable[[Any, Any], list[Sample]]] = field(default_factory=dict)
    timeout: Callable[[Any], float] | None = None
    built: Callable[[Any, Exporter], None] | None = None


KITS: list[SourceKit] = []


def register(kit: SourceKit) -> SourceKit:
    """Add a source's row; a metric or option name another row (or a built-in) has is refused."""
    if any(k.name == kit.name for k in KITS):
        raise ValueError(f"source {kit.name!r} is registered twice")
    catalog.add(kit.metrics)
    config.add_serve_options(kit.options)
    KITS.append(kit)
    return kit


def wire(rows: Sequence[SourceKit], settings: Any, state: Any) -> list[Poll]:
    return [poll for kit in rows if kit.wire is not None for poll in kit.wire(settings, state)]


def derivations(
    rows: Sequence[SourceKit], built_in: Sequence[SourceKit] = ()
) -> dict[str, Callable[[Any, Any], list[Sample]]]:
    """A built-in row's derivations by their own names (as before rows), a registered row's as
    `row.name`."""
    own = {name: d for kit in built_in for name, d in kit.derivations.items()}
    return own | {f"{kit.name}.{name}": d for kit in rows for name, d in kit.derivations.items()}


def engine(
    rows: Sequence[SourceKit],
    settings: Any,
    state: Any,
    options: Any,
    *,
    interval: float,
    clock: Callable[[], float],
    registered: Sequence[SourceKit] = (),
    refresh: Callable[[], Awaitable[Sequence[Poll]]] | None = None,
    **hooks: Any,
) -> Exporter:
    """The one engine (collector.Exporter) of a list of rows, `serve`'s (server.ROWS, then the
    `registered` ones) or `aggregate`'s (aggregator/rows.py): every row's polls into `state`, a
    deadline past every row's own timeout, their derivations in row order, then each row's `built`.
    With `refresh` (aggregate's: the polls of a round, one per replica discovery finds) the rows'
    polls are the ones every round starts with (its discovery); `hooks` are the engine's others."""
    every = (*rows, *registered)
    polls = wire(every, settings, state)
    timeouts = [row.timeout(settings) for row in every if row.timeout is not None]
    exporter = Exporter(
        [] if refresh else polls,
        state,
        options,
        interval=interval,
        clock=clock,
        deadline=max(2 * interval, 10.0, *timeouts),  # past every source's own timeout
        derivations=derivations(registered, rows),
        discovery=polls if refresh else (),
        refresh=refresh,
        **hooks,
    )
    for row in every:
        if row.built is not None:
            row.built(settings, exporter)
    return exporter
