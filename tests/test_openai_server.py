"""The OpenAI-compatible server, live on Ray Serve on loopback, driven by the official `openai` client.

A module fixture starts local Ray + Serve once with a tiny random-weight model; every request
has a timeout. A few error paths that need a misbehaving engine (overload, a dead engine
mid-stream, a stalled engine) run the same FastAPI app in-process over a scripted coordinator.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time

import httpx
import openai
import pytest

from pagedserve.cluster.settings import ServeArgs
from tests.local_serving import ScriptedCoordinator

API_KEY = "test-key"
MODEL = "tiny"
TIMEOUT = 60.0


# --------------------------------------------------------------------------- live server


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray import serve

    from pagedserve.cluster.executor.ray_utils import free_port
    from pagedserve.cluster.serve.app import server_url, start_server

    model = tiny_model_factory("llama", max_position_embeddings=2048)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    args = ServeArgs(model=str(model), dtype="float32", kv_cache_memory="32MiB", block_size=4, port=free_port(),
                     served_model_name=MODEL, api_key=API_KEY, max_num_seqs=64)
    try:
        start_server(args)
        yield server_url(args)
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, timeout=TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=TIMEOUT) as c:
        yield c


def metric(text: str, name: str) -> float:
    """Sum of a metric's samples in a Prometheus exposition (all label sets)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


def wait_idle(http: httpx.Client, deadline_s: float = 60.0) -> str:
    """Poll /metrics until no request runs or waits and every KV block is free; returns the last scrape.
    /metrics serves the coordinator's background poll (every 0.5 s): let one pass first."""
    time.sleep(1.0)
    end = time.monotonic() + deadline_s
    while True:
        text = http.get("/metrics").text
        idle = (metric(text, "pagedserve:num_requests_running") == 0
                and metric(text, "pagedserve:num_requests_waiting") == 0
                and metric(text, "pagedserve:kv_cache_free_blocks") == metric(text, "pagedserve:kv_cache_total_blocks"))
        if idle or time.monotonic() > end:
            return text
        time.sleep(0.2)


def test_models_tokenize_detokenize(http):
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 2048
    tok = http.post("/tokenize", json={"model": MODEL, "prompt": "def fibonacci(n):"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    back = http.post("/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}).json()
    assert back["prompt"].endswith("def fibonacci(n):")
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] == len(chat["tokens"])
    rendered = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert rendered.replace(" ", "") == "<|user|>\nhi<|end|>\n<|assistant|>\n"


def test_completion_stream_equals_non_stream(client, http):
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0.0)
    full = client.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    prompt_tokens = http.post("/tokenize", json={"prompt": "The quick brown fox"}).json()["count"]
    assert full.usage.prompt_tokens == prompt_tokens
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == prompt_tokens + 12

    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == choice.text
    assert [c.choices[0].finish_reason for c in text_chunks if c.choices[0].finish_reason] == ["length"]
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == prompt_tokens


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_continuous_usage_stats_on_every_chunk(client, endpoint):
    options = {"include_usage": True, "continuous_usage_stats": True}
    if endpoint == "completions":
        chunks = list(client.completions.create(model=MODEL, prompt="import os", max_tokens=8, temperature=0,
                                                stream=True, stream_options=options))
    else:
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=8, temperature=0, stream=True, stream_options=options))
    assert all(c.usage is not None for c in chunks)
    completion = [c.usage.completion_tokens for c in chunks]
    assert completion == sorted(completion) and completion[-1] == 8  # running totals, never decreasing
    assert len({c.usage.prompt_tokens for c in chunks}) == 1
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)


def test_seeded_sampling_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, prompt="import os", max_tokens=10, temperature=0.9, seed=1234)
    full = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices)
    assert streamed == full


