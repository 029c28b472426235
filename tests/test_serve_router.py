"""The Serve request router's choice over fake replicas: fast and deterministic (no Ray, no Serve app)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from pagedserve.cluster.serve.routing_policy import prefix_hashes
from pagedserve.cluster.serve.engine_calls import prompt_of
from pagedserve.cluster.serve.router import PrefixAffinityRouter
from pagedserve.cluster.serve.routing_policy import short_hash

BLOCK = 4


@dataclass
class FakeReplica:
    """What the router reads of a Serve `RunningReplica`."""

    replica_id: Any
    routing_stats: dict = field(default_factory=dict)
    max_ongoing_requests: int = 1000


def make_router(n: int, **kwargs):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

    deployment = DeploymentID(name="e", app_name="a")
    router = PrefixAffinityRouter(deployment_id=deployment, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(seed=0, **kwargs)
    replicas = [FakeReplica(ReplicaID(f"r{i}", deployment), {"block_size": BLOCK, "num_running": 0}) for i in range(n)]
    router._replicas_list = replicas
    return router, replicas


def pending(prompt: list[int] | None, method: str = "generate") -> Any:
    metadata = SimpleNamespace(call_method=method)
    return SimpleNamespace(metadata=metadata, args=["req", prompt, {}, 0] if prompt is not None else [], kwargs={})


def with_id(internal_id: str) -> Any:
    """A pending request as Serve's lifecycle hooks see it: its internal request id."""
    return SimpleNamespace(metadata=SimpleNamespace(internal_request_id=internal_id))


SHARED = list(range(100, 100 + 6 * BLOCK))


def test_shared_prefix_goes_where_it_went_before():
    router, replicas = make_router(4)
    first = router.choose(replicas, SHARED + [1])
    for tail in range(10):
        assert router.choose(replicas, SHARED + [tail, 2, 3]) is first
    assert router.policy.decisions["prefix_affine"] == 10


def test_replica_reported_prefix_wins_without_local_memory():
    router, replicas = make_router(3)
    replicas[2].routing_stats["prefix_hashes"] = [short_hash(h) for h in prefix_hashes(SHARED, BLOCK, 8)]
    assert all(router.choose(replicas, SHARED + [t]) is replicas[2] for t in range(5))


def test_overloaded_favourite_is_passed_over():
    router, replicas = make_router(2, imbalance_factor=2.0)
    replicas[0].routing_stats["prefix_hashes"] = [short_hash(h) for h in prefix_hashes(SHARED, BLOCK, 8)]
    replicas[0].routing_stats.update(num_running=10, num_waiting=5)  # load 15 > 2 * 0 + 2
    assert router.choose(replicas, SHARED + [9]) is replicas[1]
    assert router.policy.decisions["prefix_fallback"] == 1
    replicas[0].routing_stats.update(num_running=2, num_waiting=0)  # load 2 <= 2 * 0 + 2: affinity again
    assert router.choose(replicas, SHARED + [9]) is replicas[0]


def test_load_only_picks_less_loaded_and_counts_in_flight():
    router, replicas = make_router(2)
    replicas[0].routing_stats["num_waiting"] = 3
    assert all(router.choose(replicas, None) is replicas[1] for _ in range(5))
    for i in range(5):
        router.on_request_routed(with_id(f"r{i}"), replicas[1].replica_id, None)
    assert router.choose(replicas, None) is replicas[0]  # 5 in flight on r1 > 3 waiting on r0
    for i in range(5):
        router.on_request_completed(replicas[1].replica_id, f"r{i}")
    assert router.in_flight[replicas[1].replica_id] == 0


def test_in_flight_counts_hold_whatever_order_serve_reports_in():
    """Serve registers a request's completion callback before it awaits the replica's acceptance and calls
    `on_request_routed` after: a short call can complete first. A replica refusing a request completes it
    without routing it, and the request is then routed elsewhere. Two calls may share an internal id."""
    router, replicas = make_router(2)
    first, second = (r.replica_id for r in replicas)
    router.on_request_completed(first, "ready")  # an engine's ready() answered before it was counted routed
    router.on_request_routed(with_id("ready"), first, None)
    assert router.in_flight.get(first, 0) == 0
    assert {router.choose(replicas, None).replica_id for _ in range(40)} == {first, second}  # ties go either way

    router.on_request_completed(first, "refused")  # refused by the first replica ...
    router.on_request_routed(with_id("refused"), second, None)  # ... and accepted by the second
    assert (router.in_flight.get(first, 0), router.in_flight[second]) == (0, 1)
    router.on_request_completed(second, "refused")
    assert router.in_flight[second] == 0

    for _ in range(2):  # two calls of one HTTP request to one replica
        router.on_request_routed(with_id("shared"), first, None)
    assert router.in_flight[first] == 2
    for _ in range(2):
        router.on_request_completed(first, "shared")
    assert router.in_flight[first] == 0


