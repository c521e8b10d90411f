"""The order-aware rules (issue 29): a field or a seam with no anchor of its own, told by the order the
anchors were seen in, and shared starts short of a unit that no anchor saw. Hand-built streams laid out
as vLLM stores them; each test fails without its rule."""

from __future__ import annotations

import random

from kvcache_exporter.derive.attribution import Attribution
from kvcache_exporter.derive.content_causes import moved_from_divergence, seams
from kvcache_exporter.derive.fingerprints import SELECTED, FingerprintSet, K, prefix_prints, shared_prefix
from kvcache_exporter.sources.kv_events_decode import Event
from tests.derive.test_attribution import BS, Stream, tokens_by_cause
from tests.derive.test_attribution_causes import ask, joined, text

ANCHOR = 256 * 7 + min(SELECTED)  # a token that starts an anchor


def no_anchor(seed: int, n: int) -> list[int]:
    """Tokens with no anchor among them: ids whose low byte is never a selected one (0-3)."""
    rng = random.Random(seed)
    return [rng.randrange(1, 200) * 256 + rng.randrange(0, 4) for _ in range(n)]


def test_a_field_with_no_anchor_deep_in_the_prompt_is_prefix_diverged():
    """A long shared system prompt (far past the first two units), a per-request field of ids no
    anchor can fall on, then shared content: every anchor is known and in the order seen before;
    only the block hash shows the change. Without the anchor order this read cold."""
    stream, held = Stream(Attribution()), set()
    system, rest = text(1, 10 * BS + 5), text(2, 30 * BS)
    for seed in range(6):
        ask(stream, system + no_anchor(seed, 6) + rest, held)
    tokens = tokens_by_cause(stream)
    assert tokens.keys() == {"cold", "prefix_diverged"}, tokens
    assert tokens["prefix_diverged"] >= 5 * 26 * BS, tokens  # all but the first request's, bar a block or two


def test_quotes_in_appended_turns_are_named_as_without_the_order_rule():
    """Append-only turns of one chat, each new message quoting an earlier one: the order rule adds
    nothing (no move, no more diverged tokens) to what the rule without the anchor order says."""

    def causes(attribution: Attribution) -> dict[str, int]:
        stream, held = Stream(attribution), set()
        prompt = text(3, 8 * BS + 3)
        for seed in range(5):
            prompt = prompt + text(100 + seed, 3 * BS) + prompt[40 : 40 + 2 * BS]
            ask(stream, prompt, held)
        return tokens_by_cause(stream)

    assert causes(Attribution()) == causes(Attribution(reorder_layouts=False))


def test_sections_swapped_with_no_anchor_at_the_seams_are_content_moved():
    """Documents whose seams no anchor window straddles (each ends with an anchor whose window ends
    with it): the anchors are all known, their pairs across the seams are not. The first block after
    the cached prefix holds the end of the first document (12 tokens, that anchor among them), so the
    seam at the divergence point shows."""

    def moved(attribution: Attribution) -> float:
        stream, held = Stream(attribution), set()
        system = text(4, 5 * BS + 3)
        docs = [[*text(20 + i, 6 * BS), ANCHOR, *no_anchor(30 + i, K - 1)] for i in range(4)]
        ask(stream, system + joined(docs) + text(5, 2 * BS), held)
        before = stream.attribution.totals.prompt_miss_tokens
        ask(stream, system + joined(docs[i] for i in (0, 2, 1, 3)) + text(5, 2 * BS), held)
        computed = stream.attribution.totals.prompt_miss_tokens - before
        return stream.attribution.totals.tokens["content_moved"] / computed

    assert moved(Attribution()) >= 0.8
    assert moved(Attribution(reorder_layouts=False)) == 0  # without the anchor order: no seam shows


def test_a_shared_start_short_of_a_unit_with_no_anchor_is_below_hit_unit():
    """Two chains sharing their first 12 tokens (no anchor can see 12 tokens: K = 8 from an anchor
    one in 16) of a 16-token unit: the shared start can never hit."""
    stream = Stream(Attribution())
    shared = no_anchor(7, 12)
    stream.prompt(shared + text(8, 3 * BS))
    stream.prompt(shared + text(9, 3 * BS))
    tokens = tokens_by_cause(stream)
    assert tokens["below_hit_unit"] == 12, tokens


