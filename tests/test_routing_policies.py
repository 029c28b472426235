"""The routing-policy choice (ServeArgs.routing_policy): each policy's choice function over fake candidates,
the Serve router honouring it, and a bad value refused with the field named (fast: no Ray, no model)."""

from __future__ import annotations

from collections import Counter

import pytest

from pagedserve.cluster.serve.kv_feed import KVEventFeed
from pagedserve.cluster.serve.routing_policy import (
    AFFINE, BALANCED, EXACT_HIT, MISS, RANDOM, SINGLE, Holding, RoutingPolicy, prefix_hashes, short_hash,
)
from pagedserve.cluster.settings import ROUTING_POLICIES, check_routing_policy
from tests.test_kv_index import BS, FakeEngine, _replicas_from
from tests.test_serve_router import make_router

PREFIX = list(range(600, 600 + 8 * BS))


def test_random_draws_every_candidate_regardless_of_load():
    policy: RoutingPolicy[str] = RoutingPolicy(seed=3)
    loads = {"a": 0.0, "b": 50.0, "c": 100.0}
    picks = Counter(policy.choose_random(list(loads))[0] for _ in range(300))
    assert set(picks) == set(loads) and min(picks.values()) > 60  # each near 100 of 300
    assert policy.decisions[RANDOM] == 300
    assert policy.choose_random(["only"]) == ("only", SINGLE)
    with pytest.raises(ValueError, match="candidates"):
        policy.choose_random([])
    # Seeded: the same draws again.
    draws = [RoutingPolicy(seed=7), RoutingPolicy(seed=7)]
    first, second = ([p.choose_random(list(loads))[0] for _ in range(20)] for p in draws)
    assert first == second


def test_power_of_two_never_takes_the_most_loaded_and_spreads_over_the_rest():
    policy: RoutingPolicy[str] = RoutingPolicy(seed=0)
    loads = {"a": 0.0, "b": 5.0, "c": 10.0}
    picks = Counter(policy.choose_least_loaded_of_two(list(loads), loads.__getitem__)[0] for _ in range(300))
    assert "c" not in picks  # the most loaded loses to whichever other one it is drawn with
    assert picks["a"] > picks["b"] > 0  # a wins two of the three pairs, b one
    assert policy.decisions[BALANCED] == 300
    # Two candidates: always the less loaded.
    assert all(policy.choose_least_loaded_of_two(["x", "y"], {"x": 3.0, "y": 1.0}.__getitem__)[0] == "y"
               for _ in range(20))


def _router_with_a_holder(policy: str):
    """Two replicas; replica 0 holds PREFIX (by its KV events and by its served-prefix report) and is busier."""
    router, replicas = make_router(2, routing_policy=policy)
    engines = [FakeEngine(64) for _ in replicas]
    feeds = [KVEventFeed(e, f"i{n}", snapshot_every=1000) for n, e in enumerate(engines)]
    engines[0].serve(PREFIX + [1])
    _replicas_from(router, replicas, feeds)
    replicas[0].routing_stats.update(num_running=2, prefix_hashes=[short_hash(h) for h in prefix_hashes(PREFIX, BS, 8)])
    return router, replicas


def test_the_router_honours_each_policy():
    # exact (the default): the holder, within the imbalance bound (2 * 0 + 2 >= 2), from its KV events.
    router, replicas = _router_with_a_holder("exact")
    assert all(router.choose(replicas, PREFIX + [t]) is replicas[0] for t in range(10))
    assert router.policy.decisions[EXACT_HIT] == 10
    # prefix_approx: the holder too, but from the reported prefixes, ignoring the KV events.
    router, replicas = _router_with_a_holder("prefix_approx")
    assert all(router.choose(replicas, PREFIX + [t]) is replicas[0] for t in range(10))
    assert router.policy.decisions[AFFINE] == 10 and router.policy.decisions[EXACT_HIT] == 0
    assert not router.index.views  # no index kept
    # power_of_two: the less loaded, blind to what the busier replica holds.
    router, replicas = _router_with_a_holder("power_of_two")
    assert all(router.choose(replicas, PREFIX + [t]) is replicas[1] for t in range(10))
    assert router.policy.decisions[BALANCED] == 10
    # random: both, whatever they hold or carry.
    router, replicas = _router_with_a_holder("random")
    picks = Counter(router.choose(replicas, PREFIX + [t]).replica_id for t in range(100))
    assert len(picks) == 2 and router.policy.decisions[RANDOM] == 100


