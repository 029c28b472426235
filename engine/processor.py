"""Input processing: validate and tokenize a prompt, resolve its limits, and build a `Request`.

Everything a request can get wrong is caught here, before it reaches the scheduler,
with a ValueError that names the field: token ids (prompt, logit_bias, stop_token_ids,
allowed_token_ids, bad_words as tokenized) in [0, vocab_size); logprobs and
prompt_logprobs <= max_logprobs; priority in [-2**63, 2**63 - 1]; a prompt shorter than
max_model_len; and an explicitly set max_tokens with prompt + max_tokens <= max_model_len
(the default max_tokens is capped to the room left instead, as the OpenAI server does).

A prompt dict may carry `cache_salt` (vLLM's prompt field): a string of 1 to CACHE_SALT_MAX_CHARS
characters mixed into the hash of the prompt's first KV block, so that requests share prefix-cache
blocks only with requests of the same salt (one tenant's cached prefix cannot be probed through
another's time to first token).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Union

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.request import Request
from pagedserve.engine.lora.adapter import check_adapter
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.kv_transfer.params import continuation_token_ids
from pagedserve.engine.sampling_params import (
    MAX_BAD_WORDS_TOKENS,
    SamplingParams,
    bad_words_token_ids,
    check_token_ids,
)

# A prompt: text, or a dict with "prompt_token_ids" (or "prompt"), and optionally "cache_salt".
PromptType = Union[str, Mapping[str, Any]]

PRIORITY_MIN = -(2**63)
PRIORITY_MAX = 2**63 - 1
CACHE_SALT_MAX_CHARS = 256


def cache_salt_of(prompt: PromptType) -> str | None:
    """The prompt's `cache_salt` (None when it has none), validated."""
    if not isinstance(prompt, Mapping) or prompt.get("cache_salt") is None:
        return None
    salt = prompt["cache_salt"]
    if not isinstance(salt, str):
        raise ValueError(f"cache_salt: expected a string, got {type(salt).__name__}")
    if not 1 <= len(salt) <= CACHE_SALT_MAX_CHARS:
        raise ValueError(f"cache_salt: expected 1 to {CACHE_SALT_MAX_CHARS} characters, got {len(salt)}")
    return salt


