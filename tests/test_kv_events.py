"""KV events (engine/core/kv_events.py): the holdings built from an engine's event batches equal its block
pool's prefix cache after any workload, sequence numbers have no gaps, and a consumer too far behind is
told to resync from a snapshot."""

from __future__ import annotations

import random

import pytest

from pagedserve.engine.core.block_pool import BlockHash, prompt_block_hashes
from pagedserve.engine.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.core.kv_events import (
    CLEARED, DEVICE, OFFLOAD, OFFLOADED, RELOADED, REMOVED, STORED, KVEvent, KVEventLog, apply_event,
)
from tests.test_kv_cache_manager import Req, ref_hashes, schedule_prefill

BS = 4


class Follower:
    """A consumer of one log: applies batches in order, checks that no sequence number is skipped."""

    def __init__(self, log: KVEventLog) -> None:
        self.log = log
        self.seq = 0
        self.holdings: dict[str, set[BlockHash]] = {}

    def catch_up(self) -> None:
        batches = self.log.since(self.seq)
        assert batches is not None, "the log dropped batches this follower had not read"
        for batch in batches:
            assert batch.seq == self.seq + 1
            for event in batch.events:
                apply_event(self.holdings, event)
            self.seq = batch.seq

    def device(self) -> set[BlockHash]:
        return self.holdings.get(DEVICE, set())


def _manager(num_blocks: int = 12) -> tuple[KVCacheManager, KVEventLog]:
    log = KVEventLog()
    m = KVCacheManager(num_blocks, BS, events=log)
    log.add_snapshot_source(DEVICE, lambda: m.block_pool.cached_block_hash_to_block.keys())
    return m, log


def _cached(m: KVCacheManager) -> set[BlockHash]:
    return set(m.block_pool.cached_block_hash_to_block)


def test_random_workloads_leave_the_index_equal_to_the_pool():
    """Prefills with shared prefixes and salts, chunked prefills, decodes, frees, evictions under
    pressure, invalidations and resets, in random order; after every step the follower agrees."""
    rng = random.Random(7)
    m, log = _manager(num_blocks=12)
    follower = Follower(log)
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    live: dict[str, Req] = {}
    for step in range(400):
        op = rng.random()
        if op < 0.35 and len(live) < 4:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            req = Req(f"r{step}", tokens, cache_salt=rng.choice([None, None, "t1"]))
            chunk = rng.choice([None, 3])
            new, _, hit = schedule_prefill(m, req, None if chunk is None else min(chunk, req.num_tokens))
            if new is not None:
                live[req.request_id] = req
            elif req.request_id in m.req_to_blocks:
                m.free(req)
        elif op < 0.7 and live:
            req = rng.choice(list(live.values()))
            if req.num_computed_tokens < req.num_tokens:  # the rest of a chunked prefill
                n = req.num_tokens - req.num_computed_tokens
            else:  # a decode step: one more token
                req.all_token_ids.append(rng.randrange(50))
                n = 1
            if m.allocate_slots(req, n) is None:
                m.free(live.pop(req.request_id))  # preempted: its blocks go back, hashes stay
            else:
                req.num_computed_tokens += n
        elif op < 0.9 and live:
            m.free(live.pop(rng.choice(list(live))))
        elif op < 0.95 and live:
            victim = rng.choice(list(live.values()))
            m.invalidate_blocks(m.get_block_ids(victim.request_id)[:1])
            m.free(live.pop(victim.request_id))
        elif not live:
            assert m.reset_prefix_cache()
        log.seal()
        follower.catch_up()
        assert follower.device() == _cached(m), f"step {step}"
    assert log.snapshot().tiers[DEVICE] == _cached(m)


