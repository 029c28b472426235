"""The PD Serve app, live on loopback through Ray: a `-prefill` and a `-decode` deployment (one engine
replica each), the Ray KV transport between them (reads through a handle pinned to the producer
replica), and two PD ingress replicas.

Answers equal the monolithic engine's (an in-process `LocalServer` on the same model), streamed or not,
n == 1 (the decode continues from the prefill's token) and n > 1; faults kill real engine replicas
(Serve replaces them); a rolling update of the decode deployment under load fails no request. After
every test every KV block on both engines is free and nothing is held (read from /metrics). One Ray
instance and one app for the module; faults run last. The fault and rolling-update tests wait for Serve
to start new engine replicas, which takes minutes on two busy cores: they are `slow` (`make test-slow`).
"""

from __future__ import annotations

import concurrent.futures
import os
import secrets
import threading
import time

import httpx
import pytest

from pagedserve.cluster.settings import ServeArgs
from tests.local_serving import LocalServer
from tests.pd_local import MODEL_NAME, metric, metric_samples, normalized, same_answer, sse_summary

TIMEOUT = 120.0
BLOCK = 4
APP = "pdserve"
PROMPTS = [[(13 * i + 5 * k) % 470 + 20 for k in range(n)] for i, n in enumerate((5, 11, 23, 40))]


def wait_idle(http: httpx.Client, deadline_s: float = 90.0) -> str:
    """Poll /metrics until both engines report every block free, nothing running and nothing held."""
    end = time.monotonic() + deadline_s
    while True:
        text = http.get("/metrics").text
        free = metric_samples(text, "pagedserve:engine_kv_cache_free_blocks")
        total = metric_samples(text, "pagedserve:engine_kv_cache_total_blocks")
        busy = metric(text, "pagedserve:num_requests_running") + metric(text, "pagedserve:num_requests_waiting")
        held = metric(text, "pagedserve:kv_transfer_held_requests")
        if len(total) == 2 and free == total and busy == 0 and held == 0 and not replicas_starting():
            return text
        if time.monotonic() > end:
            raise AssertionError(f"not idle: free={free} total={total} busy={busy} held={held}")
        time.sleep(0.3)


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama", max_position_embeddings=2048))


@pytest.fixture(scope="module")
def server(model):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray import serve

    from pagedserve.cluster.executor.ray_utils import free_port
    from pagedserve.cluster.serve.app import server_url, start_server

    if ray.is_initialized():
        ray.shutdown()
    # The engines of one deployment share a KV secret: the Ray transport's reads are signed with it. The
    # operator's secret (in the driver too, where the app is built): a rebuilt app keeps it (rolling update).
    secret = secrets.token_hex(32)
    os.environ["PAGEDSERVE_KV_SECRET"] = secret
    # `pd_decode`: what the rolling-update test pins the decode deployment to (a change of its resources).
    ray.init(address="local", num_cpus=4, resources={"pd_decode": 4}, include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": {"PAGEDSERVE_KV_SECRET": secret}})
    args = pd_args(model, free_port())
    try:
        handle = start_server(args)
        engines = handle.get_engine_info.remote().result()
        assert {e["pool"] for e in engines} == {"prefill", "decode"}
        yield server_url(args), args
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.pop("PAGEDSERVE_KV_SECRET", None)


def pd_args(model: str, port: int, **overrides) -> ServeArgs:
    values = dict(model=model, dtype="float32", kv_cache_memory="8MiB", block_size=BLOCK, port=port,
                  served_model_name=MODEL_NAME, api_key=None, max_num_seqs=16, num_prefill_engines=1,
                  num_decode_engines=1, num_cpus_per_engine=0.5, routing_stats_period_s=0.2, app_name=APP,
                  num_ingress_replicas=2, graceful_shutdown_timeout_s=30, kv_connector="ray",
                  kv_connector_extra_config={"read_timeout_s": 20})
    return ServeArgs(**{**values, **overrides})


def replicas(pool: str) -> list[str]:
    """The actor names of a pool's live replicas (Serve's naming: SERVE_REPLICA::app#deployment#id)."""
    import ray

    prefix = f"SERVE_REPLICA::{APP}#{APP}-{pool}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))


def replicas_starting() -> bool:
    """Whether a deployment of the app is still replacing or updating replicas."""
    from ray import serve

    deployments = serve.status().applications[APP].deployments
    return any(set(d.replica_states) - {"RUNNING"} or d.status != "HEALTHY" for d in deployments.values())


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[0], timeout=TIMEOUT) as client:
        yield client