def test_kv_usage_weighs_in():
    router, replicas = make_router(2, kv_weight=4.0)
    replicas[0].routing_stats["kv_cache_usage"] = 0.9  # 3.6 > 1 waiting
    replicas[1].routing_stats["num_waiting"] = 1
    assert router.choose(replicas, None) is replicas[1]


def test_unhealthy_replica_is_avoided():
    router, replicas = make_router(2)
    replicas[0].routing_stats["healthy"] = False
    replicas[1].routing_stats["num_waiting"] = 50
    assert all(router.choose(replicas, None) is replicas[1] for _ in range(5))


def test_choose_replicas_ranks_choice_then_rest_and_reads_generate_args():
    router, replicas = make_router(3)
    ranks = asyncio.run(router.choose_replicas(replicas, pending(SHARED)))
    assert len(ranks) == 2 and len(ranks[0]) == 1 and len(ranks[1]) == 2
    again = asyncio.run(router.choose_replicas(replicas, pending(SHARED + [5])))
    assert again[0][0] is ranks[0][0]
    assert prompt_of(pending(SHARED, method="get_stats")) is None
    assert prompt_of(pending(SHARED)) == SHARED
    assert asyncio.run(router.choose_replicas([], pending(SHARED))) == []


def test_departed_replica_is_forgotten():
    router, replicas = make_router(2)
    first = router.choose(replicas, SHARED)
    router.on_replica_actor_died(first.replica_id)
    rest = [r for r in replicas if r is not first]
    assert router.choose(rest, SHARED) is rest[0]
    assert first.replica_id not in router.policy._affinity.values()


def test_snapshot_labels_replicas_and_counts_decisions():
    router, replicas = make_router(2)
    replicas[0].routing_stats.update(num_total_blocks=10, prefix_hashes=["ab"])
    router.choose(replicas, SHARED)
    snap = router.snapshot()
    assert [r["replica"] for r in snap["replicas"]] == ["r0", "r1"]
    assert snap["replicas"][0]["num_prefixes"] == 1 and "prefix_hashes" not in snap["replicas"][0]
    assert sum(snap["decisions"].values()) == 1


def test_bad_knobs_name_the_field():
    with pytest.raises(ValueError, match="imbalance_factor"):
        make_router(2, imbalance_factor=0.5)
    with pytest.raises(ValueError, match="kv_weight"):
        make_router(2, kv_weight=-1)


def test_load_counts_requests_once():
    """In-flight requests and the engine's running/waiting are the same requests: the larger counts."""
    from pagedserve.cluster.serve.routing_policy import engine_load

    assert engine_load(3, {"num_running": 2, "num_waiting": 0}, 4.0) == 3
    assert engine_load(0, {"num_running": 1, "num_waiting": 2, "kv_cache_usage": 0.5}, 4.0) == 5
    router, replicas = make_router(2)
    replicas[0].routing_stats["prefix_hashes"] = [short_hash(h) for h in prefix_hashes(SHARED, BLOCK, 8)]
    router.on_request_routed(None, replicas[0].replica_id, None)
    replicas[0].routing_stats["num_running"] = 1  # that same request, as the engine reports it
    assert router.choose(replicas, SHARED + [1]) is replicas[0]  # 1 <= 2 * 0 + 2: still affine


# --------------------------------------------------------------------------- the circuit breaker


def _routed(router, replica, internal_id: str) -> None:
    """A request routed to `replica` that has ended (its outcome is reported after)."""
    router.on_request_routed(with_id(internal_id), replica.replica_id, None)
    router.on_request_completed(replica.replica_id, internal_id)


