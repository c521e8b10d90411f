"""The vLLM source: poll one server's /metrics and normalize it into a VllmSnapshot (vllm_parse.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from .base import SourceError
from .http import Session, fetch_text, new_session
from .vllm_parse import Memory, ParseBounds, parse
from .vllm_snapshot import EngineKey, EngineSample, Histogram, VllmSnapshot

INLINE_PARSE_CHARS = 256 * 1024  # vLLM's body is ~60 KiB per engine

__all__ = [
    "EngineKey",
    "EngineSample",
    "Histogram",
    "Memory",
    "ParseBounds",
    "VllmSnapshot",
    "VllmSource",
    "parse",
]


@dataclass
class VllmSource:
    """Polls one vLLM server. The URL comes from configuration only, never from a request."""

    name: ClassVar[str] = "vllm"
    url: str
    timeout: float = 5.0
    max_body_bytes: int = 8 * 1024 * 1024
    bearer_token_file: str | None = None
    limits: ParseBounds = field(default_factory=ParseBounds)
    keep_alive: bool = True
    _session: Session | None = None
    _memory: Memory = field(default_factory=Memory)

    def headers(self) -> dict[str, str]:
        if not self.bearer_token_file:
            return {}
        try:
            # Re-read every poll so a rotated token (Kubernetes projected secret) is picked up.
            token = Path(self.bearer_token_file).read_text().strip()
        except OSError as err:
            raise SourceError("bearer_token", f"cannot read bearer token file: {err}") from err
        return {"Authorization": f"Bearer {token}"}

    async def collect(self) -> VllmSnapshot:
        body = await self.fetch(lead=True)  # "\n" + the page: as the parse reads it, no copy made
        if len(body) <= INLINE_PARSE_CHARS:  # a few ms at most: not worth a thread hop
            return self.read(body, lead=True)
        # In a worker thread: a long parse (8 MiB of series) must not hold up scrapes of /metrics.
        return await asyncio.to_thread(self.read, body, True)

    async def fetch(self, lead: bool = False) -> str:
        """The whole body of one GET (its last line ended), or SourceError; "\n" + it with `lead`."""
        if self._session is None:
            self._session = new_session(self.keep_alive)
        return await fetch_text(
            self._session,
            self.url,
            timeout=self.timeout,
            max_bytes=self.max_body_bytes,
            headers=self.headers(),
            lead=lead,
        )

    def read(self, text: str, lead: bool = False) -> VllmSnapshot:
        """The snapshot of a page (of "\n" + a page with `lead`)."""
        return parse(text, self.limits, self._memory, lead=lead)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
