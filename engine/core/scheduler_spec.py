"""The scheduler's side of speculative decoding (mixed into `Scheduler`): how many drafts a decode
verifies this step, and landing a verified step's tokens on the request with the same stop checks,
token by token, as one-token steps would make."""

from __future__ import annotations

from pagedserve.engine.core.request import Request
from pagedserve.engine.core.scheduler_output import ModelRunnerOutput
from pagedserve.engine.core.stop_conditions import check_stop
from pagedserve.engine.spec_decode.metrics import SpecDecodeStats
from pagedserve.engine.spec_decode.scheduling import num_spec_tokens


class SpecDecodeSchedulingMixin:
    running: list[Request]
    max_model_len: int
    num_generation_tokens: int
    # Set by Scheduler.__init__: drafts per step (0 = off), the batch size where speculation stops, counters.
    spec_k: int
    spec_disable_batch_size: int | None
    spec_stats: SpecDecodeStats | None

    def _spec_tokens_for(self, request: Request, budget: int) -> int:
        if not self.spec_k:
            return 0
        if self.spec_disable_batch_size is not None and len(self.running) >= self.spec_disable_batch_size:
            return 0
        return num_spec_tokens(request, self.spec_k, budget, self.max_model_len)

    @staticmethod
    def _new_logprobs(rid: str, new_token_ids: list[int], runner_output: ModelRunnerOutput) -> list | None:
        """Logprob entries of a step's new tokens (a speculating request has one per emitted token, cut
        where a stop condition cut its tokens); None when the request asked for none."""
        if not new_token_ids:
            return None
        spec = runner_output.spec_logprobs.get(rid)
        if spec is not None:
            return spec[: len(new_token_ids)]
        logprobs = runner_output.logprobs.get(rid)
        return None if logprobs is None else [logprobs]

    def _land_spec_tokens(self, request: Request, num_scheduled: int, runner_output: ModelRunnerOutput) -> list[int]:
        """A speculating request's step: rewind its computed positions to the verified ones, then append
        the accepted drafts and the target's token one at a time, stopping where a stop condition hits
        (the tokens after it are dropped, as if they had never been sampled). Returns the new tokens."""
        rid = request.request_id
        accepted = runner_output.spec_token_ids.get(rid, [])
        token = runner_output.sampled_token_ids.get(rid)
        start = request.num_computed_tokens - num_scheduled
        request.num_computed_tokens = start + 1 + (len(accepted) if token is not None else 0)
        if token is None:
            return []
        num_drafts = runner_output.num_draft_tokens.get(rid, 0)
        if self.spec_stats is not None and num_drafts:
            self.spec_stats.observe(num_drafts, len(accepted))
        new_token_ids: list[int] = []
        for t in [*accepted, token]:
            request.append_output_token(t)
            new_token_ids.append(t)
            self.num_generation_tokens += 1
            check_stop(request, self.max_model_len)
            if request.is_finished:
                break
        return new_token_ids