def test_stored_chains_carry_their_parent_and_the_salt():
    m, log = _manager()
    tokens = list(range(13))
    req = Req("a", tokens, cache_salt="tenant")
    schedule_prefill(m, req)
    (batch,) = [log.seal()]
    (event,) = batch.events
    assert event.kind == STORED and event.parent_hash is None and event.tier == DEVICE
    assert list(event.block_hashes) == ref_hashes(tokens, "tenant") == prompt_block_hashes(tokens, BS, "tenant")
    assert set(event.block_hashes).isdisjoint(prompt_block_hashes(tokens, BS))  # salted != unsalted
    req.all_token_ids += [1, 2, 3]  # decode fills the fourth block
    m.allocate_slots(req, 3)
    (event,) = log.seal().events
    assert event.block_hashes == (ref_hashes(req.all_token_ids, "tenant")[3],)
    assert event.parent_hash == ref_hashes(tokens, "tenant")[2]
    assert log.seal() is None and log.seq == 2  # nothing new: no batch, no number


def test_eviction_removes_and_reset_clears():
    m, log = _manager(num_blocks=4)
    a = Req("a", list(range(9)))
    schedule_prefill(m, a)
    m.free(a)
    log.seal()
    b = Req("b", list(range(100, 116)))  # takes all four blocks: evicts a's two hashed blocks
    schedule_prefill(m, b)
    kinds = [e.kind for e in log.seal().events]
    assert kinds == [REMOVED, STORED]
    m.free(b)
    assert m.reset_prefix_cache()
    assert [e.kind for e in log.seal().events] == [CLEARED]
    assert log.snapshot().tiers[DEVICE] == frozenset()


def test_a_consumer_too_far_behind_is_told_to_resync():
    log = KVEventLog(max_retained_events=3)
    for i in range(5):
        log.stored(bytes([i]) * 32, None)
        log.seal()
    assert log.since(5) == []
    assert [b.seq for b in log.since(2)] == [3, 4, 5]
    assert log.since(1) is None  # batch 2 is gone: take a snapshot


def test_other_tiers_plug_in():
    """The offload tier's events and snapshot source: held in its own tier, reload leaves it held."""
    log = KVEventLog()
    h1, h2 = b"1" * 32, b"2" * 32
    log.add_snapshot_source(OFFLOAD, lambda: [h2])
    log.record(KVEvent(OFFLOADED, (h1, h2), tier=OFFLOAD))
    log.record(KVEvent(RELOADED, (h1,), tier=OFFLOAD))
    log.record(KVEvent(REMOVED, (h1,), tier=OFFLOAD))
    holdings: dict[str, set[BlockHash]] = {}
    for event in log.seal().events:
        apply_event(holdings, event)
    assert holdings == {OFFLOAD: {h2}}
    assert log.snapshot().tiers == {OFFLOAD: frozenset({h2})}
    with pytest.raises(ValueError, match="tier"):
        KVEvent(STORED, (h1,), tier="nvme")


def test_an_engine_under_pressure_reports_exactly_its_cache(tiny_llama):
    """A real engine: shared prefixes, salts, preemption and eviction in a small cache, then a reset."""
    from pagedserve.engine import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama), dtype="float32", num_kv_blocks=24, block_size=4, max_num_seqs=4)
    core = llm.llm_engine.engine_core
    follower = Follower(core.kv_events)
    rng = random.Random(3)
    shared = [rng.randrange(20, 400) for _ in range(12)]
    prompts = [{"prompt_token_ids": shared + [rng.randrange(20, 400) for _ in range(rng.randrange(3, 14))],
                **({"cache_salt": "t"} if i % 3 == 0 else {})} for i in range(10)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for round_ in range(2):
        llm.generate(prompts, params, use_tqdm=False)
        follower.catch_up()
        pool = core.kv_cache_manager.block_pool
        assert follower.device() == set(pool.cached_block_hash_to_block), f"round {round_}"
    assert core.scheduler.num_preemptions > 0  # the workload did preempt (24 blocks, 4 sequences)
    assert llm.reset_prefix_cache()
    follower.catch_up()
    assert follower.device() == set()
