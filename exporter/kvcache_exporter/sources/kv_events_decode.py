"""The pure half of the KV-event source (no I/O): decoding vLLM's messages into batches.

The state they feed (counters, resident blocks) is derive/kv_events.py's EventState.

Wire format (`vllm/distributed/kv_events.py`):
A live message is `[topic, seq, payload]` (or `[seq, payload]`): `seq` is an 8-byte big-endian
counter (24 bytes with the snapshot extension: seq + publisher id), `payload` is msgpack of a
`KVEventBatch`. vLLM changed the encoding over time, so both forms are accepted:

* batch: array `[ts, events, data_parallel_rank?]` or a map with those keys;
* event: a map tagged by `type` (vLLM 0.32) or an array whose first element is the tag
  (`array_like=True`, older vLLM); `block_hashes` is the second element in both array forms.

Unknown extra fields and event types are ignored; block hashes are ints (default) or bytes. The
common vLLM 0.32 shape goes through one typed msgspec decoder that skips `token_ids` (about 10x
faster than decoding everything); any other shape is decoded event by event, still typed.

Hostile input is bounded: no untyped decode ever runs (a message of 15M empty arrays costs one
failed type check, not 1 GiB), nesting deeper than the interpreter's recursion limit is a parse
error, and every list has a maximum length checked from its header before any element is read.
Valid but heavy batches are bounded too (see "Heavy batches" below): bytes before decoding, hashes
and token ids per batch after it, both `batch_too_heavy`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar, NamedTuple

import msgspec

from .base import SourceError

KNOWN_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
DROP_REASONS = ("rate_limited", "too_many_blocks", "parse_error", "batch_too_heavy", "budget_exceeded")
# Single events refused while the rest of their batch is kept (counted with the drops, as events):
# a field outside its type or bounds, or a block size the event's own content contradicts.
REFUSAL_REASONS = ("invalid_event", "invalid_block_size")
_WITH_HASHES = {"BlockStored", "BlockRemoved"}
_SEQ_SIZES = (8, 24)

MAX_EVENTS_PER_BATCH = 65_536
MAX_HASHES_PER_EVENT = 65_536
MAX_HASH_BYTES = 64  # vLLM's hashes are 64-bit ints or 32-byte sha256 digests
# A forward jump larger than this is counted as a new publisher (view reset, restarts + 1), not as
# lost batches: 6.5x vLLM's replay buffer (10,000 batches), ~11 minutes of steps at 100 a second.
# One buggy publisher's jump then counts at most 65,536 missed batches, never 2^32; and after a real
# loss that long the view is stale anyway, so resetting it is what a restart does too.
MAX_SEQ_GAP = 1 << 16

# Heavy batches. vLLM publishes one batch per scheduler step: the blocks it filled in that step.
# Real batches hold tens of hashes (the captured ones: at most 37 hashes, 768 token ids, 4 KiB;
# a DeepSeek-V4 256-token unit is 6 events, 25 hashes); a saturated H200 stores ~15k blocks a
# second in all. A step stores at most max_num_batched_tokens of new tokens, or one long prompt
# loaded by a KV connector (128k tokens = 8,192 blocks of 16, ~0.8 MiB). The bounds sit 5-8x
# above that, and cap the work of one batch at ~0.2 s of attribution and ~50 MiB of decoded lists.
MAX_BATCH_BYTES = 4 * 1024 * 1024  # before decoding; a block costs ~60-100 bytes with its token ids
MAX_HASHES_PER_BATCH = 65_536  # one event's bound: 1M tokens of 16-token blocks
MAX_TOKENS_PER_BATCH = 1 << 20
# A block size is a count of tokens every counter multiplies by: vLLM's are 1-256 on attention groups
# and up to a few thousand on hybrid (Mamba-aligned) ones. Past this bound, or above the token ids the
# event carries (each stored block's ids are in it; windowed groups send more, never fewer), or with
# its blocks over one batch's token bound, the event is refused: one such event would otherwise add
# 2^64 tokens to counters that can never come back.
MAX_BLOCK_SIZE = 1 << 16

BlockHash = int | Annotated[bytes, msgspec.Meta(max_length=MAX_HASH_BYTES)]
Hashes = Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_HASHES_PER_EVENT)]


class _Stored(msgspec.Struct, tag_field="type", tag="BlockStored", gc=False):
    block_hashes: Hashes
    session_id: Annotated[str, msgspec.Meta(max_length=256)] | None = None  # the fleet's sessions


class _Removed(msgspec.Struct, tag_field="type", tag="BlockRemoved", gc=False):
    block_hashes: Hashes


class _Cleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", gc=False):
    pass


class _ArrayStored(msgspec.Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: Hashes


class _ArrayRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: Hashes


class _ArrayCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


MAX_TOKENS_PER_EVENT = 1 << 22
Tokens = Annotated[list[int], msgspec.Meta(max_length=MAX_TOKENS_PER_EVENT)]
BlockSize = Annotated[int, msgspec.Meta(ge=0)]


# With tokens (for miss attribution) the decoded structs are the events themselves: they have
# Event's attributes (`type` as a class attribute), so no per-event Python copy is made.
Name = Annotated[str, msgspec.Meta(max_length=256)]
GroupIndex = Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]


_tokens = msgspec.msgpack.Decoder(Tokens)
_BAD_SIZE = "block_size out of bounds"
_NO_TOKENS = msgspec.Raw(msgspec.msgpack.encode([]))


class _LazyTokens:
    """`token_ids` decoded when read: a hybrid's windowed groups repeat the step's token ids in every
    group (6 copies on DeepSeek-V4) and only the anchor's are read. Still bounded (MAX_TOKENS_PER_EVENT);
    a list that is not token ids reads as empty."""

    __slots__ = ()

    def __post_init__(self) -> None:
        """The block size checked against the event itself (MAX_BLOCK_SIZE): raising here refuses
        the event as invalid_block_size (the batch is then decoded event by event)."""
        size = self.block_size  # type: ignore[attr-defined]
        if size:
            held = size * len(self.block_hashes)  # type: ignore[attr-defined]
            # a token id takes 1 to 9 bytes: past 9 x held bytes the ids are surely enough (a windowed
            # group's, the common case), and only a closer call reads the count from the header
            if (
                size > MAX_BLOCK_SIZE
                or held > MAX_TOKENS_PER_BATCH
                or (
                    9 * held + 5 > len(self.raw_tokens)  # type: ignore[attr-defined]
                    and 0 < self.token_count < held
                )
            ):
                raise ValueError(f"{_BAD_SIZE}: {size} x {held // size} blocks, {self.token_count} token ids")

    @property
    def token_count(self) -> int:
        """How many token ids the list holds, from its msgpack header (no decoding)."""
        raw = memoryview(self.raw_tokens)  # type: ignore[attr-defined]
        if not raw.nbytes:
            return 0
        head = raw[0]
        if head == 0xDC:  # array16: most prompts' ids
            return raw[1] << 8 | raw[2] if raw.nbytes > 2 else 0
        if 0x90 <= head <= 0x9F:
            return head & 0x0F
        if head == 0xDD:
            return int.from_bytes(raw[1:5], "big") if raw.nbytes > 4 else 0
        return 0

    @property
    def token_ids(self) -> list[int]:
        try:
            return _tokens.decode(self.raw_tokens)  # type: ignore[attr-defined]
        except _DECODE_ERRORS:
            return []


class StoredWithTokens(_LazyTokens, msgspec.Struct, tag_field="type", tag="BlockStored", gc=False):
    """A BlockStored with what miss attribution and the group model (derive/units.py) read."""

    type: ClassVar[str] = "BlockStored"
    block_hashes: Hashes
    parent: BlockHash | None = msgspec.field(default=None, name="parent_block_hash")
    raw_tokens: msgspec.Raw = msgspec.field(default=_NO_TOKENS, name="token_ids")
    block_size: BlockSize = 0
    lora_name: Name | None = None
    medium: Name | None = None
    # Per block: LoRA name, multimodal ids, the cache salt (first block only)... kept undecoded: the
    # group model reads the first entry of a chain's root only.
    extra_keys: msgspec.Raw = msgspec.Raw()  # empty when absent
    group: GroupIndex | None = msgspec.field(default=None, name="group_idx")
    kind: Name | None = msgspec.field(default=None, name="kv_cache_spec_kind")
    window: int | None = msgspec.field(default=None, name="kv_cache_spec_sliding_window")
    session_id: Name | None = None
    cache_salt: Name | None = None  # SGLang names it beside the event (vLLM: in extra_keys)


class RemovedWithTokens(msgspec.Struct, tag_field="type", tag="BlockRemoved", gc=False):
    type: ClassVar[str] = "BlockRemoved"
    lora_name: ClassVar[None] = None  # a removal names no adapter: read like a store's
    block_hashes: Hashes
    medium: Name | None = None
    group: GroupIndex | None = msgspec.field(default=None, name="group_idx")


class ClearedWithTokens(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", gc=False):
    type: ClassVar[str] = "AllBlocksCleared"
    block_hashes: ClassVar[tuple] = ()
    medium: ClassVar[None] = None
    group: ClassVar[None] = None


class _ArrayStoredWithTokens(_LazyTokens, msgspec.Struct, array_like=True, tag="BlockStored", gc=False):
    type: ClassVar[str] = "BlockStored"
    block_hashes: Hashes
    parent: BlockHash | None = None
    raw_tokens: msgspec.Raw = _NO_TOKENS
    block_size: BlockSize = 0
    lora_id: int | None = None  # deprecated by vLLM, read only to reach the fields after it
    medium: Name | None = None
    lora_name: Name | None = None
    extra_keys: msgspec.Raw = msgspec.Raw()  # empty when absent
    group: GroupIndex | None = None
    kind: Name | None = None
    window: int | None = None
    locality: Name | None = None
    ownership: Name | None = None
    session_id: Name | None = None
    cache_salt: ClassVar[None] = None


class _ArrayRemovedWithTokens(msgspec.Struct, array_like=True, tag="BlockRemoved", gc=False):
    type: ClassVar[str] = "BlockRemoved"
    lora_name: ClassVar[None] = None  # a removal names no adapter: read like a store's
    block_hashes: Hashes
    medium: Name | None = None
    group: GroupIndex | None = None


class _ArrayClearedWithTokens(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    type: ClassVar[str] = "AllBlocksCleared"
    block_hashes: ClassVar[tuple] = ()
    medium: ClassVar[None] = None
    group: ClassVar[None] = None


_MapEvent = _Stored | _Removed | _Cleared
_ArrayEvent = _ArrayStored | _ArrayRemoved | _ArrayCleared
_MapEventWithTokens = StoredWithTokens | RemovedWithTokens | ClearedWithTokens
_ArrayEventWithTokens = _ArrayStoredWithTokens | _ArrayRemovedWithTokens | _ArrayClearedWithTokens


class _MapEventsBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: Annotated[list[_MapEvent], msgspec.Meta(max_length=MAX_EVENTS_PER_BATCH)]
    data_parallel_rank: int | None = None


class _MapEventsBatchWithTokens(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: Annotated[list[_MapEventWithTokens], msgspec.Meta(max_length=MAX_EVENTS_PER_BATCH)]
    data_parallel_rank: int | None = None


RawEvents = Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_EVENTS_PER_BATCH)]


class _ArrayRawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: RawEvents
    data_parallel_rank: int | None = None


class _MapRawBatch(msgspec.Struct, gc=False):
    ts: float
    events: RawEvents
    data_parallel_rank: int | None = None


class _MapTag(msgspec.Struct, gc=False):
    type: str


class _ArrayTag(msgspec.Struct, array_like=True, gc=False):
    type: str


_TAGS = {
    cls: cls.__struct_config__.tag
    for cls in (
        _Stored,
        _Removed,
        _Cleared,
        _ArrayStored,
        _ArrayRemoved,
        _ArrayCleared,
    )
}
_fast_decoder = msgspec.msgpack.Decoder(_MapEventsBatch)
_fast_decoder_with_tokens = msgspec.msgpack.Decoder(_MapEventsBatchWithTokens)
_batch_decoders = (msgspec.msgpack.Decoder(_ArrayRawBatch), msgspec.msgpack.Decoder(_MapRawBatch))
_event_decoders = (  # (tag decoder, event decoder) per encoding: tagged maps, tagged arrays
    (msgspec.msgpack.Decoder(_MapTag), msgspec.msgpack.Decoder(_MapEvent)),
    (msgspec.msgpack.Decoder(_ArrayTag), msgspec.msgpack.Decoder(_ArrayEvent)),
)
_event_decoders_with_tokens = (
    (msgspec.msgpack.Decoder(_MapTag), msgspec.msgpack.Decoder(_MapEventWithTokens)),
    (msgspec.msgpack.Decoder(_ArrayTag), msgspec.msgpack.Decoder(_ArrayEventWithTokens)),
)
_DECODE_ERRORS = (msgspec.DecodeError, RecursionError, ValueError, TypeError, OverflowError)


class Event(NamedTuple):
    type: str
    block_hashes: Sequence[int | bytes] = ()
    # BlockStored only, and only when decoded with_tokens (miss attribution needs them):
    parent: int | bytes | None = None
    token_ids: Sequence[int] = ()
    block_size: int = 0
    # The group model's fields (derive/units.py), as vLLM names them in the comments:
    lora_name: str | None = None
    medium: str | None = None  # None reads as "GPU"
    extra_keys: bytes | None = None  # msgpack of vLLM's extra_keys list
    group: int | None = None  # group_idx
    kind: str | None = None  # kv_cache_spec_kind
    window: int | None = None  # kv_cache_spec_sliding_window
    session_id: str | None = None
    cache_salt: str | None = None


class Batch(NamedTuple):
    seq: int
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None = None
    refused: tuple[str, ...] = ()  # per event left out of `events`: its REFUSAL_REASONS reason
    problem: str = ""  # the first refused event's error, for the log line
    continued: bool = False  # the rest of a batch already counted (derive/kv_budget.py cuts heavy ones)


class KvEventDecodeError(SourceError):
    """A message that is not a KV-event batch (`parse_error`), or one over the heavy-batch bounds
    (`batch_too_heavy`). `seq` is set when the sequence frame was readable."""

    def __init__(self, message: str, seq: int | None = None, reason: str = "parse_error"):
        super().__init__(reason, message)
        self.seq = seq


def peek_seq(frames: list[bytes]) -> int | None:
    """The message's sequence number without decoding the payload, or None if unreadable."""
    if len(frames) not in (2, 3) or len(frames[-2]) not in _SEQ_SIZES:
        return None
    return int.from_bytes(frames[-2][:8], "big")


