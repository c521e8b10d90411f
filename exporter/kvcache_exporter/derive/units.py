"""One publisher's KV events folded into hit units: what a prefix hit is made of. Pure, no I/O.

vLLM's hybrid KV-cache manager keeps several *groups* in one block pool (docs/kv-events.md, "Groups
and hit units"): full-attention groups hold every block of a chain, sliding-window and state groups
only the blocks in their window. Each group announces its own `BlockStored`/`BlockRemoved`, and one
hash value appears in several groups. A prefix hit (HybridKVCacheCoordinator.find_longest_cache_hit)
ends where the full-attention group holds the whole chain AND every windowed group holds the blocks
of its window just before that end.

`UnitView.units(batch)` turns a batch into the events miss attribution reads, one per hit unit:

- the *anchor* group (the first full-attention one, whatever its index) stands for the unit: its
  stores pass on, its removals are evictions;
- a windowed group's store names the unit its blocks end at (the event's last hash); the removal of
  one of those blocks ends that unit's hittability, so it passes on as the unit's removal. Window
  blocks never named (empty hash lists) and repeated removals cost nothing;
- prompt tokens past a request's last whole unit are computed but never stored by any group (on
  DeepSeek-V4 every group stores exactly the unit's 256 tokens): no event shows them, so coverage
  sits below 1 by up to one unit per request, as it does by up to one block on a single group;
- a store of hashes all still held on the GPU with no parent is `kv_cache_report_mode=full`
  re-announcing a hit: counted as reused tokens, never a miss;
- events of another medium (`CPU`, `STORAGE`: vLLM's offloading connector) are that tier's
  residency; a GPU store of blocks a tier held is a load from it (a tier hit), not a computed miss;
- a one-unit store behind a parent is preceded by `PREFILLED` when a window group named the unit:
  a prompt's prefill (an append-only turn a unit long), which attribution must not read as decode
  (decode completes window blocks with empty hash lists);
- LoRA adapters and the cache salt are part of a chain's identity: their token ids are tagged so
  content fingerprints never match across identities.

Bounded: the GPU residency, the window parts and the identity tags keep at most `max_blocks` entries
each (the window parts: two generations, like Generations), tier residency `max_blocks` per tier.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from zlib import crc32

import msgspec

from ..samples import label_value
from ..sources.kv_events_decode import Batch, Event

GPU = "GPU"
OTHER = "other"  # the label of everything past a bounded counter's first keys
MAX_GROUPS = 64  # KV-cache groups learned (vLLM builds a handful); a stream naming more is hostile
MAX_BLOCK_SIZES = 8  # block sizes remembered per group
MAX_TIERS = 8  # offload media told apart; later ones count as `other`
BASE = "base"  # the adapter label of requests without LoRA
TAG_SHIFT = 24  # identity tags go above every real token id (vocabularies stay below 2^24)
TOKEN_MASK = (1 << TAG_SHIFT) - 1  # a tagged token id without its tag
WINDOW_EXPIRED = "WindowExpired"  # the event passed on for units whose window part was removed
# Passed on just before a one-unit store behind a parent that its window groups named in the same
# batch: a prompt's prefill (decode completes window blocks with empty hash lists), never decode.
PREFILLED = "UnitPrefilled"


class _FirstKey(msgspec.Struct, array_like=True, gc=False):
    first: msgspec.Raw


_first_key = msgspec.msgpack.Decoder(_FirstKey)


@dataclass
class Group:
    """One KV-cache group as its BlockStored events describe it."""

    kind: str | None
    window: int | None
    block_sizes: set[int] = field(default_factory=set)

    @property
    def windowed(self) -> bool:
        return self.window is not None or "sliding" in (self.kind or "")


class Bounded:
    """Counts by key; the first `limit` keys keep their own count, later ones add to `other` (the
    series set stays fixed, so every count only grows)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.counts: Counter[str] = Counter()

    def add(self, key: str, n: int) -> None:
        key = label_value(key)  # keys are label values: two ids that export alike count together
        if key not in self.counts and len(self.counts) >= self.limit:
            key = OTHER
        self.counts[key] += n


