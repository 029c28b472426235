"""`pagedserve bench serve --workload shared-prefix --compare-routing`: the workload generator, the engine
cache sizing, the /metrics counters it reads and the comparison's plumbing (fake servers: no Ray, no timing)."""

from __future__ import annotations

import argparse
from collections import Counter

import pytest

from pagedserve.bench import routing_compare as rc
from pagedserve.bench.workload import SharedPrefixShape, shared_prefix

TOKENS = list(range(3, 1000))


def _parser() -> argparse.ArgumentParser:
    from pagedserve.bench import serve_load

    parser = argparse.ArgumentParser()
    serve_load.add_parser(parser.add_subparsers(dest="bench_command"))
    return parser


def test_the_served_engine_takes_the_offline_benchmarks_threads_and_quantization(tiny_llama):
    """`bench serve --start-server` must be able to run the engine `bench throughput` ran (same threads, same
    weights): a replica otherwise gets one torch thread per reserved CPU (1 by default) while the offline
    engine used every core, and the served/offline ratio measured the thread count, not the serving path."""
    from pagedserve.bench.serve_load import server_settings
    from pagedserve.cluster.settings import ServeArgs

    ns = _parser().parse_args(["serve", "--start-server", "--cpu-threads", "2", "--num-cpus-per-engine", "2",
                               "--quantization", "none"])
    settings = server_settings(ns)
    assert (settings["cpu_threads"], settings["num_cpus_per_engine"], settings["quantization"]) == (2, 2.0, "none")
    args = ServeArgs(model=str(tiny_llama), **settings)
    assert (args.cpu_threads, args.quantization) == (2, "none")
    unset = server_settings(_parser().parse_args(["serve", "--start-server"]))
    assert "cpu_threads" not in unset and "quantization" not in unset  # the server's own defaults
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--quantization", "fp4"])


def test_shared_prefix_requests_are_tenant_contexts_plus_questions_round_by_round():
    shape = SharedPrefixShape(tenants=5, context_len=40, questions=3, question_len=6, output_len=(4, 8))
    requests = shared_prefix(shape, seed=1, token_ids=TOKENS)
    assert len(requests) == shape.num_requests == 15
    contexts = [tuple(r.prompt_token_ids[:40]) for r in requests]
    assert len(set(contexts)) == 5  # one context per tenant, distinct
    assert all(len(r.prompt_token_ids) == 46 and 4 <= r.output_len <= 8 for r in requests)
    for round_ in range(3):  # each round visits every tenant once, so a context comes back after all others
        assert set(contexts[5 * round_:5 * round_ + 5]) == set(contexts)
    assert Counter(contexts) == dict.fromkeys(set(contexts), 3)
    # Questions differ; the order within rounds is shuffled (not the same every round); seeded.
    assert len({tuple(r.prompt_token_ids[40:]) for r in requests}) == 15
    assert [contexts[i] for i in range(5)] != [contexts[i] for i in range(5, 10)] or \
        [contexts[i] for i in range(5, 10)] != [contexts[i] for i in range(10, 15)]
    assert shared_prefix(shape, 1, TOKENS) == requests and shared_prefix(shape, 2, TOKENS) != requests


def test_the_engine_cache_is_sized_from_the_demand_ratio():
    shape = SharedPrefixShape(tenants=16, context_len=512, questions=4, question_len=16, output_len=(16, 16))
    assert shape.context_blocks(16) == 16 * 32
    assert shape.cache_blocks(16, 2.0, concurrency=4) == 256  # the contexts need 2x one engine's cache
    assert shape.cache_blocks(16, 3.0, concurrency=1) == 171
    with pytest.raises(ValueError, match="--kv-demand-ratio: a cache of 52 blocks"):
        shape.cache_blocks(16, 10.0, concurrency=2)  # 52 blocks cannot hold two requests of 34 blocks
    with pytest.raises(ValueError, match="--kv-demand-ratio: must be > 0"):
        shape.cache_blocks(16, 0.0, 1)
    with pytest.raises(ValueError, match="--tenants: must be >= 1"):
        SharedPrefixShape(0, 512, 4, 16, (16, 16))
    with pytest.raises(ValueError, match="--output-len"):
        SharedPrefixShape(1, 512, 4, 16, (16, 8))


