"""Headless engine actors: one `AsyncLLM` per Ray actor, stepping continuously, many requests in flight.

The actor is an async Ray actor (high `max_concurrency`); `generate` is a Ray streaming generator
that yields the engine's DELTA `RequestOutput`s (or, for a caller that reads only the end, `final_only`,
one finished output). An engine with TP/PP > 1 builds its own worker
group inside the actor through the engine's "ray" executor backend.

Failure model: actors are restartable (`max_restarts`) with `max_task_retries=0`, so the calls in
flight when an actor dies fail (the coordinator turns that into `EngineDeadError` for those requests
only) instead of being replayed silently. If the engine loop inside a live actor dies, a watchdog
thread exits the process so that Ray restarts it.

Options and helpers beyond the basic actor (all optional keywords):
- `EngineActor.__init__(..., stall_timeout_s=120.0)` and `start_engine_actors(..., max_pending_requests=1024,
  stall_timeout_s=120.0, max_concurrency=None)`.
- `wait_engines_ready(engines, timeout_s=None) -> list[dict]`: block until every actor's `ready()` answers.
- `EngineActor.abort` ends that request's `generate` stream with one final output whose
  `finish_reason` is "abort" (the engine itself emits nothing for an aborted request);
  `abort_requests(ids)` does the same for many requests in one call.
- `get_stats()` also returns "num_unfinished", "incarnation" (new on every actor (re)start), "stats_time"
  and "num_stream_outputs" (objects `generate` has yielded, all streams together).

Streams: `generate` sends the prompt once, in a stream's first output (`stream_transport`), and pauses
when `STREAM_BACKPRESSURE_OBJECTS` outputs wait unread; what the engine produces meanwhile merges into
the next delta. Placement: see `placement` (an engine on CUDA reserves its GPUs from Ray).
- `ready()` also returns "max_num_seqs", "max_num_batched_tokens", "model", "served_model_name",
  "tensor_parallel_size", "pipeline_parallel_size", "device", "pid", "node_id" and "restarted" (True after a
  Ray restart).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
import warnings
from collections.abc import AsyncIterator
from typing import Any

import ray
import torch
from ray.exceptions import ActorUnavailableError
from pydantic import ValidationError

from pagedserve.cluster.fleet_stats import ENGINE_FIGURES
from pagedserve.cluster.executor.placement import (
    pinned_engine_kwargs,
    plan_engine_placement,
    restrict_to_assigned_gpus,
    warn_if_gpus_short,
)
from pagedserve.cluster.executor.ray_utils import ensure_ray, use_reserved_cpus
from pagedserve.cluster.serve.stream_transport import STREAM_BACKPRESSURE_OBJECTS, PromptElider
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.lora.request import pop_lora_request
from pagedserve.engine.output_processor import OutputKind
from pagedserve.engine.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)



def _plain_value_error(exc: ValueError) -> ValueError:
    """pydantic's ValidationError does not survive Ray's pickling/re-wrapping well: send a plain ValueError."""
    if isinstance(exc, ValidationError) or type(exc) is not ValueError:
        return ValueError(str(exc))
    return exc


def _abort_output(request_id: str, prompt: str | dict,
                  params: SamplingParams | PoolingParams) -> RequestOutput | EmbeddingRequestOutput:
    prompt_ids = list(prompt.get("prompt_token_ids", [])) if isinstance(prompt, dict) else []
    text = prompt if isinstance(prompt, str) else None
    if isinstance(params, PoolingParams):
        return EmbeddingRequestOutput(request_id, text, prompt_ids, EmbeddingOutput([]), error="aborted")
    n = params.n
    outputs = [
        CompletionOutput(index=i, text="", token_ids=[], cumulative_logprob=None, logprobs=None, finish_reason="abort")
        for i in range(n)
    ]
    return RequestOutput(request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
                         prompt_token_ids=prompt_ids, prompt_logprobs=None, outputs=outputs, finished=True)


def _node_id() -> str | None:
    """The Ray node this engine runs on (None outside Ray)."""
    try:
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001
        return None


async def _cancel_and_wait(future: asyncio.Future) -> None:
    if not future.done():
        future.cancel()
    await asyncio.gather(future, return_exceptions=True)


class EngineActor:
    """Hosts one engine. Wrapped with `ray.remote` by `start_engine_actors` (usable without Ray in tests)."""

    def __init__(
        self,
        engine_kwargs: dict,
        engine_index: int,
        max_pending_requests: int = 1024,
        stall_timeout_s: float = 120.0,
    ) -> None:
        self.engine_index = engine_index
        restrict_to_assigned_gpus()  # before anything initialises CUDA in this process
        use_reserved_cpus(engine_kwargs.get("cpu_threads"))
        # Identifies this incarnation of the actor: a restarted actor's counters start again from zero.
        self.incarnation = uuid.uuid4().hex
        self.engine = AsyncLLM(EngineConfig(**engine_kwargs), max_pending_requests=max_pending_requests,
                               stall_timeout_s=stall_timeout_s)
        # request_id -> set by abort() to end that request's generate() stream.
        self._aborts: dict[str, asyncio.Event] = {}
        self._num_stream_outputs = 0
        self._stopped = threading.Event()
        self._watchdog = threading.Thread(target=self._watch_engine, name="engine-watchdog", daemon=True)
        self._watchdog.start()

    # ------------------------------------------------------------------ the engine's parts, in one place

    @property
    def executor(self) -> Any:
        """This engine's executor: a worker group (one Ray actor per rank) or one worker in this process."""
        return self.engine.engine.engine_core.executor

    @property
    def num_kv_blocks(self) -> int:
        return self.engine.engine.engine_core.num_blocks

    def rank_node_ids(self) -> list[str | None]:
        """The Ray node of each of this engine's ranks (this actor's own for an in-process worker)."""
        group = getattr(self.executor, "group", None)
        return [rank.node_id for rank in group.ranks] if group is not None else [_node_id()]

    # ------------------------------------------------------------------ remote API

    async def ready(self) -> dict:
        config = self.engine.config
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                restarted = ray.get_runtime_context().was_current_actor_reconstructed
        except Exception:  # noqa: BLE001 - not running inside a Ray actor
            restarted = False
        return {
            "engine_index": self.engine_index,
            "num_kv_blocks": self.num_kv_blocks,
            "block_size": config.block_size,
            "max_model_len": config.max_model_len,
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "model": config.model,
            "served_model_name": config.served_model_name,
            "tensor_parallel_size": config.tensor_parallel_size,
            "pipeline_parallel_size": config.pipeline_parallel_size,
            "device": config.device,
            "pid": os.getpid(),
            "torch_threads": torch.get_num_threads(),
            "node_id": _node_id(),
            "restarted": bool(restarted),
        }

    @ray.method(num_returns="streaming", _generator_backpressure_num_objects=STREAM_BACKPRESSURE_OBJECTS)
    async def generate(
        self, request_id: str, prompt: str | dict, sampling_params: dict, priority: int = 0,
        final_only: bool = False, pooling_params: dict | None = None,
    ) -> AsyncIterator[RequestOutput | EmbeddingRequestOutput]:
        """Stream DELTA outputs, the prompt only in the first (see `stream_transport`). With `final_only`
        (the caller reads nothing before the end: a non-streaming HTTP request) the stream is one output,
        the finished one with every token (OutputKind.FINAL_ONLY: its text is decoded once, not per step).
        ValueError (bad input), EngineOverloadedError and EngineDeadError propagate. With `pooling_params`
        (PoolingParams fields) it is an embedding request (`AsyncLLM.encode`): one finished
        EmbeddingRequestOutput; `sampling_params` is ignored."""
        try:
            sampling_params, lora_request = pop_lora_request(sampling_params)
            if pooling_params is not None:
                params: SamplingParams | PoolingParams = PoolingParams(**pooling_params)
            else:
                params = SamplingParams(**sampling_params)
        except ValueError as exc:
            raise _plain_value_error(exc) from None
        if request_id in self._aborts:
            raise ValueError(f"request_id: {request_id!r} is already running on engine {self.engine_index}")
        aborted = asyncio.Event()
        self._aborts[request_id] = aborted
        if isinstance(params, PoolingParams):
            stream = self.engine.encode(prompt, params, request_id=request_id, priority=priority)
        else:
            stream = self.engine.generate(prompt, params, request_id=request_id, priority=priority,
                                          output_kind=OutputKind.FINAL_ONLY if final_only else OutputKind.DELTA,
                                          lora_request=lora_request)
        elide = PromptElider()
        abort_wait = asyncio.ensure_future(aborted.wait())
        next_output: asyncio.Future | None = None
        try:
            while True:
                # Race the next output against abort(): the engine emits nothing for an aborted request.
                next_output = asyncio.ensure_future(anext(stream))
                await asyncio.wait({next_output, abort_wait}, return_when=asyncio.FIRST_COMPLETED)
                if not next_output.done():
                    await _cancel_and_wait(next_output)
                    self._num_stream_outputs += 1
                    yield elide(_abort_output(request_id, prompt, params))
                    return
                try:
                    output = next_output.result()
                except StopAsyncIteration:
                    return
                except ValueError as exc:
                    raise _plain_value_error(exc) from None
                # Counted before the yield: the generator may pause there (backpressure).
                self._num_stream_outputs += 1
                yield elide(output)
        finally:
            abort_wait.cancel()
            self._aborts.pop(request_id, None)
            if next_output is not None:
                await _cancel_and_wait(next_output)  # the generator must be idle before aclose()
            await stream.aclose()  # aborts the engine request if it did not finish

    async def abort(self, request_id: str) -> None:
        await self.abort_requests([request_id])

    async def abort_requests(self, request_ids: list[str]) -> None:
        """Abort many requests in one call (one engine command): a mass disconnect costs one RPC."""
        for request_id in request_ids:
            aborted = self._aborts.get(request_id)
            if aborted is not None:
                aborted.set()
        await self.engine.abort_requests(request_ids)

    async def get_stats(self) -> dict:
        stats = self.engine.get_stats()
        out: dict[str, Any] = {"engine_index": self.engine_index}
        out.update({key: getattr(stats.scheduler, key) for key in ENGINE_FIGURES})
        out["num_unfinished"] = stats.num_unfinished
        out["healthy"] = stats.healthy
        now = time.monotonic()
        out["last_step_age_s"] = max(0.0, now - stats.last_step_time)
        out["incarnation"] = self.incarnation
        out["stats_time"] = now  # orders answers of one incarnation (concurrent polls may arrive out of order)
        out["num_stream_outputs"] = self._num_stream_outputs
        out["kv_transfer"] = dict(stats.scheduler.kv_transfer or {})
        out["spec_decoding"] = dict(stats.scheduler.spec_decoding or {})
        out["lora"] = dict(stats.scheduler.lora or {})
        return out

    async def check_health(self) -> None:
        await self.engine.check_health()

    # ------------------------------------------------------------------ KV transfer (cluster/pd)

    async def kv_rank_actors(self) -> list:
        """Per rank, the actor a PD consumer reads that rank's KV from: None for a rank in this process."""
        from pagedserve.cluster.pd.rank_server import rank_actors

        return rank_actors(self.executor, self.engine.config.world_size)

    async def kv_read(self, rank: int, token: str, spec: Any, layers: list[int], auth: Any) -> list:
        """A PD consumer reads the KV of a rank in this process (signed: cluster/pd/read_auth.py; off the
        event loop)."""
        from pagedserve.cluster.pd.rank_server import read_local

        return await asyncio.to_thread(read_local, self.executor, rank, token, spec, layers, auth)

    async def kv_release(self, request_id: str, hold_token: str) -> None:
        """A PD consumer is done with a finished prefill's KV: free its blocks (only with the hold's token)."""
        self.engine.release_kv([(request_id, hold_token)])

    def shutdown(self) -> None:
        self._stopped.set()
        self.engine.shutdown()

    # ------------------------------------------------------------------ watchdog

    def _watch_engine(self) -> None:
        """If the engine loop dies (not merely stalls), exit so that Ray restarts the actor."""
        while not self._stopped.wait(1.0):
            if not self.engine.get_stats().engine_alive:
                logger.error("engine %d: the engine loop died; exiting so that Ray restarts this actor",
                             self.engine_index)
                time.sleep(1.0)  # let the in-flight requests receive their EngineDeadError
                if not self._stopped.is_set():
                    self._on_engine_death()
                return

    def _on_engine_death(self) -> None:
        os._exit(1)  # a crash (not a clean exit_actor) so that Ray restarts the actor


