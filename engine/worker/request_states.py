"""The model runner's mirror of the scheduler's requests, updated from each step's diff.

Per request: its tokens (prompt + outputs known so far), its sampling state, whether it asked for
prompt logprobs or is an embedding request (pooled, never sampled), its row in the persistent input batch, and (with a speculator) the draft model's view
of its cache. A worker in another process sees exactly what an in-process one does: everything here
comes from the SchedulerOutput.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.engine.core.scheduler_output import SchedulerOutput
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.sample.sampler import Sampler, SamplingState
from pagedserve.engine.worker.input_batch import InputBatch

if TYPE_CHECKING:
    from pagedserve.engine.worker.speculator import Speculator


@dataclass
class RunnerRequestState:
    req_id: str
    num_prompt_tokens: int
    token_ids: list[int]  # prompt + outputs known so far (mirrored in the input batch's row)
    sampling: SamplingState
    prompt_logprobs: int | None
    # Async scheduling: the token this runner sampled last, the input of a step scheduled before it landed.
    last_sampled_token_id: int | None = None
    # An embedding request: pooled after its prefill, never sampled.
    pooling: PoolingParams | None = None


class RequestStates:
    def __init__(self, input_batch: InputBatch, sampler: Sampler) -> None:
        self.input_batch = input_batch
        self.sampler = sampler
        self.requests: dict[str, RunnerRequestState] = {}
        self.prompt_logprob_reqs: set[str] = set()  # requests that asked for prompt logprobs
        self.pooling_reqs: set[str] = set()  # embedding requests

    def update(self, so: SchedulerOutput, speculator: Speculator | None) -> None:
        """Forget the finished requests, add the new ones, and apply the cached ones' new tokens
        (placeholders under async scheduling), blocks and computed counts."""
        kv_md = so.kv_connector_metadata
        loaded_from = {job.req_id: job.token_start for job in kv_md.loads} if kv_md is not None else {}
        for req_id in so.finished_req_ids:
            finished = self.requests.pop(req_id, None)
            if finished is not None:
                self.sampler.release(finished.sampling)  # frees its persistent sampling rows
            self.input_batch.remove_request(req_id)
            self.prompt_logprob_reqs.discard(req_id)
            self.pooling_reqs.discard(req_id)
            if speculator is not None:
                speculator.request_finished(req_id)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            output_ids = list(new.output_token_ids)
            self.requests[new.req_id] = RunnerRequestState(
                req_id=new.req_id,
                num_prompt_tokens=len(new.prompt_token_ids),
                token_ids=list(new.prompt_token_ids) + output_ids,
                sampling=SamplingState(
                    params=params,
                    prompt_token_ids=list(new.prompt_token_ids),
                    output_token_ids=output_ids,
                    bad_words_token_ids=new.bad_words_token_ids,
                    eos_token_ids=set(new.eos_token_ids),
                    request_id=new.req_id,
                    # Output tokens a new request arrives with were sampled by a prefill engine.
                    pending_draws=len(output_ids) if params.seed is not None and not params.greedy else 0,
                ),
                prompt_logprobs=params.prompt_logprobs,
                pooling=new.pooling_params,
            )
            self.input_batch.add_request(new.req_id, self.requests[new.req_id].token_ids, new.block_ids,
                                         new.num_computed_tokens)
            if params.prompt_logprobs is not None:
                self.prompt_logprob_reqs.add(new.req_id)
            if new.pooling_params is not None:
                self.pooling_reqs.add(new.req_id)
            if speculator is not None:
                # KV a connector loads for the target was never computed by the draft: it catches up from there.
                speculator.request_added(new.req_id, loaded_from.get(new.req_id, new.num_computed_tokens))
        grown_ids: list[str] = []  # cached requests with new tokens, and those tokens
        grown_tokens: list[list[int]] = []
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            known = len(state.token_ids)
            if cached.new_token_ids:
                state.token_ids.extend(cached.new_token_ids)
                state.sampling.output_token_ids.extend(cached.new_token_ids)
            if cached.num_placeholder_tokens:  # (None if that sample failed: the request ends, this step is dropped)
                token = 0 if state.last_sampled_token_id is None else state.last_sampled_token_id
                state.token_ids.append(token)
                state.sampling.output_token_ids.append(token)
            if len(state.token_ids) > known:
                grown_ids.append(cached.req_id)
                grown_tokens.append(state.token_ids[known:])
            if cached.new_block_ids or cached.resumed_from_preemption:
                self.input_batch.update_blocks(cached.req_id, cached.new_block_ids,
                                               replace=cached.resumed_from_preemption)
            if speculator is not None:
                speculator.request_updated(cached.req_id, cached.num_computed_tokens,
                                           cached.resumed_from_preemption)
        cached_reqs = so.scheduled_cached_reqs
        self.input_batch.append_tokens_many(grown_ids, grown_tokens)
        self.input_batch.set_num_computed([c.req_id for c in cached_reqs], (c.num_computed_tokens for c in cached_reqs))
