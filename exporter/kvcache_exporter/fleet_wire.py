"""The fleet view's wire format on NATS JetStream (docs/fleet.md, "On NATS"). Pure, no I/O.

A sidecar (`serve --fleet.publish`) sends two kinds of message, msgpack of the structs below:

* `Delta`: what one KV-event batch changed in one hash range of one replica's cache. Subject
  `<prefix>.<pool>.d.<b5>.<b4>.<b3>.<b2>.<b1>.<b0>.<replica>`: the range's 6 bits, most significant
  first, so a block of ranges is one subject filter (`<prefix>.<pool>.d.<its bits>.>`): shard K of N
  reads one filter when N is a power of two, a few otherwise (one filter per consumer is all
  nats-server 2.9, Debian's, has).
* `Counters`: the replica's prefix-cache counters and block size, subject `<prefix>.<pool>.c.<replica>`.

The ranges are HashRange(sampling, r, 64) of the aggregator (fleet_residency.py) to the hash: shard
K/N reads exactly the hashes its HashRange keeps, so shards sum to one aggregator exactly.

Order and loss: every (replica, engine, range) numbers its deltas 0, 1, 2... within an `epoch`, a
number that grows whenever the sidecar's view of the cache starts empty (the sidecar started, vLLM
restarted, vLLM cleared its cache: `cause`). A consumer that sees a new epoch forgets the replica's
blocks; a gap in `seq` is deltas lost (the sidecar's buffer was full while NATS was down); a seq or
epoch already seen is a redelivery or a replay, dropped.

Engines: a delta's `kind` names the replica's engine (vllm, sglang, trtllm), so a shard keys each
engine's hashes apart (fleet_residency.py: two engines' hashes are never one block). A delta from
before the field reads as vLLM's (sidecars then published vLLM only); an unknown engine is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec

from .aggregator.fleet_residency import MASK, SPACE, hash_position
from .derive.cache_config import config_number
from .sources.engine_events import ENGINES
from .sources.vllm_snapshot import EngineSample, VllmSnapshot

VERSION = 1
RANGE_BITS = 6
RANGES = 1 << RANGE_BITS
MAX_DELTA_BYTES = 1 << 20  # a batch's 65,536 hashes at most (decode's bound): ~600 KiB of msgpack
MAX_COUNTERS_BYTES = 4096
MAX_HASHES_PER_DELTA = 1 << 16
MAX_CHANGES_PER_DELTA = 1 << 16
CAUSES = ("start", "restart", "cleared")  # why an epoch began

# Names go into subjects: one token each, no wildcard, no dot, bounded.
SubjectToken = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
BlockHash = int | Annotated[bytes, msgspec.Meta(max_length=64)]
Text = Annotated[str, msgspec.Meta(max_length=256)]
Count = Annotated[float, msgspec.Meta(ge=0)]


class Change(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """Blocks stored (or removed) in one KV-cache group; `adapter` is the LoRA the blocks belong to
    (the cache salt is inside vLLM's hash already), `session` the request's session id, if any."""

    stored: bool
    hashes: Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_HASHES_PER_DELTA)]
    group: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] | None = None
    adapter: Text | None = None
    session: Text | None = None


class Delta(msgspec.Struct, array_like=True, gc=False, frozen=True):
    version: int
    pool: SubjectToken
    replica: SubjectToken
    engine: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]
    range: Annotated[int, msgspec.Meta(ge=0, lt=RANGES)]
    epoch: Annotated[int, msgspec.Meta(ge=0)]
    cause: Annotated[int, msgspec.Meta(ge=0, lt=len(CAUSES))]
    seq: Annotated[int, msgspec.Meta(ge=0)]
    sampling: Annotated[float, msgspec.Meta(gt=0, le=1)]
    ts: float
    changes: Annotated[list[Change], msgspec.Meta(max_length=MAX_CHANGES_PER_DELTA)]
    kind: Annotated[str, msgspec.Meta(max_length=16)] = "vllm"  # the engine; absent before it was sent


class Counters(msgspec.Struct, array_like=True, gc=False, frozen=True):
    version: int
    pool: SubjectToken
    replica: SubjectToken
    ts: float
    query_tokens: Count
    hit_tokens: Count
    block_size: Annotated[int, msgspec.Meta(gt=0, le=1 << 20)] | None = None
    start_time: float | None = None


class WireError(ValueError):
    """A message that is no delta of this pool: `reason` is the dropped counter's label."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


_encoder = msgspec.msgpack.Encoder()
_delta = msgspec.msgpack.Decoder(Delta)
_counters = msgspec.msgpack.Decoder(Counters)


def encode(message: Delta | Counters) -> bytes:
    return _encoder.encode(message)


def encode_delta(
    pool: str,
    replica: str,
    engine: int,
    r: int,
    epoch: int,
    cause: int,
    seq: int,
    sampling: float,
    ts: float,
    changes: list[tuple[bool, list, int | None, str | None, str | None]],
    kind: str = "vllm",
) -> bytes:
    """encode(Delta(VERSION, pool, ..., [Change(*c) for c in changes])) without building the
    structs: both are array-like, so tuples in their field order are the same bytes (tested); the
    sidecar's per-block path makes one small tuple per change instead of a struct."""
    return _encoder.encode(
        (VERSION, pool, replica, engine, r, epoch, cause, seq, sampling, ts, changes, kind)
    )


def kept_space(sampling: float) -> int:
    """The part of the 64-bit hash space a sampling keeps, as HashRange computes it."""
    return int(sampling * SPACE)


def range_of(position: int, kept: int) -> int | None:
    """The range holding a hash position: the r with kept*r//RANGES <= position < kept*(r+1)//RANGES
    (HashRange's bounds); None outside the sample."""
    if position >= kept:
        return None
    return ((position + 1) * RANGES + kept - 1) // kept - 1


def split(hashes: Sequence[int | bytes], kept: int) -> dict[int, list[int | bytes]]:
    """Hashes by range, in order; those outside the sample dropped (sampling before publishing)."""
    out: dict[int, list[int | bytes]] = {}
    if kept == SPACE:  # unsampled int hashes, the common case: the range is the top 6 bits
        try:
            for block_hash in hashes:
                out.setdefault((block_hash & MASK) >> (64 - RANGE_BITS), []).append(block_hash)
            return out
        except TypeError:  # bytes hashes (or a mix): the general way below
            out = {}
    for block_hash in hashes:
        r = range_of(hash_position(block_hash), kept)
        if r is not None:
            out.setdefault(r, []).append(block_hash)
    return out


def range_bits(r: int, bits: int = RANGE_BITS) -> str:
    """The top `bits` of range r's 6 bits as subject tokens, most significant first: 5 -> "0.0.0.1.0.1"."""
    return ".".join(str((r >> (RANGE_BITS - 1 - i)) & 1) for i in range(bits))


RANGE_TOKENS = tuple(range_bits(r) for r in range(RANGES))  # computed once: a subject per delta


def delta_subject(prefix: str, pool: str, r: int, replica: str) -> str:
    return f"{prefix}.{pool}.d.{RANGE_TOKENS[r]}.{replica}"


def counters_subject(prefix: str, pool: str, replica: str) -> str:
    return f"{prefix}.{pool}.c.{replica}"


def subject_filters(prefix: str, pool: str, bounds: tuple[int, int], sampling: float) -> list[str]:
    """The subject filters of the deltas whose ranges meet the hash bounds [lo, hi) of a shard: its
    ranges as aligned blocks, one filter each (one for N a power of two; a range another shard
    shares is read by both, each keeping its own hashes)."""
    kept = kept_space(sampling)
    lo, hi = bounds
    first, last = range_of(lo, kept), range_of(min(hi, kept) - 1, kept)
    if first is None or last is None or hi <= lo:
        return []
    out = []
    while first <= last:
        bits = RANGE_BITS
        while bits > 0:  # the largest aligned block starting at `first` that fits
            size = 1 << (RANGE_BITS - bits + 1)
            if first % size or first + size - 1 > last:
                break
            bits -= 1
        head = range_bits(first, bits)
        out.append(".".join(p for p in (prefix, pool, "d", head, ">") if p))
        first += 1 << (RANGE_BITS - bits)
    return out


def ranges_within(bounds: tuple[int, int], sampling: float) -> frozenset[int]:
    """The ranges wholly inside the hash bounds [lo, hi): a shard keeps all their hashes."""
    kept = kept_space(sampling)
    lo, hi = bounds
    return frozenset(r for r in range(RANGES) if lo <= kept * r // RANGES and kept * (r + 1) // RANGES <= hi)


def stream_name(prefix: str, pool: str) -> str:
    return f"{prefix}-{pool}".replace(".", "-")


def decode_delta(data: bytes, subject: str, prefix: str, pool: str) -> Delta:
    """A delta checked against its subject: the pool, range and replica it names must be the ones
    the subject names (a sidecar's permissions scope its subjects, not the bytes it sends)."""
    delta = _decode(_delta, MAX_DELTA_BYTES, data)
    if delta.pool != pool or subject != delta_subject(prefix, pool, delta.range, delta.replica):
        raise WireError("forged", "delta's pool, range or replica differs from its subject's")
    if delta.kind not in ENGINES:
        raise WireError(
            "unknown_engine", f"delta of engine {delta.kind[:16]!r}, not one of {', '.join(ENGINES)}"
        )
    return delta


def decode_counters(data: bytes, subject: str, prefix: str, pool: str) -> Counters:
    counters = _decode(_counters, MAX_COUNTERS_BYTES, data)
    if counters.pool != pool or subject != counters_subject(prefix, pool, counters.replica):
        raise WireError("forged", "counters' pool or replica differs from its subject's")
    return counters


def _decode(decoder: msgspec.msgpack.Decoder, limit: int, data: bytes):
    """One message of the decoder's type, bounded and of this VERSION, or WireError."""
    kind = decoder.type.__name__.lower()
    if len(data) > limit:
        raise WireError("too_large", f"{kind} of {len(data)} bytes, over {limit}")
    try:
        message = decoder.decode(data)
    except (msgspec.DecodeError, RecursionError, ValueError, TypeError, OverflowError) as err:
        raise WireError("parse_error", f"{kind}: {err}") from err
    if message.version != VERSION:
        raise WireError("parse_error", f"{kind} version {message.version}, expected {VERSION}")
    return message


# --- a replica's prefix-cache counters, as the aggregator reads them from /metrics -------------

VLLM_COUNTERS = ("query_tokens", "hit_tokens")


def replica_counters(snapshot: VllmSnapshot) -> EngineSample:
    """A replica's prefix-cache counters summed over its engines (start_time: the earliest engine's)."""
    counters = {name: 0.0 for name in VLLM_COUNTERS}
    starts = []
    for sample in snapshot.engines.values():
        for name in VLLM_COUNTERS:
            counters[name] += sample.counters.get(name, 0.0)
        if sample.start_time is not None:
            starts.append(sample.start_time)
    return EngineSample(counters=counters, start_time=min(starts) if starts else None)


def block_size(snapshot: VllmSnapshot) -> int | None:
    """The replica's block size (every engine of one vLLM shares it); None if not exposed."""
    sizes = {config_number(c, "block_size") for c in snapshot.cache_configs.values()} - {None}
    size = min(sizes) if sizes else None
    return int(size) if size and size > 0 else None
