"""The router's KV index (cluster/serve/kv_index.py) fed by engine replicas' reports (kv_feed.py), and
exact routing over it (router.PrefixAffinityRouter, routing_policy.choose_by_holdings): fast, no Ray,
no model (a real KV cache manager and event log stand in for each engine)."""

from __future__ import annotations

import asyncio
import random

from pagedserve.cluster.serve.kv_feed import KVEventFeed, key_of
from pagedserve.cluster.serve.kv_index import DIVERGED, GAP, RESTARTED, SILENT, ClusterKVIndex
from pagedserve.cluster.serve.routing_policy import (
    EXACT_HIT, MISS, OFFLOAD_HIT, STALE_FALLBACK, Holding, RoutingPolicy,
)
from pagedserve.engine.core.block_pool import prompt_block_hashes
from pagedserve.engine.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.core.kv_events import DEVICE, OFFLOAD, OFFLOADED, KVEvent, KVEventLog
from tests.test_kv_cache_manager import Req, schedule_prefill
from tests.test_serve_router import make_router

BS = 4


class FakeEngine:
    """What KVEventFeed reads of an AsyncLLM, over a real cache manager and event log."""

    def __init__(self, num_blocks: int = 16) -> None:
        self.log = KVEventLog(max_retained_events=64)
        self.kv = KVCacheManager(num_blocks, BS, events=self.log)
        self.log.add_snapshot_source(DEVICE, lambda: self.kv.block_pool.cached_block_hash_to_block.keys())
        self.n = 0

    def kv_events_since(self, seq):
        return self.log.since(seq)

    async def kv_snapshot(self):
        return self.log.snapshot()

    def kv_sizes(self):
        return self.log.sizes()

    def serve(self, tokens: list[int], salt: str | None = None) -> None:
        """One request's prefill, then its end (its blocks stay cached until evicted), as one step."""
        self.n += 1
        req = Req(f"q{self.n}", list(tokens), cache_salt=salt)
        if schedule_prefill(self.kv, req)[0] is not None:
            self.kv.free(req)
        self.log.seal()

    def keys(self) -> set[bytes]:
        return {key_of(h) for h in self.kv.block_pool.cached_block_hash_to_block}


def report(feed: KVEventFeed) -> dict:
    return asyncio.run(feed.report())


def test_the_index_follows_reports_and_resyncs_after_a_missed_one():
    rng = random.Random(1)
    engine = FakeEngine()
    feed = KVEventFeed(engine, "inc-1", window_reports=2, snapshot_every=1000)
    index = ClusterKVIndex()
    now = 0.0
    for i in range(30):
        engine.serve([rng.randrange(30) for _ in range(rng.randrange(4, 20))])
        rep = report(feed)
        now += 1
        if i in (10, 11, 12):  # this router misses three broadcasts: more than the window covers
            continue
        view = index.update("r", rep, now)
        if i == 13:
            assert view.stale == GAP and index.counters.gaps == 1
            break
        assert view.fresh and index.views["r"].tiers.get(DEVICE, set()) == engine.keys(), i
    # The next report whose window dropped batches the previous report's readers had not seen carries a
    # snapshot; the periodic one does too. Force the periodic one:
    feed.snapshot_every = 1
    engine.serve([1, 2, 3, 4, 5, 6, 7, 8, 9])
    view = index.update("r", report(feed), now + 1)
    assert view.fresh and index.counters.resyncs == 1
    assert view.tiers[DEVICE] == engine.keys()


def test_a_window_overflow_sends_a_snapshot_and_a_restart_is_followed():
    engine = FakeEngine()
    feed = KVEventFeed(engine, "inc-1", snapshot_every=1000)
    index = ClusterKVIndex()
    index.update("r", report(feed), 1.0)
    for i in range(40):  # more than the log retains (64 hashes) between two reports
        engine.serve(list(range(i, i + 12)))
    rep = report(feed)
    assert rep["snapshot"] is not None
    assert index.update("r", rep, 2.0).tiers[DEVICE] == engine.keys()
    # Restarted: a new engine, new incarnation, numbering from 1 again; its first report has it all.
    engine2 = FakeEngine()
    feed2 = KVEventFeed(engine2, "inc-2", snapshot_every=1000)
    engine2.serve(list(range(50, 70)))
    view = index.update("r", report(feed2), 3.0)
    assert view.fresh and view.tiers[DEVICE] == engine2.keys() and index.counters.restarts == 1
    # Restarted and already past its log before the first report this router sees: stale until a snapshot.
    engine3 = FakeEngine()
    feed3 = KVEventFeed(engine3, "inc-3", window_reports=1, snapshot_every=1000)
    for i in range(3):
        engine3.serve(list(range(i, i + 12)))
        report(feed3)
    engine3.serve(list(range(80, 92)))
    assert index.update("r", report(feed3), 4.0).stale == RESTARTED
    feed3.snapshot_every = 1
    assert index.update("r", report(feed3), 5.0).tiers[DEVICE] == engine3.keys()


