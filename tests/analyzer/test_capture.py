"""The cache's shape from real vLLM 0.32 /metrics captures, or the assumption said plainly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvcache_exporter.analyzer import capture

from .conftest import SEED

FIXTURES = SEED.parent


@pytest.mark.parametrize(
    ("name", "block_size", "blocks"),
    [("metrics.txt", 32, 64), ("metrics-blocksize128.txt", 128, 32), ("metrics-inflight.txt", 32, 64)],
)
def test_real_captures(name, block_size, blocks):
    """Each capture's own cache_config_info, read by hand here from the raw text."""
    text = (FIXTURES / name).read_text()
    line = next(x for x in text.splitlines() if x.startswith("vllm:cache_config_info{"))
    labels = dict(pair.split("=", 1) for pair in line[line.index("{") + 1 : line.rindex("}")].split('",'))
    labels = {k: v.strip('"') for k, v in labels.items()}
    shape = capture.cache_shape(None, None, str(FIXTURES / name))
    unit = int(labels["effective_attention_block_size"])
    assert shape.block_size == unit == (block_size or unit)
    assert shape.num_gpu_blocks == int(labels["num_gpu_blocks"]) * int(labels["block_size"]) // unit
    assert blocks is None or shape.num_gpu_blocks == blocks
    assert not any(n.startswith("assumed") for n in shape.notes)


def test_flags_win_and_assumptions_are_said():
    shape = capture.cache_shape(64, None, str(FIXTURES / "metrics.txt"))
    assert (shape.block_size, shape.num_gpu_blocks) == (64, 64)
    bare = capture.cache_shape(None, None, None)
    assert (bare.block_size, bare.num_gpu_blocks) == (16, 2048)
    assert [n.split(":")[0] for n in bare.notes] == [
        "assumed --block-size 16 (vLLM's default on GPUs)",
        "assumed --num-gpu-blocks 2048",
    ]
    assert all("cache_config_info" in n for n in bare.notes)


def test_a_hit_unit_larger_than_the_block_rescales_the_blocks(tmp_path):
    path = tmp_path / "metrics.txt"
    path.write_text(
        '# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="64",'
        'effective_attention_block_size="256",num_gpu_blocks="1000",engine="0"} 1.0\n'
        'vllm:cache_config_info{block_size="64",effective_attention_block_size="256",num_gpu_blocks="1000",'
        'engine="1"} 1.0\n'
    )
    shape = capture.cache_shape(None, None, str(path))
    assert (shape.block_size, shape.num_gpu_blocks) == (256, 250)
    assert any("2 engines" in n for n in shape.notes) and any("hit unit 256" in n for n in shape.notes)


def test_files_that_are_not_captures(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("up 1\n")
    with pytest.raises(ValueError, match="no vllm:cache_config_info sample"):
        capture.cache_shape(None, None, str(empty))
    broken = tmp_path / "broken.txt"
    broken.write_text('vllm:cache_config_info{block_size="16" 1\n')
    with pytest.raises(ValueError, match=f"{broken}:1:"):
        capture.cache_shape(None, None, str(broken))


def test_the_cli_reads_the_capture(seed_trace_path, tmp_path):
    argv = [sys.executable, "-m", "kvcache_exporter.analyzer", str(seed_trace_path), "--phase", "raw"]
    out = subprocess.run(
        [*argv, "--metrics", str(FIXTURES / "metrics.txt"), "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert (report["settings"]["block_size"], report["settings"]["num_gpu_blocks"]) == (32, 64)
    assert any("metrics.txt: hit unit 32 tokens, 64 blocks" in n for n in report["notes"])
    plain = subprocess.run([*argv], capture_output=True, text=True, timeout=120)
    assert "note: assumed --num-gpu-blocks 2048" in plain.stdout
    missing = subprocess.run([*argv, "--metrics", str(tmp_path / "nope")], capture_output=True, text=True)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr


def test_an_sglang_page_gives_its_page_size_and_pages(shared_fixtures, tmp_path):
    for name, pages in (("live-metrics.txt", 256), ("live-hicache-metrics.txt", 32)):
        shape = capture.cache_shape(None, None, str(shared_fixtures / "sglang-0.5.23" / name))
        assert (shape.block_size, shape.num_gpu_blocks) == (4, pages)
    lines = tmp_path / "snapshots.jsonl"
    text = (shared_fixtures / "sglang-0.5.23" / "live-metrics.txt").read_text()
    lines.write_text(json.dumps({"text": text}) + "\n")
    assert capture.cache_shape(None, None, str(lines)).num_gpu_blocks == 256
    broken = tmp_path / "broken.txt"
    broken.write_text("sglang:page_size{} -4\n")
    with pytest.raises(ValueError, match="a capture of vLLM's or SGLang's"):
        capture.cache_shape(None, None, str(broken))
