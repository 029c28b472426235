"""A step's SchedulerOutput, as the difference from what the workers already know.

Workers may live in other processes, so a step sends a request's whole state only the first time
(NewRequestData) and afterwards what changed (CachedRequestData: new tokens, new blocks, or a fresh
block table after a preemption), plus the ids of requests finished since the last step that reached
the workers, and the grammar bitmask of the constrained rows that sample this step. The builder keeps
its own record of what each request's workers have been sent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedserve.engine.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.engine.core.scheduling.in_flight import InFlight
from pagedserve.engine.core.scheduling.step_budget import StepBudget

if TYPE_CHECKING:
    from pagedserve.engine.structured_output.manager import StructuredOutputManager


class SchedulerOutputBuilder:
    def __init__(self, kv_cache_manager: KVCacheManager, in_flight: InFlight,
                 structured_output: Callable[[], StructuredOutputManager] | None) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.in_flight = in_flight
        self.structured_output = structured_output
        # Per request, as last sent to the workers: its tokens (placeholders included), its block count,
        # its preemption count.
        self._num_tokens_sent: dict[str, int] = {}
        self._block_counts: dict[str, int] = {}
        self._preemptions_sent: dict[str, int] = {}
        # Requests finished since the last output that reached the workers: they drop their state.
        self._finished_req_ids: set[str] = set()

    def forget(self, request_id: str) -> None:
        """A finished request: the next step tells the workers."""
        self._num_tokens_sent.pop(request_id, None)
        self._block_counts.pop(request_id, None)
        self._preemptions_sent.pop(request_id, None)
        self._finished_req_ids.add(request_id)

    def build(self, step: StepBudget) -> SchedulerOutput:
        """The output of a planned step (before its tokens count as computed)."""
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        for request in step.scheduled:
            rid = request.request_id
            block_ids = self.kv_cache_manager.get_block_ids(rid)
            sent, ahead = self._num_tokens_sent.get(rid), self.in_flight.tokens_ahead(request)
            if sent is None:
                new_reqs.append(
                    NewRequestData(
                        req_id=rid,
                        prompt_token_ids=request.prompt_token_ids,
                        output_token_ids=list(request.output_token_ids),
                        sampling_params=request.sampling_params,
                        block_ids=list(block_ids),
                        num_computed_tokens=request.num_computed_tokens,
                        eos_token_ids=request.eos_token_ids,
                        bad_words_token_ids=request.bad_words_token_ids,
                        pooling_params=request.pooling_params,
                        lora_request=request.lora_request,
                    )
                )
            else:
                resumed = request.num_preemptions > self._preemptions_sent.get(rid, 0)
                known = 0 if resumed else self._block_counts[rid]
                cached_reqs.append(
                    CachedRequestData(
                        req_id=rid,
                        new_token_ids=request.all_token_ids[sent:],
                        new_block_ids=list(block_ids[known:]),
                        num_computed_tokens=request.num_computed_tokens,
                        resumed_from_preemption=resumed,
                        num_placeholder_tokens=ahead - request.num_tokens,
                    )
                )
            self._block_counts[rid] = len(block_ids)
            self._num_tokens_sent[rid] = ahead
            self._preemptions_sent[rid] = request.num_preemptions

        num_scheduled = step.num_scheduled
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=set(self._finished_req_ids),
            num_spec_tokens=step.spec_tokens,
        )
        # Constrained rows that sample this step (not partial prefills) get their bitmask.
        constrained = [
            r for r in step.scheduled
            if r.structured_output is not None and r.num_computed_tokens + num_scheduled[r.request_id] == r.num_tokens
        ]
        if constrained:
            output.structured_output_req_ids = [r.request_id for r in constrained]
            output.grammar_bitmask = self.structured_output().fill_bitmask([r.structured_output for r in constrained])
        if step.scheduled:  # an empty output may never reach the workers (pipeline mode): resend the ids
            self._finished_req_ids = set()
        return output
