"""The engine deployment under Serve's lifecycle, live on loopback with a tiny model: autoscaling up under
a burst and back down after it, and a rolling update of an engine setting under load, with no request
failing in either. One Ray instance and one app for the module; after each test every KV block on
every engine replica is free.
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from pagedserve.cluster.settings import ServeArgs
from tests.test_serve_scaleout import MODEL, PROMPTS, TIMEOUT, complete, wait_all_blocks_free

APP = "elastic"
ENGINE = f"{APP}-engine"

pytestmark = pytest.mark.slow  # about two minutes on two CPU cores: `make test-slow`


def engine_args(model, port: int, **overrides) -> ServeArgs:
    values = dict(model=str(model), dtype="float32", kv_cache_memory="8MiB", block_size=4, port=port,
                  served_model_name=MODEL, api_key=None, max_num_seqs=16, app_name=APP, num_cpus_per_engine=0.5,
                  min_replicas=1, max_replicas=3, target_ongoing_requests=2, upscale_delay_s=0.5,
                  downscale_delay_s=3.0, routing_stats_period_s=0.2, graceful_shutdown_timeout_s=30)
    return ServeArgs(**{**values, **overrides})


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray import serve

    from pagedserve.cluster.executor.ray_utils import free_port
    from pagedserve.cluster.serve.app import server_url, start_server

    model = tiny_model_factory("llama", max_position_embeddings=2048)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    args = engine_args(model, free_port())
    try:
        start_server(args)
        yield args, server_url(args)
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[1], timeout=TIMEOUT) as client:
        yield client


def running_replicas() -> int:
    from ray import serve

    return serve.status().applications[APP].deployments[ENGINE].replica_states.get("RUNNING", 0)


class Load:
    """Clients sending requests back to back until stopped; every answer is recorded."""

    def __init__(self, http: httpx.Client, clients: int, max_tokens: int) -> None:
        self.http, self.max_tokens = http, max_tokens
        self.stop = threading.Event()
        self.results: list[tuple[int | None, str]] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]
        for thread in self.threads:
            thread.start()

    def _run(self, i: int) -> None:
        while not self.stop.is_set():
            try:
                response = complete(self.http, PROMPTS[i % len(PROMPTS)], max_tokens=self.max_tokens, ignore_eos=True)
                self.results.append((response.status_code, response.text[:300]))
            except httpx.HTTPError as exc:
                self.results.append((None, repr(exc)))

    def finish(self) -> list[tuple[int | None, str]]:
        self.stop.set()
        for thread in self.threads:
            thread.join(TIMEOUT)
        return self.results


def wait_for(predicate, deadline_s: float, what: str) -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_burst_scales_up_then_down_without_failures(http):
    assert running_replicas() == 1
    load = Load(http, clients=8, max_tokens=200)
    try:
        wait_for(lambda: running_replicas() >= 2, 180, "a scale-up")
    finally:
        results = load.finish()
    assert results and all(status == 200 for status, _ in results), [r for r in results if r[0] != 200][:3]
    wait_for(lambda: running_replicas() == 1, 180, "the scale-down")
    wait_all_blocks_free(http, replicas=1)
    assert complete(http, PROMPTS[0]).status_code == 200


def test_rolling_update_under_load_fails_nothing(server, http, tiny_model_factory):
    from ray import serve

    from pagedserve.cluster.serve.app import build_app

    args, _ = server
    load = Load(http, clients=3, max_tokens=40)
    try:
        time.sleep(1.0)
        changed = engine_args(tiny_model_factory("llama", max_position_embeddings=2048), args.port,
                              max_num_seqs=12, min_replicas=2, max_replicas=2)
        serve.run(build_app(changed.to_dict()), name=APP, route_prefix="/", blocking=False)
        wait_for(lambda: serve.status().applications[APP].status == "RUNNING" and running_replicas() == 2,
                 240, "the rolling update")
        time.sleep(1.0)
    finally:
        results = load.finish()
    assert len(results) > 3 and all(status == 200 for status, _ in results), [r for r in results if r[0] != 200][:3]
    engine = serve.get_deployment_handle(ENGINE, APP)
    assert all(engine.ready.remote().result()["max_num_seqs"] == 12 for _ in range(4))  # every replica is new
    wait_all_blocks_free(http, replicas=2)


def test_scale_down_finishes_the_requests_a_removed_replica_holds(server, http, tiny_model_factory):
    """Two engine replicas, both busy with long requests; the config drops to one: the replica being
    removed stops taking requests and finishes what it holds (graceful shutdown), nothing fails."""
    from ray import serve

    from pagedserve.cluster.serve.app import build_app

    args, _ = server
    model = tiny_model_factory("llama", max_position_embeddings=2048)
    assert running_replicas() == 2  # left so by the rolling update
    results: list = []

    def one(i: int) -> None:
        try:
            response = complete(http, PROMPTS[i % len(PROMPTS)], max_tokens=400, ignore_eos=True)
            results.append((response.status_code, response.text[:300]))
        except httpx.HTTPError as exc:
            results.append((None, repr(exc)))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(6)]
    for thread in threads:
        thread.start()
    time.sleep(1.5)
    smaller = engine_args(model, args.port, max_num_seqs=12, min_replicas=1, max_replicas=1)
    serve.run(build_app(smaller.to_dict()), name=APP, route_prefix="/", blocking=False)
    for thread in threads:
        thread.join(TIMEOUT)
    wait_for(lambda: running_replicas() == 1, 120, "the scale-down")
    assert len(results) == 6 and all(status == 200 for status, _ in results), results
    wait_all_blocks_free(http, replicas=1)