def decode_message(frames: list[bytes], with_tokens: bool = False) -> Batch:
    """Decode one ZMQ multipart message; raise KvEventDecodeError on anything malformed.

    `with_tokens` also decodes each BlockStored's parent hash, token ids and block size."""
    seq = peek_seq(frames)
    if seq is None:
        raise KvEventDecodeError(f"expected [topic,] seq(8 bytes), payload; got {len(frames)} frames")
    if len(frames[-1]) > MAX_BATCH_BYTES:
        raise _too_heavy(seq, f"{len(frames[-1])} bytes, over {MAX_BATCH_BYTES}")
    try:
        fast = (_fast_decoder_with_tokens if with_tokens else _fast_decoder).decode(frames[-1])
    except _DECODE_ERRORS:
        try:
            batch = _decode_slowly(seq, frames[-1], with_tokens)
        except _DECODE_ERRORS as err:
            raise KvEventDecodeError(f"batch seq {seq}: {err}", seq) from err
        _check_weight(seq, batch.events)
        return batch
    # Every hash and token id takes a byte or more: a payload this short is under both bounds.
    if len(frames[-1]) > min(MAX_HASHES_PER_BATCH, MAX_TOKENS_PER_BATCH):
        _check_weight(seq, fast.events)
    if with_tokens:
        return Batch(seq, fast.ts, fast.events, fast.data_parallel_rank)
    return Batch(seq, fast.ts, tuple(map(_to_event, fast.events)), fast.data_parallel_rank)


