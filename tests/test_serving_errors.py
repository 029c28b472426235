"""Hostile and malformed input through the OpenAI app, in-process (no Ray): ranges at the edge, text
that is not valid Unicode, OpenAI error bodies for every failure, the event loop kept free while
prompts are tokenized, request chat templates, unsupported fields, request ids, the API key scheme,
and probes served without an RPC per call."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import httpx
import pytest
from starlette.testclient import TestClient

from pagedserve.cluster.serving.app import build_fastapi_app
from pagedserve.cluster.serving.core import OpenAIServing
from pagedserve.cluster.settings import ServeArgs
from tests.local_serving import LocalServer, ScriptedCoordinator

TIMEOUT = 60.0
BODY_LIMIT = 4 * 1024 * 1024


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.fixture(scope="module")
def local(tiny_model_factory):
    model = tiny_model_factory("llama", max_position_embeddings=256)
    with LocalServer(str(model), {"scheduling_policy": "priority"}, max_n=4, max_request_body_bytes=BODY_LIMIT) as server:
        yield server


@pytest.fixture(scope="module")
def client(local):
    with local.test_client() as c:
        yield c


def greedy(client: TestClient, prompt: str = "The quick brown fox", **extra) -> httpx.Response:
    return client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                "temperature": 0, **extra}, timeout=TIMEOUT)


# --------------------------------------------------------------------------- 1. ranges at the edge


@pytest.mark.parametrize(
    "body,param",
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2**63}, "top_k"),
        ({"n": 5}, "n"),  # over the server's max_n (4)
        ({"n": 2, "best_of": 5}, "best_of"),
        ({"best_of": 2}, "best_of"),  # best_of > n is not supported
        ({"logprobs": 21}, "logprobs"),  # over max_logprobs (20)
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),  # outside the vocabulary
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"-5": 1}}, "logit_bias"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ["s"] * 65}, "stop"),
        ({"stop": "x" * 5000}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"priority": 2**63}, "priority"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"temperature": 1e9}, "temperature"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids"),
        ({"prompt": [2**40]}, "prompt"),
    ],
)
def test_numeric_fields_out_of_range_are_400_naming_the_field(client, body, param):
    assert_openai_error(greedy(client, **body), 400, param)


def test_nan_and_infinity_are_refused(client):
    for raw in ('{"prompt": "x", "temperature": NaN}', '{"prompt": "x", "top_p": Infinity}'):
        r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert_openai_error(r, 400)


def test_edge_values_the_engine_honours(client, local):
    for body in ({"seed": 2**64 - 1, "n": 2, "temperature": 1.0}, {"seed": -(2**63), "temperature": 1.0},
                 {"top_k": 2**63 - 1}, {"top_k": -1}, {"priority": -(2**63)}, {"temperature": 1e-300},
                 {"logit_bias": {"5": -100}}):
        r = greedy(client, **{"temperature": 0, **body})
        assert r.status_code == 200, (body, r.text)
    top_k_huge = greedy(client, top_k=10**6, temperature=0).json()["choices"][0]["text"]
    assert top_k_huge == greedy(client).json()["choices"][0]["text"]  # clamped: the whole vocabulary


# --------------------------------------------------------------------------- 2. text that is not valid Unicode


@pytest.mark.parametrize(
    "path,raw,param",
    [
        ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        ("/v1/completions", '{"prompt": "x", "model": "\\udfff"}', "model"),
        ("/v1/completions", '{"prompt": ["ok", "\\ud800"]}', "prompt"),
        ("/v1/completions", '{"prompt": "x", "stop": ["\\ud800"]}', "stop"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", '
                                 '"text": "\\udc00"}]}]}', "messages"),
        ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
        ("/tokenize", '{"messages": [{"role": "\\ud800", "content": "x"}]}', "messages"),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(client, path, raw, param):
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400, param)


def test_invalid_utf8_bytes_are_400(client):
    r = client.post("/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


# --------------------------------------------------------------------------- 3. every error is an OpenAI body


def test_framework_errors_are_openai_bodies(client):
    r = client.post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert_openai_error(r, 400)
    assert "detail" not in r.json()
    assert_openai_error(client.get("/v1/nothing-here"), 404)
    r = client.get("/v1/completions")
    assert_openai_error(r, 405)
    assert "POST" in r.headers.get("allow", "")
    assert_openai_error(client.post("/v1/models"), 405)
    r = client.post("/v1/completions", content=b"prompt=x", headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "error" in r.json()


def test_body_over_the_limit_is_413(client):
    big = json.dumps({"prompt": "x" * (BODY_LIMIT + 10)})
    r = client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert_openai_error(r, 413)

    def chunks():  # no Content-Length: the limit is counted as the body streams in
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 65536 + 2):
            yield b"x" * 65536
        yield b'"}'

    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(r, 413)


def test_unexpected_errors_are_500_bodies_logged_and_counted(tiny_llama, caplog):
    from pagedserve.engine.tokenizer import load_tokenizer

    args = ServeArgs(model=str(tiny_llama), served_model_name="tiny", api_key=None)
    serving = OpenAIServing(ScriptedCoordinator(fail_at_start=RuntimeError("boom")), load_tokenizer(str(tiny_llama)),
                            args, max_model_len=512)
    with TestClient(build_fastapi_app(serving), raise_server_exceptions=False) as c, caplog.at_level(logging.ERROR):
        r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}, headers={"X-Request-Id": "req-500"})
        error = assert_openai_error(r, 500)
        assert error["type"] == "internal_server_error" and error["request_id"] == "req-500"
        assert "boom" not in error["message"]  # internals stay in the log
        assert "req-500" in caplog.text and "boom" in caplog.text
        text = c.get("/metrics").text
    assert 'pagedserve:request_errors_total{model_name="tiny",status="500"} 1.0' in text


def test_error_statuses_are_counted_once(client):
    before = client.get("/metrics").text
    greedy(client, n=99)

    def count(text: str) -> float:
        line = next((x for x in text.splitlines() if x.startswith("pagedserve:request_errors_total")
                     and 'status="400"' in x), None)
        return float(line.rsplit(" ", 1)[1]) if line else 0.0

    assert count(client.get("/metrics").text) == count(before) + 1


# --------------------------------------------------------------------------- 4. the event loop stays free


class GatedTokenizer:
    """A tokenizer whose encoding waits until the test opens the gate (or 30 s pass)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.released_by_gate: list[bool] = []

    def __call__(self, *args, **kwargs):
        self.released_by_gate.append(self.gate.wait(timeout=30))
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)


