"""`python -m kvcache_exporter.analyzer` (the `analyze` subcommand) end to end."""

from __future__ import annotations

import json
import subprocess
import sys


def analyze(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "kvcache_exporter.analyzer", *args]
    return subprocess.run(argv, capture_output=True, text=True, input=stdin, timeout=60)


def test_json_on_the_raw_phase(seed_trace_path):
    out = analyze(
        str(seed_trace_path),
        "--block-size",
        "32",
        "--num-gpu-blocks",
        "96",
        "--phase",
        "raw",
        "--format",
        "json",
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["settings"]["requests"] == 160
    assert report["observed"]["hit_ratio"] == 0.0
    assert report["diagnoses"][0]["kind"] == "dynamic_prefix"
    assert report["structure"]["dynamic_field"]["start"] == 1


def test_text_on_the_normalized_requests(seed_trace_path):
    out = analyze(
        str(seed_trace_path), "--block-size", "32", "--num-gpu-blocks", "96", "--requests", "160-319"
    )
    assert out.returncode == 0, out.stderr
    assert "trace: 160 requests" in out.stdout
    assert "no significant cache loss found" in out.stdout
    assert "shared prefix   200 tokens by  160 requests" in out.stdout


def test_stdin_text_prompts_and_bad_input():
    lines = "\n".join(
        json.dumps({"prompt": f"hello number {n} " + "static words here " * 20}) for n in range(10)
    )
    out = analyze("-", "--block-size", "4", stdin=lines)
    assert out.returncode == 0, out.stderr
    assert "dynamic_prefix" in out.stdout
    bad = analyze("-", stdin='{"nothing": 1}\n')
    assert bad.returncode == 2 and "needs prompt_token_ids" in bad.stderr
    missing = analyze("/nonexistent/trace.jsonl")
    assert missing.returncode == 2


def test_mooncake_trace_with_bad_lines(tmp_path):
    from .traces import mooncake_lines

    path = tmp_path / "day.jsonl"
    lines = mooncake_lines(200, instances=2)
    lines.insert(5, '{"hash_ids": "oops"}')
    path.write_text("\n".join(lines) + "\n")
    out = analyze(str(path), "--num-gpu-blocks", "1500", "--format", "json")
    assert out.returncode == 0, out.stderr
    assert f"{path}:6: hash_ids must be a non-empty list" in out.stderr
    assert "analyze: 1 bad lines skipped" in out.stderr and "Traceback" not in out.stderr
    report = json.loads(out.stdout)
    assert report["settings"]["format"] == "mooncake" and report["settings"]["requests"] == 200
    assert 0 < report["observed"]["hit_ratio"] <= report["unbounded"]["hit_ratio"] < 1
    points = report["curve"]["points"]
    assert [p["num_gpu_blocks"] for p in points if p["num_gpu_blocks"] == 1500] == [1500]
    assert report["curve"]["restarts"] == 1 and report["curve"]["misses_by_cause"]["restart"] > 0
    text = analyze(str(path), "--num-gpu-blocks", "1500")
    assert "miss-ratio curve: the hit ratio by cache size" in text.stdout
    (at_1500,) = [p["hit_ratio"] for p in points if p["num_gpu_blocks"] == 1500]
    assert f"*     1500  {at_1500:6.3f}" in text.stdout  # the column is the hit ratio, as its title says
    wrong = analyze(str(path), "--block-size", "24")
    assert wrong.returncode == 2 and "must divide --trace-block-size 512" in wrong.stderr


def test_closed_loop_replay_on_the_seed(seed_trace_path):
    out = analyze(
        str(seed_trace_path),
        "--block-size",
        "32",
        "--num-gpu-blocks",
        "96",
        "--concurrency",
        "64",
        "--format",
        "json",
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["settings"]["replay"] == "closed loop, 64 clients"
    assert report["observed"]["preemptions"] > 0


def test_progress_bar_only_on_a_terminal(tmp_path):
    import os
    import pty

    from .traces import mooncake_lines

    path = tmp_path / "day.jsonl"
    path.write_text("\n".join(mooncake_lines(3000)) + "\n")
    quiet = analyze(str(path), "--format", "json")
    assert quiet.returncode == 0 and "analyze: parse" not in quiet.stderr and quiet.stderr == ""
    leader, follower = pty.openpty()
    argv = [sys.executable, "-m", "kvcache_exporter.analyzer", str(path), "--format", "json"]
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=follower, timeout=60)
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    assert proc.returncode == 0
    assert b"analyze: parse  [" in seen and b"3,000/3,000" in seen and b"analyze: curve" in seen


BAD_TOKEN_LINES = [
    '{"prompt_token_ids": [1, 2, 3, 4], "max_tokens": -5}',
    '{"prompt_token_ids": [1, null]}',
    '{"prompt_token_ids": [[1]]}',
    '{"messages": [1, 2]}',
    '{"prompt_token_ids": [1e400]}',
    '{"prompt_token_ids": [-3, 99999999999999999999999]}',
    "null",
    '{"prompt_token_ids": [1, 2], "max_tokens": 1e9}',
    '{"hash_ids": [1, 2], "input_length": 600}',
]


def test_hostile_lines_are_skipped_never_a_traceback(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = '{"prompt_token_ids": [1, 2, 3, 4, 5], "send_ts": "yesterday", "session": {"a": 1}}'
    path.write_text("\n".join([good, *BAD_TOKEN_LINES]) + "\n")
    out = analyze(str(path), "--block-size", "2", "--html", str(tmp_path / "bad.html"))
    assert out.returncode == 0, out.stderr
    assert (
        "Traceback" not in out.stderr and f"analyze: {len(BAD_TOKEN_LINES)} bad lines skipped" in out.stderr
    )
    assert f"{path}:9: max_tokens must be in 1..1048576" in out.stderr
    assert "trace: 1 requests" in out.stdout


def test_the_readme_analyzer_commands_run_as_written(tmp_path):
    """README's "the analyzer" block, in a shell, on a trace the simulator writes: no ../shared."""
    from tests.conftest import REPO

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Why a workload misses the cache: the analyzer", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    block = block.replace(".venv/bin/kvcache-exporter", f"{sys.executable} -m kvcache_exporter")
    run = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    said = section.split("It prints `", 1)[1].split("`", 1)[0]  # what the README says it prints
    assert " ".join(said.split()) in run.stdout
    assert (tmp_path / "trace.html").read_text(encoding="utf-8").lower().startswith("<!doctype html>")
