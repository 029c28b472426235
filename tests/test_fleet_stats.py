"""The one restart-aware accumulator behind every engine client's cumulative figures, and the one
engine-client protocol that the HTTP layer depends on."""

from __future__ import annotations

from dataclasses import fields

import pytest

from pagedserve.cluster.engine_client import EngineClient
from pagedserve.cluster.engine_stats import COUNTER_KEYS, ENGINE_FIGURES, GAUGE_KEYS, EngineStats
from pagedserve.cluster.fleet_stats import EngineEntry, FleetAccumulator, FleetCounters, FleetStats, fleet_gauges

SPEC = {"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 3, "accepted_per_position": [2, 1, 0]}


def test_a_restarted_engine_counts_on_top_of_what_it_counted_before():
    fleet = FleetCounters(("tokens",))
    fleet.observe("e0", {"tokens": 5}, incarnation="a")
    fleet.observe("e0", {"tokens": 9}, incarnation="a")
    assert fleet.totals() == {"tokens": 9}
    fleet.observe("e0", {"tokens": 2}, incarnation="b")  # restarted: counts from zero again
    assert fleet.totals() == {"tokens": 11}
    fleet.observe("e0", {"tokens": 4}, incarnation="b")
    fleet.observe("e1", {"tokens": 1}, incarnation="x")
    assert fleet.totals() == {"tokens": 14}


def test_a_member_that_went_away_keeps_its_counts_until_the_bound():
    fleet = FleetCounters(("tokens",), max_members=2)
    fleet.observe("r1", {"tokens": 3})
    fleet.observe("r2", {"tokens": 4})
    fleet.observe("r2", {"tokens": 5})  # r1 no longer reports: what it counted stays
    assert fleet.totals() == {"tokens": 8}
    fleet.observe("r3", {"tokens": 1})  # past the bound: the least recently seen (r1) is forgotten
    assert fleet.totals() == {"tokens": 6}


def test_fixed_keys_read_missing_figures_as_zero_and_ignore_others():
    fleet = FleetCounters(COUNTER_KEYS)
    assert fleet.totals() == dict.fromkeys(COUNTER_KEYS, 0)
    fleet.observe(0, {"num_prompt_tokens": 7, "not_a_counter": 100})
    assert fleet.totals() == {**dict.fromkeys(COUNTER_KEYS, 0), "num_prompt_tokens": 7}


def test_gauges_are_never_carried_over_a_restart_and_an_empty_report_keeps_the_last():
    fleet = FleetCounters(gauges={"held"})
    fleet.observe("p0", {"loads": 3, "held": 2}, incarnation=1)
    fleet.observe("p0", {}, incarnation=1)  # nothing new: the last figures stand
    assert fleet.totals() == {"loads": 3, "held": 2}
    fleet.observe("p0", {"loads": 1, "held": 1}, incarnation=2)
    assert fleet.totals() == {"loads": 4, "held": 1}
    fleet.observe("p0", None, incarnation=3)  # restarted, not reported yet: no gauge, counters kept
    assert fleet.totals() == {"loads": 4}


def test_speculative_decoding_counters_sum_over_members_and_incarnations():
    fleet = FleetCounters(COUNTER_KEYS)
    assert fleet.spec() is None  # nobody speculates: no spec_decode_* on /metrics
    fleet.observe(0, {}, incarnation="a", spec=SPEC)
    fleet.observe(0, {}, incarnation="b", spec=SPEC)
    fleet.observe(1, {}, incarnation="a", spec=SPEC)
    spec = fleet.spec()
    assert spec["num_drafts"] == 6 and spec["num_accepted_tokens"] == 9
    assert spec["accepted_per_position"] == [6, 3, 0]


def test_fleet_gauges_sum_and_average_the_reports():
    reports = [EngineStats(num_running=2, num_total_blocks=10, kv_cache_usage=0.5),
               EngineStats(num_running=1, num_total_blocks=10, kv_cache_usage=0.1)]
    gauges = fleet_gauges(reports)
    assert gauges["num_running"] == 3 and gauges["num_total_blocks"] == 20 and gauges["num_waiting"] == 0
    assert gauges["kv_cache_usage"] == pytest.approx(0.3)
    assert fleet_gauges([])["kv_cache_usage"] == 0.0


def test_every_engine_client_shape_implements_the_protocol():
    from pagedserve.cluster.serve.client import ServeEngineClient
    from pagedserve.cluster.serve.coordinator import DPCoordinator
    from pagedserve.cluster.serve.pd_client import PDClient

    for shape in (ServeEngineClient, PDClient, DPCoordinator):
        assert issubclass(shape, EngineClient), shape

    class NotAClient:
        async def abort(self, request_id: str) -> None: ...

    assert not issubclass(NotAClient, EngineClient)  # the control


def test_engines_clients_and_metrics_read_the_one_list_of_figures():
    """The engine figures are named once (engine_stats.EngineFigures' fields); what engines report, the fleet
    sums and /metrics exports follow them."""
    from pagedserve.cluster.serving import metrics

    assert set(ENGINE_FIGURES) <= {f.name for f in fields(EngineStats)} & {f.name for f in fields(FleetStats)}
    assert set(ENGINE_FIGURES) <= set(EngineStats().to_dict())  # what Serve's routing stats carry
    assert {key for _, key, _ in metrics._GAUGES} == {*GAUGE_KEYS, "kv_cache_usage"}
    assert {key for _, key, _ in metrics._COUNTERS} == set(COUNTER_KEYS)
    assert set(COUNTER_KEYS).isdisjoint(GAUGE_KEYS) and len(ENGINE_FIGURES) == len(COUNTER_KEYS) + len(GAUGE_KEYS) + 1


def _engine(label: str, incarnation: str, **figures) -> EngineEntry:
    return EngineEntry(label, EngineStats(replica=label, incarnation=incarnation, **figures))


def test_the_accumulator_keeps_counters_across_a_restart_and_a_replica_that_left():
    fleet = FleetAccumulator()
    r1 = _engine("r1", "a", num_generation_tokens=100, num_running=2, num_total_blocks=10, kv_cache_usage=0.5)
    r2 = _engine("r2", "x", num_generation_tokens=40, num_running=1, num_total_blocks=10, kv_cache_usage=0.1)
    for engine in (r1, r2):
        fleet.observe(engine.label, engine.stats)
    snap = fleet.snapshot([r1, r2])
    assert (snap.num_generation_tokens, snap.num_running, snap.num_total_blocks) == (140, 3, 20)
    assert snap.kv_cache_usage == pytest.approx(0.3) and snap.num_engines == 2 and snap.spec_decoding is None

    r1 = _engine("r1", "b", num_generation_tokens=5, num_running=0, num_total_blocks=10)  # restarted: from zero
    fleet.observe("r1", r1.stats)
    snap = fleet.snapshot([r1])  # r2 left (scaled down): its counts stay, its gauges go
    assert snap.num_generation_tokens == 100 + 5 + 40
    assert (snap.num_running, snap.num_total_blocks, snap.num_engines) == (0, 10, 1)
    assert [e.label for e in snap.engines] == ["r1"]


def test_the_snapshot_counts_gauges_only_of_reachable_engines_that_reported():
    fleet = FleetAccumulator()
    up = _engine("0", "a", num_running=2, num_prompt_tokens=7)
    down = EngineEntry("1", EngineStats(num_running=9, num_prompt_tokens=3), available=False, in_flight=1)
    fresh = EngineEntry("2", num_routed=4)  # not polled yet
    for engine in (up, down):
        fleet.observe(engine.label, engine.stats)
    snap = fleet.snapshot([up, down, fresh], stats_age_s=0.5)
    assert snap.num_running == 2 and snap.num_prompt_tokens == 10  # the unreachable engine's counts stay
    assert (snap.num_engines, snap.num_healthy_engines, snap.num_in_flight) == (3, 2, 1)
    assert snap.num_requests_routed == [0, 0, 4] and snap.stats_age_s == 0.5


def test_pools_combine_into_one_fleet_labelled_by_pool():
    prefill = FleetAccumulator().snapshot([_engine("0", "a", num_running=1, kv_cache_usage=0.2)])
    decode_fleet = FleetAccumulator()
    stats = EngineStats(num_running=3, kv_cache_usage=0.6, num_generation_tokens=9, spec_decoding=SPEC)
    decode_fleet.observe("r9", stats)
    decode = decode_fleet.snapshot([EngineEntry("r9", stats), EngineEntry("r8", available=False)])
    fleet = FleetStats.over_pools({"prefill": prefill, "decode": decode}, pd={"pd_requests": 2})
    assert [e.label for e in fleet.engines] == ["prefill-0", "decode-r9", "decode-r8"]
    assert [e.pool for e in fleet.engines] == ["prefill", "decode", "decode"]
    assert (fleet.num_running, fleet.num_generation_tokens, fleet.num_engines, fleet.num_healthy_engines) == (4, 9, 3, 2)
    assert fleet.kv_cache_usage == pytest.approx(0.4)  # the reporting engines' mean, not the pools' means' mean
    assert fleet.pools == {"prefill": prefill, "decode": decode} and fleet.pd == {"pd_requests": 2}
    assert fleet.spec_decoding["num_drafts"] == SPEC["num_drafts"]


def test_kv_transfer_figures_are_kept_across_a_restart_and_absent_without_a_connector():
    fleet = FleetAccumulator()
    assert fleet.snapshot([_engine("0", "a")]).kv_transfer is None  # no KV connector: no kv_transfer_* on /metrics
    fleet.observe("0", EngineStats(incarnation="a", kv_transfer={"loads": 3, "held_requests": 2}))
    fleet.observe("0", EngineStats(incarnation="b", kv_transfer={"loads": 1, "held_requests": 0}))  # restarted
    assert fleet.snapshot([]).kv_transfer == {"loads": 4, "held_requests": 0}  # gauges are never carried over
