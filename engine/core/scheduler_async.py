"""The scheduler's side of batches in flight (mixed into `Scheduler`): pipeline parallelism and async
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
from typing import TYPE_CHECKING

from pagedserve.engine.core.request import Request

if TYPE_CHECKING:
    from pagedserve.engine.config import EngineConfig
    from pagedserve.engine.core.kv_cache_manager import KVCacheManager


class InFlightSteps:
    """The batches in flight per request, oldest first: how many of its tokens each computes and whether
    it samples a token. A request scheduled ahead sits in two batches at once."""

    def __init__(self) -> None:
        self._steps: dict[str, deque[tuple[int, bool]]] = {}
        # Requests whose batches in flight computed over KV found invalid -> how many of those batches
        # are still to come back (their results are dropped).
        self._void: dict[str, int] = {}

    def add(self, request_id: str, num_tokens: int, samples: bool) -> None:
        self._steps.setdefault(request_id, deque()).append((num_tokens, samples))

    def pop(self, request_id: str) -> bool:
        """The request's oldest batch came back; True when its result is void (see `void`)."""
        steps = self._steps.get(request_id)
        if steps is None:
            return False
        steps.popleft()
        if not steps:
            del self._steps[request_id]
        num_void = self._void.get(request_id, 0)
        if num_void:
            if num_void == 1:
                del self._void[request_id]
            else:
                self._void[request_id] = num_void - 1
        return bool(num_void)

    def void(self, request_id: str) -> None:
        """Every batch of the request now in flight read invalid KV: drop their results when they return."""
        if request_id in self._steps:
            self._void[request_id] = len(self._steps[request_id])

    def is_void(self, request_id: str) -> bool:
        return request_id in self._void

    def steps(self, request_id: str) -> tuple[tuple[int, bool], ...]:
        return tuple(self._steps.get(request_id, ()))

    def num_tokens(self, request_id: str) -> int:
        """Tokens its batches in flight compute (their `num_computed_tokens` is already counted)."""
        return sum(n for n, _ in self._steps.get(request_id, ()))

    def num_pending_outputs(self, request_id: str) -> int:
        """Tokens its batches in flight will sample."""
        return sum(samples for _, samples in self._steps.get(request_id, ()))

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._steps

    def __bool__(self) -> bool:
        return bool(self._steps)

    def __len__(self) -> int:
        return len(self._steps)


class AsyncSchedulingMixin:
    kv_cache_manager: KVCacheManager
    requests: dict[str, Request]
    max_model_len: int

    def _init_in_flight(self, config: EngineConfig) -> None:
        self.async_scheduling = config.async_scheduling
        self._in_flight = InFlightSteps()
        # Finished requests whose blocks a batch in flight still writes: freed when it comes back.
        self._deferred_frees: dict[str, Request] = {}

    def _tokens_ahead(self, request: Request) -> int:
        """Its known tokens plus the placeholders: the tokens its batches in flight will sample."""
        return request.num_tokens + self._in_flight.num_pending_outputs(request.request_id)

    def _held_in_flight(self, request: Request) -> bool:
        """Whether a batch in flight keeps this running request out of the step being scheduled."""
        if request.request_id not in self._in_flight:
            return False
        if self._in_flight.is_void(request.request_id):
            return True  # rolled back: it resumes once the batches that read the invalid KV are back
        return not (self.async_scheduling and self._can_schedule_ahead(request))

    def _can_schedule_ahead(self, request: Request) -> bool:
        steps = self._in_flight.steps(request.request_id)
        if len(steps) != 1 or not steps[0][1]:
            return False  # one step ahead at most, and only behind a step that samples its next input
        if request.structured_output is not None:
            return False  # the grammar's bitmask for the next token needs the real last token
        # The pending token ends it by length: a step scheduled ahead would only be thrown away.
        return request.num_output_tokens + 1 < request.max_tokens and request.num_tokens + 1 < self.max_model_len

    def _mark_in_flight(self, request: Request, num_tokens: int) -> None:
        """Record a scheduled batch (call before `num_computed_tokens` moves past it)."""
        samples = request.num_computed_tokens + num_tokens >= self._tokens_ahead(request)
        self._in_flight.add(request.request_id, num_tokens, samples)

    def _step_returned(self, request_id: str) -> bool:
        """The request's oldest batch came back; True when its result is to be dropped (it read invalid KV)."""
        void = self._in_flight.pop(request_id)
        if request_id not in self._in_flight:
            request = self._deferred_frees.pop(request_id, None)
            if request is not None:
                self.kv_cache_manager.free(request)
        return void

    def _free_blocks(self, request: Request) -> None:
        if self.async_scheduling and request.request_id in self._in_flight:
            self._deferred_frees[request.request_id] = request
        else:
            self.kv_cache_manager.free(request)

    def is_draining(self, request_id: str) -> bool:
        """A finished request whose batch is still in flight: a new request may not take its id yet (that
        batch's result would land on it)."""
        return request_id in self._in_flight and request_id not in self.requests
