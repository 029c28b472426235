"""The engine core's structured-output manager: compiles grammars off the step loop, keeps one
matcher per request and fills the token bitmask of the rows that sample a constrained token.

Compiles run in worker processes (`compile_pool.CompilePool`, one driving thread each): a compile
that runs past `compile_timeout` seconds is killed with its worker, so it fails its own requests
and holds no CPU, memory or worker afterwards. Compiled grammars are cached per engine by the
canonical spec, so equal specs (the n > 1 children of one request, or many clients sending one
schema) compile once and share the future; the cache is bounded in bytes (xgrammar's
`memory_size_bytes` of each grammar) and in entries, least recently used dropped first. A spec that
failed (a compile error, a timeout) stays cached as failed, so resending it costs no worker.
The xgrammar tokenizer info is built once, in a driving thread, from the HF tokenizer with the
model's vocabulary size (which may exceed the tokenizer's), and shipped to each worker. Matchers
live here, beside the scheduler: the bitmask travels to the workers in the scheduler output, so
any rank layout (TP, PP, Ray) sees the same mask, and after a preemption the matcher is simply kept
(the request's generated tokens are recomputed, not regenerated).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import torch
import xgrammar as xgr

from pagedserve.engine.structured_output.compile_pool import (
    CompileError,
    CompileFn,
    CompilePool,
    CompileTimeoutError,
    CompileWorkerDied,
)
from pagedserve.engine.structured_output.grammar import compile_spec
from pagedserve.engine.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Grammars kept per engine: at most this many entries (compiling, compiled or failed) ...
CACHE_SIZE = 512
# ... holding at most this many bytes of compiled grammars (a grammar larger than this is used by
# the requests that asked for it and not kept).
CACHE_BYTES = 256 * 1024 * 1024
# A request whose grammar has not compiled after this many seconds fails (finish_reason "error"),
# and a compile that runs this long is killed.
COMPILE_TIMEOUT_S = 60.0
# The data segment a compile worker may grow to (its imports take about 250 MB of it).
COMPILE_MEMORY_BYTES = 2 * 1024**3
# A spec whose compile failed (or was killed) fails again at once for this long, then is retried.
FAILURE_TTL_S = 300.0
# Failures that are the spec's own doing (cached as failed); anything else is not cached.
_SPEC_FAILURES = (CompileError, CompileTimeoutError, CompileWorkerDied)


@dataclass
class _Entry:
    """A cached compile: its future, the latest deadline of a request waiting for it, its size."""

    future: Future
    deadline: float
    nbytes: int = 0
    params: StructuredOutputsParams | None = field(default=None, repr=False)
    failed_at: float | None = None


class GrammarCache:
    """Compiles by canonical spec, least recently used first out, bounded in entries and in the bytes
    of the grammars compiled so far. Thread-safe (the engine thread adds, compile threads size)."""

    def __init__(self, max_entries: int = CACHE_SIZE, max_bytes: int = CACHE_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> _Entry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def add(self, key: str, entry: _Entry) -> None:
        with self._lock:
            self._entries[key] = entry
            self._evict()

    def set_size(self, key: str, entry: _Entry, nbytes: int) -> None:
        """A compile finished: count its grammar's bytes (if it is still cached) and evict to the budget."""
        with self._lock:
            if self._entries.get(key) is entry:
                entry.nbytes = nbytes
                self.nbytes += nbytes
                self._evict()

    def discard(self, key: str, entry: _Entry) -> None:
        with self._lock:
            if self._entries.get(key) is entry:
                self.nbytes -= self._entries.pop(key).nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0

    def _evict(self) -> None:
        while len(self._entries) > self.max_entries:
            self.nbytes -= self._entries.popitem(last=False)[1].nbytes
        if self.nbytes > self.max_bytes:  # compiled grammars go, least recently used first (not compiles)
            for key in [k for k, e in self._entries.items() if e.nbytes]:
                if self.nbytes <= self.max_bytes:
                    break
                self.nbytes -= self._entries.pop(key).nbytes


