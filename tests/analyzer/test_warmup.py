"""`kvcache-exporter warmup`: the prefixes it picks from the seed, their gain in the engine after a restart,
and the command against the simulator's real HTTP server on loopback."""

from __future__ import annotations

import json
import subprocess

from kvcache_exporter.analyzer import trace, warmup
from kvcache_exporter.tools.harness import CLI, Services, free_port


def normalized(seed_lines) -> list[trace.TraceRequest]:
    return [
        trace.parse_trace_line(line, n) for n, line in enumerate(seed_lines) if line["phase"] == "normalized"
    ]


def test_top_prefixes_of_the_seed_and_their_gain_after_a_restart(seed_lines):
    requests = normalized(seed_lines)
    prefixes = warmup.top_prefixes(requests, 32, 10)
    assert len(prefixes) == 10
    assert (len(prefixes[0].token_ids), prefixes[0].requests) == (192, 160)  # the system block's whole blocks
    assert [p.score for p in prefixes] == sorted((p.score for p in prefixes), reverse=True)
    for p in prefixes:
        assert sum(r.prompt_token_ids[: len(p.token_ids)] == p.token_ids for r in requests) == p.requests
    cold = warmup.hit_ratio_after_restart(requests, [], 32, 96)
    warm = warmup.hit_ratio_after_restart(requests, prefixes, 32, 96)
    real = sum(line["usage"]["prompt_tokens_details"]["cached_tokens"] for line in seed_lines[160:])
    assert cold == real / sum(len(r.prompt_token_ids) for r in requests)  # the seed run itself
    assert warm > cold + 0.01


def test_warmup_against_the_simulator(tmp_path, seed_trace_path):
    lines = [json.loads(line) for line in seed_trace_path.read_text().splitlines()]
    path = tmp_path / "normalized.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines if line["phase"] == "normalized"))
    argv = [*CLI, "warmup", "--from", str(path), "--top", "3", "--block-size", "16"]
    dry = subprocess.run(
        [*argv, "--dry-run", "--vllm.url", f"http://127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.count(" tokens, ") == 3 and "  1.    192 tokens,   160 requests" in dry.stdout
    with Services(tmp_path / "run") as services:
        sim = services.simulator("--schedule", "none", "--block-size", "16")
        first = subprocess.run([*argv, "--vllm.url", sim.url], capture_output=True, text=True, timeout=60)
        assert first.returncode == 0, first.stderr
        again = subprocess.run([*argv, "--vllm.url", sim.url], capture_output=True, text=True, timeout=60)
    assert "sent 3 prefixes" in first.stdout
    # The first run's prefixes share the system block with each other; the second finds all of them cached.
    before = int(first.stdout.split("(")[-1].split()[0])
    after = int(again.stdout.split("(")[-1].split()[0])
    assert after > before and after >= 192 * 3 - 3 * 16
