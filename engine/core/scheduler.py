"""Continuous batching with chunked prefill, FCFS/priority, and preemption by recompute.

Each step has a token budget (`max_num_batched_tokens`) and a sequence cap
(`max_num_seqs`). Running requests are scheduled first (decodes and the rest of
chunked prefills), then waiting requests fill what is left. There are no phases:
a request simply has `num_tokens - num_computed_tokens` tokens to compute, and the
scheduler hands out as many as fit. When the KV cache runs out of blocks, the
lowest-priority running request (FCFS: the newest) is preempted: its blocks are
freed and it goes back to the waiting queue to be recomputed later.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.outputs import EngineCoreOutput, SchedulerStats
from pagedserve.engine.core.request import Request, RequestStatus
from pagedserve.engine.core.scheduler_async import AsyncSchedulingMixin
from pagedserve.engine.core.scheduler_kv import KVTransferSchedulingMixin
from pagedserve.engine.core.scheduler_spec import SpecDecodeSchedulingMixin
from pagedserve.engine.core.request_queue import RequestQueue, create_request_queue
from pagedserve.engine.core.stop_conditions import accept_constrained, check_stop
from pagedserve.engine.core.scheduler_output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagedserve.engine.spec_decode.metrics import SpecDecodeStats
from pagedserve.kv_transfer.base import KVConnectorScheduler

if TYPE_CHECKING:
    from pagedserve.engine.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler(KVTransferSchedulingMixin, SpecDecodeSchedulingMixin, AsyncSchedulingMixin):
    def __init__(
        self,
        config: EngineConfig,
        kv_cache_manager: KVCacheManager,
        kv_connector: KVConnectorScheduler | None = None,
        structured_output: Callable[[], StructuredOutputManager] | None = None,
    ) -> None:
        assert config.max_model_len is not None and config.max_num_batched_tokens is not None, "resolve() the config"
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.policy = config.scheduling_policy
        self.kv_cache_manager = kv_cache_manager
        self.kv_connector = kv_connector
        # Returns the engine's structured-output manager (made on first use: xgrammar loads lazily).
        self._structured_output = structured_output
        # Requests whose grammar is still compiling (WAITING_FOR_GRAMMAR), in arrival order, and
        # requests whose compile failed or timed out (the engine core finishes them with "error").
        self._waiting_for_grammar: dict[str, Request] = {}
        self._grammar_failures: dict[str, str] = {}

        self.requests: dict[str, Request] = {}
        # The policy lives in the queue: serving order, where preempted requests go, who is preempted.
        self.waiting: RequestQueue = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Requests finished since the last schedule(): the workers drop their state.
        self._finished_req_ids: set[str] = set()
        # How many of each request's tokens the workers have been sent.
        self._num_tokens_sent: dict[str, int] = {}
        # Requests in a batch whose output has not come back yet (pipeline parallelism, async scheduling).
        self._init_in_flight(config)
        # Per request: block count and preemption count as last sent to the workers.
        self._block_counts: dict[str, int] = {}
        self._preemptions_sent: dict[str, int] = {}
        # Requests finished because they can never fit in the cache; reported with the next outputs.
        self._unfittable: list[Request] = []

        spec = config.speculative
        self.spec_k = 0 if spec is None else spec.num_speculative_tokens
        self.spec_disable_batch_size = None if spec is None else spec.disable_by_batch_size
        self.spec_stats = None if spec is None else SpecDecodeStats()

        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_steps = 0
        self.model_seconds = 0.0

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if self.kv_connector is not None:
            self.kv_connector.request_added(request)
        constraint = request.sampling_params.structured_outputs
        if constraint is not None and request.structured_output is None:
            if self._structured_output is None:
                raise ValueError("structured_outputs: this engine has no structured-output manager")
            request.structured_output = self._structured_output().new_request(constraint, request.eos_token_ids)
        if request.structured_output is not None and not request.structured_output.is_ready:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self._waiting_for_grammar[request.request_id] = request
            return
        self.waiting.add(request)

    def _admit_grammar_ready(self) -> None:
        """Move requests whose grammar has compiled into the waiting queue; record failed ones. An
        engine with nothing else to do waits briefly for a compile here instead of spinning."""
        if not self._waiting_for_grammar:
            return
        manager = self._structured_output()
        if not self.running and not len(self.waiting) and not self._in_flight:
            manager.wait_any([r.structured_output for r in self._waiting_for_grammar.values()], 0.05)
        now = time.monotonic()
        for rid, request in list(self._waiting_for_grammar.items()):
            if rid in self._grammar_failures:
                continue
            error = request.structured_output.poll(now, manager.compile_timeout)
            if error is not None:
                self._grammar_failures[rid] = error
            elif request.structured_output.is_ready:
                del self._waiting_for_grammar[rid]
                request.status = RequestStatus.WAITING
                self.waiting.add(request)

    def take_grammar_failures(self) -> dict[str, str]:
        """Requests whose grammar failed to compile since the last call -> why."""
        failures, self._grammar_failures = self._grammar_failures, {}
        return failures

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Abort (or stop, e.g. on a stop string) requests wherever they are; frees their blocks.

        Takes many ids at once (a mass disconnect): the work is O(1) per waiting request and one pass
        over the running list only when a running request is among them, never O(waiting queue).
        """
        if not status.is_finished:
            raise ValueError(f"status: {status.name} is not a finished status")
        finished = [self.requests[rid] for rid in dict.fromkeys(request_ids) if rid in self.requests]
        if not finished:
            return []
        running = {r for r in finished if r.status == RequestStatus.RUNNING}
        if running:
            self.running = [r for r in self.running if r not in running]
        self.waiting.remove(r for r in finished if r.status != RequestStatus.RUNNING)
        for request in finished:
            self._waiting_for_grammar.pop(request.request_id, None)
            request.status = status
            self._free_request(request)
        return finished

    def _free_request(self, request: Request) -> None:
        keep_blocks = False
        if self.kv_connector is not None:
            keep_blocks = self.kv_connector.request_finished(
                request, self.kv_cache_manager.get_block_ids(request.request_id)
            )
        if not keep_blocks:
            self._free_blocks(request)
        del self.requests[request.request_id]
        self._num_tokens_sent.pop(request.request_id, None)
        self._block_counts.pop(request.request_id, None)
        self._preemptions_sent.pop(request.request_id, None)
        self._finished_req_ids.add(request.request_id)

    def has_unfinished_requests(self) -> bool:
        # A pending KV release rides on the next step's metadata, so it counts as work.
        return bool(self.requests) or (self.kv_connector is not None and self.kv_connector.has_pending_releases)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> SchedulerOutput:
        self.free_released_kv()
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        spec_tokens: dict[str, int] = {}  # speculating decodes -> drafts they may verify
        scheduled: list[Request] = []
        preempted_this_step = False
        self._admit_grammar_ready()
        now = time.time()

        # 1. Running requests: decodes and the remaining chunks of partial prefills.
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING or self._held_in_flight(request):
                continue  # preempted earlier in this loop, or its previous batch is still in flight
            num_new = min(self._tokens_ahead(request) - request.num_computed_tokens, budget)
            num_drafts = self._spec_tokens_for(request, budget)
            num_new += num_drafts
            while self.kv_cache_manager.allocate_slots(request, num_new) is None:
                if num_drafts:  # no room for the drafts' slots: decode plainly before preempting anyone
                    num_new, num_drafts = num_new - num_drafts, 0
                    continue
                victim = self._choose_victim()
                if victim is None:  # everything else is in flight (pipeline): retry next step
                    break
                if victim.request_id in num_scheduled:  # only under priority: undo its share of this step
                    budget += num_scheduled.pop(victim.request_id)
                    spec_tokens.pop(victim.request_id, None)
                    scheduled.remove(victim)
                self._preempt(victim)
                preempted_this_step = True
                if victim is request:
                    if not self.running and not scheduled and not self._in_flight:
                        # Nothing else holds blocks, so it can never fit: finish it instead of looping.
                        self._finish_unfittable(request)
                    break
            else:
                num_scheduled[request.request_id] = num_new
                if num_drafts:
                    spec_tokens[request.request_id] = num_drafts
                scheduled.append(request)
                budget -= num_new

        # 2. Waiting requests, unless we just had to preempt (the cache is full).
        while (
            not preempted_this_step
            and len(self.waiting)
            and budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            request = self.waiting.peek()
            computed_blocks, num_cached = self.kv_cache_manager.get_computed_blocks(request)
            num_external = 0
            if (
                self.kv_connector is not None
                and request.num_preemptions == 0
                and not request.skip_reading_prefix_cache  # it must compute every prompt position
            ):
                num_external = self.kv_connector.get_num_new_matched_tokens(request, num_cached)
            num_new = request.num_tokens - num_cached - num_external
            if num_new > budget and not self.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            blocks = self.kv_cache_manager.allocate_slots(
                request, num_new + num_external, num_cached, computed_blocks, num_loading_tokens=num_external
            )
            if blocks is None:
                if not self.running and not scheduled and not self._in_flight:
                    # The whole cache is free and it still does not fit (it grew while others ran).
                    self._finish_unfittable(request)
                    continue
                break
            self.waiting.pop()
            request.num_computed_tokens = num_cached
            if self.kv_connector is not None:
                self.kv_connector.update_state_after_alloc(
                    request, self.kv_cache_manager.get_block_ids(request.request_id), num_external
                )
            request.num_computed_tokens = num_cached + num_external
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            if request.scheduled_time is None:
                request.scheduled_time = now
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            scheduled.append(request)
            budget -= num_new

        output = self._build_output(scheduled, num_scheduled)
        output.num_spec_tokens = spec_tokens
        return output

    def _build_output(self, scheduled: list[Request], num_scheduled: dict[str, int]) -> SchedulerOutput:
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        for request in scheduled:
            rid = request.request_id
            block_ids = self.kv_cache_manager.get_block_ids(rid)
            sent, ahead = self._num_tokens_sent.get(rid), self._tokens_ahead(request)
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
                    )
                )
                self._block_counts[rid] = len(block_ids)
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
            self._mark_in_flight(request, num_scheduled[rid])
            request.num_computed_tokens += num_scheduled[rid]

        # Constrained rows that sample this step (not partial prefills) get their bitmask.
        constrained = [
            r for r in scheduled if r.structured_output is not None and r.num_computed_tokens == r.num_tokens
        ]
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=set(self._finished_req_ids),
        )
        if self.kv_connector is not None and (scheduled or not self._in_flight):
            # (An empty output made while batches are in flight never reaches the workers: keep its releases.)
            output.kv_connector_metadata = self.kv_connector.build_connector_metadata()
        if constrained:
            output.structured_output_req_ids = [r.request_id for r in constrained]
            output.grammar_bitmask = self._structured_output().fill_bitmask([r.structured_output for r in constrained])
        if scheduled:  # an empty output may never reach the workers (pipeline mode): resend the ids
            self._finished_req_ids = set()
        return output

    def _choose_victim(self) -> Request | None:
        """The running request the policy preempts first (FCFS: the newest; priority: the least important).
        Requests whose batch is still in flight cannot be preempted."""
        candidates = [r for r in self.running if r.request_id not in self._in_flight]
        if not candidates:
            return None
        return self.waiting.choose_victim(candidates)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        logger.warning(
            "preempted request %s (recompute; %d preemptions so far): not enough KV cache blocks. "
            "Raise kv_cache_memory or lower max_num_seqs to avoid this.",
            request.request_id,
            self.num_preemptions,
        )
        self.waiting.add_front(request)

    def _finish_unfittable(self, request: Request) -> None:
        logger.error(
            "request %s needs more KV cache than the whole cache holds (%d tokens); finishing it with 'length'",
            request.request_id,
            request.num_tokens,
        )
        self.waiting.remove([request])
        request.status = RequestStatus.FINISHED_LENGTH
        self._unfittable.append(request)
        self._free_request(request)

    # ------------------------------------------------------------------ results

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        self.num_steps += 1
        self.model_seconds += runner_output.model_seconds
        for request in self._unfittable:
            outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="length"))
        self._unfittable = []
        self._update_kv_loads(scheduler_output, runner_output)
        for rid, num_tokens in scheduler_output.num_scheduled_tokens.items():
            void = self._step_returned(rid)
            request = self.requests.get(rid)
            if request is None:  # finished (aborted) while its batch was running
                continue
            if void:  # it read KV found invalid (a failed load) and was rolled back: nothing of it counts
                continue
            chunk_start = request.num_computed_tokens - num_tokens - self._in_flight.num_tokens(rid)  # (later steps)
            prompt_left = max(0, request.num_prompt_tokens - chunk_start)
            self.num_prompt_tokens += min(num_tokens, prompt_left)
            new_token_ids: list[int] = []
            token = runner_output.sampled_token_ids.get(rid)
            error = None
            if rid in scheduler_output.num_spec_tokens:
                new_token_ids = self._land_spec_tokens(request, num_tokens, runner_output)
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
                continue
            output = EngineCoreOutput(
                request_id=rid,
                new_token_ids=new_token_ids,
                new_logprobs=self._new_logprobs(rid, new_token_ids, runner_output),
                new_prompt_logprobs=prompt_logprobs,
                finish_reason=request.status.finish_reason,
                stop_reason=request.stop_reason,
                num_cached_tokens=request.num_cached_tokens,
                num_preemptions=request.num_preemptions,
                first_scheduled_time=request.scheduled_time,
                error=error,
            )
            outputs.append(output)
            if request.is_finished:
                self.running.remove(request)
                self._free_request(request)
                output.kv_transfer_params = request.kv_transfer_params_out
        return outputs

    # ------------------------------------------------------------------ stats

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        totals = kv.total_prefix_cache_stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self._waiting_for_grammar),
            kv_cache_usage=kv.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=totals.queries,
            prefix_cache_hits=totals.hits,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_blocks,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_steps=self.num_steps,
            model_seconds=self.model_seconds,
            kv_transfer={} if self.kv_connector is None else vars(self.kv_connector.snapshot_stats()),
            spec_decoding={} if self.spec_stats is None else self.spec_stats.as_dict(),
        )
