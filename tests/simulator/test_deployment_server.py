"""Data-parallel ranks, API-server count, LoRA / session / report options end to end over HTTP and ZMQ, read
back by the exporter's own parser and compared with the real dp2 and dp2-api2 captures."""

import asyncio
import socket

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from kvcache_exporter.simulator import EngineConfig, LatencyModel, SimulatorConfig, start_simulator
from kvcache_exporter.sources.vllm_parse import parse

from .conftest import VLLM_CPU, read_jsonl

FAST = LatencyModel(base_s=0.002, per_prefill_token_s=0.00001, per_decode_seq_s=0.0001)
DEPLOYMENTS = VLLM_CPU / "deployments"


def free_port_pair() -> int:
    """A port p with p + 1 free too (rank 1 publishes on endpoint port + 1)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no free port pair")


def config(**overrides) -> SimulatorConfig:
    base = {
        "engine": EngineConfig(block_size=32, num_gpu_blocks=64, max_model_len=1024, latency=FAST),
        "schedule": "none",
        "speed": 20.0,
        "engines": 2,
    }
    return SimulatorConfig(**{**base, **overrides})


def real_metrics(capture: str) -> str:
    return read_jsonl(DEPLOYMENTS / capture / "metrics-snapshots.jsonl")[-1]["text"]


def engine_families(text: str) -> dict[str, set[str]]:
    """vllm: family (sample name) -> its engine label values."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and 'engine="' in line:
            name = line.split("{", 1)[0]
            out.setdefault(name, set()).add(line.split('engine="', 1)[1].split('"', 1)[0])
    return out


async def run_dp(cfg: SimulatorConfig, prompts: list[dict]) -> tuple[str, dict[str, list]]:
    ctx = zmq.asyncio.Context()
    subs = {}
    port = int(cfg.kv_events_endpoint.rsplit(":", 1)[1])
    sim = await start_simulator(cfg)  # `tcp://*:port`: each rank binds port + rank
    for rank in (0, 1, 2):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port + rank}")
        subs[rank] = sub
    await asyncio.sleep(0.5)
    try:
        async with aiohttp.ClientSession(base_url=sim.url) as http:
            for body in prompts:
                headers = body.pop("headers", {})
                async with http.post("/v1/completions", json=body, headers=headers) as r:
                    assert r.status == 200, await r.text()
            await asyncio.sleep(0.3)
            async with http.get("/metrics") as r:
                text = await r.text()
    finally:
        await sim.stop()
    received: dict[int, list] = {}
    for rank, sub in subs.items():
        while await sub.poll(100):
            received.setdefault(rank, []).append(await sub.recv_multipart())
        sub.close(0)
    ctx.term()
    return text, received


@pytest.mark.timeout(40)
def test_data_parallel_ranks_publish_like_vllm_and_metrics_carry_every_engine():
    port = free_port_pair()
    cfg = config(kv_events_endpoint=f"tcp://*:{port}")
    prompts = [{"prompt": list(range(5, 200)), "max_tokens": 2} for _ in range(4)]
    text, received = asyncio.run(run_dp(cfg, prompts))
    assert set(received) == {0, 1}  # nothing on port + 2, as in the dp2 capture
    for rank, messages in received.items():
        seqs = [int.from_bytes(m[1], "big") for m in messages]
        assert seqs == list(range(len(seqs)))  # each rank its own seq from 0
        assert {msgspec.msgpack.decode(m[2])[2] for m in messages} == {rank}
    # Both ranks stored the same prefix separately (round-robin routing).
    first = [msgspec.msgpack.decode(received[r][0][2])[1][0]["block_hashes"][0] for r in (0, 1)]
    assert first[0] == first[1]
    ours, real = engine_families(text), engine_families(real_metrics("dp2"))
    assert ours and all(values == {"0", "1"} for values in ours.values())
    assert set(ours) <= set(real) and all(real[name] == {"0", "1"} for name in ours)
    snapshot = parse(text)
    assert {key[1] for key in snapshot.engines} == {"0", "1"} and len(snapshot.cache_configs) == 2
    assert "_created" in text


@pytest.mark.timeout(40)
def test_api_server_count_drops_created_samples_like_the_multiprocess_exposition():
    port = free_port_pair()
    cfg = config(kv_events_endpoint=f"tcp://*:{port}", api_server_count=2)
    text, _ = asyncio.run(run_dp(cfg, [{"prompt": list(range(5, 100)), "max_tokens": 2}]))
    real = real_metrics("dp2-api2")
    assert "_created" not in real and "process_start_time_seconds" not in real
    assert "_created" not in text and "process_" not in text and "python_" not in text
    snapshot = parse(text)
    assert {key[1] for key in snapshot.engines} == {"0", "1"}
    assert snapshot.missing == parse(real).missing == ()


@pytest.mark.timeout(40)
def test_lora_session_and_report_options_over_the_api():
    port = free_port_pair()
    cfg = config(
        kv_events_endpoint=f"tcp://*:{port}", engines=1, lora_adapters=("tiny-lora-a", "tiny-lora-b")
    )
    prompt = list(range(5, 300))
    prompts = [
        {"prompt": prompt, "max_tokens": 2, "session_id": "sess-0"},
        {"prompt": prompt, "max_tokens": 2, "model": "tiny-lora-a", "headers": {"X-Session-ID": "sess-1"}},
        {"prompt": prompt, "max_tokens": 2, "vllm_xargs": {"kv_cache_report_mode": "full"}},
    ]
    text, received = asyncio.run(run_dp(cfg, prompts))
    # vLLM's one LoRA family: no engine label, one series per (running, waiting) adapter set, as captured.
    info = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    real = [line for line in real_metrics("lora").splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert {line.split("} ")[0].split(",", 1)[0] for line in info} == {'vllm:lora_requests_info{max_lora="2"'}
    assert any('running_lora_adapters="tiny-lora-a"' in line for line in info) and real
    assert all('engine="' not in line for line in info + real)
    events = [e for m in received[0] for e in msgspec.msgpack.decode(m[2])[1]]
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert stored[0]["session_id"] == "sess-0" and stored[0]["lora_name"] is None
    lora = [e for e in stored if e["lora_name"] == "tiny-lora-a"]
    assert lora and lora[0]["session_id"] == "sess-1" and lora[0]["lora_id"] == 1
    assert lora[0]["block_hashes"][0] != stored[0]["block_hashes"][0]
    reports = [
        e for e in stored if e["parent_block_hash"] is None and "session_id" not in e and not e["lora_name"]
    ]
    assert len(reports) == 1 and reports[0]["block_hashes"] == stored[0]["block_hashes"][: len(prompt) // 32]
