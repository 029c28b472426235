"""What the scheduler hands the workers each step, and what the workers hand back.

Workers may live in other processes (Ray actors), so a step carries only diffs:
full data for requests a worker has not seen, and for known requests just the new
blocks, the new tokens and how far the cache has been computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_ids: set[int]
    bad_words_token_ids: list[list[int]]
    # An embedding request: the runner pools its prompt's hidden states instead of sampling.
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None


@dataclass
class CachedRequestData:
    req_id: str
    # Tokens appended to the request since the worker last saw it (sampled outputs).
    new_token_ids: list[int]
    new_block_ids: list[int]
    num_computed_tokens: int
    # After a preemption the request's blocks were all freed: new_block_ids replaces the table.
    resumed_from_preemption: bool = False
    # Async scheduling (0 or 1): the step before this one is still running and will sample this request's
    # next input token; the worker appends the token it sampled itself (the scheduler does not know it yet).
    num_placeholder_tokens: int = 0


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # req_id -> number of tokens to compute this step.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests finished or aborted since the last step: workers drop their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Structured output: the requests that sample a constrained token this step, and their token
    # bitmask (a [len(structured_output_req_ids), ceil(vocab / 32)] int32 CPU tensor, row per id).
    structured_output_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None
    # KV connector (prefill/decode disaggregation): the loads and releases the workers do this step
    # (a kv_transfer.scheduler_connector.ConnectorMetadata), or None without a connector.
    kv_connector_metadata: Any = None
    # Speculative decoding: req_id -> how many draft tokens it may verify this step (its
    # num_scheduled_tokens is 1 + that: its last token and the drafts).
    num_spec_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    # Only requests whose scheduled tokens reached the end of their known tokens get a sampled token.
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, list[tuple[int, float, int]]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[list[tuple[int, float, int]] | None]] = field(default_factory=dict)
    # Requests whose own work in this step failed (sampling, logits processing, prompt logprobs) ->
    # the error; the engine finishes them with finish_reason "error", the rest of the batch goes on.
    failed: dict[str, str] = field(default_factory=dict)
    # KV connector: requests whose KV load failed on some rank (they recompute their prompt; their
    # sampled token is discarded), and what this step's loads moved, summed over the ranks.
    kv_load_failed: set[str] = field(default_factory=set)
    kv_loaded_bytes: int = 0
    kv_load_seconds: float = 0.0
    # Multi-LoRA: the driver's cumulative adapter counters (loads, evictions, disk_loads) and resident names.
    lora_stats: dict | None = None
    # Time this step spent in the model (forward, logits, sampling), for the host-overhead share:
    # wall time on CPU, device time (CUDA events) on a GPU.
    model_seconds: float = 0.0
    # Speculative decoding: the drafts each speculating request had accepted (its emitted tokens are these
    # followed by its sampled_token_ids entry) and how many drafts it proposed.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    # ... and, when it asked for logprobs, one entry list per emitted token (accepted drafts, then the token).
    spec_logprobs: dict[str, list[list[tuple[int, float, int]]]] = field(default_factory=dict)
    # Embedding requests whose prefill ended this step -> their pooled vector (a float32 CPU tensor).
    pooled: dict[str, Any] = field(default_factory=dict)
