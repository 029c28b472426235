"""Unit tests for engine/core/kv_cache_manager.py: prefix hits, allocation, freeing, stats, invariants."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

import pagedserve.engine.core.block_pool as block_pool
from pagedserve.engine.core.block_pool import BlockHash, hash_block_tokens
from pagedserve.engine.core.kv_cache_manager import KVCacheManager, PrefixCacheStats

BS = 4


@dataclass
class Req:
    """Stand-in for the scheduler's Request (the attributes the manager reads)."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    num_preemptions: int = 0
    skip_reading_prefix_cache: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def ref_hashes(tokens: list[int], salt: str | None, block_size: int = BS) -> list[BlockHash]:
    """Independent oracle: chained hashes of every full block, from scratch."""
    out: list[BlockHash] = []
    for i in range(len(tokens) // block_size):
        extra = (salt,) if (i == 0 and salt is not None) else None
        out.append(hash_block_tokens(out[-1] if out else None, tokens[i * block_size : (i + 1) * block_size], extra))
    return out


def schedule_prefill(m: KVCacheManager, req: Req, num_tokens: int | None = None):
    """What the scheduler does for a waiting request: look up hits, allocate, advance."""
    hit_blocks, num_hit = m.get_computed_blocks(req)
    n = req.num_tokens - num_hit if num_tokens is None else num_tokens
    new = m.allocate_slots(req, n, num_hit, hit_blocks)
    if new is not None:
        req.num_computed_tokens = num_hit + n
    return new, hit_blocks, num_hit


def snapshot(m: KVCacheManager):
    pool = m.block_pool
    return (
        [b.ref_cnt for b in pool.blocks],
        [b.block_hash for b in pool.blocks],
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        dict(pool.cached_block_hash_to_block),
        {k: list(v) for k, v in m.req_to_blocks.items()},
        dict(m.num_cached_blocks),
        m.total_prefix_cache_stats,
    )


# ---- basics ------------------------------------------------------------------------------


def test_validation():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(0, 4)
    m = KVCacheManager(4, BS)
    with pytest.raises(ValueError, match="num_new_tokens"):
        m.allocate_slots(Req("a", [1, 2]), -1)
    with pytest.raises(ValueError, match="num_new_computed_tokens"):
        m.allocate_slots(Req("a", [1, 2]), 1, -1)
    with pytest.raises(ValueError, match="num_tokens"):
        m.num_blocks_for(-1)
    assert [m.num_blocks_for(n) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]


def test_allocate_grow_and_block_ids():
    m = KVCacheManager(8, BS)
    r = Req("a", list(range(6)))
    new, _, _ = schedule_prefill(m, r)
    assert len(new) == 2 and m.get_block_ids("a") == [b.block_id for b in new]
    # Decode: a sampled token fills the second block; no new block yet.
    r.all_token_ids += [100, 101]
    assert m.allocate_slots(r, 2) == []
    r.num_computed_tokens += 2
    r.all_token_ids.append(102)
    [third] = m.allocate_slots(r, 1)
    assert m.get_block_ids("a") == [b.block_id for b in new] + [third.block_id]
    assert m.get_block_ids("unknown") == []
    assert m.num_free_blocks == 5 and m.usage == pytest.approx(3 / 8)
    assert m.num_cached_blocks["a"] == 2  # blocks 0 and 1 are full and registered
    assert [b.block_hash for b in new] == ref_hashes(r.all_token_ids, None)


def test_lookahead_slots_register_only_known_tokens():
    m = KVCacheManager(8, BS)
    r = Req("a", list(range(6)))
    # Slots for 6 known tokens + 6 speculative ones (not yet in all_token_ids).
    new = m.allocate_slots(r, 12)
    assert len(new) == 3
    assert [b.block_hash is not None for b in new] == [True, False, False]
    assert m.num_cached_blocks["a"] == 1
    r.num_computed_tokens = 6
    r.all_token_ids += [6, 7, 8, 9]
    assert m.allocate_slots(r, 4) == []
    assert [b.block_hash is not None for b in new] == [True, True, False]


def test_shared_prefix_hit_and_ref_counts():
    m = KVCacheManager(16, BS)
    prefix = list(range(10))  # two full blocks + 2 tokens
    a = Req("a", prefix + [50, 51])
    schedule_prefill(m, a)
    b = Req("b", prefix + [60, 61, 62])
    new_b, hit_b, num_hit = schedule_prefill(m, b)
    assert num_hit == 8 and [x.block_id for x in hit_b] == m.get_block_ids("a")[:2]
    assert all(x.ref_cnt == 2 for x in hit_b)
    assert m.get_block_ids("b")[:2] == m.get_block_ids("a")[:2]
    assert len(new_b) == 2  # tokens 8..12 need blocks 2 and 3
    assert set(m.get_block_ids("b")[2:]).isdisjoint(m.get_block_ids("a"))
    # A different salt shares nothing.
    c = Req("c", prefix + [70], cache_salt="tenant-2")
    _, hit_c, num_hit_c = schedule_prefill(m, c)
    assert hit_c == [] and num_hit_c == 0


def test_hit_reaches_free_cached_blocks():
    m = KVCacheManager(8, BS)
    a = Req("a", list(range(9)))
    schedule_prefill(m, a)
    a_ids = m.get_block_ids("a")
    m.free(a)
    assert m.num_free_blocks == 8
    b = Req("b", list(range(9)) + [42])
    new, hit, num_hit = schedule_prefill(m, b)
    assert num_hit == 8 and [x.block_id for x in hit] == a_ids[:2]
    assert m.num_free_blocks == 8 - 3
    free_ids = {x.block_id for x in m.block_pool.free_block_queue.get_all_free_blocks()}
    assert free_ids.isdisjoint(m.get_block_ids("b"))


def test_never_hits_the_whole_prompt():
    m = KVCacheManager(8, BS)
    a = Req("a", list(range(8)))  # exactly two full blocks
    schedule_prefill(m, a)
    b = Req("b", list(range(8)))
    hit, num_hit = m.get_computed_blocks(b)
    assert num_hit == 4 and len(hit) == 1  # last token recomputed -> only the first block
    c = Req("c", list(range(9)))
    assert m.get_computed_blocks(c)[1] == 8
    assert m.get_computed_blocks(Req("d", [0]))[1] == 0
    assert m.get_computed_blocks(Req("e", []))[1] == 0


def test_caching_disabled():
    m = KVCacheManager(8, BS, enable_caching=False)
    a = Req("a", list(range(9)))
    schedule_prefill(m, a)
    assert m.get_computed_blocks(Req("b", list(range(9)) + [1])) == ([], 0)
    assert m.block_pool.cached_block_hash_to_block == {}


def test_allocation_failure_changes_nothing():
    m = KVCacheManager(4, BS)
    a = Req("a", list(range(9)))
    schedule_prefill(m, a)  # 3 blocks: 2 full (cached) + 1
    m.free(a)
    m.make_prefix_cache_stats()
    total_before = PrefixCacheStats(**vars(m.total_prefix_cache_stats))
    # b hits a's 2 free cached blocks; needs 3 more, but only 4 - 2 hits = 2 are truly available.
    b = Req("b", list(range(9)) + list(range(100, 111)))
    before = snapshot(m)
    hit, num_hit = m.get_computed_blocks(b)
    assert num_hit == 8
    assert m.allocate_slots(b, b.num_tokens - num_hit, num_hit, hit) is None
    assert snapshot(m)[:6] == before[:6]
    assert m.total_prefix_cache_stats == total_before
    assert m.make_prefix_cache_stats() == PrefixCacheStats()
    # Exactly fitting works: 8 hit + 8 new tokens = 4 blocks.
    b2 = Req("b2", list(range(9)) + list(range(100, 107)))
    new, hit2, num_hit2 = schedule_prefill(m, b2)
    assert num_hit2 == 8 and len(new) == 2 and m.num_free_blocks == 0


def test_growth_failure_changes_nothing():
    m = KVCacheManager(2, BS)
    a = Req("a", list(range(8)))
    schedule_prefill(m, a)
    a.all_token_ids.append(8)
    before = snapshot(m)
    assert m.allocate_slots(a, 1) is None
    assert snapshot(m) == before


def test_free_is_tail_first_and_idempotent():
    m = KVCacheManager(6, BS)
    a = Req("a", list(range(12)))
    schedule_prefill(m, a)
    a_ids = m.get_block_ids("a")
    m.free(a)
    m.free(a)
    assert m.num_free_blocks == 6 and m.get_block_ids("a") == []
    assert [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()][-3:] == a_ids[::-1]
    # Reuse evicts the never-used blocks first, then a's tail before its prefix.
    z = Req("z", list(range(1000, 1016)))
    schedule_prefill(m, z)
    assert m.get_block_ids("z")[-1] == a_ids[-1]
    assert m.get_computed_blocks(Req("q", list(range(9))))[1] == 8  # a's first two blocks survive


def test_stats_count_only_reused_tokens():
    m = KVCacheManager(16, BS)
    a = Req("a", list(range(10)))
    schedule_prefill(m, a)
    b = Req("b", list(range(10)) + [7])
    m.get_computed_blocks(b)
    m.get_computed_blocks(b)  # lookups alone count nothing
    assert m.make_prefix_cache_stats() == PrefixCacheStats(requests=1, queries=10, hits=0)
    schedule_prefill(m, b)
    # Growth of a running request is not a new query.
    b.all_token_ids.append(5)
    m.allocate_slots(b, 1)
    assert m.make_prefix_cache_stats() == PrefixCacheStats(requests=1, queries=11, hits=8)
    assert m.make_prefix_cache_stats() == PrefixCacheStats()
    assert m.total_prefix_cache_stats == PrefixCacheStats(requests=2, queries=21, hits=8)


def test_stats_count_each_prompt_once_across_preemption():
    m = KVCacheManager(16, BS)
    a = Req("a", list(range(10)))
    schedule_prefill(m, a)
    assert m.make_prefix_cache_stats() == PrefixCacheStats(requests=1, queries=10, hits=0)
    # Preempted: its blocks are freed; on resuming it hits its own two full blocks.
    m.free(a)
    a.num_computed_tokens = 0
    a.num_preemptions = 1
    _, _, num_hit = schedule_prefill(m, a)
    assert num_hit == 8
    assert m.make_prefix_cache_stats() == PrefixCacheStats(preempted_requests=1, preempted_queries=10, preempted_hits=8)
    total = m.total_prefix_cache_stats
    assert (total.requests, total.queries, total.hits, total.hit_rate) == (1, 10, 0, 0.0)


def test_request_that_skips_reading_the_cache_gets_no_hit_and_is_no_query():
    m = KVCacheManager(16, BS)
    schedule_prefill(m, Req("a", list(range(10))))
    m.make_prefix_cache_stats()
    b = Req("b", list(range(10)), skip_reading_prefix_cache=True)
    assert m.get_computed_blocks(b) == ([], 0)
    new, _, _ = schedule_prefill(m, b)
    assert len(new) == 3
    assert m.make_prefix_cache_stats() == PrefixCacheStats()
    # Its blocks are not registered twice: a's blocks stay the ones a later reader hits.
    hit, num_hit = m.get_computed_blocks(Req("c", list(range(10))))
    assert num_hit == 8 and [x.block_id for x in hit] == m.get_block_ids("a")[:2]


def test_block_hashes_are_incremental():
    calls = 0
    real = block_pool.hash_block_tokens

    def counting(*args, **kwargs):
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)

    m = KVCacheManager(32, BS)
    r = Req("a", list(range(5)), cache_salt="s")
    mp = pytest.MonkeyPatch()
    mp.setattr(block_pool, "hash_block_tokens", counting)  # (the chain is extended there)
    try:
        schedule_prefill(m, r)
        for t in range(40):
            r.all_token_ids.append(t)
            m.get_computed_blocks(r)
            assert m.allocate_slots(r, 1) is not None
            r.num_computed_tokens += 1
    finally:
        mp.undo()
    assert calls == r.num_tokens // BS
    assert m.req_to_block_hashes["a"] == ref_hashes(r.all_token_ids, "s")


