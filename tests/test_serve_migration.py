"""Migration through the Serve app, live on loopback: two engine replicas behind one ingress. An engine
replica killed while it streams requests (streamed and not, greedy and seeded, n = 2, logprobs, a stop
string, a JSON schema) makes no client fail: every one gets exactly the text and tokens of an
uninterrupted run, with no error event; the migrations are on /metrics; every KV block is free after.
The non-streamed ones continue from the last checkpoint their engine sent (every 0.05 s here, so that
the kill lands after some: `EngineHost.final_only_checkpoint_s`).
"""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.serve_apps import assert_same, engine_replicas, on_engine, run, serve_app, wait_engines_running
from tests.structured_output_checks import SCHEMA, is_valid
from tests.test_serve_scaleout import metric, wait_all_blocks_free

APP = "migrate"
TIMEOUT = 180.0
PROMPTS = [[(11 * i + 7 * k) % 400 + 10 for k in range(9 + 2 * i)] for i in range(8)]


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    from pagedserve.cluster.serve.app import server_url

    model = tiny_model_factory("llama", max_position_embeddings=2048)
    with serve_app(model, app_name=APP, data_parallel_size=2, graceful_shutdown_timeout_s=5,
                   max_migrations=3) as args:
        yield server_url(args)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=TIMEOUT) as client:
        yield client


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


def set_checkpoint_interval(host, seconds: float) -> None:
    host.final_only_checkpoint_s = seconds


def test_an_engine_replica_killed_mid_stream_fails_no_client(http):
    import ray

    for _, replica in engine_replicas(APP):
        on_engine(replica, set_checkpoint_interval, 0.05)
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
    name, victim = engine_replicas(APP)[0]
    ray.kill(victim, no_restart=True)
    for thread in threads:
        thread.join(TIMEOUT)
    for name_, body in bodies.items():
        assert_same(results[name_], want[name_], name_)
    migrations = metric(http.get("/metrics").text, "pagedserve:request_migrations_total") - before
    assert migrations >= 1, "the killed replica held none of the requests"
    wait_engines_running(APP, 2)
    wait_all_blocks_free(http, replicas=2)
