"""What each engine's KV events must look like beyond the shared wire format. Pure, no I/O.

vLLM, SGLang (0.5.23: tagged maps; 0.5.5 and older: tagged arrays) and TensorRT-LLM's streaming ZMQ
publisher share one framing (`[topic, seq, payload]`, batch `[ts, events, rank]`) and one event
schema (BlockStored / BlockRemoved / AllBlocksCleared): kv_events_decode.py decodes all three. What
differs is checked here, after decoding, per event (a refused event is counted, its batch's others
kept):

- **SGLang** merges consecutive pages into one BlockStored, so `len(token_ids) = block_size x
  len(block_hashes)` exactly (`disaggregation/kv_events.py`); a page size of 0 or a count that
  disagrees is `invalid_block_size`. Media are `GPU`, `CPU_PINNED` (the HiCache host tier), `DISK`,
  `EXTERNAL`; any other is `invalid_event`. A non-GPU medium is a lower tier's residency
  (derive/units.py): the write-through backup is not a new computed block, and a GPU store of blocks
  the host tier holds is a load-back, a tier hit.
- **TensorRT-LLM** publishes only `GPU` (or no medium); its windowed groups send the window's token
  ids, as vLLM's do, so a count above the pages' is allowed, never one below.
- **vLLM**'s connectors name their own media (CPU, STORAGE, ...): only the shared bounds apply.

The engine of a stream is configuration (`--kv-events.engine`, or set by discovery: SGLang's
`/server_info` names SGLang), never guessed from a payload: SGLang's and vLLM's events are the same
shape, and their block hashes are opaque to each other (never compared: aggregator/fleet_pool.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from .kv_events_decode import Batch, Event, decode_message

VLLM, SGLANG, TRTLLM = "vllm", "sglang", "trtllm"
ENGINES = (VLLM, SGLANG, TRTLLM)
GPU = "GPU"


@dataclass(frozen=True)
class EngineRules:
    media: frozenset[str] | None  # the media the engine publishes; None: any
    exact_pages: bool  # token ids = block size x hashes on every store (else at least that many)


RULES = {
    VLLM: EngineRules(None, False),
    SGLANG: EngineRules(frozenset((GPU, "CPU_PINNED", "DISK", "EXTERNAL")), True),
    TRTLLM: EngineRules(frozenset((GPU,)), False),
}


def refusal(event, rules: EngineRules) -> str | None:
    """Why the engine could not have published `event` (a REFUSAL_REASONS reason), or None."""
    medium = getattr(event, "medium", None)
    if medium is not None and rules.media is not None and medium not in rules.media:
        return "invalid_event"
    if event.type != "BlockStored" or not event.block_hashes:
        return None
    size = event.block_size
    if rules.exact_pages:
        if not size or _token_count(event) != size * len(event.block_hashes):
            return "invalid_block_size"
    elif rules.media is not None and size and 0 < _token_count(event) < size * len(event.block_hashes):
        return "invalid_block_size"
    return None


def screen(batch: Batch, engine: str) -> Batch:
    """`batch` without the events its engine could not have published, each counted as refused."""
    rules = RULES[engine]
    if rules.media is None:
        return batch
    reasons = [refusal(event, rules) for event in batch.events]
    if not any(reasons):
        return batch
    kept = tuple(event for event, reason in zip(batch.events, reasons, strict=True) if reason is None)
    refused = tuple(reason for reason in reasons if reason)
    first = next(i for i, reason in enumerate(reasons) if reason)
    problem = batch.problem or (
        f"batch seq {batch.seq} event {first}: {engine} could not have published it ({refused[0]})"
    )
    return batch._replace(events=kept, refused=batch.refused + refused, problem=problem)


def decode_engine_message(frames: list[bytes], with_tokens: bool = False, engine: str = VLLM) -> Batch:
    """decode_message, then the engine's checks. They read each store's page size, token count and
    medium, so another engine's batch is decoded with them and, without `with_tokens`, handed on as
    plain events (hashes, medium and session only)."""
    if RULES[engine].media is None:
        return decode_message(frames, with_tokens)
    batch = screen(decode_message(frames, True), engine)
    if with_tokens:
        return batch
    return batch._replace(events=tuple(map(_plain, batch.events)))


def _token_count(event) -> int:
    count = getattr(event, "token_count", None)
    return count if count is not None else len(event.token_ids)


def _plain(event) -> Event:
    return Event(
        event.type,
        tuple(event.block_hashes),
        medium=event.medium,
        session_id=getattr(event, "session_id", None),
    )
