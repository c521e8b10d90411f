"""The source kit: what a source declares beside its code, as one row.

A row (`SourceKit`) names a source's catalog entries, its options (rows of serve's option table),
how it is wired (`wire`: its polls, each into its part of the poll state), its derivations (each
costing only its own series when it fails), the longest its poll may take (`timeout`, so the
engine's deadline is past it) and what it does once the engine exists (`built`: a source that adds
polls later, a debug page).

`serve` is the list of rows in server.ROWS (the built-in sources, in poll and derivation order)
followed by the registered ones (KITS), run by the one engine (collector.Exporter).

A registered source (a plug-in) is its source module, its derivation module and one
`register(row)`, plus their tests; no product file is edited (tests/core/test_kit.py adds a toy one
that way). `register` appends its entries to catalog.CATALOG (so docs/metrics.md and the guard know
them), its options to config.OPTIONS (flags, environment twins, YAML keys, --help, README's table;
their values reach it as `Settings.source_options[attr]`) and its row to KITS.

A built-in source declares the same beside its code in a `*_kit.py` (entries, options, a typed
settings class, checks: sources/engine_kit.py, sources/kv_events_kit.py, sources/gpu_kit.py,
derive/cost_kit.py, derive/audit_kit.py, fleet_publish_kit.py); catalog.py, config.py and
settings.py name each kit once, so its entries and options keep their place in docs/metrics.md,
--help and README's tables.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import catalog, config

if TYPE_CHECKING:
    from .collector import Exporter, Poll
    from .derive.registry import Derivation
    from .derive.state import PollState
    from .settings import Settings


@dataclass(frozen=True)
class SourceKit:
    name: str
    metrics: tuple[catalog.Metric, ...] = ()
    options: tuple[config.Option, ...] = ()
    wire: Callable[[Settings, PollState], Sequence[Poll]] | None = None
    derivations: Mapping[str, Derivation] = field(default_factory=dict)
    timeout: Callable[[Settings], float] | None = None
    built: Callable[[Settings, Exporter], None] | None = None


KITS: list[SourceKit] = []


def register(kit: SourceKit) -> SourceKit:
    """Add a source's row; a metric or option name another row (or a built-in) has is refused."""
    if any(k.name == kit.name for k in KITS):
        raise ValueError(f"source {kit.name!r} is registered twice")
    catalog.add(kit.metrics)
    config.add_serve_options(kit.options)
    KITS.append(kit)
    return kit


def wire(rows: Sequence[SourceKit], settings: Settings, state: PollState) -> list[Poll]:
    return [poll for kit in rows if kit.wire is not None for poll in kit.wire(settings, state)]


def derivations(rows: Sequence[SourceKit], built_in: Sequence[SourceKit] = ()) -> dict[str, Any]:
    """A built-in row's derivations by their own names (as before rows), a registered row's as
    `row.name`."""
    own = {name: d for kit in built_in for name, d in kit.derivations.items()}
    return own | {f"{kit.name}.{name}": d for kit in rows for name, d in kit.derivations.items()}
