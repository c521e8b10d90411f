"""The source kit: what a source declares beside its code, as one row.

A row (`SourceKit`) names a source's catalog entries, its options (rows of its command's option
table), how it is wired (`wire`: its polls, each into its part of the poll state), its
derivations (each costing only its own series when it fails), the longest its poll may take
(`timeout`, so the engine's deadline is past it), what it does once the engine exists (`built`:
a source that adds polls later, a debug page) and, for a registered row, the servers it joins
(`servers`: "serve", "aggregate" or both).

Both servers are lists of rows, each built into the one engine (collector.Exporter) by `engine`:
`serve` is server.ROWS (the built-in sources, in poll and derivation order) followed by the rows
registered for it (`registered("serve")`); `aggregate` is aggregator/rows.ROWS (its replicas and
their discovery, the fleet's KV-event intake, the NATS intake, the fleet view's derivations),
wired into its pool, followed by the rows registered for it (`registered("aggregate")`).

A registered source (a plug-in) is its source module, its derivation module and one
`register(row)`, plus their tests; no product file is edited (tests/core/test_kit.py adds a toy one
that way and runs it in both servers). `register` appends its entries to catalog.CATALOG (so
docs/metrics.md and the guard know them), its options to the option table of each server it joins
(config.OPTIONS, config.AGGREGATE_OPTIONS with aggregate's environment twins: flags, environment,
YAML keys, --help, README's tables; their values reach it as `source_options[attr]` of serve's
Settings and of aggregate's PoolSettings) and its row to KITS. Its callables take each server's
(settings, state): in `aggregate` the state is the pool (aggregator/pool.Aggregator), whose
`parts` holds a registered row's own part as serve's PollState does.

A built-in source declares the same beside its code in a `*_kit.py` (entries, options, a typed
settings class, checks: sources/engine_kit.py, sources/kv_events_kit.py, sources/gpu_kit.py,
derive/cost_kit.py, derive/audit_kit.py, fleet_publish_kit.py; aggregate's rows in
fleet_view_kit.py); catalog.py, config.py and settings.py name each kit once, so its entries and
options keep their place in docs/metrics.md, --help and README's tables.
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
    servers: tuple[str, ...] = ("serve",)  # a registered row's: the servers it joins


SERVERS = ("serve", "aggregate")
KITS: list[SourceKit] = []


def register(kit: SourceKit) -> SourceKit:
    """Add a source's row to the servers it names; a metric or option name another row (or a
    built-in) has is refused."""
    if any(k.name == kit.name for k in KITS):
        raise ValueError(f"source {kit.name!r} is registered twice")
    if not kit.servers or set(kit.servers) - set(SERVERS):
        raise ValueError(f"source {kit.name!r}: servers must be some of {', '.join(SERVERS)}")
    catalog.add(kit.metrics)
    if "serve" in kit.servers:
        config.add_serve_options(kit.options)
    if "aggregate" in kit.servers:
        config.add_aggregate_options(kit.options)
    KITS.append(kit)
    return kit


def registered(server: str) -> list[SourceKit]:
    """The rows registered for `server`, in the order they were."""
    return [kit for kit in KITS if server in kit.servers]


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
