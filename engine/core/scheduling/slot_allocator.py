"""KV allocation and preemption: the KV slots of each request's tokens this step, from the KV cache
manager. When the cache runs out, a speculating decode first gives up its drafts' slots; then the
policy's victim among the running requests (FCFS: the newest; priority: the least important) is
preempted by recompute: its blocks are freed and it goes back to the front of the waiting queue. A
request that cannot fit even with nothing else holding blocks is finished with "length"."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

from pagedserve.engine.core.block_pool import KVCacheBlock
from pagedserve.engine.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.core.request import Request, RequestStatus
from pagedserve.engine.core.request_queue import RequestQueue
from pagedserve.engine.core.scheduling.in_flight import InFlight
from pagedserve.engine.core.scheduling.step_budget import StepBudget

logger = logging.getLogger(__name__)


class Fit(enum.Enum):
    YES = "yes"  # allocated
    NOT_NOW = "not now"  # no room this step: admit nobody else
    NEVER = "never"  # finished with "length": it can never fit


class SlotAllocator:
    def __init__(self, kv_cache_manager: KVCacheManager, running: list[Request], waiting: RequestQueue,
                 in_flight: InFlight, finish: Callable[[Request], None]) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.running = running  # the scheduler's running list (preemption takes from it)
        self.waiting = waiting  # the admission's queue (preemption puts back at its front)
        self.in_flight = in_flight
        self._finish = finish  # the scheduler's: frees a finished request's blocks and forgets it
        self.num_preemptions = 0
        self._unfittable: list[Request] = []  # finished for size; reported with the next step's outputs

    def fit_running(self, request: Request, num_new: int, num_drafts: int, step: StepBudget) -> None:
        """Slots for a running request's `num_new` tokens and `num_drafts` drafts, preempting while the
        cache is full; what fits joins the step."""
        num_new += num_drafts
        while self.kv_cache_manager.allocate_slots(request, num_new) is None:
            if num_drafts:  # no room for the drafts' slots: decode plainly before preempting anyone
                num_new, num_drafts = num_new - num_drafts, 0
                continue
            victim = self._choose_victim()
            if victim is None:  # everything else is in flight (pipeline): retry next step
                return
            step.drop(victim)  # (only under priority can the victim already be in this step)
            self._preempt(victim)
            step.preempted = True
            if victim is request:
                if self._nothing_else_holds_blocks(step):  # so it can never fit: finish it instead of looping
                    self._finish_unfittable(request)
                return
        step.add(request, num_new, num_drafts)

    def fit_prompt(self, request: Request, num_new: int, num_cached: int, cached_blocks: list[KVCacheBlock],
                   num_external: int, step: StepBudget) -> Fit:
        """Slots for a waiting request: its prefix hits, the tokens it loads from elsewhere and the
        `num_new` it computes this step."""
        blocks = self.kv_cache_manager.allocate_slots(
            request, num_new + num_external, num_cached, cached_blocks, num_loading_tokens=num_external
        )
        if blocks is not None:
            return Fit.YES
        if self._nothing_else_holds_blocks(step):  # the whole cache is free (it grew while others ran)
            self._finish_unfittable(request)
            return Fit.NEVER
        return Fit.NOT_NOW

    def take_unfittable(self) -> list[Request]:
        unfittable, self._unfittable = self._unfittable, []
        return unfittable

    def _nothing_else_holds_blocks(self, step: StepBudget) -> bool:
        return not self.running and not step.scheduled and not self.in_flight

    def _choose_victim(self) -> Request | None:
        """The running request the policy preempts first. Requests whose batch is still in flight cannot
        be preempted."""
        candidates = [r for r in self.running if r.request_id not in self.in_flight]
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
        self._finish(request)
