"""The miss classifier on hand-built event streams: each cause, misaligned content, restarts, gaps, bounds."""

import random

import pytest

from kvcache_exporter.derive.attribution import OFFSET_BUCKETS, Attribution
from kvcache_exporter.sources.kv_events_decode import Batch, Event, Mark, SeqCursor

BS = 16
TEMPLATE = random.Random(1).choices(range(5, 50_000), k=200)


class Stream:
    """Builds vLLM-shaped batches: each prompt's full blocks in one BlockStored, hashed by chain."""

    def __init__(self, attribution: Attribution):
        self.attribution = attribution
        self.seq = 0
        self.cursor = SeqCursor()  # the sequence, read as the event view reads it in serve
        self.marks: list[Mark] = []

    def send(self, *events: Event, seq: int | None = None) -> None:
        self.seq = self.seq if seq is None else seq
        self.marks.append(self.cursor.advance(self.seq))
        self.attribution.apply(Batch(self.seq, 0.0, events), self.marks[-1])
        self.seq += 1

    def prompt(self, tokens: list[int], cached_blocks: int = 0) -> list[int]:
        """Store the blocks of `tokens` after the first `cached_blocks` (those hit); return all hashes."""
        hashes, parent = [], None
        for i in range(len(tokens) // BS):
            parent = hash((parent, tuple(tokens[i * BS : (i + 1) * BS])))
            hashes.append(parent)
        new = hashes[cached_blocks:]
        if new:
            before = hashes[cached_blocks - 1] if cached_blocks else None
            self.send(stored(new, tokens[cached_blocks * BS : len(hashes) * BS], before))
        return hashes


def stored(hashes, tokens, parent=None) -> Event:
    return Event("BlockStored", list(hashes), parent, list(tokens), BS)


def removed(hashes) -> Event:
    return Event("BlockRemoved", list(hashes))


def header(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(50_000, 60_000) for _ in range(length)]


@pytest.fixture
def stream() -> Stream:
    return Stream(Attribution(capacity_blocks=1000))


def tokens_by_cause(stream: Stream) -> dict[str, int]:
    return {cause: n for cause, n in stream.attribution.totals.tokens.items() if n}


def test_new_content_is_cold(stream):
    stream.prompt(header(random.Random(2), 64))
    assert tokens_by_cause(stream) == {"cold": 64}


def test_a_hash_removed_and_stored_again_was_evicted(stream):
    hashes = stream.prompt(TEMPLATE[:64])
    stream.send(removed(hashes[2:]))
    stream.prompt(TEMPLATE[:64], cached_blocks=2)
    assert tokens_by_cause(stream) == {"cold": 64, "evicted": 32}


def test_removals_take_effect_where_they_sit_in_a_batch(stream):
    """Consecutive BlockRemoved are applied together, never past the store or clear after them."""
    hashes = stream.prompt(TEMPLATE[:64])
    again = stored(hashes[:2], TEMPLATE[:32])
    stream.send(removed(hashes[:1]), removed(hashes[1:2]), again, removed(hashes[:2]), again)
    assert tokens_by_cause(stream) == {"cold": 64, "evicted": 64}  # each store saw the removals before it
    assert stream.attribution.resident == 4
    stream.send(removed(hashes[2:3]), Event("AllBlocksCleared"), stored(hashes[2:], TEMPLATE[32:64]))
    assert tokens_by_cause(stream) == {"cold": 64, "evicted": 64 + 16, "restart": 16}


def test_a_publisher_restart_turns_known_hashes_into_restart_misses(stream):
    stream.prompt(TEMPLATE[:64])
    stream.send(seq=0)  # seq back to 0: vLLM restarted, its cache is empty
    stream.prompt(TEMPLATE[:64])
    assert tokens_by_cause(stream) == {"cold": 64, "restart": 64}
    assert [m for m in stream.marks if m.restart] == [Mark(0, True)]
    stream.prompt(TEMPLATE[:96], cached_blocks=4)  # blocks never stored before the restart: cold
    assert tokens_by_cause(stream) == {"cold": 96, "restart": 64}


def test_all_blocks_cleared_is_a_restart_of_the_cache(stream):
    stream.prompt(TEMPLATE[:64])
    stream.send(Event("AllBlocksCleared"))
    stream.prompt(TEMPLATE[:64])
    assert tokens_by_cause(stream) == {"cold": 64, "restart": 64}


def test_the_same_template_behind_a_different_header_of_the_same_length_diverged(stream):
    rng = random.Random(3)
    stream.prompt(header(rng, 16) + TEMPLATE)
    stream.prompt(header(rng, 16) + TEMPLATE)
    # second prompt: the header block is cold, the 12 template blocks (192 tokens) are content seen before
    assert tokens_by_cause(stream) == {"cold": 208 + 16, "prefix_diverged": 192}


@pytest.mark.parametrize("first, second", [(5, 11), (13, 20), (3, 29)])
def test_misaligned_shared_content_is_matched_and_its_offset_measured(stream, first, second):
    rng = random.Random(first)
    stream.prompt(header(rng, first) + TEMPLATE)
    stream.prompt(header(rng, second) + TEMPLATE)
    second_prompt_blocks = (second + len(TEMPLATE)) // BS
    diverged = stream.attribution.totals.tokens["prefix_diverged"]
    assert diverged >= (second_prompt_blocks - 2) * BS  # all but the header's block and at most one more
    totals = stream.attribution.totals
    assert sum(totals.offset_counts) == 1
    assert abs(totals.offset_sum - second) <= 12  # documented error: up to 3/4 of an anchor spacing


def test_tokens_past_an_events_blocks_are_remembered_but_classify_nothing(stream):
    """A BlockStored whose token ids run past its blocks (not vLLM's shape): the extra content
    is fingerprinted for later events, but no block is judged by it."""
    rng = random.Random(9)
    stream.send(stored([1, 2], header(rng, 32) + TEMPLATE[:64]))  # 2 blocks, 96 token ids
    assert tokens_by_cause(stream) == {"cold": 32}
    stream.send(stored([3, 4], header(rng, 32) + TEMPLATE[:64]))  # seen content only past its blocks
    assert tokens_by_cause(stream) == {"cold": 64}
    stream.prompt(header(rng, 5) + TEMPLATE[:64])  # the template, now misaligned, was seen
    assert tokens_by_cause(stream)["prefix_diverged"] >= 48
    before = dict(stream.attribution.totals.tokens)
    stream.send(stored([5, 6], [1000] * 48 + TEMPLATE[:64]))  # blocks without anchors, seen ones past them
    assert {c: n - before[c] for c, n in stream.attribution.totals.tokens.items() if n != before[c]} == {
        "cold": 32
    }


def test_random_prompts_never_read_as_diverged(stream):
    rng = random.Random(4)
    for _ in range(200):
        stream.prompt(header(rng, rng.randrange(32, 200)))
    assert tokens_by_cause(stream).keys() == {"cold"}


def test_decode_filled_blocks_are_not_prompt_misses(stream):
    hashes = stream.prompt(TEMPLATE[:48])
    stream.send(stored([777], TEMPLATE[48:64], hashes[-1]))  # the request's decode filled a block
    stream.send(stored([778], TEMPLATE[64:80], 777))  # and the next one
    assert tokens_by_cause(stream) == {"cold": 48}
    assert stream.attribution.totals.decode_tokens == 32


def test_a_prompt_that_extends_a_cached_chain_by_several_blocks_is_a_prompt_miss(stream):
    stream.prompt(TEMPLATE[:48])
    stream.prompt(TEMPLATE[:96], cached_blocks=3)
    assert tokens_by_cause(stream) == {"cold": 96}
    assert stream.attribution.totals.decode_tokens == 0


def test_other_replica_comes_only_from_the_hook():
    elsewhere = set()
    stream = Stream(Attribution(other_replica=elsewhere.__contains__))
    hashes = Stream(Attribution()).prompt(TEMPLATE[:64])
    elsewhere.update(hashes[:2])
    stream.prompt(TEMPLATE[:64])
    assert tokens_by_cause(stream) == {"other_replica": 32, "cold": 32}


def test_a_gap_in_sequence_numbers_is_counted_never_attributed(stream):
    stream.prompt(TEMPLATE[:32])
    stream.send(seq=10)
    assert stream.marks[-1] == Mark(9, False)
    stream.prompt(TEMPLATE[:32], cached_blocks=2)  # no new era: what was stored before still hits
    assert tokens_by_cause(stream) == {"cold": 32}


def test_state_stays_within_its_bounds():
    stream = Stream(Attribution(max_blocks=100, max_fingerprints=50))
    rng = random.Random(5)
    for _ in range(300):
        hashes = stream.prompt(header(rng, 160))
        stream.send(removed(hashes[:5]))
    blocks, prints = stream.attribution.tracked
    assert blocks <= 100 and prints <= 50
    assert stream.attribution.totals.tokens["cold"] == 300 * 160


def test_one_event_larger_than_every_bound_leaves_the_state_within_them():
    """A single BlockStored of 400 blocks (vLLM stores a long prompt in one): every map it fills at
    once (blocks, content fingerprints, the anchor order, the pair gaps) keeps its bound."""
    stream = Stream(Attribution(max_blocks=100, max_fingerprints=256))
    rng = random.Random(8)
    for _ in range(3):
        stream.prompt(header(rng, 400 * BS))
        blocks, prints = stream.attribution.tracked
        assert blocks <= 100 and prints <= 256, (blocks, prints)


def test_what_if_capacity_counts_evictions_a_bigger_cache_would_have_kept():
    stream = Stream(Attribution(capacity_blocks=4))
    hashes = stream.prompt(TEMPLATE[:32])
    stream.send(removed(hashes))
    stream.prompt(header(random.Random(6), 64))  # 4 blocks stored after the eviction: 2x keeps it (4 <= 4)
    stream.prompt(TEMPLATE[:32])
    extra = stream.attribution.totals.extra_hit_tokens
    assert extra == {2: 32, 4: 32}
    stream.send(removed(hashes))
    stream.prompt(header(random.Random(7), 16 * 9))  # 9 blocks: only 4x (12) would have kept it
    stream.prompt(TEMPLATE[:32])
    assert extra == {2: 32, 4: 64}


def test_offsets_land_in_the_documented_buckets(stream):
    rng = random.Random(8)
    stream.prompt(header(rng, 40) + TEMPLATE)
    stream.prompt(header(rng, 100) + TEMPLATE)
    counts = stream.attribution.totals.offset_counts
    assert len(counts) == len(OFFSET_BUCKETS) + 1
    assert counts[OFFSET_BUCKETS.index(128)] == 1  # 100 tokens in: the (64, 128] bucket
