"""The group model's single-group fast path (every Llama-like model): batches pass through untouched,
and whatever it does not handle (a re-announced hit, an adapter, a session, a cache salt, a tier, a
new block size) goes the general way, even mid-batch and long after the stream began."""

from __future__ import annotations

import random

import msgspec

from kvcache_exporter.derive.units import UnitView
from kvcache_exporter.sources.kv_events_decode import Batch, Event

SIZE = 16
SALT = msgspec.msgpack.encode([["tenant-a"], None])


def store(hashes: list[int], parent: int | None = None, **fields) -> Event:
    tokens = [1000 + h % 40_000 for h in hashes for _ in range(SIZE)]
    return Event("BlockStored", hashes, parent, tokens, SIZE, group=0, kind="full_attention", **fields)


def removal(hashes: list[int], **fields) -> Event:
    return Event("BlockRemoved", hashes, group=0, medium="GPU", **fields)


def view_after(*batches: list[Event], general_only: bool = False) -> tuple[UnitView, list[Batch], int]:
    """The view after `batches`, what it passed on for each, and how many events took the fast path."""
    view, fast = UnitView(), [0]
    single_group = view._single_group

    def counted(events) -> int:
        fast[0] += (n := 0 if general_only else single_group(events))
        return n

    view._single_group = counted  # general_only: the general path alone, the reference
    inputs = [Batch(seq, 1.0, tuple(events)) for seq, events in enumerate(batches)]
    outs = [view.units(batch) for batch in inputs]
    passed = [out for out, batch in zip(outs, inputs, strict=True) if out is batch]
    return view, outs, len(passed), fast[0]


def test_a_plain_batch_passes_through_as_it_is():
    view, _, passed, fast = view_after(
        [store([1, 2])], [removal([1]), store([3, 4], parent=2), removal([2])], [store([5], parent=4)]
    )
    assert passed == 3 and fast == 4  # the first batch taught the group: the general path
    assert view.resident == {3, 4, 5}
    assert view.totals.stored_tokens == 5 * SIZE
    assert view.by_adapter.counts == {"base": 5 * SIZE}


def test_what_the_fast_path_does_not_handle_goes_the_general_way_mid_batch():
    learned = [store([1, 2])]
    reuse = [removal([9]), store([5], parent=2), store([1, 2]), store([6], parent=5)]  # [1, 2] re-announced
    view, _, _, fast = view_after(learned, reuse)
    assert fast == 2
    assert view.totals.reused_tokens == 2 * SIZE
    assert view.totals.stored_tokens == 4 * SIZE

    view, outs, _, _ = view_after(learned, [store([7], parent=2), store([10], lora_name="a", session_id="s")])
    assert view.by_adapter.counts == {"base": 3 * SIZE, "a": SIZE}
    assert view.by_session.counts == {"s": SIZE} and view.totals.session_tokens == SIZE
    assert outs[1].events[1].token_ids != store([10]).token_ids  # the adapter's own identity

    view, outs, _, _ = view_after(learned, [store([11], extra_keys=SALT)])
    assert outs[1].events[0].token_ids != store([11]).token_ids  # the salt's own identity
    view, outs, passed, _ = view_after(learned, [store([11], extra_keys=msgspec.msgpack.encode([None]))])
    assert passed == 2 and outs[1].events[0].token_ids == store([11]).token_ids

    view, _, _, _ = view_after(learned, [store([20], medium="CPU")], [store([20])])  # loaded back
    assert view.totals.tier_hit_tokens == {"CPU": SIZE} and view.totals.stored_tokens == 2 * SIZE

    view, _, _, _ = view_after(learned, [store([12], parent=2)._replace(block_size=32, token_ids=[1] * 32)])
    assert view.groups[0].block_sizes == {16, 32}


def test_a_tagged_chain_keeps_its_identity_after_plain_batches():
    _, outs, _, _ = view_after([store([1], lora_name="a")], [store([2], parent=1)])
    assert outs[1].events[0].token_ids != store([2], parent=1).token_ids  # inherited from its parent


def test_the_fast_path_equals_the_general_path_on_a_random_stream():
    rng = random.Random(20)
    batches, held, next_hash = [], [], 1
    for i in range(400):
        late = i >= 350  # an adapter, a salt or a tier turns the fast path off for good
        events = []
        for _ in range(rng.randrange(0, 5)):
            roll = rng.random()
            if roll < 0.4 and held:
                events.append(removal([held.pop(rng.randrange(len(held)))]))
            elif roll < 0.5 and held:  # a re-announced hit (kv_cache_report_mode=full), held or not
                events.append(store(rng.sample(held, min(2, len(held))) + [next_hash] * rng.randrange(2)))
            else:
                hashes = list(range(next_hash, next_hash + rng.randrange(1, 4)))
                next_hash += len(hashes)
                fields = {}
                if late and rng.random() < 0.1:
                    fields["lora_name"] = rng.choice(["a", "b"])
                if rng.random() < 0.03:
                    fields["session_id"] = "s"
                if late and rng.random() < 0.1:
                    fields["extra_keys"] = SALT
                if late and rng.random() < 0.1:
                    fields["medium"] = "CPU"
                parent = rng.choice(held) if held and rng.random() < 0.5 else None
                events.append(store(hashes, parent, **fields))
                held += hashes
        batches.append(events)
    fast, fast_out, _, handled = view_after(*batches)
    slow, slow_out, _, _ = view_after(*batches, general_only=True)
    assert handled > 300
    assert fast_out == slow_out
    assert (fast.totals, fast.resident, fast.tiers, fast._tags) == (
        slow.totals,
        slow.resident,
        slow.tiers,
        slow._tags,
    )
    assert (fast.by_adapter.counts, fast.by_session.counts) == (
        slow.by_adapter.counts,
        slow.by_session.counts,
    )
    assert (fast.reused_by_adapter.counts, fast.reused_by_session.counts) == (
        slow.reused_by_adapter.counts,
        slow.reused_by_session.counts,
    )
    assert fast.totals.reused_tokens and fast.totals.session_tokens and fast._tags and fast.tiers
