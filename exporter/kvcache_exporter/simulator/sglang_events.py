"""The simulator's KV events in SGLang 0.5.23's wire shape (`sglang/srt/disaggregation/kv_events.py`),
for `--engine sglang`: the same framing and batch `[ts, events, attn_dp_rank]`, events as tagged maps
with SGLang's fields (omit_defaults: `cache_salt`, `session_id`, `lora_name` left out when None; no
`extra_keys`, `group_idx` or spec fields), consecutive pages of one chain merged into one
`BlockStored`, and media as SGLang names them (the CPU tier is HiCache's `CPU_PINNED`).

What is vLLM's and stays so: the engine model deciding what is stored (its block size is the page
size; SGLang's "recompute the last page" and its load-backs without `session_id` are not modelled),
and the block hashes (opaque to every consumer)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import msgspec

from .blocks import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

MEDIA = {"GPU": "GPU", "CPU": "CPU_PINNED"}
MAX_REMEMBERED = 1 << 20  # page hashes whose token ids a host-tier backup may repeat


class SglangWire:
    """One publisher's events as SGLang sends them. A host-tier backup repeats the token ids of the
    GPU pages it copies (write-through), as SGLang's does; the simulator's tier events carry hashes
    only, so the GPU stores' ids are remembered (bounded) to fill them in."""

    def __init__(self) -> None:
        self.page_tokens: dict[int, list[int]] = {}
        self.host: set[int] = set()  # pages the host tier holds: a GPU store of them is a load-back

    def encode_batch(self, events: list[KVEvent], rank: int, ts: float | None = None) -> bytes:
        ts = time.time() if ts is None else ts
        return msgspec.msgpack.encode([ts, self.wire(events), rank])

    def wire(self, events: list[KVEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            for wire in self._event(event):
                last = out[-1] if out else None
                if last is not None and _continues(last, wire):
                    last["block_hashes"] = last["block_hashes"] + wire["block_hashes"]
                    last["token_ids"] = last["token_ids"] + wire["token_ids"]
                else:
                    out.append(wire)
        return out

    def _event(self, event: KVEvent) -> list[dict[str, Any]]:
        if isinstance(event, BlockStored):
            if event.medium != "GPU":
                if len(self.host) + len(event.block_hashes) > MAX_REMEMBERED:
                    self.host.clear()
                self.host.update(event.block_hashes)
                return [wire for wire in (self._stored(event),) if wire is not None]
            loaded = 0
            while loaded < len(event.block_hashes) and event.block_hashes[loaded] in self.host:
                loaded += 1
            if not loaded:
                return [self._stored(event)]
            # SGLang's load-back names no session; the pages computed after it are the request's
            size = event.block_size
            back = replace(
                event, block_hashes=event.block_hashes[:loaded], origin=replace(event.origin, session_id=None)
            )
            rest = replace(
                event,
                block_hashes=event.block_hashes[loaded:],
                parent_block_hash=event.block_hashes[loaded - 1],
                token_ids=event.token_ids[loaded * size :],
            )
            back = replace(back, token_ids=event.token_ids[: loaded * size])
            return [w for w in (self._stored(back), rest.block_hashes and self._stored(rest)) if w]
        if isinstance(event, BlockRemoved):
            if event.medium != "GPU":
                self.host.difference_update(event.block_hashes)
            return [
                {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": MEDIA[event.medium]}
            ]
        if isinstance(event, AllBlocksCleared):
            return [{"type": "AllBlocksCleared"}]
        raise TypeError(f"not a KV event: {event!r}")

    def _stored(self, event: BlockStored) -> dict[str, Any] | None:
        hashes, size = event.block_hashes, event.block_size
        if event.medium == "GPU":
            tokens = event.token_ids[: size * len(hashes)]
            if len(self.page_tokens) + len(hashes) > MAX_REMEMBERED:
                self.page_tokens.clear()
            for i, page in enumerate(hashes):
                self.page_tokens[page] = tokens[i * size : (i + 1) * size]
        else:  # a tier backup: the pages' own ids, each page its own event when the ids are known
            pages = [self.page_tokens.get(h) for h in hashes]
            if not hashes or any(p is None for p in pages):
                return None  # ids forgotten (or never seen): SGLang would not publish such a backup
            size = len(pages[0])
            tokens = [t for p in pages for t in p]
        origin = event.origin
        wire: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": tokens,
            "block_size": size,
            "lora_id": origin.lora_id,
            "medium": MEDIA[event.medium],
        }
        if origin.session_id is not None and event.medium == "GPU":
            wire["session_id"] = origin.session_id
        if origin.lora_name is not None:
            wire["lora_name"] = origin.lora_name
        return wire


def _continues(last: dict[str, Any], wire: dict[str, Any]) -> bool:
    """`wire` stores the pages right after `last`'s, from the same request and tier: one event."""
    return (
        last["type"] == wire["type"] == "BlockStored"
        and wire["parent_block_hash"] == last["block_hashes"][-1]
        and all(last.get(k) == wire.get(k) for k in ("medium", "block_size", "session_id", "lora_id"))
    )