def test_reset_prefix_cache():
    m = KVCacheManager(8, BS)
    a = Req("a", list(range(9)))
    schedule_prefill(m, a)
    assert m.reset_prefix_cache() is False
    m.free(a)
    assert m.reset_prefix_cache() is True
    assert m.get_computed_blocks(Req("b", list(range(9))))[1] == 0


def test_new_computed_blocks_only_for_fresh_request():
    m = KVCacheManager(8, BS)
    a = Req("a", list(range(9)))
    schedule_prefill(m, a)
    b = Req("b", list(range(9)))
    hit, n = m.get_computed_blocks(b)
    schedule_prefill(m, Req("b", [1]))
    with pytest.raises(ValueError, match="new_computed_blocks"):
        m.allocate_slots(b, 1, n, hit)


# ---- randomized stress -------------------------------------------------------------------


def check_invariants(m: KVCacheManager, content: dict[int, BlockHash]) -> None:
    pool = m.block_pool
    owners = [0] * pool.num_blocks
    for blocks in m.req_to_blocks.values():
        for b in blocks:
            owners[b.block_id] += 1
    assert [b.ref_cnt for b in pool.blocks] == owners
    free = pool.free_block_queue.get_all_free_blocks()
    assert sorted(b.block_id for b in free) == [b.block_id for b in pool.blocks if b.ref_cnt == 0]
    assert pool.num_free_blocks == len(free)
    for h, b in pool.cached_block_hash_to_block.items():
        assert b.block_hash == h
        assert content.get(b.block_id) == h  # the registered block really holds that prefix
    for b in pool.blocks:
        if b.block_hash is not None:
            assert pool.cached_block_hash_to_block[b.block_hash] is b


