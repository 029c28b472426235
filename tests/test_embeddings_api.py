"""`POST /v1/embeddings` through the official `openai` client: the app in-process over a real engine
(tests/local_serving.py), its vectors equal to HF transformers' pooled hidden states, the encodings,
`dimensions`, the 400s an OpenAI client expects, and `/v1/models` saying what the model serves."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch
import transformers

from tests.local_serving import LocalServer, OneIdleEngineClient

TIMEOUT = 60.0
MAX_MODEL_LEN = 64
MAX_INPUTS = 4


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def local(model):
    with LocalServer(str(model), {"max_model_len": MAX_MODEL_LEN, "max_num_batched_tokens": 16},
                     max_prompts_per_request=MAX_INPUTS) as server:
        yield server


@pytest.fixture(scope="module")
def http(local):
    with local.test_client() as c:
        yield c


@pytest.fixture(scope="module")
def client(http) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0,
                         timeout=TIMEOUT)


@pytest.fixture(scope="module")
def hf_model(model):
    return transformers.AutoModel.from_pretrained(str(model), dtype=torch.float32).eval()


def reference(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf_model(torch.tensor([token_ids])).last_hidden_state[0]
    return torch.nn.functional.normalize(hidden[-1], dim=0)  # the server's default: last, normalized


def cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(torch.as_tensor(a), torch.as_tensor(b), dim=0).item()


def assert_idle(local: LocalServer) -> None:
    free, total = local.kv_blocks_when_idle()
    assert free == total


def test_openai_client_embeddings_match_hf(client, local, hf_model):
    texts = ["the quick brown fox jumps over the lazy dog again and again", "hello world"]
    result = client.embeddings.create(model="tiny", input=texts)  # the client asks for base64 and decodes it
    tokenizer = local.serving.tokenizer
    assert [d.index for d in result.data] == [0, 1]
    for text, item in zip(texts, result.data):
        assert item.object == "embedding" and len(item.embedding) == 64
        assert cosine(item.embedding, reference(hf_model, tokenizer(text).input_ids)) > 0.9999
    assert result.usage.prompt_tokens == sum(len(tokenizer(t).input_ids) for t in texts)
    assert result.usage.total_tokens == result.usage.prompt_tokens
    assert result.model == "tiny"
    assert_idle(local)


def test_token_inputs_and_float_encoding(client, hf_model):
    ids = [[5, 6, 7, 8, 9], [10, 11]]
    nested = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    single = client.embeddings.create(model="tiny", input=ids[1], encoding_format="float", user="someone")
    for token_ids, item in zip(ids, nested.data):
        assert cosine(item.embedding, reference(hf_model, token_ids)) > 0.9999
    assert np.allclose(single.data[0].embedding, nested.data[1].embedding, atol=1e-5)
    assert nested.usage.prompt_tokens == 7


def test_base64_is_little_endian_float32(http):
    body = {"model": "tiny", "input": "hello world"}
    floats = http.post("/v1/embeddings", json={**body, "encoding_format": "float"}).json()
    encoded = http.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == floats["data"][0]["embedding"]  # exactly: the vector is float32 already


def test_dimensions_truncate_and_renormalize(client):
    full = client.embeddings.create(model="tiny", input="hello world", encoding_format="float").data[0].embedding
    cut = client.embeddings.create(model="tiny", input="hello world", dimensions=8,
                                   encoding_format="float").data[0].embedding
    assert len(cut) == 8
    assert abs(np.linalg.norm(cut) - 1.0) < 1e-5
    assert np.allclose(cut, np.asarray(full[:8]) / np.linalg.norm(full[:8]), atol=1e-5)


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": ["hello", ""]}, "input"),
    ({"input": list(range(1, MAX_MODEL_LEN + 2))}, "input"),  # longer than max_model_len
    ({"input": ["a"] * (MAX_INPUTS + 1)}, "input"),  # too many inputs
    ({"input": [1, -1]}, "input"),
    ({"input": [[1, 2], [10**6]]}, "input"),
    ({"input": [1.5]}, "input"),
    ({"input": "hello", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hello", "dimensions": 0}, "dimensions"),
    ({"input": "hello", "dimensions": 65}, "dimensions"),  # more than the hidden size
])
def test_bad_requests_are_400s_naming_the_field(http, local, body, param):
    response = http.post("/v1/embeddings", json={"model": "tiny", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}"), error["message"]
    assert_idle(local)


def test_openai_client_sees_400(client):
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.embeddings.create(model="tiny", input=list(range(1, MAX_MODEL_LEN + 2)))
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hello")


def test_a_full_context_input_is_accepted(client, hf_model):
    ids = list(range(3, 3 + MAX_MODEL_LEN))
    item = client.embeddings.create(model="tiny", input=ids, encoding_format="float").data[0]
    assert cosine(item.embedding, reference(hf_model, ids)) > 0.9999


def test_models_lists_capabilities(http):
    card = http.get("/v1/models").json()["data"][0]
    assert card["id"] == "tiny"
    assert {"completions", "chat", "embeddings", "tools"} <= set(card["capabilities"])
    assert "auto_tool_choice" not in card["capabilities"]  # started without --enable-auto-tool-choice


def test_embeddings_beside_completions(client, local, hf_model):
    """Generations and embeddings share the engine's batches; each answer is what it is alone."""
    alone = client.completions.create(model="tiny", prompt="a b c", max_tokens=8, temperature=0.0).choices[0].text
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        text = pool.submit(lambda: client.completions.create(model="tiny", prompt="a b c", max_tokens=8,
                                                             temperature=0.0).choices[0].text)
        vectors = [pool.submit(lambda: client.embeddings.create(model="tiny", input=[5, 6, 7, 8, 9],
                                                                encoding_format="float").data[0].embedding)
                   for _ in range(3)]
        assert text.result(timeout=TIMEOUT) == alone
        for future in vectors:
            assert cosine(future.result(timeout=TIMEOUT), reference(hf_model, [5, 6, 7, 8, 9])) > 0.9999
    assert_idle(local)


