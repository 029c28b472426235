"""The engine core: scheduler + executor + KV cache, stepped one batch at a time.

A failure inside a step ends only the requests it concerns: a request whose own work
failed (the runner reports it in `ModelRunnerOutput.failed`) is finished with
finish_reason "error" and its blocks freed while the rest of the batch goes on; when
the forward pass itself raises, every request of that batch is finished that way
(their blocks leave the prefix cache: their contents may be incomplete) and the engine
keeps serving.

Async scheduling (`async_scheduling`): the in-process executor runs steps in order on a background
thread and two batches are in flight, so the scheduler (and, above, the output processor) works on
step N+1 while step N runs (engine/core/scheduling/in_flight.py). A failing batch fails only its own
requests there: the worker runs the batch behind it anyway.

Structured output: a request with `structured_outputs` waits (WAITING_FOR_GRAMMAR) while its
grammar compiles in the manager's thread pool; a compile that fails or times out finishes that
request alone with finish_reason "error". The manager is made on the first such request.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.worker.executor.base import Executor
from pagedserve.engine.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.core.kv_events import DEVICE, OFFLOAD, KVEventLog, TierEventRecorder
from pagedserve.engine.outputs import EngineCoreOutput, SchedulerStats
from pagedserve.engine.core.request import Request, RequestStatus
from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.failures import describe_failure
from pagedserve.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, tokenizer: Any = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._structured_output = None
        self.executor = Executor.get_class(config)(config)
        try:
            num_blocks = self.executor.determine_num_kv_blocks()
            if num_blocks < 1:
                raise ValueError(
                    "kv_cache_memory: the KV cache budget does not hold a single block "
                    f"of {config.block_size} tokens; raise it"
                )
            self.executor.initialize_kv_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        self.num_blocks = num_blocks
        capacity = num_blocks * config.block_size
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens; max concurrency at max_model_len=%d: %.2fx",
            num_blocks, config.block_size, capacity, config.max_model_len, capacity / config.max_model_len,
        )
        # What enters and leaves the prefix cache, sealed per step (routers index it: kv_events.py).
        self.kv_events = KVEventLog()
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                               events=self.kv_events)
        pool = self.kv_cache_manager.block_pool
        self.kv_events.add_snapshot_source(DEVICE, lambda: pool.cached_block_hash_to_block.keys())
        has_connector = config.kv_transfer_config is not None or config.kv_offload_size is not None
        self.kv_connector = self._make_kv_connector() if has_connector else None
        self.scheduler = Scheduler(config, self.kv_cache_manager, kv_connector=self.kv_connector,
                                   structured_output=self.structured_output)
        # Pipeline parallelism: up to `max_concurrent_batches` batches in flight, oldest first.
        self.max_concurrent_batches = self.executor.max_concurrent_batches
        self._batch_queue: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = deque()
        # New requests whose id an earlier request still uses in a batch in flight: added once it returns.
        self._held: list[Request] = []
        self._lora_stats: dict = {}  # the driver's last adapter counters (multi-LoRA)

    def _make_kv_connector(self):
        """The scheduler half of the KV connector (prefill/decode, the offload tier, or both), told where this
        engine's ranks serve their KV; the offload tier hears of every block the block pool evicts."""
        from pagedserve.kv_transfer.factory import make_scheduler_connector
        from pagedserve.kv_transfer.layout import KVLayout

        infos = self.executor.collective_rpc("kv_transfer_info")
        connector = make_scheduler_connector(self.config.kv_transfer_config, KVLayout.from_dict(infos[0][0]),
                                             [address for _, address in infos], offload=self.config.kv_offload_spec(),
                                             block_hashes=self.kv_cache_manager.block_hashes)
        if self.config.kv_offload_size is not None:
            self.kv_cache_manager.block_pool.on_evict = connector.block_evicted
            # The tier's changes join the engine's KV events, and its holdings its snapshots (routers index both).
            tier = getattr(connector, "offload", connector)
            recorder = TierEventRecorder(self.kv_events)
            tier.listeners.append(recorder)
            self.kv_events.add_snapshot_source(recorder.TIER_NAMES.get(tier.tier, OFFLOAD), lambda: tier.index.keys())
        # An in-process producer rank learns each hold at once and passes its readers' releases straight on.
        for source in self.executor.local_kv_sources():
            connector.attach_local_source(source)
        return connector

    def release_kv(self, holds: Iterable[tuple[str, str]]) -> None:
        """Producer: a reader is done with these holds, each (hold id, hold token) from the prefill's
        kv_transfer_params (thread-safe; freed at the next tick; one without its token is ignored)."""
        if self.kv_connector is not None:
            self.kv_connector.release(list(holds))

    def free_released_kv(self) -> int:
        """Free released or expired prefill holds; returns how many are still held."""
        return self.scheduler.free_released_kv()

    def kv_transfer_stats(self):
        return None if self.kv_connector is None else self.kv_connector.snapshot_stats()

    def kv_offload_state(self) -> dict:
        """The offload tier as the scheduler and every rank see it (after the ranks' writers caught up): for
        accounting checks (tests/offload_checks.py) and benchmarks. {} without a tier."""
        if self.config.kv_offload_size is None:
            return {}
        tier = getattr(self.kv_connector, "offload", self.kv_connector)
        return {**tier.accounting(), "ranks": self.executor.collective_rpc("kv_offload_state")}

    def structured_output(self):
        """The structured-output manager (xgrammar is imported and set up on first use)."""
        if self._structured_output is None:
            from pagedserve.engine.tokenizer import load_tokenizer
            from pagedserve.engine.structured_output.manager import StructuredOutputManager

            if self.tokenizer is None:
                self.tokenizer = load_tokenizer(self.config.tokenizer or self.config.model)
            self._structured_output = StructuredOutputManager(self.tokenizer, self.config.hf_config.vocab_size)
        return self._structured_output

    @property
    def kv_cache_capacity_tokens(self) -> int:
        return self.num_blocks * self.config.block_size

    def add_request(self, request: Request) -> None:
        if self.scheduler.is_draining(request.request_id):
            if any(r.request_id == request.request_id for r in self._held):
                raise ValueError(f"request_id: {request.request_id!r} is already in use")
            self._held.append(request)
            return
        self.scheduler.add_request(request)

    def _admit_held(self) -> None:
        if self._held:
            held, self._held = self._held, []
            for request in held:
                self.add_request(request)

    def abort_requests(self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        request_ids = list(request_ids)
        if self._held:
            ids = set(request_ids)
            self._held = [r for r in self._held if r.request_id not in ids]
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._batch_queue) or bool(self._held)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule one batch, run it, and turn the sampled tokens into per-request outputs (with batches
        in flight: hand out the next batch, then take the oldest one's outputs)."""
        outputs = self._step()
        if self._batch_queue and self.config.async_scheduling and not self.scheduler.has_unfinished_requests():
            # What is still in flight carries only finished requests (a step scheduled ahead of their last
            # token): collect it now, so that an engine with nothing left to do holds no blocks.
            while self._batch_queue:
                outputs += self._collect_oldest()
        self._admit_held()
        self.kv_events.seal()
        return outputs

    def _step(self) -> list[EngineCoreOutput]:
        if self.executor.is_failed:
            return self._fail_outstanding()
        if self.max_concurrent_batches > 1:
            return self._step_with_batch_queue()
        if not self.scheduler.has_unfinished_requests():
            self.scheduler.free_released_kv()
            return []
        scheduler_output = self.scheduler.schedule()
        failed_grammars = self._fail_grammars()
        # Run even an empty step: it carries the finished request ids the workers must forget.
        try:
            runner_output = self.executor.execute_model(scheduler_output)
        except Exception as exc:
            return failed_grammars + self._fail_batch(scheduler_output, exc)
        return failed_grammars + self._update_from_output(scheduler_output, runner_output)

    def _fail_outstanding(self) -> list[EngineCoreOutput]:
        """The executor went down (a worker died and its group noticed, maybe before this engine collected
        the batches in flight): the batches in flight fail with the executor's own error, then every other
        request the engine holds; new requests are refused (`check_executor`)."""
        outputs: list[EngineCoreOutput] = []
        while self._batch_queue:
            outputs += self._collect_oldest()
        self._admit_held()  # (nothing is in flight now: their ids are free)
        message = "the engine's executor went down (a worker died) before this request finished"
        return outputs + self._finish_with_error({rid: message for rid in list(self.scheduler.requests)})

    def check_executor(self) -> None:
        """Raise if no request can run any more: the executor went down."""
        if self.executor.is_failed:
            raise RuntimeError("the engine's executor is down after an earlier failure; start a new engine")

    def _fail_grammars(self) -> list[EngineCoreOutput]:
        failures = self.scheduler.take_grammar_failures()
        if not failures:
            return []
        logger.error("structured-output grammars failed (their requests finish with an error): %s", failures)
        return self._finish_with_error(failures)

    def _update_from_output(self, so: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update_from_output(so, runner_output)
        if runner_output.lora_stats is not None:
            self._lora_stats = runner_output.lora_stats
        if runner_output.failed:
            logger.error("requests failed in this step (the rest of the batch goes on): %s", runner_output.failed)
            outputs += self._finish_with_error(runner_output.failed)
        return outputs

    def _fail_batch(self, so: SchedulerOutput, exc: Exception) -> list[EngineCoreOutput]:
        """The step raised where no single request can be blamed: finish the batch's requests with an
        error, drop their blocks from the prefix cache, and stay up for the next requests."""
        logger.error("a step failed; failing the %d requests of its batch", len(so.num_scheduled_tokens), exc_info=exc)
        message = f"the engine step running this request failed: {describe_failure(exc)}"
        for rid in so.num_scheduled_tokens:  # before the update: it frees the blocks of finished requests
            self.kv_cache_manager.uncache_blocks(rid)
        # Its KV loads never landed: reported as failed, so that their blocks never become prefix hits and
        # the producers' holds are let go.
        md = so.kv_connector_metadata
        failed_loads = {job.req_id for job in md.loads} if md is not None else set()
        outputs = self.scheduler.update_from_output(so, ModelRunnerOutput(sampled_token_ids={},
                                                                          kv_load_failed=failed_loads))
        return outputs + self._finish_with_error({rid: message for rid in so.num_scheduled_tokens})

    def _finish_with_error(self, errors: dict[str, str]) -> list[EngineCoreOutput]:
        finished = self.scheduler.finish_requests(errors, RequestStatus.FINISHED_ERROR)
        return [
            EngineCoreOutput(
                request_id=r.request_id,
                new_token_ids=[],
                finish_reason=RequestStatus.FINISHED_ERROR.finish_reason,
                error=errors[r.request_id],
                num_cached_tokens=r.num_cached_tokens,
                num_preemptions=r.num_preemptions,
                first_scheduled_time=r.scheduled_time,
            )
            for r in finished
        ]

    def _step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Keep the pipeline full: hand out a new batch while earlier ones are still running, and only
        block on the oldest batch when the queue is full or nothing new can be scheduled."""
        if len(self._batch_queue) < self.max_concurrent_batches and self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            failed_grammars = self._fail_grammars()
            if failed_grammars:
                if not scheduler_output.is_empty:
                    failed_grammars += self._enqueue(scheduler_output)
                return failed_grammars
            if not scheduler_output.is_empty:
                refused = self._enqueue(scheduler_output)
                if refused or len(self._batch_queue) < self.max_concurrent_batches:
                    return refused
            elif not self._batch_queue:
                try:
                    runner_output = self.executor.execute_model(scheduler_output)
                except Exception as exc:
                    return self._fail_batch(scheduler_output, exc)
                return self._update_from_output(scheduler_output, runner_output)
        if not self._batch_queue:
            self.scheduler.free_released_kv()
            return []
        return self._collect_oldest()

    def _collect_oldest(self) -> list[EngineCoreOutput]:
        """Wait for the oldest batch in flight and take its outputs."""
        scheduler_output, future = self._batch_queue.popleft()
        try:
            runner_output = future.result()
        except Exception as exc:
            return self._fail_pipeline(scheduler_output, exc)
        return self._update_from_output(scheduler_output, runner_output)

    def _enqueue(self, so: SchedulerOutput) -> list[EngineCoreOutput]:
        """Hand a batch to the pipeline. An executor that refuses it (its worker group died) fails it the
        way a batch that fails in flight does, so the caller sees one behaviour either way."""
        try:
            self._batch_queue.append((so, self.executor.execute_model_async(so)))
        except Exception as exc:
            return self._fail_pipeline(so, exc)
        return []

    def _fail_pipeline(self, so: SchedulerOutput, exc: Exception) -> list[EngineCoreOutput]:
        """The pipeline broke at this batch: the batches behind it will not come back either (with async
        scheduling they will: the worker runs them, so only this batch fails)."""
        outputs = self._fail_batch(so, exc)
        if self.config.async_scheduling:
            return outputs
        while self._batch_queue:
            outputs += self._fail_batch(self._batch_queue.popleft()[0], exc)
        return outputs

    def get_stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        stats.lora = dict(self._lora_stats)
        return stats

    def reset_prefix_cache(self) -> bool:
        reset = self.kv_cache_manager.reset_prefix_cache()
        self.kv_events.seal()
        return reset

    def shutdown(self) -> None:
        if self._structured_output is not None:
            self._structured_output.shutdown()
        self.executor.shutdown()