def test_the_circuit_breaker_narrows_the_candidates_under_a_blind_policy():
    router, replicas = make_router(3, routing_policy="random", failure_threshold=1)
    router.breaker.record(replicas[1].replica_id, False)
    assert router.breaker.is_open(replicas[1].replica_id)
    assert all(router.choose(replicas, PREFIX) is not replicas[1] for _ in range(50))


def test_a_bad_policy_is_an_error_naming_the_field():
    assert check_routing_policy("exact") == "exact" and "random" in ROUTING_POLICIES
    with pytest.raises(ValueError, match="routing_policy: unknown policy 'cache_aware'"):
        check_routing_policy("cache_aware")
    with pytest.raises(ValueError, match="routing_policy"):
        make_router(2, routing_policy="round_robin")


def test_serve_args_validate_and_carry_the_policy(tmp_path):
    from pydantic import ValidationError

    from pagedserve.cluster.cli import build_parser, serve_args_from
    from pagedserve.cluster.settings import ServeArgs

    (tmp_path / "config.json").write_text("{}")
    assert ServeArgs(model=str(tmp_path), api_key=None).routing_policy == "exact"
    assert ServeArgs(model=str(tmp_path), api_key=None, routing_policy="power_of_two").to_dict()[
        "routing_policy"] == "power_of_two"
    with pytest.raises(ValidationError, match="routing_policy"):
        ServeArgs(model=str(tmp_path), api_key=None, routing_policy="nope")
    ns = build_parser().parse_args(["serve", str(tmp_path), "--routing-policy", "random"])
    assert serve_args_from(ns).routing_policy == "random"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", str(tmp_path), "--routing-policy", "nope"])


def test_an_exact_miss_stays_where_the_prefix_went_last_within_the_bound():
    policy: RoutingPolicy[str] = RoutingPolicy(seed=0)
    loads = {"a": 0.0, "b": 0.0, "c": 1.0}
    nothing = lambda key: Holding()  # noqa: E731 - evicted everywhere
    for _ in range(20):
        assert policy.choose_by_holdings(list(loads), loads.__getitem__, nothing, last_sent="c")[:2] == ("c", MISS)
    loads["c"] = 5.0  # beyond 2 * 0 + 2: the two-choice winner instead
    assert all(policy.choose_by_holdings(list(loads), loads.__getitem__, nothing, last_sent="c")[0] != "c"
               for _ in range(20))
    # A holder still beats where the prefix went last.
    held = {"a": Holding(), "b": Holding(16, 0), "c": Holding()}
    loads["c"] = 0.0
    assert policy.choose_by_holdings(list(loads), loads.__getitem__, held.__getitem__, last_sent="c")[:2] == \
        ("b", EXACT_HIT)


def test_the_router_keeps_a_missed_tenant_where_it_sent_it():
    router, replicas = make_router(3)
    engines = [FakeEngine(64) for _ in replicas]
    feeds = [KVEventFeed(e, f"i{n}", snapshot_every=1000) for n, e in enumerate(engines)]
    _replicas_from(router, replicas, feeds)  # every view fresh, nothing held anywhere
    first = router.choose(replicas, PREFIX + [1], None, "m0")
    router.recent.forget(first.replica_id)  # as if its report came and said the prefix was evicted again
    for n in range(10):
        assert router.choose(replicas, PREFIX + [n + 2], None, f"m{n + 1}") is first
        router.recent.forget(first.replica_id)
    assert router.policy.decisions[MISS] == 11
