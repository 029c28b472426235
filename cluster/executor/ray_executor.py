"""`RayExecutor`: the engine's executor over a Ray worker group (one actor per TP x PP rank).

Inside a Serve engine replica whose placement group has a bundle per rank after its own, the
ranks go into that group (see `serve_app.engine_deployment_options`); elsewhere the worker group
creates its own. The engine selects it by name (`distributed_executor_backend="ray"`, the default when
tp * pp > 1). With pipeline parallelism it lets the engine keep `pp` batches in flight:
`execute_model_async` returns at once, and each actor runs its steps in order.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import ray

from pagedserve.cluster.executor.placement import uses_gpu
from pagedserve.cluster.executor.ray_utils import ensure_ray
from pagedserve.cluster.executor.worker_group import WorkerGroup, WorkerGroupOptions
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.worker.executor.base import Executor
from pagedserve.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


def _use_gpu(config: EngineConfig) -> bool:
    """GPUs when asked for, or with device="auto" when the cluster (not necessarily this node) has them."""
    return uses_gpu(config.device, ray.cluster_resources() if config.device == "auto" else {})


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        ensure_ray()
        # Pipeline parallelism: one batch per stage in flight keeps every stage busy.
        self.max_concurrent_batches = config.pipeline_parallel_size
        use_gpu = _use_gpu(config)
        options = WorkerGroupOptions(
            num_cpus_per_worker=config.num_cpus_per_worker,
            use_gpu=use_gpu,
            strategy=config.placement_group_strategy,
            placement_timeout_s=config.placement_timeout_s,
        )
        # Inside a Serve engine replica, the replica's placement group holds the ranks (after bundle 0,
        # the replica's own): Serve schedules and replaces the replica and its ranks together.
        current = ray.util.get_current_placement_group()
        if current is not None and len(current.bundle_specs) > config.world_size:
            options.placement_group = current
            options.first_bundle = len(current.bundle_specs) - config.world_size
        # The ranks run on the device their bundles reserve, whatever their node would offer.
        self.group = WorkerGroup(config.model_copy(update={"device": "cuda" if use_gpu else "cpu"}), options)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        return self.group.call_all(method, args, kwargs)

    def rank_rpc(self, rank: int, method: str, args: tuple = ()) -> Any:
        if not 0 <= rank < len(self.group.actors):
            raise ConnectionError(f"rank {rank!r}: this engine has {len(self.group.actors)} ranks")
        return ray.get(self.group.actors[rank].execute_method.remote(method, *args))

    def kv_rank_endpoints(self) -> list:
        """Every rank is a Ray actor that answers `kv_read` itself (its own concurrency group)."""
        return list(self.group.actors)

    def rank_node_ids(self) -> list[str | None]:
        return [rank.node_id for rank in self.group.ranks]

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> "Future[ModelRunnerOutput]":
        return self.group.execute_model_async(scheduler_output)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output).result()

    def check_health(self) -> None:
        self.group.check_health()

    @property
    def is_failed(self) -> bool:
        return self.group.failure is not None

    def shutdown(self) -> None:
        self.group.shutdown()
