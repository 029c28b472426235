"""`bench serve`'s overhead split (bench/overhead_split.py) from two scrapes of a real metrics registry."""

from __future__ import annotations

import pytest

from pagedserve.bench.overhead_split import overhead_delta, overhead_table, parse
from pagedserve.cluster.serving.metrics import ServingMetrics
from pagedserve.cluster.serving.overhead import OverheadMetrics
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
