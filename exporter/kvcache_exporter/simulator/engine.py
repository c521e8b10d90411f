"""One engine core: vLLM V1's FCFS scheduler over a prefix-caching block pool. No I/O, no clock of its own:
the caller passes `now` to `step` and gets back how long the step took."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from .blocks import NO_ORIGIN, Block, BlockPool, KVEvent, Origin, block_hashes_for, external_hash
from .latency import LatencyModel
from .layouts import HybridBlockPool, layout_named, unit_hashes
from .offload import CpuTier
from .residency import Residency
from .stats import EngineStats

VOCAB_LOW, VOCAB_HIGH = 5, 500


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_gpu_blocks: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    kv_cache_metrics_sample: float = 0.0
    """vLLM's --kv-cache-metrics (sampled block residency histograms) with this sample rate; 0: off."""
    latency: LatencyModel = field(default_factory=LatencyModel)
    kv_events: bool = True
    """Record KV events (what the ZMQ publisher sends); the analyzer's replays turn them off."""
    layout: str = "llama"
    """The KV-cache groups (layouts.py); a hybrid layout's unit is the block size."""
    offload_cpu_blocks: int = 0
    """Blocks of a CPU offload tier (offload.py; 0: none)."""
    offload_block_bytes: int = 0
    max_loras: int = 0
    """vLLM's --max-loras with --enable-lora (0: LoRA off): vllm:lora_requests_info is served."""


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    forced_output: list[int] | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    blocks: list[Block] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    finished_reason: str | None = None
    origin: Origin = NO_ORIGIN
    report_full: bool = False
    """vLLM's `kv_cache_report_mode: full`: re-announce the blocks a prefix hit reused."""
    fine_hashes: list[bytes] = field(default_factory=list)
    num_external_tokens: int = 0
    """Prompt tokens loaded from the offload tier at admission (vLLM's external hit)."""
    """Hybrid layouts: the chain at every `hash_block_size` tokens (block_hashes are its unit ends)."""

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def hash_extra(self) -> bytes:
        name = self.origin.lora_name
        return b"" if name is None else b"lora:" + name.encode()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    def hash_full_blocks(self, block_size: int) -> list[bytes]:
        """`block_hashes` extended to every full block of the tokens so far."""
        return block_hashes_for(self.all_token_ids, block_size, self.block_hashes, self.hash_extra)

    def stored_token_ids(self) -> Sequence[int]:
        """What a BlockStored event's token_ids are sliced from."""
        return self.all_token_ids

    def next_token(self) -> int:
        """Deterministic "sampling": the replayed token when given, else a function of the context."""
        index = len(self.output_token_ids)
        if self.forced_output is not None and index < len(self.forced_output):
            return self.forced_output[index]
        previous = self.all_token_ids[-1]
        return VOCAB_LOW + (previous * 1103515245 + 12345 + index) % (VOCAB_HIGH - VOCAB_LOW)


@dataclass(eq=False)
class KeyedRequest(Request):
    """A request given as its prompt's chain of block keys and its length, never as token ids (block-hash
    traces, whose prompts exist only as hash ids). Blocks past the prompt's full ones (its partial last
    block, the generated tokens) take keys from `fresh_keys`: nothing else can share them."""

    prompt_keys: list[bytes] = field(default_factory=list)
    prompt_len: int = 0
    fresh_keys: Iterator[bytes] = field(default_factory=lambda: iter(()))

    @property
    def all_token_ids(self) -> list[int]:
        raise TypeError("a KeyedRequest has no token ids")

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_len

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_token_ids)

    def hash_full_blocks(self, block_size: int) -> list[bytes]:
        known, full = self.block_hashes, self.num_tokens // block_size
        if len(known) < full:
            known.extend(self.prompt_keys[len(known) : full])
            known.extend(next(self.fresh_keys) for _ in range(full - len(known)))
        return known

    def stored_token_ids(self) -> Sequence[int]:
        return ()

    def next_token(self) -> int:
        return VOCAB_LOW


def _adapters(requests) -> str:
    return ",".join(sorted({r.origin.lora_name for r in requests if r.origin.lora_name is not None}))


@dataclass
class StepResult:
    duration: float
    scheduled_tokens: int
    finished: list[Request]
    events: list[KVEvent]


