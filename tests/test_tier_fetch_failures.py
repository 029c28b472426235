"""Failed fetches from another node's offload tier are counted by reason and reach /metrics
(`pagedserve:kv_offload_remote_fetch_failures_total{reason=...}`), monotonic across an engine's restart
(fast: a tier stand-in and peer calls that time out, refuse, are gone or break; no model, no Ray)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from pagedserve.cluster.engine_stats import EngineStats
from pagedserve.cluster.fleet_stats import EngineEntry, FleetAccumulator
from pagedserve.cluster.serve.tier_peer import (
    ERROR, FETCH_FAILURE_REASONS, PEER_GONE, REFUSED, TIMEOUT, TierFetcher, TierPeer, failure_reason,
)
from pagedserve.cluster.serving.metrics import ServingMetrics
from pagedserve.kv_transfer.offload.remote import TierReadAuthError
from tests.test_serve_scaleout import metric_samples

PEER = TierPeer("app", "engine", "r0")
HASHES = [bytes([i]) * 32 for i in range(4)]
METRIC = "pagedserve:kv_offload_remote_fetch_failures_total"


class TierStandIn:
    """What TierFetcher reads of an engine's offload scheduler: a tier holding none of the hashes."""

    capacity_blocks = 16
    block_bytes = 64
    location = SimpleNamespace(on_node=lambda h: False, namespace=SimpleNamespace(name="ns"))

    def adopt(self, hashes) -> None:
        raise AssertionError("a failed fetch adopts nothing")


def fetcher_raising(exc: BaseException | None) -> TierFetcher:
    async def call(peer, namespace, hashes, auth):
        if exc is None:
            await asyncio.sleep(30)  # a peer that never answers in time
        raise exc
    return TierFetcher(TierStandIn(), b"k" * 32, timeout_s=0.05, call=call)


def remote(cause: BaseException) -> BaseException:
    """`cause` as a Ray task raises it at the caller (an instance of its class too, where Ray can make one)."""
    return RayTaskError("kv_tier_read", "traceback", cause).as_instanceof_cause()


@pytest.mark.parametrize("exc, reason", [
    (None, TIMEOUT),
    (TierReadAuthError("kv_tier_read: not signed with this deployment's KV secret; refused"), REFUSED),
    (remote(TierReadAuthError("kv_tier_read: a replayed tier read")), REFUSED),
    (ConnectionError("producer replica 'r0' is gone (this is 'r2')"), PEER_GONE),
    (remote(ConnectionError("producer replica 'r0' is gone")), PEER_GONE),
    (ActorDiedError(), PEER_GONE),
    (ValueError("something else"), ERROR),
])
def test_a_failed_fetch_is_counted_by_its_reason(exc, reason):
    fetcher = fetcher_raising(exc)
    assert asyncio.run(fetcher.fetch(PEER, HASHES)) == 0  # never raises: the engine recomputes
    assert fetcher.stats.failures == fetcher.stats.fetches == 1
    assert fetcher.stats.failures_by_reason == {**dict.fromkeys(FETCH_FAILURE_REASONS, 0), reason: 1}
    if exc is not None:
        assert failure_reason(exc) == reason


def _engine(incarnation: str, failures: dict[str, int]) -> EngineStats:
    return EngineStats(num_total_blocks=8, num_free_blocks=8, incarnation=incarnation,
                       kv_tier_fetch_failures=failures)


def test_metrics_show_the_failures_by_reason_monotonic_across_a_restart():
    fleet = FleetAccumulator()
    zeros = dict.fromkeys(FETCH_FAILURE_REASONS, 0)
    fleet.observe("r0", _engine("first", {**zeros, REFUSED: 2, TIMEOUT: 1}))
    fleet.observe("r1", _engine("first", {**zeros, TIMEOUT: 1}))
    fleet.observe("r0", _engine("second", {**zeros, PEER_GONE: 1}))  # r0 restarted: counts from zero again
    stats = fleet.snapshot([EngineEntry("r0"), EngineEntry("r1")])
    text = ServingMetrics("m", lambda: stats, max_model_len=64).render()[0].decode()
    assert metric_samples(text, METRIC) == {
        f'{{model_name="m",reason="{reason}"}}': value
        for reason, value in {TIMEOUT: 2.0, REFUSED: 2.0, PEER_GONE: 1.0, ERROR: 0.0}.items()}


def test_no_tier_no_family():
    fleet = FleetAccumulator()
    fleet.observe("r0", _engine("first", {}))
    stats = fleet.snapshot([EngineEntry("r0")])
    assert stats.kv_tier_fetch_failures is None
    assert METRIC not in ServingMetrics("m", lambda: stats, max_model_len=64).render()[0].decode()
