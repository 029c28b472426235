"""Accounting of every KV block in every tier after a workload: the device block pool and the offload tier
(the scheduler's index, each rank's files and staging), for tests of the KV offload tier."""

from __future__ import annotations

from pagedserve.engine import LLM


def check_device_pool(llm: LLM) -> None:
    """Every device block is free, in the free queue once, and the hash map agrees with the blocks."""
    pool = llm.llm_engine.engine_core.kv_cache_manager.block_pool
    assert all(b.ref_cnt == 0 for b in pool.blocks), [b for b in pool.blocks if b.ref_cnt]
    queued = pool.free_block_queue.get_all_free_blocks()
    assert len(queued) == pool.num_blocks == len({b.block_id for b in queued})
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash
    hashed = [b for b in pool.blocks if b.block_hash is not None]
    assert len(hashed) == len(pool.cached_block_hash_to_block)


def check_offload_tier(llm: LLM) -> dict:
    """The tier's index is within its capacity, nothing is pinned or in flight, and every rank wrote exactly
    the indexed blocks (all on the tier, none staged). Returns the engine's tier state."""
    state = llm.llm_engine.engine_core.kv_offload_state()
    index = set(state["index"])
    assert len(index) == len(state["index"]) <= state["capacity_blocks"]
    assert not state["pins"] and state["loads_in_flight"] == 0
    for rank_state in state["ranks"]:
        assert rank_state["pending"] == 0 and rank_state["staged_bytes"] == 0
        assert rank_state["stats"]["skipped_stores"] == 0
        assert rank_state["owned"] == index, (len(rank_state["owned"]), len(index))
        assert index <= rank_state["files"]
    return state


def check_all_blocks(*llms: LLM) -> None:
    for llm in llms:
        check_device_pool(llm)
        if llm.llm_engine.config.kv_offload_size is not None:
            check_offload_tier(llm)
