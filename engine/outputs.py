"""What users get back: vLLM-compatible `RequestOutput` / `CompletionOutput`, plus the engine core's per-step output."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.request_timeline import RequestTimeline

# A position's logprobs: token id -> Logprob. Sample logprobs are a list of these, one per output token.
SampleLogprobs = list[dict[int, "Logprob"]]
PromptLogprobs = list[dict[int, "Logprob"] | None]


@dataclass(slots=True)  # one per logprob entry of every token: small and quick to build
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    # Prefill chunks and KV pull (engine/request_timeline.py), as of the request's latest output.
    timeline: RequestTimeline | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # Set when the engine failed this request (its completions then have finish_reason "error").
    error: str | None = None
    # Prefill/decode: on a producer's finished output, where a decode engine reads the prompt's KV.
    kv_transfer_params: dict | None = None

    def add(self, later: RequestOutput) -> None:
        """Fold the next DELTA output of the same request into this one, so a consumer that fell behind
        gets one output for several steps: text, tokens and logprobs append per completion index; the
        finish state, cumulative logprob and metrics are the later one's."""
        by_index = {c.index: c for c in self.outputs}
        for c in later.outputs:
            mine = by_index.get(c.index)
            if mine is None:
                self.outputs.append(c)
                by_index[c.index] = c
                continue
            mine.text += c.text
            mine.token_ids = mine.token_ids + c.token_ids
            if c.logprobs is not None:
                mine.logprobs = (mine.logprobs or []) + c.logprobs
            mine.cumulative_logprob = c.cumulative_logprob
            mine.finish_reason = c.finish_reason
            mine.stop_reason = c.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.finished = later.finished
        self.metrics = later.metrics
        self.num_cached_tokens = later.num_cached_tokens
        self.error = later.error or self.error
        self.kv_transfer_params = later.kv_transfer_params or self.kv_transfer_params


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (vLLM's shape: `.outputs.embedding`). Always finished: an embedding request
    reports once, after its prefill. `error` says why it failed (its embedding is then empty)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    num_cached_tokens: int = 0
    error: str | None = None


@dataclass
class EngineCoreOutput:
    """One request's progress in one engine step (tokens are the new ones only)."""

    request_id: str
    new_token_ids: list[int]
    # Per new token: [(token_id, logprob, rank), ...] with the sampled token first; None when not requested.
    new_logprobs: list[list[tuple[int, float, int]]] | None = None
    # Prompt logprobs for the prompt positions computed in this step (position 0 gets None).
    new_prompt_logprobs: list[list[tuple[int, float, int]] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    # With finish_reason "error": what failed (reaches the request's client).
    error: str | None = None
    kv_transfer_params: dict | None = None
    timeline: RequestTimeline | None = None
    # An embedding request's vector (a float32 CPU tensor), with its finishing output.
    pooled: Any = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0  # cumulative
    prefix_cache_queries: int = 0  # cumulative tokens
    prefix_cache_hits: int = 0  # cumulative tokens
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_prompt_tokens: int = 0  # cumulative computed prompt tokens
    num_generation_tokens: int = 0  # cumulative
    num_steps: int = 0  # cumulative engine steps that ran the model
    # Cumulative seconds: inside the model (forward, logits, sampling; device time on CUDA) and whole
    # engine steps (scheduling, inputs, model, outputs, detokenization). 1 - model/step = host share.
    model_seconds: float = 0.0
    step_seconds: float = 0.0
    # KV connector counters (kv_transfer.scheduler_connector.KVTransferStats as a dict); {} without one.
    kv_transfer: dict = field(default_factory=dict)
    # Offload tier counters (kv_transfer.offload.scheduler_side.OffloadStats as a dict); {} without a tier. The
    # figures /metrics sums over engines: tokens looked up in the tier (the device cache lacked them), tokens
    # reloaded from it, bytes spilled to it and bytes loaded back (cumulative).
    kv_offload: dict = field(default_factory=dict)
    kv_offload_query_tokens: int = 0
    kv_offload_hit_tokens: int = 0
    kv_offload_remote_hit_tokens: int = 0
    kv_offload_stored_bytes: int = 0
    kv_offload_loaded_bytes: int = 0
    # Speculative decoding counters (engine.spec_decode.metrics.SpecDecodeStats as a dict); {} without it.
    spec_decoding: dict = field(default_factory=dict)
    # Multi-LoRA (enable_lora): cumulative adapter loads into resident slots, evictions from them, reads
    # from disk, requests per adapter name ({"requests": {name: n}}), and the resident adapters' names.
    lora: dict = field(default_factory=dict)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