@dataclass
class UnitTotals:
    """Cumulative counts of one publisher (counters: they only grow)."""

    stored_tokens: int = 0  # GPU-stored tokens, each hit unit once
    session_tokens: int = 0  # of those, stored by requests that carried a session id
    reused_tokens: int = 0  # re-announced hits (kv_cache_report_mode=full)
    tier_hit_tokens: Counter[str] = field(default_factory=Counter)  # loaded back from a tier
    window_evictions: int = 0  # units whose window blocks were removed while the anchor held them
    floor_tokens: int = 0  # a tier held them, the request recomputed them (SGLang's last page)


class UnitView:
    def __init__(self, max_blocks: int = 1_000_000, label_limit: int = 10, sessions_compute: bool = False):
        self.max_blocks = max_blocks
        # SGLang: a store naming a session was computed by that request, never loaded from a tier (its
        # load-backs name none); of tier-held blocks it is the page SGLang recomputes (the last
        # token, rounded to the page, is never a hit): counted as floor_tokens, not a miss.
        self.sessions_compute = sessions_compute
        self.groups: dict[int | None, Group] = {}
        self.anchor: int | None = None
        self.anchored = False  # an anchor group was chosen
        self.totals = UnitTotals()
        self.by_adapter = Bounded(label_limit)  # stored (computed) tokens
        self.reused_by_adapter = Bounded(label_limit)
        self.by_session = Bounded(label_limit)
        self.reused_by_session = Bounded(label_limit)
        self.resident: set[int | bytes] = set()  # anchor hashes held on the GPU
        self.tiers: dict[str, set[int | bytes]] = {}
        # windowed group -> {hash of a window block: the unit it belongs to}, in two generations
        self._parts: dict[int | None, dict[int | bytes, int | bytes]] = {}
        self._old_parts: dict[int | None, dict[int | bytes, int | bytes]] = {}
        self._parts_held = 0
        self._tags: dict[int | bytes, int] = {}  # last hash of a tagged chain's event -> its tag

    @property
    def hit_unit(self) -> int | None:
        """Tokens per hit unit: the anchor group's block size (vLLM's effective attention block)."""
        group = self.groups.get(self.anchor) if self.anchored else None
        return max(group.block_sizes) if group and group.block_sizes else None

    @property
    def parts(self) -> int:
        """Window blocks remembered (each names its unit)."""
        return sum(map(len, self._parts.values())) + sum(map(len, self._old_parts.values()))

    def restart(self) -> None:
        """A new publisher (vLLM restarted, perhaps with another model): nothing is held any more, on
        any tier, and the groups are learned again."""
        self.groups.clear()
        self.anchor, self.anchored = None, False
        self.resident.clear()
        self.tiers.clear()
        self._parts, self._old_parts, self._parts_held = {}, {}, 0

    def units(self, batch: Batch) -> Batch:
        """The batch as attribution reads it: one event per hit unit, in stream order (the batch
        itself when that is what it already was: one group, no tier, nothing re-announced)."""
        events = batch.events
        single = len(self.groups) == 1 and not self.tiers and not self._tags
        start = self._single_group(events) if single else 0
        if start == len(events):
            return batch
        out: list = list(events[:start])
        resident, anchor, anchored = self.resident, self.anchor, self.anchored
        removed: list = []  # consecutive anchor removals (one per evicted block), applied at once
        for event in events[start:]:
            kind = event.type
            medium = event.medium
            if kind == "BlockRemoved" and (medium is None or medium == GPU):
                if not anchored or event.group == anchor:  # the common case, inline
                    removed += event.block_hashes
                    out.append(event)
                else:
                    self._removed(event, out)
                continue
            if removed:
                resident.difference_update(removed)
                removed = []
            if medium is not None and medium != GPU:
                self._tier(event, medium)
            elif kind == "BlockStored":
                self._stored(event, event.group, out)
                anchor, anchored = self.anchor, self.anchored
            else:
                if kind == "AllBlocksCleared":  # the GPU pool was reset; vLLM's lower tiers keep theirs
                    resident.clear()
                    if self.sessions_compute:  # SGLang's /flush_cache resets HiCache's host pool too
                        for held in self.tiers.values():
                            held.clear()
                    self._parts, self._old_parts, self._parts_held = {}, {}, 0
                out.append(event)
        if removed:
            resident.difference_update(removed)
        if len(out) == len(events) and all(map(operator.is_, out, events)):
            return batch
        return batch._replace(events=tuple(out))

    def _single_group(self, events: Sequence) -> int:
        """The fast path of a stream that has shown one group only (every single-group model): its
        leading events that pass through untouched (GPU stores and removals of the anchor group,
        known block size, no adapter, session, extra key or re-announced hit; no tier or tag
        seen), applied as `_stored` would; how many. The rest of the batch takes the general path."""
        anchor, resident = self.anchor, self.resident
        sizes = self.groups[anchor].block_sizes if self.anchored else ()
        tokens, done, removed = 0, 0, []  # removed: consecutive removals (one per evicted block)
        for event in events:
            medium = event.medium
            if event.group != anchor or (medium != GPU and medium is not None):
                break
            kind = event.type
            if kind == "BlockRemoved":
                removed += event.block_hashes
                done += 1
                continue
            if removed:
                resident.difference_update(removed)
                removed = []
            if kind != "BlockStored":
                break
            hashes, size = event.block_hashes, event.block_size
            if not hashes or size not in sizes or event.lora_name or event.session_id is not None:
                break
            if event.parent is None and (
                resident.issuperset(hashes)
                or _first_extra_key(getattr(event, "extra_keys", None))
                or getattr(event, "cache_salt", None)
            ):
                break
            if len(resident) + len(hashes) > self.max_blocks:
                resident.clear()
            resident.update(hashes)
            tokens += len(hashes) * size
            done += 1
        if removed:
            resident.difference_update(removed)
        if tokens:
            self.totals.stored_tokens += tokens
            self.by_adapter.add(BASE, tokens)
        return done

    def _learn(self, event, group: int | None) -> Group | None:
        spec = self.groups.get(group)
        if spec is None:
            if len(self.groups) >= MAX_GROUPS:
                return None
            spec = self.groups[group] = Group(getattr(event, "kind", None), getattr(event, "window", None))
            if not self.anchored and not spec.windowed:
                self.anchor, self.anchored = group, True
        if event.block_size and len(spec.block_sizes) < MAX_BLOCK_SIZES:
            spec.block_sizes.add(event.block_size)
        return spec

    def _stored(self, event, group: int | None, out: list) -> None:
        hashes = event.block_hashes
        spec = self.groups.get(group)
        if spec is None or (event.block_size and event.block_size not in spec.block_sizes):
            spec = self._learn(event, group)
        if spec is None:
            return  # past MAX_GROUPS: not a group vLLM would build
        if not self.anchored or group != self.anchor:  # a windowed group (or another full one)
            if hashes:
                self._keep_parts(group, hashes, hashes[-1])
            return
        if not hashes:
            return
        count = len(hashes)
        size = event.block_size or len(event.token_ids) // count
        if event.parent is None and self.resident.issuperset(hashes):
            self._reused(event, count * size)
            return
        if self.tiers:
            loaded = self._loaded(hashes)
            if loaded:
                if self.sessions_compute and event.session_id is not None:
                    self.totals.floor_tokens += loaded[0] * size
                else:
                    self.totals.tier_hit_tokens[loaded[1]] += loaded[0] * size
                if loaded[0] == count:
                    return
                event = _tail(event, loaded[0], size)
                hashes, count = event.block_hashes, count - loaded[0]
        resident = self.resident
        if len(resident) + count > self.max_blocks:
            resident.clear()  # bounded: forgetting means a later reuse report reads as a store
        resident.update(hashes)
        tokens = count * size
        self.totals.stored_tokens += tokens
        if event.session_id is not None:
            self.totals.session_tokens += tokens
            self.by_session.add(event.session_id, tokens)
        lora = event.lora_name
        adapters = self.by_adapter.counts
        if (lora or BASE) in adapters:
            adapters[lora or BASE] += tokens
        else:
            self.by_adapter.add(lora or BASE, tokens)
        if lora or self._tags or event.parent is None:
            tag = self._tag(event)
            if tag:
                self._remember_tag(hashes[-1], tag)
                event = _tagged(event, tag)
        if count == 1 and event.parent is not None and self._window_named(hashes[0]):
            out.append(Event(PREFILLED, hashes))
        out.append(event)

    def _window_named(self, unit) -> bool:
        """Whether a window group named `unit` (its part's last hash is the unit's: the chain at its end)."""
        return any(unit in parts for parts in self._parts.values()) or any(
            unit in parts for parts in self._old_parts.values()
        )

    def _reused(self, event, tokens: int) -> None:
        self.totals.reused_tokens += tokens
        self.reused_by_adapter.add(getattr(event, "lora_name", None) or BASE, tokens)
        session = getattr(event, "session_id", None)
        if session is not None:
            self.reused_by_session.add(session, tokens)

    def _removed(self, event, out: list) -> None:
        group = getattr(event, "group", None)
        hashes = event.block_hashes
        if not self.anchored or group == self.anchor or group not in self.groups:
            self.resident.difference_update(hashes)
            out.append(event)
            return
        units, new, old = [], self._parts.get(group, {}), self._old_parts.get(group, {})
        for block_hash in hashes:
            unit = new.pop(block_hash, None)
            if unit is None:
                unit = old.pop(block_hash, None)
            if unit is not None and unit in self.resident:
                units.append(unit)
        if units:
            self.totals.window_evictions += len(units)
            self.resident.difference_update(units)
            out.append(Event(WINDOW_EXPIRED, units))

    def _keep_parts(self, group: int | None, hashes: Sequence, unit) -> None:
        parts = self._parts.get(group)
        if parts is None:
            parts = self._parts[group] = {}
        parts.update(dict.fromkeys(hashes, unit))
        self._parts_held += len(hashes)
        if self._parts_held >= self.max_blocks // 2:
            self._old_parts, self._parts, self._parts_held = self._parts, {}, 0

    def _tier(self, event, medium: str) -> None:
        if medium not in self.tiers and len(self.tiers) >= MAX_TIERS - 1:
            medium = OTHER
        held = self.tiers.setdefault(medium, set())
        if event.type == "BlockStored":
            if len(held) + len(event.block_hashes) > self.max_blocks:
                held.clear()
            held.update(event.block_hashes)
        elif event.type == "BlockRemoved":
            held.difference_update(event.block_hashes)
        elif event.type == "AllBlocksCleared":
            held.clear()

    def _loaded(self, hashes: Sequence) -> tuple[int, str] | None:
        """How many leading hashes a lower tier held (a load back to the GPU), and which tier."""
        for medium, held in self.tiers.items():
            if hashes[0] in held:
                n = 1
                while n < len(hashes) and hashes[n] in held:
                    n += 1
                return n, medium
        return None

    def _tag(self, event) -> int:
        """0 for the default identity; else a tag from the adapter and the root's first extra key."""
        parent = event.parent
        if parent is not None:
            inherited = self._tags.get(parent)
            if inherited is not None:
                return inherited
        lora = getattr(event, "lora_name", None)
        first = b""
        if parent is None:  # vLLM's salt is the first extra key; SGLang's a field of its own
            first = _first_extra_key(getattr(event, "extra_keys", None))
            first = first or (getattr(event, "cache_salt", None) or "").encode()
        if not lora and not first:
            return 0
        return (crc32(first, crc32((lora or "").encode())) & 0xFF) | 1

    def _remember_tag(self, last_hash, tag: int) -> None:
        if len(self._tags) >= self.max_blocks:
            self._tags.clear()
        self._tags[last_hash] = tag


