"""The scheduler's side of prefill/decode KV transfer: freeing a producer's released holds, counting
a consumer's finished loads, and recomputing a prompt whose load failed (mixed into `Scheduler`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pagedserve.engine.core.request import Request, RequestStatus
from pagedserve.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from pagedserve.engine.core.kv_cache_manager import KVCacheManager
    from pagedserve.engine.core.request_queue import RequestQueue
    from pagedserve.kv_transfer.base import KVConnectorScheduler

logger = logging.getLogger(__name__)


class KVTransferSchedulingMixin:
    kv_connector: KVConnectorScheduler | None
    kv_cache_manager: KVCacheManager
    running: list[Request]
    waiting: RequestQueue

    def free_released_kv(self) -> int:
        """Producer: free the blocks of finished prefills whose reader released them or whose hold
        expired. Returns how many requests are still held (the engine keeps ticking while any are)."""
        if self.kv_connector is None:
            return 0
        for request in self.kv_connector.take_freeable():
            self.kv_cache_manager.free(request)
        return int(self.kv_connector.has_held)

    def _update_kv_loads(self, so: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        md = so.kv_connector_metadata
        if self.kv_connector is None or md is None or not md.loads:
            return
        self.kv_connector.add_worker_stats(runner_output.kv_loaded_bytes, runner_output.kv_load_seconds)
        for job in md.loads:
            if job.req_id not in runner_output.kv_load_failed:
                self.kv_connector.load_finished(job.req_id, ok=True)

    def _recompute_after_failed_load(self, request: Request) -> None:
        """Its KV load failed: drop what this step computed on top of it and compute the prompt here."""
        logger.warning("request %s: loading its prompt's KV failed; computing the prompt locally", request.request_id)
        self.kv_connector.mark_load_failed(request)
        self.kv_cache_manager.uncache_blocks(request.request_id)
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1  # the workers see it as resumed: a fresh block table
        self.waiting.add_front(request)
