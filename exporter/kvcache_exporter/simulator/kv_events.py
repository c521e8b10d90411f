"""KV-cache events on ZMQ in vLLM's wire format (`vllm/distributed/kv_events.py`, ZmqEventPublisher)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from .blocks import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def event_to_wire(event: KVEvent) -> dict[str, Any]:
    """The map vLLM 0.32 sends for each event: tag key `type`, fields in declaration order, and (msgspec's
    omit_defaults) the defaulted fields left out when None: `extra_keys` of an event without hashes or
    of an offload tier's (vLLM 0.33 sends none), `kv_cache_spec_kind` of a tier's placeholder,
    `kv_cache_spec_sliding_window` of a group without a window, `session_id` of a request without one."""
    if isinstance(event, BlockStored):
        origin = event.origin
        wire = {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": origin.lora_id,
            "medium": event.medium,
            "lora_name": origin.lora_name,
        }
        if event.block_hashes and event.medium == "GPU":
            wire["extra_keys"] = [origin.extra_key()] * len(event.block_hashes)
        wire["group_idx"] = event.group_idx
        if event.kv_cache_spec_kind is not None:
            wire["kv_cache_spec_kind"] = event.kv_cache_spec_kind
        if event.sliding_window is not None:
            wire["kv_cache_spec_sliding_window"] = event.sliding_window
        if origin.session_id is not None:
            wire["session_id"] = origin.session_id
        return wire
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": event.block_hashes,
            "medium": event.medium,
            "group_idx": event.group_idx,
        }
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(events: list[KVEvent], data_parallel_rank: int, ts: float | None = None) -> bytes:
    ts = time.time() if ts is None else ts
    return msgspec.msgpack.encode([ts, [event_to_wire(e) for e in events], data_parallel_rank])


def should_bind(endpoint: str) -> bool:
    """vLLM binds for wildcard hosts and ipc/inproc, and connects to a concrete tcp address."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint(endpoint: str, rank: int) -> str:
    """Data-parallel ranks get their own endpoint: tcp port + rank, inproc/ipc name + `_dp<rank>`."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class KVEventPublisher:
    """PUB socket (+ optional replay ROUTER) for one engine; `publish` is cheap and never blocks."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        rank: int,
        buffer_steps: int = 10000,
        hwm: int = 100000,
        encode: Callable[[list[KVEvent], int], bytes] = encode_batch,  # SglangWire().encode_batch
    ) -> None:
        self.rank = rank
        self.encode = encode
        self.topic = topic.encode()
        self.seq = 0
        self.drop_every = 0
        self._batches_since_drop = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._pub = context.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        endpoint = offset_endpoint(endpoint, rank)
        if should_bind(endpoint):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._router = None
        self._replay_task = None
        if replay_endpoint:
            self._router = context.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(offset_endpoint(replay_endpoint, rank))
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    @property
    def endpoints(self) -> tuple[str, str | None]:
        """The live and replay endpoints as bound or connected (resolves `*` ports)."""
        live = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        replay = self._router.getsockopt(zmq.LAST_ENDPOINT).decode() if self._router else None
        return live, replay

    async def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        payload = self.encode(events, self.rank)
        seq_bytes = self.seq.to_bytes(8, "big")
        self._buffer.append((self.seq, payload))
        self.seq += 1
        if self._drop_this_one():
            return  # lost on the wire like a high-water-mark overflow; replay can still serve it
        with contextlib.suppress(zmq.Again):
            await self._pub.send_multipart((self.topic, seq_bytes, payload), flags=zmq.NOBLOCK)

    def _drop_this_one(self) -> bool:
        if not self.drop_every:
            return False
        self._batches_since_drop += 1
        if self._batches_since_drop < self.drop_every:
            return False
        self._batches_since_drop = 0
        return True

    async def _serve_replay(self) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart()
            identity, start = frames[0], frames[-1]
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._router.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
            await self._router.send_multipart((identity, b"", END_OF_REPLAY, b""))

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._router.close(linger=0)
        self._pub.close(linger=0)
