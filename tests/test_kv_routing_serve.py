"""Exact routing live on Ray Serve (loopback): two engine replicas publish KV events with their routing
stats, the ingress replica's router indexes them and routes on them. With KV demand above one engine's
cache (ten tenants' shared prefixes, salted for half of them), after every request the router's index holds
exactly as many blocks per engine as the engine's prefix cache, and the engines find the cached tokens
the router predicted for at least 95% of the requests."""

from __future__ import annotations

import os
import random
import time

import httpx
import pytest

from pagedserve.cluster.settings import ServeArgs
from tests.test_serve_scaleout import metric, metric_samples

MODEL = "tiny"
BLOCK = 4
APP = "kvrouting"


@pytest.fixture(scope="module")
def http(tiny_model_factory):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray import serve

    from pagedserve.cluster.executor.ray_utils import free_port
    from pagedserve.cluster.serve.app import server_url, start_server

    model = tiny_model_factory("llama", max_position_embeddings=512)
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    args = ServeArgs(model=str(model), dtype="float32", num_kv_blocks=52, block_size=BLOCK, port=free_port(),
                     served_model_name=MODEL, api_key=None, max_num_seqs=4, data_parallel_size=2,
                     num_ingress_replicas=1, num_cpus_per_engine=0.5, routing_stats_period_s=0.2, app_name=APP)
    try:
        start_server(args)
        with httpx.Client(base_url=server_url(args), timeout=120.0) as client:
            yield client
    finally:
        serve.shutdown()
        ray.shutdown()


def wait_in_sync(http: httpx.Client, generated: float = 0.0, deadline_s: float = 90.0) -> str:
    """Until the engines' routing stats count `generated` tokens (so they were taken after the last
    request finished), both engines are idle with every block free, and the router's index holds, per
    engine and tier, as many blocks as the engine reported in those stats."""
    end = time.monotonic() + deadline_s
    while True:
        text = http.get("/metrics").text
        if metric(text, "pagedserve:generation_tokens_total") < generated:
            assert time.monotonic() < end, "the engines' routing stats never showed the last request"
            time.sleep(0.1)
            continue
        free = metric_samples(text, "pagedserve:engine_kv_cache_free_blocks")
        total = metric_samples(text, "pagedserve:engine_kv_cache_total_blocks")
        busy = metric(text, "pagedserve:engine_num_requests_running") + metric(
            text, "pagedserve:engine_num_requests_waiting")
        index = metric_samples(text, "pagedserve:engine_kv_index_blocks")
        cached = metric_samples(text, "pagedserve:engine_kv_cached_blocks")
        if len(total) == 2 and free == total and busy == 0 and index == cached:
            return text
        assert time.monotonic() < end, f"not in sync: index={index} engines={cached} free={free} busy={busy}"
        time.sleep(0.2)


def test_requests_land_where_their_prefix_is_and_the_engines_find_what_the_router_predicted(http):
    rng = random.Random(11)
    tenants = [([rng.randrange(20, 400) for _ in range(6 * BLOCK)], f"t{i}" if i % 2 else None) for i in range(10)]

    def complete(prefix: list[int], salt: str | None) -> None:
        body = {"model": MODEL, "prompt": prefix + [rng.randrange(20, 400) for _ in range(3)], "max_tokens": 3,
                "temperature": 0.0, "ignore_eos": True, **({"cache_salt": salt} if salt else {})}
        assert http.post("/v1/completions", json=body).status_code == 200

    # One request at a time, each routed on the index as of the engines' last report: two concurrent ones
    # may reach their engine in either order, and the first one's new blocks can evict the least recently
    # used prefix, the very one the second came back for (routers predict from the reports; see README).
    text = wait_in_sync(http)
    generated = metric(text, "pagedserve:generation_tokens_total")
    for _ in range(40):
        complete(*tenants[rng.randrange(10)])
        generated += 3
        text = wait_in_sync(http, generated)
    checks = metric_samples(text, "pagedserve:routing_cached_token_predictions_total")
    matched = sum(v for k, v in checks.items() if 'outcome="match"' in k)
    checked = sum(checks.values())
    assert checked == 40 and matched >= 0.95 * checked, checks
    decisions = metric_samples(text, "pagedserve:routing_decisions_total")
    assert sum(v for k, v in decisions.items() if "exact_hit" in k) >= 10, decisions
    assert metric(text, "pagedserve:routing_actual_cached_tokens_total") > 0
    assert metric(text, "pagedserve:kv_index_stale_engines") == 0
    assert metric(text, "pagedserve:kv_index_divergences_total") == 0
    held = metric_samples(text, "pagedserve:engine_kv_index_blocks")
    # (the tenants' prefixes do not fit one engine; a string message, which pytest prints whole)
    assert len(held) == 2 and sum(held.values()) > 52, f"held {held}, decisions {decisions}"
