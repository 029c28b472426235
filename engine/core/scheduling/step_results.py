"""A returned step's results landed on its requests: the sampled token appended with the stop checks
(a speculating request's accepted drafts and token through speculation's own landing), the grammar
advanced, prompt logprobs cut to the chunk, an embedding request's vector (it finishes with it), and
one EngineCoreOutput per request with news. Keeps the token counters the stats report."""

from __future__ import annotations

import time

from pagedserve.engine.core.request import Request, RequestStatus
from pagedserve.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.engine.core.scheduling.in_flight import InFlight
from pagedserve.engine.core.stop_conditions import accept_constrained, check_stop
from pagedserve.engine.outputs import EngineCoreOutput
from pagedserve.engine.spec_decode.scheduling import SpecDecodeScheduling


class StepResults:
    def __init__(self, max_model_len: int, in_flight: InFlight, spec: SpecDecodeScheduling) -> None:
        self.max_model_len = max_model_len
        self.in_flight = in_flight
        self.spec = spec
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_steps = 0
        self.model_seconds = 0.0
        self.returned_at = 0.0  # wall clock of the latest step's return (each request's timeline)

    def step_returned(self, runner_output: ModelRunnerOutput) -> None:
        self.returned_at = time.time()
        self.num_steps += 1
        self.model_seconds += runner_output.model_seconds

    def land(self, request: Request, num_tokens: int, so: SchedulerOutput,
             runner_output: ModelRunnerOutput) -> EngineCoreOutput | None:
        """Land the request's part of the step (its `num_tokens` scheduled tokens); None when it brings
        nothing to report (a prompt chunk that samples nothing)."""
        rid = request.request_id
        request.timeline.step_landed(self.returned_at)
        chunk_start = request.num_computed_tokens - num_tokens - self.in_flight.num_tokens(rid)  # (later steps)
        prompt_left = max(0, request.num_prompt_tokens - chunk_start)
        self.num_prompt_tokens += min(num_tokens, prompt_left)
        if request.pooling_params is not None:
            return self._land_pooled(request, runner_output)
        new_token_ids: list[int] = []
        token = runner_output.sampled_token_ids.get(rid)
        error = None
        if rid in so.num_spec_tokens:
            new_token_ids = self.spec.land(request, num_tokens, runner_output, self.max_model_len)
            self.num_generation_tokens += len(new_token_ids)
        elif token is not None:
            request.append_output_token(token)
            new_token_ids.append(token)
            self.num_generation_tokens += 1
            check_stop(request, self.max_model_len)
            if request.structured_output is not None:
                error = accept_constrained(request, token)
        prompt_logprobs = runner_output.prompt_logprobs.get(rid)
        if prompt_logprobs is not None:
            prompt_logprobs = request.take_new_prompt_logprobs(chunk_start, prompt_logprobs)
        if not new_token_ids and prompt_logprobs is None:
            return None
        return EngineCoreOutput(
            request_id=rid,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs(rid, new_token_ids, runner_output),
            new_prompt_logprobs=prompt_logprobs,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
            first_scheduled_time=request.scheduled_time,
            error=error,
            # Its first tokens and its end carry the engine's timeline (prefill chunks, KV pull) out.
            timeline=(request.timeline.snapshot() if request.is_finished
                      or len(request.output_token_ids) == len(new_token_ids) else None),
        )

    @staticmethod
    def _land_pooled(request: Request, runner_output: ModelRunnerOutput) -> EngineCoreOutput | None:
        """An embedding request: nothing to report until its last prefill chunk brings the vector; then
        it is finished (it never decodes)."""
        pooled = runner_output.pooled.get(request.request_id)
        if pooled is None:
            return None
        request.status = RequestStatus.FINISHED_STOPPED
        return EngineCoreOutput(
            request_id=request.request_id, new_token_ids=[], finish_reason=request.status.finish_reason,
            num_cached_tokens=request.num_cached_tokens, num_preemptions=request.num_preemptions,
            first_scheduled_time=request.scheduled_time, pooled=pooled,
        )


def new_logprobs(rid: str, new_token_ids: list[int], runner_output: ModelRunnerOutput) -> list | None:
    """Logprob entries of a step's new tokens (a speculating request has one per emitted token, cut
    where a stop condition cut its tokens); None when the request asked for none."""
    if not new_token_ids:
        return None
    spec = runner_output.spec_logprobs.get(rid)
    if spec is not None:
        return spec[: len(new_token_ids)]
    logprobs = runner_output.logprobs.get(rid)
    return None if logprobs is None else [logprobs]