def _first_extra_key(raw) -> bytes:
    """The msgpack of the first entry of `extra_keys`, b"" when absent or null."""
    if raw is None:
        return b""
    data = bytes(raw)
    if not data or data in (b"\xc0", b"\x90"):
        return b""
    head = data[0]
    skip = 1 if 0x90 <= head <= 0x9F else 3 if head == 0xDC else 5 if head == 0xDD else 0
    if not skip or len(data) <= skip or data[skip] == 0xC0:
        return b""
    try:
        return bytes(_first_key.decode(data).first)
    except msgspec.DecodeError:
        return data[skip : skip + 64]  # unreadable: still one identity per distinct prefix


def _tail(event, skip: int, size: int) -> Event:
    """The event without its first `skip` blocks (they were loaded, not computed)."""
    hashes = event.block_hashes
    return Event(
        "BlockStored",
        hashes[skip:],
        hashes[skip - 1],
        event.token_ids[skip * size :],
        event.block_size,
        lora_name=getattr(event, "lora_name", None),
        session_id=getattr(event, "session_id", None),
    )


def _tagged(event, tag: int) -> Event:
    """The event with its token ids moved into the identity's own range: the same text under another
    adapter or salt is other content to the fingerprints."""
    shift = tag << TAG_SHIFT
    return Event(
        "BlockStored",
        event.block_hashes,
        event.parent,
        [token ^ shift for token in event.token_ids],
        event.block_size,
        lora_name=getattr(event, "lora_name", None),
        session_id=getattr(event, "session_id", None),
    )