def start_engine_actors(
    engine_kwargs: dict,
    data_parallel_size: int,
    num_cpus_per_engine: float = 1,
    name_prefix: str | None = None,
    max_restarts: int = -1,
    max_pending_requests: int = 1024,
    stall_timeout_s: float = 120.0,
    max_concurrency: int | None = None,
) -> list[ray.actor.ActorHandle]:
    """Create `data_parallel_size` restartable engine actors (not waiting for them; see `wait_engines_ready`)."""
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size: must be >= 1, got {data_parallel_size}")
    if num_cpus_per_engine < 0:
        raise ValueError(f"num_cpus_per_engine: must be >= 0, got {num_cpus_per_engine}")
    if max_pending_requests < 1:
        raise ValueError(f"max_pending_requests: must be >= 1, got {max_pending_requests}")
    EngineConfig(**engine_kwargs)  # fail fast in the caller on bad engine arguments
    ensure_ray()
    concurrency = max_concurrency or max_pending_requests + 64  # + room for stats/health/abort calls
    resources = ray.cluster_resources()
    options, pinned_kwargs = engine_actor_options(engine_kwargs, num_cpus_per_engine, resources,
                                                  max_restarts=max_restarts, max_concurrency=concurrency)
    warn_if_gpus_short(data_parallel_size, pinned_kwargs, resources)
    actor_cls = ray.remote(EngineActor)
    engines = []
    for index in range(data_parallel_size):
        named = dict(options, name=f"{name_prefix}-{index}") if name_prefix is not None else options
        engines.append(
            actor_cls.options(**named).remote(pinned_kwargs, index, max_pending_requests, stall_timeout_s)
        )
    return engines


def engine_actor_options(
    engine_kwargs: dict,
    num_cpus_per_engine: float,
    cluster_resources: dict[str, float],
    max_restarts: int = -1,
    max_concurrency: int = 1088,
) -> tuple[dict[str, Any], dict]:
    """Ray actor options for one engine on a cluster with these resources, and its engine kwargs with
    `device` pinned to what the options reserve (an engine on CUDA holds its GPUs; see `placement`)."""
    placement = plan_engine_placement(engine_kwargs, cluster_resources)
    options: dict[str, Any] = dict(
        placement.actor_options(num_cpus_per_engine),
        max_restarts=max_restarts,
        max_task_retries=0,
        max_concurrency=max_concurrency,
    )
    return options, pinned_engine_kwargs(engine_kwargs, placement)


def wait_engines_ready(engines: list[ray.actor.ActorHandle], timeout_s: float | None = None) -> list[dict]:
    """Block until every engine has loaded its model; returns their `ready()` answers in order.

    A restarting actor rejects calls (ActorUnavailableError) until it is back: retry until `timeout_s`.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    answers: list[dict] = []
    for engine in engines:
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                answers.append(ray.get(engine.ready.remote(), timeout=remaining))
                break
            except ActorUnavailableError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)
    return answers
