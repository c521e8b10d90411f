"""The source kit (kit.py): a toy source added the way a new source is meant to be, in files written
here to a temporary folder (its source module, its derivation module) and one row registered for
both servers, run as the real `kvcache-exporter serve`, `aggregate` and `docs` processes. The test
lists the files the source needed and shows its metric served on both servers' /metrics (and
following its input), documented in docs/metrics.md's output, its flag in both --help texts (each
with its server's environment twin), and a bad reading counted under its own collector, not the
loop's end."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest

from kvcache_exporter.tools.harness import stop, wait_showing
from tests.conftest import free_port

TOY_SOURCE = '''
"""A toy source: one reading from a file; its option beside it."""
from kvcache_exporter.config import Option
from kvcache_exporter.sources.base import SourceError

OPTIONS = (Option("toy.path", str, "", "file holding the toy reading"),)


class ToySource:
    name = "toy"

    def __init__(self, path):
        self.path = path

    async def collect(self):
        text = open(self.path).read().strip()
        try:
            return float(text)
        except ValueError:
            raise SourceError("parse_error", "not a number") from None

    async def close(self):
        pass
'''

TOY_DERIVE = '''
"""The toy's state part, its catalog entry and its derivation."""
from kvcache_exporter.catalog import Metric
from kvcache_exporter.collector import Poll
from kvcache_exporter.samples import Sample

from toy_source import ToySource

TOY_READING = "kvcache_toy_reading"
METRICS = (Metric(TOY_READING, "gauge", "The toy's last reading.", group="toy", per_target=False),)


class ToyPart:
    value = None

    def ingest(self, reading, ts):
        self.value = reading


def wire(settings, state):
    part = state.parts["toy"] = ToyPart()
    return [Poll(ToySource(settings.source_options["toy_path"]), part.ingest)]


def reading(state, options):
    value = state.parts["toy"].value
    return [] if value is None else [Sample(TOY_READING, {}, value)]
