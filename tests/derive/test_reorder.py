"""The prefix_diverged rule (derive/reorder.py): what a reorder would serve, and what the hit unit costs."""

import random

from kvcache_exporter.derive.attribution import Attribution
from kvcache_exporter.derive.fingerprints import SELECTED
from kvcache_exporter.derive.reorder import (
    FRONT_TAIL,
    FRONT_TAIL_BEHIND_ANCHOR,
    KnownRun,
    first_known_run,
    served_tokens,
    unit_shortfall_tokens,
)
from kvcache_exporter.sources.kv_events_decode import Batch, Event
from tests.derive.test_attribution import BS, TEMPLATE, Stream, header, tokens_by_cause


def test_a_known_run_behind_an_unseen_anchor_is_fronted():
    run = first_known_run([3, 20, 40, 60], [False, True, True, False], 96, root=False)
    assert run == KnownRun(start=16, end=64, fronted=True)
    assert served_tokens(run, 96, 16) == 48 and served_tokens(run, 96, 32) == 32
    assert unit_shortfall_tokens(run, 16) == 0  # fronted: the reorder's, not the unit's


def test_known_content_at_the_divergence_point_is_already_first():
    run = first_known_run([9, 20, 40], [True, True, False], 64, root=False)
    assert not run.fronted and served_tokens(run, 64, 16) == 0
    assert unit_shortfall_tokens(run, 64) == run.end  # short of a 64-token unit: never hits
    assert served_tokens(run, 64, 16, continues=True) == run.end // 16 * 16  # a diverged chain goes on


def test_at_a_chains_root_anything_before_known_content_is_the_front():
    assert first_known_run([12, 30], [True, True], 64, root=True).fronted
    assert not first_known_run([2, 30], [True, True], 64, root=True).fronted  # starts at token 0


def test_nothing_seen_is_no_run():
    assert first_known_run([5, 9], [False, False], 32, root=True) is None
    assert served_tokens(None, 32, 16) == unit_shortfall_tokens(None, 16) == 0


def test_a_361_token_template_in_256_token_units_leaves_105_tokens_that_never_hit():
    """DeepSeek-V4 hits in 256-token units (one stored event per unit once the group model folded
    the groups): the second prompt hits 256 tokens of the template and computes its last 105 with
    the new header (docs/kv-events.md): cause below_hit_unit, the rest of the unit cold."""
    attribution = Attribution(hit_unit=256)
    template, rng = random.Random(11).choices(range(5, 50_000), k=361), random.Random(12)
    for seq, prompt in enumerate((template + header(rng, 151), template + header(rng, 151))):
        hashes = [hash(("unit", seq, 0)) if seq == 0 else hash(("unit", 0, 0)), hash(("unit", seq, 1))]
        events = [Event("BlockStored", hashes[seq:], hashes[0] if seq else None, prompt[256 * seq :], 256)]
        attribution.apply(Batch(seq, 0.0, tuple(events)))
    shortfall = attribution.totals.tokens["below_hit_unit"]
    assert abs(shortfall - 105) <= 8, shortfall  # the run's end is known to within half a fingerprint
    assert attribution.totals.tokens["cold"] == 512 + 256 - shortfall
    assert attribution.totals.tokens["prefix_diverged"] == 0