@pytest.mark.parametrize("seed", range(4))
def test_randomized_stress(seed: int):
    rng = random.Random(seed)
    m = KVCacheManager(num_blocks=24, block_size=BS)
    bases = [[rng.randrange(50) for _ in range(30)] for _ in range(3)]
    content: dict[int, BlockHash] = {}  # block_id -> prefix hash of the KV actually written there
    running: dict[str, Req] = {}
    allocated: dict[str, int] = {}  # tokens each running request holds slots for

    def write(req: Req, start: int, end: int, num_hit_blocks: int = 0) -> None:
        """Simulate the forward pass: blocks that become full get the request's prefix hash."""
        hashes = ref_hashes(req.all_token_ids, req.cache_salt)
        blocks = m.req_to_blocks[req.request_id]
        for i in range(max(start // BS, num_hit_blocks), min(end, req.num_tokens) // BS):
            content[blocks[i].block_id] = hashes[i]

    for step in range(400):
        op = rng.random()
        if op < 0.35 or not running:
            rid = f"r{step}"
            base = rng.choice(bases)
            tokens = base[: rng.randrange(1, len(base))] + [rng.randrange(50) for _ in range(rng.randrange(0, 6))]
            req = Req(rid, tokens, cache_salt=rng.choice([None, None, "s"]))
            hit, num_hit = m.get_computed_blocks(req)
            hashes = ref_hashes(tokens, req.cache_salt)
            for i, b in enumerate(hit):
                assert content[b.block_id] == hashes[i]  # a hit returns the right KV
            assert num_hit < req.num_tokens
            chunk = rng.randrange(1, req.num_tokens - num_hit + 1)
            before = snapshot(m)
            new = m.allocate_slots(req, chunk, num_hit, hit)
            if new is None:
                assert snapshot(m) == before
                m.free(req)  # drops the lookup's hash state
            else:
                write(req, num_hit, num_hit + chunk, len(hit))
                req.num_computed_tokens = num_hit + chunk
                running[rid] = req
                allocated[rid] = req.num_computed_tokens
        elif op < 0.85:
            req = running[rng.choice(sorted(running))]
            if req.num_computed_tokens == req.num_tokens:
                req.all_token_ids.append(rng.randrange(50))  # the sampled token, computed next step
            n = rng.randrange(1, req.num_tokens - req.num_computed_tokens + 1)
            before = snapshot(m)
            new = m.allocate_slots(req, n)
            if new is None:
                assert snapshot(m) == before
                m.free(req)  # preempt
                del running[req.request_id], allocated[req.request_id]
            else:
                write(req, req.num_computed_tokens, req.num_computed_tokens + n)
                req.num_computed_tokens += n
                allocated[req.request_id] = req.num_computed_tokens
        else:
            rid = rng.choice(sorted(running))
            m.free(running.pop(rid))
            del allocated[rid]
        check_invariants(m, content)
        for rid, n in allocated.items():
            assert len(m.get_block_ids(rid)) == m.num_blocks_for(n)

    for req in running.values():
        m.free(req)
    check_invariants(m, content)
    assert m.num_free_blocks == m.num_blocks and m.usage == 0.0
    assert m.req_to_blocks == {} and m.req_to_block_hashes == {} and m.num_cached_blocks == {}
    total = m.total_prefix_cache_stats
    assert total.requests > 0 and 0 < total.hits <= total.queries
