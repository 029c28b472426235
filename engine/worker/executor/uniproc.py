"""The default executor: one worker in this process."""

from __future__ import annotations

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

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def local_kv_sources(self) -> list:
        source = getattr(self.worker.model_runner.kv_hooks, "source", None)
        return [] if source is None else [source]

    def shutdown(self) -> None:
        self.worker.shutdown()