class StructuredOutputRequest:
    """One request's constraint: its compile future until it is ready, then its matcher."""

    def __init__(self, future: Future, submitted_at: float, stop_token_ids: list[int],
                 replay_token_ids: list[int] | None = None) -> None:
        self.future = future
        self.submitted_at = submitted_at
        self.stop_token_ids = stop_token_ids
        self.matcher: xgr.GrammarMatcher | None = None
        # Output tokens the request starts with (resumed, or a PD continuation's): the matcher accepts
        # them once it is made, so it stands where the run that generated them left it.
        self.replay_token_ids = list(replay_token_ids or ())

    def poll(self, now: float, timeout: float) -> str | None:
        """Make the matcher once the grammar is compiled. Returns an error message when the compile
        failed or took longer than `timeout` seconds, else None (check `is_ready`)."""
        if self.matcher is not None:
            return None
        if not self.future.done():
            if now - self.submitted_at > timeout:
                return f"structured_outputs: compiling the grammar took longer than {timeout:g} s"
            return None
        exc = self.future.exception()
        if exc is not None:
            return f"structured_outputs: the grammar failed to compile: {type(exc).__name__}: {exc}"
        self.matcher = xgr.GrammarMatcher(self.future.result(), override_stop_tokens=self.stop_token_ids)
        for token_id in self.replay_token_ids:
            if not self.matcher.accept_token(token_id):
                return f"structured_outputs: the grammar rejects the output token {token_id} the request resumes from"
        return None

    @property
    def is_ready(self) -> bool:
        return self.matcher is not None

    def accept(self, token_id: int) -> bool:
        assert self.matcher is not None
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()


