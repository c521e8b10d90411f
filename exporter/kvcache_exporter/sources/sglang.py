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

    async def collect(self) -> VllmSnapshot:
        body = await self.fetch(lead=True)
        if len(body) <= INLINE_PARSE_CHARS:
            return self.read(body, lead=True)
        return await asyncio.to_thread(self.read, body, True)

    def read(self, text: str, lead: bool = False) -> VllmSnapshot:
        sglang = is_sglang(text)
        if self.kind != "auto" and sglang != (self.kind == "sglang"):
            found = "SGLang" if sglang else "no SGLang"
            raise SourceError("wrong_engine", f"--engine {self.kind}, but the page has {found} metrics")
        if sglang:
            return parse_sglang(text, self.limits, self._sglang_memory, lead=lead)
        return super().read(text, lead)
