"""Why was each block computed? Live miss attribution from vLLM's KV-event stream. Pure, no I/O.

`BlockStored` lists blocks vLLM had to compute (hits produce no event). `Attribution.apply(batch)`
classifies every stored block, in stream order, by the first rule that holds (docs/kv-events.md has
a section per cause: the rule, an example, the action and its worth, what it gets wrong):

1. `evicted`: its hash was stored before by this publisher and removed since (`BlockRemoved`);
   `window_expired` when the removal was its unit's window part (units.py's `WindowExpired`);
2. `restart`: its hash was resident before the publisher restarted (seq went back) or before an
   `AllBlocksCleared`, and not stored since;
3. `other_replica`: the hash is resident on another replica, as told by the `other_replica` hook
   (a lone sidecar passes none, so it never sets this cause; the fleet view passes
   `FleetResidency`'s residency test);
4. the content causes of a new hash, by where its tokens lie among the event's (content_causes.py,
   reorder.py; fingerprints.py says what content is *known*): `history_rewritten` (behind a cached
   prefix, text the model generated re-rendered: decode-filled blocks' fingerprints), else
   `below_hit_unit` (known content at the divergence point short of a hit unit), `prefix_diverged`
   (a known run behind a per-request front, in whole hit units), `content_moved` (known runs joined
   at seams), or `identity_isolated` (content known under another adapter or salt only);
5. `cold`: none of the above (also a hash still resident when stored again: two requests
   computing the same new prefix in one step, or the recomputed last block of a fully cached prompt).

Decode-filled blocks are counted apart (`decode_tokens`), not as prompt misses: a `BlockStored`
of exactly one block whose parent is the still-unextended last block of an earlier event is a
request's decode filling its next block (prefill stores all its full blocks in one event per step),
unless units.py said its window groups named it (`PREFILLED`: a hybrid layout's prefill of an
append-only turn one unit long; decode completes window blocks with empty hash lists).

Bounded: `max_blocks` tracked hashes and `max_fingerprints` fingerprints (two-generation maps),
whatever the stream does. A publisher restart or `AllBlocksCleared` starts a new era in O(1);
blocks of an older era read as `restart`. Sequence gaps (the event view counts them): the miss
tokens of lost batches are never attributed, which the coverage ratio shows.

For the fleet (issue 11): one `Attribution` per replica, each given
`other_replica=lambda h: fleet.held_elsewhere(replica, h)` or similar; nothing else changes.

What-if capacity: a block evicted and recomputed after D further stored blocks would still have
been resident in a cache of f x the capacity when D <= (f-1) x capacity (every block stored
after the eviction pushed it one place further down the LRU order). `extra_hit_tokens[f]` adds
those blocks' tokens; the estimate is (hits + extra) / queries.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import sub

from ..sources.kv_events_decode import IN_ORDER, Batch, Event, Mark
from .content_causes import (
    foreign_span,
    gap_changed,
    moved_from_divergence,
    moved_span,
    rewritten_span,
    seams,
    whole_units,
)
from .fingerprints import PREFIX_STEPS, FingerprintSet, Generations, K, anchors, prefix_prints, shared_prefix
from .layouts import LAYOUTS, AnchorOrder, OrderBudget, layout_served, stop_after
from .reorder import (
    KnownRun,
    first_known_run,
    front_without_anchors,
    lead,
    overlaps,
    served_span,
    served_tokens,
    unit_shortfall_tokens,
)
from .units import PREFILLED, TAG_SHIFT, TOKEN_MASK, WINDOW_EXPIRED

CAUSES = (  # the `cause` label of the miss tokens, in rule order (the module docstring)
    "evicted",
    "window_expired",
    "restart",
    "other_replica",
    "history_rewritten",
    "prefix_diverged",
    "content_moved",
    "below_hit_unit",
    "identity_isolated",
    "cold",
)
CAPACITY_FACTORS = (2, 4)
# Known content in order behind a field with no anchor (nothing shows where it is) counts from this many
# hit units on: a question recombined from shared sentences is shorter.
FIELD_RUN_UNITS = 4
FIELD_RUN_TOKENS = 512  # or this many tokens, where hit units are large (DeepSeek-V4: 2 of 256)
# Token offsets of the divergence histogram: where shared content starts in a prompt.
OFFSET_BUCKETS = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# The rewritten-turn histogram: which rewrite along a conversation a history_rewritten event is (the
# assistant turn where it diverges when every turn is rewritten; counted up to 7 along a chain).
TURN_BUCKETS = (1, 2, 3, 4, 6)

# A tracked block is one int: flags | depth << 6 | turns << 21 | era << 24 | stamp << 40 (stamp: blocks stored
# when it was stored or removed). One int per hash keeps a tracked block near 100 bytes.
# _WINDOW: removed as a windowed group's part (the unit's window expired), not by the anchor group;
# _DECODED: a decode-filled block (its child, decode-filled too, is generated text for sure).
_REMOVED, _DIVERGED, _OPEN_TIP, _DEPTH_KNOWN, _WINDOW, _DECODED = 1, 2, 4, 8, 16, 32
_DEPTH_MAX = (1 << 15) - 1
_TURNS, _TURN, _TURN_MAX = 7 << 21, 1 << 21, 7  # rewritten turns along the chain (saturating)
_ERA_MASK = (1 << 16) - 1


_KEEP_ON_REMOVE = ((1 << 40) - 1) & ~_OPEN_TIP  # flags, depth and era; the stamp is replaced
_STEP = 1 << 6 | 1 << 40  # from one block of an event to the next: depth + 1, stamp + 1


@dataclass
class Totals:
    """Cumulative counts since start (counters: they only grow)."""

    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))
    decode_tokens: int = 0
    tier_restored_tokens: int = 0  # loaded back from an offload tier (units.py): tier hits, not misses
    host_hit_tokens: int | None = None  # None while no host tier is known (whatif.py)
    host_load_bytes: float = 0.0  # what loading those tokens from the host would move
    extra_hit_tokens: dict[int, int] = field(default_factory=lambda: dict.fromkeys(CAPACITY_FACTORS, 0))
    offset_counts: list[int] = field(default_factory=lambda: [0] * (len(OFFSET_BUCKETS) + 1))
    offset_sum: float = 0.0
    rewritten_turn_counts: list[int] = field(default_factory=lambda: [0] * (len(TURN_BUCKETS) + 1))
    rewritten_turn_sum: int = 0
    reorder_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LAYOUTS, 0))
    """of the prefix_diverged tokens, those a reorder to each layout would hit (layouts.py)"""
    unordered_events: int = 0  # past the order budget: attributed without the anchor order
    batches: int = 0

    @property
    def prompt_miss_tokens(self) -> int:
        return sum(self.tokens.values())


class Attribution:
    def __init__(
        self,
        max_blocks: int = 400_000,
        max_fingerprints: int = 800_000,
        capacity_blocks: int | None = None,
        other_replica: Callable[[int | bytes], bool] | None = None,
        hit_unit: int | None = None,
        reorder_layouts: bool = True,
        order_budget: OrderBudget | None = None,
    ):
        self.hit_unit = hit_unit  # tokens vLLM hits in (a whole number of blocks); None: the block size
        self.host_tier_blocks: int | None = None  # the what-if host tier (whatif.py), set once known
        self.kv_bytes_per_token = 0.0
        self.capacity_blocks = capacity_blocks  # vLLM's num_gpu_blocks when known (cache_config_info)
        self.other_replica = other_replica
        self.totals = Totals()
        self.resident = 0
        self.resident_peak = 0
        self._blocks = Generations(max_blocks)
        share = max_fingerprints // 8
        self._content_prints = FingerprintSet(max_fingerprints - 4 * share - share // 2)
        # of chains' first tokens (shared starts short of a unit); off where the share holds only a few
        # chains' (an update puts PREFIX_STEPS)
        self._prefixes = FingerprintSet(share // 2) if share // 2 > 2 * PREFIX_STEPS else None
        self._generated = FingerprintSet(max_fingerprints // 8)  # of decode-filled blocks: generated text
        self._foreign = FingerprintSet(max_fingerprints // 8)  # of adapters' and salted chains, untagged
        # tokens from each anchor pair's first anchor to its second, as last stored: an anchor-free section
        # moved between them shows nowhere else (content_causes.gap_changed)
        self._gaps = Generations(share) if reorder_layouts else None
        # which anchor followed which: the layouts' worth; None: not estimated (the bench's baseline)
        self._order = AnchorOrder(max_fingerprints // 8) if reorder_layouts else None
        self.order_budget = order_budget  # None: every event ordered (tests, the analyzer, the accuracy runs)
        # (prefix_diverged tokens, end, after_template) of the events estimated: the rate past the budget
        self._estimated = [0, 0, 0]
        self.limits = (max_blocks, max_fingerprints)
        self._stored = 0  # blocks stored so far: the clock of the what-if estimate
        self._era = 0
        self.fields = None  # front_fields.FrontFields when the wiring has a tokenizer: names the front
        self._prefilled = None  # the unit units.py last said was prefilled (PREFILLED): not decode

    def set_host_tier(self, blocks: int | None, bytes_per_token: float | None) -> None:
        """The what-if host tier (whatif.host_tier_blocks) and the KV bytes of a token, once known."""
        self.host_tier_blocks, self.kv_bytes_per_token = blocks, bytes_per_token or 0.0
        if blocks is not None and self.totals.host_hit_tokens is None:
            self.totals.host_hit_tokens = 0

    @property
    def tracked(self) -> tuple[int, int]:
        """(tracked hashes, tracked fingerprints): never above the bounds."""
        prints = len(self._content_prints) + len(self._generated) + len(self._foreign)
        prints += len(self._prefixes or ())
        return len(self._blocks), prints + len(self._order or ())

    def mark(self, mark: Mark) -> None:
        """What the stream's sequence said (the event view reads it and counts lost batches): a restart
        (a new publisher with an empty cache) starts a new era."""
        if mark.restart:
            self._new_era()

    def apply(self, batch: Batch, mark: Mark = IN_ORDER) -> None:
        """One batch (of hit-unit events: derive/units.py folds groups first), in stream order, with
        the mark the stream's sequence gave it (derive/state.py; SeqCursor when driven alone)."""
        if mark is not IN_ORDER:
            self.mark(mark)
        if not batch.continued:
            self.totals.batches += 1
        removed: list[int | bytes] = []  # consecutive BlockRemoved (one per evicted block) applied at once
        for event in batch.events:
            kind = event.type
            if kind == "BlockRemoved":
                removed += event.block_hashes
                continue
            if removed:
                self._remove(removed)
                removed = []
            if kind == "BlockStored":
                self._store(event)
            elif kind == "AllBlocksCleared":
                self._new_era()
            elif kind == WINDOW_EXPIRED:
                self._remove(event.block_hashes, _WINDOW)
            elif kind == PREFILLED:
                self._prefilled = event.block_hashes[0]
        if removed:
            self._remove(removed)

    def _new_era(self) -> None:
        self._era += 1
        self.resident = 0

    def _store(self, event: Event) -> list[tuple[str, int, int]]:
        """Classify and track one BlockStored; returns its content spans (cause, start, stop)."""
        hashes = event.block_hashes
        count = len(hashes)
        if not count:
            return []
        blocks, parent_hash = self._blocks, event.parent
        if parent_hash is None and count > 1 and (hashes[0] in blocks.new or hashes[0] in blocks.old):
            lead = self._resident_lead(hashes)
            if lead:
                return self._store_behind_resident(event, lead)
        size = event.block_size or len(event.token_ids) // count  # token ids are decoded when read
        depth, diverged, rewritable, turns, appended = 0, 0, False, 0, False
        if parent_hash is not None:
            parent = blocks.new.get(parent_hash) or blocks.old.get(parent_hash)  # Generations.get
            if parent is None:
                depth = None
            else:
                blocks.new[parent_hash] = parent & ~_OPEN_TIP  # Generations.put
                blocks.rotate_if_full()
                depth = (parent >> 6) & _DEPTH_MAX if parent & _DEPTH_KNOWN else None
                diverged = parent & _DIVERGED
                rewritable = not parent & _OPEN_TIP  # an open tip goes on where it ended: append-only
                turns = parent & _TURNS
                appended = parent & _OPEN_TIP and not parent & _REMOVED
                if count == 1 and appended and hashes[0] != self._prefilled:
                    self.totals.decode_tokens += size
                    if parent & _DECODED:  # the second decode block on: not a one-block prompt misread
                        self._generated.update(anchors(event.token_ids)[1])
                    self._track(hashes, depth, (0, 1) if diverged else (0, 0), _DECODED, turns)
                    return []
        unit, length = self.hit_unit or size, count * size
        before = 0 if parent_hash is None else None if depth is None else (depth + 1) * size
        tokens = event.token_ids  # decoded on each read: once
        found = anchors(tokens)
        order = self._order
        if order is not None and self.order_budget is not None and not self.order_budget.take():
            order = None  # past the budget: attributed as with the order off, its estimate extrapolated
            self.totals.unordered_events += 1
        pairs = order.read(found[1]) if order is not None else None
        known = self._known(tokens, found, length, rewritable)
        if appended:  # the whole chain hit and nothing held past its open tip: no hit was lost, cold
            known = None
        start = None  # at a root: (fingerprints of its first tokens, the longest shared start seen)
        if parent_hash is None and self._prefixes is not None:
            lengths, prints = prefix_prints(tokens, unit)
            start = prints, shared_prefix(lengths, prints, self._prefixes) if lengths else 0
        run, served, spans = None, 0, ()
        if known is not None:
            fresh = start is not None and bool(start[0]) and not start[1]  # its very start never seen
            run, served, spans = self._content(
                known, size, length, parent_hash is None, unit, before, diverged, pairs, fresh
            )
        if start is not None:  # shared content short of a unit that no anchor saw, when they named nothing
            self._prefixes.update(start[0])
            if start[1] and not spans:
                spans = [("below_hit_unit", 0, start[1])]
        if (
            self.other_replica is None
            and blocks.new.keys().isdisjoint(hashes)
            and blocks.old.keys().isdisjoint(hashes)
        ):  # every hash new (the common case): the content rules only
            tokens = self.totals.tokens
            for cause, start, stop in spans:
                tokens[cause] += stop - start
                length -= stop - start
            tokens["cold"] += length
        else:
            self._count_each(hashes, spans, size)
        if spans and spans[0][0] == "history_rewritten":  # one more rewritten turn along the chain
            turns = min((turns >> 21) + 1, _TURN_MAX) << 21
            self.totals.rewritten_turn_counts[bisect_left(TURN_BUCKETS, turns >> 21)] += 1
            self.totals.rewritten_turn_sum += turns >> 21
        marked = (0, 0)
        if served:
            start, stop = served_span(run, count * size, served)
            marked = (start // size, -(-stop // size))
            diverged_span = next((span[1:] for span in spans if span[0] == "prefix_diverged"), None)
            if diverged_span is not None and order is not None:
                served_at = run.start if run.fronted else 0
                self._layouts(known[0], pairs, diverged_span, served_at, unit, count * size)
            elif diverged_span is not None and self._order is not None:
                self._layouts_as_estimated(diverged_span[1] - diverged_span[0])
            if not diverged and depth is not None and run.fronted:
                self._observe_offset(depth * size + run.start)
                if self.fields is not None:
                    self.fields.observe(event, run.start, served)
        if order is not None:
            order.learn(pairs)
            self._gaps.new.update(zip(pairs[1], map(sub, found[0][1:], found[0]), strict=False))
            self._gaps.rotate_if_full()
        self._track(hashes, depth, marked, 0, turns)
        return spans

    def _resident_lead(self, hashes: Sequence) -> int:
        """How many of a root event's first blocks are resident in this era (stored again: vLLM did
        not hit them); 0 when all are (the same prompt computed twice at once)."""
        era, new, old = self._era & _ERA_MASK, self._blocks.new, self._blocks.old
        lead = 0
        for block_hash in hashes:
            info = new.get(block_hash) or old.get(block_hash)
            if info is None or info & _REMOVED or (info >> 24) & _ERA_MASK != era:
                break
            lead += 1
        return lead if lead < len(hashes) else 0

    def _store_behind_resident(self, event: Event, lead: int) -> list[tuple[str, int, int]]:
        """A chain's root stored again over `lead` resident blocks: on a hybrid layout a prefix hits
        only where every group holds a part, and the window groups keep theirs at a prompt's end
        only (docs/kv-events.md, "Hybrid layouts: a prefix stored again"). The rest is classified
        as behind that cached prefix; the resident blocks take the cause of the divergence point
        (the span the rest starts with, or prefix_diverged: its front sits there), else cold."""
        hashes, size = event.block_hashes, event.block_size or len(event.token_ids) // len(event.block_hashes)
        self.resident -= lead  # stored again: counted once
        self._track(hashes[:lead], 0, (0, 0), tip=False)
        rest = Event("BlockStored", hashes[lead:], hashes[lead - 1], event.token_ids[lead * size :], size)
        spans = self._store(rest)
        cause = spans[0][0] if spans and (spans[0][1] == 0 or spans[0][0] == "prefix_diverged") else "cold"
        self.totals.tokens[cause] += lead * size
        return spans

    def _layouts(
        self, positions, pairs, span: tuple[int, int], run_start: int, unit: int, length: int
    ) -> None:
        """Of the prefix_diverged span, what a reorder to each layout would hit (layouts.py)."""
        end, template = layout_served(self._order, positions, pairs, span, run_start, unit, length)
        tokens = self.totals.reorder_tokens
        tokens["end"] += end
        tokens["after_template"] += template
        estimated = self._estimated
        estimated[0] += span[1] - span[0]
        estimated[1] += end
        estimated[2] += template

    def _layouts_as_estimated(self, diverged: int) -> None:
        """A prefix_diverged span the budget left unestimated: each layout's share of the estimated ones."""
        estimated, tokens = self._estimated, self.totals.reorder_tokens
        if estimated[0]:
            tokens["end"] += diverged * estimated[1] // estimated[0]
            tokens["after_template"] += diverged * estimated[2] // estimated[0]

    def _count_each(self, hashes: Sequence, spans: Sequence[tuple[str, int, int]], size: int) -> None:
        """Count blocks by the first rule that holds; `spans`: the content causes' tokens (cause,
        start, stop) among the event's, the rest `cold`."""
        totals, other = self.totals.tokens, self.other_replica
        count = len(hashes)
        shares = [(cause, overlaps(start, stop, size, count)) for cause, start, stop in spans]
        infos = self._blocks.get_many(hashes)
        # a unit whose window part expired: the blocks this very lookup's allocation evicted (removed
        # with nothing stored since) were resident when vLLM looked the prompt up, not hit for it
        expired = any(info is not None and info & _REMOVED and info & _WINDOW for info in infos)
        for i, (block_hash, info) in enumerate(zip(hashes, infos, strict=True)):
            if info is not None:
                if expired and info & _REMOVED and info >> 40 == self._stored:
                    totals["window_expired"] += size
                    continue
                totals[self._seen_before(info, size)] += size
            elif other is not None and other(block_hash):
                totals["other_replica"] += size
            else:
                rest = size
                for cause, tokens in shares:
                    totals[cause] += tokens[i]
                    rest -= tokens[i]
                totals["cold"] += rest

    def _content(
        self,
        known: tuple,
        size: int,
        length: int,
        root: bool,
        unit: int,
        depth: int | None,
        diverged: int,
        pairs: list | None,
        fresh_start: bool = False,
    ) -> tuple[KnownRun | None, int, list[tuple[str, int, int]]]:
        """The content causes of new tokens with known content, in order (docs/kv-events.md): the
        known run, the tokens a reorder serves, and the spans (cause, start, stop), apart and ascending."""
        positions, prints, found, made, elsewhere = known
        if made:
            # the answer's last, partial block was never stored as decode: its text is never learnt
            rewritten = rewritten_span(positions, [p in made for p in prints], length, unit, size)
            if rewritten is not None:
                return None, 0, [("history_rewritten", *rewritten)]
        if not found:  # known under another adapter or salt only, or too little generated text
            isolated = foreign_span(positions, elsewhere, length, unit) if elsewhere else None
            return None, 0, [] if isolated is None else [("identity_isolated", *isolated)]
        seen, ordered = None, False
        if pairs is not None and not diverged and len(prints) > 1:
            seen = list(map(found.__contains__, prints))
            decided, ordered = self._in_order(positions, prints, seen, pairs, size, unit, length, root)
            if decided is not None:
                return decided
        if found.issuperset(prints) and not root:  # all known (the common case when any is): the rest
            start = max(positions[0] - lead(positions, length), 0)
            run = KnownRun(start, length, front_without_anchors(start, root, unit, depth))
        else:
            seen = seen or list(map(found.__contains__, prints))
            run = first_known_run(positions, seen, length, root, unit, depth, fresh_start, size + K)
        served = served_tokens(run, length, unit, bool(diverged), size // 2)
        spans: list[tuple[str, int, int]] = []
        start = unit_shortfall_tokens(run, unit, bool(diverged))
        if start:
            spans.append(("below_hit_unit", 0, start))
        if served:
            low, stop = served_span(run, length, served)
            spans.append(("prefix_diverged", max(low, start), stop))
            start = stop
        elif run.fronted:
            start = max(run.start, start)
        if seen is not None and not diverged and not ordered:  # the anchor order saw no move
            moved = moved_span(positions, seen, length, unit, bisect_left(positions, run.start), start)
            if moved is not None:
                spans.append(("content_moved", *moved))
        return run, served, spans

    def _in_order(
        self,
        positions: Sequence[int],
        prints: Sequence[int],
        seen: list[bool],
        pairs: list,
        size: int,
        unit: int,
        length: int,
        root: bool,
    ) -> tuple[tuple | None, bool]:
        """The order-aware rules (content_causes.seams; docs/kv-events.md, "A field with no anchor at
        the seam"). The front is the unseen content before the first seen anchor, else the first seam
        when it lies in the first two blocks (a field after known content), else (no seam at all) a
        field with no anchor in the first block. A seam past the front joining a section of a hit
        unit or more: `content_moved` from the front on. Known content in order past the front, for
        4 hit units or more: `prefix_diverged` at any depth. In order at the divergence point with
        seams only further on: left to the rule without the order (a seam right at the divergence
        point shows no pair: a move there looks like sentences recombined behind an anchor-free
        field). Returns (the result or None, whether the anchor order was known: not when more pairs
        are new than seen in order, as when they were forgotten)."""
        first = seen.index(True)
        if root and first:  # any token before known content at a root is a per-request front: reorder.py
            return None, True
        if not root and (not first or positions[first - 1] - positions[0] < K):
            # sections moved from the divergence point on; unseen anchors before them all in one
            # window straddle the seam there, not a field (not at a root: a template's head, a field
            # and history behind it read as moved there, tests/analyzer/test_layout_estimates.py)
            walk = self._order.followers(pairs)  # each pair's follower; None: never seen
            pair_seen = [follower is not None for follower in walk[first:]]
            moved = moved_from_divergence(positions[first:], seen[first:], pair_seen, length, unit)
            if moved is not None:
                return (None, 0, [("content_moved", *moved)]), True
        paired = self._order.steps(pairs, first, seen)  # in order from `first` on (layouts.py)
        joins, last = seams(positions, seen, paired, first)
        # a field behind known content: its seam's first anchor in the divergence point's block, or the
        # seam in the first two
        fronted = first or (joins and (positions[joins[0] - 1] < size or positions[joins[0]] < 2 * size))
        if joins and not fronted:  # in order at the divergence point, seams only further on: the rule below
            return None, False  # (questions recombined from shared sentences behind a field with no anchor)
        moves = joins if first else joins[1:]
        if sum(paired[first:last]) < 2 * len(moves):
            return None, False
        end = stop_after(positions, last, length)
        if first:
            start = 0 if positions[first] < 2 * size else positions[first] - lead(positions, length)
        elif fronted:
            start = max(positions[joins[0]] - lead(positions, length), positions[joins[0] - 1] + 1)
        else:
            start = size
        if moves:  # a seam moves a section of a hit unit or more
            bounds = [positions[j] for j in joins] + [end]
            if any(bounds[i + 1] - bounds[i] >= unit for i in range(len(joins) - len(moves), len(joins))):
                moved = whole_units(start, end, unit)
                return (None if moved is None else (None, 0, [("content_moved", *moved)])), True
        if first or root:  # at a root an anchor-free front may come first: the rule below
            return None, True
        if not joins and end - start < min(FIELD_RUN_UNITS * unit, FIELD_RUN_TOKENS):  # recombined pieces
            return None, True
        if gap_changed(positions, self._gaps.get_many(pairs[1]), start, last):  # moved past the front
            moved = whole_units(start, end, unit)
            return (None if moved is None else (None, 0, [("content_moved", *moved)])), True
        run = KnownRun(start, end, True)
        served = served_tokens(run, length, unit, False, size // 2) if end > start else 0
        if served <= 0:
            return None, True
        return (run, served, [("prefix_diverged", *served_span(run, length, served))]), True

    def _known(
        self, tokens: Sequence[int], found: tuple[list[int], list[int]], length: int, rewritable: bool
    ) -> tuple | None:
        """The event's anchors (positions, fingerprints); the known ones among them; the ones of
        generated text (`rewritable`: behind a known cached prefix whose last block had been extended
        before, not an append to a finished chain's open tip); per anchor whether it was seen under another
        adapter or salt only (when nothing is known otherwise). None when none of these holds. The
        event's own fingerprints are added afterwards, so a block never matches itself. `found`: the
        event's anchors (positions, fingerprints)."""
        positions, prints = found
        content, foreign, generated = self._content_prints, self._foreign, self._generated
        found = content.new.intersection(prints)
        if content.old:
            found |= content.old.intersection(prints)
        content.new.update(prints)
        if len(content.new) >= content.half:
            content.rotate_if_full()
        made = _seen_in(generated, prints) if rewritable and (generated.new or generated.old) else None
        elsewhere = None
        if tokens and tokens[0] >> TAG_SHIFT:  # an adapter's or a salted chain's (units.py tags them)
            plain = anchors([token & TOKEN_MASK for token in tokens])[1]  # same positions: the low byte
            if not found:
                elsewhere = _seen_in(content, plain) | _seen_in(foreign, plain)
            foreign.update(plain)
        elif not found and (foreign.new or foreign.old):  # (no __len__ call: the common path)
            plain, elsewhere = prints, _seen_in(foreign, prints)
        if not (found or made or elsewhere):
            return None
        if positions[-1] >= length:  # anchors past the event's blocks (hostile): seen only
            cut = bisect_left(positions, length)
            positions, prints = positions[:cut], prints[:cut]
            found.intersection_update(prints)
            if not positions:
                return None
        flags = [p in elsewhere for p in plain[: len(positions)]] if elsewhere else None
        return positions, prints, found, made, flags

    def _seen_before(self, info: int, size: int) -> str:
        """The cause of a block whose hash is tracked: rules 1 and 2, or a duplicate store."""
        if info & _REMOVED:
            if info & _WINDOW:  # a bigger cache would not have kept it: no what-if estimate
                return "window_expired"
            self._estimate(info >> 40, size)
            return "evicted"
        if (info >> 24) & _ERA_MASK != self._era & _ERA_MASK:
            return "restart"
        self.resident -= 1  # still resident: re-stored by a concurrent request, counted once
        return "cold"

    def _estimate(self, removed_at: int, size: int) -> None:
        capacity = self.capacity_blocks or self.resident_peak
        stored_since = self._stored - removed_at
        for factor in CAPACITY_FACTORS:
            if capacity and stored_since <= (factor - 1) * capacity:
                self.totals.extra_hit_tokens[factor] += size
        host = self.host_tier_blocks
        # the evicted block itself takes one of the tier's places: it survives H - 1 later evictions
        if host is not None and stored_since < host:
            self.totals.host_hit_tokens += size
            self.totals.host_load_bytes += size * self.kv_bytes_per_token

    def _track(
        self,
        hashes: Sequence,
        depth: int | None,
        marked: tuple[int, int],
        decoded: int = 0,
        turns: int = 0,
        tip: bool = True,
    ) -> None:
        """Remember the event's blocks: resident, in this era, blocks marked[0] to marked[1] (not
        included) in a diverged known run, the last one an open tip."""
        count, stored = len(hashes), self._stored
        low, high = marked
        base = (self._era & _ERA_MASK) << 24 | (_DEPTH_KNOWN if depth is not None else 0) | turns
        depth = depth or 0
        if depth + count - 1 <= _DEPTH_MAX:  # depth and stamp both grow by one per block
            start = base | depth << 6 | (stored + 1) << 40
            values = list(range(start, start + count * _STEP, _STEP))
        else:
            values = [base | min(depth + i, _DEPTH_MAX) << 6 | (stored + 1 + i) << 40 for i in range(count)]
        for i in range(low, high):
            values[i] |= _DIVERGED
        values[-1] |= (_OPEN_TIP if tip else 0) | decoded
        blocks = self._blocks
        blocks.new.update(zip(hashes, values, strict=False))  # as many values as hashes
        if len(blocks.new) >= blocks.half:
            blocks.rotate_if_full()
        self._stored = stored + count
        self.resident += count
        if self.resident > self.resident_peak:
            self.resident_peak = self.resident

    def _remove(self, hashes: Sequence[int | bytes], why: int = 0) -> None:
        blocks, removed = self._blocks, 0
        mark = self._stored << 40 | _REMOVED | why  # the stamp of a removal, and its flags
        new, old, half = blocks.new, blocks.old, blocks.half
        for block_hash in hashes:  # inlined Generations.get/put
            info = new.get(block_hash) or old.get(block_hash)
            if info is not None and not info & _REMOVED:
                new[block_hash] = info & _KEEP_ON_REMOVE | mark
                removed += 1
                if len(new) >= half:
                    blocks.rotate_if_full()
                    new, old = blocks.new, blocks.old
        self.resident = max(self.resident - removed, 0)

    def _observe_offset(self, offset: int) -> None:
        totals = self.totals
        totals.offset_counts[bisect_left(OFFSET_BUCKETS, offset)] += 1  # first bucket with offset <= bound
        totals.offset_sum += offset


def _seen_in(prints: FingerprintSet, candidates: Sequence[int]) -> set[int]:
    found = prints.new.intersection(candidates)
    return found | prints.old.intersection(candidates) if prints.old else found
