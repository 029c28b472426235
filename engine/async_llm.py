"""`AsyncLLM`: an asyncio front over one engine, for serving.

The engine steps on a dedicated background thread (torch releases the GIL in its
kernels, so the event loop stays responsive). Callers talk to it through a command
queue; each request's outputs flow back into its own asyncio queue, a step's outputs
handed to each event loop in one call (`output_streams`). All engine state is touched by
the engine thread only.

The engine is also built on that thread (model load, warm-up, KV sizing), so that on CPU every
parallel region of its life runs from one thread. OpenMP (libgomp) keeps a thread pool per thread
that opens regions, and once its pools hold more threads than the machine has CPUs it stops spinning
between regions: each of a step's hundreds of regions then waits on a futex wake. An engine built on
the caller's thread and stepped on this one ran the 64-request default-model workload at 0.74x the
offline speed (2 cores); built here, at the same speed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.kv_events import KVEventBatch, KVSnapshot
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.output_processor import CHECKPOINT_INTERVAL_S, DELTA_KINDS, OutputKind
from pagedserve.engine.output_streams import Outbox, OutputStream, OutputStreams
from pagedserve.engine.outputs import EmbeddingRequestOutput, RequestOutput, SchedulerStats
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.processor import PromptType
from pagedserve.engine.sampling_params import SamplingParams, bad_words_token_ids

logger = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """The bounded request queue is full; retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; in-flight requests fail with this."""


class StreamEndedError(RuntimeError):
    """A `generate()` stream ended by `AsyncLLM.end_streams`: its request was aborted for its caller, who
    asked for the stream to end with this instead of waiting on outputs an aborted request never sends."""


class EngineStoppedError(EngineDeadError):
    """The engine was shut down (its replica drained: scale-down, rolling update) with this request
    unfinished; what it streamed stands, and a serving layer may continue it on another engine."""


@dataclass
class AsyncEngineStats:
    scheduler: SchedulerStats
    num_unfinished: int
    last_step_time: float
    engine_alive: bool
    healthy: bool


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        max_pending_requests: int = 1024,
        stall_timeout_s: float = 120.0,
        stream_interval: int | str = 1,
    ) -> None:
        """`stream_interval`: a DELTA stream sends at most one output per this many generated tokens of a
        completion (`delta_coalescer`: the first tokens, a finish and an error go at once); "auto": as many
        as the open streams call for (`delta_coalescer.auto_interval`), 1 while they are few."""
        self._outputs = OutputStreams(stream_interval)  # (validates the interval)
        self.max_pending_requests = max_pending_requests
        self.stall_timeout_s = stall_timeout_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # The streams of live generate() calls by request id, for end_streams(); touched by callers only.
        self._open_streams: dict[str, OutputStream] = {}
        self._pending_aborts: list[str] = []  # engine thread only
        self._ids = itertools.count()
        self._stopped = threading.Event()
        self._dead_error: BaseException | None = None
        self._last_progress = time.monotonic()
        self._num_unfinished = 0
        # Live generate() streams (the bound on pending requests); touched by callers only.
        self._num_active = 0
        built: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._build_and_run, args=(config, built), name="pagedserve-engine",
                                        daemon=True)
        self._thread.start()
        self.engine: LLMEngine
        built.result()  # the thread has set self.engine; re-raises what building it raised (a bad config: ValueError)
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer

    @property
    def stream_interval(self) -> int | str:
        return self._outputs.stream_interval

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "AsyncLLM":
        async_keys = {"max_pending_requests", "stall_timeout_s", "stream_interval"}
        async_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in async_keys}
        return cls(EngineConfig(model=model, **kwargs), **async_kwargs)

    # ------------------------------------------------------------------ public API

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        output_kind: OutputKind = OutputKind.DELTA,
        lora_request: LoRARequest | None = None,
        checkpoint_interval_s: float = CHECKPOINT_INTERVAL_S,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (deltas by default; CUMULATIVE: each output holds everything so
        far). Bad input raises ValueError before the first output; the request is aborted if the caller
        stops iterating (client disconnect). FINAL_ONLY yields only the finished output, for a caller that
        reads nothing before the end (its text is then decoded once, not token by token); CHECKPOINT, for one
        that reads only the end but must know what was generated, yields deltas at most once per
        `checkpoint_interval_s` and the finished one (the text decoded once, into the finishing delta)."""
        self._raise_if_dead()
        request_id = request_id or f"req-{next(self._ids)}"
        if self._num_active >= self.max_pending_requests:
            raise EngineOverloadedError(
                f"the engine has {self._num_active} unfinished requests (limit {self.max_pending_requests})"
            )
        loop = asyncio.get_running_loop()
        self._num_active += 1
        stream = self._outputs.open(loop, output_kind)
        # Open from the first step of this call (before any await), so end_streams() finds it; a request id
        # already open stays the other call's (the engine refuses this one's add).
        registered = self._open_streams.setdefault(request_id, stream) is stream
        added: concurrent.futures.Future | None = None
        finished = accepted = False
        try:
            # Tokenized here, in a thread: never on the engine thread, between two steps of every request.
            bad_words_ids = None
            if isinstance(sampling_params, SamplingParams) and sampling_params.bad_words:
                bad_words_ids = await asyncio.to_thread(bad_words_token_ids, sampling_params.bad_words,
                                                        self.tokenizer)
            if not stream.queue.empty():  # ended (end_streams) before it was added: never add it
                raise stream.queue.get_nowait()
            added = concurrent.futures.Future()
            self._commands.put(("add", (request_id, prompt, sampling_params, priority, output_kind, stream,
                                        bad_words_ids, lora_request, checkpoint_interval_s), added))
            await asyncio.wrap_future(added)  # raises the processor's ValueError, if any
            accepted = True
            # Met while merging: a failure (an exception, or an output that carries the request's error) goes
            # out on its own after what came before it, so a consumer that fell behind still gets the tokens
            # made before the request failed (an HTTP stream has then started: the error is sent in-band).
            held_back: RequestOutput | BaseException | None = None
            while True:
                if held_back is not None:
                    item, held_back = held_back, None
                else:
                    item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                # Several steps' deltas waiting (a slow consumer, e.g. an HTTP stream): send them as one.
                while (output_kind in DELTA_KINDS and not item.finished and item.error is None
                       and not stream.queue.empty()):
                    later = stream.queue.get_nowait()
                    if isinstance(later, BaseException) or later.error is not None:
                        held_back = later
                        break
                    item.add(later)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._num_active -= 1
            if registered:
                del self._open_streams[request_id]
            if accepted and not finished:
                self._commands.put(("abort", [request_id], None))
            elif not accepted and added is not None:
                # Never abort by id a request this call did not add: a refused add (e.g. the id is in use)
                # names another caller's request. A caller that left while its add was being applied
                # aborts it once the add is through.
                added.add_done_callback(lambda future: self._abort_if_added(future, request_id))  # type: ignore[misc]

    def _abort_if_added(self, future: concurrent.futures.Future, request_id: str) -> None:
        if not future.cancelled() and future.exception() is None:
            self._commands.put(("abort", [request_id], None))

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[EmbeddingRequestOutput]:
        """An embedding request (vLLM's name): yields its one finished `EmbeddingRequestOutput`. Its
        prefill runs in the same continuous batch as the generations; ValueError on bad input."""
        if not isinstance(pooling_params, PoolingParams):
            raise ValueError("pooling_params: expected a PoolingParams")
        async for output in self.generate(prompt, pooling_params, request_id, priority,  # type: ignore[arg-type]
                                          output_kind=OutputKind.FINAL_ONLY):
            yield output  # type: ignore[misc]

    def release_kv(self, holds: list[tuple[str, str]]) -> None:
        """Prefill producer: readers are done with these holds' KV, each (hold id, hold token) (thread-safe)."""
        self.engine.release_kv(list(holds))

    @property
    def num_kv_blocks(self) -> int:
        return self.engine.num_kv_blocks

    def kv_read(self, rank: int, token: str, spec: Any, layers: list[int], auth: Any) -> list:
        """Prefill producer: one rank's held KV for a PD consumer (blocking; call it off the event loop)."""
        return self.engine.kv_read(rank, token, spec, layers, auth)

    def kv_rank_endpoints(self) -> list:
        return self.engine.kv_rank_endpoints()

    def kv_offload_tier(self) -> Any:
        """The offload tier's scheduler side (its `location`, `block_bytes`, thread-safe `adopt`), or None
        without a tier: what the engine host serves peers from and fetches into (kv_transfer/offload/remote.py)."""
        if self.config.kv_offload_size is None:
            return None
        connector = self.engine.engine_core.kv_connector
        return getattr(connector, "offload", connector)

    def rank_node_ids(self) -> list[str | None]:
        return self.engine.rank_node_ids()

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", [request_id], None))

    def end_streams(self, request_ids: list[str]) -> None:
        """Abort these requests and end their `generate()` streams with `StreamEndedError`, after the outputs
        already on their way (an aborted request itself sends nothing more). For a serving layer that must
        answer an abort on the stream itself, without racing every output against an abort signal. Any
        thread may call it; ids without a live stream are only aborted."""
        for request_id in request_ids:
            stream = self._open_streams.get(request_id)
            if stream is None:
                continue
            stream.put(StreamEndedError(f"request {request_id!r} was aborted"))
        if request_ids:
            self._commands.put(("abort", list(request_ids), None))

    async def abort_requests(self, request_ids: list[str]) -> None:
        """Abort many requests with one engine command (one batched abort in the engine core)."""
        if request_ids:
            self._commands.put(("abort", list(request_ids), None))

    def kv_events_since(self, seq: int) -> list[KVEventBatch] | None:
        """The engine's KV event batches after `seq` (None: no longer all retained; take a snapshot)."""
        return self.engine.engine_core.kv_events.since(seq)

    def kv_sizes(self) -> tuple[int, dict[str, int]]:
        """(seq, hashes each KV tier held right after batch seq): what a consumer's view must hold."""
        return self.engine.engine_core.kv_events.sizes()

    async def kv_snapshot(self) -> KVSnapshot:
        """Every hash the engine's KV tiers hold and the sequence number it is current to, taken on the
        engine thread between two steps (so that it agrees with the event batches around it)."""
        self._raise_if_dead()
        taken: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("kv_snapshot", None, taken))
        return await asyncio.wrap_future(taken)

    def get_stats(self) -> AsyncEngineStats:
        return AsyncEngineStats(
            scheduler=self._stats,
            num_unfinished=self._num_unfinished,
            last_step_time=self._last_progress,
            engine_alive=self._thread.is_alive() and self._dead_error is None,
            healthy=self.is_healthy(),
        )

    def is_healthy(self) -> bool:
        """Unhealthy when the loop died, or when work is waiting and no step has finished for too long."""
        if self._dead_error is not None or not self._thread.is_alive():
            return False
        stalled = self._num_unfinished > 0 and time.monotonic() - self._last_progress > self.stall_timeout_s
        return not stalled

    async def check_health(self) -> None:
        self._raise_if_dead()
        if not self.is_healthy():
            raise EngineDeadError(f"the engine made no progress for {self.stall_timeout_s:.0f}s with work waiting")

    def shutdown(self) -> None:
        """Stop the engine; requests still running end with `EngineStoppedError` (not left hanging)."""
        if not self._stopped.is_set():
            self._stopped.set()
            self._commands.put(("stop", None, None))
            self._thread.join(timeout=30)
            if not self._thread.is_alive():  # the streams are ours now
                for request_id in self._outputs.request_ids():
                    self._outputs.deliver(request_id, EngineStoppedError(
                        f"the engine shut down before request {request_id!r} finished"))
            self.engine.shutdown()

    # ------------------------------------------------------------------ the engine thread

    def _raise_if_dead(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead_error!r}")

    def _handle_command(self, command: tuple) -> bool:
        kind, payload, future = command
        if kind == "abort":  # collected: the aborts of one drain reach the engine as one batch
            for request_id in payload:
                self._outputs.forget(request_id)
            self._pending_aborts.extend(payload)
            return True
        self._flush_aborts()  # an abort sent before an add is applied before it
        if kind == "stop":
            return False
        if kind == "kv_snapshot":
            future.set_result(self.engine.engine_core.kv_events.snapshot())
            return True
        if kind == "add":
            request_id, prompt, params, priority, output_kind, stream, bad_words_ids, lora_request, interval = payload
            if not future.set_running_or_notify_cancel():
                return True  # its caller left before the add was applied: nothing to add
            try:
                self.engine.add_request(request_id, prompt, params, priority=priority, output_kind=output_kind,
                                        bad_words_ids=bad_words_ids, lora_request=lora_request,
                                        checkpoint_interval_s=interval)
            except BaseException as exc:  # bad input: only this request fails
                future.set_exception(exc)
            else:
                self._outputs.add(request_id, stream)
                future.set_result(None)
        return True

    def _flush_aborts(self) -> None:
        if self._pending_aborts:
            request_ids, self._pending_aborts = self._pending_aborts, []
            self.engine.abort_request(request_ids)

    def _build_and_run(self, config: EngineConfig, built: concurrent.futures.Future[None]) -> None:
        """Build the engine on this thread (see the module docstring: one thread opens every parallel
        region of it), hand it to the constructor, then step it."""
        try:
            engine = LLMEngine(config)
            self._stats = engine.get_stats()
        except BaseException as exc:
            built.set_exception(exc)
            return
        self.engine = engine
        built.set_result(None)
        self._run()

    def _run(self) -> None:
        try:
            running = True
            while running:
                idle = not self.engine.has_unfinished_requests()
                try:
                    command = self._commands.get(timeout=0.5) if idle else self._commands.get_nowait()
                except queue.Empty:
                    command = None
                while command is not None and running:
                    running = self._handle_command(command)
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        command = None
                self._flush_aborts()
                if not running:
                    break
                if idle:  # a prefill producer frees released / expired KV holds even with no work
                    self.engine.free_released_kv()
                if self.engine.has_unfinished_requests():
                    outbox: Outbox = {}
                    try:
                        for output in self.engine.step():
                            self._outputs.deliver(output.request_id, output, outbox)
                    finally:  # what was made goes out before any failure is delivered
                        self._outputs.send(outbox)
                    if self.engine.engine_core.executor.is_failed:
                        # Its workers are gone: every later step would fail too. Stop, so that the
                        # waiting requests fail now and a supervisor (the engine actor) can restart us.
                        raise EngineDeadError("the executor failed: its workers are gone")
                self._last_progress = time.monotonic()
                self._num_unfinished = self.engine.get_num_unfinished_requests()
                self._stats = self.engine.get_stats()
        except BaseException as exc:  # the engine broke: fail every in-flight request clearly
            logger.exception("engine loop died")
            self._dead_error = exc
            error = EngineDeadError(f"the engine failed: {exc!r}")
            for request_id in self._outputs.request_ids():
                self._outputs.deliver(request_id, error)
            self._fail_pending_adds(error)

    def _fail_pending_adds(self, error: BaseException) -> None:
        while True:
            try:
                kind, _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None and not future.done():  # an add or a snapshot
                future.set_exception(error)
