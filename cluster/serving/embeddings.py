"""`POST /v1/embeddings`: embeddings from the served decoder model, in OpenAI's shape.

Each input is one engine request with pooling params (`EngineClient.generate(..., pooling_params=)`):
a prefill-only request in the engines' continuous batch, routed like any prompt (data parallelism,
prefix affinity). `encoding_format` "base64" is the vector's little-endian float32 bytes (what the
official client asks for by default and decodes); `dimensions` keeps the first that many components
and renormalizes (the engine refuses more than the model's hidden size).
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field, StrictInt, StrictStr

from pagedserve.cluster.serving.core import OpenAIServing
from pagedserve.cluster.serving.errors import APIError, engine_error
from pagedserve.cluster.serving.requests import OpenAIRequest
from pagedserve.cluster.serving.streams import RequestFailedError
from pagedserve.engine.outputs import EmbeddingRequestOutput


class EmbeddingRequest(OpenAIRequest):
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list: each a text or a token-id list (400 for an empty input or list)."""
        value = self.input
        single = isinstance(value, str) or bool(value) and isinstance(value[0], int)
        if not single and not value:
            raise APIError(400, "input: the input list is empty", param="input")
        items: list = [value] if single else list(value)
        for i, item in enumerate(items):
            if len(item) == 0:
                where = "the input" if single else f"input[{i}]"
                raise APIError(400, f"input: {where} is empty", param="input")
        return items


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def tokenize_input(serving: OpenAIServing, item: str | list[int]) -> list[int]:
    """A text's token ids (off the event loop), or token ids checked against the vocabulary; either way no
    longer than max_model_len (an embedding generates nothing: the whole context is the input's)."""
    if isinstance(item, str):
        ids = await serving.run_blocking(lambda: list(serving.tokenizer(item).input_ids))
        if not ids:
            raise APIError(400, "input: the input encodes to no tokens", param="input")
    else:
        ids = item
        bad = [t for t in ids if not 0 <= t < serving.vocab_size]
        if bad:
            raise APIError(400, f"input: token id {bad[0]} is outside the vocabulary (size {serving.vocab_size})",
                           param="input")
    if len(ids) > serving.max_model_len:
        raise APIError(400, f"input: this model's maximum context length is {serving.max_model_len} tokens, but "
                            f"the input has {len(ids)} tokens", param="input", code="context_length_exceeded")
    return ids


async def embed_one(serving: OpenAIServing, request_id: str, ids: list[int], params: dict) -> EmbeddingRequestOutput:
    """One input's engine request: its one finished output (closing the stream early aborts it)."""
    final = None
    async for output in serving.client.generate(request_id, ids, {}, pooling_params=params):
        final = output
    if final is None:
        raise APIError(500, "the engine returned no output", type="internal_server_error")
    if final.error is not None:
        raise RequestFailedError(final.error)
    return final


def check_embedding_model(serving: OpenAIServing, model: str | None) -> None:
    """Embeddings come from the base model: a LoRA adapter's name is a 400 rather than the base model's
    vector under the adapter's name (404 for a name nobody serves)."""
    lora = serving.lora.resolve(model)
    if lora is not None:
        raise APIError(400, f"model: embeddings are computed by the base model `{serving.model_name}`; the LoRA "
                            f"adapter `{lora.lora_name}` serves completions and chat only", param="model")


async def create_embedding(serving: OpenAIServing, request: EmbeddingRequest) -> dict:
    check_embedding_model(serving, request.model)
    items = request.inputs()
    limit = serving.args.max_prompts_per_request
    if len(items) > limit:
        raise APIError(400, f"input: at most {limit} inputs per request are allowed, got {len(items)}", param="input")
    token_ids = [await tokenize_input(serving, item) for item in items]
    params = {"dimensions": request.dimensions} if request.dimensions is not None else {}
    request_id = f"embd-{uuid.uuid4().hex}"
    serving.admit(len(items))
    tasks = [asyncio.ensure_future(embed_one(serving, f"{request_id}-{i}", ids, params))
             for i, ids in enumerate(token_ids)]
    try:
        outputs = await asyncio.gather(*tasks)
    except BaseException as exc:
        for task in tasks:  # one failed (or the client left): the others' engine requests are aborted
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            raise
        raise engine_error(exc) from None
    finally:
        serving.release(len(items))
    num_tokens = sum(len(ids) for ids in token_ids)
    data = [EmbeddingData(index=i, embedding=encode_vector(out.outputs.embedding, request.encoding_format))
            for i, out in enumerate(outputs)]
    return EmbeddingResponse(data=data, model=serving.model_name,
                             usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)).model_dump()
