"""Routing decisions kept for each request's trace (cluster/serve/route_log.py): the Serve request router
and the in-process coordinator log why a request went where it went; the log is bounded."""

from __future__ import annotations

import asyncio

from pagedserve.cluster.serve.route_log import MAX_PER_REQUEST, RouteLog, RouteRecord
from tests.test_serve_router import SHARED, make_router, pending


def test_serve_router_logs_each_generate_calls_decision():
    router, replicas = make_router(3)
    replicas[2].routing_stats["num_running"] = 5
    ranks = asyncio.run(router.choose_replicas(replicas, pending(SHARED)))
    (record,) = router.route_log.take("req")
    assert record.winner == ranks[0][0].replica_id.unique_id
    assert record.decision == "balanced" and record.deployment == "e"
    assert record.num_candidates == 3 and record.winner in record.candidates
    assert record.candidates["r2"] >= 5  # its load as the router saw it
    assert record.seconds >= 0 and record.start > 0
    assert router.route_log.take("req") == []  # taken once
    asyncio.run(router.choose_replicas(replicas, pending(SHARED, method="get_stats")))  # not a request: not logged
    assert router.route_log._records == {}


def test_coordinator_logs_its_choice(monkeypatch):
    from pagedserve.cluster.serve.coordinator import DPCoordinator

    coordinator = DPCoordinator([object(), object()], block_size=4)
    index = coordinator.choose_engine(SHARED, request_id="r-1")
    (record,) = coordinator.routing_records("r-1")
    assert record["winner"] == str(index) and record["deployment"] == "engine"
    assert set(record["candidates"]) == {"0", "1"} and record["decision"] == "balanced"
    assert coordinator.routing_records("r-1") == []


def test_log_is_bounded():
    log = RouteLog(max_records=3)
    for i in range(5):
        log.record(f"r{i}", RouteRecord("0", "single"))
    assert log.take("r0") == [] and len(log.take("r4")) == 1
    for _ in range(MAX_PER_REQUEST + 3):  # retries of one request: a few kept
        log.record("again", RouteRecord("0", "single"))
    assert len(log.take("again")) == MAX_PER_REQUEST
