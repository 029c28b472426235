"""Continuous batching with chunked prefill, FCFS/priority, and preemption by recompute.

Each step has a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`). Running
requests are scheduled first (decodes and the rest of chunked prefills), then waiting requests fill
what is left. There are no phases: a request simply has `num_tokens - num_computed_tokens` tokens to
compute, and the scheduler hands out as many as fit. When the KV cache runs out of blocks, the
lowest-priority running request (FCFS: the newest) is preempted: its blocks are freed and it goes back
to the waiting queue to be recomputed later.

The scheduler is the loop; each job is a part with its own state (engine/core/scheduling/):
admission (the waiting queue, grammars compiling), the step's budget, KV slots and preemption, the
batches in flight, the KV connector's side, the output builder, landing results; speculation's
reservations and rewinds are engine/spec_decode/scheduling.py. The scheduler itself owns the live
requests (`requests`) and the running list.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.core.request import Request, RequestStatus
from pagedserve.engine.core.request_queue import RequestQueue
from pagedserve.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.engine.core.scheduling.admission import Admission
from pagedserve.engine.core.scheduling.in_flight import InFlight
from pagedserve.engine.core.scheduling.kv_transfer_side import KVTransferSide
from pagedserve.engine.core.scheduling.output_builder import SchedulerOutputBuilder
from pagedserve.engine.core.scheduling.slot_allocator import Fit, SlotAllocator
from pagedserve.engine.core.scheduling.step_budget import StepBudget
from pagedserve.engine.core.scheduling.step_results import StepResults
from pagedserve.engine.outputs import EngineCoreOutput, SchedulerStats
from pagedserve.engine.spec_decode.scheduling import SpecDecodeScheduling
from pagedserve.kv_transfer.base import KVConnectorScheduler

if TYPE_CHECKING:
    from pagedserve.engine.structured_output.manager import StructuredOutputManager


class Scheduler:
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
        # Multi-LoRA: at most this many distinct adapters among the running requests (the resident slots).
        self.max_loras = config.max_loras if config.enable_lora else None
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []  # (the same list for the whole run: parts hold it)
        self.admission = Admission(config.scheduling_policy, structured_output)
        self.in_flight = InFlight(config.async_scheduling, config.max_model_len, kv_cache_manager)
        self.kv_transfer = KVTransferSide(kv_connector, kv_cache_manager, self.requests, self.in_flight)
        self.slots = SlotAllocator(kv_cache_manager, self.running, self.admission.waiting, self.in_flight,
                                   finish=self._free_request)
        self.spec = SpecDecodeScheduling(config.speculative)
        self.output_builder = SchedulerOutputBuilder(kv_cache_manager, self.in_flight, structured_output)
        self.results = StepResults(config.max_model_len, self.in_flight, self.spec)

    @property
    def waiting(self) -> RequestQueue:
        return self.admission.waiting

    @property
    def kv_connector(self) -> KVConnectorScheduler | None:
        return self.kv_transfer.connector

    @property
    def num_preemptions(self) -> int:
        return self.slots.num_preemptions

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.kv_transfer.request_added(request)
        self.admission.add(request)

    def take_grammar_failures(self) -> dict[str, str]:
        """Requests whose grammar failed to compile since the last call -> why."""
        return self.admission.take_grammar_failures()

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
            self.running[:] = [r for r in self.running if r not in running]
        self.admission.remove(r for r in finished if r.status != RequestStatus.RUNNING)
        for request in finished:
            request.status = status
            self._free_request(request)
        return finished

    def _free_request(self, request: Request) -> None:
        """A finished request leaves: its blocks go back (unless a reader holds them, or a batch in
        flight still writes them) and the workers hear of it with the next step."""
        if not self.kv_transfer.keeps_blocks(request):
            self.in_flight.free_blocks(request)
        del self.requests[request.request_id]
        self.output_builder.forget(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self.kv_transfer.has_pending_releases

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def is_draining(self, request_id: str) -> bool:
        """A finished request whose batch is still in flight: a new request may not take its id yet (that
        batch's result would land on it)."""
        return request_id in self.in_flight and request_id not in self.requests

    def free_released_kv(self) -> int:
        return self.kv_transfer.free_released()

    def roll_back_invalid_blocks(self, block_ids: Iterable[int]) -> list[str]:
        return self.kv_transfer.roll_back_invalid_blocks(block_ids)

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> SchedulerOutput:
        self.kv_transfer.free_released()
        self.admission.admit_compiled(idle=not self.running and not len(self.waiting) and not self.in_flight)
        now = time.time()
        step = StepBudget(self.max_num_batched_tokens, self.enable_chunked_prefill)
        self._schedule_running(step)
        if not step.preempted:  # (a preemption means the cache is full: nobody new this step)
            self._schedule_waiting(step, now)
        output = self.output_builder.build(step)
        output.kv_connector_metadata = self.kv_transfer.step_metadata(bool(step.scheduled))
        for request in step.scheduled:  # handed out: its batch is in flight, its tokens count as computed
            num_tokens = step.num_scheduled[request.request_id]
            if request.num_computed_tokens < request.num_prompt_tokens:  # a prefill chunk (timed for traces)
                request.timeline.chunk_scheduled(now, min(num_tokens, request.num_prompt_tokens - request.num_computed_tokens))
            self.in_flight.add(request, num_tokens)
            request.num_computed_tokens += num_tokens
        return output

    def _schedule_running(self, step: StepBudget) -> None:
        """Decodes (speculating ones with their drafts) and the remaining chunks of partial prefills."""
        for request in list(self.running):
            if step.exhausted:
                break
            if request.status != RequestStatus.RUNNING or self.in_flight.holds(request):
                continue  # preempted earlier in this loop, or its previous batch is still in flight
            num_new = step.chunk(self.in_flight.tokens_ahead(request) - request.num_computed_tokens)
            num_drafts = self.spec.drafts_for(request, step.budget, len(self.running), self.max_model_len)
            self.slots.fit_running(request, num_new, num_drafts, step)

    def _schedule_waiting(self, step: StepBudget, now: float) -> None:
        """Waiting requests in the policy's order while budget, sequences, KV slots and adapter slots last."""
        adapters = self._running_adapters()
        while len(self.waiting) and not step.exhausted and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            lora = request.lora_request
            if lora is not None and adapters is not None and lora.lora_int_id not in adapters:
                if len(adapters) >= self.max_loras:
                    break  # its adapter needs a slot that running requests hold: it waits for one to finish
            cached_blocks, num_cached = self.kv_cache_manager.get_computed_blocks(request)
            num_external = self.kv_transfer.num_external_tokens(request, num_cached)
            num_new = step.prompt_chunk(request.num_tokens - num_cached - num_external)
            if num_new is None:
                break
            fit = self.slots.fit_prompt(request, num_new, num_cached, cached_blocks, num_external, step)
            if fit is Fit.NEVER:
                continue
            if fit is Fit.NOT_NOW:
                break
            self.waiting.pop()
            if lora is not None and adapters is not None:
                adapters.add(lora.lora_int_id)
            request.num_computed_tokens = num_cached  # (where its loads start)
            self.kv_transfer.allocated(request, num_external)
            request.num_computed_tokens = num_cached + num_external
            if request.num_preemptions == 0:  # (tokens reloaded from an offload tier are cache hits too)
                request.num_cached_tokens = num_cached + self.kv_transfer.num_cached_external(request, num_external)
            request.status = RequestStatus.RUNNING
            if request.scheduled_time is None:
                request.scheduled_time = now
            self.running.append(request)
            step.add(request, num_new)

    def _running_adapters(self) -> set[int] | None:
        """The adapter ids the running requests hold slots for (None without LoRA)."""
        if self.max_loras is None:
            return None
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    # ------------------------------------------------------------------ results

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        self.results.step_returned(runner_output)
        outputs = [EngineCoreOutput(r.request_id, [], finish_reason="length") for r in self.slots.take_unfittable()]
        self.kv_transfer.update_loads(scheduler_output, runner_output)
        for rid, num_tokens in scheduler_output.num_scheduled_tokens.items():
            void = self.in_flight.returned(rid)
            request = self.requests.get(rid)
            if request is None:  # finished (aborted) while its batch was running
                continue
            if void:  # it read KV found invalid (a failed load) and was rolled back: nothing of it counts
                continue
            output = self.results.land(request, num_tokens, scheduler_output, runner_output)
            if output is None:
                continue
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
            num_waiting=self.admission.num_waiting,
            kv_cache_usage=kv.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=totals.queries,
            prefix_cache_hits=totals.hits,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_blocks,
            num_prompt_tokens=self.results.num_prompt_tokens,
            num_generation_tokens=self.results.num_generation_tokens,
            num_steps=self.results.num_steps,
            model_seconds=self.results.model_seconds,
            kv_transfer=self.kv_transfer.stats(),
            **self.kv_transfer.offload_figures(),
            spec_decoding=self.spec.stats_dict(),
        )
