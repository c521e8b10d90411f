"""One decoder for the simulator's frames and vLLM's real frames finds the same structure."""

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvcache_exporter.simulator.blocks import AllBlocksCleared, BlockRemoved, BlockStored
from kvcache_exporter.simulator.kv_events import KVEventPublisher, offset_endpoint, should_bind


def decode(frames: list[bytes]) -> tuple[int, dict[str, dict[str, type]]]:
    """-> (seq, {event type: {key: value type}}) for one multipart message."""
    _topic, seq, payload = frames
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert isinstance(ts, float) and isinstance(rank, int) and len(seq) == 8
    structure: dict[str, dict[str, type]] = {}
    for event in events:
        structure.setdefault(event["type"], {}).update(
            {k: type(v) for k, v in event.items() if v is not None}
        )
    return int.from_bytes(seq, "big"), structure


def merged(messages: list[list[bytes]]) -> dict[str, dict[str, type]]:
    out: dict[str, dict[str, type]] = {}
    for frames in messages:
        for kind, keys in decode(frames)[1].items():
            out.setdefault(kind, {}).update(keys)
    return out


def test_bind_or_connect_like_vllm():
    assert should_bind("tcp://*:5557") and should_bind("ipc:///tmp/x") and should_bind("tcp://[::]:1")
    assert not should_bind("tcp://127.0.0.1:5557")
    assert offset_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"


@pytest.mark.timeout(20)
def test_simulator_frames_have_the_real_structure_and_replay_works(seed_kv_frames):
    real = merged(seed_kv_frames)

    async def scenario():
        ctx = zmq.asyncio.Context()
        publisher = KVEventPublisher(ctx, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "kv", 0)
        live, replay_endpoint = publisher.endpoints
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(live)
        await asyncio.sleep(0.3)  # let the connect settle (PUB drops before that)
        stored = BlockStored([1, 2], None, list(range(64)), 32)
        chained = BlockStored([4], 2, list(range(32)), 32)
        await publisher.publish([stored, chained, BlockRemoved([3])])
        await publisher.publish([AllBlocksCleared()])
        got = [await asyncio.wait_for(sub.recv_multipart(), 5) for _ in range(2)]
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay_endpoint)
        await dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed = [await asyncio.wait_for(dealer.recv_multipart(), 5) for _ in range(2)]
        dealer.close(0)
        sub.close(0)
        await publisher.close()
        ctx.term()
        return got, replayed

    got, replayed = asyncio.run(scenario())
    assert [decode(f)[0] for f in got] == [0, 1]
    ours = merged(got)
    for kind in ("BlockStored", "BlockRemoved"):
        assert ours[kind] == real[kind], kind
    assert ours["AllBlocksCleared"] == {"type": str}
    assert int.from_bytes(replayed[0][1], "big") == 1
    assert replayed[1][1:] == [(-1).to_bytes(8, "big", signed=True), b""]
