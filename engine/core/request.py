"""The scheduler's view of one request: its tokens, progress through the KV cache, and status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.request_timeline import RequestTimeline
from pagedserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.engine.structured_output.manager import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    WAITING = 0
    # Its structured-output grammar is still compiling: the scheduler leaves it out until then.
    WAITING_FOR_GRAMMAR = 1
    RUNNING = 2
    PREEMPTED = 3
    # Everything from here on is finished.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: set[int]
    max_tokens: int  # resolved: params.max_tokens capped by max_model_len - prompt length
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    cache_salt: str | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # An embedding request (resolved: its pooling type set): prefill only, it finishes with its pooled
    # vector and samples nothing (its sampling_params are a placeholder).
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs under (None: the base model)

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first scheduling
    # When the request was first scheduled (metrics).
    scheduled_time: float | None = None
    # Prompt logprob entries already reported (recompute after a preemption must not repeat them).
    num_prompt_logprobs_sent: int = 0
    # The grammar matcher of a request with structured_outputs (set by the scheduler on arrival).
    structured_output: StructuredOutputRequest | None = None
    # KV connector state: the prompt's KV was (to be) loaded from a producer; the load failed, so the
    # prompt is computed here; the kv_transfer_params a producer hands its reader when this finishes.
    kv_load_done: bool = False
    kv_load_failed: bool = False
    kv_transfer_params_out: dict | None = None
    # Prefill chunks and KV pull, timed for traces and overhead metrics (engine/request_timeline.py).
    timeline: RequestTimeline = field(default_factory=RequestTimeline)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Prompt logprobs need the logits of every prompt position, and mean/cls pooling the hidden
        states of every (the first) position, so such a request computes its whole prompt instead of
        reusing cached blocks (its own blocks still enter the cache)."""
        if self.pooling_params is not None and self.pooling_params.needs_every_position:
            return True
        return self.sampling_params.prompt_logprobs is not None

    def take_new_prompt_logprobs(self, chunk_start: int, entries: list) -> list | None:
        """The part of a chunk's prompt logprobs not reported yet, or None if there is none.

        A chunk computed from position `chunk_start` carries the entries of prompt tokens
        chunk_start + 1 onward (token 0 too, as None, when it starts at 0). After a preemption
        the prompt is computed again from the start: entries already reported are dropped.
        """
        first = 0 if chunk_start == 0 else chunk_start + 1
        if first > self.num_prompt_logprobs_sent:
            raise ValueError(
                f"entries: prompt logprobs of request {self.request_id} skip positions "
                f"{self.num_prompt_logprobs_sent}..{first - 1}"
            )
        new = entries[self.num_prompt_logprobs_sent - first :]
        self.num_prompt_logprobs_sent += len(new)
        return new or None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
