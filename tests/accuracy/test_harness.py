"""The accuracy harness on the simulator in process, every layout and every kind it can inject, small.

Asserted is what the attribution gets right today; the kinds it does not know well yet (content_moved,
identity_isolated, below_hit_unit, tier_restored) are only required to be scored: their misnamings
are what docs/accuracy.md shows, not something to pin.
"""

from collections import Counter
from dataclasses import replace

import pytest

from kvcache_exporter.accuracy.harness import (
    CANNOT_SHOW,
    DECODE,
    HIT,
    Sidecar,
    Table,
    can_show,
    named,
    run,
    tabulate,
)
from kvcache_exporter.accuracy.simulated import SHAPES, Simulated
from kvcache_exporter.accuracy.workload import FAULTS, Generator, Request
from kvcache_exporter.simulator.blocks import BlockStored
from kvcache_exporter.simulator.kv_events import encode_batch
from kvcache_exporter.sources.kv_events_decode import decode_message

FRONT_FIELDS = ("timestamp_first", "request_id_first", "uuid_first")


@pytest.fixture(
    scope="module", params=SHAPES, ids=lambda spec: spec.layout + ("+tier" if spec.offload_blocks else "")
)
def table(request):
    backend = Simulated(request.param)
    return tabulate(
        request.param.name, run(backend, Generator(backend.shape, 7).cases(3 * len(backend.shape.kinds)))
    )


def test_every_kind_the_shape_can_inject_is_scored(table):
    kinds = next(spec.shape.kinds for spec in SHAPES if spec.name == table.shape)
    assert len(kinds) >= 13 and set(table.counts) == set(kinds)
    assert all(table.scored(kind) >= 3 for kind in kinds)


def test_append_only_turns_never_get_a_fault_cause(table):
    assert table.scored("append_turn") > 20
    assert table.faulted_appends() == 0, table.counts["append_turn"]


def test_front_fields_are_prefix_diverged_and_never_another_fault(table):
    front = sum((table.counts[kind] for kind in FRONT_FIELDS), Counter())
    assert front["prefix_diverged"] >= 0.8 * sum(front.values()), front
    assert set(front) & FAULTS <= {"prefix_diverged"}, front


def test_a_generated_answer_rerendered_is_history_rewritten_and_never_another_fault(table):
    # the engine generates the answer, the next turn re-renders it (workload.py `_generated`); a miss
    # is cold when too little of the kept text had been seen as generated (docs/accuracy.md)
    history = table.counts["assistant_truncated"] + table.counts["tool_args_reserialized"]
    assert history["history_rewritten"] >= 4 and set(history) <= {"history_rewritten", "cold"}, history


def test_repeats_hit_and_resets_restarts_and_overflows_are_named(table):
    assert table.right("exact_repeat") == table.scored("exact_repeat")
    for kind in ("cache_reset", "engine_restart", "capacity_overflow"):
        if kind in table.counts:
            assert table.right(kind) == table.scored(kind), (kind, table.counts[kind])


class SkipsResets(Simulated):
    """A backend that does not do the reset a request asks for."""

    def send(self, request):
        return super().send(replace(request, before=None))


def test_the_check_can_fail_a_reset_the_backend_skips_is_not_a_restart():
    backend = SkipsResets(SHAPES[0])
    table = tabulate("no reset", run(backend, Generator(backend.shape, 7).cases(14)))
    assert table.scored("cache_reset") == 1 and table.right("cache_reset") == 0
    assert table.counts["cache_reset"] == {HIT: 1}


def test_the_named_cause_is_the_largest_delta_else_hit_or_decode():
    assert named({"cold": 32, "prefix_diverged": 64}) == "prefix_diverged"
    assert named({"cold": 32, "evicted": 32}) == "cold"  # a tie: the first by name
    assert named({}) == HIT and named({"cold": 0}) == HIT
    assert named({}, decode=16) == DECODE
    assert {"evicted", "restart", "prefix_diverged"} <= FAULTS and "cold" not in FAULTS


def test_the_sidecar_reads_a_request_as_its_own_delta():
    sidecar = Sidecar()
    store = BlockStored([101, 102], None, list(range(20, 52)), 16)
    batch = decode_message([b"kv", (0).to_bytes(8, "big"), encode_batch([store], 0, 1.0)], with_tokens=True)
    assert sidecar.feed([batch]) == {"cold": 32}
    assert sidecar.feed([]) == {}  # the next request's delta starts from there


def test_a_host_tier_load_is_tier_restored_and_a_short_shared_prefix_never_another_fault(table):
    """The CPU tier's loads are read from the restored tokens serve exports apart (not a miss); shared
    content short of a unit is below_hit_unit where an anchor sees it, else cold (docs/accuracy.md)."""
    if "host_tier_load" in table.counts:
        assert table.right("host_tier_load") == table.scored("host_tier_load"), table.counts["host_tier_load"]
    short = table.counts["short_shared_prefix"]
    assert set(short) <= {"below_hit_unit", "cold"}, short
    if table.shape == "simulator deepseek-v4":  # 256-token units: the shared part holds anchors
        assert short["below_hit_unit"] == short.total(), short


def test_a_change_no_whole_unit_holds_cannot_show_and_is_not_counted():
    """Decided from the case: a prompt shorter than a unit, or a content change past the last whole
    unit, cannot reach the stream; an action before the request or another identity can."""
    unit = 16
    field = Request(tuple(range(40)), "timestamp_first", "prefix_diverged")
    assert can_show(field, (99, *range(1, 40)), unit)  # differs in the first unit
    assert not can_show(field, (*range(33), 99), unit)  # differs at token 33, past the 32 stored
    assert not can_show(
        Request(tuple(range(15)), "other_identity", "identity_isolated", identity="a"), (), unit
    )
    assert can_show(
        Request(tuple(range(40)), "cache_reset", "restart", before="reset"), tuple(range(40)), unit
    )
    table = Table("t", {"uuid_first": Counter({"prefix_diverged": 3, CANNOT_SHOW: 2})})
    assert table.scored("uuid_first") == 3 and table.right("uuid_first") == 3
    assert table.misnamed("uuid_first") == Counter() and table.cannot_show("uuid_first") == 2