def test_the_serve_command_takes_the_workload_and_comparison_flags():
    from pagedserve.bench.serve_load import check_load_args, make_workload, server_settings

    ns = _parser().parse_args(["serve", "--start-server", "--workload", "shared-prefix", "--tenants", "8",
                               "--context-len", "256", "--questions", "2", "--question-len", "8", "--output-len",
                               "4", "--kv-demand-ratio", "2", "--max-concurrency", "2", "--block-size", "16",
                               "--compare-routing", "all"])
    check_load_args(ns)
    assert [arm.label for arm in ns.compare_routing] == list(rc.POLICY_RUNS)
    assert server_settings(ns)["num_kv_blocks"] == 64  # 8 x 16 context blocks / 2
    assert len(make_workload(ns, TOKENS)) == 16
    with pytest.raises(ValueError, match="--compare-routing: needs --start-server"):
        check_load_args(_parser().parse_args(["serve", "--compare-routing", "exact"]))
    with pytest.raises(ValueError, match="--compare-routing: runs one --request-rate"):
        check_load_args(_parser().parse_args(["serve", "--start-server", "--compare-routing", "exact",
                                              "--request-rate", "1,2"]))
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--compare-routing", "exact,round_robin"])


def test_policy_arms_and_their_settings():
    arms = rc.parse_policies("exact, random,exact")
    assert [a.label for a in arms] == ["exact", "random"]
    with pytest.raises(argparse.ArgumentTypeError, match="expected all or"):
        rc.parse_policies("fastest")
    base = {"num_kv_blocks": 64, "data_parallel_size": 2, "kv_offload_size": "1GiB", "routing_policy": "random"}
    assert rc.arm_settings(base, rc.POLICY_RUNS["prefix_approx"], "256MiB") == {
        "num_kv_blocks": 64, "data_parallel_size": 2, "routing_policy": "prefix_approx"}
    assert rc.arm_settings(base, rc.POLICY_RUNS["exact+offload"], "256MiB")["kv_offload_size"] == "256MiB"
    # Every arm's router policy is one the server accepts.
    from pagedserve.cluster.settings import ROUTING_POLICIES

    assert {arm.routing_policy for arm in rc.POLICY_RUNS.values()} == set(ROUTING_POLICIES)


def _metrics(queries: float, hits: float, tier: float, decisions: dict[str, float],
             checked: int = 0, matched: int = 0) -> str:
    """The /metrics text of the server (its own renderer) with these counters."""
    from pagedserve.cluster.fleet_stats import FleetStats
    from pagedserve.cluster.serving.metrics import ServingMetrics

    stats = FleetStats(prefix_cache_queries=queries, prefix_cache_hits=hits, kv_offload_hit_tokens=tier,
                       routing_decisions=decisions, kv_routing={"checked": checked, "matched": matched})
    return ServingMetrics("m", lambda: stats, max_model_len=64).render()[0].decode()


def test_cache_counters_and_the_runs_delta_come_from_the_servers_metrics():
    before = rc.cache_counters(_metrics(100, 20, 0, {"exact_hit": 1}, checked=1, matched=1))
    after = rc.cache_counters(_metrics(1100, 520, 300, {"exact_hit": 9, "miss": 3}, checked=12, matched=10))
    assert before["queries"] == 100 and after["tier_hits"] == 300 and after["decision:miss"] == 3
    delta = rc.cache_delta(before, after)
    assert delta["queried_tokens"] == 1000 and delta["device_hit_tokens"] == 500 and delta["tier_hit_tokens"] == 300
    assert delta["prefix_hit_rate"] == pytest.approx(0.8) and delta["device_hit_rate"] == pytest.approx(0.5)
    assert delta["routing_decisions"] == {"exact_hit": 8, "miss": 3}
    assert delta["predictions"] == {"match": 9, "mismatch": 2}
    assert rc.cache_delta(before, before)["prefix_hit_rate"] == 0.0


