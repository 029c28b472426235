"""The PD Serve app, live on loopback through Ray: a prefill engine and a decode engine (headless
engine actors owned by the pools deployment), the Ray KV transport between them, and the PD ingress.

Answers equal the monolithic engine's (an in-process `LocalServer` on the same model); faults kill
real engine actors (Ray restarts them). After every test every KV block on both engines is free and
nothing is held (read from /metrics). One Ray instance and one app for the module; faults run last.
"""

from __future__ import annotations

import concurrent.futures
import os
import secrets
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
        if len(total) == 2 and free == total and busy == 0 and held == 0:
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
    # The engines of one deployment share a KV secret: the Ray transport's reads are signed with it.
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PAGEDSERVE_KV_SECRET": secrets.token_hex(32)}})
    args = ServeArgs(model=model, dtype="float32", kv_cache_memory="8MiB", block_size=BLOCK, port=free_port(),
                     served_model_name=MODEL_NAME, api_key=None, max_num_seqs=16, num_prefill_engines=1,
                     num_decode_engines=1, num_cpus_per_engine=0.5, routing_stats_period_s=0.2, app_name=APP,
                     kv_connector="ray", kv_connector_extra_config={"read_timeout_s": 20})
    try:
        handle = start_server(args)
        engines = handle.get_engine_info.remote().result()
        yield server_url(args), {e["pool"]: (e["name"], e["namespace"]) for e in engines}
    finally:
        serve.shutdown()
        ray.shutdown()


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
    """Greedy, streaming, n with logprobs, stop strings and usage, through the Ray transport."""
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
        expected = post(mono, "/v1/completions", **body).json()
        response = post(http, "/v1/completions", **body)
        assert response.status_code == 200, response.text
        assert not same_answer(normalized(expected), normalized(response.json()))
    body = {"model": MODEL_NAME, "prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0, "logprobs": 1,
            "stream_options": {"include_usage": True}}
    assert not same_answer(sse_summary(mono, "/v1/completions", body), sse_summary(http, "/v1/completions", body))
    body = {"prompt": PROMPTS[3], "max_tokens": 6, "n": 2, "logprobs": 2, "temperature": 1.0, "seed": 11}
    assert not same_answer(normalized(post(mono, "/v1/completions", **body).json()),
                           normalized(post(http, "/v1/completions", **body).json()))
    text = post(mono, "/v1/completions", prompt=PROMPTS[1], max_tokens=12, temperature=0).json()["choices"][0]["text"]
    body = {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "stop": [text[5:7]]}
    expected = normalized(post(mono, "/v1/completions", **body).json())
    assert expected["choices"][0]["finish_reason"] == "stop"
    assert not same_answer(expected, normalized(post(http, "/v1/completions", **body).json()))
    text = wait_idle(http)
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


def _kill(name_ns: tuple[str, str]) -> None:
    import ray

    ray.kill(ray.get_actor(name_ns[0], namespace=name_ns[1]), no_restart=False)  # Ray restarts it


def _wait_running(http: httpx.Client, pool: str, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        samples = metric_samples(http.get("/metrics").text, "pagedserve:pool_num_requests_running")
        if samples.get(f'{{model_name="{MODEL_NAME}",pool="{pool}"}}', 0) > 0:
            return
        time.sleep(0.05)


def _wait_healthy(http: httpx.Client, deadline_s: float = 90.0) -> None:
    end = time.monotonic() + deadline_s
    while http.get("/health").status_code != 200:
        assert time.monotonic() < end, "the restarted engine did not come back"
        time.sleep(0.3)


def test_killed_prefill_engine_falls_back_to_the_decode_pool(server, http, mono):
    """Requests that reach the prefill pool while its engine is dead (Ray is restarting it) are computed
    on the decode engine: every answer is still the monolithic one. (A producer killed between its
    prefill and the consumer's read: test_pd_layouts.)"""
    prompts = [[(17 * i + 3 * k) % 470 + 20 for k in range(60)] for i in range(4)]
    bodies = [{"prompt": p, "max_tokens": 6, "temperature": 0} for p in prompts]
    before = metric_samples(http.get("/metrics").text, "pagedserve:pd_requests_total")
    _kill(server[1]["prefill"])
    responses = _concurrent(http, bodies)
    for body, response in zip(bodies, responses):
        assert response.status_code == 200, response.text
        expected = normalized(post(mono, "/v1/completions", **body).json())
        assert not same_answer(expected, normalized(response.json()))
    after = metric_samples(http.get("/metrics").text, "pagedserve:pd_requests_total")
    key = f'{{model_name="{MODEL_NAME}",path="prefill_fallbacks"}}'
    assert after[key] > before.get(key, 0)
    _wait_healthy(http)
    response = post(http, "/v1/completions", prompt=PROMPTS[2], max_tokens=8, temperature=0)
    assert response.status_code == 200  # the restarted prefill engine serves again


def test_killed_decode_engine_fails_its_requests_and_releases_holds(server, http):
    bodies = [{"prompt": p, "max_tokens": 300, "temperature": 0, "ignore_eos": True} for p in PROMPTS]
    responses = _concurrent(http, bodies, during=lambda: (_wait_running(http, "decode"), _kill(server[1]["decode"])))
    codes = sorted(r.status_code for r in responses)
    assert 503 in codes and set(codes) <= {200, 503}, [r.text[:200] for r in responses]
    for response in responses:
        if response.status_code == 503:
            assert response.json()["error"]["code"] == "engine_dead"
    _wait_healthy(http)
    response = post(http, "/v1/completions", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert response.status_code == 200
    # idle_after: the prefill engine holds nothing (the router released what the dead decode never read)
