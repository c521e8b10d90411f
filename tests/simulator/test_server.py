"""The simulator end to end over HTTP on an ephemeral loopback port."""

import asyncio

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcache_exporter.simulator import EngineConfig, LatencyModel, SimulatorConfig, start_simulator
from kvcache_exporter.simulator.server import _is_loopback

FAST = LatencyModel(base_s=0.002, per_prefill_token_s=0.00001, per_decode_seq_s=0.0001)


def config(**overrides) -> SimulatorConfig:
    base = {
        "engine": EngineConfig(block_size=16, num_gpu_blocks=512, max_model_len=2048, latency=FAST),
        "schedule": "none",
        "speed": 20.0,
    }
    return SimulatorConfig(**{**base, **overrides})


def samples(text: str) -> dict[tuple, float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def value(text: str, name: str, engine: str = "0") -> float:
    return sum(v for (n, labels), v in samples(text).items() if n == name and ("engine", engine) in labels)


async def with_simulator(cfg: SimulatorConfig, body):
    sim = await start_simulator(cfg)
    try:
        async with aiohttp.ClientSession(base_url=sim.url) as http:
            return await body(sim, http)
    finally:
        await sim.stop()


@pytest.mark.timeout(30)
def test_api_usage_reports_cached_tokens_and_metrics_follow():
    async def body(sim, http):
        prompt = list(range(5, 105))
        for _ in range(2):
            async with http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4}) as r:
                first = await r.json()
        assert first["usage"]["prompt_tokens"] == 100
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        async with http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "where is my order?"}]}
        ) as r:
            assert (await r.json())["choices"][0]["message"]["role"] == "assistant"
        async with http.get("/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == sim.config.model_name
        async with http.get("/health") as r:
            assert r.status == 200
        async with http.get("/metrics") as r:
            text = await r.text()
        assert value(text, "vllm:prefix_cache_hits_total") == 96
        assert value(text, "vllm:request_success_total") == 3
        async with http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5000}) as r:
            assert r.status == 400

    asyncio.run(with_simulator(config(), body))


@pytest.mark.timeout(30)
def test_faults_restart_and_workload_switch_from_the_control_api():
    async def body(sim, http):
        await asyncio.sleep(0.5)
        async with http.get("/metrics") as r:
            before = await r.text()
        assert value(before, "vllm:prefix_cache_queries_total") > 0
        created = value(before, "vllm:prefix_cache_queries_created")

        async with http.post("/control/workload", json={"name": "raw"}) as r:
            assert (await r.json())["workload"] == "raw"
        async with http.post("/control/workload", json={"name": "bogus"}) as r:
            assert r.status == 400

        async with http.post("/control/metrics", json={"fail": True}) as r:
            assert r.status == 200
        async with http.get("/metrics") as r:
            assert r.status == 500
        async with http.post("/control/metrics", json={"fail": False, "malformed": True}) as r:
            pass
        async with http.get("/metrics") as r:
            with pytest.raises(ValueError):
                list(text_string_to_metric_families(await r.text()))
        async with http.post("/control/metrics", json={"malformed": False, "delay_s": 0.3}) as r:
            pass
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with http.get("/metrics") as r:
            assert r.status == 200
        assert loop.time() - started >= 0.3
        async with http.post("/control/metrics", json={"delay_s": 0}) as r:
            pass

        async with http.post("/control/restart") as r:
            assert (await r.json())["instance"] == 1
        async with http.get("/metrics") as r:
            after = await r.text()
        assert value(after, "vllm:prefix_cache_queries_created") > created
        assert (
            value(after, "vllm:prefix_cache_queries_total")
            < value(before, "vllm:prefix_cache_queries_total") + 1
        )

    asyncio.run(with_simulator(config(schedule="normalized", rate=40.0), body))


@pytest.mark.timeout(30)
def test_schedule_raw_phase_has_no_hits_and_normalized_recovers():
    async def body(sim, http):
        hits = []
        for _ in range(3):
            async with http.get("/metrics") as r:
                text = await r.text()
            hits.append(
                (value(text, "vllm:prefix_cache_hits_total"), value(text, "vllm:prefix_cache_queries_total"))
            )
            await asyncio.sleep(0.6)
        return hits

    # at speed 20, each phase lasts 0.6 wall seconds
    hits = asyncio.run(with_simulator(config(schedule="raw:12s,normalized", rate=30.0), body))
    (h0, q0), (h1, q1), (h2, q2) = hits
    assert q1 > q0 and h0 == 0  # raw: every prompt starts with a unique header
    assert (h2 - h1) / (q2 - q1) > 0.5  # normalized: the template is shared


@pytest.mark.timeout(30)
def test_engines_dcgm_and_v0_schema():
    async def body(sim, http):
        for i in range(4):
            async with http.post("/v1/completions", json={"prompt": [7, 8, 9, i], "max_tokens": 2}) as r:
                assert r.status == 200
        async with http.get("/metrics") as r:
            text = await r.text()
        async with http.get("/dcgm/metrics") as r:
            dcgm = await r.text()
        return text, dcgm

    text, dcgm = asyncio.run(with_simulator(config(engines=2), body))
    assert (
        value(text, "vllm:request_success_total", "0") == 2 == value(text, "vllm:request_success_total", "1")
    )
    families = {f.name: f for f in text_string_to_metric_families(dcgm)}
    assert families["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"].type == "counter"
    assert set(families["DCGM_FI_DEV_FB_USED"].samples[0].labels) == {
        "gpu",
        "UUID",
        "device",
        "modelName",
        "Hostname",
        "container",
        "namespace",
        "pod",
    }
    assert len(families["DCGM_FI_DEV_GPU_UTIL"].samples) == 2

    async def v0(sim, http):
        async with http.get("/metrics") as r:
            return await r.text()

    v0_text = asyncio.run(with_simulator(config(metrics_schema="v0"), v0))
    assert "vllm:gpu_prefix_cache_hit_rate" in v0_text and 'engine="' not in v0_text


def test_control_is_loopback_only():
    assert _is_loopback("127.0.0.1") and _is_loopback("::1")
    assert not _is_loopback("10.0.0.5") and not _is_loopback(None)