def test_sentences_that_recur_in_new_orders_after_a_unique_header_are_not_diverged():
    """Template first (cached), then a per-request header, then questions made of recurring
    sentences in new combinations: the layout is already fixed; a reorder serves no whole unit."""
    rng = random.Random(13)
    sentences = [rng.choices(range(5, 50_000), k=rng.randrange(6, 14)) for _ in range(12)]
    stream = Stream(Attribution())
    stream.prompt(TEMPLATE[:192])
    for _ in range(60):
        question = [t for s in rng.sample(sentences, 4) for t in s]
        stream.prompt(TEMPLATE[:192] + header(rng, 12) + question, cached_blocks=192 // BS)
    got = tokens_by_cause(stream)
    assert got.get("prefix_diverged", 0) < 0.2 * sum(got.values()), got


def test_the_template_behind_a_header_is_served_in_whole_units():
    rng = random.Random(14)
    stream = Stream(Attribution())
    stream.prompt(header(rng, 16) + TEMPLATE)
    stream.prompt(header(rng, 16) + TEMPLATE)  # 216 tokens, 13 blocks: 192 served, the header's block cold
    assert tokens_by_cause(stream) == {"cold": 208 + 16, "prefix_diverged": 192}


# --- shared content short of a unit at a chain's root (issue 29's short_shared_prefix) ---------------


def test_at_a_root_a_known_run_short_of_a_unit_before_new_content_can_never_hit():
    """Known content from near the first token, then unseen content, all within the first unit: the
    unit's hash is new, so whatever precedes the known stretch, it never hits. Short of the unit."""
    run = first_known_run([6, 20], [True, False], 32, root=True, unit=32)
    assert not run.fronted and run.end < 32
    assert unit_shortfall_tokens(run, 32) == run.end and served_tokens(run, 32, 32) == 0
    assert first_known_run([6, 20], [True, False], 32, root=True).fronted  # no unit known: as before


def test_at_a_root_one_unit_all_seen_yet_new_differs_where_no_anchor_could_see():
    """One stored unit at a root, every anchor seen, its hash new: the difference lies past the last
    seen window, where no anchor could see it; the known stretch ends K tokens before the unit's end
    at the latest."""
    run = first_known_run([3], [True], 32, root=True, unit=32)
    assert run == KnownRun(start=0, end=24, fronted=False) and unit_shortfall_tokens(run, 32) == 24
    assert first_known_run([3, 20], [True, True], 32, root=True, unit=32).end == 28  # its window's end
    assert first_known_run([12, 40], [True, True], 64, root=True, unit=32).fronted  # longer: a front


def test_two_root_prompts_sharing_most_of_their_first_unit_are_below_the_hit_unit():
    """One 16-token block each, sharing their first 13 tokens (anchors at 0 and 4, windows inside)."""
    anchor, plain = min(SELECTED), [v for v in range(600, 900) if v % 256 not in SELECTED]
    shared = [anchor, *plain[:3], anchor, *plain[3:11]]
    stream = Stream(Attribution())
    stream.prompt([*shared, *plain[20:23]])
    assert tokens_by_cause(stream) == {"cold": 16}
    stream.prompt([*shared, *plain[30:33]])
    assert tokens_by_cause(stream) == {"cold": 16 + 4, "below_hit_unit": 12}


def test_at_a_root_a_front_is_taken_short_where_the_first_known_anchor_lies_far_behind_it():
    """A front with no anchor (or past its last one) runs FRONT_TAIL tokens at most: the known run
    starts no later, however far behind its first seen anchor lies (anchors are sparse)."""
    assert first_known_run([54, 70, 90], [True] * 3, 128, root=True).start == min(
        54 - 10, FRONT_TAIL
    )  # was 54 - 10
    assert first_known_run([20, 80, 100], [False, True, True], 128, root=True).start == min(
        70, 21 + FRONT_TAIL_BEHIND_ANCHOR
    )  # was 70, then 69 (FRONT_TAIL)
    near = [20, 36, 52, 68, 84, 100]
    assert first_known_run(near, [True] * 6, 128, root=True).start == 16  # as before: 20 - 4
    behind_a_prefix = first_known_run([54, 70, 90], [True] * 3, 128, root=False)
    assert behind_a_prefix.start == 44  # as before


def test_an_id_first_before_content_whose_first_anchor_lies_late_is_prefix_diverged():
    """Real vLLM (tiny Llama, request_id_first, 32-token blocks): an 8-token id first, then the same
    chat, whose first anchor lies 54 tokens in. Taken as starting 4 tokens before that anchor, the
    known run served 2 of the 4 blocks (a tie with cold, named cold); from 32 tokens in, 3."""
    plain = [v for v in range(20, 256) if v not in SELECTED]
    rng = random.Random(7)
    shared = [rng.choice(plain) for _ in range(46)] + [sorted(SELECTED)[3]]
    shared += rng.choices(range(20, 500), k=140)
    attribution = Attribution()
    for seq in range(2):
        prompt = [rng.choice(plain) for _ in range(8)] + shared
        hashes = [hash(("block", seq, i)) for i in range(4)]
        attribution.apply(Batch(seq, 0.0, (Event("BlockStored", hashes, None, prompt[:128], 32),)))
    tokens = attribution.totals.tokens
    assert tokens["prefix_diverged"] == 96 and tokens["cold"] == 128 + 32


def test_at_a_root_unseen_content_only_in_the_last_block_does_not_end_a_fronted_run():
    """Unseen anchors from `open_tail` tokens before the end on, none seen after them: the run goes to
    the end; not behind a cached prefix, not when a seen anchor follows, not when they start earlier."""
    seen = [True, True, True, False, False]
    assert first_known_run([16, 40, 70, 131, 144], seen, 160, root=True).end == 135  # before: 131 + 4
    assert first_known_run([16, 40, 70, 131, 144], seen, 160, root=True, open_tail=40).end == 160
    assert first_known_run([16, 40, 70, 131, 144], seen, 160, root=False, open_tail=40).end == 135
    assert first_known_run([16, 40, 70, 100, 144], seen, 160, root=True, open_tail=40).end == 104
    assert first_known_run([16, 40, 70, 131, 144], [*seen[:4], True], 160, root=True, open_tail=40).end == 135


def test_a_shorter_front_shifts_the_earlier_prompts_unstored_tail_into_the_stored_blocks():
    """Real vLLM (tiny Llama, uuid_first, 32-token blocks): a 20-token front then 160 shared tokens
    stores 5 blocks, the shared content to 140 (its anchors fingerprinted to 132); the same content
    behind a 6-token front stores 5 blocks too, to 154: its anchor at 138 was never fingerprinted.
    That is the earlier prompt's unstored tail, not new content: moving the front to the end serves
    all 5 blocks (before: 4, the run ended at the unseen anchor)."""
    plain = [v for v in range(20, 256) if v not in SELECTED]
    rng = random.Random(5)
    shared = [rng.choice(plain) for _ in range(160)]
    for at in (10, 30, 50, 70, 90, 110, 125, 138):
        shared[at] = sorted(SELECTED)[at % 7]
    attribution = Attribution()
    for seq, front in enumerate((20, 6)):
        prompt = [rng.choice(plain) for _ in range(front)] + shared
        hashes = [hash(("block", seq, i)) for i in range(5)]
        attribution.apply(Batch(seq, 0.0, (Event("BlockStored", hashes, None, prompt[:160], 32),)))
    tokens = attribution.totals.tokens
    assert tokens["prefix_diverged"] == 160 and tokens["cold"] == 160  # before: 128 and 192


def test_at_a_root_a_front_with_an_anchor_runs_two_spacings_past_it_at_most():
    """Real vLLM (tiny Llama, uuid_first, 32-token blocks): a 34-token front whose last anchor sits at
    5, then the chat stored before behind a 30-token front, its first anchor 40 tokens in (74). Taken
    as starting three spacings past the front's anchor (54), the run served 2 of the 4 blocks (named
    cold); from two (38), 3, what moving the front to the end serves (the earlier prompt stored 4
    blocks, 120 tokens of the chat)."""
    plain = [v for v in range(20, 256) if v not in SELECTED]
    rng = random.Random(9)
    shared = [rng.choice(plain) for _ in range(40)] + rng.choices(range(20, 500), k=80)
    for at in range(40, 120, 14):  # anchors at the typical spacing (a sparser event leads further)
        shared[at] = sorted(SELECTED)[at % 9]
    attribution = Attribution()
    for seq, length in enumerate((30, 34)):
        front = [rng.choice(plain) for _ in range(length)]
        front[length - 29] = sorted(SELECTED)[5 + seq]
        hashes = [hash(("block", seq, i)) for i in range(4)]
        attribution.apply(Batch(seq, 0.0, (Event("BlockStored", hashes, None, (front + shared)[:128], 32),)))
    tokens = attribution.totals.tokens
    assert tokens["prefix_diverged"] == 96 and tokens["cold"] == 128 + 32  # before: 64 and 192
