"""How the engine (vLLM/SGLang /metrics) and GPU sources are wired: their rows' polls in server.ROWS,
above sources/ and derive/ (a source knows nothing of the poll state)."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from .collector import Poll, target_polls
from .derive.state import PollState
from .settings import Settings
from .sources.base import SourceUnavailable
from .sources.gpu_factory import make_gpu_source
from .sources.sglang import EngineSource

log = logging.getLogger("kvcache_exporter")


def wire_engines(s: Settings, state: PollState) -> list[Poll]:
    """One poll per --vllm.url, each a target of the poll state; the sources kept as
    state.parts["engines"] (discovery asks the first)."""
    engines = state.parts["engines"] = {
        urlsplit(url).netloc: EngineSource(
            url, s.vllm_timeout, s.vllm_max_body_bytes, s.vllm_bearer_token_file, kind=s.engine_kind
        )
        for url in s.vllm_url
    }
    polls = target_polls(state, engines)
    for target in state.targets:  # `auto`: vllm until the first page says otherwise
        target.engine_kind = "sglang" if s.engine_kind == "sglang" else "vllm"
    return polls


def engine_timeout(s: Settings) -> float:
    return s.vllm_timeout + 1


def wire_gpu(s: Settings, state: PollState) -> list[Poll]:
    """None when there is no GPU telemetry at all, so nothing reads as failing."""
    try:
        gpu = make_gpu_source(
            s.gpu_source,
            devices=s.gpu_devices or None,
            max_processes=s.gpu_max_processes,
            dcgm_url=s.gpu_dcgm_url,
            pod_name=s.gpu_pod,  # $POD_NAME already applied by config
            pod_namespace=s.gpu_namespace,
            gpu_uuids=s.gpu_uuids or None,
            timeout_seconds=s.gpu_dcgm_timeout,
        )
    except SourceUnavailable as off:
        log.info("GPU telemetry off: %s", off)
        return []
    return [Poll(gpu, state.add_gpu().ingest)]
