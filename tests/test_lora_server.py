"""Multi-LoRA through the OpenAI app (in-process: the app, the DP coordinator, the engine actor): a request
picks an adapter by its `model` name and gets HF + PEFT's greedy tokens; /v1/models lists the base and each
adapter with its parent; adapters load and unload at run time behind the API key; an unknown adapter is a
404, one that does not fit (rank, base model) a 400 naming why; /metrics counts requests per adapter and
the engines' adapter loads."""

from __future__ import annotations

import hashlib

import pytest

from tests.local_serving import LocalServer
from tests.lora_adapters import make_adapter, peft_greedy

KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [(9 * k) % 400 + 20 for k in range(14)]
MAX_TOKENS = 5
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory):
    base = tiny_model_factory("llama", max_position_embeddings=512)
    root = tmp_path_factory.mktemp("served-adapters")
    a = make_adapter(base, root / "a", 4, ["q_proj", "v_proj"], seed=21)
    b = make_adapter(base, root / "b", 8, ALL, seed=22)
    big = make_adapter(base, root / "big", 16, ["q_proj"], seed=23)
    other = make_adapter(tiny_model_factory("llama", hidden_size=96), root / "other", 2, ["q_proj"], seed=24)
    expected = {name: peft_greedy(base, path, [PROMPT], MAX_TOKENS)[0] for name, path in (("a", a), ("b", b))}
    expected["tiny"] = peft_greedy(base, None, [PROMPT], MAX_TOKENS)[0]
    server = LocalServer(str(base), engine_kwargs={"enable_lora": True, "max_loras": 2, "max_lora_rank": 8},
                         enable_lora=True, max_lora_rank=8, lora_modules=[f"a={a}"],
                         api_key_sha256=hashlib.sha256(KEY.encode()).hexdigest())
    try:
        yield server, {"a": a, "b": b, "big": big, "other": other}, expected
    finally:
        server.close()


def _complete(http, model: str):
    return http.post("/v1/completions", headers=AUTH, json={"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                           "temperature": 0, "ignore_eos": True})


def _text(server: LocalServer, tokens: list[int]) -> str:
    return server.serving.tokenizer.decode(tokens, skip_special_tokens=True)  # (as the server detokenizes)


def test_adapters_by_model_name_load_unload_and_errors(setup):
    server, paths, expected = setup
    with server.test_client() as http:
        models = http.get("/v1/models", headers=AUTH).json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None), ("a", "tiny")]
        for model in ("tiny", "a"):
            response = _complete(http, model)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == _text(server, expected[model])
            assert response.json()["model"] == model
        chat = http.post("/v1/chat/completions", headers=AUTH, json={
            "model": "a", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
        assert chat.status_code == 200 and chat.json()["model"] == "a"
        missing = _complete(http, "b")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"

        body = {"lora_name": "b", "lora_path": str(paths["b"])}
        assert http.post("/v1/load_lora_adapter", json=body).status_code == 401  # behind the API key
        loaded = http.post("/v1/load_lora_adapter", headers=AUTH, json=body)
        assert loaded.status_code == 200, loaded.text
        assert [m["id"] for m in http.get("/v1/models", headers=AUTH).json()["data"]] == ["tiny", "a", "b"]
        response = _complete(http, "b")
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == _text(server, expected["b"])
        again = http.post("/v1/load_lora_adapter", headers=AUTH, json=body)
        assert again.status_code == 400 and "already served" in again.json()["error"]["message"]

        too_big = http.post("/v1/load_lora_adapter", headers=AUTH, json={"lora_name": "big", "lora_path": str(paths["big"])})
        assert too_big.status_code == 400 and "r=16 exceeds max_lora_rank=8" in too_big.json()["error"]["message"]
        other = http.post("/v1/load_lora_adapter", headers=AUTH,
                          json={"lora_name": "other", "lora_path": str(paths["other"])})
        assert other.status_code == 400 and "base model mismatch" in other.json()["error"]["message"]
        assert other.json()["error"]["param"] == "lora_path"

        assert http.post("/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "b"}).status_code == 200
        assert _complete(http, "b").status_code == 404
        gone = http.post("/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "b"})
        assert gone.status_code == 404 and gone.json()["error"]["type"] == "NotFoundError"
        # the base model and the other adapter are unaffected
        assert _complete(http, "a").json()["choices"][0]["text"] == _text(server, expected["a"])
        assert _complete(http, "tiny").json()["choices"][0]["text"] == _text(server, expected["tiny"])

        server.kv_blocks_when_idle()
        metrics = http.get("/metrics").text
        assert 'pagedserve:lora_requests_total{lora_name="a",model_name="tiny"} 3.0' in metrics
        assert 'pagedserve:lora_requests_total{lora_name="b",model_name="tiny"} 1.0' in metrics
        assert 'pagedserve:lora_adapter_loads_total{model_name="tiny"} 2.0' in metrics
    free, total = server.kv_blocks_when_idle()
    assert free == total


def test_cli_lora_flags_map_onto_serve_args(tiny_llama):
    from pagedserve.cluster.cli import build_parser, serve_args_from
    from pagedserve.cluster.serving.lora import parse_lora_modules

    args = serve_args_from(build_parser().parse_args([
        "serve", str(tiny_llama), "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32", "--max-cpu-loras", "5",
        "--lora-modules", "sql=/adapters/sql", "chat=/adapters/chat"]))
    assert (args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (True, 3, 32, 5)
    assert parse_lora_modules(args.lora_modules) == [("sql", "/adapters/sql"), ("chat", "/adapters/chat")]
    assert args.engine_kwargs()["max_loras"] == 3
    with pytest.raises(ValueError, match="lora_modules: expected NAME=PATH"):
        parse_lora_modules(["sql"])


def test_load_and_unload_at_run_time_under_load_fail_no_request(setup):
    """Requests for the base model and an adapter stream while another adapter loads (and serves at once) and one
    whose requests are mid-stream unloads: every request succeeds with its own adapter's tokens."""
    import json
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from tests.pd_local import metric, sse_summary

    server, paths, expected = setup
    long_tokens = 40
    long_b = peft_greedy(server.args.model, paths["b"], [PROMPT], long_tokens)[0]
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    with server.test_client() as http:
        http.headers.update(AUTH)
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "b2", "lora_path": str(paths["b"])}).status_code == 200

        def long_b2(streaming: threading.Event) -> str:
            """A stream under b2, past its first token (`streaming` set) when b2 is unloaded."""
            text = ""
            with http.stream("POST", "/v1/completions", json={**body, "model": "b2", "max_tokens": long_tokens,
                                                              "stream": True}) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[len("data: "):])["choices"][0]["text"]
                        streaming.set()
            return text

        def short(model: str) -> tuple[str, str]:
            return model, sse_summary(http, "/v1/completions", {**body, "model": model})["choices"][0]["text"]

        with ThreadPoolExecutor(max_workers=12) as pool:
            started = [threading.Event() for _ in range(2)]
            long_runs = [pool.submit(long_b2, event) for event in started]
            background = [pool.submit(short, model) for model in ("tiny", "a", "a", "tiny", "a", "tiny", "a", "tiny")]
            assert all(event.wait(timeout=60) for event in started)
            loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(paths["b"])})
            assert loaded.status_code == 200, loaded.text
            served_c = [pool.submit(short, "c") for _ in range(2)]
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": "b2"}).status_code == 200
            results = [f.result(timeout=120) for f in background + served_c]
            for run in long_runs:
                assert run.result(timeout=120) == _text(server, long_b)
        want = {"tiny": expected["tiny"], "a": expected["a"], "c": expected["b"]}
        for model, text in results:
            assert text == _text(server, want[model]), model
        assert _complete(http, "b2").status_code == 404  # gone for requests that come after
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 200
        server.kv_blocks_when_idle()
        # a, b, b2 and c (each load a new adapter id) through max_loras=2 slots: swaps, counted
        metrics = http.get("/metrics").text
        assert metric(metrics, "pagedserve:lora_adapter_loads_total") >= 4
        assert metric(metrics, "pagedserve:lora_adapter_evictions_total") >= 2
    free, total = server.kv_blocks_when_idle()
    assert free == total


