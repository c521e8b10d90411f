"""A trace's lines, each read with a byte cap: a longer line is skipped without ever being held whole."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import BinaryIO

MAX_LINE_BYTES = 4 << 20
"""A trace line longer than this is skipped: 4 MiB holds a 500,000-token prompt as ids."""
_CHUNK = 1 << 20


class BadLine(ValueError):
    """A line the analyzer skips; its message goes out as `file:line: message`."""


def read_lines(stream: BinaryIO, max_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, str | BadLine]]:
    """(line number, its text or why it is skipped) for each non-blank line; memory stays within
    `max_bytes` whatever the line lengths."""
    number = 0
    while True:
        raw = stream.readline(max_bytes + 1)
        if not raw:
            return
        number += 1
        if len(raw) > max_bytes and not raw.endswith(b"\n"):
            skipped = len(raw) + _skip_rest(stream)
            yield number, BadLine(f"line longer than {max_bytes:,} bytes ({skipped:,}; --max-line-bytes)")
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            yield number, BadLine(f"not UTF-8 ({err.reason} at byte {err.start})")
            continue
        if text.strip():
            yield number, text


def _skip_rest(stream: BinaryIO) -> int:
    """Read up to the end of the current line in bounded chunks; the bytes skipped."""
    skipped = 0
    while True:
        chunk = stream.readline(_CHUNK)
        skipped += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return skipped


def json_object(text: str) -> dict:
    """One line's JSON object, or BadLine (never RecursionError: nesting depth is the decoder's limit)."""
    try:
        obj = json.loads(text)
    except RecursionError:
        raise BadLine("JSON nested too deeply") from None
    except json.JSONDecodeError as err:
        raise BadLine(f"not JSON: {err.msg} at column {err.colno}") from None
    if not isinstance(obj, dict):
        raise BadLine(f"not a JSON object but {type(obj).__name__}")
    return obj
