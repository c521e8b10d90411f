"""The diagnoses table: each cause's condition, worth and evidence, ranked by worth."""

from __future__ import annotations

import pytest

from kvcache_exporter.analyzer import diagnoses

FACTS = {
    "block_size": 16,
    "num_gpu_blocks": 256,
    "replicas": 2,
    "routing": "round-robin",
    "observed": 0.1,
    "unbounded": 0.2,
    "one_replica": 0.5,
    "session_text": "",
    "reordered": 0.8,
    "needed_blocks": 1024,
    "needed_text": "about 1024 blocks per replica (16384 tokens)",
    "preemptions": 0,
    "first_block_unique": 0.6,
    "granularity_loss": 0.06,
    "dyn_requests": 100,
    "dyn_start": 7,
    "dyn_where": "from token 7 on",
    "dyn_end": 20,
    "dyn_len": 12,
    "dyn_template": 180,
    "dyn_field_text": " The first per-request field reads as an id (<Word> <id>:).",
    "host_text": " A host tier of 512 blocks per replica would reach 0.180 (exact two-tier replay).",
}


def test_ranked_by_worth_with_the_hit_ratio_after_each_fix():
    found = diagnoses.diagnose(FACTS)
    assert [d.kind for d in found] == ["dynamic_prefix", "affinity", "capacity", "block_granularity"]
    assert [round(d.gain, 3) for d in found] == [0.7, 0.3, 0.1, 0.06]
    assert [round(d.after, 3) for d in found] == [0.8, 0.4, 0.2, 0.16]
    assert "hit ratio 0.100 -> 0.800" in found[0].evidence and "1024 blocks per replica" in found[2].evidence
    assert found[0].evidence.endswith("0.800. The first per-request field reads as an id (<Word> <id>:).")


def test_every_cause_formats_its_evidence_from_the_facts():
    for cause in diagnoses.CAUSES:
        assert cause.evidence.format(**FACTS) and cause.actions
        assert not any(ch in cause.evidence.format(**FACTS) for ch in "{}")


@pytest.mark.parametrize(
    ("change", "absent"),
    [
        ({"reordered": None}, "dynamic_prefix"),
        ({"reordered": 0.12}, "dynamic_prefix"),  # worth less than SIGNIFICANT
        ({"needed_blocks": None}, "capacity"),
        ({"one_replica": None}, "affinity"),
        ({"granularity_loss": 0.01}, "block_granularity"),
    ],
)
def test_a_cause_that_does_not_hold_or_is_worth_little_is_left_out(change, absent):
    assert absent not in [d.kind for d in diagnoses.diagnose({**FACTS, **change})]


def test_nothing_shared_is_reported_although_worth_nothing():
    facts = {**FACTS, "first_block_unique": 0.95, "unbounded": 0.01, "observed": 0.01, "reordered": None}
    facts.update(one_replica=None, needed_blocks=None, granularity_loss=0.0)
    assert [(d.kind, d.gain) for d in diagnoses.diagnose(facts)] == [("nothing_shared", 0.0)]
