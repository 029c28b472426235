"""Unit tests for engine/core/block_pool.py: free queue, ref counts, hashing, eviction."""

from __future__ import annotations

import pytest

from pagedserve.engine.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, hash_block_tokens


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def check_links(queue: FreeKVCacheBlockQueue) -> None:
    """Forward and backward walks agree and match the counter."""
    forward = queue.get_all_free_blocks()
    backward = []
    node = queue._tail.prev_free
    while node is not queue._head:
        backward.append(node)
        node = node.prev_free
    assert ids(forward) == ids(backward[::-1])
    assert len(forward) == queue.num_free_blocks


# ---- free queue --------------------------------------------------------------------------


def test_free_queue_fifo_order_and_remove_from_middle():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4, 5]
    q.remove(blocks[3])
    assert blocks[3].prev_free is None and blocks[3].next_free is None
    check_links(q)
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 4, 5]
    assert q.popleft() is blocks[0]
    q.remove(blocks[5])  # the last one
    q.append(blocks[3])
    q.append(blocks[0])
    check_links(q)
    assert ids(q.get_all_free_blocks()) == [1, 2, 4, 3, 0]
    assert [q.popleft().block_id for _ in range(5)] == [1, 2, 4, 3, 0]
    assert q.num_free_blocks == 0
    check_links(q)
    with pytest.raises(ValueError):
        q.popleft()


def test_free_queue_rejects_double_insert_and_remove_of_absent_block():
    blocks = [KVCacheBlock(i) for i in range(2)]
    q = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError):
        q.append(blocks[0])
    q.remove(blocks[0])
    with pytest.raises(ValueError):
        q.remove(blocks[0])
    check_links(q)


# ---- hashing -----------------------------------------------------------------------------


def test_hash_chaining_parent_salt_and_tokens_matter():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(None, [1, 2, 3, 4])  # deterministic
    other_parent = hash_block_tokens(None, [9, 9, 9, 9])
    assert hash_block_tokens(h0, [5, 6, 7, 8]) != hash_block_tokens(other_parent, [5, 6, 7, 8])
    assert hash_block_tokens(h0, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4], ("salt-a",)) != h0
    assert hash_block_tokens(None, [1, 2, 3, 4], ("salt-a",)) != hash_block_tokens(None, [1, 2, 3, 4], ("salt-b",))
    assert hash_block_tokens(None, [1, 2, 3, 5]) != h0
    # Key type and boundaries are part of the encoding.
    assert hash_block_tokens(None, [1], ("1",)) != hash_block_tokens(None, [1], (1,))
    assert hash_block_tokens(None, [1], ("ab", "c")) != hash_block_tokens(None, [1], ("a", "bc"))


def test_hash_rejects_bad_input():
    with pytest.raises(ValueError, match="extra_keys"):
        hash_block_tokens(None, [1], (1.5,))
    with pytest.raises(ValueError, match="token_ids"):
        hash_block_tokens(None, [2**70])


# ---- pool --------------------------------------------------------------------------------


def test_pool_validates_size():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, enable_caching=True)


def test_get_new_blocks_takes_from_head_and_sets_ref():
    pool = BlockPool(4, enable_caching=True)
    got = pool.get_new_blocks(3)
    assert ids(got) == [0, 1, 2] and all(b.ref_cnt == 1 for b in got)
    assert pool.num_free_blocks == 1 and pool.usage == pytest.approx(0.75)
    with pytest.raises(ValueError, match="n"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1  # failed call took nothing


def test_free_order_is_eviction_order():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [2, 0, 3, 1]
    assert ids(pool.get_new_blocks(2)) == [2, 0]


def test_shared_blocks_ref_counts():
    pool = BlockPool(3, enable_caching=True)
    a = pool.get_new_blocks(2)
    pool.touch(a)  # a second owner
    assert [b.ref_cnt for b in a] == [2, 2]
    pool.free_blocks(a)
    assert [b.ref_cnt for b in a] == [1, 1] and pool.num_free_blocks == 1
    pool.free_blocks(a)
    assert pool.num_free_blocks == 3
    with pytest.raises(ValueError, match="already free"):
        pool.free_blocks(a[:1])


def test_cached_free_block_can_be_hit_and_touch_removes_it_from_queue():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    h0 = hash_block_tokens(None, [1, 2])
    h1 = hash_block_tokens(h0, [3, 4])
    pool.cache_full_blocks(blocks, [h0, h1], 0, 2)
    assert pool.get_cached_block(h0) is blocks[0] and blocks[1].block_hash == h1
    pool.free_blocks(reversed(blocks))
    assert pool.num_free_blocks == 4
    # Still cached while free; a hit pulls it out of the middle of the queue.
    hit = pool.get_cached_block(h1)
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and hit not in pool.free_block_queue.get_all_free_blocks()
    check_links(pool.free_block_queue)
    assert pool.num_free_blocks == 3


def test_eviction_takes_least_recently_freed_and_drops_its_hash():
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    hashes = [hash_block_tokens(None, [i]) for i in range(3)]
    pool.cache_full_blocks(blocks, hashes, 0, 3)
    pool.free_blocks([blocks[1], blocks[2], blocks[0]])
    [evicted] = pool.get_new_blocks(1)
    assert evicted is blocks[1] and evicted.block_hash is None
    assert pool.get_cached_block(hashes[1]) is None
    assert pool.get_cached_block(hashes[2]) is blocks[2]
    assert pool.get_cached_block(hashes[0]) is blocks[0]


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [7])
    pool.cache_full_blocks([a], [h], 0, 1)
    pool.cache_full_blocks([b], [h], 0, 1)
    assert pool.get_cached_block(h) is a and b.block_hash is None
    pool.free_blocks([b, a])
    pool.get_new_blocks(1)  # evicts b: must not drop a's entry
    assert pool.get_cached_block(h) is a


def test_caching_disabled_registers_nothing():
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1])
    pool.cache_full_blocks(blocks, [h], 0, 1)
    assert pool.get_cached_block(h) is None and blocks[0].block_hash is None


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    hashes = [hash_block_tokens(None, [1]), hash_block_tokens(None, [2])]
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    pool.free_blocks(blocks[:1])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    pool.free_blocks(blocks[1:])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(hashes[0]) is None and pool.get_cached_block(hashes[1]) is None
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.num_free_blocks == 2