@pytest.fixture(scope="module")
def mono(model):
    server = LocalServer(model, {"kv_cache_memory": "8MiB"})
    try:
        with server.test_client() as client:
            yield client
    finally:
        server.close()


@pytest.fixture(autouse=True)
def idle_after(request):
    yield
    if "http" in request.fixturenames:
        wait_idle(request.getfixturevalue("http"))


def post(client, path: str, **body) -> httpx.Response:
    return client.post(path, json={"model": MODEL_NAME, **body})


def test_answers_equal_the_monolithic_engine(http, mono):
    """Greedy (n == 1: the decode continues from the prefill's token), streaming, n > 1 with logprobs, stop
    strings and usage, through the Ray transport and both ingress replicas."""
    served_by = set()
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
        expected = post(mono, "/v1/completions", **body).json()
        for _ in range(4):
            response = post(http, "/v1/completions", **body)
            assert response.status_code == 200, response.text
            assert not same_answer(normalized(expected), normalized(response.json()))
            served_by.add(response.headers["x-pagedserve-ingress"])
    assert len(served_by) == 2  # 16 requests, each to either ingress replica
    body = {"model": MODEL_NAME, "prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0, "logprobs": 1,
            "stream_options": {"include_usage": True}}
    assert not same_answer(sse_summary(mono, "/v1/completions", body), sse_summary(http, "/v1/completions", body))
    body = {**body, "n": 2, "prompt": PROMPTS[3]}  # n > 1 streamed: the decode engine makes both
    assert not same_answer(sse_summary(mono, "/v1/completions", body), sse_summary(http, "/v1/completions", body))
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6,
            "temperature": 0}
    assert not same_answer(sse_summary(mono, "/v1/chat/completions", chat),
                           sse_summary(http, "/v1/chat/completions", chat))
    body = {"prompt": PROMPTS[3], "max_tokens": 6, "n": 2, "logprobs": 2, "temperature": 1.0, "seed": 11}
    assert not same_answer(normalized(post(mono, "/v1/completions", **body).json()),
                           normalized(post(http, "/v1/completions", **body).json()))
    text = post(mono, "/v1/completions", prompt=PROMPTS[1], max_tokens=12, temperature=0).json()["choices"][0]["text"]
    body = {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "stop": [text[5:7]]}
    expected = normalized(post(mono, "/v1/completions", **body).json())
    assert expected["choices"][0]["finish_reason"] == "stop"
    assert not same_answer(expected, normalized(post(http, "/v1/completions", **body).json()))
    text = wait_idle(http)
    pd = metric_samples(text, "pagedserve:pd_requests_total")
    assert pd[f'{{model_name="{MODEL_NAME}",path="continuations"}}'] > 0
    assert metric(text, "pagedserve:kv_transfer_bytes_total") > 0
    assert metric(text, "pagedserve:kv_transfer_failures_total") == 0
    assert set(metric_samples(text, "pagedserve:pool_num_requests_running")) == {
        f'{{model_name="{MODEL_NAME}",pool="prefill"}}', f'{{model_name="{MODEL_NAME}",pool="decode"}}'}


def _concurrent(http: httpx.Client, bodies: list[dict], during=None) -> list[httpx.Response]:
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(post, http, "/v1/completions", **body) for body in bodies]
        if during is not None:
            during()
        return [f.result() for f in futures]


def _kill_replica(pool: str) -> str:
    """Kill the pool's (one) replica for good: Serve notices and starts a new one."""
    import ray

    name = replicas(pool)[0]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    return name