def weight(events: Sequence) -> tuple[int, int]:
    """(block hashes, token ids) of a batch's events: what applying it costs, in time and memory."""
    hashes = tokens = 0
    for event in events:
        hashes += len(getattr(event, "block_hashes", ()))
        cls = type(event)
        if cls in _LAZY_TOKENS:  # lazily decoded ids: their header's count
            tokens += event.token_count
        elif cls not in _NO_TOKEN_IDS:  # (a missed getattr costs an exception: once per removal)
            tokens += len(getattr(event, "token_ids", ()))
    return hashes, tokens


_LAZY_TOKENS = frozenset((StoredWithTokens, _ArrayStoredWithTokens))
_NO_TOKEN_IDS = frozenset(
    (_Stored, _Removed, _Cleared, _ArrayStored, _ArrayRemoved, _ArrayCleared, RemovedWithTokens)
) | {ClearedWithTokens, _ArrayRemovedWithTokens, _ArrayClearedWithTokens}


def _check_weight(seq: int, events: Sequence) -> None:
    hashes, tokens = weight(events)
    if hashes > MAX_HASHES_PER_BATCH:
        raise _too_heavy(seq, f"{hashes} block hashes, over {MAX_HASHES_PER_BATCH}")
    if tokens > MAX_TOKENS_PER_BATCH:
        raise _too_heavy(seq, f"{tokens} token ids, over {MAX_TOKENS_PER_BATCH}")