def test_chat_stream_equals_non_stream(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello there"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_n_choices_with_temperature(client):
    out = client.completions.create(model=MODEL, prompt="class Engine:", max_tokens=8, n=3, temperature=1.0)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 24
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go"}],
                                                 max_tokens=6, n=3, temperature=1.0, stream=True))
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finished == [0, 1, 2]  # exactly one finish chunk per choice


def test_batch_prompts_index_choices(client, http):
    ids = http.post("/tokenize", json={"prompt": "import os"}).json()["tokens"]
    out = client.completions.create(model=MODEL, prompt=["def step", "import os"], max_tokens=4, n=2, temperature=0)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in out.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy: n copies agree
    assert out.usage.prompt_tokens == len(ids) + http.post("/tokenize", json={"prompt": "def step"}).json()["count"]
    by_ids = client.completions.create(model=MODEL, prompt=[[5, 6, 7], ids], max_tokens=4, temperature=0)
    assert sorted(c.index for c in by_ids.choices) == [0, 1]
    assert {c.index: c.text for c in by_ids.choices}[1] == by_index[2]  # token ids == the same text


def test_stop_string(client):
    base = client.completions.create(model=MODEL, prompt="Paged attention", max_tokens=16, temperature=0,
                                     logprobs=0)
    text = base.choices[0].text
    tokens = base.choices[0].logprobs.tokens
    stop = next(t for t in tokens[2:] if t.strip() and "\ufffd" not in t and t in text)
    stopped = client.completions.create(model=MODEL, prompt="Paged attention", max_tokens=16, temperature=0,
                                        stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Paged attention", max_tokens=16, temperature=0, stop=[stop], stream=True) if c.choices)
    assert streamed == stopped.choices[0].text


def test_logprobs_present_and_bounded(client):
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(x <= 0.0 for x in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    # greedy: the sampled token is the most likely one
    assert all(abs(max(top.values()) - x) < 1e-4 for top, x in zip(lp.top_logprobs, lp.token_logprobs))

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 5
    for item in content:
        assert item.logprob <= 0.0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "logprobs": 1000}, "logprobs"),
        ({"prompt": "x", "top_k": -5}, "top_k"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"prompt": [10**6]}, "prompt_token_ids"),
        ({"prompt": "x", "max_tokens": 5000}, "max_tokens"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x " * 3000}, "prompt"),
        ({}, "prompt"),
    ],
)
def test_invalid_completion_values_are_400(http, body, param):
    r = http.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error


def test_invalid_chat_values_are_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    assert info.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)


def test_unknown_model_auth_and_unknown_fields(server, http):
    r = http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=TIMEOUT)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=TIMEOUT,
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert httpx.get(f"{server}/health", timeout=TIMEOUT).status_code == 200  # probes need no key
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "frobnicate": True,
                                           "user": "u-1"})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1


def test_request_id_comes_back_exactly_once_through_serve(http):
    """Serve's proxy sets X-Request-Id on every response; the app adds none of its own behind it."""
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                  headers={"X-Request-Id": "abc-123"})
    assert r.status_code == 200 and r.headers.get_list("x-request-id") == ["abc-123"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 99}, headers={"X-Request-Id": "abc-124"})
    assert r.headers.get_list("x-request-id") == ["abc-124"] and r.json()["error"]["request_id"] == "abc-124"
    generated = http.get("/health").headers.get_list("x-request-id")
    assert len(generated) == 1 and generated[0]
    r = http.get("/v1/models", headers={"X-Request-Id": "z" * 129})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"
    assert len(r.headers.get_list("x-request-id")) == 1


def test_resource_caps_are_400s_through_serve(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [[5, 6]] * 100_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "bad_words": ["x" * 1024] * 1024})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words"
    assert http.get("/health").status_code == 200