def test_a_silent_replica_goes_stale_and_comes_back():
    engine = FakeEngine()
    feed = KVEventFeed(engine, "inc", snapshot_every=1000)
    index = ClusterKVIndex(silent_after_s=5.0)
    rep = report(feed)
    assert index.update("r", rep, 0.0).fresh
    assert index.update("r", rep, 4.0).fresh  # the same report, seen again: not silent yet
    assert index.update("r", rep, 6.0).stale == SILENT and index.num_stale() == 1
    engine.serve(list(range(10)))
    assert index.update("r", report(feed), 7.0).fresh
    assert index.views["r"].tiers[DEVICE] == engine.keys()


def test_a_view_that_drifted_from_its_engine_is_caught_and_resynced():
    engine = FakeEngine()
    feed = KVEventFeed(engine, "inc", snapshot_every=1000)
    index = ClusterKVIndex()
    engine.serve(list(range(12)))
    assert index.update("r", report(feed), 0.0).fresh
    index.views["r"].tiers[DEVICE].pop()  # an event this view lost (a bug, a corrupted report)
    engine.serve(list(range(20, 32)))
    view = index.update("r", report(feed), 1.0)
    assert view.stale == DIVERGED and index.counters.divergences == 1
    feed.snapshot_every = 1
    assert index.update("r", report(feed), 2.0).fresh and view.tiers[DEVICE] == engine.keys()


def test_offload_tier_holdings_extend_the_device_prefix():
    index = ClusterKVIndex()
    keys = [key_of(h) for h in prompt_block_hashes(list(range(40)), BS)]
    log = KVEventLog()
    engine = type("E", (), {"kv_events_since": lambda s, q: log.since(q), "kv_sizes": lambda s: log.sizes()})()
    feed = KVEventFeed(engine, "i", snapshot_every=1000)
    log.stored(prompt_block_hashes(list(range(40)), BS)[0], None)
    log.record(KVEvent(OFFLOADED, tuple(prompt_block_hashes(list(range(40)), BS)[1:5]), tier=OFFLOAD))
    log.seal()
    index.update("r", report(feed), 0.0)
    assert index.held_blocks("r", keys) == (1, 5)


def test_choose_by_holdings_kinds_and_the_load_bound():
    policy: RoutingPolicy[str] = RoutingPolicy(seed=0)
    loads = {"a": 0.0, "b": 0.0, "c": 0.0}
    held = {"a": Holding(), "b": Holding(16, 0), "c": Holding(8, 32)}
    pick = lambda: policy.choose_by_holdings(list(loads), loads.__getitem__, held.__getitem__)[:2]  # noqa: E731
    assert pick() == ("c", OFFLOAD_HIT)  # 8 + 0.5 * 32 = 24 > 16
    held["c"] = Holding(8, 8)
    assert pick() == ("b", EXACT_HIT)
    loads["b"] = 10.0  # beyond 2 * 0 + 2: passed over for the next best within the bound
    assert pick() == ("c", OFFLOAD_HIT)
    held["c"] = Holding(8, 0, stale=True)
    assert pick() == ("c", STALE_FALLBACK)
    held["c"] = Holding()
    choice, kind = pick()
    assert kind == MISS and choice in ("a", "c")
    # The holder is scored on its own holding even when the two-choice winner comes later in the list.
    loads.update(a=1.0, b=0.0, c=0.0)
    held.update(a=Holding(16, 0), b=Holding(), c=Holding())
    for _ in range(20):
        assert pick() == ("a", EXACT_HIT)


def _replicas_from(router, replicas, feeds):
    """A broadcast of every replica's stats (the router reads them when it next chooses)."""
    for replica, feed in zip(replicas, feeds):
        replica.routing_stats["kv_events"] = report(feed)
    router._sync_index(replicas)


