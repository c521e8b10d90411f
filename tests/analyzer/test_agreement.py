"""One answer offline and live: `analyze` and `serve` read the same token stream the same way.

Offline: `analyze TRACE --format json` (its cause table and "estimated live" row). Live: the same
requests sent one at a time to `simulate` (a vLLM-compatible server, KV events on), `serve` reading its
/metrics and KV events. And against real vLLM: the seed run's captured events read by the sidecar.
The causes must agree within 2 points of the attributed tokens, the estimates within 0.02."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request

from kvcache_exporter.analyzer import live, tokenize, trace
from kvcache_exporter.derive.attribution import CAUSES
from tests.conftest import REPO, free_port
from tests.derive.test_attribution_real import SEED, phase_ratio, seed_phases

from .chats import timestamp_first_chat

CLI = [sys.executable, "-m", "kvcache_exporter"]
TINY = REPO / "tests" / "fixtures" / "tiny-llama"
BLOCK, BLOCKS = 32, 512


def shares(tokens: dict[str, float]) -> dict[str, float]:
    attributed = {c: tokens.get(c, 0.0) for c in CAUSES}
    total = sum(attributed.values()) or 1.0
    return {c: n / total for c, n in attributed.items()}


def analyze(path, *args) -> dict:
    out = subprocess.run(
        [*CLI, "analyze", str(path), "--block-size", str(BLOCK), "--num-gpu-blocks", str(BLOCKS),
         "--format", "json", *args],
        capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    return json.loads(out.stdout)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def counter(body: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", body, re.M))


def served(services, prompts: list[tuple[list[int], int]]) -> tuple[dict[str, float], float]:
    """`serve`'s miss tokens by cause and reorder estimate, the prompts sent one at a time to `simulate`."""
    kv = f"tcp://127.0.0.1:{free_port()}"
    sim = services.simulator("--block-size", str(BLOCK), "--num-gpu-blocks", str(BLOCKS),
                             "--workload", "none", "--speed", "50", "--kv-events-endpoint", kv)  # fmt: skip
    exporter = services.exporter("--vllm.url", f"{sim.url}/metrics", "--collect.interval", "0.5s",
                                 "--gpu.source", "none", "--kv-events.endpoint", kv)  # fmt: skip
    time.sleep(2.0)  # ZMQ's subscription reaches the publisher before the first request's events
    for prompt, max_tokens in prompts:
        post(f"{sim.url}/v1/completions", {"model": "sim-llama", "prompt": prompt, "max_tokens": max_tokens})
    deadline, last = time.monotonic() + 60, None
    while True:  # until serve has read every batch and polled vLLM's counters after them: two reads agree
        time.sleep(1.5)
        body = get(f"{exporter.url}/metrics")
        causes = re.findall(r'^kvcache_prefix_cache_miss_tokens_total\{cause="(\w+)"\} (\S+)$', body, re.M)
        estimate = re.findall(r'reordered_estimate\{window="15m"\} (\S+)', body)
        if estimate and (causes, estimate) == last:
            break
        last = causes, estimate
        assert time.monotonic() < deadline, "serve's figures never settled"
    assert counter(body, "kvcache_kv_events_missed_batches_total") == 0
    return {c: float(n) for c, n in causes}, float(estimate[0])


def test_timestamp_first_chat_reads_the_same_in_analyze_and_serve(services, tmp_path):
    """The newcomer's case: a chat log whose system message starts with the time it was sent."""
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(timestamp_first_chat()) + "\n")
    offline = analyze(path, "--tokenizer", str(TINY))
    model = tokenize.ModelTokenizer(TINY)
    requests = [
        trace.parse_trace_line(json.loads(line), i, 16, model)
        for i, line in enumerate(timestamp_first_chat())
    ]
    causes, estimate = served(services, [(r.prompt_token_ids, r.max_tokens) for r in requests])
    mine, theirs = shares(offline["curve"]["misses_by_cause"]), shares(causes)
    assert max(abs(mine[c] - theirs[c]) for c in CAUSES) <= 0.02, (mine, theirs)
    assert theirs["prefix_diverged"] > 0.8  # what the fix is: fields after the shared instructions
    assert abs(offline["reordered_estimate"] - estimate) <= 0.02, (offline["reordered_estimate"], estimate)


def test_the_seed_run_reads_the_same_in_analyze_and_on_real_vllm_events():
    """The seed trace replayed by the analyzer vs the sidecar on the events real vLLM 0.32 published for
    the same requests (block size 32, 96 blocks): the same tokens per cause, the same estimate."""
    lines = (SEED / "trace.jsonl").read_text().splitlines()
    requests = trace.parse_trace(lines)
    offline = live.live_view(requests, 32, 96)
    real = seed_phases()["totals"].tokens
    mine, theirs = shares(offline.misses_by_cause), shares(real)
    assert max(abs(mine[c] - theirs[c]) for c in CAUSES) <= 0.02, (mine, theirs)
    raw = [r for r, line in zip(requests, lines, strict=True) if json.loads(line)["phase"] == "raw"]
    hits, queries = phase_ratio("raw")
    live_estimate = (hits + seed_phases()["raw"]["prefix_diverged"]) / queries
    assert abs(live.live_view(raw, 32, 96).reordered_estimate - live_estimate) <= 0.02
