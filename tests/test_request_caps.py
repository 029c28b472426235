"""Resource caps at the HTTP API, in-process: prompts per request and admission by prompts x n, bad_words
(characters at the door, tokens in the engine), grammar bombs, request ids (valid, exactly once), the
API key from a file or the environment, and the warning for a server reachable without a key. Every
refusal is a 400 naming the field, made before any per-prompt work, while /health keeps answering."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from starlette.testclient import TestClient

from pagedserve.cluster.serving.app import build_fastapi_app
from pagedserve.cluster.serving.core import OpenAIServing
from pagedserve.cluster.settings import API_KEY_ENV, ServeArgs, exposure_warning, is_loopback_host
from pagedserve.engine.tokenizer import load_tokenizer
from pagedserve.engine.sampling_params import MAX_BAD_WORDS_TOKENS
from tests.local_serving import LocalServer, ScriptedCoordinator
from tests.test_serving_errors import TIMEOUT, GatedTokenizer, assert_openai_error


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(str(tiny_llama))


def _app(tiny_llama, tokenizer, coordinator=None, behind_serve_proxy: bool = False, **overrides):
    args = ServeArgs(model=str(tiny_llama), served_model_name="tiny", **{"api_key": None, **overrides})
    serving = OpenAIServing(coordinator or ScriptedCoordinator(), tokenizer, args, max_model_len=512)
    return build_fastapi_app(serving, behind_serve_proxy=behind_serve_proxy)


def _asgi(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=TIMEOUT)


# --------------------------------------------------------------------------- refused early, /health answers


BIG_BODIES = [
    ({"prompt": [[5, 6]] * 100_000}, "prompt"),  # over the static ceiling: refused before the model is built
    ({"prompt": ["a b"] * 100_000}, "prompt"),
    ({"prompt": [f"p{i}" for i in range(129)]}, "prompt"),  # over the server's limit (128): before tokenizing
    ({"prompt": "x", "bad_words": ["x" * 1024] * 1024}, "bad_words"),  # 1 MiB of bad words
]


@pytest.mark.parametrize(("body", "param"), BIG_BODIES)
def test_big_requests_are_refused_before_tokenizing_while_health_answers(tiny_llama, tokenizer, body, param):
    """The tokenizer's gate is never opened: a request that reached tokenization would hang, not 400."""
    gated = GatedTokenizer(tokenizer)
    app = _app(tiny_llama, gated)

    async def run():
        async with _asgi(app) as c:
            refused = asyncio.create_task(c.post("/v1/completions", json={"max_tokens": 2, **body}))
            health = await asyncio.wait_for(c.get("/health"), 30)
            return health, await asyncio.wait_for(refused, 60)

    health, refused = asyncio.run(run())
    assert health.status_code == 200
    assert_openai_error(refused, 400, param)
    assert gated.released_by_gate == []  # nothing was tokenized
    assert app.state.serving.num_in_flight == 0


def test_max_prompts_per_request_is_a_setting(tiny_llama, tokenizer):
    app = _app(tiny_llama, tokenizer, max_prompts_per_request=3)
    with TestClient(app) as c:
        ok = c.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 3
        error = assert_openai_error(c.post("/v1/completions", json={"prompt": ["a", "b", "c", "d"]}), 400, "prompt")
        assert "at most 3 prompts" in error["message"]
    with pytest.raises(ValueError):
        ServeArgs(model=str(tiny_llama), max_prompts_per_request=0)


def test_admission_counts_prompts_times_n(tiny_llama, tokenizer):
    gate = asyncio.Event()
    app = _app(tiny_llama, tokenizer, ScriptedCoordinator(tokens=3, gate=gate), max_pending_requests=4, max_n=8)

    async def run():
        async with _asgi(app) as c:
            body = {"prompt": ["a", "b"], "n": 2, "max_tokens": 3}
            first = asyncio.create_task(c.post("/v1/completions", json=body))
            while app.state.serving.num_in_flight == 0:
                await asyncio.sleep(0.01)
            held = app.state.serving.num_in_flight
            second = await c.post("/v1/completions", json={"prompt": "c", "max_tokens": 3})
            gate.set()
            return held, await first, second

    held, first, second = asyncio.run(run())
    assert held == 4  # two prompts x n=2: four slots for one HTTP request
    assert first.status_code == 200
    assert second.status_code == 503 and second.json()["error"]["code"] == "overloaded"
    assert app.state.serving.num_in_flight == 0
    with TestClient(app) as c:  # never admissible: a 400, not a retry-later 503
        assert_openai_error(c.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2}), 400, "prompt")
        assert_openai_error(c.post("/v1/completions", json={"prompt": "a", "n": 5}), 400, "n")
        chat = {"messages": [{"role": "user", "content": "hi"}], "n": 5}
        assert_openai_error(c.post("/v1/chat/completions", json=chat), 400, "n")


def test_bad_words_over_the_token_limit_are_a_400_from_the_engine(tiny_llama):
    """Under the character limit but over the token limit: the engine (tokenizing in a thread) refuses."""
    words = [" ".join(f"w{i}x{j}" for j in range(120)) for i in range(MAX_BAD_WORDS_TOKENS // 400)]
    assert all(len(w) <= 1024 for w in words)
    with LocalServer(str(tiny_llama), {"kv_cache_memory": "8MiB"}) as server, server.test_client() as c:
        r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "bad_words": words})
        assert "encode to more than" in assert_openai_error(r, 400, "bad_words")["message"]
        ok = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "bad_words": ["fox"]})
        assert ok.status_code == 200
        free, total = server.kv_blocks_when_idle()
        assert free == total


