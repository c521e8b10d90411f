"""The exporter-wide derivations (derive/registry.py) over a replayed poll state: cost, energy, audit."""

import pytest

from kvcache_exporter.derive.cost import Pricing
from kvcache_exporter.sources.gpu import GpuDevice, GpuSnapshot
from tests.replay import replay, seed_snapshots, values

GIB = 1024**3


def device(used_gib, energy_j, power=300.0):
    return GpuDevice(
        0, "GPU-1", "NVIDIA H100 80GB HBM3", used_gib * GIB, 80 * GIB, 0.5, 0.2, power, energy_j, 60
    )


def test_cost_and_audit_over_the_real_seed_run(shared_fixtures):
    texts = [s["text"] for s in seed_snapshots(shared_fixtures)]
    snapshots = [GpuSnapshot((device(20, 1000.0 * i),)) for i in range(len(texts))]
    pricing = Pricing(gpu_hour_price={"NVIDIA H100 80GB HBM3": 3.6})
    exporter = replay(texts, windows=(300.0,), quantiles=(0.5,), gpu=snapshots, pricing=pricing)
    assert values(exporter, "kvcache_gpu_cost_per_hour") == {(): 3.6}
    # 300 s of a 3.6/h GPU = 0.3; tokens: the last 30 polls of the run
    cost_all = values(exporter, "kvcache_cost_per_million_tokens", token_kind="all", window="5m")
    assert len(cost_all) == 1 and next(iter(cost_all.values())) > 0
    joules = next(iter(values(exporter, "kvcache_energy_joules_per_token", window="5m").values()))
    assert joules == pytest.approx(30 * 1000.0 / tokens_between(texts, -31, -1))
    checks = {dict(k)["check"]: v for k, v in values(exporter, "kvcache_config_check").items()}
    # the seed run: prefix caching on, gpu_memory_utilization 0.92 (vLLM's default) on a GPU whose 20 GiB
    # never move and stay within vLLM's budget: nobody shares it, so the ceiling does not apply
    assert checks["prefix_caching_enabled"] == 1
    assert checks["gpu_memory_utilization_ceiling"] == 1
    assert checks["no_deprecated_metrics"] == 1


def tokens_between(texts, start, end):
    import re

    def total(text):
        return sum(
            float(re.search(rf"^vllm:{name}_total{{[^}}]*}} (\S+)$", text, re.M).group(1))
            for name in ("prompt_tokens", "generation_tokens")
        )

    return total(texts[end]) - total(texts[start])


def test_cost_without_gpu_telemetry_prices_the_configured_gpu_count(shared_fixtures):
    texts = [s["text"] for s in seed_snapshots(shared_fixtures)]
    exporter = replay(
        texts, windows=(300.0,), quantiles=(0.5,), pricing=Pricing(gpu_hour_price=3.6), gpu_count=2
    )
    assert values(exporter, "kvcache_gpu_cost_per_hour") == {(): 7.2}
    cost_all = next(iter(values(exporter, "kvcache_cost_per_million_tokens", token_kind="all").values()))
    # 300 s of two 3.6/h GPUs = 0.6, over the tokens of the last 30 polls
    assert cost_all == pytest.approx(0.6 / tokens_between(texts, -31, -1) * 1e6)
