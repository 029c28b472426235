"""The engine core: scheduler + executor + KV cache, stepped one batch at a time.

A failure inside a step ends only the requests it concerns: a request whose own work
failed (the runner reports it in `ModelRunnerOutput.failed`) is finished with
finish_reason "error" and its blocks freed while the rest of the batch goes on; when
the forward pass itself raises, every request of that batch is finished that way
(their blocks leave the prefix cache: their contents may be incomplete) and the engine
keeps serving.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.worker.executor.base import Executor
from pagedserve.engine.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.outputs import EngineCoreOutput, SchedulerStats
from pagedserve.engine.core.request import Request, RequestStatus
from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.sample.sampler import describe_failure
from pagedserve.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
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
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv_cache_manager)
        # Pipeline parallelism: up to `max_concurrent_batches` batches in flight, oldest first.
        self.max_concurrent_batches = self.executor.max_concurrent_batches
        self._batch_queue: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = deque()

    @property
    def kv_cache_capacity_tokens(self) -> int:
        return self.num_blocks * self.config.block_size

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._batch_queue)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule one batch, run it, and turn the sampled tokens into per-request outputs."""
        if self.max_concurrent_batches > 1:
            return self._step_with_batch_queue()
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        # Run even an empty step: it carries the finished request ids the workers must forget.
        try:
            runner_output = self.executor.execute_model(scheduler_output)
        except Exception as exc:
            return self._fail_batch(scheduler_output, exc)
        return self._update_from_output(scheduler_output, runner_output)

    def _update_from_output(self, so: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update_from_output(so, runner_output)
        if runner_output.failed:
            logger.error("requests failed in this step (the rest of the batch goes on): %s", runner_output.failed)
            outputs += self._finish_with_error(runner_output.failed)
        return outputs

    def _fail_batch(self, so: SchedulerOutput, exc: Exception) -> list[EngineCoreOutput]:
        """The step raised where no single request can be blamed: finish the batch's requests with an
        error, drop their blocks from the prefix cache, and stay up for the next requests."""
        logger.error("a step failed; failing the %d requests of its batch", len(so.num_scheduled_tokens), exc_info=exc)
        message = f"the engine step running this request failed: {describe_failure(exc)}"
        outputs = self.scheduler.update_from_output(so, ModelRunnerOutput(sampled_token_ids={}))
        for rid in so.num_scheduled_tokens:
            self.kv_cache_manager.uncache_blocks(rid)
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
            if not scheduler_output.is_empty:
                self._batch_queue.append((scheduler_output, self.executor.execute_model_async(scheduler_output)))
                if len(self._batch_queue) < self.max_concurrent_batches:
                    return []
            elif not self._batch_queue:
                try:
                    runner_output = self.executor.execute_model(scheduler_output)
                except Exception as exc:
                    return self._fail_batch(scheduler_output, exc)
                return self._update_from_output(scheduler_output, runner_output)
        if not self._batch_queue:
            return []
        scheduler_output, future = self._batch_queue.popleft()
        try:
            runner_output = future.result()
        except Exception as exc:
            # The pipeline broke: the batches behind this one will not come back either.
            outputs = self._fail_batch(scheduler_output, exc)
            while self._batch_queue:
                outputs += self._fail_batch(self._batch_queue.popleft()[0], exc)
            return outputs
        return self._update_from_output(scheduler_output, runner_output)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()