def test_health_answers_while_a_prompt_is_being_tokenized(tiny_llama):
    """Encoding blocks until /health has answered: done on the event loop, it would wait out the timeout."""
    from pagedserve.engine.tokenizer import load_tokenizer

    tokenizer = GatedTokenizer(load_tokenizer(str(tiny_llama)))
    args = ServeArgs(model=str(tiny_llama), served_model_name="tiny", api_key=None)
    app = build_fastapi_app(OpenAIServing(ScriptedCoordinator(), tokenizer, args, max_model_len=512))

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=TIMEOUT) as c:
            pending = [asyncio.create_task(c.post("/v1/completions", json={"prompt": f"p{i}", "max_tokens": 2}))
                       for i in range(3)]
            await asyncio.sleep(0)
            health = await asyncio.wait_for(c.get("/health"), 20)
            tokenizer.gate.set()
            return health, await asyncio.gather(*pending)

    health, completions = asyncio.run(run())
    assert health.status_code == 200
    assert [r.status_code for r in completions] == [200, 200, 200]
    assert tokenizer.released_by_gate == [True, True, True]


def test_health_answers_while_big_prompts_are_prepared(client, local):
    """Three 2 MB prompts are tokenized in the thread pool while /health answers (then refused as too long)."""
    app = local.app
    done: list[int] = []

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=TIMEOUT) as c:
            async def big(i: int) -> httpx.Response:
                r = await c.post("/v1/completions", json={"prompt": f"{i} " + "lorem ipsum " * 170_000})
                done.append(i)
                return r

            pending = [asyncio.create_task(big(i)) for i in range(3)]
            await asyncio.sleep(0.05)
            health = await asyncio.wait_for(c.get("/health"), 30)
            in_flight = 3 - len(done)
            return health, in_flight, await asyncio.gather(*pending)

    health, in_flight, responses = asyncio.run(run())
    assert health.status_code == 200
    assert in_flight > 0  # answered while big prompts were still being prepared
    for r in responses:
        assert_openai_error(r, 400, "prompt")["code"] == "context_length_exceeded"