def test_a_shared_start_shorter_than_k_is_a_role_header_not_a_cause():
    stream = Stream(Attribution())
    stream.prompt([1, 2, 3, 4, 5, *text(8, 3 * BS)])
    stream.prompt([1, 2, 3, 4, 5, *text(9, 3 * BS)])
    assert tokens_by_cause(stream).keys() == {"cold"}


def test_shared_prefix_is_the_longest_prefix_seen():
    seen = FingerprintSet(100)
    tokens = list(range(100, 200))
    lengths, prints = prefix_prints(tokens, 32)
    assert lengths[0] >= K and lengths[-1] < 32
    seen.update(prefix_prints(tokens[:20] + [7] * 12, 32)[1])
    assert shared_prefix(lengths, prints, seen) == 20


def test_seams_are_new_pairs_and_short_unseen_gaps():
    positions = [0, 16, 32, 48, 64, 80, 200]
    seen = [True, True, False, True, True, True, True]
    paired = [True, False, False, True, False, True]
    # 0->16 in order; 16 -> (32 unseen) -> 48 a short gap: a seam; 48->64 in order; 64->80 a new pair;
    # 80 -> 200: 120 tokens with no anchor and a new pair... here seen in order (paired[5]).
    joins, last = seams(positions, seen, paired, 0)
    assert joins == [3, 5] and last == 6
    paired[5] = False  # a new pair that far apart: unique content ends the stretch
    assert seams(positions, seen, paired, 0) == ([3, 5], 5)


def test_sections_moved_from_the_divergence_point_on_are_content_moved():
    """Documents B A D C after A B C D, behind a cached system prompt of whole blocks, no anchor window
    straddling a seam (each document ends with an anchor whose window ends with it): the first seam
    sits at the divergence point, so no pair shows it; the new pairs B->A, A->D and D->C further on
    do. Before this rule: in order at the divergence point with seams only further on was left to
    the rule without the order, which saw no junction (cold)."""
    stream, held = Stream(Attribution()), set()
    system = text(40, 5 * BS)
    docs = [[*text(41 + i, 3 * BS), ANCHOR, *no_anchor(45 + i, K - 1)] for i in range(4)]
    ask(stream, system + joined(docs) + text(45, 2 * BS), held)
    before = stream.attribution.totals.prompt_miss_tokens
    moved_before = stream.attribution.totals.tokens["content_moved"]
    ask(stream, system + joined(docs[i] for i in (1, 0, 3, 2)) + text(45, 2 * BS), held)
    computed = stream.attribution.totals.prompt_miss_tokens - before
    moved = stream.attribution.totals.tokens["content_moved"] - moved_before
    assert moved >= 0.8 * computed, tokens_by_cause(stream)


def test_a_move_whose_first_seam_an_unseen_anchor_straddles_is_content_moved():
    """As above, the system prompt's last 4 tokens in the first new block, an anchor among them: its
    window straddles the seam at the divergence point, so the new tokens start with one unseen anchor
    (a front, read alone: prefix_diverged). One window of unseen anchors is a seam, not a field."""
    stream, held = Stream(Attribution()), set()
    system = [*text(46, 5 * BS), ANCHOR, *no_anchor(47, 3)]
    docs = [[*text(48 + i, 3 * BS), ANCHOR, *no_anchor(52 + i, K - 1)] for i in range(4)]
    ask(stream, system + joined(docs) + text(56, 2 * BS), held)
    before = dict(stream.attribution.totals.tokens)
    ask(stream, system + joined(docs[i] for i in (1, 0, 3, 2)) + text(56, 2 * BS), held)
    tokens = {c: n - before[c] for c, n in stream.attribution.totals.tokens.items() if n != before[c]}
    assert tokens.keys() == {"content_moved"}, tokens  # before: the front read alone, 48 tokens cold


def test_one_field_after_known_content_is_not_a_move():
    """A per-request field between a shared template and known content in its old order: one seam
    (the field), never content_moved."""
    stream, held = Stream(Attribution()), set()
    template, rest = text(50, 5 * BS), text(51, 12 * BS)
    for seed in range(5):
        ask(stream, template + text(60 + seed, 10) + rest, held)
    assert stream.attribution.totals.tokens["content_moved"] == 0, tokens_by_cause(stream)


