"""Response shaping shared by the endpoints: OpenAI logprobs, usage, and SSE framing."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Protocol

from pagedserve.cluster.serving.responses import (
    ChatLogprobs,
    ChatLogprobToken,
    CompletionLogprobs,
    PromptLogprob,
    TopLogprob,
    UsageInfo,
)
from pagedserve.engine.outputs import CompletionOutput, Logprob, PromptLogprobs

# JSON has no -inf: clamp logprobs as vLLM does.
MIN_LOGPROB = -9999.0


class _HasTokenIds(Protocol):
    token_ids: list[int]


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _token_text(entry: Logprob | None, token_id: int, tokenizer) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id])


def _top_entries(position: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
    """The top `num` alternatives at one position, by rank (the sampled token is listed only if it ranks)."""
    ranked = [(tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= num]
    ranked.sort(key=lambda item: item[1].rank)
    return ranked[:num]


def completion_logprobs(output: CompletionOutput, num: int, text_offset: int, tokenizer) -> CompletionLogprobs:
    """OpenAI completions `logprobs` for the tokens of `output` (a delta or a whole output)."""
    result = CompletionLogprobs()
    for token_id, position in zip(output.token_ids, output.logprobs or []):
        sampled = position.get(token_id)
        token = _token_text(sampled, token_id, tokenizer)
        result.tokens.append(token)
        result.token_logprobs.append(_clamp(sampled.logprob) if sampled is not None else MIN_LOGPROB)
        top: dict[str, float] = {}
        for tid, lp in _top_entries(position, num):  # by rank: tokens that decode alike keep the best logprob
            top.setdefault(_token_text(lp, tid, tokenizer), _clamp(lp.logprob))
        result.top_logprobs.append(top if num > 0 else None)
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def chat_logprobs(output: CompletionOutput, num: int, tokenizer) -> ChatLogprobs:
    """OpenAI chat `logprobs.content` for the tokens of `output`."""
    content: list[ChatLogprobToken] = []
    for token_id, position in zip(output.token_ids, output.logprobs or []):
        sampled = position.get(token_id)
        token = _token_text(sampled, token_id, tokenizer)
        top = [
            TopLogprob(token=(t := _token_text(lp, tid, tokenizer)), logprob=_clamp(lp.logprob),
                       bytes=list(t.encode("utf-8", errors="replace")))
            for tid, lp in _top_entries(position, num)
        ]
        content.append(ChatLogprobToken(
            token=token,
            logprob=_clamp(sampled.logprob) if sampled is not None else MIN_LOGPROB,
            bytes=list(token.encode("utf-8", errors="replace")),
            top_logprobs=top,
        ))
    return ChatLogprobs(content=content)


def prompt_logprobs(positions: PromptLogprobs) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: per prompt position (None for the first), token id -> its logprob,
    rank and text (the prompt's own token and the top alternatives)."""
    return [
        None if position is None else {
            str(tid): PromptLogprob(logprob=_clamp(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
            for tid, lp in position.items()
        }
        for position in positions
    ]


def usage(prompts: Sequence[_HasTokenIds], completion_tokens: int) -> UsageInfo:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"
