"""The synchronous engine: processor -> engine core -> output processor. `LLM` and `AsyncLLM` drive it."""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.output_processor import CHECKPOINT_INTERVAL_S, OutputKind, OutputProcessor, ParentRequest
from pagedserve.engine.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    EngineCoreOutput,
    RequestOutput,
    SchedulerStats,
)
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.processor import Processor, PromptType
from pagedserve.engine.tokenizer import load_tokenizer
from pagedserve.engine.core.request import RequestStatus
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config if config.hf_config is not None else config.resolve()
        self.tokenizer = load_tokenizer(self.config.tokenizer or self.config.model)
        self.engine_core = EngineCore(self.config, self.tokenizer)
        self.processor = Processor(self.config, self.tokenizer, self.engine_core.kv_cache_capacity_tokens)
        self.output_processor = OutputProcessor(self.tokenizer)
        # parent request id -> its child engine request ids (n > 1)
        self._children: dict[str, list[str]] = {}
        self._step_seconds = 0.0  # cumulative wall time of step() (SchedulerStats.step_seconds)
        # Embedding requests in the engine -> their prompt (text, token ids).
        self._embeddings: dict[str, tuple[str | None, list[int]]] = {}
        self._lora_requests: Counter[str] = Counter()  # requests per adapter name (SchedulerStats.lora)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        output_kind: OutputKind = OutputKind.FINAL_ONLY,
        bad_words_ids: list[list[int]] | None = None,
        lora_request: LoRARequest | None = None,
        checkpoint_interval_s: float = CHECKPOINT_INTERVAL_S,
    ) -> None:
        """Validate and queue a request; raises ValueError (naming the field) on bad input. With
        PoolingParams it is an embedding request: one finished `EmbeddingRequestOutput` reports it.
        `bad_words_ids`: `params.bad_words` already tokenized (else they are tokenized here).
        `lora_request`: the LoRA adapter it runs under (None: the base model). `checkpoint_interval_s`:
        an `OutputKind.CHECKPOINT` request's seconds between outputs."""
        self.engine_core.check_executor()
        if request_id in self._children or request_id in self.output_processor.states or request_id in self._embeddings:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        arrival_time = time.time() if arrival_time is None else arrival_time
        text, request = self.processor.process(request_id, prompt, params, priority, arrival_time, bad_words_ids,
                                               lora_request)
        if lora_request is not None:
            self._lora_requests[lora_request.lora_name] += 1
        if isinstance(params, PoolingParams):  # an embedding: reported by this engine, not the output processor
            self.engine_core.add_request(request)
            self._embeddings[request_id] = (text, request.prompt_token_ids)
            return
        if params.n == 1:
            self.output_processor.add_request(
                request_id, text, request.prompt_token_ids, params, arrival_time, output_kind,
                prefilled_output_ids=request.output_token_ids, checkpoint_interval_s=checkpoint_interval_s,
            )
            self.engine_core.add_request(request)
            return
        parent = ParentRequest(request_id, params.n)
        children: list[str] = []
        for index in range(params.n):
            child_params = params.child(index)
            child_id = f"{request_id}#{index}"
            child_prompt = {"prompt_token_ids": request.prompt_token_ids, "cache_salt": request.cache_salt}
            _, child = self.processor.process(child_id, child_prompt, child_params, priority, arrival_time,
                                              request.bad_words_token_ids, lora_request)
            self.output_processor.add_request(
                child_id, text, request.prompt_token_ids, child_params, arrival_time, output_kind, parent, index,
                checkpoint_interval_s=checkpoint_interval_s,
            )
            self.engine_core.add_request(child)
            children.append(child_id)
        self._children[request_id] = children

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        engine_ids: list[str] = []
        for rid in ids:
            engine_ids.extend(self._children.pop(rid, [rid]))
        for rid in engine_ids:
            self.output_processor.abort_request(rid)
            self._embeddings.pop(rid, None)
        self.engine_core.abort_requests(engine_ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.engine_core.scheduler.get_num_unfinished_requests()

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        start = time.perf_counter()
        try:
            return self._step()
        finally:
            self._step_seconds += time.perf_counter() - start

    def _step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        core_outputs = self.engine_core.step()
        embeddings: list[EmbeddingRequestOutput] = []
        if self._embeddings:
            embeddings = [self._embedding_output(out) for out in core_outputs
                          if out.request_id in self._embeddings and out.finished]
            core_outputs = [out for out in core_outputs if out.request_id not in self._embeddings]
            for out in embeddings:
                del self._embeddings[out.request_id]
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        if stopped:
            self.engine_core.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
        for out in outputs:
            if out.finished:
                self._children.pop(out.request_id, None)
        return [*outputs, *embeddings] if embeddings else outputs

    def _embedding_output(self, out: EngineCoreOutput) -> EmbeddingRequestOutput:
        text, prompt_token_ids = self._embeddings[out.request_id]
        error = out.error
        if out.pooled is None and error is None:  # finished without its vector ("length": it never fits)
            error = f"the request finished without an embedding ({out.finish_reason})"
        return EmbeddingRequestOutput(
            request_id=out.request_id, prompt=text, prompt_token_ids=prompt_token_ids,
            outputs=EmbeddingOutput([] if out.pooled is None else out.pooled.tolist()),
            num_cached_tokens=out.num_cached_tokens, error=error,
        )

    def release_kv(self, holds: list[tuple[str, str]]) -> None:
        """Prefill producer: readers are done with these holds' KV, each (hold id, hold token) (see
        EngineCore.release_kv)."""
        self.engine_core.release_kv(holds)

    def free_released_kv(self) -> int:
        return self.engine_core.free_released_kv()

    @property
    def num_kv_blocks(self) -> int:
        return self.engine_core.num_blocks

    def kv_read(self, rank: int, token: str, spec: Any, layers: list[int], auth: Any) -> list:
        """Prefill producer: a PD consumer reads one rank's held KV (`Worker.kv_read`, through the executor)."""
        return self.engine_core.executor.rank_rpc(rank, "kv_read", (token, spec, layers, auth))

    def kv_rank_endpoints(self) -> list:
        """Per rank, what answers `kv_read` for it in its own process, or None (`kv_read` here)."""
        return self.engine_core.executor.kv_rank_endpoints()

    def rank_node_ids(self) -> list[str | None]:
        return self.engine_core.executor.rank_node_ids()

    def get_stats(self) -> SchedulerStats:
        stats = self.engine_core.get_stats()
        stats.step_seconds = self._step_seconds
        if self.config.enable_lora:
            stats.lora = {"loads": 0, "evictions": 0, "disk_loads": 0, "resident": [], **stats.lora,
                          "requests": dict(self._lora_requests)}
        return stats

    def forget_lora(self, lora_int_id: int) -> None:
        """An adapter was unloaded: its id is checked again if a request names it later."""
        self.processor.forget_lora(lora_int_id)

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
