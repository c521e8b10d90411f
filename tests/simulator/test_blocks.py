from kvcache_exporter.simulator.blocks import (
    BlockPool,
    BlockRemoved,
    BlockStored,
    block_hashes_for,
    external_hash,
)
from kvcache_exporter.simulator.engine import Engine, EngineConfig, Request


def run_one(engine: Engine, prompt: list[int], max_tokens: int = 1) -> Request:
    request = Request(f"r{len(prompt)}-{prompt[0]}", prompt, max_tokens, 0.0)
    engine.add_request(request)
    while engine.has_work:
        engine.step(0.0)
    return request


def test_hash_chains_over_parent_and_fits_in_64_bits():
    a = block_hashes_for(list(range(8)), 4, [])
    b = block_hashes_for([9, 9, 9, 9, 4, 5, 6, 7], 4, [])
    assert len(a) == 2 and a[1] != b[1]  # same tokens, different parent
    assert 0 <= external_hash(a[0]) < 2**64


def test_usage_excludes_the_null_block_and_counts_cached_free_blocks_as_free():
    pool = BlockPool(num_gpu_blocks=5, block_size=4)
    blocks = pool.get_new_blocks(2)
    assert pool.usage == 0.5
    pool.free_blocks(reversed(blocks))
    assert pool.usage == 0.0


def test_fully_cached_block_aligned_prompt_recomputes_its_last_block():
    engine = Engine(EngineConfig(block_size=4, num_gpu_blocks=16, max_model_len=64))
    prompt = list(range(10, 18))  # two full blocks
    run_one(engine, prompt)
    again = run_one(engine, prompt)
    assert again.num_cached_tokens == 4  # capped at prompt-1 tokens -> only the first block
    longer = run_one(engine, [*prompt, 99])
    assert longer.num_cached_tokens == 8


def test_blocks_filled_during_decode_are_cached_and_announced():
    engine = Engine(EngineConfig(block_size=4, num_gpu_blocks=16, max_model_len=64))
    request = Request("r", [11, 12, 13], 6, 0.0)
    engine.add_request(request)
    stored = []
    while engine.has_work:
        stored += [e for e in engine.step(0.0).events if isinstance(e, BlockStored)]
    # 3 prompt tokens + 5 computed outputs = 8 tokens = 2 full blocks, each stored in the step that filled it
    assert [len(e.block_hashes) for e in stored] == [1, 1]
    assert stored[1].parent_block_hash == stored[0].block_hashes[0]
    follow_up = run_one(engine, [*request.all_token_ids[:8], 1])
    assert follow_up.num_cached_tokens == 8


def test_eviction_takes_fresh_blocks_first_then_the_tail_of_the_oldest_chain():
    engine = Engine(EngineConfig(block_size=4, num_gpu_blocks=7, max_model_len=64))  # 6 usable blocks
    first = list(range(100, 112))  # 3 full blocks
    second = list(range(200, 212))
    run_one(engine, [*first, 1])  # 4 blocks: 3 cached + 1 partial (unhashed, freed to the queue front)
    # needs 4: the partial block, the 2 never-used blocks, then first's tail block (A3)
    run_one(engine, [*second, 1])
    assert run_one(engine, [*first, 2]).num_cached_tokens == 8
    # that request evicted second's tail (after second's partial block)
    assert run_one(engine, [*second, 3]).num_cached_tokens == 8


def test_preemption_when_blocks_run_out():
    engine = Engine(EngineConfig(block_size=4, num_gpu_blocks=9, max_model_len=64, max_num_batched_tokens=64))
    requests = [Request(f"r{i}", [50 + i] * 10, 12, 0.0) for i in range(2)]
    for request in requests:
        engine.add_request(request)
    while engine.has_work:
        engine.step(0.0)
    assert engine.stats.num_preemptions >= 1
    assert all(len(r.output_token_ids) == 12 for r in requests)
    assert engine.stats.prefix_cache_queries == 20  # preempted lookups are not exported
    assert engine.pool.usage == 0.0


def test_removed_events_when_cached_blocks_are_reused():
    engine = Engine(EngineConfig(block_size=4, num_gpu_blocks=4, max_model_len=64))  # 3 usable
    events = []
    for base in (10, 20, 30):
        engine.add_request(Request(str(base), list(range(base, base + 8)), 1, 0.0))
        while engine.has_work:
            events += engine.step(0.0).events
    assert any(isinstance(e, BlockRemoved) for e in events)