def test_embeddings_through_serve(client, http, tiny_model_factory):
    """/v1/embeddings through the Serve ingress, router and engine replica: HF's pooled hidden states."""
    import torch
    import transformers

    hf = transformers.AutoModel.from_pretrained(str(tiny_model_factory("llama", max_position_embeddings=2048)),
                                                dtype=torch.float32).eval()
    ids = [[5, 6, 7, 8, 9, 10, 11], [12, 13]]
    result = client.embeddings.create(model=MODEL, input=ids)  # base64 on the wire, decoded by the client
    assert [d.index for d in result.data] == [0, 1] and result.usage.prompt_tokens == 9
    for token_ids, item in zip(ids, result.data):
        with torch.no_grad():
            expected = hf(torch.tensor([token_ids])).last_hidden_state[0, -1]
        got = torch.tensor(item.embedding)
        assert torch.nn.functional.cosine_similarity(got, expected, dim=0).item() > 0.9999
        assert abs(got.norm().item() - 1.0) < 1e-5
    response = http.post("/v1/embeddings", json={"model": MODEL, "input": ""})
    assert response.status_code == 400 and response.json()["error"]["param"] == "input"
    assert "embeddings" in http.get("/v1/models").json()["data"][0]["capabilities"]
    text = wait_idle(http)
    assert metric(text, "pagedserve:kv_cache_free_blocks") == metric(text, "pagedserve:kv_cache_total_blocks")


def test_metrics_after_requests(client, http):
    client.completions.create(model=MODEL, prompt="def fibonacci", max_tokens=4, temperature=0)
    client.completions.create(model=MODEL, prompt="def fibonacci", max_tokens=4, temperature=0)
    text = wait_idle(http)
    for name in ("pagedserve:time_to_first_token_seconds_count", "pagedserve:e2e_request_latency_seconds_count",
                 "pagedserve:inter_token_latency_seconds_count", "pagedserve:request_prompt_tokens_count",
                 "pagedserve:prompt_tokens_total", "pagedserve:generation_tokens_total",
                 "pagedserve:request_success_total", "pagedserve:prefix_cache_queries_total"):
        assert metric(text, name) > 0, name
    assert metric(text, "pagedserve:prefix_cache_hits_total") > 0  # the second prompt reused the first's blocks
    assert 'model_name="tiny"' in text
    assert metric(text, "pagedserve:kv_cache_usage_perc") == 0.0


def test_client_disconnect_aborts_and_frees_blocks(server, http):
    before = wait_idle(http)
    generated_before = metric(before, "pagedserve:generation_tokens_total")
    max_tokens = 1900
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=TIMEOUT) as c:
        with c.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            received = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
            assert received
            # /metrics serves the coordinator's last poll: wait (bounded) for one that saw the request
            end = time.monotonic() + 30
            while True:
                during = http.get("/metrics").text
                if metric(during, "pagedserve:num_requests_running") == 1 or time.monotonic() > end:
                    break
                time.sleep(0.1)
            assert metric(during, "pagedserve:num_requests_running") == 1
            assert metric(during, "pagedserve:kv_cache_free_blocks") < metric(during, "pagedserve:kv_cache_total_blocks")
        # leaving the block closes the connection mid-stream
    after = wait_idle(http)
    assert metric(after, "pagedserve:num_requests_running") == 0
    assert metric(after, "pagedserve:kv_cache_free_blocks") == metric(after, "pagedserve:kv_cache_total_blocks")
    assert metric(after, "pagedserve:generation_tokens_total") - generated_before < max_tokens  # it was aborted


