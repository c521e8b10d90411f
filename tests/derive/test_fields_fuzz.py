"""Hostile input to field naming (issue 33): any text classifies and redacts without raising and
leaves no letter or digit of its own in the shape; any pattern string is compiled or refused with a
ValueError; any token ids (negative, huge, out of vocabulary, bytes that are not UTF-8) decode
without raising, and a front namer fed them stays within its bounds. `make fuzz` runs 100,000 each."""

import re
from itertools import pairwise
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from kvcache_exporter.derive.fields import KINDS, MAX_SHAPE, Rules, classify, shape, vet_pattern
from kvcache_exporter.derive.front_fields import MAX_RECENT, FrontFields
from kvcache_exporter.model_tokenizer import load_tokenizer, safe_decoder
from kvcache_exporter.sources.kv_events_decode import Event
from tests.fuzzing import fuzz_settings

TOKENIZER = load_tokenizer(Path(__file__).resolve().parents[1] / "fixtures" / "tiny-llama")
VOCAB = TOKENIZER.get_vocab_size(with_added_tokens=True)
CLASSES = re.compile("<(?:" + "|".join([*KINDS, "ticket", "Word", "word", "WORD", "alnum", "n"]) + ")>")
RULES = Rules.with_patterns({"ticket": r"TCK-\d{6}"})
TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=600) | st.from_regex(
    r"([A-Za-z0-9 :\-/.@\[\]{}#_]|2026-12-04T10:00|TCK-\d{6}){0,80}", fullmatch=True
)


@given(TEXT)
@fuzz_settings(500)
def test_any_text_redacts_to_classes_and_punctuation_only(text):
    found = classify(text, RULES)
    assert all(a.end <= b.start for a, b in pairwise(found))
    redacted = shape(text, found)
    assert len(redacted) <= MAX_SHAPE
    assert not any(c.isalnum() for c in CLASSES.sub("", redacted)), redacted
    assert re.fullmatch(r"[\x20-\x7e]*", redacted)


@given(st.text(max_size=80))
@fuzz_settings(200)
def test_any_pattern_is_compiled_or_refused_with_a_reason(pattern):
    try:
        compiled = vet_pattern("user", pattern)
    except ValueError as err:
        assert str(err)
    else:
        assert compiled.pattern == pattern


IDS = st.lists(
    st.integers(-(2**70), 2**70) | st.integers(0, VOCAB + 5) | st.sampled_from([3, 4, 259, 300]), max_size=100
)


@given(IDS)
@fuzz_settings(500)
def test_hostile_token_ids_decode_without_raising(ids):
    text = safe_decoder(TOKENIZER, 64)(ids)
    assert isinstance(text, str)


@given(st.lists(st.tuples(IDS, st.integers(-5, 200), st.integers(0, 10**6)), max_size=40))
@fuzz_settings(200)
def test_a_front_namer_fed_hostile_fronts_stays_bounded(fronts):
    namer = FrontFields(safe_decoder(TOKENIZER, 64), RULES, 1000, clock=lambda: 0.0, timer=lambda: 0.0)
    for ids, start, served in fronts:
        namer.observe(Event("BlockStored", [1], None, ids, 16), start, served)
    report = namer.report()
    assert set(report["fields"]) == set(RULES.kinds)
    assert sum(report["fields"].values()) == sum(s for ids, start, s in fronts if start > 0)
    assert len(report["recent"]) <= MAX_RECENT
    for seen in report["recent"]:
        assert not any(c.isalnum() for c in CLASSES.sub("", seen["shape"]))
