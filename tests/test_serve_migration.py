"""Migration through the Serve app, live on loopback: two engine replicas behind one ingress. An engine
replica killed while it streams requests (streamed and not, greedy and seeded, n = 2, logprobs, a stop
string, a JSON schema) makes no client fail: every one gets exactly the text and tokens of an
uninterrupted run, with no error event; the migrations are on /metrics; every KV block is free after.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time

import httpx
import pytest

from pagedserve.cluster.settings import ServeArgs
from tests.structured_output_checks import SCHEMA, is_valid
from tests.test_serve_scaleout import metric, wait_all_blocks_free

MODEL = "tiny"
APP = "migrate"
TIMEOUT = 180.0
PROMPTS = [[(11 * i + 7 * k) % 400 + 10 for k in range(9 + 2 * i)] for i in range(8)]


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray import serve

    from pagedserve.cluster.executor.ray_utils import free_port
    from pagedserve.cluster.serve.app import server_url, start_server

    model = tiny_model_factory("llama", max_position_embeddings=2048)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    args = ServeArgs(model=str(model), dtype="float32", kv_cache_memory="8MiB", block_size=4, port=free_port(),
                     served_model_name=MODEL, api_key=None, max_num_seqs=16, data_parallel_size=2,
                     num_cpus_per_engine=0.5, routing_stats_period_s=0.2, app_name=APP,
                     graceful_shutdown_timeout_s=5, max_migrations=3)
    try:
        start_server(args)
        yield server_url(args)
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=TIMEOUT) as client:
        yield client


def run(http: httpx.Client, body: dict, progress: threading.Event | None = None) -> dict:
    """One /v1/completions request, streamed or not: {"status", "choices": {index: {text, tokens,
    logprobs, finish_reason}}, "completion_tokens", "errors"}. `progress` is set once a streamed
    request has received a few chunks with text."""
    body = {"model": MODEL, "logprobs": 1, **body}
    choices: dict[int, dict] = {}

    def add(choice: dict) -> None:
        got = choices.setdefault(choice["index"], {"text": "", "tokens": [], "logprobs": [], "finish_reason": None})
        got["text"] += choice["text"]
        if choice.get("logprobs"):
            got["tokens"] += choice["logprobs"]["tokens"]
            got["logprobs"] += choice["logprobs"]["token_logprobs"]
        got["finish_reason"] = choice.get("finish_reason") or got["finish_reason"]

    if not body.get("stream"):
        response = http.post("/v1/completions", json=body)
        if response.status_code != 200:
            return {"status": response.status_code, "errors": [response.text], "choices": {}}
        answer = response.json()
        for choice in answer["choices"]:
            add(choice)
        return {"status": 200, "choices": choices, "errors": [], "completion_tokens": answer["usage"]["completion_tokens"]}
    errors: list = []
    usage = None
    chunks = 0
    with http.stream("POST", "/v1/completions", json={**body, "stream_options": {"include_usage": True}}) as response:
        if response.status_code != 200:
            return {"status": response.status_code, "errors": [response.read().decode()], "choices": {}}
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                errors.append(event)
                continue
            for choice in event.get("choices", []):
                add(choice)
            usage = event.get("usage") or usage
            chunks += 1
            if progress is not None and chunks >= 3:
                progress.set()
    return {"status": 200, "choices": choices, "errors": errors,
            "completion_tokens": usage["completion_tokens"] if usage else None}


def assert_same(got: dict, want: dict, what: str) -> None:
    assert got["status"] == 200 and not got["errors"], (what, got)
    assert got["choices"].keys() == want["choices"].keys(), what
    for index, w in want["choices"].items():
        g = got["choices"][index]
        assert g["text"] == w["text"], (what, index)
        assert g["tokens"] == w["tokens"], (what, index)
        assert g["finish_reason"] == w["finish_reason"], (what, index)
        assert all(math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-3) for a, b in zip(g["logprobs"], w["logprobs"]))
    assert got["completion_tokens"] == want["completion_tokens"], what


def first_unique_word(text: str, start: int) -> str:
    """Three ASCII letters from `start` on whose first occurrence in `text` is there (a stop string)."""
    for i in range(start, len(text) - 3):
        word = text[i:i + 3]
        if word.isascii() and word.isalpha() and text.find(word) == i:
            return word
    raise AssertionError(f"no usable stop string in {text!r}")


def requests_to_kill(http: httpx.Client) -> dict[str, dict]:
    long = {"max_tokens": 1200, "ignore_eos": True}  # seconds of decoding: the kill lands mid-stream
    greedy_text = run(http, {"prompt": PROMPTS[0], "temperature": 0, **long})["choices"][0]["text"]
    stop = first_unique_word(greedy_text, start=40)  # about where the kill lands; it ends the reference run
    bodies = {
        "greedy": {"prompt": PROMPTS[0], "temperature": 0, **long},
        "seeded": {"prompt": PROMPTS[1], "temperature": 0.9, "seed": 5, **long},
        "n2": {"prompt": PROMPTS[2], "temperature": 1.0, "seed": 8, "n": 2, **long},
        "stop": {"prompt": PROMPTS[0], "temperature": 0, "stop": [stop], **long},
        "json": {"prompt": PROMPTS[3], "temperature": 0, "max_tokens": 120,
                 "structured_outputs": {"json": SCHEMA, "whitespace_pattern": ""}},
        "final_greedy": {"prompt": PROMPTS[4], "temperature": 0, **long},
        "final_seeded_n2": {"prompt": PROMPTS[5], "temperature": 0.8, "seed": 3, "n": 2, **long},
    }
    for name, body in bodies.items():
        body["stream"] = not name.startswith("final")
    return bodies


def _engine_replicas() -> list:
    import ray

    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if f"#{APP}-engine#" in a["name"]]
    return [(a["name"], ray.get_actor(a["name"], namespace=a["namespace"])) for a in names]


def _wait_running(replicas: int, deadline_s: float = 180.0) -> None:
    from ray import serve

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        status = serve.status().applications[APP].deployments[f"{APP}-engine"]
        if status.replica_states.get("RUNNING", 0) == replicas and status.status == "HEALTHY":
            return
        time.sleep(0.5)
    raise AssertionError(f"not {replicas} running engine replicas: {serve.status().applications[APP]}")


def test_an_engine_replica_killed_mid_stream_fails_no_client(http):
    import ray

    bodies = requests_to_kill(http)
    want = {name: run(http, body) for name, body in bodies.items()}
    assert want["stop"]["choices"][0]["finish_reason"] == "stop"
    assert is_valid("json", want["json"]["choices"][0]["text"])
    wait_all_blocks_free(http, replicas=2)
    before = metric(http.get("/metrics").text, "pagedserve:request_migrations_total")

    results: dict[str, dict] = {}
    progress = {name: threading.Event() for name in bodies}

    def one(name: str) -> None:
        try:
            results[name] = run(http, bodies[name], progress[name])
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            results[name] = {"status": None, "errors": [repr(exc)], "choices": {}}

    threads = [threading.Thread(target=one, args=(name,), daemon=True) for name in bodies]
    for thread in threads:
        thread.start()
    for name, event in progress.items():
        if bodies[name]["stream"] and name != "json":
            assert event.wait(TIMEOUT), f"{name}: no progress"
    name, victim = _engine_replicas()[0]
    ray.kill(victim, no_restart=True)
    for thread in threads:
        thread.join(TIMEOUT)
    for name_, body in bodies.items():
        assert_same(results[name_], want[name_], name_)
    migrations = metric(http.get("/metrics").text, "pagedserve:request_migrations_total") - before
    assert migrations >= 1, "the killed replica held none of the requests"
    _wait_running(2)
    wait_all_blocks_free(http, replicas=2)
