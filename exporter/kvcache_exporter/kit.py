"""The source kit: what a source declares beside its code, as one row.

A row (`SourceKit`) names a source's catalog entries, its options (rows of serve's option table;
their values reach it as `Settings.source_options[attr]`), how it is wired (`wire`: its polls,
each into the part of the poll state it keeps in `PollState.parts[name]`) and its derivations (run
after the built-in table, each costing only its own series when it fails). `register(row)` puts
them where the rest of the exporter reads them: catalog.CATALOG (so docs/metrics.md and the guard
know the metrics), config.OPTIONS (flags, environment twins, YAML keys, --help, README's table),
and KITS, which `serve` (server.build_exporter) wires after the built-in sources.

So a new source is its source module, its derivation module and one row, plus their tests
(tests/core/test_kit.py adds a toy one that way). The built-in sources (vLLM/SGLang, GPU, KV
events) are still wired in server.py and declared in catalog.py, config.py and settings.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import catalog, config

if TYPE_CHECKING:
    from .collector import Poll
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


KITS: list[SourceKit] = []


def register(kit: SourceKit) -> SourceKit:
    """Add a source's row; a metric or option name another row (or a built-in) has is refused."""
    if any(k.name == kit.name for k in KITS):
        raise ValueError(f"source {kit.name!r} is registered twice")
    catalog.add(kit.metrics)
    config.add_serve_options(kit.options)
    KITS.append(kit)
    return kit


def wire(settings: Settings, state: PollState) -> list[Poll]:
    return [poll for kit in KITS if kit.wire is not None for poll in kit.wire(settings, state)]


def derivations() -> dict[str, Any]:
    return {f"{kit.name}.{name}": d for kit in KITS for name, d in kit.derivations.items()}
