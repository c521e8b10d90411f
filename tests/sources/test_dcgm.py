"""dcgm-exporter scrapes from public sources (tests/fixtures/dcgm/SOURCES.md)."""

import asyncio
from pathlib import Path

import pytest
from aiohttp import web

from kvcache_exporter.sources.base import SourceError, SourceUnavailable
from kvcache_exporter.sources.dcgm import MIB, DcgmSource, parse_dcgm
from kvcache_exporter.sources.gpu_factory import make_gpu_source
from tests.loopback import serve

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm"
T4 = "GPU-6d5c0ac5-74d7-3130-46f1-e93ed57f469a"
VLLM_POD, VLLM_NS = "vllm-medgemma-4b-it-d599b4c99-f95nk", "vllm-inference"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_maps_every_field_of_a_node_scrape_by_uuid():
    [t4] = parse_dcgm(fixture("node-t4-gpu-operator.txt"), gpu_uuids={T4}).devices
    assert (t4.index, t4.uuid, t4.name) == (0, T4, "Tesla T4")
    assert t4.memory_used_bytes == 5120 * MIB
    assert t4.memory_total_bytes == (5120 + 9791 + 447) * MIB  # used + free + reserved
    assert (t4.utilization_ratio, t4.memory_utilization_ratio) == (0.91, 0.73)
    assert (t4.power_watts, t4.temperature_celsius) == (68.244, 74.0)
    assert t4.energy_joules == 15152422.938  # 15152422938 mJ


def test_energy_counter_typed_counter_is_read():
    # this scrape has # TYPE ... counter, which the parser exposes as <name>_total
    [l40s] = parse_dcgm(
        fixture("node-l40s-helm.txt"), gpu_uuids={"GPU-5b4e07f6-3a86-4340-039d-25f2a83cdc43"}
    ).devices
    assert (l40s.name, l40s.energy_joules, l40s.memory_used_bytes) == ("NVIDIA L40S", 5551899.58, 0.0)
    assert l40s.memory_total_bytes == (0 + 45459 + 608) * MIB


def test_keeps_only_this_pods_series_on_a_shared_gpu():
    text = fixture("mps-two-pods-pr432.txt")
    [mine] = parse_dcgm(text, pod_name=VLLM_POD, pod_namespace=VLLM_NS).devices
    assert (mine.uuid, mine.name, mine.memory_used_bytes) == (
        "GPU-3bc239e1-4cc8-97e4-e817-5a36dfd2885e",
        "NVIDIA A100-SXM4-80GB",
        15866 * MIB,
    )
    assert mine.memory_total_bytes is None  # no FB_FREE in this scrape: total unknown, not guessed
    assert parse_dcgm(text, pod_name=VLLM_POD, pod_namespace="default").devices == ()


def test_pod_filter_drops_other_gpus_of_the_node():
    text = fixture("mixed-node-pr736.txt")
    [triton] = parse_dcgm(text, pod_name="triton-server-f7cb5d77-95xcf").devices
    assert (triton.index, triton.name, triton.memory_used_bytes) == (2, "NVIDIA A30", None)
    assert parse_dcgm(fixture("pod-labels-issue340.txt"), pod_name="dcgmproftester").devices[0].index == 0


def test_node_without_pod_labels_matches_no_pod():
    text = fixture("empty-pod-labels-issue138.txt")
    assert parse_dcgm(text, pod_name="vllm-0").devices == ()
    [gpu] = parse_dcgm(text, gpu_uuids={"GPU-6bf47ca9-ad3e-15db-beed-1079a7d74116"}).devices
    assert (gpu.utilization_ratio, gpu.power_watts, gpu.energy_joules) == (0.44, 302.206, 4335301.032)


def serve_and_collect(body: bytes, status: int = 200, **options):
    async def metrics(request):
        return web.Response(body=body, status=status)

    async def scenario():
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner, url = await serve(app)
        source = make_gpu_source("dcgm", dcgm_url=f"{url}/metrics", **options)
        try:
            return await source.collect()
        finally:
            await source.close()
            await runner.cleanup()

    return asyncio.run(scenario())


def test_collects_over_http():
    body = fixture("mps-two-pods-pr432.txt").encode()
    snapshot = serve_and_collect(body, pod_name=VLLM_POD, pod_namespace=VLLM_NS)
    assert [d.memory_used_bytes for d in snapshot.devices] == [15866 * MIB]


@pytest.mark.parametrize(
    ("status", "options", "reason"),
    [
        (200, {"pod_name": "nobody"}, "no_matching_gpu"),
        (503, {"pod_name": VLLM_POD}, "http_status"),
        (200, {"pod_name": VLLM_POD, "max_body_bytes": 100}, "body_too_large"),
    ],
)
def test_http_failures_have_reasons(status, options, reason):
    with pytest.raises(SourceError) as raised:
        serve_and_collect(fixture("mps-two-pods-pr432.txt").encode(), status, **options)
    assert raised.value.reason == reason


def test_connection_refused_is_a_connection_error():
    source = DcgmSource("http://127.0.0.1:9/metrics", pod_name="x", timeout_seconds=2)
    with pytest.raises(SourceError) as raised:
        asyncio.run(source.collect())
    assert raised.value.reason == "connection"


def test_dcgm_needs_a_url_and_a_pod_or_uuids():
    with pytest.raises(ValueError):
        make_gpu_source("dcgm")
    with pytest.raises(ValueError):
        DcgmSource("http://127.0.0.1:9400/metrics")
    with pytest.raises(SourceUnavailable, match="disabled"):
        make_gpu_source("none")
