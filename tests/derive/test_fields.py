"""The field classifier and the redaction: each kind on examples, generated prompts (hypothesis)
named by their first field, secrets never surviving the shape, user patterns vetted for time."""

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcache_exporter.derive.fields import (
    KINDS,
    MAX_PATTERNS,
    MAX_SHAPE,
    MAX_TEXT,
    Rules,
    classify,
    first_kind,
    shape,
    vet_pattern,
)
from tests.fuzzing import fuzz_settings

EXAMPLES = [
    ("2026-12-04T13:49:58Z", "timestamp"),
    ("2026-12-04 13:49", "timestamp"),
    ("[TS:1733320000]", "timestamp"),
    ("2026-12-04", "date"),
    ("04/12/2026", "date"),
    ("Dec 4, 2026", "date"),
    ("13:49:58", "time"),
    ("10:42 pm", "time"),
    ("3f2a9c1e-1b2c-4d5e-8f90-123456789abc", "uuid"),
    ("bob.smith+x@mail.example.com", "email"),
    ("https://shop.example.com/orders?id=7", "url"),
    ("0xdeadbeef99", "hex"),
    ("9f86d081884c7d65", "hex"),
    ("[ID:48213]", "id"),
    ("[NO:A-99812]", "id"),
    ("#12345", "id"),
    ("ORD123456", "id"),
    ("1234567", "number"),
    ("{USER_NAME}", "template"),
    ("{{ customer }}", "template"),
]


@pytest.mark.parametrize(("value", "kind"), EXAMPLES)
def test_each_kind_is_named_alone_and_inside_a_sentence(value, kind):
    assert [f.kind for f in classify(value)] == [kind]
    text = f"Hello there, regarding {value} please help."
    found = classify(text)
    assert first_kind(found) == kind
    assert text[found[0].start : found[0].end] == value
    assert shape(text, found) == f"<Word> <word>, <word> <{kind}> <word> <word>."


def test_plain_words_and_short_numbers_are_other():
    found = classify("Please answer politely in 3 short sentences.")
    assert found == [] and first_kind(found) == "other"


def test_the_seed_header_is_named_by_its_first_field():
    text = "User [ID:48213] at 2026-12-04T13:49:58 asks about order [NO:A-99812]: Dear Alice Smith"
    found = classify(text)
    assert [f.kind for f in found] == ["id", "timestamp", "id"]
    assert (
        shape(text, found) == "<Word> <id> <word> <timestamp> <word> <word> <word> <id>: <Word> <Word> <Word>"
    )


SECRETS = ["Alice", "hunter2", "Zürich", "PASSWORD", "s3cr3t", "日本語", "ÆØÅ", "x_y_z", "4111"]


@pytest.mark.parametrize("secret", SECRETS)
def test_no_secret_survives_the_shape(secret):
    text = f"My name is {secret}, key={secret}; see {secret}@{secret}.com or <{secret}> [{secret}]!"
    redacted = shape(text, classify(text))
    assert secret not in redacted
    assert not re.search(r"[^\x20-\x7e]", redacted)  # nothing but ASCII classes and punctuation


def test_the_shape_is_bounded():
    text = "word " * 10_000
    assert len(shape(text, classify(text))) <= MAX_SHAPE
    assert all(f.end <= MAX_TEXT for f in classify("1234 " * 10_000))


# --- generated prompts: a few fields behind and between secret words --------------------------------
FIELD_VALUES = {
    "timestamp": st.builds(
        "{:04d}-{:02d}-{:02d}T{:02d}:{:02d}:{:02d}".format,
        *(st.integers(lo, hi) for lo, hi in ((1990, 2099), (1, 12), (1, 28), (0, 23), (0, 59), (0, 59))),
    ),
    "uuid": st.uuids().map(str),
    "email": st.builds(
        "{}@{}.com".format,
        st.from_regex(r"[a-z]{1,10}", fullmatch=True),
        st.from_regex(r"[a-z]{2,10}", fullmatch=True),
    ),
    "number": st.integers(10_000, 10**12).map(str),
    "id": st.integers(100, 10**8).map("[ID:{}]".format),
}
WORDS = st.from_regex(r"[A-Za-zÀ-ÿ]{1,12}", fullmatch=True)


@st.composite
def prompts(draw):
    kinds = draw(st.lists(st.sampled_from(sorted(FIELD_VALUES)), min_size=1, max_size=3))
    parts, words = [], []
    for kind in kinds:
        lead = draw(st.lists(WORDS, max_size=4))
        words += lead
        parts += [*lead, draw(FIELD_VALUES[kind])]
    return " ".join(parts), kinds, words


@given(prompts())
@fuzz_settings(300)
def test_generated_prompts_are_named_by_their_first_field_and_leak_no_word(case):
    text, kinds, words = case
    found = classify(text)
    assert [f.kind for f in found] == kinds
    redacted = shape(text, found)
    for word in words:
        assert not re.search(rf"\b{re.escape(word)}\b", redacted) or word in ("Word", "word", "WORD", "n")


# --- user patterns ------------------------------------------------------------------------------------
def test_user_patterns_come_first_and_add_their_kind():
    rules = Rules.with_patterns({"ticket": r"TCK-\d{6}"})
    assert rules.kinds == ("ticket", *KINDS)
    text = "Ticket TCK-123456 opened at 10:42"
    found = classify(text, rules)
    assert [f.kind for f in found] == ["ticket", "time"]
    assert shape(text, found) == "<Word> <ticket> <word> <word> <time>"


@pytest.mark.parametrize(
    ("name", "pattern", "problem"),
    [
        ("nested", r"(a+)+b", "repeat inside a repeat"),
        ("alternatives", r"(a|ab)*c", "alternatives under a repeat"),
        ("backref", r"(a)\1", "back-references"),
        ("look", r"(?=a)a", "look-arounds"),
        ("cubic", r"a*a*a*b", "open-ended repeats"),
        ("slow", r"\w*\w*x", "too slow"),
        ("empty", r"x*", "matches the empty text"),
        ("broken", r"(", "not a regular expression"),
        ("Bad-Name", r"x", "the name must match"),
        ("uuid", r"x", "the name must match"),
        ("long", "x" * 201, "longer than 200"),
    ],
)
def test_patterns_that_could_backtrack_or_break_labels_are_refused(name, pattern, problem):
    with pytest.raises(ValueError, match=problem):
        vet_pattern(name, pattern)


def test_the_time_budget_is_what_refuses():
    ticks = iter(range(0, 10**6, 1))
    vet_pattern("fine", r"TCK-\d{6}", budget=2, clock=lambda: next(ticks))  # each scan reads 1 tick
    with pytest.raises(ValueError, match="too slow"):
        vet_pattern("fine", r"TCK-\d{6}", budget=0.5, clock=lambda: next(ticks))


def test_every_refused_pattern_is_named_at_once():
    with pytest.raises(ValueError) as err:
        Rules.with_patterns({"a": r"(a+)+", "b": r"ok\d+", "c": r"("})
    assert "a: " in str(err.value) and "c: " in str(err.value) and "b: " not in str(err.value)
    with pytest.raises(ValueError, match=f"at most {MAX_PATTERNS}"):
        Rules.with_patterns({f"p{i}": rf"x{i}y" for i in range(MAX_PATTERNS + 1)})


def test_a_tag_cut_where_the_front_ends_is_still_named():
    assert [f.kind for f in classify("User [ID:48213")] == ["id"]
    assert [f.kind for f in classify("at [TS:17333")] == ["timestamp"]
