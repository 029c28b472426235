"""`bench serve`'s overhead split (bench/overhead_split.py) from two scrapes of a real metrics registry."""

from __future__ import annotations

import pytest

from pagedserve.bench.overhead_split import overhead_delta, overhead_table, parse
from pagedserve.cluster.serving.metrics import ServingMetrics
from pagedserve.cluster.serving.overhead import OverheadMetrics
from pagedserve.cluster.serving.request_stages import RequestStages
from pagedserve.engine.outputs import RequestMetrics


def observe(overhead: OverheadMetrics, queue_s: float, prefill_s: float, ttft_s: float, decode_s: float,
            client_decode_s: float, tokens: int) -> None:
    leg = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.0 + queue_s,
                         first_token_time=100.0 + queue_s + prefill_s,
                         last_token_time=100.0 + queue_s + prefill_s + decode_s)
    overhead.observe(None, [leg], [{"deployment": "engine", "winner": "r1", "seconds": 0.001, "start": 99.0}],
                     ttft_s, client_decode_s, tokens)


def test_the_split_is_the_runs_means_from_two_scrapes():
    metrics = ServingMetrics("tiny", lambda: {})
    overhead = OverheadMetrics(metrics.registry, "tiny")
    observe(overhead, 0.5, 0.5, 2.0, 1.0, 1.0, 3)  # before the run: must not count
    before = parse(metrics.render()[0].decode())
    observe(overhead, 0.010, 0.020, 0.040, 0.040, 0.060, 5)
    observe(overhead, 0.030, 0.020, 0.060, 0.080, 0.100, 5)
    split = overhead_delta(before, parse(metrics.render()[0].decode()))
    assert split["stage_ms"]["queue"] == pytest.approx(20.0)
    assert split["stage_ms"]["prefill"] == pytest.approx(20.0)
    assert split["stage_ms"]["router"] == pytest.approx(1.0)
    # TTFT: model = queue + prefill (30 and 50 ms), framework = the rest of 40 and 60 ms.
    assert split["ttft_ms"]["model"] == pytest.approx(40.0)
    assert split["ttft_ms"]["framework"] == pytest.approx(10.0)
    assert split["ttft_ms"]["framework_share"] == pytest.approx(0.2)
    # TPOT over 4 gaps: model 10 and 20 ms, as the client saw it 15 and 25 ms.
    assert split["tpot_ms"]["model"] == pytest.approx(15.0)
    assert split["tpot_ms"]["framework"] == pytest.approx(5.0)
    table = overhead_table([{"name": "rate inf", "overhead": split}])
    assert "TTFT 50.00 ms = model 40.00 + framework 10.00 (20%)" in table


def test_no_histograms_no_split():
    empty = parse(ServingMetrics("tiny", lambda: {}).render()[0].decode())
    assert overhead_delta(empty, empty) is None
    assert overhead_delta(None, empty) is None
    assert overhead_table([{"name": "x"}]) == ""


def two_leg_request(overhead: OverheadMetrics) -> None:
    """A PD request: routed to prefill replica p0 (leg 1: queue 10 ms, prefill 30 ms, its first token at
    100.04), then to decode replica d1 (leg 2: queue 5 ms, prefill 5 ms, decode 40 ms over 4 more tokens)."""
    stages = RequestStages(marks={"received": 99.0, "dispatched": 99.98, "last_output": 100.2})
    prefill = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.01, first_token_time=100.04,
                             last_token_time=100.04, finished_time=100.04)
    decode = RequestMetrics(arrival_time=100.05, first_scheduled_time=100.055, first_token_time=100.06,
                            last_token_time=100.1, finished_time=100.1)
    routes = [{"deployment": "prefill", "winner": "p0", "start": 99.99, "seconds": 0.001},
              {"deployment": "decode", "winner": "d1", "start": 100.045, "seconds": 0.001}]
    overhead.observe(stages, [prefill, decode], routes, ttft_s=1.1, client_decode_s=0.05, num_tokens=5)


def test_each_engine_leg_is_labelled_with_its_own_deployment_and_replica():
    metrics = ServingMetrics("tiny", lambda: {})
    overhead = OverheadMetrics(metrics.registry, "tiny")
    two_leg_request(overhead)
    rows = [s for f in metrics.registry.collect() for s in f.samples if s.name.endswith("_count")]

    def where(name: str, **labels: str) -> set[tuple[str, str]]:
        return {(s.labels["deployment"], s.labels["replica"]) for s in rows
                if s.name == name and s.value and labels.items() <= s.labels.items()}

    stage = "pagedserve:request_stage_seconds_count"
    for name in ("queue", "prefill"):  # one observation per leg, on the replica that ran it
        assert where(stage, stage=name) == {("prefill", "p0"), ("decode", "d1")}, name
    assert where(stage, stage="decode") == {("prefill", "p0"), ("decode", "d1")}
    assert where(stage, stage="ingress") == where(stage, stage="dispatch") == {("prefill", "p0")}
    assert where(stage, stage="output") == {("decode", "d1")}
    # TTFT's model part is the prefill replica's work; TPOT's the decode replica's.
    assert where("pagedserve:time_to_first_token_split_seconds_count") == {("prefill", "p0")}
    assert where("pagedserve:time_per_output_token_split_seconds_count") == {("decode", "d1")}
    # TPOT's model part is the engines' time after the first token: the decode leg's queue and prefill (its
    # KV pull and continuation step, 10 ms) and its decode (40 ms), over 4 tokens; here all the client saw.
    sums = {s.labels["part"]: s.value for f in metrics.registry.collect() for s in f.samples
            if s.name == "pagedserve:time_per_output_token_split_seconds_sum"}
    assert sums["model"] == pytest.approx(0.0125) and sums["framework"] == pytest.approx(0.0)


def test_bench_split_is_per_request_when_a_request_has_two_legs():
    metrics = ServingMetrics("tiny", lambda: {})
    overhead = OverheadMetrics(metrics.registry, "tiny")
    before = parse(metrics.render()[0].decode())
    two_leg_request(overhead)
    split = overhead_delta(before, parse(metrics.render()[0].decode()))
    assert split["stage_ms"]["queue"] == pytest.approx(15.0)  # 10 + 5 ms, one request
    assert split["stage_ms"]["prefill"] == pytest.approx(35.0)
    assert split["stage_ms"]["ingress"] == pytest.approx(980.0)
    assert split["stage_ms"]["output"] == pytest.approx(100.0)
    table = overhead_table([{"name": "pd", "overhead": split}])
    assert "by stage: ingress 980.00, router 2.00, dispatch 20.00, queue 15.00, prefill 35.00, decode 40.00, " \
           "output 100.00" in table  # in the order of the request's path
