"""Through the server: a request that fails inside an engine step gets an OpenAI error (500, or an error
event on a stream) and fails alone: a concurrent healthy request finishes with its usual answer, the
engine keeps serving, and every KV block is free afterwards."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.local_serving import LocalServer

# Requests whose prompt starts with these token ids are poisoned by the fault injector.
MARK = [11, 12, 13, 14]
HEALTHY = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
POISONED = {"model": "tiny", "prompt": MARK + [5, 6, 7], "max_tokens": 8, "temperature": 0}


class PoisonMarkedPrompts:
    """Model-runner fault injector: the sampling of a request whose prompt starts with MARK raises."""

    def __init__(self, runner, after_tokens: int = 0) -> None:
        self.runner, self.after_tokens = runner, after_tokens
        self.failed: set[str] = set()

    def __call__(self, stage: str, request_id: str) -> None:
        state = self.runner.requests.get(request_id)
        if (stage == "sample" and state is not None and state.token_ids[: len(MARK)] == MARK
                and len(state.token_ids) - state.num_prompt_tokens >= self.after_tokens):
            self.failed.add(request_id)
            raise RuntimeError("injected sampling failure")


@pytest.fixture(scope="module")
def local(tiny_model_factory):
    with LocalServer(str(tiny_model_factory("llama", max_position_embeddings=256)), {"max_num_seqs": 8}) as server:
        yield server


@pytest.fixture(scope="module")
def client(local):
    with local.test_client() as c:
        yield c


def _runner(local: LocalServer):
    return local.actor.engine.engine.engine_core.executor.worker.model_runner


def test_request_failing_in_a_step_fails_alone(client, local):
    alone = client.post("/v1/completions", json=HEALTHY)
    assert alone.status_code == 200
    runner = _runner(local)
    injector = PoisonMarkedPrompts(runner)
    runner.fault_injector = injector
    try:
        with ThreadPoolExecutor(1) as pool:
            healthy = pool.submit(client.post, "/v1/completions", json=HEALTHY)
            deadline = time.monotonic() + 60  # let the healthy request start, so the two share steps
            while local.actor.engine.get_stats().num_unfinished == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            bad = client.post("/v1/completions", json=POISONED)
            bad_stream = client.post("/v1/completions", json={**POISONED, "stream": True})
            healthy = healthy.result(timeout=120)
    finally:
        runner.fault_injector = None

    assert len(injector.failed) == 2
    assert bad.status_code == 500
    error = bad.json()["error"]
    assert error["code"] == "request_failed" and "injected sampling failure" in error["message"]
    # It fails at its first token, before the SSE body starts: the status line still says so.
    assert bad_stream.status_code == 500 and bad_stream.json()["error"]["code"] == "request_failed"

    assert healthy.status_code == 200
    assert healthy.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    again = client.post("/v1/completions", json=POISONED)  # the injector is off: the engine serves it
    assert again.status_code == 200 and again.json()["choices"][0]["finish_reason"] == "length"
    free, total = local.kv_blocks_when_idle()
    assert free == total


def test_stream_failing_mid_way_ends_with_an_error_event(client, local):
    runner = _runner(local)
    runner.fault_injector = PoisonMarkedPrompts(runner, after_tokens=3)
    try:
        r = client.post("/v1/completions", json={**POISONED, "stream": True})
    finally:
        runner.fault_injector = None
    assert r.status_code == 200  # the body had started: the error is reported in-band
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_failed"
    chunks = [json.loads(e) for e in events[:-2]]
    assert chunks and all(c["choices"][0]["finish_reason"] != "error" for c in chunks if c["choices"])
    free, total = local.kv_blocks_when_idle()
    assert free == total
