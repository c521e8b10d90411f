"""Reading a trace's lines with a byte cap: a huge line is skipped without being held, memory stays
bounded; JSON nesting never escapes as RecursionError."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from kvcache_exporter.analyzer.lines import BadLine, json_object, read_lines


def test_lines_longer_than_the_cap_are_skipped_and_the_next_ones_read():
    stream = io.BytesIO(b'{"a": 1}\n' + b"x" * 5000 + b"\n\n  \n" + b'{"b": 2}\n' + b"y" * 3000)
    out = list(read_lines(stream, max_bytes=1024))
    assert [n for n, _ in out] == [1, 2, 5, 6]
    assert out[0][1] == '{"a": 1}\n' and out[2][1] == '{"b": 2}\n'
    assert isinstance(out[1][1], BadLine) and "longer than 1,024 bytes (5,001" in str(out[1][1])
    assert isinstance(out[3][1], BadLine)  # the last line, without its newline, is too long too


def test_a_line_of_exactly_the_cap_is_read():
    """The cap counts the line's bytes, its newline aside."""
    assert list(read_lines(io.BytesIO(b"x" * 10 + b"\n"), max_bytes=10)) == [(1, "x" * 10 + "\n")]
    (_, line), *_ = read_lines(io.BytesIO(b"x" * 11 + b"\n"), max_bytes=10)
    assert isinstance(line, BadLine)


def test_bytes_that_are_not_utf8_are_a_bad_line():
    (number, line), *_ = read_lines(io.BytesIO(b'{"a": "\xff"}\n'))
    assert number == 1 and isinstance(line, BadLine) and "not UTF-8" in str(line)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"a": ' * 50_000 + "1" + "}" * 50_000, "nested too deeply"),
        ("[1, 2]", "not a JSON object but list"),
        ("null", "not a JSON object but NoneType"),
        ('{"a": 1', "not JSON"),
    ],
)
def test_json_objects_only(text, message):
    with pytest.raises(BadLine, match=message):
        json_object(text)


def test_a_60_mb_line_stays_within_a_small_memory(tmp_path):
    """The line is skipped while read in chunks: the analyzer's peak RSS stays that of a small trace."""
    path = tmp_path / "huge.jsonl"
    good = '{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9]}\n'
    with path.open("w") as f:
        f.write(good + '{"prompt_token_ids": [' + "12345," * 10_000_000 + "1]}\n" + good)
    script = (
        "import resource, subprocess, sys\n"
        f"out = subprocess.run([sys.executable, '-m', 'kvcache_exporter.analyzer', {str(path)!r}], "
        "capture_output=True, text=True)\n"
        "print(out.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "sys.stderr.write(out.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    code, peak_kib = map(int, out.stdout.split())
    assert code == 0, out.stderr
    assert f"{path}:2: line longer than 4,194,304 bytes (60,000," in out.stderr
    assert "analyze: 1 bad lines skipped" in out.stderr
    assert peak_kib < 200 * 1024, f"peak RSS {peak_kib} KiB"