def _entry(p50: float, p90: float, tok_s: float, hit: float) -> dict:
    return {"completed": 4, "num_requests": 4, "failed": 0, "throughput": {"output_tokens_per_s": tok_s},
            "latency_ms": {"ttft": {"p50": p50, "p90": p90}},
            "cache": {"prefix_hit_rate": hit, "device_hit_rate": hit, "tier_hit_tokens": 0, "routing_decisions": {}}}


class FakeServer:
    def __init__(self, settings: dict, log: list) -> None:
        self.url, self.settings, self.log = "http://127.0.0.1:1", settings, log

    def stop(self, everything: bool = True) -> None:
        self.log.append(("stop", self.settings["routing_policy"], everything))


def test_compare_runs_each_arm_on_its_own_app_and_always_deletes_it():
    log: list = []
    figures = {"random": (100, 400, 10, 0.1), "power_of_two": (90, 380, 11, 0.1), "prefix_approx": (50, 300, 14, 0.4),
               "exact": (20, 60, 20, 0.5), "exact+offload": (15, 40, 31, 0.9)}

    def start(settings: dict) -> FakeServer:
        log.append(("start", settings["routing_policy"], settings.get("kv_offload_size")))
        return FakeServer(settings, log)

    def measure(server: FakeServer, arm: rc.PolicyRun) -> dict:
        assert server.settings["num_kv_blocks"] == 64  # the same engines for every arm
        return _entry(*figures[arm.label])

    entries = rc.compare(rc.parse_policies("all"), {"num_kv_blocks": 64}, "128MiB", start, measure, log=lambda _: None)
    assert [e["policy"] for e in entries] == list(rc.POLICY_RUNS) and entries[-1]["offload"]
    assert log[0] == ("start", "random", None) and log[-2] == ("start", "exact", "128MiB")
    assert [x for x in log if x[0] == "stop"] == [("stop", a.routing_policy, False) for a in rc.POLICY_RUNS.values()]
    aims = rc.summary(entries)["aims"]
    assert aims["p90_ttft_prefix_approx_over_exact"] == {"ratio": 5.0, "target": 3.0, "met": True}
    assert aims["hit_rate_tier_over_exact"]["ratio"] == pytest.approx(1.8) and not aims["hit_rate_tier_over_exact"]["met"]
    assert aims["throughput_tier_over_exact"]["met"]
    text = rc.table(entries)
    assert "exact+offload" in text and "TTFT p90 ms" in text and "predicted exactly" in text
    assert any("not met" in line for line in rc.aims_lines(aims))

    # A run that fails still deletes its app; the error propagates.
    log.clear()

    def failing(server: FakeServer, arm: rc.PolicyRun) -> dict:
        raise RuntimeError("load failed")

    with pytest.raises(RuntimeError):
        rc.compare(rc.parse_policies("exact"), {}, "1GiB", start, failing, log=lambda _: None)
    assert log == [("start", "exact", None), ("stop", "exact", False)]
    # Aims whose arms did not run are left out.
    assert rc.summary([{**_entry(1, 2, 3, 0.5), "policy": "exact"}])["aims"] == {}


def test_contexts_come_from_the_models_vocabulary_when_its_folder_is_at_hand(tiny_llama, tmp_path):
    from pagedserve.bench.serve_load import make_workload, vocabulary_ids

    ids = vocabulary_ids(str(tiny_llama))
    assert ids and len(ids) > 100 and min(ids) >= 0
    ns = _parser().parse_args(["serve", "--workload", "shared-prefix", "--tenants", "4", "--context-len", "32",
                               "--questions", "2", "--output-len", "4"])
    # The server's sample-text tokens may be one id (a word-level tokenizer's unknown): the vocabulary wins.
    requests = make_workload(ns, [2], str(tiny_llama))
    assert len({tuple(r.prompt_token_ids[:32]) for r in requests}) == 4
    assert all(t in set(ids) for r in requests for t in r.prompt_token_ids)
    assert vocabulary_ids(str(tmp_path)) is None  # no model folder: the server's tokens are used
    assert {t for r in make_workload(ns, [2, 5], None) for t in r.prompt_token_ids} <= {2, 5}
