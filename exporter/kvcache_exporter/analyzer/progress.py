"""A progress bar on stderr for big traces; silent when stderr is not a terminal."""

from __future__ import annotations

import sys
from typing import TextIO

EVERY = 1000
"""lines or requests between redraws"""
MIN_TOTAL = 3000


class Progress:
    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total = total
        self.on = total >= MIN_TOTAL and self.stream.isatty()

    def __call__(self, stage: str, done: int) -> None:
        if self.on and (done % EVERY == 0 or done == self.total):
            filled = round(30 * done / self.total)
            bar = "#" * filled + "." * (30 - filled)
            self.stream.write(f"\ranalyze: {stage:6s} [{bar}] {done:,}/{self.total:,}")
            self.stream.flush()

    def close(self) -> None:
        if self.on:
            self.stream.write("\n")
            self.stream.flush()
