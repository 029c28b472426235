"""The default executor: one worker in this process.

With async scheduling the worker runs its steps on one background thread, in the order they were handed
out, so the engine can schedule step N+1 while step N runs (two batches in flight); every other call to
the worker goes through the same thread, so the worker is never used by two threads at once.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.worker.executor.base import Executor
from pagedserve.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.engine.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config, rank=0)
        self.worker.init_device()
        self.worker.load_model()
        self._step_thread: ThreadPoolExecutor | None = None
        if config.async_scheduling:
            self._step_thread = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-step")
            self.max_concurrent_batches = 2

    def _call(self, fn, *args: Any, **kwargs: Any) -> Any:
        if self._step_thread is None:
            return fn(*args, **kwargs)
        return self._step_thread.submit(fn, *args, **kwargs).result()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        return [self._call(getattr(self.worker, method), *args, **(kwargs or {}))]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._call(self.worker.execute_model, scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        if self._step_thread is None:
            return super().execute_model_async(scheduler_output)
        return self._step_thread.submit(self.worker.execute_model, scheduler_output)

    def rank_rpc(self, rank: int, method: str, args: tuple = ()) -> Any:
        """Called on the caller's thread, not the step thread: the one rank call made beside a running step
        is `kv_read`, which reads only a finished prefill's held blocks (no step writes them)."""
        if rank != 0:
            raise ConnectionError(f"rank {rank!r}: this engine has one rank, in this process")
        return getattr(self.worker, method)(*args)

    def local_kv_sources(self) -> list:
        source = getattr(self.worker.model_runner.kv_hooks, "source", None)
        return [] if source is None else [source]

    def shutdown(self) -> None:
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True)  # let a step in flight finish before the worker goes
        self.worker.shutdown()