def eos_token_ids_of(model_path: str, hf_config, tokenizer) -> set[int]:
    """EOS ids from generation_config.json (int or list), the model config, and the tokenizer."""
    ids: set[int] = set()
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(model_path)
        candidates = [gen.eos_token_id]
    except (OSError, ValueError):
        candidates = []
    candidates += [getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    for value in candidates:
        if value is None:
            continue
        ids.update(value if isinstance(value, (list, tuple)) else [value])
    return ids


class Processor:
    def __init__(self, config: EngineConfig, tokenizer, kv_cache_capacity_tokens: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.kv_cache_capacity_tokens = kv_cache_capacity_tokens
        self.vocab_size = config.hf_config.vocab_size
        self.eos_token_ids = eos_token_ids_of(config.model, config.hf_config, tokenizer)
        self.adapters: dict[int, LoRARequest] = {}  # adapters checked against the base model, by id

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """A request's adapter must fit the base model and max_lora_rank (checked once per adapter id, from
        its config and safetensors header), and one id names one adapter."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request: expected a LoRARequest, got {type(lora_request).__name__}")
        if not self.config.enable_lora:
            raise ValueError("lora_request: this engine was started without enable_lora")
        known = self.adapters.get(lora_request.lora_int_id)
        if known is not None:
            if known != lora_request:
                raise ValueError(f"lora_request.lora_int_id: {lora_request.lora_int_id} already names adapter "
                                 f"{known.lora_name!r} at {known.lora_path!r}")
            return
        check_adapter(lora_request.lora_path, self.config.hf_config, self.config.max_lora_rank)
        self.adapters[lora_request.lora_int_id] = lora_request

    def forget_lora(self, lora_int_id: int) -> None:
        """An unloaded adapter's id: a later request under it is checked again."""
        self.adapters.pop(lora_int_id, None)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError("prompt_token_ids: must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self.tokenizer(prompt["prompt"]).input_ids
        raise ValueError("prompt: expected a string or a dict with 'prompt_token_ids' or 'prompt'")

    def validate_prompt_ids(self, ids: list[int], generates: bool = True) -> None:
        """`generates`: room for at least one generated token must be left (not for an embedding)."""
        if not ids:
            raise ValueError("prompt: the prompt is empty")
        bad = [t for t in ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: token id {bad[0]} is out of vocabulary (size {self.vocab_size})")
        max_len = self.config.max_model_len
        if len(ids) + int(generates) > max_len:
            raise ValueError(
                f"prompt: the prompt has {len(ids)} tokens, but max_model_len is {max_len}"
                + (" (the prompt and at least one generated token must fit)" if generates else "")
            )
        if len(ids) + int(generates) > self.kv_cache_capacity_tokens:
            raise ValueError(
                f"prompt: the prompt has {len(ids)} tokens, more than the whole KV cache holds "
                f"({self.kv_cache_capacity_tokens} tokens); raise kv_cache_memory"
            )

    def validate_params(self, params: SamplingParams) -> None:
        limit = self.config.max_logprobs
        if params.logprobs is not None and params.logprobs > limit:
            raise ValueError(f"logprobs: at most {limit} are allowed, got {params.logprobs}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > limit:
            raise ValueError(f"prompt_logprobs: at most {limit} are allowed, got {params.prompt_logprobs}")
        params.verify_vocab(self.vocab_size)
        if params.structured_outputs is not None:
            from pagedserve.engine.structured_output.grammar import check_spec  # xgrammar loads lazily

            check_spec(params.structured_outputs)

    def resolve_max_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> int:
        """Output tokens the request may generate: max_tokens if set by the caller (refused when the
        prompt and it exceed max_model_len), else the room left (None, or the default, capped)."""
        max_len = self.config.max_model_len
        room = max_len - num_prompt_tokens
        if params.max_tokens is None:
            return room
        if "max_tokens" in params.model_fields_set and params.max_tokens > room:
            raise ValueError(
                f"max_tokens: the model's maximum context length is {max_len} tokens; the request needs "
                f"{num_prompt_tokens + params.max_tokens} ({num_prompt_tokens} in the prompt, "
                f"{params.max_tokens} for the completion)"
            )
        return min(params.max_tokens, room)

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        bad_words_ids: list[list[int]] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> tuple[str | None, Request]:
        """`bad_words_ids`: `params.bad_words` already tokenized (`bad_words_token_ids`), e.g. off the
        engine thread by `AsyncLLM`; else they are tokenized here."""
        if not isinstance(params, (SamplingParams, PoolingParams)):
            raise ValueError("sampling_params: expected a SamplingParams (or PoolingParams for an embedding)")
        if isinstance(priority, bool) or not isinstance(priority, int) or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            raise ValueError(f"priority: expected an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError("priority: set scheduling_policy='priority' to use request priorities")
        cache_salt = cache_salt_of(prompt)
        self.check_lora(lora_request)
        text, ids = self.tokenize_prompt(prompt)
        if isinstance(params, PoolingParams):
            return text, self._pooling_request(request_id, ids, params, priority, arrival_time, cache_salt)
        self.validate_prompt_ids(ids)
        self.validate_params(params)
        max_tokens = self.resolve_max_tokens(params, len(ids))
        if bad_words_ids is None:
            bad_words_ids = bad_words_token_ids(params.bad_words, self.tokenizer) if params.bad_words else []
        elif sum(len(word) for word in bad_words_ids) > MAX_BAD_WORDS_TOKENS:
            raise ValueError(f"bad_words: they encode to more than {MAX_BAD_WORDS_TOKENS} tokens in all")
        # The tokenizer may know more tokens than the model's vocabulary (added tokens).
        check_token_ids("bad_words", [t for word in bad_words_ids for t in word], self.vocab_size)
        request = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=max_tokens,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            cache_salt=cache_salt,
            bad_words_token_ids=bad_words_ids,
            lora_request=lora_request,
        )
        for token_id in self._continuation(params, max_tokens):
            request.append_output_token(token_id)
        return text, request

    def _pooling_request(self, request_id: str, ids: list[int], params: PoolingParams, priority: int,
                         arrival_time: float | None, cache_salt: str | None) -> Request:
        """An embedding request: its prompt may fill max_model_len (nothing is generated); its pooling
        resolved against the engine's defaults; a placeholder SamplingParams (it never samples)."""
        self.validate_prompt_ids(ids, generates=False)
        resolved = params.resolved(self.config.pooling, self.config.normalize_embeddings,
                                   int(self.config.hf_config.hidden_size))
        return Request(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling_params=SamplingParams(max_tokens=1),
            eos_token_ids=set(),
            max_tokens=1,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            cache_salt=cache_salt,
            pooling_params=resolved,
        )

    def _continuation(self, params: SamplingParams, max_tokens: int) -> list[int]:
        """The output tokens a request starts with, validated: a prefill/decode continuation's first
        tokens (already sent to the client by the prefill) or a resumed request's (already emitted by
        the engine it migrates from, `resume_output_token_ids`: engine/resume.py)."""
        remote = continuation_token_ids(params.kv_transfer_params)
        resumed = params.resume_output_token_ids or []
        if remote and resumed:
            raise ValueError("resume_output_token_ids: a resumed request cannot also continue a prefill "
                             "(kv_transfer_params.continue_remote_output)")
        if remote:
            where, tokens = "kv_transfer_params.continue_remote_output", remote
            if params.n != 1:
                raise ValueError(f"{where}: a continuation carries one completion's tokens; n must be 1")
            check_token_ids("kv_transfer_params.remote_output_token_ids", tokens, self.vocab_size)
        elif resumed:
            where, tokens = "resume_output_token_ids", resumed
            check_token_ids(where, tokens, self.vocab_size)
        else:
            return []
        if len(tokens) >= max_tokens:
            raise ValueError(f"{where}: the {len(tokens)} output tokens already generated leave no room under "
                             f"max_tokens {max_tokens}")
        return tokens
