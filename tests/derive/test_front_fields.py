"""The field in front of a diverged prefix, named live: attribution's hook, with the real tiny-llama
tokenizer decoding headers of the seed's shape; sampling, the counters, the redacted log line and
report; and nothing at all without a tokenizer."""

import logging
import random
from pathlib import Path

from kvcache_exporter import catalog as c
from kvcache_exporter.derive.attribution import Attribution
from kvcache_exporter.derive.fields import KINDS, Rules
from kvcache_exporter.derive.front_fields import BUSY_PER_SECOND, LOG_EVERY_S, MAX_RECENT, FrontFields
from kvcache_exporter.derive.kv_events import EventState
from kvcache_exporter.derive.registry import DeriveOptions
from kvcache_exporter.derive.registry import attribution as attribution_samples
from kvcache_exporter.derive.state import PollState
from kvcache_exporter.model_tokenizer import load_tokenizer, safe_decoder
from tests.derive.test_attribution import BS, TEMPLATE, Stream

TOKENIZER = load_tokenizer(Path(__file__).resolve().parents[1] / "fixtures" / "tiny-llama")
SECRET_NAMES = ["Alice", "Bob", "Mallory", "Zoë"]


def header(rng: random.Random) -> str:
    return (
        f"User [ID:{rng.randrange(10**4, 10**5)}] {rng.choice(SECRET_NAMES)} at "
        f"2026-12-{rng.randrange(1, 29):02d}T{rng.randrange(24):02d}:{rng.randrange(60):02d}:00 asks about "
        f"order [NO:A-{rng.randrange(10**5, 10**6)}]: "
    )


class Front:
    """A stored event's token ids, counting how often they are read (each read decodes them)."""

    def __init__(self, ids):
        self.ids, self.reads = ids, 0

    @property
    def token_ids(self):
        self.reads += 1
        return self.ids


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def namer(clock=None, per_second=100, rules=None, decode=None, timer=lambda: 0.0) -> FrontFields:
    return FrontFields(decode or safe_decoder(TOKENIZER, 64), rules, per_second, clock or Clock(), timer)


def prompts(stream: Stream, count: int, seed: int = 1, template=TEMPLATE) -> None:
    rng = random.Random(seed)
    for _ in range(count):
        stream.prompt(TOKENIZER.encode(header(rng)).ids + template)