def test_bounded_load(server, http):
    """200 requests, 32 concurrent streams: no errors, every stream ends with [DONE], no leaked blocks."""
    num_requests, concurrency = 200, 32

    async def one(c: httpx.AsyncClient, sem: asyncio.Semaphore, i: int) -> tuple[int, int, bool]:
        async with sem:
            if i % 2:
                path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"q{i}"}]}
            else:
                path, body = "/v1/completions", {"prompt": f"request {i}: def f(x):"}
            body.update(model=MODEL, max_tokens=8, temperature=0.7, seed=i, stream=True)
            tokens, done = 0, False
            async with c.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    return response.status_code, 0, False
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        done = True
                        continue
                    event = json.loads(data)
                    assert "error" not in event, event
                    tokens += sum(1 for ch in event["choices"] if ch.get("finish_reason"))
            return response.status_code, tokens, done

    async def run() -> list[tuple[int, int, bool]]:
        sem = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=TIMEOUT, limits=limits) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, sem, i) for i in range(num_requests))), 300)

    results = asyncio.run(run())
    assert [status for status, _, _ in results] == [200] * num_requests
    assert all(done and finishes == 1 for _, finishes, done in results)
    after = wait_idle(http)
    assert metric(after, "pagedserve:kv_cache_free_blocks") == metric(after, "pagedserve:kv_cache_total_blocks")
    assert metric(after, "pagedserve:num_requests_running") == 0


# --------------------------------------------------------------------------- scripted engine (in-process)


@pytest.fixture()
def make_app(tiny_llama):
    from pagedserve.cluster.serving.app import build_fastapi_app
    from pagedserve.cluster.serving.core import OpenAIServing
    from pagedserve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_llama))

    def make(coordinator, **overrides):
        args = ServeArgs(model=str(tiny_llama), served_model_name=MODEL, api_key=None, **overrides)
        serving = OpenAIServing(coordinator, tokenizer, args, max_model_len=512)
        return build_fastapi_app(serving)

    return make


def _asgi_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=TIMEOUT)


def test_overload_is_503_with_retry_after(make_app):
    gate = asyncio.Event()
    app = make_app(ScriptedCoordinator(tokens=3, gate=gate), max_pending_requests=1)

    async def run():
        async with _asgi_client(app) as c:
            first = asyncio.create_task(c.post("/v1/completions", json={"prompt": "a", "max_tokens": 3}))
            await asyncio.sleep(0.2)  # the first request now holds the only slot (blocked on the gate)
            second = await c.post("/v1/completions", json={"prompt": "b", "max_tokens": 3})
            gate.set()
            return (await first), second

    first, second = asyncio.run(run())
    assert first.status_code == 200
    assert second.status_code == 503
    assert second.headers["retry-after"] == "1"
    assert second.json()["error"]["code"] == "overloaded"
    assert app.state.serving.num_in_flight == 0  # every admission slot is given back


def test_engine_errors_map_to_status(make_app):
    from pagedserve.engine.async_llm import EngineDeadError, EngineOverloadedError

    async def post(coordinator, **body):
        app = make_app(coordinator)
        async with _asgi_client(app) as c:
            response = await c.post("/v1/completions", json={"prompt": "a", **body})
        assert app.state.serving.num_in_flight == 0
        return response

    r = asyncio.run(post(ScriptedCoordinator(fail_at_start=EngineOverloadedError("full"))))
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    r = asyncio.run(post(ScriptedCoordinator(fail_at_start=ValueError("prompt_token_ids: token id 9999 is bad"))))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_token_ids"
    r = asyncio.run(post(ScriptedCoordinator(tokens=2, error=EngineDeadError("engine 0 died"))))
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"

    coordinator = ScriptedCoordinator(tokens=2, error=EngineDeadError("engine 0 died"))
    r = asyncio.run(post(coordinator, stream=True))
    assert r.status_code == 200
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_dead"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-2]] == ["t0 ", "t1 "]
    assert len(coordinator.aborted) == 1  # the failed stream was closed, not left running


def test_health_reflects_stalled_engine(make_app):
    coordinator = ScriptedCoordinator()
    app = make_app(coordinator)

    async def get():
        async with _asgi_client(app) as c:
            return await c.get("/health")

    assert asyncio.run(get()).status_code == 200
    coordinator.healthy = False
    r = asyncio.run(get())
    assert r.status_code == 503 and r.json()["error"]["code"] == "unhealthy"
