"""The one restart-aware accumulator behind every engine client's cumulative figures, and the one
engine-client protocol that the HTTP layer depends on."""

from __future__ import annotations

import pytest

from pagedserve.cluster.engine_client import EngineClient
from pagedserve.cluster.fleet_stats import COUNTER_KEYS, FleetCounters, fleet_gauges

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
    reports = [{"num_running": 2, "num_total_blocks": 10, "kv_cache_usage": 0.5},
               {"num_running": 1, "num_total_blocks": 10, "kv_cache_usage": 0.1}]
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
    """The engine figures are named once (fleet_stats); what engines report and /metrics exports follow it."""
    from pagedserve.cluster.fleet_stats import ENGINE_FIGURES, GAUGE_KEYS
    from pagedserve.cluster.serve.engine_host import ROUTING_STATS_KEYS
    from pagedserve.cluster.serving import metrics

    assert set(ENGINE_FIGURES) <= set(ROUTING_STATS_KEYS)
    assert {key for _, key, _ in metrics._GAUGES} == {*GAUGE_KEYS, "kv_cache_usage"}
    assert {key for _, key, _ in metrics._COUNTERS} == set(COUNTER_KEYS)

