"""`pagedserve bench serve --chaos-kill-every`: its arguments, which replicas it may kill, its comparison."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from pagedserve.bench.chaos import (
    ReplicaKiller, check_chaos_args, comparison, engine_replica_names, migration_costs,
)


def test_only_the_apps_engine_replicas_are_targets():
    actors = [{"name": "SERVE_REPLICA::app#app-engine#a1", "namespace": "serve"},
              {"name": "SERVE_REPLICA::app#app-ingress#i1", "namespace": "serve"},
              {"name": "SERVE_REPLICA::other#other-engine#b1", "namespace": "serve"},
              {"name": "SERVE_CONTROLLER_ACTOR", "namespace": "serve"}]
    assert engine_replica_names(actors, "app") == [("SERVE_REPLICA::app#app-engine#a1", "serve")]


def test_chaos_arguments_are_checked(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ns = argparse.Namespace(chaos_kill_every=None, start_server=False)
    check_chaos_args(ns)  # off
    with pytest.raises(ValueError, match="--chaos-kill-every: must be > 0"):
        check_chaos_args(argparse.Namespace(chaos_kill_every=0.0, start_server=True))
    with pytest.raises(ValueError, match="--chaos-kill-every: needs --start-server"):
        check_chaos_args(argparse.Namespace(chaos_kill_every=30.0, start_server=False))
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    check_chaos_args(argparse.Namespace(chaos_kill_every=30.0, start_server=False))


def test_the_comparison_puts_both_runs_side_by_side():
    def run(failed: int, stall: float, chaos: dict | None = None) -> dict:
        out = {"completed": 10 - failed, "failed": failed, "throughput": {"requests_per_s": 2.0},
               "latency_ms": {"ttft": {"p99": 50.0}, "tpot": {"p99": 5.0}, "itl": {"max": stall}}}
        return {**out, "chaos": chaos} if chaos else out

    seen = {"kills": 3, "kills_interrupting_streams": 2, "migration_cost_ms": {"count": 2, "median": 400.0,
                                                                                 "max": 700.0}}
    out = comparison(run(0, 9.0), run(0, 900.0, seen))
    assert out["kills"] == 3 and out["kills_interrupting_streams"] == 2
    assert out["migration_cost_ms"]["max"] == 700.0
    assert out["without_kills"]["longest_stall"] == 9.0 and out["with_kills"]["longest_stall"] == 900.0
    assert out["with_kills"]["failed"] == 0 and out["with_kills"]["goodput_requests_per_s"] is None


def test_migration_cost_is_the_slowest_interrupted_stream_from_kill_to_its_next_token():
    streams = [
        [1.0, 1.1, 1.2, 2.5, 2.6],  # migrated: nothing from 1.2 until 2.5
        [1.05, 1.15, 1.25, 1.35],  # on the survivor: its next token at 1.35
        [3.0, 3.1],  # started after the kill at 1.3 (and spans no kill)
        [],  # failed before a token
    ]
    costs = migration_costs([1.3, 2.8, 9.0], streams)
    assert costs == pytest.approx([2.5 - 1.3])  # 2.8 and 9.0 interrupted no stream


def test_the_killer_credits_each_kill_to_the_run_it_fell_in():
    killer = ReplicaKiller("app", every_s=1.0)
    killer.kills = [1.3]
    first: dict = {}
    killer.observe(SimpleNamespace(results=[SimpleNamespace(token_times=[1.0, 1.2, 2.0])]), first)
    assert first["chaos"]["kills"] == 1 and first["chaos"]["migration_cost_ms"]["max"] == pytest.approx(700.0)
    killer.kills.append(5.0)
    second: dict = {}
    killer.observe(SimpleNamespace(results=[SimpleNamespace(token_times=[4.0, 4.5])]), second)
    assert second["chaos"] == {"kills": 1, "kills_interrupting_streams": 0, "migration_cost_ms": None}
