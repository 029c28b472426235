"""The batches handed to the workers whose results have not come back: pipeline parallelism and async
scheduling (vLLM's `async_scheduling`).

With async scheduling the engine schedules step N+1 while step N runs. A running decode whose step-N
token is not back yet may be scheduled again with an output placeholder: the scheduler counts the token
step N will sample as known (its `num_computed_tokens` already covers step N), and the worker, which
sampled that token itself, appends it before building step N+1's inputs. When step N's output lands the
token is appended and the stop checks run as in a synchronous step; a request that finished at step N is
gone when step N+1's result comes back, so that result is dropped, and its blocks are freed only then
(until then step N+1 still writes them; a failing step N+1 must still be able to uncache them).

Only one step is scheduled ahead, and only for a request whose next input does not depend on the host:
no grammar (its bitmask needs the real last token) and not when step N's token will end it by length.
"""

from __future__ import annotations

from collections import deque

from pagedserve.engine.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.core.request import Request


class InFlight:
    """Per request, its batches in flight, oldest first: how many of its tokens each computes and whether
    it samples a token (a request scheduled ahead sits in two batches at once); which of them read KV
    found invalid (their results are dropped); and the finished requests whose blocks wait for them."""

    def __init__(self, async_scheduling: bool, max_model_len: int, kv_cache_manager: KVCacheManager) -> None:
        self.async_scheduling = async_scheduling
        self.max_model_len = max_model_len
        self.kv_cache_manager = kv_cache_manager
        self._steps: dict[str, deque[tuple[int, bool]]] = {}
        # Requests whose batches in flight computed over KV found invalid -> how many of those batches
        # are still to come back (their results are dropped).
        self._void: dict[str, int] = {}
        # Finished requests whose blocks a batch in flight still writes: freed when it comes back.
        self._deferred_frees: dict[str, Request] = {}

    # ------------------------------------------------------------------ scheduling

    def tokens_ahead(self, request: Request) -> int:
        """Its known tokens plus the placeholders: the tokens its batches in flight will sample."""
        steps = self._steps.get(request.request_id)
        return request.num_tokens + (sum(samples for _, samples in steps) if steps else 0)

    def holds(self, request: Request) -> bool:
        """Whether a batch in flight keeps this running request out of the step being scheduled."""
        steps = self._steps.get(request.request_id)
        if steps is None:
            return False
        if request.request_id in self._void:
            return True  # rolled back: it resumes once the batches that read the invalid KV are back
        return not (self.async_scheduling and self._can_schedule_ahead(request, steps))

    def _can_schedule_ahead(self, request: Request, steps: deque[tuple[int, bool]]) -> bool:
        if len(steps) != 1 or not steps[0][1]:
            return False  # one step ahead at most, and only behind a step that samples its next input
        if request.structured_output is not None:
            return False  # the grammar's bitmask for the next token needs the real last token
        # The pending token ends it by length: a step scheduled ahead would only be thrown away.
        return request.num_output_tokens + 1 < request.max_tokens and request.num_tokens + 1 < self.max_model_len

    def add(self, request: Request, num_tokens: int) -> None:
        """Record a scheduled batch (call before `num_computed_tokens` moves past it)."""
        # (an embedding request samples nothing: its last prefill chunk leaves no placeholder behind)
        samples = (request.pooling_params is None
                   and request.num_computed_tokens + num_tokens >= self.tokens_ahead(request))
        self._steps.setdefault(request.request_id, deque()).append((num_tokens, samples))

    # ------------------------------------------------------------------ results

    def returned(self, request_id: str) -> bool:
        """The request's oldest batch came back; True when its result is to be dropped (it read invalid
        KV). A finished request's deferred blocks are freed once its last batch is back."""
        steps = self._steps.get(request_id)
        void = False
        if steps is not None:
            steps.popleft()
            if not steps:
                del self._steps[request_id]
            num_void = self._void.get(request_id, 0)
            if num_void:
                if num_void == 1:
                    del self._void[request_id]
                else:
                    self._void[request_id] = num_void - 1
            void = bool(num_void)
        if request_id not in self._steps:
            request = self._deferred_frees.pop(request_id, None)
            if request is not None:
                self.kv_cache_manager.free(request)
        return void

    def num_tokens(self, request_id: str) -> int:
        """Tokens its batches in flight compute (their `num_computed_tokens` is already counted)."""
        return sum(n for n, _ in self._steps.get(request_id, ()))

    def void(self, request_id: str) -> None:
        """Every batch of the request now in flight read invalid KV: drop their results when they return."""
        if request_id in self._steps:
            self._void[request_id] = len(self._steps[request_id])

    def free_blocks(self, request: Request) -> None:
        """Free a finished request's blocks, or, while a batch scheduled ahead still writes them, once it
        is back."""
        if self.async_scheduling and request.request_id in self._steps:
            self._deferred_frees[request.request_id] = request
        else:
            self.kv_cache_manager.free(request)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._steps

    def __bool__(self) -> bool:
        return bool(self._steps)

    def __len__(self) -> int:
        return len(self._steps)
