"""`POST /tokenize` and `POST /detokenize` (vLLM's extensions)."""

from __future__ import annotations

from pagedserve.cluster.serving.core import OpenAIServing
from pagedserve.cluster.serving.errors import APIError, bad_request
from pagedserve.cluster.serving.requests import DetokenizeRequest, TokenizeRequest
from pagedserve.cluster.serving.responses import DetokenizeResponse, TokenizeResponse


def tokenize(serving: OpenAIServing, request: TokenizeRequest) -> TokenizeResponse:
    serving.check_model(request.model)
    if request.prompt is not None:
        ids = list(serving.tokenizer(request.prompt, add_special_tokens=request.add_special_tokens).input_ids)
    else:
        try:
            conversation = [{"role": m.role, "content": m.text()} for m in request.messages or []]
        except ValueError as exc:
            raise bad_request(exc) from None
        ids = serving.encode_chat(conversation, None, request.add_generation_prompt)
    return TokenizeResponse(count=len(ids), max_model_len=serving.max_model_len, tokens=ids)


def detokenize(serving: OpenAIServing, request: DetokenizeRequest) -> DetokenizeResponse:
    serving.check_model(request.model)
    vocab = len(serving.tokenizer)
    bad = [t for t in request.tokens if t < 0 or t >= vocab]
    if bad:
        raise APIError(400, f"tokens: token id {bad[0]} is out of vocabulary (size {vocab})", param="tokens")
    return DetokenizeResponse(prompt=serving.tokenizer.decode(request.tokens))
