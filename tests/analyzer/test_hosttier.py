"""The exact two-tier replay (GPU pool evicting into a host LRU) and `analyze --host-tier-*`."""

from __future__ import annotations

import json

import pytest

from kvcache_exporter.analyzer import capture
from kvcache_exporter.analyzer.analysis import analyze, render_text
from kvcache_exporter.analyzer.hosttier import two_tier_replay
from kvcache_exporter.analyzer.trace import TraceRequest

from .test_cli import analyze as analyze_cli

# Block size 4, 4 GPU blocks (one is vLLM's null block: 3 usable), each request 2 full blocks + 1 token.
# A fills the pool; B evicts A's two blocks (A2 first: the tail is freed first) into the host; A again
# finds nothing on the GPU and loads its prefix from the host; the last A hits both blocks on the GPU.
A, B = list(range(1, 10)), list(range(100, 109))
ABAA = [TraceRequest(p, 1, index=i) for i, p in enumerate([A, B, A, A])]


@pytest.mark.parametrize(
    ("host_blocks", "host_hits"),
    [
        (0, 0),  # GPU alone: only the last A hits
        (1, 4),  # the host kept A1 (A2 went first), so A1 loads; A2 alone is no prefix
        (2, 8),  # both loaded
        (8, 8),  # a bigger tier has nothing more to give
    ],
)
def test_two_tier_replay_on_a_trace_known_by_hand(host_blocks, host_hits):
    tier = two_tier_replay(ABAA, 4, 4, host_blocks, bytes_per_token=1024.0)
    assert (tier.prompt_tokens, tier.gpu_hit_tokens, tier.host_hit_tokens) == (36, 8, host_hits)
    assert tier.hit_ratio == (8 + host_hits) / 36 and tier.load_bytes == host_hits * 1024


def test_a_loaded_block_leaves_the_host():
    # A, B, A (loads A's two blocks: they leave the host), B: B's blocks went to the host when A came back
    tier = two_tier_replay([TraceRequest(p, 1, index=i) for i, p in enumerate([A, B, A, B])], 4, 4, 2)
    assert (tier.gpu_hit_tokens, tier.host_hit_tokens) == (0, 16)


def test_the_report_and_the_capacity_diagnosis_name_the_tier():
    report = analyze(ABAA, 4, 4, host_tier=(2, 1024.0))
    assert report.host_tier["hit_ratio"] == pytest.approx(16 / 36) and report.host_tier["load_bytes"] == 8192
    capacity = next(d for d in report.diagnoses if d.kind == "capacity")
    assert "A host tier of 2 blocks per replica would reach 0.444" in capacity.evidence
    assert "with a host tier of 2 blocks     0.444" in render_text(report)
    assert analyze(ABAA, 4, 4).host_tier is None


def test_the_tier_from_bytes_needs_the_kv_layout(tmp_path):
    metrics = tmp_path / "metrics.txt"
    info = 'block_size="16",num_gpu_blocks="100",kv_cache_memory_bytes="1638400",kv_cache_size_tokens="1600"'
    metrics.write_text(f"vllm:cache_config_info{{{info}}} 1.0\n")
    assert capture.host_tier(None, 16 * 1024 * 64, str(metrics), 16) == (64, 1024.0)
    assert capture.host_tier(None, 16 * 1024 * 64, str(metrics), 8) == (128, 1024.0)
    assert capture.host_tier(10, None, None, 16) == (10, None)
    assert capture.host_tier(None, None, str(metrics), 16) is None  # vLLM reports no tier
    with pytest.raises(ValueError, match="needs the bytes of a KV block"):
        capture.host_tier(None, 1 << 30, None, 16)


def test_the_cli_flag_on_a_mooncake_trace(tmp_path):
    """Sequentially, a GPU LRU of N blocks over a host LRU of H is one LRU of N + H: the tier's hit ratio
    is the GPU-only replay's with N + H blocks, a figure computed by another path (the engine)."""
    from .traces import mooncake_lines

    path = tmp_path / "day.jsonl"
    path.write_text("\n".join(mooncake_lines(200)) + "\n")
    out = analyze_cli(str(path), "--num-gpu-blocks", "1500", "--host-tier-blocks", "700", "--format", "json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    tier = report["host_tier"]
    assert tier["host_blocks"] == 700 and tier["load_bytes"] is None and tier["host_hit_tokens"] > 0
    assert tier["gpu_hit_ratio"] == pytest.approx(report["observed"]["hit_ratio"], abs=1e-6)
    bigger = json.loads(analyze_cli(str(path), "--num-gpu-blocks", "2200", "--format", "json").stdout)
    assert "host_tier" not in bigger
    assert tier["hit_ratio"] == pytest.approx(bigger["observed"]["hit_ratio"], abs=1e-6)
    assert tier["hit_ratio"] > report["observed"]["hit_ratio"] + 0.02
    page = tmp_path / "report.html"
    text = analyze_cli(
        str(path), "--num-gpu-blocks", "1500", "--host-tier-blocks", "700", "--html", str(page)
    ).stdout
    assert f"with a host tier of 700 blocks</th><td>{tier['hit_ratio']:.3f}" in page.read_text()
    assert f"with a host tier of 700 blocks  {tier['hit_ratio']:6.3f}  (exact two-tier replay" in text
    bad = analyze_cli(str(path), "--host-tier-bytes", "1000000")
    assert bad.returncode == 2 and "--host-tier-bytes needs the bytes of a KV block" in bad.stderr
