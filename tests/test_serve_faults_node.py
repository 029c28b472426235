"""A worker node lost under load (slow: a two-raylet cluster on this machine, `tests/multinode_cluster.py`):
a 2-CPU head (Serve's controller and proxy, the ingress pinned there by its custom resource) and a 2-CPU
worker node `w`; two engine replicas of 1.5 CPUs each, so that no node holds both: one runs on `w`.
While both engines stream requests (streamed and not, greedy and seeded), `w`'s raylet and every process
on it are killed, as a machine failure would: every request finishes on the head's engine with exactly
the output of an uninterrupted run, none fails, and the migrations are on /metrics.
"""

from __future__ import annotations

import time

import httpx
import pytest

pytest.importorskip("ray")

from pagedserve.cluster.executor.ray_utils import free_port  # noqa: E402
from pagedserve.cluster.settings import ServeArgs  # noqa: E402
from tests.multinode_cluster import LocalCluster, node_resource  # noqa: E402
from tests.serve_apps import (  # noqa: E402
    DEFAULTS, assert_same, deploy_config, run, run_in_background, wait_app_running,
)
from tests.test_serve_scaleout import metric, metric_samples  # noqa: E402

pytestmark = pytest.mark.slow  # a second raylet, its engine replica and the kill: minutes on two cores

APP = "nodeloss"
TIMEOUT = 240.0
PROMPTS = [[(19 * i + 3 * k) % 400 + 10 for k in range(8 + i)] for i in range(6)]


def wait_both_engines_busy(http: httpx.Client, deadline_s: float = 120.0) -> None:
    end = time.monotonic() + deadline_s
    while True:
        running = metric_samples(http.get("/metrics").text, "pagedserve:engine_num_requests_running")
        if len(running) == 2 and all(value > 0 for value in running.values()):
            return
        assert time.monotonic() < end, f"the load did not reach both engines: {running}"
        time.sleep(0.2)


def test_a_worker_node_lost_under_load_fails_no_request(tiny_model_factory):
    model = str(tiny_model_factory("llama", max_position_embeddings=2048))
    with LocalCluster(head_cpus=2, workers={"w": 2}) as cluster:
        from ray import serve

        args = ServeArgs(model=model, port=free_port(), **{**DEFAULTS, "app_name": APP, "data_parallel_size": 2,
                                                           "num_cpus_per_engine": 1.5, "max_migrations": 3,
                                                           "graceful_shutdown_timeout_s": 5})
        serve.start(proxy_location="HeadOnly", http_options={"host": args.host, "port": args.port})
        deploy_config(args, deployments=[{"name": f"{APP}-ingress", "ray_actor_options": {
            "num_cpus": 0, "resources": {node_resource("head"): 0.01}}}], proxy_location="HeadOnly")
        wait_app_running(APP)
        assert cluster.node_id("w") in cluster.replica_nodes(APP, f"{APP}-engine")

        long = {"max_tokens": 900, "ignore_eos": True}
        bodies = [{"prompt": PROMPTS[i], "temperature": 0.0 if i % 2 == 0 else 0.8, "seed": i,
                   "stream": i < 4, **long} for i in range(len(PROMPTS))]
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=TIMEOUT) as http:
            want = [run(http, body) for body in bodies]
            before = metric(http.get("/metrics").text, "pagedserve:request_migrations_total")
            threads, results = run_in_background(http, bodies, TIMEOUT)
            wait_both_engines_busy(http)
            cluster.kill_worker("w")
            for thread in threads:
                thread.join(TIMEOUT)
            for index in range(len(bodies)):
                assert_same(results.get(index, {"status": None, "errors": ["unfinished"]}), want[index],
                            f"request {index}")
            migrations = metric(http.get("/metrics").text, "pagedserve:request_migrations_total") - before
            assert migrations >= 1, "the lost node's engine held none of the requests"
            # The survivor serves on (the lost replica waits for capacity elsewhere).
            assert_same(run(http, bodies[0]), want[0], "after the loss")
