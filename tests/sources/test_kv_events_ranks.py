"""Where each data-parallel rank publishes: vLLM's offset_endpoint_port (vllm/distributed/kv_events.py)."""

import pytest

from kvcache_exporter.sources.kv_events import rank_endpoint


@pytest.mark.parametrize(
    ("endpoint", "rank", "expected"),
    [
        ("tcp://127.0.0.1:5557", 0, "tcp://127.0.0.1:5557"),
        ("tcp://127.0.0.1:5557", 1, "tcp://127.0.0.1:5558"),
        ("tcp://*:5711", 3, "tcp://*:5714"),
        ("tcp://[::1]:5557", 2, "tcp://[::1]:5559"),
        ("tcp://127.0.0.1:0", 1, "tcp://127.0.0.1:0"),  # an OS-chosen port stays one
        ("ipc:///tmp/kv", 1, "ipc:///tmp/kv_dp1"),
        ("inproc://cache", 2, "inproc://cache_dp2"),
    ],
)
def test_rank_endpoints_match_vllm(endpoint, rank, expected):
    assert rank_endpoint(endpoint, rank) == expected
