"""TensorRT-LLM's streaming KV events (PyTorch backend, KVCacheManagerV2) decoded and attributed.

TensorRT-LLM does not run here (it needs an NVIDIA GPU and its CUDA wheels), so the streams are built
with its published wire schema, `tensorrt_llm/_torch/pyexecutor/kv_cache_events.py`: the structs below
restate its field names, order and msgspec options (tagged maps, omit_defaults; the batch a positional
array whose rank is left out when unset), and the frames are its publisher's
(`[topic, seq (8 bytes big-endian), payload]`). Its `_StreamingEventSource` sets `medium="GPU"`,
`lora_name=None`, the manager's block size, and `mm_keys` only with multimodal decoding on."""

from __future__ import annotations

from typing import Any

import msgspec

from kvcache_exporter.derive.attribution import Attribution
from kvcache_exporter.derive.kv_events import EventState
from kvcache_exporter.derive.miss_windows import MissHistory
from kvcache_exporter.derive.state import KvEventsState
from kvcache_exporter.derive.units import UnitView
from kvcache_exporter.sources.engine_events import decode_engine_message
from kvcache_exporter.sources.kv_events_decode import KvEventDrain


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class WireEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MultimodalKey(msgspec.Struct, omit_defaults=True, gc=False, tag="mm_key"):
    hash: str
    start_offset: int
    uuid: str | None = None


class BlockStored(WireEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int | str]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    mm_keys: list[list[MultimodalKey]] | None = None


class BlockRemoved(WireEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(WireEvent):
    pass


BS = 32  # tokens_per_block
_encoder = msgspec.msgpack.Encoder()


class Publisher:
    """TensorRT-LLM's ZmqEventPublisher without the socket: its frames, seq from 0."""

    def __init__(self, rank: int | None = None):
        self.seq, self.rank = 0, rank

    def frames(self, *events) -> list[bytes]:
        payload = _encoder.encode(EventBatch(1.0, list(events), self.rank))
        self.seq += 1
        return [b"", (self.seq - 1).to_bytes(8, "big"), payload]


def chain(tokens: list[int], parent: int | None = None) -> list[int]:
    hashes = []
    for i in range(len(tokens) // BS):
        parent = hash((parent, tuple(tokens[i * BS : (i + 1) * BS]))) & (2**63 - 1)
        hashes.append(parent)
    return hashes


def store(tokens: list[int], **fields) -> BlockStored:
    return BlockStored(chain(tokens), None, tokens, BS, None, "GPU", None, **fields)


def fold(messages) -> KvEventsState:
    state = KvEventsState(EventState(), {}, Attribution(), MissHistory(1e9), UnitView())
    for frames in messages:
        state.ingest(KvEventDrain((decode_engine_message(frames, True, "trtllm"),)), 1.0)
    return state


def test_a_trtllm_stream_is_decoded_and_attributed():
    pub = Publisher()
    system, other = list(range(1000, 1128)), list(range(5000, 5064))
    a = store(system + other)
    messages = [
        pub.frames(AllBlocksCleared()),
        pub.frames(a),
        pub.frames(BlockRemoved(a.block_hashes[-2:], "GPU")),  # evicted under pressure
        pub.frames(BlockStored(a.block_hashes[-2:], a.block_hashes[-3], other, BS, None, "GPU", None)),
        pub.frames(AllBlocksCleared()),  # a cache reset
        pub.frames(a),
    ]
    first = decode_engine_message(messages[1], True, "trtllm")
    assert first.dp_rank is None and not first.refused  # the rank left out, as omit_defaults sends it
    (event,) = first.events
    assert (len(event.block_hashes), event.block_size, event.medium) == (6, BS, "GPU")
    totals = fold(messages).attribution.totals
    assert totals.tokens["evicted"] == 64
    assert totals.tokens["restart"] == 192
    assert totals.prompt_miss_tokens == 192 + 64 + 192


def test_multimodal_keys_and_string_token_ids_decode():
    """mm_keys (one list per block) and string token ids (multimodal placeholders, `EventTokenId`)
    are read without error; the event's hashes count, its content reads as none."""
    tokens: list[int | str] = [*range(100, 100 + BS), *(["img"] * BS)]
    keys = [[], [MultimodalKey("ab" * 16, 0, "u-1")]]
    mm = BlockStored(chain(list(range(2 * BS))), None, tokens, BS, None, "GPU", None, mm_keys=keys)
    got = decode_engine_message(Publisher(rank=0).frames(mm), True, "trtllm")
    assert not got.refused and got.dp_rank == 0
    (event,) = got.events
    assert len(event.block_hashes) == 2 and event.token_count == 2 * BS
    assert fold([Publisher().frames(mm)]).attribution.totals.prompt_miss_tokens == 2 * BS


def test_a_medium_other_than_gpu_is_refused_alone():
    pub = Publisher()
    message = pub.frames(store(list(range(BS))), BlockRemoved([1], "CPU"), store(list(range(9, 9 + BS))))
    got = decode_engine_message(message, True, "trtllm")
    assert got.refused == ("invalid_event",) and len(got.events) == 2
