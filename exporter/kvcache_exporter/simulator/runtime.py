"""The running simulator: engines stepped in simulated time, KV-event publishers, load generator, GPUs."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from dataclasses import replace

import zmq.asyncio

from ..routing import route
from .blocks import Origin
from .config import SimulatorConfig, cache_config_labels
from .dcgm import GpuState
from .engine import Engine, Request
from .exposition import ExpositionState
from .kv_events import KVEventPublisher, encode_batch
from .sglang_events import SglangWire
from .workloads import RequestSpec, Workload, WorkloadFactory, parse_schedule, phase_at


class EngineRestarted(RuntimeError):
    pass


class Runtime:
    def __init__(self, config: SimulatorConfig) -> None:
        self.config = config
        self.phases = parse_schedule(config.schedule)
        self.workload_override: str | None = None
        self._factory = WorkloadFactory(
            config.seed, trace_path=config.trace_path, tokenizer_path=config.tokenizer_path
        )
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._round_robin = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._zmq = zmq.asyncio.Context()
        self.publishers: list[KVEventPublisher] = []
        self.gpus = [
            GpuState(
                i,
                config.gpu_memory_total_mib,
                config.gpu_memory_utilization * config.gpu_memory_total_mib,
                swing_period_s=config.memory_swing_period_s,
            )
            for i in range(config.engines)
        ]
        self.instance = -1

    # --- clock ------------------------------------------------------------------------------

    def sim_now(self) -> float:
        """Simulated epoch seconds: wall time since start, sped up by `speed`."""
        return self._sim_origin + (time.monotonic() - self._wall_origin) * self.config.speed

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        self._wall_origin, self._sim_origin = time.monotonic(), time.time()
        self._schedule_origin = self.sim_now()
        await self._start_engines()
        self._tasks.append(asyncio.create_task(self._generate_load()))
        self._tasks.append(asyncio.create_task(self._sample_gpus()))

    async def _start_engines(self) -> None:
        self.instance += 1
        self.created = time.time()
        engine = self.config.engine
        if self.config.lora_adapters:  # --enable-lora --max-loras <adapters>
            engine = replace(engine, max_loras=max(engine.max_loras, len(self.config.lora_adapters)))
        self.engines = [Engine(engine, i) for i in range(self.config.engines)]
        self._wakeups = [asyncio.Event() for _ in self.engines]
        self._pending: dict[Request, asyncio.Future] = {}
        self._busy_s = [0.0 for _ in self.engines]
        if self.config.kv_events_endpoint:
            self.publishers = [
                KVEventPublisher(
                    self._zmq,
                    self.config.kv_events_endpoint,
                    self.config.kv_events_replay_endpoint,
                    self.config.kv_events_topic,
                    i,
                    self.config.kv_buffer_steps,
                    encode=SglangWire().encode_batch
                    if self.config.metrics_schema == "sglang"
                    else encode_batch,
                )
                for i in range(self.config.engines)
            ]
            for publisher in self.publishers:
                publisher.drop_every = self.config.faults.drop_kv_seq_every
        self._engine_tasks = [asyncio.create_task(self._run_engine(i)) for i in range(len(self.engines))]

    async def _stop_engines(self) -> None:
        for task in self._engine_tasks:
            task.cancel()
        for task in self._engine_tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for future in self._pending.values():
            if not future.done():
                future.set_exception(EngineRestarted("engine restarted"))
        for publisher in self.publishers:
            await publisher.close()
        self.publishers = []

    async def restart(self) -> None:
        """Like a process restart: counters back to zero, new `_created`, empty cache, KV seq from 0."""
        await self._stop_engines()
        await self._start_engines()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._stop_engines()
        self._zmq.term()

    def exposition_state(self) -> ExpositionState:
        return ExpositionState(
            self.config.model_name,
            self.engines,
            None if self.config.api_server_count > 1 else self.created,
            lambda i: cache_config_labels(self.config, i),
        )

    # --- requests ---------------------------------------------------------------------------

    async def generate(self, spec: RequestSpec) -> Request:
        index = self._route(spec.session)
        request = Request(
            f"req-{next(self._ids)}",
            spec.prompt_token_ids,
            spec.max_tokens,
            self.sim_now(),
            spec.forced_output,
            origin=self.origin(spec),
            report_full=spec.report_full,
        )
        self.engines[index].add_request(request)  # raises ValueError for requests that can never fit
        future = asyncio.get_running_loop().create_future()
        self._pending[request] = future
        self._wakeups[index].set()
        return await future

    def origin(self, spec: RequestSpec) -> Origin:
        adapters = self.config.lora_adapters
        if spec.lora_name is not None and spec.lora_name not in adapters:
            raise ValueError(f"unknown LoRA adapter {spec.lora_name!r}")
        lora_id = None if spec.lora_name is None else adapters.index(spec.lora_name) + 1
        return Origin(lora_id, spec.lora_name, spec.session_id)

    def built_in(self, spec: RequestSpec) -> RequestSpec:
        """Built-in traffic with the configured deployment options: adapter by session, session ids,
        report mode."""
        config, choices = self.config, (None, *self.config.lora_adapters)
        spec.lora_name = choices[route("session", len(choices), spec.session, 0)]
        spec.session_id = spec.session if config.session_ids and spec.session else None
        spec.report_full = config.kv_cache_report_mode == "full"
        return spec

    def _route(self, session: str | None) -> int:
        sticky = self.config.routing == "session" and bool(session)
        return route(
            self.config.routing, len(self.engines), session, 0 if sticky else next(self._round_robin)
        )

    async def _run_engine(self, index: int) -> None:
        engine, wakeup, speed = self.engines[index], self._wakeups[index], self.config.speed
        while True:
            if not engine.has_work:
                wakeup.clear()
                await wakeup.wait()
            result = engine.step(self.sim_now())
            self._busy_s[index] += result.duration
            await asyncio.sleep(result.duration / speed)
            if self.publishers:
                await self.publishers[index].publish(result.events)
            for request in result.finished:
                future = self._pending.pop(request, None)
                if future is not None and not future.done():
                    future.set_result(request)

    # --- built-in traffic -------------------------------------------------------------------

    def current_workload(self) -> str:
        if self.workload_override:
            return self.workload_override
        return phase_at(self.phases, self.sim_now() - self._schedule_origin)

    def switch_workload(self, name: str | None) -> None:
        """Force a workload now (`None` resumes the schedule from its start)."""
        if name is not None:
            self._factory.make(name)  # validate
        self.workload_override = name
        if name is None:
            self._schedule_origin = self.sim_now()

    async def _generate_load(self) -> None:
        slots = asyncio.Semaphore(self.config.concurrency)
        workload: Workload | None = None
        active = ""
        in_flight: set[asyncio.Task] = set()
        while True:
            name = self.current_workload()
            if name != active:
                active, workload = name, self._factory.make(name)
            if workload is None or self.config.rate <= 0:
                await asyncio.sleep(0.05)
                continue
            spec = self.built_in(workload.next_request())
            gap = spec.gap_s if spec.gap_s is not None else self._rng.expovariate(self.config.rate)
            await asyncio.sleep(gap / self.config.speed)
            await slots.acquire()
            task = asyncio.create_task(self._send(workload, spec, slots))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)

    async def _send(self, workload: Workload, spec: RequestSpec, slots: asyncio.Semaphore) -> None:
        try:
            request = await self.generate(spec)
            workload.on_response(spec, request.output_token_ids)
        except (EngineRestarted, ValueError):
            workload.on_response(spec, [])
        finally:
            slots.release()

    # --- GPU telemetry ----------------------------------------------------------------------

    async def _sample_gpus(self, interval_s: float = 0.5) -> None:
        last_sim, last_busy = self.sim_now(), list(self._busy_s)
        while True:
            await asyncio.sleep(interval_s)
            now, busy = self.sim_now(), list(self._busy_s)
            elapsed = max(now - last_sim, 1e-9)
            for gpu, engine, before, after in zip(self.gpus, self.engines, last_busy, busy, strict=False):
                fraction = min(max(after - before, 0.0) / elapsed, 1.0)
                gpu.advance(elapsed, fraction, engine.pool.usage)
            last_sim, last_busy = now, busy
