"""A replica that refused a request for load (its queue is full) is passed over for a moment: the retry
goes to another replica even where the refusing one looks idle or holds the request's prefix. Fast: the
request router over fake replicas (no Ray, no Serve app)."""

from __future__ import annotations

import pytest

from pagedserve.cluster.serve.circuit_breaker import CircuitBreaker
from tests.test_serve_router import SHARED, _routed, make_router


def test_the_refusing_replica_is_passed_over_until_the_holdoff_ends():
    clock = [0.0]
    router, replicas = make_router(2)
    router.breaker.clock = lambda: clock[0]
    router.breaker.refusal_holdoff_s = 1.0
    holder = router.choose(replicas, SHARED + [1])  # the prefix now goes there first
    other = next(r for r in replicas if r is not holder)
    assert all(router.choose(replicas, SHARED + [t]) is holder for t in range(5))
    _routed(router, holder, "refused")
    router.record_refusal("refused")
    assert not router.breaker.is_open(holder.replica_id), "a refusal is no failure"
    assert all(router.choose(replicas, SHARED + [t]) is other for t in range(10))
    clock[0] = 0.99
    assert router.choose(replicas, SHARED + [2]) is other
    clock[0] = 1.0  # routable again (the prefix meanwhile went to the other replica, and stays there)
    assert router.breaker.is_routable(holder.replica_id)
    assert any(router.choose(replicas, None) is holder for _ in range(20))
    router.record_refusal("never-routed")  # unknown ids are ignored
    assert router.breaker.is_routable(holder.replica_id)


def test_when_every_replica_refused_the_router_still_routes():
    router, replicas = make_router(2)
    for i, replica in enumerate(replicas):
        _routed(router, replica, f"r{i}")
        router.record_refusal(f"r{i}")
    assert not any(router.breaker.is_routable(r.replica_id) for r in replicas)
    assert router.choose(replicas, None) in replicas


def test_refusal_holdoff_is_validated_and_forgotten_with_the_replica():
    with pytest.raises(ValueError, match="refusal_holdoff_s"):
        CircuitBreaker(refusal_holdoff_s=-1)
    breaker: CircuitBreaker[str] = CircuitBreaker(clock=lambda: 0.0)
    breaker.refused("a")
    assert breaker.is_refusing("a") and not breaker.is_routable("a") and not breaker.is_open("a")
    breaker.forget("a")
    assert breaker.is_routable("a")
