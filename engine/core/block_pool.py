"""The block pool: every physical KV cache block, the LRU free queue, and the prefix-cache hash map.

A block is "free" exactly when its ref count is 0; free blocks sit in an LRU queue
(least recently freed at the head) and keep their contents and hash, so a later
request can still hit them. Taking a free block for new use evicts it: its hash is
dropped from the hash -> block map.

Block hashes are SHA-256 digests chained over the parent block's digest, the block's
token ids and optional extra keys (e.g. a cache salt). SHA-256 rather than the builtin
`hash` because a collision would silently reuse the wrong KV, and because digests are
stable across processes (str hashing is randomized per process), so other processes
(a data-parallel router, a KV connector) can compute the same hashes. It costs ~1 us
per full block and each block is hashed once per request.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

BlockHash = bytes
"""A 32-byte SHA-256 digest identifying a full block's contents and its whole prefix."""

ExtraKey = str | int | bytes

_ROOT_HASH: BlockHash = hashlib.sha256(b"pagedserve-kv-root").digest()


def _encode_extra_key(key: ExtraKey) -> bytes:
    """Type-tagged, length-prefixed encoding so distinct key tuples never encode alike."""
    if isinstance(key, bool) or not isinstance(key, (str, int, bytes)):
        raise ValueError(f"extra_keys: unsupported key type {type(key).__name__} (use str, int or bytes)")
    if isinstance(key, str):
        tag, data = b"s", key.encode("utf-8")
    elif isinstance(key, bytes):
        tag, data = b"b", key
    else:
        tag, data = b"i", str(key).encode("ascii")
    return tag + struct.pack("<I", len(data)) + data


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[ExtraKey] | None = None,
) -> BlockHash:
    """Hash one block: chained over `parent_hash` (None for the first block), its tokens and extra keys."""
    try:
        token_bytes = array("q", token_ids).tobytes()
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token_ids: must be 64-bit integers ({e})") from None
    h = hashlib.sha256(_ROOT_HASH if parent_hash is None else parent_hash)
    h.update(struct.pack("<I", len(token_ids)))
    h.update(token_bytes)
    if extra_keys:
        h.update(b"".join(_encode_extra_key(k) for k in extra_keys))
    return h.digest()


def first_block_extra_keys(cache_salt: str | None, lora_key: tuple = ()) -> tuple[ExtraKey, ...] | None:
    """The extra keys hashed into a request's first block (the chain carries them to every later one): its
    cache salt and the LoRA adapter it runs under (`LoRARequest.cache_key`: KV computed under one adapter is
    never a hit for another, nor for the base model). The one place that decides them, for the engine and
    for routers alike."""
    extra = (() if cache_salt is None else (cache_salt,)) + tuple(lora_key)
    return extra or None


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        cache_salt: str | None, max_blocks: int | None = None,
                        lora_key: tuple = ()) -> list[BlockHash]:
    """Extend `hashes` (a request's chain so far) to cover its full blocks (at most `max_blocks`)."""
    num_full = len(token_ids) // block_size
    if max_blocks is not None:
        num_full = min(num_full, max_blocks)
    for i in range(len(hashes), num_full):
        parent = hashes[-1] if hashes else None
        extra = first_block_extra_keys(cache_salt, lora_key) if i == 0 else None
        hashes.append(hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], extra))
    return hashes


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                        max_blocks: int | None = None, lora_key: tuple = ()) -> list[BlockHash]:
    """The prefix-cache hashes of a prompt's full blocks, exactly as the engine registers them."""
    return extend_block_hashes([], token_ids, block_size, cache_salt, max_blocks, lora_key)


class CacheEventSink(Protocol):
    """Where the pool reports hashes entering and leaving the prefix cache (engine.core.kv_events)."""

    def stored(self, block_hash: BlockHash, parent: BlockHash | None) -> None: ...

    def removed(self, block_hash: BlockHash) -> None: ...

    def cleared(self) -> None: ...


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    """One physical block. `block_hash` is set while the block is registered in the prefix cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Links of the free queue; both None when the block is not in it.
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:12] if self.block_hash is not None else None
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, block_hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, least recently freed first; O(1) popleft/append/remove.

    Hand-written (rather than a deque) because a prefix-cache hit must pull a block out
    of the middle of the queue in O(1).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        # Sentinels: the real blocks always lie strictly between head and tail.
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("free block queue is empty")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, head (next to evict) first. O(n): for tests and debugging."""
        out = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free
        return out


class BlockPool:
    """Owns all blocks: allocation, ref counting, and the prefix-cache hash map."""

    def __init__(self, num_blocks: int, enable_caching: bool, events: CacheEventSink | None = None) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks: must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        # Called with (block id, hash) when a cached block is taken for new use: its KV is intact until the step
        # being scheduled writes it, so an offload tier copies it out first (kv_transfer/offload/).
        self.on_evict: Callable[[int, BlockHash], None] | None = None
        self.events = events

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, cached or not (cached ones are evictable)."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref count > 0)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` blocks from the head of the free queue (evicting cached ones); each gets ref count 1."""
        if n < 0:
            raise ValueError(f"n: must be >= 0, got {n}")
        if n > self.num_free_blocks:
            raise ValueError(f"n: cannot allocate {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_block_queue.popleft()
            h = block.block_hash
            if h is not None and self.on_evict is not None and self.cached_block_hash_to_block.get(h) is block:
                self.on_evict(block.block_id, h)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        h = block.block_hash
        if h is None:
            return
        if self.cached_block_hash_to_block.get(h) is block:
            del self.cached_block_hash_to_block[h]
            if self.events is not None:
                self.events.removed(h)
        block.block_hash = None

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Drop the block's hash so no prefix lookup finds it (its contents are not to be trusted)."""
        self._evict(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks (prefix hits); a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; blocks reaching 0 join the free queue in the given order.

        The caller orders them so that the first to be freed is the first to be evicted.
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"ordered_blocks: block {block.block_id} is already free")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(
        self,
        request_blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register hashes for request_blocks[num_cached_blocks:num_full_blocks], which just became full.

        If another block already holds the same hash (two requests computed the same
        prefix without sharing), the existing entry is kept and this block stays unhashed.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        if num_cached_blocks < 0 or num_full_blocks > len(request_blocks) or num_full_blocks > len(block_hashes):
            raise ValueError(
                f"num_full_blocks: {num_full_blocks} exceeds request_blocks ({len(request_blocks)}) "
                f"or block_hashes ({len(block_hashes)}), or num_cached_blocks {num_cached_blocks} < 0"
            )
        table = self.cached_block_hash_to_block
        events = self.events
        for i in range(num_cached_blocks, num_full_blocks):
            block = request_blocks[i]
            if block.block_hash is not None:
                continue  # already registered (e.g. a prefix hit)
            h = block_hashes[i]
            if h not in table:
                table[h] = block
                block.block_hash = h
                if events is not None:
                    events.stored(h, block_hashes[i - 1] if i else None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.events is not None:
            self.events.cleared()
        return True
