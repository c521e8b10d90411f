"""The miss-ratio curve in one pass (stack distances over vLLM's block pool), and the exact replay it is
checked against.

Why a stack distance exists for vLLM's pool, replayed one request at a time (docs/analyzer.md derives it):
every block is free between requests, so the free queue is the cache. A finished request frees its blocks
tail first (`free_blocks(reversed(blocks))`): hashed ones go to the back in that order, its unhashed last
block goes to the front as an empty slot. New blocks are popped from the front. So the hashed blocks form
one LRU list, ordered by last use, a request's first block being its most recent, and chained hashes make a
request's blocks evicted tail first. Block `b` is still cached at capacity C (usable blocks, the null block
excluded) iff the blocks used since `b`'s last use, plus the empty slot the previous request took for its
partial block, number fewer than C. That count is `b`'s distance; a request hits the leading blocks whose
running maximum of distance is below C. One pass over the trace therefore gives the hits at every C.

Groups: a Mooncake trace block of 512 tokens is 32 vLLM blocks of 16 that are always used together; block
j of a group has distance (group's distance) + j, so the pass works per group and never per vLLM block.
A prompt ending inside a group uses only its first blocks; the rest keep their older place (segments).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from ..routing import route_all
from ..simulator.blocks import BlockPool
from .blocktrace import BlockRequest, fresh_keys, prompt_keys, total_blocks

CAUSES = ("cold", "evicted", "restart", "other_replica")  # a block's history alone, without its content


def curve_sizes(num_gpu_blocks: int, steps_per_doubling: int = 2) -> list[int]:
    """1/8x to 8x the given pool, `steps_per_doubling` points per factor of two."""
    span = 3 * steps_per_doubling
    sizes = {max(2, round(num_gpu_blocks * 2 ** (k / steps_per_doubling))) for k in range(-span, span + 1)}
    return sorted(sizes)


def route_blocks(requests: Sequence[BlockRequest], replicas: int, routing: str) -> list[int]:
    return route_all((r.session for r in requests), replicas, routing)


def restart_points(requests: Sequence[BlockRequest], restart_at: Sequence[int] = ()) -> set[int]:
    """Request positions before which every replica's cache is emptied."""
    points = {p for p in restart_at if 0 < p < len(requests)}
    previous = None
    for n, r in enumerate(requests):
        if r.instance is not None:
            if previous is not None and r.instance != previous:
                points.add(n)
            previous = r.instance
    return points


class Fenwick:
    __slots__ = ("tree",)

    def __init__(self, size: int) -> None:
        self.tree = [0] * (size + 1)

    def add(self, i: int, value: int) -> None:
        tree, n = self.tree, len(self.tree)
        while i < n:
            tree[i] += value
            i += i & -i

    def prefix(self, i: int) -> int:
        tree, total = self.tree, 0
        while i > 0:
            total += tree[i]
            i &= i - 1
        return total


@dataclass
class Stack:
    """One replica's LRU stack since its last restart. Each use of a group takes one time slot holding
    its width. A later, narrower use moves only the group's head, so a group is its head (blocks from 0,
    at its latest use) and, rarely, a tail of older segments `(slot, first block, end)`."""

    size: int
    tree: Fenwick = field(init=False)
    last: dict[int, tuple[int, int]] = field(default_factory=dict)
    """group -> (slot of its latest use, width then)"""
    tails: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)
    clock: int = 0
    total: int = 0
    transient: int = 0

    def __post_init__(self) -> None:
        self.tree = Fenwick(self.size)

    def _raw(self, group: int) -> list[tuple[int, int, int]]:
        head = self.last.get(group)
        if head is None:
            return []
        return [(head[0], 0, head[1]), *self.tails.get(group, ())]

    def segments(self, group: int) -> list[tuple[int, int, int]]:
        """(distance of the segment's first block, first block, end) for each segment of `group`."""
        base = self.total + self.transient
        if group not in self.tails:  # the common case: one segment, or none
            head = self.last.get(group)
            return [] if head is None else [(base - self.tree.prefix(head[0]), 0, head[1])]
        return [(base - self.tree.prefix(slot), a, b) for slot, a, b in self._raw(group)]

    def widest(self, group: int) -> int:
        """The most of the group's blocks any use cached since the restart (an unbounded pool holds them)."""
        tail = self.tails.get(group)
        if tail:
            return tail[-1][2]
        head = self.last.get(group)
        return head[1] if head else 0

    def use(self, group: int | None, width: int) -> None:
        self.clock += 1
        self.tree.add(self.clock, width)
        self.total += width
        if group is None or not width:
            return
        head = self.last.get(group)
        if head is not None and head[1] <= width and group not in self.tails:  # the common case
            self.tree.add(head[0], -head[1])
            self.total -= head[1]
            self.last[group] = (self.clock, width)
            return
        rest = []
        for slot, a, b in self._raw(group):
            moved = min(b, width) - a
            if moved > 0:
                self.tree.add(slot, -moved)
                self.total -= moved
                a += moved
            if a < b:
                rest.append((slot, a, b))
        self.last[group] = (self.clock, width)
        if rest:
            self.tails[group] = rest
        else:
            self.tails.pop(group, None)