# --------------------------------------------------------------------------- 5. request chat templates


def test_request_chat_template_is_refused_by_default(client):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template": "{% for i in range(10**9) %}{% for j in range(10**9) %}x{% endfor %}{% endfor %}"}
    assert_openai_error(client.post("/v1/chat/completions", json=body), 400, "chat_template")


def test_trusted_request_chat_template_renders_with_a_size_limit(tiny_llama):
    from pagedserve.engine.tokenizer import load_tokenizer

    args = ServeArgs(model=str(tiny_llama), served_model_name="tiny", api_key=None,
                     trust_request_chat_template=True, max_request_body_bytes=64 * 1024)
    app = build_fastapi_app(OpenAIServing(ScriptedCoordinator(), load_tokenizer(str(tiny_llama)), args, 512))
    messages = [{"role": "user", "content": "hi"}]
    with TestClient(app, raise_server_exceptions=False) as c:
        ok = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2,
                                                   "chat_template": "{{ messages[0]['content'] }}!"})
        assert ok.status_code == 200, ok.text
        huge = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2,
                                                     "chat_template": "{{ 'ab' * 100000 }}"})
        assert "rendered prompt" in assert_openai_error(huge, 400, "messages")["message"]


# --------------------------------------------------------------------------- 6. fields that change the answer


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"suffix": "x"}, "suffix"),
        ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
        ("/v1/completions", {"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ("/v1/completions", {"response_format": {"type": "xml"}}, "response_format"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
        ("/v1/chat/completions", {"response_format": {"type": "grammar"}}, "response_format"),
        ("/v1/chat/completions", {"echo": True}, "echo"),
    ],
)
def test_unimplemented_fields_are_refused(client, path, body, param):
    base = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    error = assert_openai_error(client.post(path, json={**base, "max_tokens": 2, **body}), 400, param)
    assert "not supported" in error["message"]


def test_neutral_values_and_unknown_fields_pass(client, caplog):
    with caplog.at_level(logging.WARNING):
        r = client.post("/v1/completions", headers={"X-Request-Id": "rid-unknown"},
                        json={"prompt": "x", "max_tokens": 2, "use_beam_search": False, "tools": [],
                              "response_format": {"type": "text"}, "frobnicate": 1})
    assert r.status_code == 200, r.text
    warnings = [rec.getMessage() for rec in caplog.records if "frobnicate" in rec.getMessage()]
    assert len(warnings) == 1 and "rid-unknown" in warnings[0] and "use_beam_search" not in warnings[0]


def test_prompt_logprobs_are_returned(client):
    ids = client.post("/tokenize", json={"prompt": "The quick brown fox"}).json()["tokens"]
    choice = greedy(client, prompt_logprobs=2).json()["choices"][0]
    prompt_lps = choice["prompt_logprobs"]
    assert len(prompt_lps) == len(ids) and prompt_lps[0] is None
    for token_id, position in zip(ids[1:], prompt_lps[1:]):
        assert str(token_id) in position  # the prompt's own token is always listed
        assert all(entry["logprob"] <= 0 for entry in position.values())
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2, "prompt_logprobs": 1}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert_openai_error(greedy(client, prompt_logprobs=1, stream=True), 400, "prompt_logprobs")


def test_truncate_prompt_tokens_keeps_the_last_tokens(client):
    ids = client.post("/tokenize", json={"prompt": "The quick brown fox jumps"}).json()["tokens"]
    r = greedy(client, prompt="The quick brown fox jumps", truncate_prompt_tokens=3).json()
    assert r["usage"]["prompt_tokens"] == 3
    assert r["choices"][0]["text"] == greedy(client, prompt=ids[-3:]).json()["choices"][0]["text"]


# --------------------------------------------------------------------------- 7. X-Request-Id