def test_moved_from_divergence_needs_two_seams_and_sections_that_are_not_sentences():
    positions = [0, 16, 32, 48, 64, 80, 96, 112]
    seen = [True] * 8
    paired = [True, True, False, True, True, False, True]  # seams before 48 and before 96: 48 tokens apart
    assert moved_from_divergence(positions, seen, paired, 128, 32) == (0, 128)
    assert moved_from_divergence(positions, seen, paired, 128, 128) == (0, 128)  # 48 >= 2 spacings
    close = [True, True, False, False, True, True, True]  # seams before 48 and 64: 16 tokens apart
    assert moved_from_divergence(positions, seen, close, 128, 32) == (0, 128)  # half of a 32-token unit
    assert moved_from_divergence(positions, seen, close, 128, 64) is None  # a sentence, not a section
    one = [True, True, False, True, True, True, True]
    assert moved_from_divergence(positions, seen, one, 128, 32) is None  # one seam: a field
    assert moved_from_divergence(positions, [False, *seen[1:]], paired, 128, 32) is None  # a front first


def test_one_seam_two_units_in_with_known_content_to_the_end_is_two_sections_swapped():
    """Real vLLM (tiny Llama, documents_reranked/tools_reordered): two adjacent sections swapped, the
    second seam past the stored blocks: known content from the divergence point, one never-seen pair
    100 tokens in, known content to the last anchor. A field behind known content sits in the first
    block; two units of known content there did not follow the cached prefix (or they would have
    hit). It read as a field (`prefix_diverged`)."""
    positions = list(range(0, 240, 16))
    seen = [True] * len(positions)
    seam = [p != 96 for p in positions[:-1]]  # 96 -> 112 never seen next to each other
    assert moved_from_divergence(positions, seen, seam, 256, 32) == (0, 256)
    assert moved_from_divergence(positions, seen, seam, 256, 64) is None  # 108 tokens: short of 2 units
    near_end = [p != 208 for p in positions[:-1]]
    assert moved_from_divergence(positions, seen, near_end, 256, 48) is None  # 36 tokens after: under a unit
    unique_after = [*seen[:-3], False, False, False]  # the stretch ends at unique content
    assert moved_from_divergence(positions, unique_after, seam, 256, 32) is None


def test_a_root_stored_again_over_resident_blocks_is_classified_behind_them():
    """A hybrid layout hits a prefix only where its window groups hold a part, kept at a prompt's end
    only: a field after a shared system prompt makes vLLM store the whole prompt again from the root,
    its first blocks (the system prompt) still resident with the same hashes. The rest is read as
    behind that prefix (known content behind a field: prefix_diverged) and the resident blocks take
    the divergence point's cause. Before: the resident blocks read cold (a concurrent store) and the
    field a junction between known runs (content_moved)."""
    stream = Stream(Attribution())
    system, rest = text(70, 6 * BS), text(71, 14 * BS)
    stream.prompt(system + text(72, 9) + rest)
    before = dict(stream.attribution.totals.tokens)
    stream.prompt(system + text(73, 9) + rest)
    tokens = {c: n - before[c] for c, n in stream.attribution.totals.tokens.items() if n != before[c]}
    assert max(tokens, key=tokens.__getitem__) == "prefix_diverged", tokens
    assert tokens["prefix_diverged"] >= 6 * BS + 12 * BS, tokens  # the system prompt and most of the rest
    assert stream.attribution.resident == 20 + 14, stream.attribution.resident  # the 6 stored again: once


def test_the_same_root_computed_twice_at_once_stays_cold():
    """Every block of the root event resident (two requests computing the same new prompt in one
    step): nothing to classify behind, cold as before."""
    stream = Stream(Attribution())
    prompt = text(74, 8 * BS)
    stream.prompt(prompt)
    stream.prompt(prompt)
    assert tokens_by_cause(stream).keys() == {"cold"}


def test_one_seam_after_a_field_is_not_read_as_two():
    """A field after the system prompt whose last value held an anchor and this one none: the pair
    across it (the system prompt's last anchor, the rest's first) is new, a seam. The step after it
    is a pair seen before, in a context never seen (the seam's): read in context it was a second
    seam, and the known rest behind it a moved section (content_moved). It is the field."""
    stream, held = Stream(Attribution()), set()
    system = [*text(80, 5 * BS), ANCHOR, *no_anchor(81, K - 1)]
    rest = text(82, 12 * BS)
    ask(stream, [*system, *no_anchor(83, 3), ANCHOR + 256, *no_anchor(84, 3), *rest], held)
    before = dict(stream.attribution.totals.tokens)
    ask(stream, system + no_anchor(85, 6) + rest, held)
    tokens = {c: n - before[c] for c, n in stream.attribution.totals.tokens.items() if n != before[c]}
    assert tokens.get("content_moved", 0) == 0 and tokens["prefix_diverged"] >= 10 * BS, tokens


