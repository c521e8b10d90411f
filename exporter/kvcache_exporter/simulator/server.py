"""HTTP face of the simulator: vLLM's OpenAI-style API and /metrics, dcgm-exporter's /dcgm/metrics, and a
loopback-only /control API for fault injection."""

from __future__ import annotations

import asyncio
import ipaddress
import time
import uuid

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import dcgm, tokenizer
from .config import SimulatorConfig
from .engine import Request
from .exposition import make_registry
from .runtime import EngineRestarted, Runtime
from .sglang_exposition import make_sglang_registry
from .workloads import RequestSpec

MALFORMED_LINE = b'vllm:kv_cache_usage_perc{engine="0",model_name= 0.5 garbage\n'


class Simulator:
    """`await Simulator(config).start()`; then `.url`, `.switch_workload(name)`, `await .stop()`."""

    def __init__(self, config: SimulatorConfig) -> None:
        self.config = config
        self.runtime = Runtime(config)
        state = self.runtime.exposition_state
        if config.metrics_schema == "sglang":
            self._registry = make_sglang_registry(state)
        else:
            self._registry = make_registry(state, config.metrics_schema)
        self._runner: web.AppRunner | None = None
        self.port = config.port

    @property
    def url(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self.port}"

    async def start(self) -> Simulator:
        await self.runtime.start()
        self._runner = web.AppRunner(self._app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.runtime.stop()

    def switch_workload(self, name: str | None) -> None:
        self.runtime.switch_workload(name)

    async def restart(self) -> None:
        await self.runtime.restart()

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[_loopback_only_control])
        app.add_routes(
            [
                web.get("/metrics", self._metrics),
                web.get("/dcgm/metrics", self._dcgm),
                web.get("/health", self._health),
                web.get("/v1/models", self._models),
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat),
                web.get("/control/state", self._state),
                web.post("/control/restart", self._control_restart),
                web.post("/control/metrics", self._control_metrics),
                web.post("/control/kv-events", self._control_kv_events),
                web.post("/control/workload", self._control_workload),
                web.post("/control/reset-prefix-cache", self._control_reset_cache),
            ]
        )
        return app

    # --- scraping ---------------------------------------------------------------------------

    async def _metrics(self, request: web.Request) -> web.Response:
        faults = self.config.faults
        if faults.metrics_delay_s:
            await asyncio.sleep(faults.metrics_delay_s)
        if faults.metrics_fail:
            return web.Response(status=500, text="Internal Server Error")
        body = generate_latest(self._registry)
        if faults.metrics_malformed:
            body = MALFORMED_LINE + body
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _dcgm(self, request: web.Request) -> web.Response:
        return web.Response(text=dcgm.render(self.runtime.gpus), content_type="text/plain")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        model = {
            "id": self.config.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": self.config.model_name,
            "max_model_len": self.config.engine.max_model_len,
        }
        adapters = [
            {**model, "id": name, "root": f"/adapters/{name}", "parent": self.config.model_name}
            for name in self.config.lora_adapters
        ]
        return web.json_response({"object": "list", "data": [model, *adapters]})

    # --- OpenAI-style API -------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.Response:
        body = await _json(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            token_ids = tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            token_ids = list(prompt)
        else:
            raise _bad_request("prompt must be a string or a list of token ids (one prompt per request)")
        done = await self._run(body, token_ids, request)
        choice = {
            "index": 0,
            "text": tokenizer.decode(done.output_token_ids),
            "logprobs": None,
            "finish_reason": done.finished_reason,
            "stop_reason": None,
        }
        if body.get("return_token_ids"):
            choice["token_ids"] = done.output_token_ids
            choice["prompt_token_ids"] = token_ids
        return web.json_response(self._envelope("cmpl", "text_completion", choice, done))

    async def _chat(self, request: web.Request) -> web.Response:
        body = await _json(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad_request("messages must be a non-empty list")
        done = await self._run(body, tokenizer.encode_chat(messages), request)
        message = {"role": "assistant", "content": tokenizer.decode(done.output_token_ids)}
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": done.finished_reason,
            "stop_reason": None,
        }
        return web.json_response(self._envelope("chatcmpl", "chat.completion", choice, done))

    async def _run(self, body: dict, token_ids: list[int], http: web.Request) -> Request:
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise _bad_request("max_tokens must be a positive integer")
        session_id = body.get("session_id") or http.headers.get("X-Session-ID")
        session = str(body.get("user") or session_id or "")
        model = body.get("model")
        xargs = body.get("vllm_xargs") if isinstance(body.get("vllm_xargs"), dict) else {}
        spec = RequestSpec(
            token_ids,
            max_tokens,
            session,
            lora_name=model if model in self.config.lora_adapters else None,
            session_id=None if session_id is None else str(session_id),
            report_full=xargs.get("kv_cache_report_mode") == "full",
        )
        try:
            return await self.runtime.generate(spec)
        except ValueError as exc:
            raise _bad_request(str(exc)) from exc
        except EngineRestarted as exc:
            raise web.HTTPServiceUnavailable(text=str(exc)) from exc

    def _envelope(self, prefix: str, kind: str, choice: dict, done: Request) -> dict:
        prompt_tokens, completion_tokens = len(done.prompt_token_ids), len(done.output_token_ids)
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.config.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens,
                "prompt_tokens_details": {"cached_tokens": max(done.num_cached_tokens, 0)},
            },
        }

    # --- control ----------------------------------------------------------------------------

    async def _state(self, request: web.Request) -> web.Response:
        rt = self.runtime
        return web.json_response(
            {
                "workload": rt.current_workload(),
                "instance": rt.instance,
                "created": rt.created,
                "faults": vars(self.config.faults),
                "kv_event_seq": [p.seq for p in rt.publishers],
                "engines": [
                    {
                        "running": len(e.running),
                        "waiting": len(e.waiting),
                        "kv_cache_usage": e.pool.usage,
                        "prefix_cache_queries": e.stats.prefix_cache_queries,
                        "prefix_cache_hits": e.stats.prefix_cache_hits,
                    }
                    for e in rt.engines
                ],
            }
        )

    async def _control_restart(self, request: web.Request) -> web.Response:
        await self.runtime.restart()
        return await self._state(request)

    async def _control_metrics(self, request: web.Request) -> web.Response:
        body, faults = await _json(request), self.config.faults
        faults.metrics_delay_s = float(body.get("delay_s", faults.metrics_delay_s))
        faults.metrics_fail = bool(body.get("fail", faults.metrics_fail))
        faults.metrics_malformed = bool(body.get("malformed", faults.metrics_malformed))
        return await self._state(request)

    async def _control_kv_events(self, request: web.Request) -> web.Response:
        body = await _json(request)
        self.config.faults.drop_kv_seq_every = int(body.get("drop_every", 0))
        for publisher in self.runtime.publishers:
            publisher.drop_every = self.config.faults.drop_kv_seq_every
        return await self._state(request)

    async def _control_workload(self, request: web.Request) -> web.Response:
        body = await _json(request)
        try:
            self.runtime.switch_workload(body.get("name"))
        except ValueError as exc:
            raise _bad_request(str(exc)) from exc
        return await self._state(request)

    async def _control_reset_cache(self, request: web.Request) -> web.Response:
        done = [engine.reset_prefix_cache() for engine in self.runtime.engines]
        for engine in self.runtime.engines:
            self.runtime._wakeups[engine.index].set()  # publish the AllBlocksCleared promptly
        return web.json_response({"reset": done})


@web.middleware
async def _loopback_only_control(request: web.Request, handler):
    if request.path.startswith("/control/") and not _is_loopback(request.remote):
        raise web.HTTPForbidden(text="control endpoints accept loopback peers only")
    return await handler(request)


def _is_loopback(peer: str | None) -> bool:
    try:
        return peer is not None and ipaddress.ip_address(peer).is_loopback
    except ValueError:
        return False


async def _json(request: web.Request) -> dict:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError as exc:
        raise _bad_request("body is not JSON") from exc
    if not isinstance(body, dict):
        raise _bad_request("body must be a JSON object")
    return body


def _bad_request(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=message)


async def start_simulator(config: SimulatorConfig) -> Simulator:
    return await Simulator(config).start()