@dataclass
class Curve:
    block_size: int
    num_gpu_blocks: int
    prompt_tokens: int
    sizes: list[int]
    hit_tokens: list[int]
    """at each size"""
    unbounded_hit_tokens: int
    observed_hit_tokens: int
    """at num_gpu_blocks"""
    per_request_hits: list[int]
    """hit tokens of each request at num_gpu_blocks"""
    misses_by_cause: dict[str, int]
    """computed prompt tokens at num_gpu_blocks by cause; partial_block: tokens in no hittable block"""
    restarts: int
    fits_from: int
    """the smallest size every request fits in (smaller sizes would reject some)"""

    def ratio(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict:
        return {
            "points": [
                {"num_gpu_blocks": s, "hit_ratio": round(self.ratio(h), 6), "fits": s >= self.fits_from}
                for s, h in zip(self.sizes, self.hit_tokens, strict=True)
            ],
            "observed_hit_ratio": round(self.ratio(self.observed_hit_tokens), 6),
            "unbounded_hit_ratio": round(self.ratio(self.unbounded_hit_tokens), 6),
            "misses_by_cause": self.misses_by_cause,
            "restarts": self.restarts,
        }


@dataclass
class _Tally:
    limit: int
    observed: int
    diff: list[int] = field(init=False)
    point: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.diff = [0] * (self.limit + 2)
        self.point = [0] * (self.limit + 2)

    def run(self, lo: int, hi: int) -> None:
        """One block at each distance lo..hi."""
        limit = self.limit
        if lo >= limit:
            self.point[limit] += hi - lo + 1
        elif hi >= limit:
            self.diff[lo] += 1
            self.diff[limit] -= 1
            self.point[limit] += hi - limit + 1
        else:
            self.diff[lo] += 1
            self.diff[hi + 1] -= 1

    def hits_below(self) -> list[int]:
        """hits_below()[c] = blocks with distance < c."""
        counts = [d + p for d, p in zip(accumulate(self.diff), self.point, strict=True)]
        return [0, *accumulate(counts)]


def stack_curve(
    requests: Sequence[BlockRequest],
    block_size: int,
    num_gpu_blocks: int,
    sizes: Sequence[int] | None = None,
    replicas: int = 1,
    routing: str = "round-robin",
    restart_at: Sequence[int] = (),
    progress=None,
) -> Curve:
    sizes = sorted(sizes or curve_sizes(num_gpu_blocks))
    bs = block_size
    tally = _Tally(max(max(sizes), num_gpu_blocks), num_gpu_blocks - 1)
    entries = sum(len(r.groups) + 1 for r in requests) + 1
    stacks = [Stack(entries) for _ in range(replicas)]
    before_restart: list[set[int]] = [set() for _ in range(replicas)]
    restarts = restart_points(requests, restart_at)
    causes = dict.fromkeys((*CAUSES, "partial_block"), 0)
    per_request, prompt_tokens, unbounded = [], 0, 0
    for n, (r, replica) in enumerate(zip(requests, route_blocks(requests, replicas, routing), strict=True)):
        if progress is not None:
            progress("curve", n + 1)
        if n in restarts:
            for i, stack in enumerate(stacks):
                before_restart[i].update(stack.last)
            stacks = [Stack(entries) for _ in range(replicas)]
        stack = stacks[replica]
        hits = _lookup(r, stack, tally, bs)
        unbounded += _unbounded_hits(r, stack, bs)
        per_request.append(hits * bs)
        prompt_tokens += r.prompt_tokens
        _classify(r, replica, hits, stacks, before_restart[replica], causes, bs)
        _use(r, stack, bs)
    below = tally.hits_below()
    return Curve(
        bs,
        num_gpu_blocks,
        prompt_tokens,
        list(sizes),
        [below[s - 1] * bs for s in sizes],
        unbounded * bs,
        sum(per_request),
        per_request,
        causes,
        len(restarts),
        max((total_blocks(r, bs) for r in requests), default=1) + 1,
    )


def _lookup(r: BlockRequest, stack: Stack, tally: _Tally, bs: int) -> int:
    """Tally the distances of r's hittable blocks; return its hits (in blocks) at the observed size."""
    hittable = (r.prompt_tokens - 1) // bs  # vLLM always computes the last prompt token
    running, index, hits, observed = -1, 0, 0, tally.observed
    for group, width in zip(r.groups, r.widths, strict=True):
        eligible = min(width, hittable - index)
        if eligible <= 0:
            break
        covered = 0
        for base, a, b in stack.segments(group):
            k = min(b, eligible) - a
            if k <= 0:
                break
            flat = min(k, max(0, running - base + 1))  # blocks whose distance the running maximum hides
            if flat:
                tally.point[min(running, tally.limit)] += flat
            if flat < k:
                tally.run(base + flat, base + k - 1)
            if running < observed:
                hits += min(k, max(0, observed - base))
            running = max(running, base + k - 1)
            covered = a + k
        if covered < eligible:
            break
        index += width
    return hits


def _unbounded_hits(r: BlockRequest, stack: Stack, bs: int) -> int:
    """r's hits (in blocks) if nothing were ever evicted: up to each group's widest use since the restart."""
    hittable, index, hits = (r.prompt_tokens - 1) // bs, 0, 0
    for group, width in zip(r.groups, r.widths, strict=True):
        eligible = min(width, hittable - index)
        if eligible <= 0:
            break
        k = min(stack.widest(group), eligible)
        hits += k
        if k < eligible:
            break
        index += width
    return hits


def _classify(r, replica, hits, stacks, before_restart, causes, bs) -> None:
    """Blame each computed prompt token on one cause, by what its block was (the live rules' order). The
    content causes need the tokens: a token trace's table is the sidecar's own (live.py) instead."""
    hittable = (r.prompt_tokens - 1) // bs
    causes["partial_block"] += r.prompt_tokens - hittable * bs
    index = 0
    own = stacks[replica]
    for group, width in zip(r.groups, r.widths, strict=True):
        for j in range(max(index, hits), min(index + width, hittable)):
            causes[_cause(group, j - index, own, stacks, replica, before_restart)] += bs
        index += width
        if index >= hittable:
            break


def _cause(group, j, own, stacks, replica, before_restart) -> str:
    if j < own.widest(group):
        return "evicted"
    if group in before_restart:
        return "restart"
    if any(i != replica and j < s.widest(group) for i, s in enumerate(stacks)):
        return "other_replica"
    return "cold"


def _use(r: BlockRequest, stack: Stack, bs: int) -> None:
    """Free r's blocks as vLLM does, tail first: the blocks holding output tokens, then the prompt's."""
    hashed = (r.prompt_tokens + r.max_tokens - 1) // bs
    stack.use(None, max(hashed - sum(r.widths), 0))
    for group, width in zip(reversed(r.groups), reversed(r.widths), strict=True):
        stack.use(group, width)
    stack.transient = 1 if (r.prompt_tokens + r.max_tokens - 1) % bs else 0


@dataclass
class PoolReplay:
    hit_tokens: int
    prompt_tokens: int
    rejected: int
    per_request_hits: list[int]

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def pool_replay(
    requests: Sequence[BlockRequest],
    block_size: int,
    num_gpu_blocks: int,
    replicas: int = 1,
    routing: str = "round-robin",
    restart_at: Sequence[int] = (),
) -> PoolReplay:
    """The exact replay, one request at a time per replica, through the simulator's BlockPool (vLLM's
    free queue, eviction and hashing), one vLLM block at a time."""
    bs = block_size

    def fresh() -> list[BlockPool]:
        return [BlockPool(num_gpu_blocks, bs) for _ in range(replicas)]

    pools, restarts, unique = fresh(), restart_points(requests, restart_at), fresh_keys()
    hits, prompt_tokens, rejected = [], 0, 0
    for n, (r, replica) in enumerate(zip(requests, route_blocks(requests, replicas, routing), strict=True)):
        if n in restarts:
            pools = fresh()
        pool = pools[replica]
        needed = total_blocks(r, bs)
        if needed > num_gpu_blocks - 1:
            rejected += 1
            hits.append(0)
            continue
        keys = prompt_keys(r)
        hashed = (r.prompt_tokens + r.max_tokens - 1) // bs
        keys += [next(unique) for _ in range(hashed - len(keys))]
        hit = pool.longest_cached_prefix(keys[: (r.prompt_tokens - 1) // bs])
        pool.touch(hit)
        blocks = hit + pool.get_new_blocks(needed - len(hit))
        pool.cache_full_blocks(blocks, keys, (), len(hit), hashed)
        pool.free_blocks(reversed(blocks))
        pool.events.clear()
        hits.append(len(hit) * bs)
        prompt_tokens += r.prompt_tokens
    return PoolReplay(sum(hits), prompt_tokens, rejected, hits)
