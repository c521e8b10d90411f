"""The engine source: poll one server's /metrics, read it as vLLM's or SGLang's page.

`--engine auto` (the default) decides per page from its family names (sglang_parse.is_sglang), so
one `--vllm.url` (alias `--engine.url`) serves either engine; `vllm` / `sglang` insist, and a page of
the other engine is a `wrong_engine` error rather than series read under the wrong meaning.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import ClassVar

from .base import SourceError
from .sglang_parse import Memory as SglangMemory
from .sglang_parse import is_sglang
from .sglang_parse import parse as parse_sglang
from .vllm import INLINE_PARSE_CHARS, VllmSource
from .vllm_snapshot import VllmSnapshot

ENGINE_KINDS = ("auto", "vllm", "sglang")


@dataclass
class EngineSource(VllmSource):
    """VllmSource with SGLang's page read too; `kind` is the flag (auto | vllm | sglang)."""

    name: ClassVar[str] = "vllm"  # the collector label stays: dashboards and alerts select on it
    kind: str = "auto"
    _sglang_memory: SglangMemory = field(default_factory=SglangMemory)
    _vllm_last: bool = False  # the last page the vLLM parse read had no SGLang names

    async def collect(self) -> VllmSnapshot:
        body = await self.fetch(lead=True)
        if len(body) <= INLINE_PARSE_CHARS:
            return self.read(body, lead=True)
        return await asyncio.to_thread(self.read, body, True)

    def read(self, text: str, lead: bool = False) -> VllmSnapshot:
        if self._vllm_last and self.kind != "sglang":
            return self._read_vllm_first(text, lead)
        sglang = is_sglang(text)
        self._vllm_last = False
        if self.kind != "auto" and sglang != (self.kind == "sglang"):
            found = "SGLang" if sglang else "no SGLang"
            raise SourceError("wrong_engine", f"--engine {self.kind}, but the page has {found} metrics")
        if sglang:
            return parse_sglang(text, self.limits, self._sglang_memory, lead=lead)
        self._vllm_last = True  # the vLLM parse's RunFinder now holds a page without SGLang's names
        return super().read(text, lead)

    def _read_vllm_first(self, text: str, lead: bool) -> VllmSnapshot:
        """A page read as vLLM's first, when the last page the vLLM parse saw was vLLM's: its
        RunFinder then knows which runs differ from that page (every other byte is the same), and
        only those can hold SGLang's names (`is_sglang`'s needles hold no line feed but a leading
        one, and a run starts with one, so no needle spans a run's edge). `is_sglang` searched the
        whole page, ~0.1 ms: more than the rest of a vLLM page's parse."""
        snapshot, error = None, None
        try:
            snapshot = super().read(text, lead)
        except Exception as err:  # a page of SGLang's fails here: decided below
            error = err
        moved = self._memory.finder.moved
        runs = self._memory.finder.runs
        if moved is None or (error is not None and not isinstance(error, SourceError)):
            sglang = is_sglang(text)  # searched anew (or a crash): the whole page
        else:
            sglang = any(is_sglang(runs[i][0]) for i in moved)
        if not sglang:
            if error is not None:
                raise error
            return snapshot  # type: ignore[return-value]
        self._vllm_last = False
        return self.read(text, lead)
