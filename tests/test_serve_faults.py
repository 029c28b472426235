"""Overload, flapping and drain through the Serve app, live on loopback: two engine replicas behind one
ingress, faults put into the real engines (`engine_faults`, run in the replica's process).

- One replica's queue is full: it refuses with EngineOverloadedError; the ingress retries the request,
  the router passes the refusing replica over, and every request succeeds on the other, with the
  output of an unloaded run; the retries are on /metrics.
- One replica fails every request: after `failure_threshold` failures in a row its circuit opens (on
  /metrics), no request reaches it; once its faults are gone and its cooldown has passed, a healthy
  report closes the circuit and it serves again.
- Scale-down (the Serve config deployed again with the engine's `num_replicas` from 2 to 1): the removed
  replica gets no new request; what it holds finishes within the graceful window or (the long ones)
  migrates to the survivor: no request fails, each gets its reference output. Serve picks the replica
  to remove, so both hold long requests first (each sent once the one before runs: the router sends a
  fresh prompt to the less loaded replica; checked on /metrics), and the engines' steps are slowed so
  that a long request outlives the window on any machine.

After every test every KV block is free on every replica.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from tests.engine_faults import fail_requests, fill_queue, free_queue, slow_steps
from tests.serve_apps import (
    assert_same, engine_replicas, on_engine, deploy_config, replica_id, run, run_in_background, serve_app,
    wait_engines_running,
)
from tests.test_serve_scaleout import metric, metric_samples, wait_all_blocks_free

APP = "faults"
TIMEOUT = 180.0
PROMPTS = [[(13 * i + 5 * k) % 400 + 10 for k in range(7 + i % 5)] for i in range(64)]
GRACEFUL_S = 3.0


@pytest.fixture(scope="module")
def app(tiny_model_factory):
    model = tiny_model_factory("llama", max_position_embeddings=2048)
    with serve_app(model, declarative=True, app_name=APP, data_parallel_size=2, graceful_shutdown_timeout_s=GRACEFUL_S,
                   max_migrations=3) as args:
        yield args


@pytest.fixture(scope="module")
def http(app):
    from pagedserve.cluster.serve.app import server_url

    with httpx.Client(base_url=server_url(app), timeout=TIMEOUT) as client:
        yield client


@pytest.fixture(autouse=True)
def blocks_free_after(request):
    yield
    if "http" in request.fixturenames:
        wait_all_blocks_free(request.getfixturevalue("http"), replicas=None)


def counter(http: httpx.Client, name: str) -> float:
    return metric(http.get("/metrics").text, f"pagedserve:{name}")


def routed_to(http: httpx.Client, replica: str) -> float:
    """Requests the ingress routed to `replica` (its per-engine gauge on /metrics)."""
    samples = metric_samples(http.get("/metrics").text, "pagedserve:engine_num_requests_routed")
    return sum(value for labels, value in samples.items() if replica in labels)


def run_all(http: httpx.Client, bodies: list[dict]) -> list[dict]:
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda body: run(http, body), bodies))


def test_a_full_replica_refuses_and_its_requests_succeed_on_the_other(http):
    bodies = [{"prompt": PROMPTS[i], "temperature": 0.0 if i % 2 else 0.8, "seed": i, "max_tokens": 16,
               "stream": i % 3 != 0} for i in range(8)]
    want = [run(http, body) for body in bodies]
    wait_all_blocks_free(http, replicas=2)
    _, full = engine_replicas(APP)[0]
    on_engine(full, fill_queue, 1)
    try:
        before = counter(http, "overload_retries_total")
        for _ in range(4):  # a burst: the router sends some to the full replica (it looks no busier)
            for index, got in enumerate(run_all(http, bodies)):
                assert_same(got, want[index], f"request {index}")
            if counter(http, "overload_retries_total") > before:
                break
        assert counter(http, "overload_retries_total") > before, "no request reached the full replica"
    finally:
        on_engine(full, free_queue)


def test_a_replica_failing_every_request_leaves_routing_until_it_recovers(http):
    name, bad = engine_replicas(APP)[0]
    bad_id = replica_id(name)
    opens = counter(http, "circuit_breaker_opens_total")
    body = {"temperature": 0.0, "max_tokens": 4}
    on_engine(bad, fail_requests, True)
    try:
        failed = 0
        for prompt in PROMPTS:  # until its third failure in a row opens its circuit
            got = run(http, {**body, "prompt": prompt})
            if got["status"] != 200:
                assert got["status"] == 500 and "injected sampling failure" in got["errors"][0], got
                failed += 1
            if counter(http, "circuit_breaker_opens_total") > opens:
                break
        assert counter(http, "circuit_breaker_opens_total") == opens + 1 and failed >= 3
        assert counter(http, "engines_circuit_open") == 1
        routed = routed_to(http, bad_id)
        for prompt in PROMPTS[:10]:  # open: nothing goes there, so nothing fails
            assert run(http, {**body, "prompt": prompt})["status"] == 200
        assert routed_to(http, bad_id) == routed
    finally:
        on_engine(bad, fail_requests, False)
    # Its faults are gone: after the cooldown a healthy report closes the circuit (seen when routing).
    deadline = time.monotonic() + 60
    while counter(http, "engines_circuit_open") > 0:
        assert time.monotonic() < deadline, "the circuit did not close"
        assert run(http, {**body, "prompt": PROMPTS[0]})["status"] == 200
        time.sleep(0.5)
    # Back in routing: prompts it never saw, sent together (one at a time, a prefix-affine router may keep
    # sending each to the replica that served it before), reach it again within a few rounds.
    routed = routed_to(http, bad_id)
    for round_ in range(5):
        fresh = PROMPTS[40 + 4 * round_: 44 + 4 * round_]
        assert all(got["status"] == 200 for got in run_all(http, [{**body, "prompt": p} for p in fresh]))
        if routed_to(http, bad_id) > routed:
            break
    assert routed_to(http, bad_id) > routed, "the recovered replica got no request"
    assert counter(http, "engines_circuit_open") == 0
    assert counter(http, "circuit_breaker_opens_total") == opens + 1


def requests_on(http: httpx.Client) -> dict[str, float]:
    """Requests running or waiting on each engine replica (by /metrics label)."""
    text = http.get("/metrics").text
    running = metric_samples(text, "pagedserve:engine_num_requests_running")
    waiting = metric_samples(text, "pagedserve:engine_num_requests_waiting")
    return {labels: running.get(labels, 0.0) + waiting.get(labels, 0.0) for labels in {*running, *waiting}}


def start_on_both_replicas(http: httpx.Client, bodies: list[dict]) -> tuple[list, dict[int, dict]]:
    """Start the requests one at a time, each once the ones before run in an engine: the router sends
    each fresh prompt to the less loaded replica, so both replicas hold some (asserted)."""
    threads: list = []
    results: dict[int, dict] = {}
    for index, body in enumerate(bodies):
        started, got = run_in_background(http, [body], TIMEOUT)
        threads += started
        results[index] = got  # (filled when it finishes; flattened below)
        deadline = time.monotonic() + TIMEOUT
        while sum(requests_on(http).values()) < index + 1:
            assert time.monotonic() < deadline, f"long request {index} never ran"
            time.sleep(0.1)
    spread = requests_on(http)
    assert len(spread) == 2 and all(n >= 1 for n in spread.values()), f"not on both replicas: {spread}"
    return threads, results


def test_scale_down_finishes_short_requests_and_migrates_long_ones(app, http):
    long = {"max_tokens": 1800, "ignore_eos": True, "cache_salt": "drain"}  # fresh prefixes: routed by load
    bodies = [
        {"prompt": PROMPTS[0], "temperature": 0.0, "stream": True, **long},
        {"prompt": PROMPTS[1], "temperature": 0.9, "seed": 4, "stream": True, **long},
        {"prompt": PROMPTS[2], "temperature": 0.0, "stream": False, **long},
        {"prompt": PROMPTS[3], "temperature": 0.7, "seed": 9, "stream": False, **long},
    ]
    short = [{"prompt": PROMPTS[10 + i], "temperature": 0.0, "max_tokens": 8, "stream": i % 2 == 0}
             for i in range(4)]
    want = [run(http, {**body, "cache_salt": "reference"}) for body in bodies]
    want_short = [run(http, body) for body in short]
    wait_all_blocks_free(http, replicas=2)
    migrations = counter(http, "request_migrations_total")
    replicas = [actor for _, actor in engine_replicas(APP)]
    for replica in replicas:  # ~2 ms a step per request: 1800 tokens take seconds past the window anywhere
        on_engine(replica, slow_steps, 0.002)
    try:
        threads, started = start_on_both_replicas(http, bodies)
        deploy_config(app, deployments=[{"name": f"{APP}-engine", "num_replicas": 1}])
        # While the removed replica drains, short requests keep coming (and succeed, on the survivor or
        # within the graceful window on the replica being removed).
        deadline = time.monotonic() + TIMEOUT
        while len(engine_replicas(APP)) > 1 or any(thread.is_alive() for thread in threads):
            assert time.monotonic() < deadline, "the scale-down did not finish"
            for index, got in enumerate(run_all(http, short)):
                assert_same(got, want_short[index], f"short request {index}")
            for thread in threads:
                thread.join(0.1)
    finally:
        for _, replica in engine_replicas(APP):
            on_engine(replica, slow_steps, 0.0)
    for index in range(len(bodies)):
        assert_same(started[index][0], want[index], f"long request {index}")
    assert counter(http, "request_migrations_total") > migrations, "no long request outlived the window"
    assert counter(http, "request_migration_failures_total") == 0
    wait_engines_running(APP, 1)
