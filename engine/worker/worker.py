"""One rank of an engine: device, distributed groups, model, KV cache, and its model runner."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.device_limits import check_block_size, should_warm_up
from pagedserve.engine.worker.model_runner import ModelRunner
from pagedserve.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.kv_transfer.rank_read import read_layers
from pagedserve.parallel.state import ParallelContext, destroy_distributed, init_distributed

logger = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        distributed_init_method: str | None = None,
        local_device_index: int = 0,
    ) -> None:
        self.config = config
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.local_device_index = local_device_index
        self.parallel: ParallelContext | None = None
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        device_type = self.config.resolved_device
        # Again here: the config may have been resolved on a machine without this rank's device.
        check_block_size(self.config.block_size, device_type)
        if self.config.cpu_threads is not None:
            torch.set_num_threads(self.config.cpu_threads)
            logger.info("rank %d: %d torch threads (cpu_threads)", self.rank, self.config.cpu_threads)
        if device_type == "cuda":
            torch.cuda.set_device(self.local_device_index)
            self.device = torch.device("cuda", self.local_device_index)
        else:
            self.device = torch.device("cpu")
        if self.config.world_size > 1:
            if self.distributed_init_method is None:
                raise ValueError("distributed_init_method: required when tensor/pipeline parallel size > 1")
            self.parallel = init_distributed(
                rank=self.rank,
                world_size=self.config.world_size,
                tp_size=self.config.tensor_parallel_size,
                pp_size=self.config.pipeline_parallel_size,
                init_method=self.distributed_init_method,
            )
        else:
            self.parallel = ParallelContext.single()
        self.model_runner = ModelRunner(self.config, self.parallel, self.device)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_kv_blocks(self) -> int:
        """Blocks that fit this rank's share of the KV budget (each rank holds its own layers/heads)."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = self.model_runner.kv_cache_bytes_per_block()
        if self.device.type == "cuda" and self.config.kv_cache_memory is None:
            from pagedserve.engine.worker.memory_profiler import gpu_kv_budget

            return max(0, gpu_kv_budget(self.model_runner) // per_block)
        return max(0, self.config.kv_cache_memory_bytes // per_block)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)
        if should_warm_up(self.device):
            logger.info("warming up the Triton kernels (one compile per variant, before serving)")
            self.model_runner.warm_up()

    def kv_transfer_info(self) -> tuple[dict, object]:
        """This rank's KV layout (as a dict) and its KV connector address (None unless it serves KV)."""
        hooks = self.model_runner.kv_hooks
        return self.model_runner.kv_layout().to_dict(), getattr(hooks, "address", None)

    def kv_read(self, token: str, spec: Any, layers: list[int], auth: Any) -> list:
        """A PD consumer reads this (producer) rank's KV (kv_transfer/rank_read.py), through the executor."""
        return read_layers(self.model_runner.kv_hooks if self.model_runner is not None else None,
                           token, spec, layers, auth)

    def kv_offload_state(self) -> dict:
        """This rank's offload tier once its writer caught up (files written, staged, counters); {} without one."""
        hooks = self.model_runner.kv_hooks if self.model_runner is not None else None
        tier = getattr(hooks, "offload", hooks)
        if tier is None or not hasattr(tier, "state"):
            return {}
        return {**tier.state(), "stats": vars(tier.stats).copy()}

    def set_fault_injector(self, fault_injector: Callable[[str, str], None] | None) -> None:
        """Test hook: see ModelRunner.fault_injector (None turns it off)."""
        self.model_runner.fault_injector = fault_injector

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.model_runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        hooks = self.model_runner.kv_hooks if self.model_runner is not None else None
        if hooks is not None and hasattr(hooks, "close"):
            hooks.close()
        if self.parallel is not None and self.parallel.world_size > 1:
            destroy_distributed()
