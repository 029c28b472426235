"""A LoRA adapter stays part of a request's identity across engines (in-process, no Ray):

- prefill/decode: a request for an adapter is prefilled under it on the prefill engine, its KV handed over,
  and decoded under it on the decode engine; its greedy tokens equal HF + PEFT's, streamed or not;
- migration: a request whose engine dies mid-stream (`MigratingClient`) continues under its adapter on the
  next engine, alone and through the PD client, and the stream equals HF + PEFT's tokens."""

from __future__ import annotations

import asyncio
from dataclasses import asdict

import pytest

from pagedserve.cluster.serve.migration import MigratingClient
from pagedserve.cluster.serving.app import build_fastapi_app
from pagedserve.cluster.serving.core import OpenAIServing
from pagedserve.cluster.settings import ServeArgs
from pagedserve.engine.async_llm import EngineDeadError
from pagedserve.engine.lora.request import SAMPLING_KEY, LoRARequest
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.tokenizer import load_tokenizer
from tests.local_serving import LocalServer
from tests.lora_adapters import make_adapter, peft_greedy
from tests.pd_local import MODEL_NAME, LocalPD, sse_summary
from tests.test_pd_migration import _DiesOnce

PROMPT = [(11 * k) % 400 + 20 for k in range(21)]
MAX_TOKENS = 10
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_ENGINE = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True).model_dump()


@pytest.fixture(scope="module")
def base(tiny_model_factory):
    return tiny_model_factory("llama", max_position_embeddings=512)


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory):
    path = make_adapter(base, tmp_path_factory.mktemp("pd-adapter") / "a", 8, ALL, seed=31)
    return LoRARequest("a", 1, str(path))


@pytest.fixture(scope="module")
def expected(base, adapter):
    table = {name: peft_greedy(base, path, [PROMPT], MAX_TOKENS)[0]
             for name, path in (("a", adapter.lora_path), (MODEL_NAME, None))}
    assert table["a"] != table[MODEL_NAME]  # the adapter changes the greedy tokens
    return table


@pytest.fixture(scope="module")
def pd(base, adapter):
    local = LocalPD(str(base), engine_kwargs=LORA_ENGINE)
    # The OpenAI app over the PD client, serving the adapter by name (as `--lora-modules a=PATH`).
    local.args = ServeArgs(model=str(base), served_model_name=MODEL_NAME, api_key=None, enable_lora=True,
                           max_lora_rank=8, lora_modules=[f"a={adapter.lora_path}"])
    local.serving = OpenAIServing(local.client, load_tokenizer(str(base)), local.args,
                                  local.decode.engine.config.max_model_len)
    local.app = build_fastapi_app(local.serving)
    yield local
    local.close()


def _lora_requests(engine) -> dict[str, int]:
    return dict(engine.engine.get_stats().scheduler.lora.get("requests", {}))


def _text(tokens: list[int], model: str) -> str:
    return load_tokenizer(model).decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("stream", [False, True], ids=["final", "stream"])
def test_a_pd_request_prefills_and_decodes_under_its_adapter(pd, base, expected, stream):
    before = {engine.replica: _lora_requests(engine) for engine in pd.engines()}
    pd_requests = pd.client.counters.pd_requests
    loads = pd.kv_stats(pd.decode)["loads"]
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    with pd.test_client() as http:
        for model in ("a", MODEL_NAME):
            if stream:
                got = sse_summary(http, "/v1/completions", {**body, "model": model})
                assert not got["errors"]
                text = got["choices"][0]["text"]
            else:
                response = http.post("/v1/completions", json={**body, "model": model})
                assert response.status_code == 200, response.text
                assert response.json()["model"] == model
                text = response.json()["choices"][0]["text"]
            assert text == _text(expected[model], str(base)), model
    # both requests went through a prefill and a KV handover; the adapter's ran under it on both engines
    assert pd.client.counters.pd_requests == pd_requests + 2
    assert pd.kv_stats(pd.decode)["loads"] == loads + 2
    for engine in pd.engines():
        assert _lora_requests(engine).get("a", 0) == before[engine.replica].get("a", 0) + 1
    for free, total, held in pd.wait_idle():
        assert (free, held) == (total, 0)


async def _tokens(client, params: dict, request_id: str) -> list[int]:
    tokens: list[int] = []
    async for out in client.generate(request_id, PROMPT, params):
        assert out.error is None
        tokens += out.outputs[0].token_ids
    return tokens


def test_a_migrated_pd_request_continues_under_its_adapter(pd, adapter, expected):
    params = {**GREEDY, SAMPLING_KEY: asdict(adapter)}
    state = pd.client.decode.engines[0]
    decode_only = pd.client.counters.decode_only
    before = _lora_requests(pd.decode).get("a", 0)
    state.handle = dying = _DiesOnce(pd.decode_handle, after_outputs=2)
    try:
        client = MigratingClient(pd.client)
        got = asyncio.run(_tokens(client, params, "pd-migrated"))
    finally:
        state.handle = pd.decode_handle
        state.available = True
    assert dying.died and client.num_migrations == 1
    assert pd.client.counters.decode_only == decode_only + 1  # the continuation ran on the decode engine alone
    assert _lora_requests(pd.decode).get("a", 0) == before + 2  # the first decode leg and the continuation
    assert got == expected["a"]
    for free, total, held in pd.wait_idle():
        assert (free, held) == (total, 0)


class _DiesAfter:
    """An engine client whose first stream dies (EngineDeadError, as a lost replica surfaces) after `tokens`
    tokens; it records the sampling params of every submission."""

    def __init__(self, inner, tokens: int) -> None:
        self.inner, self.tokens, self.died = inner, tokens, False
        self.submitted: list[dict] = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def generate(self, request_id, prompt_token_ids, sampling_params, priority=0, final_only=False,
                       cache_salt=None, pooling_params=None):
        self.submitted.append(sampling_params)
        kill = not self.died
        self.died = True
        delivered = 0
        async for output in self.inner.generate(request_id, prompt_token_ids, sampling_params, priority,
                                                final_only=final_only, cache_salt=cache_salt):
            if kill and delivered >= self.tokens:
                raise EngineDeadError(f"the replica serving {request_id} died")
            delivered += len(output.outputs[0].token_ids)
            yield output


def test_a_migrated_request_continues_under_its_adapter(base, adapter, expected):
    with LocalServer(str(base), engine_kwargs=LORA_ENGINE) as server:
        inner = _DiesAfter(server.coordinator, tokens=3)
        client = MigratingClient(inner)
        got = asyncio.run(_tokens(client, {**GREEDY, SAMPLING_KEY: asdict(adapter)}, "migrated"))
        assert inner.died and client.num_migrations == 1
        assert len(inner.submitted) == 2
        continuation = inner.submitted[1]
        assert continuation[SAMPLING_KEY] == asdict(adapter) and continuation["resume_output_token_ids"]
        assert got == expected["a"]
        assert server.actor.engine.get_stats().scheduler.lora["requests"] == {"a": 2}
        free, total = server.kv_blocks_when_idle()
        assert free == total