def test_one_unit_all_known_behind_a_new_start_is_prefix_diverged():
    """A 64-token hit unit (DeepSeek-V4's is 256) stored alone at a root, every anchor known, its hash
    new: either its last tokens differ (shared content short of the unit: below_hit_unit) or its
    front does. A front never seen as a chain's start (the prefix fingerprints) is a per-request
    field: prefix_diverged. Before: below_hit_unit either way."""
    unit = 64

    def causes(*prompts: list[int]) -> dict[str, int]:
        stream = Stream(Attribution())
        for prompt in prompts[:-1]:
            stream.send(Event("BlockStored", [hash(tuple(prompt))], None, prompt, unit))
        before = dict(stream.attribution.totals.tokens)
        last = prompts[-1]
        stream.send(Event("BlockStored", [hash(tuple(last))], None, last, unit))
        return {c: n - before[c] for c, n in stream.attribution.totals.tokens.items() if n != before[c]}

    content = text(95, unit)
    fronted = causes(no_anchor(96, 5) + content[:59], no_anchor(97, 5) + content[:59])
    assert max(fronted, key=fronted.__getitem__) == "prefix_diverged", fronted
    ended = causes(content[:58] + no_anchor(98, 6), content[:58] + no_anchor(99, 6))
    assert max(ended, key=ended.__getitem__) == "below_hit_unit", ended


def test_a_section_with_no_anchor_moved_shows_as_a_pair_further_apart_or_closer():
    """Real vLLM (tiny Llama, tools_reordered/documents_reranked): a section with no anchor of its own
    moved to the front. Every anchor is known and every pair in the order seen before; only the
    distances changed: the pair around the section's old place is closer by its length. A field sits
    in the divergence point's block; a changed distance past it is a second change: a move. It read
    as a field behind known content (`prefix_diverged`)."""
    stream, held = Stream(Attribution()), set()
    system = text(70, 5 * BS - 5) + no_anchor(69, K)  # no anchor window reaches past a section's end
    docs = [[*text(71 + i, 4 * BS), ANCHOR, *no_anchor(75 + i, K - 1)] for i in range(3)]
    docs.insert(1, no_anchor(72, 40))
    ask(stream, system + joined(docs) + text(75, BS), held)
    before = dict(tokens_by_cause(stream))
    ask(stream, system + joined(docs[i] for i in (1, 0, 2, 3)) + text(75, BS), held)
    tokens = {cause: n - before.get(cause, 0) for cause, n in tokens_by_cause(stream).items()}
    assert tokens.get("content_moved", 0) >= 8 * BS and "prefix_diverged" not in tokens, tokens


def test_a_field_of_another_length_moves_no_pair_past_it():
    """The same prompt with a per-request field of another length each time, right after the system
    prompt: the distances past the field are the same, so it stays prefix_diverged."""
    stream, held = Stream(Attribution()), set()
    system, rest = text(80, 5 * BS + 3), text(81, 12 * BS)
    for seed in range(5):
        ask(stream, system + no_anchor(82 + seed, 4 + 3 * seed) + rest, held)
    tokens = tokens_by_cause(stream)
    assert tokens["prefix_diverged"] >= 4 * 8 * BS and "content_moved" not in tokens, tokens


def test_a_field_right_after_an_anchor_is_fronted_however_far_the_next_anchor_lies():
    """Real vLLM (tiny Llama, field_after_system): the system prompt's last anchor in the divergence
    point's block, then a per-request field (the one before held an anchor, this one none), then
    shared content whose first anchor lies past the first two blocks. The one seam (that anchor pair
    never seen) is the field; it read as in order at the divergence point with a seam further on:
    `cold`."""
    stream, held = Stream(Attribution()), set()
    system = [*text(90, 5 * BS), ANCHOR, *no_anchor(91, K + 1)]  # its last anchor 0 tokens into block 5
    rest = [*no_anchor(95, 20), ANCHOR + 512, *text(96, 12 * BS)]  # first anchor 36 tokens into block 5
    ask(stream, [*system, *no_anchor(92, 3), ANCHOR + 256, *no_anchor(93, K), *rest], held)
    before = dict(tokens_by_cause(stream))
    ask(stream, system + no_anchor(94, 6) + rest, held)
    tokens = {cause: n - before.get(cause, 0) for cause, n in tokens_by_cause(stream).items()}
    assert tokens.get("prefix_diverged", 0) >= 8 * BS, tokens
