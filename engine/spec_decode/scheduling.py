"""Speculative decoding's part of the scheduler: which decodes speculate, with how many drafts, and how
a verified step's tokens land on the request.

A speculating decode is scheduled for 1 + k tokens (its last token and k drafts: budget and KV slots
are reserved for all of them); after the step its `num_computed_tokens` is rewound to the positions
the target verified, so rejected drafts' slots are simply written again by the next step. Prefix-cache
hashes only ever cover a request's verified tokens (the KV cache manager hashes known tokens only).
"""

from __future__ import annotations

from pagedserve.engine.core.request import Request
from pagedserve.engine.core.scheduler_output import ModelRunnerOutput
from pagedserve.engine.core.stop_conditions import check_stop
from pagedserve.engine.spec_decode.config import SpeculativeConfig
from pagedserve.engine.spec_decode.metrics import SpecDecodeStats


class SpecDecodeScheduling:
    def __init__(self, spec: SpeculativeConfig | None) -> None:
        self.k = 0 if spec is None else spec.num_speculative_tokens  # drafts per step (0: off)
        self.disable_batch_size = None if spec is None else spec.disable_by_batch_size
        self.stats = None if spec is None else SpecDecodeStats()

    def drafts_for(self, request: Request, budget: int, num_running: int, max_model_len: int) -> int:
        """Drafts a decode request may verify this step: at most k, within the token budget (its own token
        comes first), and never past max_tokens or max_model_len (every accepted token is emitted); none
        while `num_running` reaches the batch size where speculation stops."""
        if self.k <= 0 or request.num_tokens - request.num_computed_tokens != 1:
            return 0
        if self.disable_batch_size is not None and num_running >= self.disable_batch_size:
            return 0
        if request.structured_output is not None:
            # A grammar would have to advance its matcher over unverified drafts: such requests decode one
            # token per step. Every other sampling parameter is applied at every verified position.
            return 0
        room = min(
            budget - 1,
            request.max_tokens - request.num_output_tokens - 1,
            max_model_len - request.num_tokens - 1,
        )
        return max(0, min(self.k, room))

    def land(self, request: Request, num_scheduled: int, runner_output: ModelRunnerOutput,
             max_model_len: int) -> list[int]:
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
        if self.stats is not None and num_drafts:
            self.stats.observe(num_drafts, len(accepted))
        new_token_ids: list[int] = []
        for t in [*accepted, token]:
            request.append_output_token(t)
            new_token_ids.append(t)
            check_stop(request, max_model_len)
            if request.is_finished:
                break
        return new_token_ids

    def stats_dict(self) -> dict:
        return {} if self.stats is None else self.stats.as_dict()