def test_request_id_is_honoured_generated_or_refused(client):
    r = client.post("/v1/completions", json={"prompt": "x", "n": 99}, headers={"X-Request-Id": "my-id-42"})
    assert r.headers.get_list("x-request-id") == ["my-id-42"]
    assert assert_openai_error(r, 400, "n")["request_id"] == "my-id-42"
    for bad in ("has space", "x" * 129, "é"):
        r = client.get("/v1/models", headers={"X-Request-Id": bad.encode()})
        error = assert_openai_error(r, 400, "X-Request-Id")
        assert bad not in error["message"]
        assert r.headers.get_list("x-request-id") == [error["request_id"]] and len(error["request_id"]) == 32
    r = client.get("/v1/models", headers={"X-Request-Id": "x" * 128})
    assert r.status_code == 200 and r.headers.get_list("x-request-id") == ["x" * 128]
    assert len(client.get("/health").headers.get_list("x-request-id")) == 1


# --------------------------------------------------------------------------- 8. the API key


def _keyed_app(tiny_llama, **overrides) -> tuple:
    from pagedserve.engine.tokenizer import load_tokenizer

    coordinator = ScriptedCoordinator()
    args = ServeArgs(model=str(tiny_llama), served_model_name="tiny", api_key="k3y", **overrides)
    return build_fastapi_app(OpenAIServing(coordinator, load_tokenizer(str(tiny_llama)), args, 512)), coordinator


def test_authorization_scheme_is_case_insensitive(tiny_llama):
    app, _ = _keyed_app(tiny_llama)
    with TestClient(app) as c:
        for header in ("Bearer k3y", "bearer k3y", "BEARER k3y", "  Bearer   k3y "):
            assert c.get("/v1/models", headers={"Authorization": header}).status_code == 200, header
        for header in ("Basic k3y", "Bearer k3yy", "Bearer", "k3y", ""):
            assert_openai_error(c.get("/v1/models", headers={"Authorization": header}), 401)
        assert c.get("/metrics").status_code == 200  # open by default


def test_metrics_can_require_the_key(tiny_llama):
    app, _ = _keyed_app(tiny_llama, metrics_require_auth=True)
    with TestClient(app) as c:
        assert_openai_error(c.get("/metrics"), 401)
        assert c.get("/metrics", headers={"Authorization": "Bearer k3y"}).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/ping").status_code == 200


# --------------------------------------------------------------------------- 9. probes without an RPC per call


def test_probes_and_metrics_read_the_polled_stats(tiny_llama):
    app, coordinator = _keyed_app(tiny_llama)
    with TestClient(app) as c:
        for _ in range(5):
            assert c.get("/health").status_code == 200
            assert c.get("/ping").status_code == 200
            assert c.get("/metrics").status_code == 200
        coordinator.healthy = False
        assert_openai_error(c.get("/health"), 503)
    assert coordinator.num_refreshes == 0


# --------------------------------------------------------------------------- 10. flags and Serve config args


def test_new_settings_as_cli_flags_and_serve_args(tiny_llama):
    from pagedserve.cluster.cli import build_parser, serve_args_from

    ns = build_parser().parse_args([
        "serve", str(tiny_llama), "--max-n", "4", "--max-logprobs", "5", "--max-request-body-bytes", "2048",
        "--trust-request-chat-template", "--metrics-require-auth", "--tokenizer-pool-size", "3",
    ])
    args = serve_args_from(ns)
    assert (args.max_n, args.max_logprobs, args.max_request_body_bytes, args.tokenizer_pool_size) == (4, 5, 2048, 3)
    assert args.trust_request_chat_template and args.metrics_require_auth
    assert ServeArgs.model_validate(args.to_dict()) == args  # the same names in a Serve config's args
    defaults = ServeArgs(model=str(tiny_llama))
    assert (defaults.max_n, defaults.max_logprobs, defaults.max_request_body_bytes) == (16, 20, 16 * 1024 * 1024)
    assert not defaults.trust_request_chat_template and not defaults.metrics_require_auth
    with pytest.raises(ValueError):
        ServeArgs(model=str(tiny_llama), max_request_body_bytes=10)


def test_local_server_still_answers_after_the_errors(client, local):
    """Nothing above disturbed the engine: a greedy request is deterministic and every KV block is free."""
    first = greedy(client).json()["choices"][0]["text"]
    assert greedy(client).json()["choices"][0]["text"] == first
    free, total = local.kv_blocks_when_idle()
    assert free == total
