from hypothesis import given
from hypothesis import strategies as st

from kvcache_exporter.aggregator import fleet_holders as holders
from kvcache_exporter.aggregator.fleet_holders import SMALL, Rank

RANKS = [Rank(f"r{replica}", 1 << rank) for replica in range(12) for rank in range(3)]


@given(st.lists(st.sampled_from(range(len(RANKS))), max_size=80))
def test_any_toggling_of_ranks_answers_as_a_plain_set_would(toggles):
    held, model = None, set()
    for index in toggles:
        rank = RANKS[index]
        if index in model:
            model.discard(index)
            held = holders.remove(held, rank)
        else:
            model.add(index)
            held = holders.add(held, rank)
        if not model:
            assert held is None
            continue
        names = {RANKS[i].replica for i in model}
        assert holders.replicas(held) == names
        assert holders.sole_replica(held) == (next(iter(names)) if len(names) == 1 else None)
        assert [holders.holds(held, r) for r in RANKS] == [i in model for i in range(len(RANKS))]


def test_one_rank_is_itself_a_few_a_tuple_more_a_dict_by_replica():
    held = holders.add(None, RANKS[0])
    assert held is RANKS[0]
    for rank in RANKS[1:SMALL]:
        held = holders.add(held, rank)
    assert held == tuple(RANKS[:SMALL])
    held = holders.add(held, RANKS[SMALL])
    assert held == {"r0": 0b111, "r1": 0b111, "r2": 0b111}
