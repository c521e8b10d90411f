"""A pool of simulator replicas behind one gateway, the way a model pool runs in Kubernetes.

Each replica is a whole `Simulator` (its own `/metrics`, KV-event PUB and control API) serving no
traffic of its own. The front is an OpenAI-style gateway: it picks a replica per request
(`round-robin`, or `session`: a hash of the request's `user` / `x-session-id`) and proxies the
request there over HTTP. The built-in workload goes through the same routing, in process.

`file_sd()` describes the replicas in Prometheus `file_sd` format (the `replica` and
`kv_events_endpoint` labels are what `kvcache-exporter aggregate` reads); it is rewritten when a
replica restarts, because a restarted replica's KV-event socket binds a new ephemeral port.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import random
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from ..routing import route
from .config import Faults, SimulatorConfig
from .engine import Request
from .runtime import EngineRestarted
from .server import Simulator, _json
from .workloads import RequestSpec, WorkloadFactory, parse_schedule, phase_at

ROUTINGS = ("round-robin", "session")
PROXIED = ("/v1/completions", "/v1/chat/completions")


class SimulatorFleet:
    """`await SimulatorFleet(config, replicas=4, routing="session").start()`; `.url` is the gateway."""

    def __init__(self, config: SimulatorConfig, replicas: int, routing: str, file_sd: str | None = None):
        if replicas < 1 or routing not in ROUTINGS:
            raise ValueError(f"need replicas >= 1 and routing in {ROUTINGS}")
        self.config, self.routing, self.file_sd_path = config, routing, file_sd
        self.replicas = [Simulator(self._replica_config(i)) for i in range(replicas)]
        self._turns = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None
        self.port = config.port

    def _replica_config(self, index: int) -> SimulatorConfig:
        c = self.config
        return dataclasses.replace(
            c,
            port=0,  # ephemeral: `--file-sd` and /control/state name the ports (the next ones may be taken)
            engines=1,
            schedule="none",
            kv_events_endpoint=_replica_endpoint(c.kv_events_endpoint or "tcp://127.0.0.1:*", index),
            kv_events_replay_endpoint=None,
            faults=Faults(drop_kv_seq_every=c.faults.drop_kv_seq_every),
        )

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def names(self) -> list[str]:
        return [f"replica-{i}" for i in range(len(self.replicas))]

    def kv_endpoint(self, index: int) -> str:
        return self.replicas[index].runtime.publishers[0].endpoints[0]

    async def start(self, load: bool = True) -> SimulatorFleet:
        for replica in self.replicas:
            await replica.start()
        self._http = aiohttp.ClientSession()
        self._runner = web.AppRunner(self._app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.write_file_sd()
        if load:
            self.start_load()
        return self

    def start_load(self) -> None:
        """The built-in workload (`start(load=False)` lets subscribers connect first)."""
        self._tasks.append(asyncio.create_task(self._generate_load()))

    async def stop_load(self) -> None:
        """End the built-in workload; the replicas keep serving."""
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def stop(self) -> None:
        await self.stop_load()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()
        for replica in self.replicas:
            await replica.stop()

    async def restart(self, index: int) -> None:
        """Restart one replica like a vLLM process restart (empty cache, KV seq from 0)."""
        await self.replicas[index].restart()
        self.write_file_sd()

    def file_sd(self) -> list[dict]:
        return [
            {
                "targets": [f"{r.config.host}:{r.port}"],
                "labels": {"replica": name, "kv_events_endpoint": self.kv_endpoint(i)},
            }
            for i, (name, r) in enumerate(zip(self.names(), self.replicas, strict=True))
        ]

    def write_file_sd(self) -> None:
        if self.file_sd_path:
            path = Path(self.file_sd_path)
            temporary = path.with_suffix(path.suffix + ".tmp")
            temporary.write_text(json.dumps(self.file_sd(), indent=1))
            temporary.replace(path)  # atomic: a reader never sees half a file

    def pick(self, session: str) -> int:
        return route(self.routing, len(self.replicas), session, next(self._turns))

    async def generate(self, spec: RequestSpec) -> Request:
        return await self.replicas[self.pick(spec.session)].runtime.generate(spec)

    # --- the gateway ------------------------------------------------------------------------

    def _app(self) -> web.Application:
        app = web.Application()
        app.add_routes([web.post(path, self._proxy) for path in PROXIED])
        app.add_routes([web.get("/v1/models", self._proxy), web.get("/control/state", self._state)])
        return app

    async def _proxy(self, request: web.Request) -> web.Response:
        body = await _json(request) if request.method == "POST" else {}
        session = request.headers.get("x-session-id") or str(body.get("user") or body.get("session_id") or "")
        replica = self.replicas[self.pick(session)]
        assert self._http is not None
        async with self._http.request(request.method, replica.url + request.path, json=body or None) as r:
            return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)

    async def _state(self, request: web.Request) -> web.Response:
        return web.json_response({"routing": self.routing, "replicas": self.file_sd()})

    # --- built-in traffic, routed like the gateway's ----------------------------------------

    async def _generate_load(self) -> None:
        factory = WorkloadFactory(
            self.config.seed, trace_path=self.config.trace_path, tokenizer_path=self.config.tokenizer_path
        )
        rng, phases = random.Random(self.config.seed), parse_schedule(self.config.schedule)
        origin = time.monotonic()
        slots, in_flight, active, workload = asyncio.Semaphore(self.config.concurrency), set(), "", None
        while True:
            name = phase_at(phases, (time.monotonic() - origin) * self.config.speed)
            if name != active:
                active, workload = name, factory.make(name)
            if workload is None or self.config.rate <= 0:
                await asyncio.sleep(0.05)
                continue
            spec = self.replicas[0].runtime.built_in(workload.next_request())  # session ids etc.
            gap = spec.gap_s if spec.gap_s is not None else rng.expovariate(self.config.rate)
            await asyncio.sleep(gap / self.config.speed)
            await slots.acquire()
            task = asyncio.create_task(self._send(workload, spec, slots))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)

    async def _send(self, workload, spec: RequestSpec, slots: asyncio.Semaphore) -> None:
        try:
            done = await self.generate(spec)
            workload.on_response(spec, done.output_token_ids)
        except (EngineRestarted, ValueError):
            workload.on_response(spec, [])
        finally:
            slots.release()


def _replica_endpoint(endpoint: str, index: int) -> str:
    """Replica i's KV-event endpoint: an ephemeral `*` port stays so, a fixed tcp port moves by i."""
    if index == 0 or not endpoint.startswith("tcp://") or endpoint.endswith(":*"):
        return endpoint
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + index}"
