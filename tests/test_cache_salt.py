"""`cache_salt` (vLLM's prompt field): requests share prefix-cache blocks only with requests of the same
salt; no salt is the shared cache as before. It reaches the engine through the library (a prompt dict
key), AsyncLLM, the engine actor behind the DP coordinator, the Serve engine client, and HTTP (a
request field on completions and chat completions); a bad salt is a ValueError / a 400 naming it."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.engine import LLM, SamplingParams
from tests.local_serving import LocalServer

PROMPT = [(13 * k) % 400 + 20 for k in range(21)]  # five full blocks of 4 and a tail
GREEDY = dict(max_tokens=3, temperature=0, ignore_eos=True)


def _cached(llm: LLM, salt: str | None, **params) -> list[int]:
    prompt = {"prompt_token_ids": PROMPT} if salt is None else {"prompt_token_ids": PROMPT, "cache_salt": salt}
    out = llm.generate([prompt], SamplingParams(**{**GREEDY, **params}), use_tqdm=False)[0]
    return out.num_cached_tokens


def test_the_library_shares_blocks_only_between_requests_of_the_same_salt(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", num_kv_blocks=64, block_size=4)
    assert _cached(llm, None) == 0
    assert _cached(llm, None) == 20  # no salt: today's shared cache
    assert _cached(llm, "tenant-a") == 0  # not the unsalted blocks
    assert _cached(llm, "tenant-a") == 20
    assert _cached(llm, "tenant-b") == 0
    _cached(llm, "tenant-c", n=2)  # (its second child hits the first one's blocks)
    assert _cached(llm, "tenant-c") == 20  # the children carried the salt: their blocks are tenant-c's
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize("salt,message", [("", "1 to 256 characters, got 0"), ("x" * 257, "got 257"),
                                          (7, "expected a string, got int")])
def test_a_bad_salt_is_a_value_error_naming_it(tiny_llama, salt, message):
    llm = LLM(model=str(tiny_llama), dtype="float32", num_kv_blocks=16, block_size=4)
    with pytest.raises(ValueError, match=f"cache_salt: .*{message}"):
        llm.generate([{"prompt_token_ids": PROMPT, "cache_salt": salt}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert _cached(llm, "x" * 256) == 0  # the longest salt is fine, and the engine goes on


def test_the_serve_engine_client_carries_the_salt_to_its_replica(tiny_llama):
    """ServeEngineClient -> engine deployment -> engine actor -> AsyncLLM, in-process (a fake handle)."""
    from pagedserve.cluster.serve.client import ServeEngineClient
    from pagedserve.cluster.serve.engine_host import EngineHost
    from tests.serve_handle_fakes import FakeHandle

    replica = EngineHost({"model": str(tiny_llama), "dtype": "float32", "kv_cache_memory": "8MiB",
                                "block_size": 4})

    client = ServeEngineClient(FakeHandle(replica), "app", "engine")

    async def cached(rid: str, salt: str | None) -> int:
        outputs = [o async for o in client.generate(rid, PROMPT, GREEDY, final_only=True, cache_salt=salt)]
        return outputs[-1].num_cached_tokens

    try:
        got = [asyncio.run(cached(f"r{i}", salt)) for i, salt in enumerate(["s1", "s1", "s2", None])]
    finally:
        replica.shutdown()
    assert got == [0, 20, 0, 0]


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    local = LocalServer(str(tiny_model_factory("llama", max_position_embeddings=512)))
    try:
        yield local
    finally:
        local.close()


def _hits(server: LocalServer) -> int:
    return server.actor.engine.get_stats().scheduler.prefix_cache_hits


def test_http_salts_completions_and_chat(server):
    """Over the OpenAI app, the DP coordinator and the engine actor: a salt's blocks are hits for the same
    salt only (prefix-cache hit counters of the engine)."""
    with server.test_client() as http:
        def hits_of(path: str, body: dict) -> int:
            before = _hits(server)
            response = http.post(path, json={"model": "tiny", "max_tokens": 2, "temperature": 0, **body})
            assert response.status_code == 200, response.text
            server.kv_blocks_when_idle()  # (the stats are published a loop turn after the output)
            return _hits(server) - before

        completion = {"prompt": PROMPT}
        assert hits_of("/v1/completions", {**completion, "cache_salt": "a"}) == 0
        assert hits_of("/v1/completions", {**completion, "cache_salt": "b"}) == 0
        assert hits_of("/v1/completions", {**completion, "cache_salt": "a"}) == 20
        assert hits_of("/v1/completions", completion) == 0
        chat = {"messages": [{"role": "user", "content": "a long enough question " * 4}]}
        assert hits_of("/v1/chat/completions", {**chat, "cache_salt": "c", "stream": True}) == 0
        assert hits_of("/v1/chat/completions", {**chat, "cache_salt": "c"}) > 0
        assert hits_of("/v1/chat/completions", {**chat, "cache_salt": "d"}) == 0


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
@pytest.mark.parametrize("salt", ["", "x" * 257, 5])
def test_http_refuses_a_bad_salt_with_a_400_naming_it(server, path, body, salt):
    with server.test_client() as http:
        response = http.post(path, json={"model": "tiny", "max_tokens": 1, "cache_salt": salt, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "cache_salt"