'''

ROW = """
import sys
import toy_derive, toy_source
from kvcache_exporter import kit
row = kit.SourceKit(
    "toy", toy_derive.METRICS, toy_source.OPTIONS, toy_derive.wire, {"r": toy_derive.reading},
    servers=SERVERS,
)
kit.register(row)
from kvcache_exporter.cli import main
sys.exit(main())
"""


TOY = [
    sys.executable,
    "-c",
    textwrap.dedent(ROW).replace("SERVERS", '("serve", "aggregate")'),
]  # with its row


@pytest.mark.timeout(150)
def test_a_toy_source_needs_its_two_modules_and_one_row(tmp_path):
    toy = tmp_path / "toy"
    toy.mkdir()
    (toy / "toy_source.py").write_text(TOY_SOURCE)
    (toy / "toy_derive.py").write_text(TOY_DERIVE)
    needed = sorted(p.name for p in toy.iterdir())
    assert needed == ["toy_derive.py", "toy_source.py"]  # plus the one row, no product file edited
    env = {**os.environ, "PYTHONPATH": str(toy)}
    run = dict(cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)

    helped = subprocess.run([*TOY, "serve", "--help"], **run)
    assert "--toy.path" in helped.stdout and "KVCACHE_EXPORTER_TOY_PATH" in helped.stdout
    documented = subprocess.run([*TOY, "docs", "--output", str(tmp_path / "metrics.md")], **run)
    assert documented.returncode == 0, documented.stderr
    assert "| `kvcache_toy_reading` | gauge |" in (tmp_path / "metrics.md").read_text()

    reading, port = tmp_path / "reading", free_port()
    reading.write_text("41.5\n")
    serve = subprocess.Popen(
        [*TOY, "serve", "--vllm.url", f"http://127.0.0.1:{free_port()}/metrics",
         "--toy.path", str(reading), "--web.listen-address", f"127.0.0.1:{port}",
         "--collect.interval", "200ms", "--gpu.source", "none", "--kv-events.discovery", "off"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        text = wait_showing(url, "kvcache_toy_reading 41.5", 45)
        assert 'kvcache_exporter_collector_success{collector="toy"} 1.0' in text
        reading.write_text("not a number\n")  # bad input: counted under its collector, its series absent
        text = wait_showing(url, 'kvcache_exporter_errors_total{collector="toy",reason="parse_error"}', 30)
        assert 'kvcache_exporter_collector_success{collector="toy"} 0.0' in text
        assert "kvcache_toy_reading " not in text
        reading.write_text("7\n")
        wait_showing(url, "kvcache_toy_reading 7.0", 30)
    finally:
        stop(serve)

    # the same row inside aggregate's engine, beside its replicas row (one replica, not answering)
    helped = subprocess.run([*TOY, "aggregate", "--help"], **run)
    assert "--toy.path" in helped.stdout and "KVCACHE_AGGREGATE_TOY_PATH" in helped.stdout
    port = free_port()
    aggregate = subprocess.Popen(
        [*TOY, "aggregate", "--replica", f"127.0.0.1:{free_port()}", "--kv-events.discovery", "off",
         "--web.listen-address", f"127.0.0.1:{port}", "--collect.interval", "200ms"],
        cwd=tmp_path, env={**env, "KVCACHE_AGGREGATE_TOY_PATH": str(reading)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        text = wait_showing(url, "kvcache_toy_reading 7.0", 45)
        assert 'kvcache_exporter_collector_success{collector="toy"} 1.0' in text
        assert "kvcache_fleet_replicas 1.0" in text  # aggregate's own rows still run
        reading.write_text("3.25\n")
        wait_showing(url, "kvcache_toy_reading 3.25", 30)
    finally:
        stop(aggregate)


def test_a_row_joins_only_the_servers_it_names(tmp_path):
    """A row registered for `aggregate` alone is in aggregate's option table, not serve's; a row
    naming no server or one that does not exist is refused before anything is added."""
    from kvcache_exporter import catalog, kit

    toy = tmp_path / "toy"
    toy.mkdir()
    (toy / "toy_source.py").write_text(TOY_SOURCE)
    (toy / "toy_derive.py").write_text(TOY_DERIVE)
    only = [sys.executable, "-c", textwrap.dedent(ROW).replace("SERVERS", '("aggregate",)')]
    run = dict(
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(toy)}, capture_output=True, text=True, timeout=60
    )
    assert "--toy.path" in subprocess.run([*only, "aggregate", "--help"], **run).stdout
    assert "--toy.path" not in subprocess.run([*only, "serve", "--help"], **run).stdout

    before = catalog.CATALOG
    metric = catalog.Metric("kvcache_nowhere_reading", "gauge", "A row of no server's.", per_target=False)
    for servers in ((), ("serve", "fleet")):
        with pytest.raises(ValueError, match="servers must be some of serve, aggregate"):
            kit.register(kit.SourceKit("nowhere", (metric,), servers=servers))
    assert catalog.CATALOG is before and kit.KITS == []


def test_serve_is_its_rows_and_a_row_declares_its_whole_source():
    """The built-ins are rows too (server.ROWS): their derivations, in order, are the engine's
    table; a row that declares its source declares every metric and option of it, which the
    catalog and the option table hold in their place."""
    from kvcache_exporter import catalog, config, kit, server
    from kvcache_exporter.derive.registry import DERIVATIONS

    assert list(kit.derivations([], server.ROWS)) == list(DERIVATIONS)
    rows = {row.name: row for row in server.ROWS}
    assert len(rows) == len(server.ROWS)
    whole = {  # row -> (its metrics, its options), as the catalog and option table tell them apart
        "gpu": (lambda m: m.group in ("gpu", "memory"), "gpu."),
        "cost": (lambda m: m.group == "cost", "cost."),
        "audit": (lambda m: m.name.startswith("kvcache_config_"), "audit."),
        "fleet_publish": (lambda m: m.source == "serve --fleet.publish", "fleet."),
        "kv_events": (lambda m: m.group in ("events", "attribution"), ("kv_events.", "whatif.", "fields.")),
        "vllm": (
            lambda m: m.group in ("cache", "blocks", "latency", "sglang") or "vllm" in m.name,
            ("vllm.", "engine."),
        ),
    }
    for name, (mine, prefix) in whole.items():
        assert list(rows[name].metrics) == [m for m in catalog.CATALOG if mine(m)], name
        assert list(rows[name].options) == [o for o in config.OPTIONS if o.key.startswith(prefix)], name
    for row in server.ROWS:
        assert all(m in catalog.CATALOG for m in row.metrics) and all(
            o in config.OPTIONS for o in row.options
        )


def test_aggregate_is_its_rows_and_they_declare_all_its_options():
    """`aggregate`'s sources are rows too (aggregator/rows.py): their derivations, in order, are its
    derivation table; they declare every fleet entry but serve's publisher's, and every option of
    aggregate's table (as it has them: its env twin, its default) but the collecting, endpoint and
    logging ones that both commands have (serve's rows do not declare those either). The pool's
    engine is built from them: their discovery polls first, the replicas row's deadline."""
    from kvcache_exporter import catalog, config, kit
    from kvcache_exporter.aggregator import pool_samples, rows
    from kvcache_exporter.aggregator.discovery import StaticSd
    from kvcache_exporter.aggregator.pool import Aggregator, PoolSettings

    assert list(kit.derivations([], rows.ROWS)) == list(pool_samples.DERIVATIONS)
    assert kit.derivations([], rows.ROWS) == pool_samples.DERIVATIONS
    assert len({row.name for row in rows.ROWS}) == len(rows.ROWS)
    entries = [m for row in rows.ROWS for m in row.metrics]
    fleet = [m for m in catalog.CATALOG if m.group == "fleet" and m.source != "serve --fleet.publish"]
    assert sorted(m.name for m in entries) == sorted(m.name for m in fleet) and len(fleet) > 20
    declared = [o for row in rows.ROWS for o in row.options]
    assert all(o in config.AGGREGATE_OPTIONS for o in declared)
    both = [o.key for o in config.AGGREGATE_OPTIONS if o.key.startswith(("collect.", "web.", "log."))]
    assert sorted([o.key for o in declared] + both) == sorted(o.key for o in config.AGGREGATE_OPTIONS)
    assert "replica.targets" in [o.key for o in declared] and "collect.interval" in both

    pool = Aggregator(PoolSettings(interval=1.0, timeout=20.0), [StaticSd([]), StaticSd([])], fd_limit=1024)
    assert pool.engine.derivations == pool_samples.DERIVATIONS and pool.engine.deadline == 21.0
    assert [poll.source for poll in pool.engine.discovery] == pool.discovered and pool.engine.polls == []
    assert pool.intake is None and pool.events is not None
    asyncio.run(pool.close())  # its ZMQ context
