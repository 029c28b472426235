"""The scheduler's side of prefill/decode KV transfer, around its KV connector (the scheduler half of
kv_transfer/): how many prompt tokens a consumer loads instead of computing, what each load is told
after allocation, a producer's held blocks (kept at finish, freed when released), each step's connector
metadata, and the loads that come back: a landed load makes its blocks prefix hits, a failed one
rolls back every request that read its blocks. Without a connector every method is a no-op."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from pagedserve.engine.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.core.request import Request
from pagedserve.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.engine.core.scheduling.in_flight import InFlight
from pagedserve.kv_transfer.base import KVConnectorScheduler

logger = logging.getLogger(__name__)


class KVTransferSide:
    def __init__(self, connector: KVConnectorScheduler | None, kv_cache_manager: KVCacheManager,
                 requests: dict[str, Request], in_flight: InFlight) -> None:
        self.connector = connector
        self.kv_cache_manager = kv_cache_manager
        self.requests = requests  # the scheduler's live requests (read: whose computed tokens to roll back)
        self.in_flight = in_flight

    # ------------------------------------------------------------------ requests in and out

    def request_added(self, request: Request) -> None:
        if self.connector is not None:
            self.connector.request_added(request)

    def num_external_tokens(self, request: Request, num_cached: int) -> int:
        """Prompt tokens past the local prefix hits whose KV this request loads from elsewhere (never on a
        resume after preemption, nor for a request that must compute every prompt position)."""
        if self.connector is None or request.num_preemptions or request.skip_reading_prefix_cache:
            return 0
        return self.connector.get_num_new_matched_tokens(request, num_cached)

    def allocated(self, request: Request, num_external: int) -> None:
        """The request has its blocks; its loads start at its `num_computed_tokens` (the local hits)."""
        if self.connector is not None:
            self.connector.update_state_after_alloc(
                request, self.kv_cache_manager.get_block_ids(request.request_id), num_external
            )
            if num_external:
                layout = getattr(self.connector, "layout", None)
                request.timeline.load_started(time.time(), num_external,
                                              str(getattr(getattr(self.connector, "config", None), "kv_connector", "")),
                                              int(getattr(layout, "num_layers", 0) or 0))

    def num_cached_external(self, request: Request, num_external: int) -> int:
        """Of the request's external tokens, those that count as prefix-cache hits (an offload tier's reload)."""
        if self.connector is None or not num_external:
            return 0
        return num_external if self.connector.external_tokens_are_cached(request) else 0

    def keeps_blocks(self, request: Request) -> bool:
        """A finished request: whether its blocks stay allocated for a reader (a producer's hold)."""
        if self.connector is None:
            return False
        return self.connector.request_finished(request, self.kv_cache_manager.get_block_ids(request.request_id))

    @property
    def has_pending_releases(self) -> bool:
        """A pending KV release rides on the next step's metadata, so it counts as work."""
        return self.connector is not None and self.connector.has_pending_releases

    def free_released(self) -> int:
        """Producer: free the blocks of finished prefills whose reader released them or whose hold
        expired. Returns how many requests are still held (the engine keeps ticking while any are)."""
        if self.connector is None:
            return 0
        for request in self.connector.take_freeable():
            self.kv_cache_manager.free(request)
        return int(self.connector.has_held)

    # ------------------------------------------------------------------ steps

    def step_metadata(self, anything_scheduled: bool):
        """This step's loads, grants and releases for the workers (None without a connector). An empty
        output made while batches are in flight never reaches the workers: its releases wait."""
        if self.connector is None or not (anything_scheduled or not self.in_flight):
            return None
        return self.connector.build_connector_metadata()

    def update_loads(self, so: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """Account this step's loads. A load that landed makes its blocks prefix hits; the blocks of one
        that failed are invalid: every request that read them is rolled back to recompute from there."""
        md = so.kv_connector_metadata
        if self.connector is None or md is None or not md.loads:
            return
        self.connector.add_worker_stats(runner_output.kv_loaded_bytes, runner_output.kv_load_seconds)
        bs = self.kv_cache_manager.block_size
        invalid: list[int] = []
        now, step_tokens = time.time(), sum(job.token_end - job.token_start for job in md.loads) or 1
        for job in md.loads:
            request = self.requests.get(job.req_id)
            if request is not None:  # the step's bytes, shared by tokens among its loads
                request.timeline.load_landed(now, runner_output.kv_loaded_bytes * (job.token_end - job.token_start)
                                             // step_tokens, job.req_id not in runner_output.kv_load_failed)
            if job.req_id not in runner_output.kv_load_failed:
                self.connector.load_finished(job.req_id, ok=True)
                if request is not None:
                    self.kv_cache_manager.finish_load(request)
                continue
            if request is None:  # finished meanwhile: its blocks went back unhashed, nobody read them
                continue
            logger.warning("request %s: loading its prompt's KV failed; computing the prompt locally", job.req_id)
            self.connector.mark_load_failed(request)
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
            self.in_flight.void(rid)
            rolled_back.append(rid)
        return rolled_back

    def stats(self) -> dict:
        stats = None if self.connector is None else self.connector.snapshot_stats()
        return {} if stats is None else vars(stats)

    def offload_figures(self) -> dict:
        """SchedulerStats' offload tier fields: its counters as a dict and the ones /metrics sums ({} without one)."""
        stats = None if self.connector is None else self.connector.snapshot_offload_stats()
        if stats is None:
            return {}
        return {"kv_offload": vars(stats), "kv_offload_query_tokens": stats.query_tokens,
                "kv_offload_hit_tokens": stats.hit_tokens, "kv_offload_remote_hit_tokens": stats.remote_hit_tokens,
                "kv_offload_stored_bytes": stats.stored_bytes,
                "kv_offload_loaded_bytes": stats.loaded_bytes}
