"""The scheduler's side of prefill/decode KV transfer: freeing a producer's released holds, counting
a consumer's finished loads, and rolling back every request that read the blocks of a load that
failed (mixed into `Scheduler`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagedserve.engine.core.request import Request
from pagedserve.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from pagedserve.engine.core.kv_cache_manager import KVCacheManager
    from pagedserve.engine.core.request_queue import RequestQueue
    from pagedserve.engine.core.scheduler_async import InFlightSteps
    from pagedserve.kv_transfer.base import KVConnectorScheduler

logger = logging.getLogger(__name__)


class KVTransferSchedulingMixin:
    kv_connector: KVConnectorScheduler | None
    kv_cache_manager: KVCacheManager
    requests: dict[str, Request]
    running: list[Request]
    waiting: RequestQueue
    _in_flight: InFlightSteps

    def free_released_kv(self) -> int:
        """Producer: free the blocks of finished prefills whose reader released them or whose hold
        expired. Returns how many requests are still held (the engine keeps ticking while any are)."""
        if self.kv_connector is None:
            return 0
        for request in self.kv_connector.take_freeable():
            self.kv_cache_manager.free(request)
        return int(self.kv_connector.has_held)

    def _update_kv_loads(self, so: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """Account this step's loads. A load that landed makes its blocks prefix hits; the blocks of one
        that failed are invalid: every request that read them is rolled back to recompute from there."""
        md = so.kv_connector_metadata
        if self.kv_connector is None or md is None or not md.loads:
            return
        self.kv_connector.add_worker_stats(runner_output.kv_loaded_bytes, runner_output.kv_load_seconds)
        bs = self.kv_cache_manager.block_size
        invalid: list[int] = []
        for job in md.loads:
            request = self.requests.get(job.req_id)
            if job.req_id not in runner_output.kv_load_failed:
                self.kv_connector.load_finished(job.req_id, ok=True)
                if request is not None:
                    self.kv_cache_manager.finish_load(request)
                continue
            if request is None:  # finished meanwhile: its blocks went back unhashed, nobody read them
                continue
            logger.warning("request %s: loading its prompt's KV failed; computing the prompt locally", job.req_id)
            self.kv_connector.mark_load_failed(request)
            invalid += job.block_ids[job.token_start // bs : (job.token_end - 1) // bs + 1]
        if invalid:
            self.roll_back_invalid_blocks(invalid)

    def roll_back_invalid_blocks(self, block_ids: Iterable[int]) -> list[str]:
        """vLLM's invalid-block handling: blocks whose KV cannot be trusted leave the prefix cache, and every
        request whose computed tokens cover one rolls its `num_computed_tokens` back to the start of its
        first invalid block; it keeps its blocks and recomputes from there. The results of its batches in
        flight (they read the invalid KV) are dropped when they come back. Returns the rolled-back ids.

        Invalid blocks come from failed KV loads, whose blocks no other request can hit before the load
        landed: in practice the loader is the one request rolled back. (No load runs under async
        scheduling, whose steps scheduled ahead would already carry a token sampled over the bad KV.)
        """
        bs = self.kv_cache_manager.block_size
        rolled_back = []
        for rid, first in self.kv_cache_manager.invalidate_blocks(block_ids).items():
            request = self.requests.get(rid)
            if request is None or request.num_computed_tokens <= first * bs:
                continue  # finished (its blocks are freed when its batch returns), or never read the block
            request.num_computed_tokens = first * bs
            # The workers take its block table and computed count afresh, as on a resume after preemption.
            request.num_preemptions += 1
            self._in_flight.void(rid)
            rolled_back.append(rid)
        return rolled_back