class RecordingClient(OneIdleEngineClient):
    """An engine client that records what reaches it (nothing should) and answers nothing."""

    def __init__(self) -> None:
        self.requests: list[str] = []

    async def generate(self, request_id, prompt_token_ids, sampling_params, priority=0, final_only=False,
                       cache_salt=None, pooling_params=None):
        self.requests.append(request_id)
        return
        yield


def test_a_lora_adapter_name_is_a_400_not_the_base_models_vector(model, tmp_path):
    """Embeddings come from the base model: naming an adapter is refused (param "model") rather than answered
    with the base model's vector, and the adapter's /v1/models card does not claim embeddings."""
    from starlette.testclient import TestClient

    from pagedserve.cluster.serving.app import build_fastapi_app
    from pagedserve.cluster.serving.core import OpenAIServing
    from pagedserve.cluster.settings import ServeArgs
    from pagedserve.engine.tokenizer import load_tokenizer
    from tests.lora_adapters import make_adapter

    adapter = make_adapter(model, tmp_path / "a", 2, ["q_proj"], seed=5)
    args = ServeArgs(model=str(model), served_model_name="tiny", api_key=None, enable_lora=True, max_lora_rank=8,
                     lora_modules=[f"a={adapter}"])
    engine = RecordingClient()
    app = build_fastapi_app(OpenAIServing(engine, load_tokenizer(str(model)), args, max_model_len=MAX_MODEL_LEN))
    with TestClient(app, raise_server_exceptions=False) as http:
        response = http.post("/v1/embeddings", json={"model": "a", "input": "hello"})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "model" and "base model `tiny`" in error["message"]
        assert http.post("/v1/embeddings", json={"model": "b", "input": "hello"}).status_code == 404
        cards = {card["id"]: card["capabilities"] for card in http.get("/v1/models").json()["data"]}
    assert "embeddings" in cards["tiny"] and "embeddings" not in cards["a"]
    assert "completions" in cards["a"] and "tools" in cards["a"]
    assert engine.requests == []
