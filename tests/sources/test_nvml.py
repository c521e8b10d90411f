"""The real pynvml code path against a stand-in libnvidia-ml.so.1 (tests/fixtures/nvml/fake_nvml.c)."""

import ctypes.util

import pytest

from kvcache_exporter.derive.gpu import gpu_samples
from kvcache_exporter.sources.gpu import GpuDevice, GpuProcess
from kvcache_exporter.sources.nvml import select_processes

TWO_GPUS = """count 2
0.name NVIDIA H100 80GB HBM3
0.uuid GPU-aaaa
0.mem_total 85520809984
0.mem_used 21474836480
0.util_gpu 87
0.util_mem 40
0.power_mw 350500
0.energy_mj 123456789
0.temp 61
0.procs 100:1000,200:20000,300:500
proc.100.name /usr/bin/python3
proc.200.name /opt/neighbour/bin/trainer
1.name NVIDIA H100 80GB HBM3
1.uuid GPU-bbbb
1.mem_total 85520809984
1.mem_used 1048576
1.util_gpu 0
1.util_mem 0
1.power_mw 70000
1.energy_mj 5000
1.temp 30
"""


def test_reads_every_gpu_with_units_converted(fake_nvml_dir, run_nvml):
    [result] = run_nvml(fake_nvml_dir, [TWO_GPUS], NVML_MAX_PROCESSES="2")
    first, second = result["snapshot"]["devices"]
    assert first == {
        "index": 0,
        "uuid": "GPU-aaaa",
        "name": "NVIDIA H100 80GB HBM3",
        "memory_used_bytes": 21474836480.0,
        "memory_total_bytes": 85520809984.0,
        "utilization_ratio": 0.87,
        "memory_utilization_ratio": 0.40,
        "power_watts": 350.5,  # 350500 mW
        "energy_joules": 123456.789,  # 123456789 mJ
        "temperature_celsius": 61,
        # python3 first (a vLLM/Python process), then the largest; pid 300 (500 B) cut by the limit of 2
        "processes": [
            {"pid": 100, "name": "python3", "used_bytes": 1000},
            {"pid": 200, "name": "trainer", "used_bytes": 20000},
        ],
    }
    assert (second["index"], second["uuid"], second["power_watts"], second["processes"]) == (
        1,
        "GPU-bbbb",
        70.0,
        [],
    )


def test_selects_devices_by_uuid_and_index(fake_nvml_dir, run_nvml):
    [by_uuid] = run_nvml(fake_nvml_dir, [TWO_GPUS], NVML_DEVICES="GPU-bbbb")
    assert [d["index"] for d in by_uuid["snapshot"]["devices"]] == [1]
    [by_index] = run_nvml(fake_nvml_dir, [TWO_GPUS], NVML_DEVICES="0")
    assert [d["uuid"] for d in by_index["snapshot"]["devices"]] == ["GPU-aaaa"]


def test_unsupported_fields_are_omitted_not_failures(fake_nvml_dir, run_nvml):
    state = TWO_GPUS + "0.energy.error 3\n0.processes.error 3\n1.power.error 3\n1.temperature.error 3\n"
    [result] = run_nvml(fake_nvml_dir, [state])
    first, second = result["snapshot"]["devices"]
    assert (first["energy_joules"], first["processes"], first["power_watts"]) == (None, [], 350.5)
    assert (second["power_watts"], second["temperature_celsius"], second["energy_joules"]) == (
        None,
        None,
        5.0,
    )


def test_gpu_lost_mid_run_is_an_error_then_recovers(fake_nvml_dir, run_nvml):
    lost = TWO_GPUS + "error 15\n"  # NVML_ERROR_GPU_IS_LOST on every device call
    results = run_nvml(fake_nvml_dir, [TWO_GPUS, lost, TWO_GPUS])
    assert results[0]["snapshot"]["devices"][0]["uuid"] == "GPU-aaaa"
    assert results[1] == {"error": "gpu_lost", "type": "SourceError"}
    assert [d["uuid"] for d in results[2]["snapshot"]["devices"]] == ["GPU-aaaa", "GPU-bbbb"]


def test_other_nvml_errors_carry_a_generic_reason(fake_nvml_dir, run_nvml):
    results = run_nvml(fake_nvml_dir, [TWO_GPUS + "0.memory.error 999\n", "init_error 9\n"])
    assert results == [
        {"error": "nvml_error", "type": "SourceError"},
        {"error": "unavailable", "type": "SourceUnavailable"},  # 9: driver not loaded
    ]


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="a real NVML is installed")
def test_no_nvml_library_means_unavailable(run_nvml):
    assert run_nvml(None, ["count 1\n"]) == [{"error": "unavailable", "type": "SourceUnavailable"}]
    assert run_nvml(None, []) == ["unavailable"]


def test_auto_picks_nvml_when_it_initializes(fake_nvml_dir, run_nvml, tmp_path):
    state = tmp_path / "auto-state"
    state.write_text(TWO_GPUS)
    assert run_nvml(fake_nvml_dir, [], FAKE_NVML_STATE=str(state)) == ["NvmlSource"]
    state.write_text("count 0\n")
    assert run_nvml(fake_nvml_dir, [], FAKE_NVML_STATE=str(state)) == ["unavailable"]


def test_process_selection_prefers_vllm_and_python_then_memory():
    processes = [GpuProcess(1, "trainer", 9e9), GpuProcess(2, "vllm", 1e9), GpuProcess(3, "", None)]
    assert [p.pid for p in select_processes(processes, 2)] == [2, 1]
    assert select_processes(processes, 0) == ()


def test_samples_skip_missing_fields():
    from kvcache_exporter.sources.gpu import GpuSnapshot

    device = GpuDevice(
        0, "GPU-x", "NVIDIA L4", memory_used_bytes=5.0, processes=(GpuProcess(7, "vllm", 3.0),)
    )
    labels = {"gpu": "0", "uuid": "GPU-x", "name": "NVIDIA L4"}
    assert gpu_samples(GpuSnapshot((device,))) == [
        ("kvcache_gpu_memory_used_bytes", labels, 5.0),
        (
            "kvcache_gpu_process_memory_used_bytes",
            {"gpu": "0", "uuid": "GPU-x", "pid": "7", "process": "vllm"},
            3.0,
        ),
    ]
