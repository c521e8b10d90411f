import math

from kvcache_exporter.derive.memory import (
    budget_usage_ratio,
    headroom_ratio,
    memory_budget_bytes,
    memory_samples,
    memory_swing_bytes,
)
from kvcache_exporter.sources.gpu import GpuDevice, GpuSnapshot

GB = 1e9
H100 = 85520809984.0  # NVML total of an H100 80GB HBM3


def test_budget_usage_and_headroom():
    budget = memory_budget_bytes(0.92, H100)
    assert budget == 0.92 * 85520809984.0
    assert budget_usage_ratio(20 * GB, budget) == 20e9 / (0.92 * 85520809984.0)
    assert headroom_ratio(20 * GB, H100) == (85520809984.0 - 20e9) / 85520809984.0
    assert memory_budget_bytes(None, H100) is None
    assert memory_budget_bytes(0.9, None) is None
    assert budget_usage_ratio(1.0, 0.0) is None
    assert headroom_ratio(1.0, 0.0) is None
    assert headroom_ratio(2.0, 1.0) == 0.0  # never negative


def seed_swing_series(seconds: int = 600, period: int = 120) -> list[tuple[float, float]]:
    """The seed incident: used memory swinging 12 GB -> 20 GB every `period` seconds, sampled each 15 s."""
    return [
        (float(t), 16 * GB + 4 * GB * math.sin(2 * math.pi * t / period + math.pi / 2))
        for t in range(0, seconds + 1, 15)
    ]


def test_periodic_swing_shows_up_as_a_number():
    series = seed_swing_series()
    # t = 0, 120, ... hit 20 GB (sin = 1); t = 60, 180, ... hit 12 GB (sin = -1)
    assert math.isclose(memory_swing_bytes(series, 300), 8 * GB)
    # a window shorter than half a period cannot see both peaks: 45 s window ending at t=600 (20 GB)
    # holds t = 570 (sin(...) at 570 = cos(2*pi*570/120) = cos(9.5*pi) = 0) and t = 585, 600
    assert math.isclose(memory_swing_bytes(series, 45), 4 * GB, rel_tol=1e-9)


def test_swing_needs_two_points_in_the_window():
    assert memory_swing_bytes([], 300) is None
    assert memory_swing_bytes([(0.0, 5.0)], 300) is None
    assert memory_swing_bytes([(0.0, 5.0), (400.0, 9.0)], 300) is None  # t=0 is outside (100, 400]
    assert memory_swing_bytes([(0.0, 5.0), (400.0, 9.0), (450.0, 1.0)], 300, now=450.0) == 8.0


def test_memory_samples_per_gpu():
    device = GpuDevice(
        0, "GPU-a", "NVIDIA H100 80GB HBM3", memory_used_bytes=20 * GB, memory_total_bytes=100 * GB
    )
    snapshot = GpuSnapshot((device,))
    history = {"GPU-a": [(0.0, 12 * GB), (150.0, 20 * GB), (300.0, 14 * GB)]}
    labels = {"gpu": "0", "uuid": "GPU-a", "name": "NVIDIA H100 80GB HBM3"}
    assert memory_samples(snapshot, 300.0, 0.9, history, "5m", 300) == [
        ("kvcache_gpu_memory_budget_bytes", labels, 90 * GB),
        ("kvcache_gpu_memory_budget_usage_ratio", labels, 20 / 90),
        ("kvcache_gpu_memory_headroom_ratio", labels, 0.8),
        ("kvcache_gpu_memory_swing_bytes", {**labels, "window": "5m"}, 6 * GB),  # t=0 left the window
    ]
    # without vLLM's gpu_memory_utilization only headroom (and swing) can be said
    names = [s.name for s in memory_samples(snapshot, 300.0, None, {}, "5m", 300)]
    assert names == ["kvcache_gpu_memory_headroom_ratio"]
