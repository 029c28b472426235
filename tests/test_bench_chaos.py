"""`pagedserve bench serve --chaos-kill-every`: its arguments, which replicas it may kill, its comparison."""

from __future__ import annotations

import argparse

import pytest

from pagedserve.bench.chaos import check_chaos_args, comparison, engine_replica_names


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
    def run(failed: int, stall: float) -> dict:
        return {"completed": 10 - failed, "failed": failed, "throughput": {"requests_per_s": 2.0},
                "latency_ms": {"ttft": {"p99": 50.0}, "tpot": {"p99": 5.0}, "itl": {"max": stall}}}

    out = comparison(run(0, 9.0), run(0, 900.0), num_kills=3)
    assert out["kills"] == 3
    assert out["without_kills"]["longest_stall"] == 9.0 and out["with_kills"]["longest_stall"] == 900.0
    assert out["with_kills"]["failed"] == 0 and out["with_kills"]["goodput_requests_per_s"] is None
