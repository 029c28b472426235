"""How the engine drives its workers. Backends are resolved by name so `engine/` never imports Ray."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

# backend name -> "module:Class"; the one place that knows where executors live.
_EXECUTOR_BACKENDS = {
    "uni": "pagedserve.engine.worker.executor.uniproc:UniProcExecutor",
    "ray": "pagedserve.cluster.executor.ray_executor:RayExecutor",
}


class Executor(ABC):
    # How many batches the engine may have in flight at once (pipeline parallelism).
    max_concurrent_batches: int = 1

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @staticmethod
    def get_class(config: EngineConfig) -> type["Executor"]:
        backend = config.executor_backend
        if backend not in _EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend: unknown {backend!r}; choose from {sorted(_EXECUTOR_BACKENDS)}")
        module_name, class_name = _EXECUTOR_BACKENDS[backend].split(":")
        return getattr(importlib.import_module(module_name), class_name)

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call `method` on every worker; results in rank order."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on all workers and return the driver rank's output."""

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> "Future[ModelRunnerOutput]":
        """Start one step and return at once. Executors with `max_concurrent_batches > 1` (pipeline
        parallelism) override this so several batches can be in flight; by default it runs inline."""
        future: Future[ModelRunnerOutput] = Future()
        try:
            future.set_result(self.execute_model(scheduler_output))
        except BaseException as exc:
            future.set_exception(exc)
        return future

    def determine_num_kv_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_kv_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def local_kv_sources(self) -> list:
        """KV connector sources of ranks in this process (kv_transfer.kv_source.KVSource); [] when the
        ranks live elsewhere (their readers' releases then reach the engine through `release_kv`)."""
        return []

    def rank_rpc(self, rank: int, method: str, args: tuple = ()) -> Any:
        """Call `Worker.<method>` on one rank (beside `collective_rpc`): how a PD consumer's KV read reaches
        a producer rank through its engine (`Worker.kv_read`)."""
        raise NotImplementedError(f"{type(self).__name__}: no rank_rpc")

    def kv_rank_endpoints(self) -> list:
        """Per rank, an object a PD consumer may send `kv_read` to directly (a rank living in its own
        process, e.g. a Ray actor), or None for a rank in this process (read through `rank_rpc`)."""
        return [None] * self.config.world_size

    def rank_node_ids(self) -> list[str | None]:
        """Per rank, the cluster node it runs on (None: this process's, unknown here)."""
        return [None] * self.config.world_size

    def check_health(self) -> None:
        """Raise if a worker is gone."""

    @property
    def is_failed(self) -> bool:
        """True once the executor can run no more steps (a worker died and took its group down); cheap."""
        return False

    def shutdown(self) -> None:
        pass