class Engine:
    def __init__(self, config: EngineConfig, index: int = 0) -> None:
        self.config = config
        self.index = index
        self.layout = layout = layout_named(config.layout)
        if layout is None:
            self.pool = BlockPool(config.num_gpu_blocks, config.block_size, record_events=config.kv_events)
        elif config.block_size != layout.unit:
            raise ValueError(f"layout {layout.name} has a {layout.unit}-token unit, not {config.block_size}")
        else:
            self.pool = HybridBlockPool(config.num_gpu_blocks, layout, record_events=config.kv_events)
        self.tier = None
        if config.offload_cpu_blocks:
            if layout is not None:
                raise ValueError("the CPU offload tier is simulated for the llama layout only")
            self.tier = CpuTier(config.offload_cpu_blocks, config.offload_block_bytes, config.kv_events)
        self.stats = EngineStats(config.max_model_len)
        if config.kv_cache_metrics_sample:
            self.pool.residency = Residency(self.stats.histograms, config.kv_cache_metrics_sample, seed=index)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.lora_requests: dict[tuple[str, str], float] = {}
        """(running adapters, waiting adapters), comma-joined -> when last seen (vLLM keeps stale ones)."""

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        if not request.num_prompt_tokens:
            raise ValueError("empty prompt")
        if request.num_prompt_tokens + request.max_tokens > self.config.max_model_len:
            raise ValueError(f"prompt + max_tokens exceeds max_model_len {self.config.max_model_len}")
        needed_blocks = -(-(request.num_prompt_tokens + request.max_tokens) // self.config.block_size)
        if needed_blocks > self.config.num_gpu_blocks - 1:
            raise ValueError(f"request needs {needed_blocks} KV blocks, the pool has fewer")
        self.waiting.append(request)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def step(self, now: float) -> StepResult:
        self.pool.now = now
        scheduled = self._schedule(now)
        if self.config.max_loras:
            self.lora_requests[(_adapters(self.running), _adapters(self.waiting))] = now
        decode_seqs = sum(1 for r, n in scheduled if r.output_token_ids and n == 1)
        total = sum(n for _, n in scheduled)
        duration = self.config.latency.step_seconds(total - decode_seqs, decode_seqs)
        if total:
            self.stats.observe("iteration_tokens_total", total)
        finished = self._execute(scheduled, now + duration)
        events = self.pool.take_events()
        if self.tier is not None:  # the connector's events follow the cache manager's, as in vLLM
            events += self.tier.take_events()
        return StepResult(duration, total, finished, events)

    # --- scheduling -------------------------------------------------------------------------

    def _schedule(self, now: float) -> list[tuple[Request, int]]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self._allocate(request, num_new, []):
                victim = self.running.pop()  # FCFS: the latest arrival goes first
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
                index += 1
                continue
            break
        # As in vLLM, no new admissions in a step that had to preempt.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit_blocks = self._lookup(request)
            num_hit_tokens = len(hit_blocks) * self.config.block_size
            loaded = self._offloaded(request, len(hit_blocks))
            num_external = len(loaded) * self.config.block_size
            num_new = min(request.num_tokens - num_hit_tokens - num_external, budget)
            if not self._allocate(request, num_new, hit_blocks, num_external):
                break
            self.waiting.popleft()
            if loaded:
                self.tier.load(loaded)
            self._admit(request, num_hit_tokens, now, num_external)
            scheduled.append((request, num_new))
            budget -= num_new
        return scheduled

    def _hash(self, request: Request) -> None:
        """request.block_hashes: one per full block (per unit on a hybrid layout)."""
        layout = self.layout
        if layout is None:
            request.hash_full_blocks(self.config.block_size)
            return
        h = layout.hash_block_size
        fine = block_hashes_for(request.all_token_ids, h, request.fine_hashes, request.hash_extra)
        request.block_hashes = unit_hashes(fine, layout.unit // h)

    def _lookup(self, request: Request) -> list[Block]:
        if not self.config.enable_prefix_caching:
            return []
        self._hash(request)
        # The last token is always recomputed (its logits are needed), so at most num_tokens-1 hit.
        max_hit_blocks = (request.num_tokens - 1) // self.config.block_size
        if self.layout is not None:
            return self.pool.hit_units(request.block_hashes, max_hit_blocks)
        return self.pool.longest_cached_prefix(request.block_hashes[:max_hit_blocks])

    def _offloaded(self, request: Request, num_hit_blocks: int) -> list[int]:
        """The blocks past the GPU hit that the offload tier holds in a row (at most num_tokens-1 hit)."""
        if self.tier is None or not self.config.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.config.block_size
        wanted = [external_hash(h) for h in request.block_hashes[num_hit_blocks:max_blocks]]
        return wanted[: self.tier.held(wanted)]

    def _admit(self, request: Request, num_hit_tokens: int, now: float, num_external: int = 0) -> None:
        request.num_computed_tokens = num_hit_tokens + num_external
        if request.scheduled_time is None:
            request.scheduled_time = now
        if request.num_preemptions == 0 and self.config.enable_prefix_caching:
            # Recorded once at admission (vLLM PR #48860); lookups after a preemption are not exported.
            self.stats.prefix_cache_queries += request.num_tokens
            self.stats.prefix_cache_hits += num_hit_tokens
            if self.tier is not None:
                self.tier.stats.external_queries += request.num_tokens
                self.tier.stats.external_hits += num_external
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens + num_external
            request.num_external_tokens = num_external
        self.running.append(request)

    def _allocate(
        self, request: Request, num_new: int, hit_blocks: list[Block], num_external: int = 0
    ) -> bool:
        bs = self.config.block_size
        computed = request.num_computed_tokens + len(hit_blocks) * bs + num_external
        required = -(-(computed + num_new) // bs)
        num_new_blocks = max(required - len(request.blocks) - len(hit_blocks), 0)
        evictable_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if num_new_blocks + evictable_hits > self.pool.num_free_blocks:
            return False
        if hit_blocks:
            self.pool.touch(hit_blocks)
            request.blocks.extend(hit_blocks)
            if request.report_full:
                hashes = request.block_hashes if self.layout is None else request.fine_hashes
                self.pool.reuse_report(hashes, request.all_token_ids, len(hit_blocks), request.origin)
        if num_new_blocks:
            request.blocks.extend(self.pool.get_new_blocks(num_new_blocks))
        if self.config.enable_prefix_caching:
            num_cached = request.num_cached_blocks if not hit_blocks else len(hit_blocks)
            num_full = min(computed + num_new, request.num_tokens) // bs
            if num_full > num_cached and self.layout is not None:
                self._hash(request)
                self.pool.cache_units(
                    request.blocks,
                    request.block_hashes,
                    request.fine_hashes,
                    request.all_token_ids,
                    num_cached,
                    num_full,
                    request.num_prompt_tokens,
                    request.origin,
                )
            elif num_full > num_cached:  # most decode steps fill no block: nothing to hash
                request.hash_full_blocks(bs)
                self.pool.cache_full_blocks(
                    request.blocks,
                    request.block_hashes,
                    request.stored_token_ids(),
                    num_cached,
                    num_full,
                    request.origin,
                )
                if self.tier is not None:  # the connector stores every newly computed block
                    self.tier.store([external_hash(h) for h in request.block_hashes[num_cached:num_full]])
            request.num_cached_blocks = max(num_cached, num_full)
        return True

    def _preempt(self, request: Request) -> None:
        self._free(request)
        request.num_computed_tokens = 0
        request.num_cached_blocks = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def _free(self, request: Request) -> None:
        # Tail blocks first: they hold the least shareable tokens, so they are evicted first.
        self.pool.free_blocks(reversed(request.blocks))
        request.blocks = []

    # --- execution --------------------------------------------------------------------------

    def _execute(self, scheduled: list[tuple[Request, int]], done: float) -> list[Request]:
        finished = []
        for request, num_new in scheduled:
            request.num_computed_tokens += num_new
            if request.num_computed_tokens < request.num_tokens:
                continue  # a chunk of a longer prefill
            self._emit_token(request, done)
            if len(request.output_token_ids) >= request.max_tokens:
                self._finish(request, done, "length")
                finished.append(request)
        return finished

    def _emit_token(self, request: Request, now: float) -> None:
        stats = self.stats
        if request.first_token_time is None:
            request.first_token_time = now
            prompt_len = request.num_prompt_tokens
            cached = max(request.num_cached_tokens, 0)
            stats.prompt_tokens += prompt_len
            stats.prompt_tokens_cached += cached
            stats.prompt_tokens_external += request.num_external_tokens
            stats.prompt_tokens_computed += prompt_len - cached
            stats.observe("time_to_first_token_seconds", now - request.arrival_time)
        else:
            stats.observe("inter_token_latency_seconds", now - request.last_token_time)
        request.last_token_time = now
        request.output_token_ids.append(request.next_token())
        stats.generation_tokens += 1

    def _finish(self, request: Request, now: float, reason: str) -> None:
        self.running.remove(request)
        self._free(request)
        request.finish_time = now
        request.finished_reason = reason
        stats = self.stats
        stats.request_success[reason] += 1
        generated = len(request.output_token_ids)
        decode = request.last_token_time - request.first_token_time
        observations = {
            "e2e_request_latency_seconds": now - request.arrival_time,
            "request_queue_time_seconds": request.scheduled_time - request.arrival_time,
            "request_prefill_time_seconds": request.first_token_time - request.scheduled_time,
            "request_decode_time_seconds": decode,
            "request_inference_time_seconds": request.last_token_time - request.scheduled_time,
            "request_prompt_tokens": request.num_prompt_tokens,
            "request_generation_tokens": generated,
            "request_max_num_generation_tokens": request.max_tokens,
            "request_params_max_tokens": request.max_tokens,
            "request_params_n": 1,
            "request_num_preemptions": request.num_preemptions,
            "request_prefill_kv_computed_tokens": request.num_prompt_tokens
            - max(request.num_cached_tokens, 0),
        }
        if generated > 1:
            observations["request_time_per_output_token_seconds"] = decode / (generated - 1)
        for name, value in observations.items():
            stats.observe(name, value)