def test_a_replica_failing_requests_in_a_row_leaves_routing_until_it_recovers():
    clock = [0.0]
    router, replicas = make_router(2, failure_threshold=3, breaker_cooldown_s=10.0)
    router.breaker.clock = lambda: clock[0]
    bad = replicas[0]
    for i in range(2):  # a success in between starts the count again
        _routed(router, bad, f"f{i}")
        router.record_outcome(f"f{i}", ok=False)
    _routed(router, bad, "ok")
    router.record_outcome("ok", ok=True)
    for i in range(3):
        _routed(router, bad, f"g{i}")
        assert not router.breaker.is_open(bad.replica_id)
        router.record_outcome(f"g{i}", ok=False)
    assert router.breaker.is_open(bad.replica_id) and router.breaker.num_opens == 1
    assert all(router.choose(replicas, None) is replicas[1] for _ in range(20))
    snap = router.snapshot()
    assert snap["circuit_opens"] == 1 and [r["circuit_open"] for r in snap["replicas"]] == [True, False]
    # A fresh healthy report before the cooldown changes nothing; after it, the circuit closes.
    bad.routing_stats = {**bad.routing_stats}
    router.choose(replicas, None)
    assert router.breaker.is_open(bad.replica_id)
    clock[0] = 11.0
    router.choose(replicas, None)
    assert router.breaker.is_open(bad.replica_id), "no new report since the cooldown ended"
    bad.routing_stats = {**bad.routing_stats, "healthy": False}
    router.choose(replicas, None)
    assert router.breaker.is_open(bad.replica_id), "an unhealthy report does not close it"
    bad.routing_stats = {**bad.routing_stats, "healthy": True}
    router.choose(replicas, None)
    assert not router.breaker.is_open(bad.replica_id)
    assert any(router.choose(replicas, None) is bad for _ in range(20))
    # On probation: one more failure opens it again.
    _routed(router, bad, "h")
    router.record_outcome("h", ok=False)
    assert router.breaker.is_open(bad.replica_id) and router.breaker.num_opens == 2


def test_when_every_circuit_is_open_the_router_still_routes():
    router, replicas = make_router(2, failure_threshold=1)
    for i, replica in enumerate(replicas):
        _routed(router, replica, f"x{i}")
        router.record_outcome(f"x{i}", ok=False)
    assert router.breaker.num_open() == 2
    assert router.choose(replicas, None) in replicas
    router.record_outcome("never-routed", ok=False)  # unknown ids are ignored
    assert router.breaker.num_open() == 2 and router.breaker.num_opens == 2
    router.breaker.forget(replicas[0].replica_id)  # (a replica that left)
    assert router.breaker.num_open() == 1


def test_breaker_settings_are_checked():
    from pagedserve.cluster.serve.circuit_breaker import CircuitBreaker

    with pytest.raises(ValueError, match="failure_threshold"):
        CircuitBreaker(failure_threshold=0)
    with pytest.raises(ValueError, match="cooldown_s"):
        CircuitBreaker(cooldown_s=-1)


def test_a_producers_kv_calls_go_to_the_replica_they_name_or_fail_fast_elsewhere():
    """kv_read / kv_release / kv_rank_endpoints name their replica: the router sends them there, whatever the
    load; when that replica is gone they go to another, which refuses them (EngineHost._check_pinned)."""
    router, replicas = make_router(3)
    replicas[1].routing_stats["num_running"] = 50  # the busiest: the policy would never pick it
    for method in ("kv_read", "kv_release", "kv_rank_endpoints"):
        call = SimpleNamespace(metadata=SimpleNamespace(call_method=method), args=[], kwargs={"replica": "r1"})
        assert asyncio.run(router.choose_replicas(replicas, call)) == [[replicas[1]]]
    gone = SimpleNamespace(metadata=SimpleNamespace(call_method="kv_read"), args=[], kwargs={"replica": "r9"})
    ranks = asyncio.run(router.choose_replicas(replicas, gone))
    assert len(ranks) == 1 and len(ranks[0]) == 1 and ranks[0][0] is not replicas[1]
    # A generate call naming a replica keyword is routed by the policy as always.
    call = SimpleNamespace(metadata=SimpleNamespace(call_method="generate"), args=["q", SHARED, {}],
                           kwargs={"replica": "r1"})
    assert asyncio.run(router.choose_replicas(replicas, call))[0] != [replicas[1]]