def test_ingress_replicas_agree_on_startup_adapter_ids_and_never_share_one_for_two_adapters(setup):
    """Every ingress replica sends requests to the same engines: a --lora-modules adapter has one id on all of them
    (shared slots and cached blocks), and adapters loaded at run time on different replicas never get one id (an
    engine refuses an id that names two adapters; a per-replica counter would hand out 1, 2, ... on each)."""
    from pagedserve.cluster.serving.lora import LoRAAdapters

    server, paths, _ = setup
    first, second = LoRAAdapters(server.args, "tiny"), LoRAAdapters(server.args, "tiny")
    assert first.resolve("a") == second.resolve("a") == server.serving.lora.resolve("a")
    on_first, on_second = first.load("x", str(paths["b"])), second.load("y", str(paths["a"]))
    assert on_first.lora_int_id != on_second.lora_int_id
    assert on_first.lora_int_id != first.resolve("a").lora_int_id
    first.unload("x")
    assert first.load("x", str(paths["b"])).lora_int_id != on_first.lora_int_id  # a reload is a fresh identity


def test_the_engine_host_reports_its_resident_adapters_where_the_router_prefers_them(setup):
    """The replica's routing stats (what Serve's request router reads) list the adapters its engine holds, and a
    router over replicas reporting those stats sends that adapter's requests to the holder."""
    import asyncio

    from tests.test_lora_routing import pending_for
    from tests.test_serve_router import make_router

    server, _, _ = setup
    with server.test_client() as http:
        assert _complete(http, "a").status_code == 200
    reported = asyncio.run(server.actor.record_routing_stats())
    assert "a" in reported["lora_adapters"]
    router, replicas = make_router(3)
    replicas[1].routing_stats = {**reported, "num_running": 0}
    for i in range(6):
        prompt = [i * 5 + k for k in range(3)]
        assert asyncio.run(router.choose_replicas(replicas, pending_for("a", prompt)))[0][0] is replicas[1]