def _wait_running(http: httpx.Client, pool: str, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        samples = metric_samples(http.get("/metrics").text, "pagedserve:pool_num_requests_running")
        if samples.get(f'{{model_name="{MODEL_NAME}",pool="{pool}"}}', 0) > 0:
            return
        time.sleep(0.05)


def _wait_replaced(pool: str, gone: str, deadline_s: float = 300.0) -> None:
    end = time.monotonic() + deadline_s
    while True:
        live = replicas(pool)
        if live and gone not in live and not replicas_starting():
            return
        assert time.monotonic() < end, f"Serve did not replace the {pool} replica"
        time.sleep(0.3)


@pytest.mark.slow
def test_killed_prefill_replica_under_load_recomputes_on_decode(server, http, mono):
    """A prefill replica killed while requests run on it: those requests are computed on the decode engine
    (the prefill leg's EngineDeadError, or a read from the dead producer, falls back); requests that
    arrive before Serve's replacement is up wait for it. Every answer is still the monolithic one."""
    prompts = [[(17 * i + 3 * k) % 470 + 20 for k in range(600)] for i in range(16)]  # prefill work queues up
    bodies = [{"prompt": p, "max_tokens": 6, "temperature": 0} for p in prompts]
    before = wait_idle(http)
    killed: list[str] = []
    responses = _concurrent(http, bodies, during=lambda: (_wait_running(http, "prefill"),
                                                          killed.append(_kill_replica("prefill"))))
    for body, response in zip(bodies, responses):
        assert response.status_code == 200, response.text
        expected = normalized(post(mono, "/v1/completions", **body).json())
        assert not same_answer(expected, normalized(response.json()))
    _wait_replaced("prefill", killed[0])
    after = wait_idle(http)
    fallbacks = f'{{model_name="{MODEL_NAME}",path="prefill_fallbacks"}}'
    recomputed = (metric_samples(after, "pagedserve:pd_requests_total")[fallbacks]
                  - metric_samples(before, "pagedserve:pd_requests_total").get(fallbacks, 0)
                  + metric(after, "pagedserve:kv_transfer_fallbacks_total")
                  - metric(before, "pagedserve:kv_transfer_fallbacks_total"))
    assert recomputed > 0
    response = post(http, "/v1/completions", prompt=PROMPTS[2], max_tokens=8, temperature=0)
    assert response.status_code == 200  # the new prefill replica serves


@pytest.mark.slow
def test_killed_decode_replica_migrates_its_requests_and_releases_holds(server, http):
    """A decode replica killed mid-generation: its requests migrate (the ingress's MigratingClient resubmits
    each as a continuation; with one decode replica they wait for Serve's replacement) or, once their
    migrations are used up, fail cleanly with 503 engine_dead; every finished one has all its tokens."""
    bodies = [{"prompt": p, "max_tokens": 300, "temperature": 0, "ignore_eos": True} for p in PROMPTS]
    before = wait_idle(http)
    killed: list[str] = []
    responses = _concurrent(http, bodies, during=lambda: (_wait_running(http, "decode"),
                                                          killed.append(_kill_replica("decode"))))
    codes = sorted(r.status_code for r in responses)
    assert set(codes) <= {200, 503}, [r.text[:200] for r in responses]
    for response in responses:
        if response.status_code == 503:
            assert response.json()["error"]["code"] == "engine_dead"
        else:
            assert response.json()["usage"]["completion_tokens"] == 300
    _wait_replaced("decode", killed[0])
    after = wait_idle(http)
    tried = (metric(after, "pagedserve:request_migrations_total") - metric(before, "pagedserve:request_migrations_total")
             + metric(after, "pagedserve:request_migration_failures_total")
             - metric(before, "pagedserve:request_migration_failures_total"))
    assert tried > 0  # the kill reached requests in flight
    response = post(http, "/v1/completions", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert response.status_code == 200
    # idle_after: the prefill engine holds nothing (the client released what the dead decode never read)


@pytest.mark.slow
def test_rolling_update_of_the_decode_deployment_fails_no_request(server, http, mono):
    """Redeploy the app with the decode pool pinned to another resource: Serve replaces the decode
    replica (the old one drains its requests; a redeploy through `serve.run` gives every deployment a
    new version, so the other deployments roll too); requests sent all along succeed."""
    from ray import serve

    from pagedserve.cluster.serve.app import build_app

    url, args = server
    old_decode = replicas("decode")
    expected = normalized(post(mono, "/v1/completions", prompt=PROMPTS[1], max_tokens=12, temperature=0).json())
    stop = threading.Event()
    results: list[httpx.Response | Exception] = []

    def load() -> None:
        # Requests sent while no decode replica runs wait for the new one (it may take minutes to load here).
        with httpx.Client(base_url=url, timeout=600.0) as client:
            while not stop.is_set():
                try:
                    results.append(post(client, "/v1/completions", prompt=PROMPTS[1], max_tokens=12, temperature=0))
                except httpx.HTTPError as exc:
                    results.append(exc)

    threads = [threading.Thread(target=load, daemon=True) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        updated = args.model_copy(update={"decode_resources": {"pd_decode": 1.0}})
        serve.run(build_app(updated.to_dict()), name=APP, route_prefix="/", blocking=False)
        end = time.monotonic() + 300
        while replicas("decode") == old_decode or replicas_starting():
            assert time.monotonic() < end, "the decode deployment was not updated"
            time.sleep(0.5)
        time.sleep(1.0)  # a few requests on the new replica
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=600.0)
    failed = [r if isinstance(r, Exception) else r.text[:200] for r in results
              if isinstance(r, Exception) or r.status_code != 200]
    assert results and not failed, failed
    for response in results:
        assert not same_answer(expected, normalized(response.json()))
