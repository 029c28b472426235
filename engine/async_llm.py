"""`AsyncLLM`: an asyncio front over one engine, for serving.

The engine steps on a dedicated background thread (torch releases the GIL in its
kernels, so the event loop stays responsive). Callers talk to it through a command
queue; each request's outputs flow back into its own asyncio queue. All engine
state is touched by the engine thread only.
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
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.output_processor import OutputKind
from pagedserve.engine.outputs import RequestOutput, SchedulerStats
from pagedserve.engine.processor import PromptType
from pagedserve.engine.sampling_params import SamplingParams, bad_words_token_ids

logger = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """The bounded request queue is full; retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; in-flight requests fail with this."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


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
    ) -> None:
        self.engine = LLMEngine(config)
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.max_pending_requests = max_pending_requests
        self.stall_timeout_s = stall_timeout_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._pending_aborts: list[str] = []  # engine thread only
        self._ids = itertools.count()
        self._stopped = threading.Event()
        self._dead_error: BaseException | None = None
        self._last_progress = time.monotonic()
        self._num_unfinished = 0
        # Live generate() streams (the bound on pending requests); touched by callers only.
        self._num_active = 0
        self._stats = self.engine.get_stats()
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "AsyncLLM":
        async_keys = {"max_pending_requests", "stall_timeout_s"}
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
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (deltas by default; CUMULATIVE: each output holds everything so
        far). Bad input raises ValueError before the first output; the request is aborted if the caller
        stops iterating (client disconnect). FINAL_ONLY yields only the finished output, for a caller that
        reads nothing before the end (its text is then decoded once, not token by token)."""
        self._raise_if_dead()
        request_id = request_id or f"req-{next(self._ids)}"
        if self._num_active >= self.max_pending_requests:
            raise EngineOverloadedError(
                f"the engine has {self._num_active} unfinished requests (limit {self.max_pending_requests})"
            )
        loop = asyncio.get_running_loop()
        self._num_active += 1
        # Tokenized here, in a thread: never on the engine thread, between two steps of every request.
        bad_words_ids = None
        if isinstance(sampling_params, SamplingParams) and sampling_params.bad_words:
            try:
                bad_words_ids = await asyncio.to_thread(bad_words_token_ids, sampling_params.bad_words,
                                                        self.tokenizer)
            except BaseException:
                self._num_active -= 1
                raise
        stream = _Stream(loop, asyncio.Queue())
        added: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", (request_id, prompt, sampling_params, priority, output_kind, stream, bad_words_ids),
                            added))
        finished = False
        try:
            await asyncio.wrap_future(added)  # raises the processor's ValueError, if any
            error: BaseException | None = None  # met while merging: raised after what came before it
            while True:
                if error is not None:
                    raise error
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                # Several steps' deltas waiting (a slow consumer, e.g. an HTTP stream): send them as one.
                while output_kind == OutputKind.DELTA and not item.finished and not stream.queue.empty():
                    later = stream.queue.get_nowait()
                    if isinstance(later, BaseException):
                        error = later
                        break
                    item.add(later)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._num_active -= 1
            if not finished:
                self._commands.put(("abort", [request_id], None))

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

    def rank_node_ids(self) -> list[str | None]:
        return self.engine.rank_node_ids()

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", [request_id], None))

    async def abort_requests(self, request_ids: list[str]) -> None:
        """Abort many requests with one engine command (one batched abort in the engine core)."""
        if request_ids:
            self._commands.put(("abort", list(request_ids), None))

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
        if not self._stopped.is_set():
            self._stopped.set()
            self._commands.put(("stop", None, None))
            self._thread.join(timeout=30)
            self.engine.shutdown()

    # ------------------------------------------------------------------ the engine thread

    def _raise_if_dead(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead_error!r}")

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if isinstance(item, BaseException) or item.finished:
            del self._streams[request_id]
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is gone
            pass

    def _handle_command(self, command: tuple) -> bool:
        kind, payload, future = command
        if kind == "abort":  # collected: the aborts of one drain reach the engine as one batch
            for request_id in payload:
                self._streams.pop(request_id, None)
            self._pending_aborts.extend(payload)
            return True
        self._flush_aborts()  # an abort sent before an add is applied before it
        if kind == "stop":
            return False
        if kind == "add":
            request_id, prompt, params, priority, output_kind, stream, bad_words_ids = payload
            try:
                self.engine.add_request(request_id, prompt, params, priority=priority, output_kind=output_kind,
                                        bad_words_ids=bad_words_ids)
            except BaseException as exc:  # bad input: only this request fails
                future.set_exception(exc)
            else:
                self._streams[request_id] = stream
                future.set_result(None)
        return True

    def _flush_aborts(self) -> None:
        if self._pending_aborts:
            request_ids, self._pending_aborts = self._pending_aborts, []
            self.engine.abort_request(request_ids)

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
                    for output in self.engine.step():
                        self._deliver(output.request_id, output)
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
            for request_id in list(self._streams):
                self._deliver(request_id, error)
            self._fail_pending_adds(error)

    def _fail_pending_adds(self, error: BaseException) -> None:
        while True:
            try:
                kind, _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add" and future is not None and not future.done():
                future.set_exception(error)
