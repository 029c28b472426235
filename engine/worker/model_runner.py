"""Turns a SchedulerOutput into one forward pass over a flat, unpadded batch of tokens.

A step, in order: the runner's mirror of the requests takes the scheduler's diff (request_states.py:
its tokens and sampling state per request, rows of the persistent input batch, input_batch.py); the
step is planned (step_plan.py: drafts proposed, decodes first, the rows that sample); the inputs are
gathered from the input batch with vectorized numpy; the model runs (a replayed CUDA graph for a
decode-only step on GPU, with the KV connector's loads beside it); and on the last pipeline stage the
hidden states become the step's output (step_outputs.py: sampled tokens, verified drafts, logprobs,
embedding requests' pooled vectors (pooler.py), failures). The runner itself owns the model, its KV cache and what is built at start-up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.engine.layers.attention_metadata import AttentionMetadata
from pagedserve.engine.models.loader import load_model, resolve_dtype
from pagedserve.engine.sample.sampler import Sampler
from pagedserve.engine.worker.cuda_graphs import CUDAGraphRunner
from pagedserve.engine.worker.input_batch import InputBatch
from pagedserve.engine.worker.request_states import RequestStates, RunnerRequestState
from pagedserve.engine.worker.step_outputs import StepOutputs
from pagedserve.engine.worker.step_plan import plan_step
from pagedserve.kernels.cpu import empty_hugepage_tensor, load_cpu_ops
from pagedserve.parallel.communication import pp_recv_tensors, pp_send_tensors, world_sum_ints
from pagedserve.parallel.pipeline import IntermediateTensors
from pagedserve.parallel.state import ParallelContext

logger = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class _ModelTimer:
    """Time from the start of the forward pass to now: wall time on CPU, device time on CUDA (events, read
    after the sampler's host copy has synchronized)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start_s = time.perf_counter()

    def seconds(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self.start_s
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return self.start.elapsed_time(end) / 1000.0


class ModelRunner:
    def __init__(self, config: EngineConfig, parallel: ParallelContext, device: torch.device) -> None:
        self.config = config
        self.parallel = parallel
        self.device = device
        self.hf_config = config.hf_config
        self.dtype = resolve_dtype(config.dtype, self.hf_config, device)
        self.block_size = config.block_size
        self.is_first_stage = parallel.pp_rank == 0
        self.is_last_stage = parallel.pp_rank == parallel.pp_size - 1
        # Only one rank samples and reports results: TP rank 0 of the last pipeline stage.
        self.is_driver = self.is_last_stage and parallel.tp_rank == 0
        self.input_batch = InputBatch(config.max_num_seqs, config.max_model_len, self.block_size, device)
        self.sampler = Sampler(seed=config.seed)
        self.states = RequestStates(self.input_batch, self.sampler)
        # Test hook, off (None) by default: called as fault_injector(stage, request_id) with stage
        # "forward" before the model runs (a raise fails the whole batch) and "sample" before a
        # request's row is sampled (a raise fails that request alone).
        self.fault_injector: Callable[[str, str], None] | None = None
        self.model: torch.nn.Module | None = None
        self.kv_caches: KVCaches = []
        self.kv_hooks = None  # worker half of a KV connector (kv_transfer.base.KVConnectorWorker)
        self.speculator = None  # speculative decoding (worker.speculator.Speculator), made with the model
        self.graphs: CUDAGraphRunner | None = None  # decode-only CUDA graphs (off on CPU / enforce_eager)
        self.outputs: StepOutputs | None = None  # the last stage's sampling and verification (made with the model)
        self.lora = None  # multi-LoRA: the resident slots and host cache (engine.lora.manager.LoRAManager)

    @property
    def requests(self) -> dict[str, RunnerRequestState]:
        return self.states.requests

    # ------------------------------------------------------------------ setup

    def load_model(self) -> None:
        if self.device.type == "cpu":
            load_cpu_ops()  # build/load the compiled CPU ops now, not inside the first decode step
        torch.manual_seed(self.config.seed)
        self.model = load_model(
            self.config.model, self.hf_config, self.dtype, self.parallel, device=self.device,
            max_position=self.config.max_model_len, quantization=self.config.quantization,
        )
        # enforce_eager: every step layer by layer, on CPU too (no fused decode op: engine/models/fused_decode.py)
        self.model.fused_decode = not self.config.enforce_eager
        if self.config.enable_lora:
            from pagedserve.engine.lora.manager import LoRAManager

            self.lora = LoRAManager(self.model, self.config.max_loras, self.config.max_lora_rank,
                                    self.config.cpu_loras, self.device, self.dtype)
        spec = self.config.speculative
        if spec is not None:
            from pagedserve.engine.worker.speculator import Speculator

            self.speculator = Speculator(spec, self.dtype, self.device, self.block_size, self.config.max_model_len)
        self.outputs = StepOutputs(self.model, self.sampler, self.states, self.speculator, self.is_driver)

    def kv_cache_bytes_per_block(self) -> int:
        num_layers, num_kv_heads, head_size = self.model.kv_cache_shape_per_layer()
        element = torch.empty((), dtype=self.dtype).element_size()
        target = 2 * num_layers * self.block_size * num_kv_heads * head_size * element
        # A draft model's cache has as many blocks as the target's (it reads them through the same tables).
        return target + (self.speculator.kv_cache_bytes_per_block() if self.speculator is not None else 0)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        num_layers, num_kv_heads, head_size = self.model.kv_cache_shape_per_layer()
        shape = (num_blocks, self.block_size, num_kv_heads, head_size)
        self.kv_caches = [(self._zeros_kv(shape), self._zeros_kv(shape)) for _ in range(num_layers)]
        if self.speculator is not None:
            self.speculator.initialize_kv_cache(num_blocks, self._zeros_kv)
        if self.config.kv_transfer_config is not None or self.config.kv_offload_size is not None:
            from pagedserve.kv_transfer.factory import make_worker_connector

            self.kv_hooks = make_worker_connector(self.config.kv_transfer_config, self.kv_layout(), self.parallel.rank,
                                                  self.device, offload=self.config.kv_offload_spec())
        if self.kv_hooks is not None:
            self.kv_hooks.register_kv_caches(self.kv_caches)
        self.graphs = CUDAGraphRunner(self.model, self.kv_caches, self.config, self.device)

    def kv_layout(self):
        """This engine's KV layout (kv_transfer.layout.KVLayout): what a KV connector moves."""
        from pagedserve.kv_transfer.layout import KVLayout

        _, num_kv_heads_here, head_size = self.model.kv_cache_shape_per_layer()
        num_kv_heads = int(getattr(self.hf_config, "num_key_value_heads", None) or self.hf_config.num_attention_heads)
        return KVLayout(
            num_layers=int(self.hf_config.num_hidden_layers), num_kv_heads=num_kv_heads, head_size=head_size,
            dtype=str(self.dtype).removeprefix("torch."), block_size=self.block_size,
            tp_size=self.parallel.tp_size, pp_size=self.parallel.pp_size,
        )

    def warm_up(self) -> None:
        """Compile every kernel variant now, not in a served step (engine.warmup)."""
        from pagedserve.engine.worker.warmup import warm_up_kernels

        warm_up_kernels(self)
        if self.graphs is not None:
            try:
                self.graphs.capture()
            except Exception:  # a model path that cannot be captured serves eagerly rather than not at all
                logger.warning("CUDA graph capture failed; decoding eagerly (pass enforce_eager to skip it)",
                               exc_info=True)
                self.graphs = None

    def _zeros_kv(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type == "cpu":
            return empty_hugepage_tensor(shape, self.dtype)  # fewer TLB misses on scattered block reads
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step. Returns the sampled tokens on the driver rank, None on the others."""
        self.states.update(so, self.speculator)
        if self.lora is not None:
            self.lora.update(so)
        kv_md = so.kv_connector_metadata
        if self.kv_hooks is not None and kv_md is not None:
            self.kv_hooks.start_load_kv(kv_md)  # releases go out now; loads run beside the forward pass
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(sampled_token_ids={}) if self.is_driver else None
        plan = plan_step(so, self.input_batch, self.states.requests, self.speculator, self.states.pooling_reqs)
        input_ids, positions, metadata = self.input_batch.prepare(plan.req_ids, plan.query_lens_np, plan.drafts,
                                                                  rows=plan.rows)
        if self.lora is not None:
            self.lora.prepare(plan.req_ids, plan.query_lens_np)
        if self.fault_injector is not None:
            for rid in plan.req_ids:
                self.fault_injector("forward", rid)
        timer = _ModelTimer(self.device)
        hidden = self._forward(input_ids, positions, metadata, has_loads=kv_md is not None and bool(kv_md.loads))
        self.input_batch.advance(plan.rows, plan.query_lens_np)
        if not self.is_last_stage:
            pp_send_tensors(hidden.to_dict(), self.parallel)
            self._finish_kv_loads(kv_md)
            return None
        output = ModelRunnerOutput(sampled_token_ids={})
        self._finish_kv_loads(kv_md, output)
        # A request whose load failed computed over KV never filled: the scheduler drops what it samples
        # now and recomputes it, so its seeded generator's draws of this step are taken back too.
        checkpoints = [self.states.requests[rid].sampling.draws_checkpoint()
                       for rid in output.kv_load_failed if rid in self.states.requests]
        self.outputs.fill(output, so, plan, hidden, self.fault_injector)
        for checkpoint in checkpoints:
            checkpoint.rewind_draws()
        if self.is_driver:  # (only the driver reports; on CUDA reading the timer waits for the device)
            output.model_seconds = timer.seconds() + plan.draft_seconds
            if self.lora is not None:
                output.lora_stats = self.lora.stats()
        return output if self.is_driver else None

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                 has_loads: bool = False):
        """This stage's forward pass: a replayed CUDA graph when the step allows one (no KV loads), else eager."""
        intermediate = None
        if not self.is_first_stage:
            intermediate = IntermediateTensors(**pp_recv_tensors(self.parallel, device=self.device))
        if self.graphs is not None and self.graphs.can_run(
            positions.shape[0], metadata, has_intermediate=intermediate is not None, has_kv_hooks=has_loads
        ):
            return self.graphs.run(input_ids, positions, metadata)
        return self.model.forward(
            input_ids if self.is_first_stage else None,
            positions,
            self.kv_caches,
            metadata,
            intermediate=intermediate,
            # Layer-by-layer waits only while this step loads KV (a connector with no loads waits on nothing):
            # without them a decode step on CPU takes the fused op (engine/models/fused_decode.py).
            kv_hooks=self.kv_hooks if has_loads else None,
        )

    def _finish_kv_loads(self, kv_md, output: ModelRunnerOutput | None = None) -> None:
        """Agree over every rank on which loads failed (any rank failing fails the request) and sum the bytes."""
        if self.kv_hooks is None or kv_md is None or not kv_md.loads:
            return
        failed, nbytes, seconds = self.kv_hooks.finish_loads()
        flags = [1 if job.req_id in failed else 0 for job in kv_md.loads]
        if self.parallel.world_size > 1:
            *flags, nbytes = world_sum_ints([*flags, nbytes], self.device)
        if output is not None:
            output.kv_load_failed = {job.req_id for job, f in zip(kv_md.loads, flags) if f}
            output.kv_loaded_bytes = nbytes
            output.kv_load_seconds = seconds