def test_the_seed_header_names_its_user_id_and_counts_the_diverged_tokens():
    attribution = Attribution(capacity_blocks=1000)
    attribution.fields = fields = namer()
    prompts(Stream(attribution), 4)
    diverged = attribution.totals.tokens["prefix_diverged"]
    assert diverged >= 3 * (len(TEMPLATE) // BS - 2) * BS  # the 3 prompts after the first
    assert fields.tokens["id"] == diverged and sum(fields.tokens.values()) == diverged
    report = fields.report()
    assert report["fronts"] == {"sampled": 3, "skipped": 0}
    # the known content may start inside the header (its words recur): the front is what precedes it
    assert {s["shape"] for s in report["recent"]} <= {
        "<Word> <id>",
        "<Word> <id> <Word> <word> <timestamp> <word>",
    }
    assert {s["field"] for s in report["recent"]} == {"id"}


def test_at_most_per_second_fronts_are_decoded():
    calls, clock = [], Clock()

    def decode(ids):
        calls.append(len(ids))
        return safe_decoder(TOKENIZER, 64)(ids)

    attribution = Attribution(capacity_blocks=1000)
    attribution.fields = fields = namer(clock, per_second=2, decode=decode)
    stream = Stream(attribution)
    prompts(stream, 6)
    assert fields.sampled == len(calls) == 2 and fields.skipped == 3
    clock.now += 1.0
    prompts(stream, 2, seed=2)
    assert fields.sampled == len(calls) == 4
    assert max(calls) <= 64


def test_at_most_a_cpu_share_a_second_goes_to_naming():
    clock, ticks = Clock(), iter(range(10**6))
    fields = namer(clock, per_second=100, timer=lambda: next(ticks) * BUSY_PER_SECOND * 0.6)
    fronts = [Front(TOKENIZER.encode(f"Order #{n} now").ids) for n in range(100, 106)]
    for front in fronts[:4]:  # each named front reads as 0.6 x BUSY_PER_SECOND of CPU
        fields.observe(front, 3, 10)
    assert (fields.sampled, fields.skipped) == (2, 2)
    clock.now += 1.0
    for front in fronts[4:]:
        fields.observe(front, 3, 10)
    assert (fields.sampled, fields.skipped) == (4, 2)


def test_nothing_is_decoded_when_no_prefix_diverges():
    calls = []
    attribution = Attribution(capacity_blocks=1000)
    attribution.fields = namer(decode=lambda ids: calls.append(ids) or "")
    rng = random.Random(5)
    stream = Stream(attribution)
    for _ in range(5):  # unrelated prompts: cold only
        stream.prompt([rng.randrange(5, 50_000) for _ in range(128)])
    stream.prompt(TOKENIZER.encode("Same start for both. ").ids + TEMPLATE)
    stream.prompt(TOKENIZER.encode("Same start for both. ").ids + TEMPLATE, cached_blocks=14)
    assert calls == [] and attribution.totals.tokens["prefix_diverged"] == 0


def test_the_log_line_is_rate_limited_and_redacted(caplog):
    clock = Clock()
    attribution = Attribution(capacity_blocks=1000)
    attribution.fields = namer(clock)
    stream = Stream(attribution)
    with caplog.at_level(logging.INFO, logger="kvcache_exporter.derive.front_fields"):
        prompts(stream, 4)
        clock.now += LOG_EVERY_S
        prompts(stream, 2, seed=3)
    lines = [r for r in caplog.records if r.name == "kvcache_exporter.derive.front_fields"]
    assert len(lines) == 2
    assert lines[0].field == "id" and lines[0].shape.startswith("<Word> <id>")
    text = " ".join(f"{r.getMessage()} {r.__dict__}" for r in lines)
    assert not any(name in text for name in [*SECRET_NAMES, "User", "order", "2026"])


def test_user_patterns_name_their_own_kind():
    rules = Rules.with_patterns({"ticket": r"TCK-\d{6}"})
    fields = namer(rules=rules)
    for n in range(3):
        ids = TOKENIZER.encode(f"Ticket TCK-{123456 + n} from Alice: ").ids
        fields.observe(Front(ids + TEMPLATE), len(ids), 100)
    assert fields.tokens["ticket"] == 300
    assert fields.report()["recent"][0]["shape"].startswith("<Word> <ticket> <word> <Word>:")


def test_the_recent_shapes_are_bounded():
    fields = namer()
    for n in range(MAX_RECENT + 10):
        ids = TOKENIZER.encode("Ab" + ":" * n + " 2026-12-04").ids
        fields.observe(Front(ids), len(ids), 1)
    assert len(fields.report()["recent"]) == MAX_RECENT


def test_the_field_series_exist_only_with_a_tokenizer():
    def series(with_fields: bool) -> dict:
        state = PollState(retention=120.0)
        attribution = Attribution(capacity_blocks=1000)
        if with_fields:
            attribution.fields = namer()
        state.add_kv_events(EventState(), attribution=attribution)
        prompts(Stream(attribution), 3)
        state.kv_events[0].ingest(None, 1.0)
        samples = attribution_samples(state, DeriveOptions())
        return {s.labels["field"]: s.value for s in samples if s.name == c.PREFIX_DIVERGED_FIELD_TOKENS_TOTAL}

    assert series(False) == {}  # absent, not zero
    with_fields = series(True)
    assert set(with_fields) == set(KINDS) and with_fields["id"] > 0


def test_the_token_ids_of_a_front_skipped_are_never_read():
    fields, fronts = (
        namer(per_second=1),
        [Front(TOKENIZER.encode(f"Order #{n} now").ids) for n in range(100, 105)],
    )
    for front in fronts:
        fields.observe(front, 3, 10)
    assert [f.reads for f in fronts] == [1, 0, 0, 0, 0] and fields.skipped == 4
