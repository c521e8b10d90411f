"""Trace lines: every field checked before anything is built from it (issue 23), OpenAI Batch API lines."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvcache_exporter.analyzer import trace
from kvcache_exporter.analyzer.blocktrace import Selection, parse_lines

from .traces import batch_line, chat_lines

GOOD = {"prompt_token_ids": [5, 6, 7, 8]}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"completion_token_ids": "abc"}, "completion_token_ids must be a list of token ids, not str"),
        ({"completion_token_ids": {"a": 1}}, "completion_token_ids must be a list of token ids, not dict"),
        ({"completion_token_ids": 7}, "completion_token_ids must be a list of token ids, not int"),
        ({"completion_token_ids": [1, "2"]}, "completion_token_ids must hold token ids"),
        ({"completion_token_ids": [1] * (trace.MAX_GENERATED + 1)}, "more than 1,048,576"),
        ({"prompt_token_ids": [True, 2]}, "prompt_token_ids must hold token ids"),
        ({"prompt_token_ids": [1.5]}, "prompt_token_ids must hold token ids"),
        ({"prompt_token_ids": "1 2 3"}, "prompt_token_ids must be a list of token ids, not str"),
        ({"prompt_token_ids": [1] * (trace.MAX_PROMPT_TOKENS + 1)}, "more than 1,048,576"),
        ({"max_tokens": "16"}, "max_tokens must be in 1..1048576"),
        ({"max_tokens": 2**40}, "max_tokens must be in 1..1048576"),
        ({"i": -1}, "i must be in 0.."),
        ({"session": "s" * 2000}, "session longer than 1024"),
    ],
)
def test_each_field_is_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        trace.parse_trace_line({**GOOD, **fields}, 0)


def test_null_completion_is_no_completion_and_ids_are_kept():
    request = trace.parse_trace_line({**GOOD, "completion_token_ids": None, "session": 12}, 3)
    assert request.forced_output is None and request.session == "12" and request.index == 3
    assert trace.parse_trace_line({**GOOD, "completion_token_ids": [9, 9]}, 0).forced_output == [9, 9]


@pytest.mark.parametrize(
    "messages",
    [[1, 2], [{"role": 5, "content": "x"}], [{"role": "user", "content": {"text": "x"}}], "hello"],
)
def test_bad_messages_are_named(messages):
    with pytest.raises(ValueError, match=r"messages|content"):
        trace.parse_trace_line({"messages": messages}, 0)


@pytest.mark.parametrize("depth", [100, 900, 5000, 200_000])
def test_deeply_nested_message_parts_are_a_bad_line_not_a_recursion_error(depth):
    part = '{"type": "text", "text": ' * depth + '"x"' + "}" * depth
    line = '{"messages": [{"role": "user", "content": [' + part + "]}]}"
    good = json.dumps({"messages": [{"role": "user", "content": "x"}]})
    parsed = parse_lines([good, line, "[" * depth + "]" * depth], "t", 16)
    assert len(parsed.requests) + len(parsed.skipped) == 3
    assert all(s.startswith("t:") for s in parsed.skipped)


def test_batch_api_lines_are_their_bodies():
    bodies = chat_lines(3, "customer")
    lines = [json.dumps(batch_line(n, body)) for n, body in enumerate(bodies)]
    lines.append(json.dumps(batch_line(3, {"prompt": "hello there", "max_tokens": 4}, "/v1/completions")))
    lines.append(json.dumps(batch_line(4, {"input": "embed me"}, "/v1/embeddings")))
    lines.append(json.dumps({"custom_id": "x", "url": "/v1/chat/completions", "body": "nope"}))
    parsed = parse_lines(lines, "batch.jsonl", 16)
    direct = [trace.parse_trace_line(body, n) for n, body in enumerate(bodies)]
    assert [t.prompt_token_ids for t in parsed.traces[:3]] == [t.prompt_token_ids for t in direct]
    assert parsed.traces[0].session == bodies[0]["user"] and parsed.traces[0].max_tokens == 32
    assert parsed.traces[3].max_tokens == 4 and parsed.text
    only = "only /v1/chat/completions and /v1/completions prompts"
    assert parsed.skipped == [
        f"batch.jsonl:5: batch line for '/v1/embeddings': {only}",
        "batch.jsonl:6: batch line's body must be an object",
    ]


def test_phase_and_positions_select_while_parsing():
    lines = ["[1]", json.dumps({**GOOD, "phase": "a"}), "7", json.dumps({**GOOD, "phase": "b"})] * 3
    parsed = parse_lines(lines, "p", 2, select=Selection("b", 1, 1))
    assert len(parsed.requests) == 1
    assert parsed.skipped[:2] == ["p:1: not a JSON object but list", "p:3: not a JSON object but int"]


def analyze(*args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "kvcache_exporter.analyzer", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_phase_with_lines_that_are_not_objects(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(["[1, 2]", '"text"', json.dumps({**GOOD, "phase": "raw"}) * 1, "{"]) + "\n")
    out = analyze(str(path), "--phase", "raw", "--block-size", "2")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and "trace: 1 requests" in out.stdout
    assert f"{path}:1: not a JSON object but list" in out.stderr and f"{path}:4: not JSON" in out.stderr


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"this is not json", "not a tokenizer.json"),
        (b'{"version": "1.0", "model": 5}', "not a tokenizer.json"),
        (b"\xff\xfe", "tokenizer.json"),
    ],
)
def test_a_tokenizer_file_that_is_not_a_tokenizer(tmp_path, content, message):
    (tmp_path / "tokenizer.json").write_bytes(content)
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "hello"}) + "\n")
    out = analyze(str(path), "--tokenizer", str(tmp_path))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("analyze: ") and message in out.stderr


def test_a_chat_template_that_fails_names_the_line(tmp_path):
    from .test_tokenize import TINY_LLAMA

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((TINY_LLAMA / "tokenizer.json").read_bytes())
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] + 1 }}")
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    out = analyze(str(path), "--tokenizer", str(folder))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"{path}:1: the chat template fails on these messages" in out.stderr
    (folder / "chat_template.jinja").write_text("{% for %}")
    broken = analyze(str(path), "--tokenizer", str(folder))
    assert broken.returncode == 2 and "the chat template does not compile" in broken.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-gpu-blocks", "1000000000000"], "over 16,777,216"),  # was a MemoryError traceback
        (["--num-gpu-blocks", "100000000"], "over 16,777,216"),  # was 3 GiB
        (["--num-gpu-blocks", "8388608", "--replicas", "4"], "x 4 replica(s)"),
        (["--arrivals", "--speed", "nan"], "--speed nan: a finite number above 0"),
        (["--arrivals", "--speed", "0"], "--speed 0.0: a finite number above 0"),
        (["--tokenizer", "/dev/zero"], "/dev/zero: not a regular file"),  # was a read without end
    ],
)
def test_sizes_from_flags_are_bounded_one_line_each(tmp_path, flags, message):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    out = analyze(str(path), *flags)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("analyze: ") and message in out.stderr, out.stderr


def test_a_capture_with_too_many_blocks_is_refused(tmp_path):
    capture = tmp_path / "metrics.txt"
    capture.write_text(
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000000000000",engine="0"} 1.0\n'
    )
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    out = analyze(str(path), "--metrics", str(capture))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "over 16,777,216" in out.stderr
