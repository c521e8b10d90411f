"""`analyze --concurrency/--arrivals` on block-hash traces: the engine replays chains of block keys."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvcache_exporter.analyzer import blocktrace, cli, mrc
from kvcache_exporter.analyzer.replay import concurrent_replay

from .traces import mooncake_lines, qwen_lines

# (lines, a pool where overlapping requests must preempt: it holds about one of the longest Mooncake
# requests, 740 blocks, or three of the longest Qwen conversations, 178)
TRACES = {"mooncake": (lambda: mooncake_lines(300), 1000), "qwen": (lambda: qwen_lines(150), 500)}


@pytest.fixture(scope="module", params=sorted(TRACES))
def trace(request, tmp_path_factory):
    make, blocks = TRACES[request.param]
    path = tmp_path_factory.mktemp("traces") / f"{request.param}.jsonl"
    path.write_text("\n".join(make()) + "\n")
    parsed = blocktrace.parse_lines(path.read_text().splitlines(), str(path), 16)
    assert parsed.kind == request.param and not parsed.skipped
    return path, parsed.requests, blocks


def analyze_json(capsys, *argv: str) -> dict:
    assert cli.main([*argv, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_one_client_and_slow_arrivals_are_the_sequential_replay(trace, capsys):
    path, requests, blocks = trace
    sequential = mrc.pool_replay(requests, 16, blocks)  # the exact sequential replay
    assert sequential.rejected == 0 and 0 < sequential.hit_ratio < 1
    one = concurrent_replay(requests, 16, blocks, concurrency=1)
    slow = concurrent_replay(requests, 16, blocks, speed=0.001)  # gaps 1000x longer: nothing overlaps
    for run in (one, slow):
        assert run.per_request_hits == sequential.per_request_hits and run.preemptions == 0
    report = analyze_json(capsys, str(path), "--num-gpu-blocks", str(blocks), "--concurrency", "1")
    assert report["settings"]["replay"] == "closed loop, 1 clients"
    assert report["observed"]["hit_tokens"] == sequential.hit_tokens
    assert report["observed"]["preemptions"] == 0
    # The default report's observed line is the one-pass curve's: the same hits on these traces.
    default = analyze_json(capsys, str(path), "--num-gpu-blocks", str(blocks))
    assert default["observed"]["hit_tokens"] == sequential.hit_tokens
    assert report["unbounded"] == default["unbounded"] and report["curve"] == default["curve"]


def test_overlap_on_a_small_cache_preempts_and_loses_hits(trace, capsys):
    path, requests, blocks = trace
    sequential = mrc.pool_replay(requests, 16, blocks)
    big = sum(blocktrace.total_blocks(r, 16) for r in requests) + 2
    unbounded = mrc.pool_replay(requests, 16, big)
    crowded = analyze_json(capsys, str(path), "--num-gpu-blocks", str(blocks), "--concurrency", "32")
    arrivals = analyze_json(capsys, str(path), "--num-gpu-blocks", str(blocks), "--arrivals", "--speed", "20")
    assert arrivals["settings"]["replay"] == "open loop at the trace's arrivals x20"
    for report in (crowded, arrivals):
        observed = report["observed"]
        assert observed["preemptions"] > 0 and observed["rejected"] == 0
        assert observed["prompt_tokens"] == sum(r.prompt_tokens for r in requests)
        # Measured at this pool, not a law: overlap can also gain a little elsewhere (docs/analyzer.md).
        assert observed["hit_ratio"] < sequential.hit_ratio
    # A law: no request hits more than everything that came before it.
    replayed = concurrent_replay(requests, 16, blocks, concurrency=32)
    assert all(h <= u for h, u in zip(replayed.per_request_hits, unbounded.per_request_hits, strict=True))
    assert replayed.hit_tokens == crowded["observed"]["hit_tokens"]
    # With nothing evicted, overlap changes no request's hits: the report's unbounded line stays sequential.
    assert concurrent_replay(requests, 16, big, concurrency=32).per_request_hits == unbounded.per_request_hits


def test_text_and_html_show_the_overlap(trace, capsys, tmp_path):
    path, _, blocks = trace
    assert cli.main([str(path), "--num-gpu-blocks", str(blocks), "--arrivals"]) == 0
    text = capsys.readouterr().out
    assert "(open loop at the trace's arrivals x1)" in text and "preemptions (observed)" in text
    pages = {}
    for mode, extra in (("sequential", []), ("crowded", ["--concurrency", "32"])):
        page = tmp_path / f"{mode}.html"
        assert cli.main([str(path), "--num-gpu-blocks", str(blocks), *extra, "--html", str(page)]) == 0
        pages[mode] = [part.split("/>")[0] for part in page.read_text().split("<polyline")]
    assert "closed loop, 32 clients" in pages["crowded"][0]
    # The time plot is drawn from the observed replay's per-request hits; the curve is the same.
    assert pages["sequential"][1] != pages["crowded"][1] and pages["sequential"][2] == pages["crowded"][2]


def test_block_keys_replay_as_the_same_prompts_as_token_ids():
    """The seam itself: a Mooncake trace, and the same trace with each hash id turned into 512 token ids
    of its own, replayed overlapping through the engine: the same hits and preemptions, request for
    request (equal hash ids are equal prefixes, as equal tokens are)."""
    import random

    from kvcache_exporter.analyzer import trace as token_trace

    lines = mooncake_lines(120)
    token_lines = []
    for line in lines:
        obj = json.loads(line)
        ids = [t for h in obj["hash_ids"] for t in random.Random(h).choices(range(5, 50_000), k=512)]
        body = {"prompt_token_ids": ids[: obj["input_length"]], "max_tokens": obj["output_length"]}
        token_lines.append(json.dumps({**body, "send_ts": obj["timestamp"] / 1000}))
    keyed = blocktrace.parse_lines(lines, "hashes", 16).requests
    tokens = token_trace.parse_trace(token_lines)
    for kw in ({"concurrency": 16}, {"speed": 5.0}):
        by_keys = concurrent_replay(keyed, 16, 1000, **kw)
        by_tokens = concurrent_replay(tokens, 16, 1000, **kw)
        assert by_keys.per_request_hits == by_tokens.per_request_hits and by_keys.hit_tokens > 0
        assert by_keys.preemptions == by_tokens.preemptions > 0


PEAK_RSS_CHILD = """
import sys
from pathlib import Path
from kvcache_exporter.analyzer.cli import main
code = main(sys.argv[1:])
status = Path("/proc/self/status").read_text()
print(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")), file=sys.stderr)
sys.exit(code)
"""


def test_a_huge_prompt_trace_replays_without_its_tokens(tmp_path):
    """200 requests of about 1M prompt tokens (2,000 hash ids each, few distinct): 200M token ids would
    be over 1.5 GiB as Python lists. Replayed by 4 clients at block size 512 in bounded memory."""
    rng = __import__("random").Random(7)
    templates = [[rng.randrange(10**9) for _ in range(2000)] for _ in range(3)]
    lines = []
    for i in range(200):
        ids = rng.choice(templates)[: rng.randint(1500, 2000)]
        ids = ids + [rng.randrange(10**9) for _ in range(2000 - len(ids))]
        line = {"timestamp": i, "input_length": 2000 * 512 - i, "output_length": 2, "hash_ids": ids}
        lines.append(json.dumps(line))
    path = tmp_path / "huge.jsonl"
    path.write_text("\n".join(lines) + "\n")
    argv = [sys.executable, "-c", PEAK_RSS_CHILD, str(path), "--block-size", "512", "--num-gpu-blocks"]
    argv += ["4200", "--concurrency", "4", "--format", "json"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["observed"]["prompt_tokens"] == sum(2000 * 512 - i for i in range(200)) > 2 * 10**8
    assert 0.5 < report["observed"]["hit_ratio"] < 1 and report["observed"]["preemptions"] > 0
    peak_mib = int(out.stderr.split()[-1]) / 1024
    assert peak_mib < 250, f"peak RSS {peak_mib:.0f} MiB"


def test_restarts_empty_every_cache_in_overlapping_replays(tmp_path, capsys):
    lines = mooncake_lines(300, seed=2, instances=3)  # server_instance changes twice
    path = tmp_path / "restarts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    requests = blocktrace.parse_lines(lines, "r", 16).requests
    steady = blocktrace.parse_lines(mooncake_lines(300, seed=2), "s", 16).requests  # the same requests
    restarts = frozenset(mrc.restart_points(requests))
    assert len(restarts) == 2
    sequential = mrc.pool_replay(requests, 16, 2000)
    assert sequential.per_request_hits != mrc.pool_replay(steady, 16, 2000).per_request_hits
    one = concurrent_replay(requests, 16, 2000, concurrency=1, restarts=restarts)
    assert one.per_request_hits == sequential.per_request_hits
    report = analyze_json(capsys, str(path), "--num-gpu-blocks", "2000", "--concurrency", "1")
    assert report["observed"]["hit_tokens"] == sequential.hit_tokens
    burst = concurrent_replay(requests, 16, 2000, speed=20.0, restarts=restarts)
    assert burst.preemptions > 0
    # A restart drains the requests in flight, then the first request after it finds every cache empty.
    assert all(burst.per_request_hits[n] == 0 for n in restarts)
    assert all(sequential.per_request_hits[n] == 0 for n in restarts)
    assert burst.per_request_hits != concurrent_replay(steady, 16, 2000, speed=20.0).per_request_hits
