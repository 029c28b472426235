"""Property-based fuzzing of the OpenAI app from its own OpenAPI schema, in-process over a real engine.

Bodies are drawn from each POST route's request schema (hypothesis-jsonschema), then perturbed (a
field dropped, retyped or replaced by an extreme value), alongside arbitrary JSON and raw bytes.
Whatever arrives: no 5xx, every error is an OpenAI error body, every stream ends with [DONE]. After
the run a greedy request still gets the answer it got before, and every KV block is free again.
Cases are bounded and derandomized so the run is short and repeatable.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from starlette.testclient import TestClient

from tests.local_serving import LocalServer

POST_ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
FUZZ_SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(HealthCheck))
GREEDY = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
EXTREMES = st.sampled_from([
    None, True, -1, 0, 2**31, 2**63, -(2**63) - 1, 2**64, 10**30, 1e308, -1e308, 1e-320, "", "\u0000",
    float("nan"), float("inf"), "x" * 4096, [], {}, [None], {"": None}, "\ud800", ["\udfff"], [2**70],
])
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def local(tiny_model_factory):
    model = tiny_model_factory("llama", max_position_embeddings=64)
    with LocalServer(str(model), {"max_num_seqs": 16}, max_n=4, max_request_body_bytes=256 * 1024) as server:
        yield server


@pytest.fixture(scope="module")
def client(local):
    with local.test_client() as c:
        yield c


@pytest.fixture(scope="module")
def openapi(local) -> dict:
    return local.app.openapi()


@pytest.fixture(scope="module")
def greedy_before(client) -> str:
    r = client.post("/v1/completions", json=GREEDY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def body_strategy(openapi: dict, path: str) -> st.SearchStrategy[Any]:
    """Schema-valid bodies, most with the served model name and a short generation (each case stays
    cheap), some perturbed: one field replaced by an extreme or arbitrary value."""
    schema = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    valid = from_schema({**schema, "components": openapi["components"]})

    @st.composite
    def bodies(draw) -> Any:
        body = draw(valid)
        if not isinstance(body, dict):
            return body
        if "model" in body and draw(st.integers(0, 3)):
            body["model"] = "tiny"
        if path in ("/v1/completions", "/v1/chat/completions"):
            body.pop("max_completion_tokens", None)
            body["max_tokens"] = draw(st.integers(1, 8))
        if path == "/tokenize" and (body.get("prompt") is None) == (body.get("messages") is None):
            # The schema cannot say "exactly one of prompt or messages" (a model validator does), so
            # most schema-valid bodies would stop at it: give these a prompt so they reach the tokenizer.
            body.pop("messages", None)
            body["prompt"] = draw(st.text(max_size=32))
        if draw(st.booleans()) and body:
            key = draw(st.sampled_from(sorted(body)))
            body[key] = draw(EXTREMES | JSON_VALUES)
        return body

    return bodies()


def check_response(response) -> None:
    """No 5xx; errors are OpenAI bodies; streams end with [DONE] and carry errors only in-band."""
    assert response.status_code < 500, (response.status_code, response.text[:2000])
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}, body
        assert {"message", "type", "param", "code"} <= set(body["error"]), body
        return
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", response.text[-500:]
        for event in events[:-1]:
            payload = json.loads(event)
            assert "error" not in payload or set(payload["error"]) >= {"message", "type", "param", "code"}
            if "error" in payload:
                assert payload["error"]["type"] != "internal_server_error", payload


def post(client: TestClient, path: str, body: Any):
    raw = json.dumps(body).encode("utf-8", "surrogatepass")  # NaN / Infinity included: Python's parser takes them
    return client.post(path, content=raw, headers={"content-type": "application/json"}, timeout=120)


@pytest.mark.parametrize("path", POST_ROUTES)
def test_schema_driven_bodies_never_fail_the_server(client, openapi, greedy_before, path):
    statuses: list[int] = []

    @FUZZ_SETTINGS
    @given(body=body_strategy(openapi, path))
    def run(body: Any) -> None:
        response = post(client, path, body)
        statuses.append(response.status_code)
        check_response(response)

    run()
    assert 200 in statuses  # the generated bodies reach the engine, not only the validators


def test_arbitrary_json_and_bytes_never_fail_the_server(client, greedy_before):
    @FUZZ_SETTINGS
    @given(path=st.sampled_from(POST_ROUTES),
           payload=st.one_of(JSON_VALUES.map(lambda v: json.dumps(v).encode()), st.binary(max_size=64)))
    def run(path: str, payload: bytes) -> None:
        check_response(client.post(path, content=payload, headers={"content-type": "application/json"}))

    run()


def test_every_route_and_method(client, openapi):
    for path, operations in openapi["paths"].items():
        for method in ("get", "post", "put", "delete", "patch"):
            response = client.request(method.upper(), path, content=b"{}",
                                      headers={"content-type": "application/json"})
            check_response(response)
            if method not in operations:
                assert response.status_code == 405, (method, path)


def test_after_the_fuzzing_the_engine_is_intact(client, local, greedy_before):
    """Runs last in this module: the answer is unchanged and every KV block is back in the pool."""
    r = client.post("/v1/completions", json=GREEDY)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy_before
    free, total = local.kv_blocks_when_idle()
    assert free == total