class StructuredOutputManager:
    def __init__(
        self, tokenizer, vocab_size: int, compile_timeout: float = COMPILE_TIMEOUT_S, max_workers: int | None = None,
        cache_bytes: int = CACHE_BYTES, compile_memory_bytes: int | None = COMPILE_MEMORY_BYTES,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.compile_timeout = compile_timeout
        self.compile_memory_bytes = compile_memory_bytes
        # Two workers at least: one slow compile never holds every worker.
        self.num_workers = max_workers or max(2, min(4, (os.cpu_count() or 2) // 2))
        # What a worker runs: (xgr.GrammarCompiler, params) -> CompiledGrammar. A module-level function
        # (it travels to the worker by name); tests swap in one that fails or stalls on purpose.
        self.compile_fn: CompileFn = compile_spec
        self._threads = ThreadPoolExecutor(self.num_workers, thread_name_prefix="pagedserve-grammar")
        self._setup: Future[tuple[xgr.TokenizerInfo, CompilePool]] | None = None
        self._setup_lock = threading.Lock()
        self.cache = GrammarCache(CACHE_SIZE, cache_bytes)
        # Fills many rows' bitmasks at once on its own threads (the step loop waits for it).
        self._batch_filler = xgr.BatchGrammarMatcher(max_threads=max(1, min(8, os.cpu_count() or 1)))
        self.num_compiles = 0
        self.num_cache_hits = 0

    # ------------------------------------------------------------------ compiling

    def _make_pool(self) -> tuple[xgr.TokenizerInfo, CompilePool]:
        info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
        pool = CompilePool(info.serialize_json(), self.num_workers, self.compile_memory_bytes)
        try:
            pool.start()  # every worker imports side by side, instead of one by one as compiles come
        except Exception as exc:  # noqa: BLE001 - each job starts its worker again (and fails alone)
            logger.warning("starting the grammar compile workers failed: %r", exc)
        return info, pool

    def _ready(self) -> tuple[xgr.TokenizerInfo, CompilePool]:
        """The tokenizer info and the worker pool (made once per engine, on a driving thread)."""
        with self._setup_lock:
            if self._setup is None:
                self._setup = Future()
                try:
                    self._setup.set_result(self._make_pool())
                except BaseException as exc:
                    self._setup.set_exception(exc)
        return self._setup.result()

    def start(self) -> None:
        """Build the tokenizer info and start the compile workers now (else on the first compile)."""
        self._ready()[1].start()

    @property
    def pool(self) -> CompilePool | None:
        """The worker pool, once made."""
        return None if self._setup is None or not self._setup.done() else self._setup.result()[1]

    def submit(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """The compile of `params`, shared with every earlier request with the same spec."""
        key = params.cache_key()
        deadline = time.monotonic() + self.compile_timeout
        entry = self.cache.get(key)
        if entry is not None and entry.failed_at is not None and time.monotonic() - entry.failed_at > FAILURE_TTL_S:
            self.cache.discard(key, entry)
            entry = None
        if entry is not None:
            entry.deadline = max(entry.deadline, deadline)
            self.num_cache_hits += 1
            return entry.future
        entry = _Entry(Future(), deadline, params=params)
        self.cache.add(key, entry)
        self.num_compiles += 1
        self._threads.submit(self._compile, key, entry)
        return entry.future

    def _compile(self, key: str, entry: _Entry) -> None:
        """On a driving thread: compile `entry` in a worker, unless every request that waited for it has
        already given up (then it is dropped, not cached as failed: the spec itself may be fine). A
        failure of the spec's own (an error, a kill at the time limit) stays cached for FAILURE_TTL_S."""
        if not entry.future.set_running_or_notify_cancel():
            return
        try:
            if time.monotonic() > entry.deadline:
                raise TimeoutError(f"compiling the grammar took longer than {self.compile_timeout:g} s "
                                   "(it waited for a free compile worker)")
            info, pool = self._ready()
            assert entry.params is not None
            text = pool.compile(self.compile_fn, entry.params, self.compile_timeout)
            compiled = xgr.CompiledGrammar.deserialize_json(text, info)
        except BaseException as exc:
            if isinstance(exc, _SPEC_FAILURES):
                entry.failed_at = time.monotonic()
            else:
                self.cache.discard(key, entry)
            entry.future.set_exception(exc)
        else:
            self.cache.set_size(key, entry, compiled.memory_size_bytes)
            entry.future.set_result(compiled)
        finally:
            entry.params = None

    def new_request(self, params: StructuredOutputsParams, stop_token_ids: set[int],
                    replay_token_ids: list[int] | None = None) -> StructuredOutputRequest:
        return StructuredOutputRequest(self.submit(params), time.monotonic(), sorted(stop_token_ids),
                                       replay_token_ids)

    def wait_any(self, requests: list[StructuredOutputRequest], timeout: float) -> None:
        """Block up to `timeout` seconds until one of the pending compiles finishes (an idle engine
        waiting only for grammars sleeps here instead of spinning)."""
        pending = [r.future for r in requests if not r.future.done()]
        if pending:
            wait_futures(pending, timeout=timeout, return_when="FIRST_COMPLETED")

    # ------------------------------------------------------------------ per step

    def fill_bitmask(self, requests: list[StructuredOutputRequest]) -> torch.Tensor:
        """[len(requests), ceil(vocab / 32)] int32: the tokens each matcher allows next."""
        bitmask = xgr.allocate_token_bitmask(len(requests), self.vocab_size)
        matchers = [r.matcher for r in requests]
        assert all(m is not None for m in matchers), "fill_bitmask: a request's grammar is not ready"
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self._batch_filler.batch_fill_next_token_bitmask(matchers, bitmask)
        return bitmask

    def clear_cache(self) -> None:
        """Forget compiled grammars (the benchmark's cold-compile figure; the workers keep none)."""
        self.cache.clear()

    def shutdown(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        pool = self.pool
        if pool is not None:
            pool.shutdown()
