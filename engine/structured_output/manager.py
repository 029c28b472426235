"""The engine core's structured-output manager: compiles grammars off the step loop, keeps one
matcher per request and fills the token bitmask of the rows that sample a constrained token.

Compiles run in a small thread pool and are cached per engine by the canonical spec, so equal
specs (the n > 1 children of one request, or many clients sending one schema) compile once and
share the future. The xgrammar tokenizer info is built once, in the pool, from the HF tokenizer
with the model's vocabulary size (which may exceed the tokenizer's). Matchers live here, beside
the scheduler: the bitmask travels to the workers in the scheduler output, so any rank layout
(TP, PP, Ray) sees the same mask, and after a preemption the matcher is simply kept (the request's
generated tokens are recomputed, not regenerated).
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import torch
import xgrammar as xgr

from pagedserve.engine.structured_output.grammar import compile_spec
from pagedserve.engine.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Compiled grammars kept per engine (their futures; least recently used dropped first).
CACHE_SIZE = 512
# A request whose grammar has not compiled after this many seconds fails (finish_reason "error").
COMPILE_TIMEOUT_S = 60.0


class StructuredOutputRequest:
    """One request's constraint: its compile future until it is ready, then its matcher."""

    def __init__(self, future: Future, submitted_at: float, stop_token_ids: list[int]) -> None:
        self.future = future
        self.submitted_at = submitted_at
        self.stop_token_ids = stop_token_ids
        self.matcher: xgr.GrammarMatcher | None = None

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
        self, tokenizer, vocab_size: int, compile_timeout: float = COMPILE_TIMEOUT_S, max_workers: int | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.compile_timeout = compile_timeout
        workers = max_workers or max(1, min(4, (os.cpu_count() or 2) // 2))
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="pagedserve-grammar")
        self._compiler: Future[xgr.GrammarCompiler] | None = None
        self._cache: OrderedDict[str, Future[xgr.CompiledGrammar]] = OrderedDict()
        # Fills many rows' bitmasks at once on its own threads (the step loop waits for it).
        self._batch_filler = xgr.BatchGrammarMatcher(max_threads=max(1, min(8, os.cpu_count() or 1)))
        self.num_compiles = 0
        self.num_cache_hits = 0

    # ------------------------------------------------------------------ compiling

    def _make_compiler(self) -> xgr.GrammarCompiler:
        info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
        return xgr.GrammarCompiler(info, max_threads=2)

    def compiler(self) -> xgr.GrammarCompiler:
        """The grammar compiler (built once per engine, in the pool)."""
        if self._compiler is None:
            self._compiler = self._pool.submit(self._make_compiler)
        return self._compiler.result()

    def submit(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """The compile of `params`, shared with every earlier request with the same spec."""
        key = params.cache_key()
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            self.num_cache_hits += 1
            return future
        if self._compiler is None:
            self._compiler = self._pool.submit(self._make_compiler)
        future = self._pool.submit(self._compile, params)
        self._cache[key] = future
        self.num_compiles += 1
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        compiled = compile_spec(self.compiler(), params)
        logger.debug("compiled a %s grammar in %.1f ms", params.kind, 1000 * (time.perf_counter() - start))
        return compiled

    def new_request(self, params: StructuredOutputsParams, stop_token_ids: set[int]) -> StructuredOutputRequest:
        return StructuredOutputRequest(self.submit(params), time.monotonic(), sorted(stop_token_ids))

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
        """Forget compiled grammars (the benchmark's cold-compile figure); xgrammar's own too."""
        self._cache.clear()
        if self._compiler is not None and self._compiler.done() and self._compiler.exception() is None:
            self._compiler.result().clear_cache()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
