"""`kvcache-exporter simulate ...` (and `python -m kvcache_exporter.simulator ...`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal

from .config import Faults, SimulatorConfig
from .engine import EngineConfig
from .fleet import SimulatorFleet
from .latency import LatencyModel
from .layouts import LAYOUTS, layout_named
from .residency import DEFAULT_SAMPLE
from .server import Simulator
from .workloads import WorkloadFactory, parse_schedule, trace_lines


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "simulate", help="run a vLLM-compatible simulator (metrics, KV events, API)", description=__doc__
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--listen", default="127.0.0.1:8000", help="HOST:PORT to serve on (port 0: any free port)")
    add("--model-name", default="sim-llama", help="served model name (the model_name label)")
    add("--block-size", type=int, default=16, help="with --layout llama; hybrid layouts fix their own")
    add(
        "--layout",
        choices=tuple(LAYOUTS),
        default="llama",
        help="KV-cache groups: llama (one full-attention group), gemma-3 (5 sliding-window groups of "
        "window 64 + 1 full, block 32), gemma-2 (1 + 1), deepseek-v4 (6 groups, 256-token hit unit); "
        "see docs/simulator.md",
    )
    add("--num-gpu-blocks", type=int, default=2048, help="KV-cache blocks of each engine")
    add("--max-num-seqs", type=int, default=256, help="requests running at once, as vLLM's flag")
    add("--max-num-batched-tokens", type=int, default=8192, help="tokens per step, as vLLM's flag")
    add("--max-model-len", type=int, default=8192, help="longest request in tokens, as vLLM's flag")
    add("--no-prefix-caching", action="store_true", help="turn prefix caching off, as vLLM's flag")
    add(
        "--kv-cache-metrics",
        action="store_true",
        help="serve vLLM's sampled block residency histograms (vllm:kv_block_*_seconds)",
    )
    add("--kv-cache-metrics-sample", type=float, default=DEFAULT_SAMPLE, help="fraction of blocks sampled")
    add(
        "--engines",
        "--data-parallel-size",
        dest="engines",
        type=int,
        default=1,
        help="data-parallel ranks, each with its own pool, KV publisher (port + rank) and engine label",
    )
    add(
        "--api-server-count",
        type=int,
        default=1,
        help="above 1: /metrics as vLLM's multiprocess view (no _created samples)",
    )
    add("--lora-adapters", default="", help="comma list of LoRA adapter names served beside the model")
    add(
        "--offload-cpu-bytes",
        type=int,
        default=0,
        help="a CPU offload tier of this size (vLLM 0.33's OffloadingConnector: medium CPU events, "
        "vllm:kv_offload_* metrics); 0: none",
    )
    add("--session-ids", action="store_true", help="built-in traffic sends its session as session_id")
    add(
        "--kv-cache-report-mode",
        choices=("default", "full"),
        default="default",
        help="full: built-in requests have vLLM re-announce the blocks their prefix hits reused",
    )
    add("--replicas", type=int, default=1, help="replicas behind one gateway on --listen")
    add(
        "--routing",
        choices=("round-robin", "session"),
        default="round-robin",
        help="how the gateway (with --replicas) or the engines (with --engines) share requests",
    )
    add("--file-sd", help="with --replicas: write the replicas as a Prometheus file_sd JSON file here")
    add("--metrics-schema", choices=("v1", "v0"), default="v1", help="/metrics names: V1 or V0 vLLM")
    add(
        "--engine",
        choices=("vllm", "sglang"),
        default="vllm",
        help="whose /metrics to serve: vLLM's (--metrics-schema) or SGLang 0.5's names and label sets",
    )
    add(
        "--workload",
        "--schedule",
        dest="schedule",
        default="normalized",
        help="workloads over simulated time, e.g. normalized:60s,raw:60s,normalized "
        "(each one of raw|normalized|chat|templates|trace|none)",
    )
    add("--trace", dest="trace_path", help="trace.jsonl for the `trace` workload")
    add(
        "--tokenizer",
        dest="tokenizer_path",
        help="a model's tokenizer.json (or folder): raw/normalized headers as real text in it "
        "(`User [ID:48213] at 2026-...`), for serve --fields.tokenizer",
    )
    add("--rate", type=float, default=5.0, help="built-in requests per simulated second (Poisson)")
    add("--concurrency", type=int, default=32, help="most built-in requests in flight")
    add("--speed", type=float, default=1.0, help="simulated seconds per wall second")
    add("--seed", type=int, default=20251202, help="seed of the built-in workloads")
    add("--kv-events-endpoint", help="ZMQ PUB endpoint (binds on */::/ipc/inproc, else connects)")
    add("--kv-events-replay-endpoint", help="ZMQ ROUTER endpoint for replay")
    add("--kv-events-topic", default="kv", help="ZMQ topic of the KV events")
    add(
        "--kv-bytes-per-token", type=int, default=131072, help="for cache_config_info's kv_cache_memory_bytes"
    )
    add("--step-base-s", type=float, default=LatencyModel.base_s, help="seconds every engine step takes")
    add(
        "--step-prefill-token-s",
        type=float,
        default=LatencyModel.per_prefill_token_s,
        help="seconds a step adds per prefilled token",
    )
    add(
        "--step-decode-seq-s",
        type=float,
        default=LatencyModel.per_decode_seq_s,
        help="seconds a step adds per decoding request",
    )
    add("--memory-swing-period", type=float, default=0.0, help="seconds per 12 GB -> 20 GB GPU memory swing")
    add("--fault-metrics-delay", type=float, default=0.0, help="seconds to wait before answering /metrics")
    add("--fault-metrics-fail", action="store_true", help="answer /metrics with HTTP 500")
    add("--fault-metrics-malformed", action="store_true", help="prepend an unparsable line to /metrics")
    add("--fault-drop-kv-seq", type=int, default=0, metavar="N", help="skip a KV-event seq every N batches")
    add(
        "--write-trace",
        metavar="FILE",
        help="write the --workload schedule's requests to FILE as trace.jsonl (for `analyze`) and exit",
    )
    add("--trace-requests", type=int, default=160, metavar="N", help="with --write-trace: requests per phase")


def config_from_args(args: argparse.Namespace) -> SimulatorConfig:
    host, _, port = args.listen.rpartition(":")
    parse_schedule(args.schedule)  # fail early on a bad schedule
    layout = layout_named(args.layout)
    adapters = tuple(name for name in args.lora_adapters.split(",") if name)
    block_size = args.block_size if layout is None else layout.unit
    if args.offload_cpu_bytes and args.offload_cpu_bytes < block_size * args.kv_bytes_per_token:
        raise ValueError("--offload-cpu-bytes must hold at least one block")
    if len(set(adapters)) != len(adapters) or args.model_name in adapters:
        raise ValueError("--lora-adapters: names must be distinct and differ from --model-name")
    return SimulatorConfig(
        host=host.strip("[]") or "127.0.0.1",
        port=int(port),
        model_name=args.model_name,
        engine=EngineConfig(
            block_size=block_size,
            layout=args.layout,
            offload_cpu_blocks=args.offload_cpu_bytes // (block_size * args.kv_bytes_per_token),
            offload_block_bytes=block_size * args.kv_bytes_per_token,
            num_gpu_blocks=args.num_gpu_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            enable_prefix_caching=not args.no_prefix_caching,
            kv_cache_metrics_sample=args.kv_cache_metrics_sample if args.kv_cache_metrics else 0.0,
            latency=LatencyModel(args.step_base_s, args.step_prefill_token_s, args.step_decode_seq_s),
        ),
        engines=args.engines,
        routing=args.routing,
        metrics_schema="sglang" if args.engine == "sglang" else args.metrics_schema,
        schedule=args.schedule,
        rate=args.rate,
        concurrency=args.concurrency,
        speed=args.speed,
        seed=args.seed,
        trace_path=args.trace_path,
        tokenizer_path=args.tokenizer_path,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_topic=args.kv_events_topic,
        kv_bytes_per_token=args.kv_bytes_per_token,
        memory_swing_period_s=args.memory_swing_period,
        api_server_count=args.api_server_count,
        lora_adapters=adapters,
        session_ids=args.session_ids,
        kv_cache_report_mode=args.kv_cache_report_mode,
        faults=Faults(
            args.fault_metrics_delay,
            args.fault_metrics_fail,
            args.fault_metrics_malformed,
            args.fault_drop_kv_seq,
        ),
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"simulate: {exc}")
        return 2
    if args.write_trace:
        return _write_trace(args)
    if args.replicas > 1:
        asyncio.run(_serve(SimulatorFleet(config, args.replicas, args.routing, args.file_sd)))
    else:
        asyncio.run(_serve(Simulator(config)))
    return 0


def _write_trace(args: argparse.Namespace) -> int:
    factory = WorkloadFactory(args.seed, trace_path=args.trace_path)
    count = 0
    with open(args.write_trace, "w", encoding="utf-8") as out:
        for line in trace_lines(factory, args.schedule, max(args.trace_requests, 0)):
            out.write(json.dumps(line, separators=(",", ":")) + "\n")
            count += 1
    print(f"simulate: wrote {count} requests ({args.schedule}) to {args.write_trace}")
    return 0


async def _serve(simulator: Simulator | SimulatorFleet) -> None:
    await simulator.start()
    print(f"simulator serving {simulator.config.model_name} on {simulator.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await simulator.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcache_exporter.simulator")
    add_arguments(parser)
    return run(parser.parse_args(argv))