def _too_heavy(seq: int, what: str) -> KvEventDecodeError:
    return KvEventDecodeError(f"batch seq {seq}: {what}", seq, "batch_too_heavy")


def _to_event(event) -> Event:
    if "type" in type(event).__dict__:
        return event  # a *WithTokens struct: already Event-like
    session = getattr(event, "session_id", None)
    if session is not None:
        return Event("BlockStored", tuple(event.block_hashes), session_id=session)
    return Event(_TAGS[type(event)], tuple(getattr(event, "block_hashes", ())))


def _decode_slowly(seq: int, payload: bytes, with_tokens: bool) -> Batch:
    """Other encodings (array-tagged events, map batches, unknown event types), one event at a time."""
    batch = _first_that_decodes(_batch_decoders, payload, "neither a batch array nor a batch map")
    if batch.data_parallel_rank is not None and batch.data_parallel_rank < 0:
        raise ValueError(f"data_parallel_rank is {batch.data_parallel_rank}")
    decoders = _event_decoders_with_tokens if with_tokens else _event_decoders
    events, refused, problem = [], [], ""
    for index, raw in enumerate(batch.events):
        try:
            events.append(_event(raw, decoders))
        except _DECODE_ERRORS as err:  # one bad event: refused, the batch's others kept
            refused.append("invalid_block_size" if _BAD_SIZE in str(err) else "invalid_event")
            problem = problem or f"batch seq {seq} event {index}: {str(err)[:200]}"
    return Batch(seq, batch.ts, tuple(events), batch.data_parallel_rank, tuple(refused), problem)


