"""Turns a SchedulerOutput into one forward pass over a flat, unpadded batch of tokens.

The runner keeps a small state per request (its tokens, sampling state) and a persistent input batch
(input_batch.py: token ids, block tables and computed counts in preallocated rows), both updated from
the scheduler's diffs, so that a worker in another process sees exactly what an in-process one does
and a step's inputs are gathered with vectorized numpy instead of rebuilt per request. Sequences are
ordered decodes first (query length 1), then prefill chunks; the attention layers rely on that order.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.engine.worker.attention_metadata import AttentionMetadata
from pagedserve.engine.worker.input_batch import InputBatch
from pagedserve.engine.worker.cuda_graphs import CUDAGraphRunner
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.models.loader import load_model, resolve_dtype
from pagedserve.engine.sample.sampler import Sampler, SamplingState, compute_prompt_logprobs, describe_failure
from pagedserve.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.kernels.cpu import empty_hugepage_tensor, load_cpu_ops
from pagedserve.parallel.communication import pp_recv_tensors, pp_send_tensors, world_sum_ints
from pagedserve.parallel.pipeline import IntermediateTensors
from pagedserve.parallel.state import ParallelContext

logger = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class RunnerRequestState:
    req_id: str
    num_prompt_tokens: int
    token_ids: list[int]  # prompt + outputs known so far (mirrored in the input batch's row)
    sampling: SamplingState
    prompt_logprobs: int | None
    # Async scheduling: the token this runner sampled last, the input of a step scheduled before it landed.
    last_sampled_token_id: int | None = None


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


@dataclass
class _Batch:
    """The host-side plan of one step, in batch order."""

    req_ids: list[str]
    query_lens: list[int]
    start_positions: list[int]  # num_computed_tokens before this step
    # Indices (into the flat token batch) of the last token of sequences that sample.
    sample_rows: list[int]
    sample_req_ids: list[str]
    # Speculating requests: their proposed tokens (the query is [last token] + drafts; every position
    # of it is verified) and the flat-batch rows of those positions, in request order.
    drafts: dict[str, list[int]] = field(default_factory=dict)
    spec_rows: list[int] = field(default_factory=list)
    spec_req_ids: list[str] = field(default_factory=list)
    # The requests' rows in the input batch and their query lengths, as arrays (batch order).
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    query_lens_np: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


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
        self.requests: dict[str, RunnerRequestState] = {}
        self.input_batch = InputBatch(config.max_num_seqs, config.max_model_len, self.block_size, device)
        self._prompt_logprob_reqs: set[str] = set()  # requests that asked for prompt logprobs
        self.sampler = Sampler(seed=config.seed)
        # Test hook, off (None) by default: called as fault_injector(stage, request_id) with stage
        # "forward" before the model runs (a raise fails the whole batch) and "sample" before a
        # request's row is sampled (a raise fails that request alone).
        self.fault_injector: Callable[[str, str], None] | None = None
        self.model: torch.nn.Module | None = None
        self.kv_caches: KVCaches = []
        self.kv_hooks = None  # worker half of a KV connector (kv_transfer.base.KVConnectorWorker)
        self.speculator = None  # speculative decoding (worker.speculator.Speculator), made with the model
        self.graphs: CUDAGraphRunner | None = None  # decode-only CUDA graphs (off on CPU / enforce_eager)

    # ------------------------------------------------------------------ setup

    def load_model(self) -> None:
        if self.device.type == "cpu":
            load_cpu_ops()  # build/load the compiled CPU ops now, not inside the first decode step
        torch.manual_seed(self.config.seed)
        self.model = load_model(
            self.config.model, self.hf_config, self.dtype, self.parallel, device=self.device,
            max_position=self.config.max_model_len, quantization=self.config.quantization,
        )
        spec = self.config.speculative
        if spec is not None:
            from pagedserve.engine.worker.speculator import Speculator

            self.speculator = Speculator(spec, self.dtype, self.device, self.block_size, self.config.max_model_len)

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
        if self.config.kv_transfer_config is not None:
            from pagedserve.kv_transfer.factory import make_worker_connector

            self.kv_hooks = make_worker_connector(self.config.kv_transfer_config, self.kv_layout(), self.parallel.rank, self.device)
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

    # ------------------------------------------------------------------ per-step state

    def _update_states(self, so: SchedulerOutput) -> None:
        kv_md = so.kv_connector_metadata
        loaded_from = {job.req_id: job.token_start for job in kv_md.loads} if kv_md is not None else {}
        for req_id in so.finished_req_ids:
            finished = self.requests.pop(req_id, None)
            if finished is not None:
                self.sampler.release(finished.sampling)  # frees its persistent sampling rows
            self.input_batch.remove_request(req_id)
            self._prompt_logprob_reqs.discard(req_id)
            if self.speculator is not None:
                self.speculator.request_finished(req_id)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            output_ids = list(new.output_token_ids)
            self.requests[new.req_id] = RunnerRequestState(
                req_id=new.req_id,
                num_prompt_tokens=len(new.prompt_token_ids),
                token_ids=list(new.prompt_token_ids) + output_ids,
                sampling=SamplingState(
                    params=params,
                    prompt_token_ids=list(new.prompt_token_ids),
                    output_token_ids=output_ids,
                    bad_words_token_ids=new.bad_words_token_ids,
                    eos_token_ids=set(new.eos_token_ids),
                    request_id=new.req_id,
                    # Output tokens a new request arrives with were sampled by a prefill engine.
                    pending_draws=len(output_ids) if params.seed is not None and not params.greedy else 0,
                ),
                prompt_logprobs=params.prompt_logprobs,
            )
            self.input_batch.add_request(new.req_id, self.requests[new.req_id].token_ids, new.block_ids,
                                         new.num_computed_tokens)
            if params.prompt_logprobs is not None:
                self._prompt_logprob_reqs.add(new.req_id)
            if self.speculator is not None:
                # KV a connector loads for the target was never computed by the draft: it catches up from there.
                self.speculator.request_added(new.req_id, loaded_from.get(new.req_id, new.num_computed_tokens))
        grown_ids: list[str] = []  # cached requests with new tokens, and those tokens
        grown_tokens: list[list[int]] = []
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            known = len(state.token_ids)
            if cached.new_token_ids:
                state.token_ids.extend(cached.new_token_ids)
                state.sampling.output_token_ids.extend(cached.new_token_ids)
            if cached.num_placeholder_tokens:  # (None if that sample failed: the request ends, this step is dropped)
                token = 0 if state.last_sampled_token_id is None else state.last_sampled_token_id
                state.token_ids.append(token)
                state.sampling.output_token_ids.append(token)
            if len(state.token_ids) > known:
                grown_ids.append(cached.req_id)
                grown_tokens.append(state.token_ids[known:])
            if cached.new_block_ids or cached.resumed_from_preemption:
                self.input_batch.update_blocks(cached.req_id, cached.new_block_ids,
                                               replace=cached.resumed_from_preemption)
            if self.speculator is not None:
                self.speculator.request_updated(cached.req_id, cached.num_computed_tokens,
                                                cached.resumed_from_preemption)
        cached_reqs = so.scheduled_cached_reqs
        self.input_batch.append_tokens_many(grown_ids, grown_tokens)
        self.input_batch.set_num_computed([c.req_id for c in cached_reqs], (c.num_computed_tokens for c in cached_reqs))

    def _propose_drafts(self, so: SchedulerOutput) -> dict[str, list[int]]:
        """Draft tokens for this step's speculating requests (the draft model also catches up over
        every scheduled request's tokens, so its cache stays in step with the target's)."""
        if self.speculator is None:
            return {}
        if self.speculator.draft is None:  # n-gram: only the speculating requests, read from their rows
            rids = list(so.num_spec_tokens)
            return self.speculator.propose_ngram(rids, [self.input_batch.tokens_of(r) for r in rids],
                                                 [so.num_spec_tokens[r] for r in rids])
        scheduled = []
        num_computed = self.input_batch.num_computed
        for rid, n in so.num_scheduled_tokens.items():
            k = so.num_spec_tokens.get(rid, 0)
            end = int(num_computed[self.input_batch.row_of[rid]]) + (1 if rid in so.num_spec_tokens else n)
            scheduled.append((rid, self.requests[rid].token_ids, end, self.input_batch.blocks_of(rid).tolist(), k))
        return self.speculator.propose_draft_model(scheduled)

    def _plan_batch(self, so: SchedulerOutput, drafts: dict[str, list[int]]) -> _Batch:
        """Order the step decodes first (each group in schedule order) and find the rows that sample:
        vectorized over the input batch's arrays; Python touches only the speculating requests."""
        scheduled = so.num_scheduled_tokens
        rids = list(scheduled)
        lens = np.fromiter(scheduled.values(), dtype=np.int64, count=len(rids))
        speculating = np.zeros(len(rids), dtype=bool)
        if so.num_spec_tokens:
            index = {rid: i for i, rid in enumerate(rids)}
            for rid in so.num_spec_tokens:
                if rid in index:  # its last token and the drafts it got (maybe fewer than allowed)
                    speculating[index[rid]] = True
                    lens[index[rid]] = 1 + len(drafts.get(rid, ()))
        order = np.argsort(lens != 1, kind="stable")
        lens, speculating = lens[order], speculating[order]
        req_ids = [rids[i] for i in order.tolist()]
        rows = self.input_batch.rows_for(req_ids)
        starts = self.input_batch.num_computed[rows]
        last_rows = np.cumsum(lens) - 1
        samples = np.flatnonzero(~speculating & (starts + lens == self.input_batch.num_tokens[rows]))
        spec = np.flatnonzero(speculating)
        return _Batch(
            req_ids, lens.tolist(), starts.tolist(), last_rows[samples].tolist(), [req_ids[i] for i in samples.tolist()],
            drafts, spec_rows=np.flatnonzero(np.repeat(speculating, lens)).tolist(),
            spec_req_ids=[req_ids[i] for i in spec.tolist()], rows=rows, query_lens_np=lens,
        )

    def _prepare_inputs(self, batch: _Batch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        return self.input_batch.prepare(batch.req_ids, batch.query_lens_np, batch.drafts, rows=batch.rows)

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step. Returns the sampled tokens on the driver rank, None on the others."""
        self._update_states(so)
        kv_md = so.kv_connector_metadata
        if self.kv_hooks is not None and kv_md is not None:
            self.kv_hooks.start_load_kv(kv_md)  # releases go out now; loads run beside the forward pass
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(sampled_token_ids={}) if self.is_driver else None
        draft_start = time.perf_counter()
        drafts = self._propose_drafts(so)
        # The draft model's passes are model work, not host overhead (its argmax waits for the device).
        draft_model = self.speculator is not None and self.speculator.draft is not None
        draft_seconds = time.perf_counter() - draft_start if draft_model else 0.0
        batch = self._plan_batch(so, drafts)
        input_ids, positions, metadata = self._prepare_inputs(batch)

        if self.fault_injector is not None:
            for rid in batch.req_ids:
                self.fault_injector("forward", rid)
        timer = _ModelTimer(self.device)
        intermediate = None
        if not self.is_first_stage:
            intermediate = IntermediateTensors(**pp_recv_tensors(self.parallel, device=self.device))
        if self.graphs is not None and self.graphs.can_run(
            positions.shape[0], metadata, has_intermediate=intermediate is not None, has_kv_hooks=self.kv_hooks is not None
        ):
            hidden = self.graphs.run(input_ids, positions, metadata)
        else:
            hidden = self.model.forward(
                input_ids if self.is_first_stage else None,
                positions,
                self.kv_caches,
                metadata,
                intermediate=intermediate,
                kv_hooks=self.kv_hooks,
            )
        self.input_batch.advance(batch.rows, batch.query_lens_np)
        if not self.is_last_stage:
            pp_send_tensors(hidden.to_dict(), self.parallel)
            self._finish_kv_loads(kv_md)
            return None

        output = ModelRunnerOutput(sampled_token_ids={})
        self._finish_kv_loads(kv_md, output)
        output.prompt_logprobs = self._compute_prompt_logprobs(batch, hidden, output.failed)
        if batch.sample_rows:
            logits = self.model.compute_logits(hidden[batch.sample_rows])
            if self.is_driver:
                states = [self.requests[rid].sampling for rid in batch.sample_req_ids]
                self.sampler.fault_injector = (
                    None if self.fault_injector is None else functools.partial(self.fault_injector, "sample")
                )
                sampled = self.sampler.sample(logits, states, *self._bitmask_for(so, batch))
                for row, rid in enumerate(batch.sample_req_ids):
                    if row in sampled.errors:
                        output.failed[rid] = sampled.errors[row]
                        continue
                    output.sampled_token_ids[rid] = sampled.token_ids[row]
                    self.requests[rid].last_sampled_token_id = sampled.token_ids[row]
                    if sampled.logprobs[row] is not None:
                        output.logprobs[rid] = sampled.logprobs[row]
        if batch.spec_rows:
            self._verify_drafts(batch, hidden, output)
        for rid in output.failed:
            output.prompt_logprobs.pop(rid, None)
        if self.is_driver:  # (only the driver reports; on CUDA reading the timer waits for the device)
            output.model_seconds = timer.seconds() + draft_seconds
        return output if self.is_driver else None

    def _verify_drafts(self, batch: _Batch, hidden: torch.Tensor, output: ModelRunnerOutput) -> None:
        """Rejection-sample the speculating requests' positions: accepted drafts + one target token each."""
        logits = self.model.compute_logits(hidden[batch.spec_rows])
        if not self.is_driver:
            return
        states = [self.requests[rid].sampling for rid in batch.spec_req_ids]
        try:
            results, logprobs = self.speculator.verify(
                logits, [batch.drafts.get(rid, []) for rid in batch.spec_req_ids], states
            )
        except Exception as exc:  # no single request to blame: every speculating request of the step fails
            for rid in batch.spec_req_ids:
                output.failed[rid] = describe_failure(exc)
            return
        for rid, result, entries in zip(batch.spec_req_ids, results, logprobs):
            if entries is not None:
                output.spec_logprobs[rid] = entries
            output.sampled_token_ids[rid] = result.next_token_id
            output.spec_token_ids[rid] = list(result.accepted_token_ids)
            output.num_draft_tokens[rid] = len(batch.drafts.get(rid, ()))

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

    @staticmethod
    def _bitmask_for(so: SchedulerOutput, batch: _Batch) -> tuple[torch.Tensor | None, list[int] | None]:
        """The scheduler's grammar bitmask and, per bitmask row, the logits row it constrains."""
        if so.grammar_bitmask is None or not so.structured_output_req_ids:
            return None, None
        row_of = {rid: row for row, rid in enumerate(batch.sample_req_ids)}
        keep = [i for i, rid in enumerate(so.structured_output_req_ids) if rid in row_of]
        rows = [row_of[so.structured_output_req_ids[i]] for i in keep]
        bitmask = so.grammar_bitmask if len(keep) == len(so.structured_output_req_ids) else so.grammar_bitmask[keep]
        return bitmask, rows

    def _compute_prompt_logprobs(
        self, batch: _Batch, hidden: torch.Tensor, failed: dict[str, str]
    ) -> dict[str, list[list[tuple[int, float, int]] | None]]:
        """Logprobs of the prompt tokens covered by this step's chunk (token 0 gets None); a request
        whose computation raises goes to `failed` instead."""
        result: dict[str, list[list[tuple[int, float, int]] | None]] = {}
        if not self._prompt_logprob_reqs:
            return result
        offset = 0
        for rid, ql, start in zip(batch.req_ids, batch.query_lens, batch.start_positions):
            state = self.requests[rid]
            row0 = offset
            offset += ql
            if state.prompt_logprobs is None or start >= state.num_prompt_tokens:
                continue
            # Position p predicts prompt token p + 1.
            end = min(start + ql, state.num_prompt_tokens - 1)
            entries: list[list[tuple[int, float, int]] | None] = [None] if start == 0 else []
            if end > start:
                logits = self.model.compute_logits(hidden[row0 : row0 + (end - start)])
                targets = torch.tensor(state.token_ids[start + 1 : end + 1], dtype=torch.long, device=logits.device)
                if self.is_driver:
                    try:
                        entries.extend(compute_prompt_logprobs(logits, targets, state.prompt_logprobs))
                    except Exception as exc:
                        failed[rid] = describe_failure(exc)
                        continue
            result[rid] = entries
        return result
