"""The typed engine record (`EngineStats`), built from the scheduler's stats in one place and carried as a
dict only across Serve's routing stats; the fleet snapshot (`FleetStats`) each engine client builds from it;
and /metrics rendered from a snapshot by attribute."""

from __future__ import annotations

import dataclasses
import pickle

from prometheus_client.parser import text_string_to_metric_families

from pagedserve.cluster.engine_stats import ENGINE_FIGURES, EngineStats
from pagedserve.cluster.fleet_stats import EngineEntry, FleetAccumulator, FleetStats
from pagedserve.cluster.serve.client import ServeEngineClient
from pagedserve.cluster.serve.pd_client import PDClient
from pagedserve.cluster.serving.metrics import ServingMetrics
from pagedserve.engine.outputs import SchedulerStats

SPEC = {"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 3, "accepted_per_position": [2, 1, 0]}


def _scheduler() -> SchedulerStats:
    """Every figure a different value, so that a figure read from the wrong field shows."""
    stats = SchedulerStats(**{name: 10 + i for i, name in enumerate(ENGINE_FIGURES) if name != "kv_cache_usage"})
    stats.kv_cache_usage = 0.25
    stats.kv_transfer = {"loads": 2, "held_requests": 1}
    stats.spec_decoding = dict(SPEC)
    stats.lora = {"loads": 1, "resident": ["sql"]}
    return stats


def test_the_record_is_built_from_the_scheduler_stats():
    scheduler = _scheduler()
    stats = EngineStats.from_scheduler(scheduler, engine_index=3, replica="r1", incarnation="inc", stats_time=5.0,
                                       healthy=False, num_unfinished=4)
    assert {name: getattr(stats, name) for name in ENGINE_FIGURES} == {
        name: getattr(scheduler, name) for name in ENGINE_FIGURES}
    assert (stats.engine_index, stats.replica, stats.incarnation, stats.stats_time) == (3, "r1", "inc", 5.0)
    assert stats.healthy is False and stats.num_unfinished == 4
    assert stats.kv_transfer == scheduler.kv_transfer and stats.spec_decoding == SPEC
    assert stats.lora["resident"] == ["sql"]
    scheduler.kv_transfer["loads"] = 99  # the engine's live figures are not shared with the record
    scheduler.spec_decoding["accepted_per_position"][0] = 99
    assert stats.kv_transfer["loads"] == 2 and stats.spec_decoding["accepted_per_position"][0] == 2
    assert stats.figures("counter")["num_generation_tokens"] == scheduler.num_generation_tokens
    assert set(stats.figures("gauge")) == {"num_running", "num_waiting", "num_free_blocks", "num_total_blocks"}


def test_the_record_round_trips_through_pickle_and_the_routing_stats_dict():
    stats = EngineStats.from_scheduler(_scheduler(), replica="r1", incarnation="inc")
    assert pickle.loads(pickle.dumps(stats)) == stats  # Ray: an engine actor's get_stats
    routing = {**stats.to_dict(), "prefix_hashes": ["ab"], "block_size": 4, "kv_events": {"seq": 1}, "in_flight": 2}
    assert EngineStats.from_dict(routing) == stats  # what the router adds is left out
    assert EngineStats.from_dict({"num_running": 1}) == EngineStats(num_running=1)  # missing: defaults


def _replica(replica: str, stats: EngineStats, **router) -> dict:
    """A replica as the Serve router's snapshot lists it: its routing stats and the router's own figures."""
    return {**stats.to_dict(), "replica": replica, "num_prefixes": 0, "in_flight": 0, "num_routed": 0,
            "circuit_open": False, **router}


def _serve_client(monkeypatch, replicas: list[dict]) -> ServeEngineClient:
    client = ServeEngineClient(handle=type("H", (), {"options": lambda self, **kw: self})(), app_name="a",
                               deployment_name="d")
    monkeypatch.setattr(client, "routing_snapshot", lambda: {"replicas": replicas, "decisions": {"balanced": 3},
                                                             "circuit_opens": 1, "kv_routing": {"stale_engines": 0}})
    return client


def test_the_serve_client_keeps_counters_across_a_replica_restart_and_departure(monkeypatch):
    replicas = [_replica("r1", EngineStats(incarnation="a", num_prompt_tokens=30, num_running=2)),
                _replica("r2", EngineStats(incarnation="x", num_prompt_tokens=12, num_running=1), in_flight=1,
                         circuit_open=True),
                {"replica": "r3", "in_flight": 0, "num_routed": 0, "num_prefixes": 0}]  # not reported yet
    client = _serve_client(monkeypatch, replicas)
    first = client.aggregate_stats()
    assert isinstance(first, FleetStats)
    assert (first.num_prompt_tokens, first.num_running, first.num_engines, first.num_in_flight) == (42, 3, 3, 1)
    assert [e.label for e in first.engines] == ["r1", "r2", "r3"] and first.engines[2].stats is None
    assert first.routing_decisions == {"balanced": 3}
    assert first.fault_tolerance == {"circuit_opens": 1, "circuit_open_engines": 1}
    replicas[0] = _replica("r1", EngineStats(incarnation="b", num_prompt_tokens=4))  # r1 restarted
    del replicas[1]  # r2 scaled down
    after = client.aggregate_stats()
    assert after.num_prompt_tokens == 30 + 4 + 12 and after.num_running == 0 and after.num_engines == 2


class _Pool:
    """A pool as the PD client sees it: an engine client whose snapshot the test sets."""

    def __init__(self) -> None:
        self.fleet = FleetAccumulator()
        self.engines: list[EngineEntry] = []

    def report(self, label: str, stats: EngineStats) -> None:
        self.fleet.observe(label, stats)
        self.engines = [e for e in self.engines if e.label != label] + [EngineEntry(label, stats)]

    def aggregate_stats(self) -> FleetStats:
        return self.fleet.snapshot(list(self.engines))

    latest_stats = aggregate_stats


def test_the_pd_client_sums_both_pools_and_keeps_kv_transfer_counters_across_a_restart():
    prefill, decode = _Pool(), _Pool()
    client = PDClient(prefill, decode, release=lambda *args: None)
    prefill.report("0", EngineStats(incarnation="a", num_prompt_tokens=20, kv_transfer={"held_requests": 2}))
    decode.report("0", EngineStats(incarnation="a", num_generation_tokens=8, kv_transfer={"loads": 3}))
    client.counters.pd_requests = 3
    first = client.latest_stats()
    assert (first.num_prompt_tokens, first.num_generation_tokens) == (20, 8)
    assert first.kv_transfer == {"held_requests": 2, "loads": 3} and first.pd["pd_requests"] == 3
    assert set(first.pools) == {"prefill", "decode"} and first.pools["decode"].num_generation_tokens == 8
    decode.report("0", EngineStats(incarnation="b", num_generation_tokens=1, kv_transfer={"loads": 1}))  # restarted
    prefill.report("0", EngineStats(incarnation="a", num_prompt_tokens=20, kv_transfer={"held_requests": 0}))
    after = client.aggregate_stats()
    assert after.num_generation_tokens == 9 and after.kv_transfer == {"held_requests": 0, "loads": 4}
    assert [e.label for e in after.engines] == ["prefill-0", "decode-0"]


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_render_a_fleet_snapshot_by_attribute():
    fleet = FleetAccumulator()
    engines = [EngineEntry("0", EngineStats(num_running=2, num_waiting=1, kv_cache_usage=0.5, num_free_blocks=6,
                                            num_total_blocks=10, num_generation_tokens=40, prefix_cache_hits=8,
                                            lora={"loads": 2, "evictions": 1, "disk_loads": 2}),
                           num_routed=5),
               EngineEntry("1", EngineStats(num_running=1, kv_cache_usage=0.1, num_free_blocks=10, num_total_blocks=10,
                                            num_generation_tokens=2, healthy=False, spec_decoding=SPEC),
                           num_routed=1)]
    for engine in engines:
        fleet.observe(engine.label, engine.stats)
    snapshot = fleet.snapshot(engines, routing_decisions={"balanced": 6},
                              fault_tolerance={"migrations": 2, "circuit_open_engines": 1})
    text = ServingMetrics("m", lambda: snapshot).render()[0].decode()
    got = _samples(text)
    model = (("model_name", "m"),)

    def engine(index: str) -> tuple:
        return (("engine_index", index), ("model_name", "m"))

    assert got[("pagedserve:num_requests_running", model)] == 3
    assert got[("pagedserve:num_requests_waiting", model)] == 1
    assert abs(got[("pagedserve:kv_cache_usage_perc", model)] - 0.3) < 1e-9
    assert got[("pagedserve:kv_cache_free_blocks", model)] == 16
    assert got[("pagedserve:kv_cache_total_blocks", model)] == 20
    assert got[("pagedserve:generation_tokens_total", model)] == 42
    assert got[("pagedserve:prefix_cache_hits_total", model)] == 8
    assert got[("pagedserve:engine_healthy", engine("0"))] == 1 and got[("pagedserve:engine_healthy", engine("1"))] == 0
    assert got[("pagedserve:engine_num_requests_running", engine("1"))] == 1
    assert got[("pagedserve:engine_prefix_cache_hits", engine("0"))] == 8
    assert got[("pagedserve:engine_num_requests_routed", engine("0"))] == 5
    assert not any(name == "pagedserve:engine_prefixes_reported" for name, _ in got)  # no Serve router here
    assert (got[("pagedserve:num_engines", model)], got[("pagedserve:num_healthy_engines", model)]) == (2, 1)
    assert got[("pagedserve:routing_decisions_total", (("decision", "balanced"), ("model_name", "m")))] == 6
    assert got[("pagedserve:spec_decode_num_drafts_total", model)] == SPEC["num_drafts"]
    assert got[("pagedserve:request_migrations_total", model)] == 2
    assert got[("pagedserve:engines_circuit_open", model)] == 1
    assert got[("pagedserve:lora_adapter_loads_total", model)] == 2
    assert not any(name.startswith(("pagedserve:kv_transfer_", "pagedserve:pool_")) for name, _ in got)  # not PD


def test_metrics_of_a_failing_or_empty_snapshot_are_zeros():
    def broken() -> FleetStats:
        raise RuntimeError("engine gone")

    for stats_fn in (broken, lambda: None, FleetStats):
        got = _samples(ServingMetrics("m", stats_fn).render()[0].decode())
        assert got[("pagedserve:num_requests_running", (("model_name", "m"),))] == 0
        assert got[("pagedserve:num_engines", (("model_name", "m"),))] == 0


def test_a_wrapping_client_replaces_fields_without_touching_the_snapshot():
    snapshot = FleetStats(num_running=2, fault_tolerance={"circuit_opens": 1})
    changed = snapshot.replace(fault_tolerance={"circuit_opens": 1, "migrations": 3})
    assert changed.num_running == 2 and changed.fault_tolerance["migrations"] == 3
    assert snapshot.fault_tolerance == {"circuit_opens": 1} and dataclasses.is_dataclass(changed)