def _event(raw: msgspec.Raw, decoders=_event_decoders) -> Event:
    for tag_decoder, event_decoder in decoders:
        try:
            tag = tag_decoder.decode(raw).type
        except msgspec.DecodeError:
            continue
        if tag not in KNOWN_TYPES:
            return Event(tag)
        return _to_event(event_decoder.decode(raw))  # a known tag in the wrong shape is an error
    raise ValueError("event is not a tagged map or tagged array")


def _first_that_decodes(decoders, payload: bytes, what: str):
    for decoder in decoders:
        try:
            return decoder.decode(payload)
        except msgspec.ValidationError:
            continue
    raise ValueError(f"payload is {what}")


class TokenBucket:
    """`rate` tokens per second, bursts up to one second's worth; rate <= 0 means unlimited."""

    def __init__(self, rate: float, clock: Callable[[], float]):
        self.rate, self.clock = rate, clock
        self.tokens, self.last = float(rate), clock()

    def take(self) -> bool:
        if self.rate <= 0:
            return True
        now = self.clock()
        self.tokens = min(self.rate, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class Mark(NamedTuple):
    """What one publisher's sequence says before a batch: batches lost since the previous one, and
    whether the publisher restarted (its cache starts empty)."""

    lost: int = 0
    restart: bool = False


IN_ORDER = Mark()


class SeqCursor:
    """One publisher's sequence, read once: every consumer of the stream is handed its marks."""

    def __init__(self) -> None:
        self.next: int | None = None  # the seq expected next; None before the first batch

    def gap(self, seq: int) -> range:
        """Sequence numbers lost before `seq`. A seq below the expected one is a new publisher (vLLM
        restarted and counts from 0 again), whose batches before `seq` are the ones lost; so is a jump
        beyond MAX_SEQ_GAP, whose "gap" is no loss anybody could replay."""
        expected = self.next
        if expected is None:
            return range(0)  # joining a running stream: what came before is not a gap
        if seq >= expected:
            return range(expected, seq) if seq - expected <= MAX_SEQ_GAP else range(0)
        return range(0, seq) if seq <= MAX_SEQ_GAP else range(0)

    def advance(self, seq: int) -> Mark:
        expected = self.next
        if expected is None or seq == expected:
            self.next = seq + 1
            return IN_ORDER
        lost = len(self.gap(seq))
        self.next = seq + 1
        return Mark(lost, not expected < seq <= expected + MAX_SEQ_GAP)

    def skip(self, seq: int | None, count: int) -> Mark:
        """`count` messages from `seq` on dropped on purpose: the sequence moves past them."""
        if seq is None:
            return IN_ORDER
        mark = self.advance(seq)
        self.next = seq + count
        return mark


class Dropped(NamedTuple):
    """`count` messages the subscriber did not apply (rate_limited, parse_error): seq, seq + 1, ...
    when the first seq was readable."""

    reason: str
    seq: int | None = None
    count: int = 1


@dataclass(frozen=True)
class KvEventDrain:
    """What the subscriber received since the last poll, in arrival order: the KV-event snapshot."""

    items: tuple[Batch | Dropped, ...] = ()
