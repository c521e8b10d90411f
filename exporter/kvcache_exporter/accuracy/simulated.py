"""The simulator in process as a backend: one engine, requests one at a time, every step's events
through vLLM's wire encoding (simulator/kv_events.py) and the sidecar's decoder. A restart is a new
engine (a new publisher: seq from 0, an empty cache), a reset vLLM's /reset_prefix_cache."""

from __future__ import annotations

from dataclasses import dataclass

from ..simulator.blocks import Origin
from ..simulator.engine import Engine, EngineConfig
from ..simulator.engine import Request as EngineRequest
from ..simulator.streams import step_batches
from ..sources.kv_events_decode import Batch
from .workload import KINDS, Request, Shape

# Kinds no simulator shape can inject: its hybrid pool evicts a unit's window blocks with its full one.
NOT_SIMULATED = frozenset({"window_dropped"})
NO_TIER = frozenset({"host_tier_load"})
# A reset clears the GPU only: the tier loads the prompt back, which is host_tier_load's case; and a
# cache that overflows into the tier is loaded back, not evicted.
TIERED = frozenset({"capacity_overflow", "cache_reset"})


@dataclass(frozen=True)
class SimShape:
    name: str
    layout: str
    block_size: int  # the hit unit
    blocks: int
    max_model_len: int
    offload_blocks: int = 0

    @property
    def shape(self) -> Shape:
        skip = NOT_SIMULATED | (TIERED if self.offload_blocks else NO_TIER)
        return Shape(
            self.name,
            self.block_size,
            self.block_size * self.blocks,
            self.max_model_len - 1,  # max_tokens 1 (a generated answer is far under the budget)
            tuple(k for k in KINDS if k not in skip),
        )


SHAPES = (
    SimShape("simulator llama", "llama", 16, 256, 2048),
    SimShape("simulator llama + CPU tier", "llama", 16, 128, 2048, offload_blocks=1024),
    SimShape("simulator gemma-2", "gemma-2", 32, 128, 2048),
    SimShape("simulator gemma-3", "gemma-3", 32, 128, 2048),
    SimShape("simulator deepseek-v4", "deepseek-v4", 256, 64, 8192),
)


class Simulated:
    def __init__(self, spec: SimShape):
        self.spec, self.shape = spec, spec.shape
        self.seq, self.clock, self.sent = 0, 0.0, 0
        self.engine = self._engine()

    def _engine(self) -> Engine:
        spec = self.spec
        config = EngineConfig(
            spec.block_size,
            spec.blocks,
            max_model_len=spec.max_model_len,
            max_num_batched_tokens=spec.max_model_len,
            layout=spec.layout,
            offload_cpu_blocks=spec.offload_blocks,
            offload_block_bytes=spec.block_size * 1024 if spec.offload_blocks else 0,
        )
        return Engine(config, 0)

    def begin(self, case: int) -> None:
        """One engine: every case is its."""

    def send(self, request: Request) -> tuple[list[Batch], tuple[int, ...]]:
        if request.before == "restart":
            self.engine, self.seq = self._engine(), 0
        elif request.before == "reset" and not self.engine.reset_prefix_cache():
            raise RuntimeError("the simulator's cache could not be reset: a request is running")
        self.sent += 1
        sent = EngineRequest(str(self.sent), list(request.prompt), max(request.answer, 1), self.clock)
        if request.identity is not None:  # a LoRA adapter: part of the chain's hash (blocks.py)
            sent.origin = Origin(1 + int(request.identity.rpartition("-")[2]), request.identity)
        self.engine.add_request(sent)
        batches, self.clock, self.seq = step_batches(self.engine, self.clock, self.seq)
        return batches, tuple(sent.output_token_ids)