def test_the_router_routes_to_the_holder_predicts_and_keeps_tenants_apart():
    router, replicas = make_router(3)
    engines = [FakeEngine(64) for _ in replicas]
    feeds = [KVEventFeed(e, f"i{n}", snapshot_every=1000) for n, e in enumerate(engines)]
    prefix = list(range(200, 232))  # eight blocks
    engines[1].serve(prefix + [1, 2], salt="tenant-a")
    _replicas_from(router, replicas, feeds)
    prompt = prefix + [7, 8, 9]
    assert router.choose(replicas, prompt, "tenant-a", "x1") is replicas[1]
    assert router.policy.decisions[EXACT_HIT] == 1 and router.predictions["x1"] == 32
    router.observe_cached("x1", 32)
    assert router.prediction_counters.matched == 1
    # Another tenant's request for the same tokens is no hit anywhere: a miss, wherever it lands.
    router.choose(replicas, prompt, "tenant-b", "x2")
    assert router.policy.decisions[MISS] == 1 and router.predictions["x2"] == 0
    # Unsalted, likewise.
    router.choose(replicas, prompt, None, "x3")
    assert router.policy.decisions[MISS] == 2


def test_a_stale_replica_is_routed_approximately_and_counted():
    router, replicas = make_router(2)
    engines = [FakeEngine(64) for _ in replicas]
    feeds = [KVEventFeed(e, f"i{n}", window_reports=1, snapshot_every=1000) for n, e in enumerate(engines)]
    _replicas_from(router, replicas, feeds)
    prefix = list(range(300, 332))
    engines[0].serve(prefix + [1])
    report(feeds[0])  # a report this router never sees ...
    engines[0].serve(list(range(500, 520)))
    _replicas_from(router, replicas, feeds)  # ... so the next one has a gap
    assert router.index.views[replicas[0].replica_id].stale == GAP
    assert router.snapshot()["kv_index"]["stale_engines"] == 1
    # Approximately: replica 0 reported serving the prefix (its recent-prefix list), so it still wins.
    from pagedserve.cluster.serve.routing_policy import short_hash
    from pagedserve.cluster.serve.routing_policy import prefix_hashes

    replicas[0].routing_stats["prefix_hashes"] = [short_hash(h) for h in prefix_hashes(prefix, BS, 8)]
    assert router.choose(replicas, prefix + [5], None, "s1") is replicas[0]
    assert router.policy.decisions[STALE_FALLBACK] == 1
    feeds[0].snapshot_every = 1
    _replicas_from(router, replicas, feeds)
    assert router.index.views[replicas[0].replica_id].fresh and router.index.counters.resyncs == 1
    assert router.choose(replicas, prefix + [6], None, "s2") is replicas[0]
    assert router.policy.decisions[EXACT_HIT] == 1


def test_metrics_show_decisions_staleness_predictions_and_views():
    from pagedserve.cluster.serving.metrics import ServingMetrics
    from tests.test_serve_scaleout import metric_samples

    from pagedserve.cluster.fleet_stats import EngineEntry, FleetStats

    stats = FleetStats(routing_decisions={EXACT_HIT: 7, STALE_FALLBACK: 1},
                       kv_routing={"stale_engines": 1, "resyncs": 2, "gaps": 1, "restarts": 0, "stale_spells": 1,
                                   "divergences": 0, "checked": 10, "matched": 9, "predicted_tokens": 80,
                                   "actual_tokens": 72},
                       engines=[EngineEntry("r0", kv_view={"stale": None, "seq": 3, "blocks": {DEVICE: 5},
                                                           "engine_blocks": {DEVICE: 5}})])
    text = ServingMetrics("m", lambda: stats, max_model_len=64).render()[0].decode()
    assert metric_samples(text, "pagedserve:routing_cached_token_predictions_total") == {
        '{model_name="m",outcome="match"}': 9.0, '{model_name="m",outcome="mismatch"}': 1.0}
    assert metric_samples(text, "pagedserve:kv_index_stale_engines") == {'{model_name="m"}': 1.0}
    assert metric_samples(text, "pagedserve:kv_index_resyncs_total") == {'{model_name="m"}': 2.0}
    assert metric_samples(text, "pagedserve:routing_actual_cached_tokens_total") == {'{model_name="m"}': 72.0}
    view = '{engine_index="r0",model_name="m",tier="device"}'
    assert metric_samples(text, "pagedserve:engine_kv_index_blocks") == {view: 5.0}
    assert metric_samples(text, "pagedserve:engine_kv_cached_blocks") == {view: 5.0}
    assert 'decision="stale_fallback"' in text
