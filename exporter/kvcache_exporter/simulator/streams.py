"""KV-event streams of a deployment shape without a server: the ZMQ messages one engine publishes while
serving the deployment captures' traffic (shared prefix + question, exact repeats, a header before the
prefix, unrelated prompts), for benchmarks and tests; and one engine stepped until idle, its batches
as the sidecar decodes them (the analyzer's live view and the simulated accuracy backend)."""

from __future__ import annotations

import random

from ..sources.kv_events_decode import Batch, decode_message
from .blocks import Origin
from .engine import Engine, EngineConfig, Request
from .kv_events import encode_batch
from .layouts import layout_named
from .sglang_events import SglangWire


def shape_frames(
    layout: str = "llama",
    requests: int = 200,
    num_gpu_blocks: int = 64,
    lora_adapters: tuple[str, ...] = (),
    seed: int = 20251206,
    offload_cpu_blocks: int = 0,
    engines: list[Engine] | None = None,
    engine_kind: str = "vllm",
) -> list[list[bytes]]:
    """[topic, seq, payload] per published batch; requests rotate over the base model and the adapters;
    with offload_cpu_blocks, a CPU tier adds its medium "CPU" events. `engines` receives the engine (its
    stats say what vLLM computed). `engine_kind` "sglang": the same traffic in SGLang's wire shape."""
    shape = layout_named(layout)
    block_size = 16 if shape is None else shape.unit
    config = EngineConfig(
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        layout=layout,
        max_model_len=1 << 16,
        offload_cpu_blocks=offload_cpu_blocks,
        offload_block_bytes=block_size * 131072,
    )
    engine, rng = Engine(config), random.Random(seed)
    encode = SglangWire().encode_batch if engine_kind == "sglang" else encode_batch
    if engines is not None:
        engines.append(engine)
    system = [rng.randrange(5, 500) for _ in range(4 * config.block_size + 44)]
    adapters = (None, *lora_adapters)
    sent: list[list[int]] = []
    frames: list[list[bytes]] = []
    now = 0.0
    for i in range(requests):
        kind = i % 4
        if kind == 1 and sent:
            prompt = rng.choice(sent)
        elif kind == 2:
            prompt = [rng.randrange(5, 500) for _ in range(rng.randrange(3, 12))] + system
        elif kind == 3:
            prompt = [rng.randrange(5, 500) for _ in range(rng.randrange(60, 60 + 3 * config.block_size))]
        else:
            prompt = system + [rng.randrange(5, 500) for _ in range(rng.randrange(5, 40))]
        sent.append(prompt)
        name = adapters[i % len(adapters)]
        origin = Origin(None if name is None else adapters.index(name), name, f"sess-{i % 7}")
        engine.add_request(Request(f"r{i}", prompt, 8, now, origin=origin))
        while engine.has_work:
            result = engine.step(now)
            now += result.duration
            if result.events:
                payload = encode(result.events, 0, ts=now)
                frames.append([b"kv", len(frames).to_bytes(8, "big"), payload])
    return frames


def step_batches(engine: Engine, clock: float, seq: int, index: int = 0) -> tuple[list[Batch], float, int]:
    """Step `engine` from `clock` until it is idle; each step's events go through vLLM's wire (a ZMQ
    message with the next sequence number, data-parallel rank `index`) and the sidecar's decoder,
    with the tokens. Returns the batches, the clock after the last step and the next seq."""
    batches = []
    while engine.has_work:
        step = engine.step(clock)
        clock += step.duration
        if step.events:  # vLLM publishes nothing for a step without events
            frames = [b"kv", seq.to_bytes(8, "big"), encode_batch(step.events, index, clock)]
            batches.append(decode_message(frames, with_tokens=True))
            seq += 1
    return batches, clock, seq