# --------------------------------------------------------------------------- grammar bombs over HTTP


@pytest.mark.parametrize(
    ("extra", "param", "prefix"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": {
            "type": "object", "properties": {"a": {"type": "array", "items": {"type": "array", "items": {
                "enum": list(range(2000))}}}}}}}}, "response_format", "response_format.json_schema:"),
        ({"guided_regex": "(" + "|".join(f"[a-z]{{{i}}}x" for i in range(1, 301)) + ")"}, "guided_regex",
         "guided_regex:"),
        ({"guided_json": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}}},
         "guided_json", "guided_json:"),
        ({"guided_grammar": "root ::= " + " ".join(f'[a-z]{{{100 + i}}}' for i in range(40))}, "guided_grammar",
         "guided_grammar:"),
    ],
)
def test_grammar_bombs_are_400s_naming_the_field(tiny_llama, tokenizer, extra, param, prefix):
    with TestClient(_app(tiny_llama, tokenizer)) as c:
        error = assert_openai_error(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **extra}),
                                    400, param)
        assert error["message"].startswith(prefix), error["message"]


# --------------------------------------------------------------------------- X-Request-Id


def test_request_id_is_set_once_by_the_app_or_left_to_the_serve_proxy(tiny_llama, tokenizer):
    with TestClient(_app(tiny_llama, tokenizer)) as c:
        r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}, headers={"X-Request-Id": "abc-123"})
        assert r.status_code == 200 and r.headers.get_list("x-request-id") == ["abc-123"]
        assert len(c.get("/health").headers.get_list("x-request-id")) == 1
    # Behind Serve's proxy (which puts the id on every request and copies it onto the response) the app
    # adds none, and still names the id in error bodies.
    with TestClient(_app(tiny_llama, tokenizer, behind_serve_proxy=True)) as c:
        r = c.post("/v1/completions", json={"prompt": "a", "n": 99}, headers={"X-Request-Id": "abc-123"})
        assert r.headers.get_list("x-request-id") == []
        assert assert_openai_error(r, 400, "n")["request_id"] == "abc-123"
        r = c.get("/v1/models", headers={"X-Request-Id": "y" * 129})
        assert "request_id" not in assert_openai_error(r, 400, "X-Request-Id")


# --------------------------------------------------------------------------- the API key


def test_api_key_from_a_file_or_the_environment(tiny_llama, tokenizer, tmp_path, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text("  file-key\n")
    monkeypatch.setenv(API_KEY_ENV, "env-key")
    assert ServeArgs(model=str(tiny_llama)).api_key == "env-key"
    assert ServeArgs(model=str(tiny_llama), api_key_file=str(key_file)).api_key == "file-key"  # file > env
    assert ServeArgs(model=str(tiny_llama), api_key_file=str(key_file), api_key="flag-key").api_key == "flag-key"
    args = ServeArgs(model=str(tiny_llama), api_key_file=str(key_file))
    assert "file-key" not in repr(args.to_dict()) and "api_key_file" not in args.to_dict()
    replica = ServeArgs.model_validate(args.to_dict())  # what a Serve replica builds: the digest only
    app = build_fastapi_app(OpenAIServing(ScriptedCoordinator(), tokenizer, replica, 512))
    with TestClient(app) as c:
        assert_openai_error(c.get("/v1/models", headers={"Authorization": "Bearer env-key"}), 401)
        assert c.get("/v1/models", headers={"Authorization": "Bearer file-key"}).status_code == 200
    monkeypatch.delenv(API_KEY_ENV)
    with pytest.raises(ValueError, match="api_key_file: cannot read"):
        ServeArgs(model=str(tiny_llama), api_key_file=str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="api_key_file: .* is empty"):
        ServeArgs(model=str(tiny_llama), api_key_file=str(tmp_path / "empty"))


def test_api_key_file_flag(tiny_llama, tmp_path, capsys):
    from pagedserve.cluster.cli import build_parser, serve_args_from

    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    args = serve_args_from(build_parser().parse_args(["serve", str(tiny_llama), "--api-key-file", str(key_file),
                                                      "--max-prompts-per-request", "16"]))
    assert args.api_key == "s3cret" and args.max_prompts_per_request == 16
    with pytest.raises(SystemExit):
        serve_args_from(build_parser().parse_args(["serve", str(tiny_llama), "--api-key-file", str(tmp_path / "x")]))
    assert "--api-key-file: cannot read" in capsys.readouterr().err


def test_serving_beyond_loopback_without_a_key_warns_at_start(tiny_llama, monkeypatch, caplog):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert all(is_loopback_host(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback_host(h) for h in ("0.0.0.0", "::", "10.0.0.5", "example.com"))
    assert exposure_warning(ServeArgs(model=str(tiny_llama))) is None
    assert exposure_warning(ServeArgs(model=str(tiny_llama), host="0.0.0.0", api_key="k")) is None
    warning = exposure_warning(ServeArgs(model=str(tiny_llama), host="0.0.0.0"))
    assert "0.0.0.0" in warning and "no API key" in warning and "--api-key-file" in warning

    import pagedserve.cluster.executor.ray_utils as ray_utils
    from pagedserve.cluster.serve.app import start_server

    class Stop(Exception):
        pass

    def no_ray(*args, **kwargs) -> None:
        raise Stop

    monkeypatch.setattr(ray_utils, "ensure_ray", no_ray)  # the warning comes before anything starts
    with caplog.at_level(logging.WARNING), pytest.raises(Stop):
        start_server(ServeArgs(model=str(tiny_llama), host="0.0.0.0"))
    assert "with no API key" in caplog.text
