"""The causes chat traffic has (issue 29), on hand-built streams laid out as vLLM stores them: a
rewritten history, re-ranked sections, append-only turns (never a fault), another identity, an
expired window, a unit loaded back from a tier. Each test fails without its rule."""

from __future__ import annotations

import random

from kvcache_exporter.derive.attribution import CAUSES, Attribution
from kvcache_exporter.sources.kv_events_decode import Event
from tests.derive.test_attribution import BS, Stream, header, removed, stored, tokens_by_cause
from tests.derive.test_units import DSV4, Chain, feed, part, unit_events, words


def text(seed: int, n: int) -> list[int]:
    return random.Random(seed).choices(range(5, 50_000), k=n)


def joined(parts) -> list[int]:
    return [token for part in parts for token in part]


def generate(stream: Stream, prompt: list[int], generated: list[int]) -> None:
    """The decode of `generated` after `prompt`: each block it fills, one BlockStored of one block
    whose parent is the chain's open tip (the prompt's last full block first)."""
    tokens = prompt + generated
    hashes, parent = [], None
    for i in range(len(tokens) // BS):
        parent = hash((parent, tuple(tokens[i * BS : (i + 1) * BS])))
        hashes.append(parent)
    for i in range(len(prompt) // BS, len(hashes)):
        stream.send(stored(hashes[i : i + 1], tokens[i * BS : (i + 1) * BS], hashes[i - 1]))


def ask(stream: Stream, prompt: list[int], held: set) -> None:
    """Store `prompt` as vLLM would: its leading blocks the cache holds hit, the rest is stored."""
    hashes, parent = [], None
    for i in range(len(prompt) // BS):
        parent = hash((parent, tuple(prompt[i * BS : (i + 1) * BS])))
        hashes.append(parent)
    cached = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
    held.update(stream.prompt(prompt, cached_blocks=cached))


def chat(stream: Stream, turns: int, render) -> list[int]:
    """A conversation: each turn's prompt is the history as `render` shows the earlier answers, then
    a new user message; the model answers 300 tokens. Returns the last prompt."""
    history: list[int] = text(1, 100)  # the system prompt
    answers: list[list[int]] = []
    prompt: list[int] = []
    previous: list[int] = []  # the last prompt and its answer: what the cache holds of the chain
    for turn in range(turns):
        user = header(random.Random(100 + turn), 40)
        prompt = history + user
        cached = 0
        if answers:  # the blocks the last prompt shares with what the cache holds
            cached = len(previous) // BS
            while prompt[: cached * BS] != previous[: cached * BS]:
                cached -= 1
        stream.prompt(prompt, cached_blocks=cached)
        answer = text(200 + turn, 300)
        generate(stream, prompt, answer)
        previous = prompt + answer
        answers.append(answer)
        history = prompt + render(answer)
    return prompt


def test_a_template_that_drops_each_answers_first_tokens_is_history_rewritten():
    """DeepSeek-R1-style: every earlier answer re-rendered without its first 96 generated tokens
    (the reasoning). Each turn after the first leaves the cache where the last answer starts; the
    answer's kept text is known generated content behind a cached prefix."""
    stream = Stream(Attribution())
    chat(stream, 4, lambda answer: answer[96:])
    tokens = tokens_by_cause(stream)
    assert tokens.keys() <= {"history_rewritten", "cold"}
    # three rewritten turns, each worth the prompt's 12-token tail and the kept 204 tokens (208 in whole
    # blocks); the answer's last ~24 tokens are not known (its partial block is never stored, the
    # last full one's late anchors have no whole window), so the span runs a block past the last
    # known generated text: up to a block of the next message joins it (224 a turn at most)
    assert 3 * 176 <= tokens["history_rewritten"] <= 3 * 224, tokens
    # the turn index, bounded: turns 2, 3 and 4 diverge at the 1st, 2nd and 3rd answer (buckets 1, 2, 3, 4, 6)
    assert stream.attribution.totals.rewritten_turn_counts == [1, 1, 1, 0, 0, 0]
    assert stream.attribution.totals.rewritten_turn_sum == 1 + 2 + 3


def test_tool_arguments_reserialised_are_history_rewritten():
    """The answer's first 24 tokens (the tool call's arguments) re-rendered in another key order: the
    chain leaves the cache there, the rest of the answer is known generated text."""
    stream = Stream(Attribution())
    chat(stream, 3, lambda answer: answer[:24][::-1] + answer[24:])
    tokens = tokens_by_cause(stream)
    assert tokens.keys() <= {"history_rewritten", "cold"}
    assert 2 * 256 <= tokens["history_rewritten"] <= 2 * 304, tokens  # 12 + 300 tokens a turn, at most


def test_append_only_turns_are_never_a_fault():
    """The template renders every answer verbatim: each turn hits the whole history (the decode blocks
    included) and computes only the new message: cold, whatever the content recalls."""
    stream = Stream(Attribution())
    chat(stream, 5, lambda answer: answer)
    assert tokens_by_cause(stream).keys() == {"cold"}
    assert stream.attribution.totals.decode_tokens > 0


def test_reranked_documents_are_content_moved():
    """Four shared documents in another order per request, behind a cached system prompt: known
    content whose pieces are joined by seams, not by their former neighbours."""
    stream, held = Stream(Attribution()), set()
    system, docs = text(3, 64), [text(10 + i, 96) for i in range(4)]
    orders = [random.Random(seed).sample(range(4), 4) for seed in range(16)]
    computed = 0
    for seed, order in enumerate(orders):
        before = stream.attribution.totals.prompt_miss_tokens
        ask(stream, system + joined(docs[i] for i in order) + header(random.Random(seed), 20), held)
        computed += stream.attribution.totals.prompt_miss_tokens - before
    tokens = tokens_by_cause(stream)
    assert tokens.keys() <= {"content_moved", "cold"}, tokens
    # a seam shows only with an anchor in the 7 tokens before it (p ~ 0.36), one seam joins the
    # whole stretch: about half the re-ranked requests show one (a lower bound; the rest reads cold)
    assert tokens["content_moved"] >= 0.3 * computed, (tokens, computed)


def test_the_same_documents_in_the_same_order_behind_a_per_request_front_are_prefix_diverged():
    stream = Stream(Attribution())
    docs = text(3, 64) + joined(text(10 + i, 96) for i in range(4))
    for seed in range(6):
        stream.prompt(header(random.Random(seed), 20) + docs)
    tokens = tokens_by_cause(stream)
    assert tokens["prefix_diverged"] > 0 and "content_moved" not in tokens


def test_content_under_another_adapter_or_salt_is_identity_isolated_and_new_content_is_cold():
    state, shared = part(), words(512, 20)
    feed(state, unit_events(DSV4, Chain(shared), 0, 256))
    feed(state, unit_events(DSV4, Chain(words(256, 21), salt=1), 0, 256, lora_name="adapter-a"))
    assert state.attribution.totals.tokens["identity_isolated"] == 0  # new text: cold
    feed(state, unit_events(DSV4, Chain(shared, salt=2), 0, 256, lora_name="adapter-b"))
    feed(state, unit_events(DSV4, Chain(words(256, 21)), 0, 256))  # adapter-a's text, without one
    tokens = state.attribution.totals.tokens
    assert tokens["identity_isolated"] == 2 * 256 and tokens["cold"] == 2 * 256


def test_a_unit_whose_window_part_was_dropped_is_window_expired_and_not_in_the_capacity_estimate():
    attribution = Attribution(capacity_blocks=100)
    stream = Stream(attribution)
    hashes = stream.prompt(text(30, 64))
    stream.send(Event("WindowExpired", hashes[2:]))
    stream.prompt(text(30, 64), cached_blocks=2)
    assert tokens_by_cause(stream) == {"cold": 64, "window_expired": 32}
    assert attribution.totals.extra_hit_tokens == {2: 0, 4: 0}


def test_units_a_hybrid_lookup_evicted_itself_after_a_window_part_expired_are_window_expired():
    """Real vLLM (Gemma-3 pattern): a prompt's last unit lost its window part, so the prompt hit
    nothing, and its own allocation evicted the rest of its blocks (still resident when vLLM looked
    it up: removed with nothing stored since) before storing them all again from the root. Those
    were `evicted` (a bigger cache would not have kept them any better); they are `window_expired`."""
    stream = Stream(Attribution(capacity_blocks=100))
    hashes = stream.prompt(text(31, 64))
    stream.send(Event("WindowExpired", hashes[3:]))  # the fill dropped the last unit's window part
    stream.send(removed(hashes[:3]), stored(hashes, text(31, 64)))  # the lookup's own allocation
    assert tokens_by_cause(stream) == {"cold": 64, "window_expired": 64}
    assert stream.attribution.totals.extra_hit_tokens == {2: 0, 4: 0}
    other = Stream(Attribution(capacity_blocks=100))  # no window part expired: evicted, as before
    hashes = other.prompt(text(32, 64))
    other.send(removed(hashes[:3]), stored(hashes, text(32, 64)))
    assert tokens_by_cause(other) == {"cold": 64 + 16, "evicted": 48}  # its last block: still resident


def test_a_unit_loaded_back_from_a_tier_is_restored_not_a_miss():
    state, chain = part(), Chain(words(256, 40))
    gpu = unit_events(DSV4, chain, 0, 256)
    feed(state, gpu, [Event("BlockStored", gpu[3].block_hashes, None, [], 256, medium="CPU")])
    feed(state, [Event("BlockRemoved", gpu[3].block_hashes, group=3)], gpu)  # evicted, loaded back
    totals = state.attribution.totals
    assert totals.tier_restored_tokens == 256 and totals.prompt_miss_tokens == 256


def test_every_stored_token_has_exactly_one_cause():
    """The content causes split an event's tokens without overlap: their sum is what was stored."""
    stream = Stream(Attribution(hit_unit=64))
    system, docs = text(3, 64), [text(10 + i, 96) for i in range(4)]
    stored_tokens = 0
    for seed in range(8):
        front = header(random.Random(seed), 20) if seed % 2 else []
        order = random.Random(seed).sample(range(4), 4)
        prompt = front + system + joined(docs[i] for i in order)
        stream.prompt(prompt)
        stored_tokens += len(prompt) // BS * BS
    totals = stream.attribution.totals
    assert set(totals.tokens) == set(CAUSES)
    assert totals.prompt_miss_tokens == stored_tokens


def test_the_rewritten_span_reaches_past_the_answers_unstored_last_block():
    """An answer of 4 blocks and 14 tokens: its last 14 were never stored as decode (a partial block),
    so no fingerprint knows them. Re-rendered without its first 5 tokens, then a 6-token follow-up:
    the 4 blocks stored are all re-rendered answer. Before, the span ended at the last known
    generated anchor (a block short: cold 16)."""
    stream, held = Stream(Attribution()), set()
    system, answer = text(90, 6 * BS), text(91, 4 * BS + 14)
    ask(stream, system, held)
    generate(stream, system, answer)
    before = dict(stream.attribution.totals.tokens)
    ask(stream, system + answer[5:] + text(92, 6), held)
    tokens = {c: n - before[c] for c, n in stream.attribution.totals.tokens.items() if n != before[c]}
    assert tokens == {"history_rewritten": 4 * BS}, tokens
