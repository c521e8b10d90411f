"""GPU history across polls: reset-adjusted energy and the memory it swings through."""

from kvcache_exporter.derive.gpu import GpuHistory
from kvcache_exporter.sources.gpu import GpuSnapshot
from tests.derive.test_registry import GIB, device


def test_energy_increase_survives_a_driver_counter_reset():
    history = GpuHistory(retention=600)
    for ts, energy in [(0, 1000.0), (10, 4000.0), (20, 500.0), (30, 2500.0)]:  # reset after ts 10
        history.ingest(GpuSnapshot((device(12, energy),)), ts)
    assert history.energy_increase(60, now=30) == 3000 + 500 + 2000


def test_seed_incident_swing_from_12_to_20_gib_is_measured():
    history = GpuHistory(retention=600)
    for ts in range(0, 300, 10):
        used = 12 if (ts // 60) % 2 == 0 else 20  # a one-minute square wave
        history.ingest(GpuSnapshot((device(used, None),)), ts)
    used = history.used()["GPU-1"]
    assert max(u for _, u in used) - min(u for _, u in used) == 8 * GIB
