"""Requests that survive the engine serving them: `MigratingClient` wraps any `EngineClient`.

It watches what each streamed request has delivered to its client. When the inner stream fails with
`EngineDeadError` (the replica died, its node or a TP/PP rank was lost, Serve's health check found it
stalled, or its engine was shut down with the request unfinished: `EngineStoppedError`, which is how a
draining replica hands back what outlived its graceful window), it
resubmits the request to the inner client as a continuation (engine/resume.py: the prompt, the output
tokens already delivered, the original sampling parameters; the inner client's router then picks a
healthy replica) and the client's stream goes on: no error, no repeated or missing token, usage that
counts each token once, and `cumulative_logprob` continued token by token from where it stood. A
completion of an `n > 1` request that had started continues on its own (its own seed), as the n == 1
request the engine ran it as; a request that had delivered nothing is resubmitted whole.

Non-streaming requests (`final_only`) migrate the same way: their engines send their token-id deltas
too, merged into one output per checkpoint interval (the engine's `OutputKind.CHECKPOINT`: no per-step
detokenization or transport), so a continuation starts from the last checkpoint the router received and
the serving layer joins the deltas of both engines into one answer (`streams.collect`). Only embedding
requests (one output, nothing to continue from) are computed again.

Each request migrates at most `max_migrations` times, then fails with a clean `EngineDeadError`
(503 `engine_dead`). A request an engine refuses for load (`EngineOverloadedError`: its queue is full)
is submitted again up to `max_overload_retries` times after a short backoff, before or after it
started (the router passes the refusing replica over for a moment, `CircuitBreaker.refused`, and
weighs the others' load);
only then does the refusal reach the client (503 `overloaded`). Under Serve a replica at its
`max_ongoing_requests` already hands the request to the router's next choice itself; these retries
cover the engine's own queue limit and every other shape. Migrations and retries are logged with the
request id and counted in the stats the HTTP layer's /metrics reads (`fault_tolerance`:
`migrations`, `migration_failures`, `overload_retries`), and each is an event on the request's trace
(`record_event`: `migration`, `overload_retry`, `migration_failed`), whose resubmission's routing
decision `routing_records` hands over marked with its attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagedserve.cluster.fleet_stats import FleetStats
from pagedserve.cluster.serving.request_stages import record_event
from pagedserve.cluster.stream_merge import merge_streams
from pagedserve.engine.async_llm import EngineDeadError, EngineOverloadedError
from pagedserve.engine.lora.request import SAMPLING_KEY as LORA_KEY
from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.engine.resume import resume_params
from pagedserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_MIGRATIONS = 3
# A request an overloaded engine refused is submitted again (the router then weighs that engine's load)
# at most this many times, waiting this long times the retry's number first; then the refusal stands (503).
DEFAULT_MAX_OVERLOAD_RETRIES = 2
OVERLOAD_BACKOFF_S = 0.2
# A request whose engine failed again waits this long times its migrations so far before the next one
# (the first goes at once): a router learns of a dead replica a moment after its requests do.
MIGRATION_BACKOFF_S = 0.5


@dataclass
class _Completion:
    """What one completion has delivered to the client so far."""

    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    finished: bool = False
    # Since a migration the engine's cumulative_logprob starts from 0: it is summed here instead.
    resumed: bool = False


@dataclass
class _Leg:
    """One inner stream of a request: the whole request (index None) or one resumed completion."""

    request_id: str
    index: int | None
    stream: AsyncIterator[RequestOutput]


class MigratingClient:
    """An `EngineClient` whose streams survive engine failures (see the module docstring)."""

    def __init__(self, inner: Any, max_migrations: int = DEFAULT_MAX_MIGRATIONS,
                 max_overload_retries: int = DEFAULT_MAX_OVERLOAD_RETRIES) -> None:
        if max_migrations < 0:
            raise ValueError(f"max_migrations: expected >= 0, got {max_migrations}")
        if max_overload_retries < 0:
            raise ValueError(f"max_overload_retries: expected >= 0, got {max_overload_retries}")
        self.inner = inner
        self.max_migrations = max_migrations
        self.max_overload_retries = max_overload_retries
        self.num_migrations = 0  # resubmissions after an engine failure
        self.num_migration_failures = 0  # requests that failed with max_migrations used up
        self.num_overload_retries = 0  # resubmissions after an engine refused a request for load
        self._legs: dict[str, list[str]] = {}  # request id -> the inner request ids now running
        self._issued: dict[str, list[tuple[int, str]]] = {}  # request id -> (attempt, inner id) submitted

    # ------------------------------------------------------------------ generate

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling_params: dict,
                       priority: int = 0, final_only: bool = False, cache_salt: str | None = None,
                       pooling_params: dict | None = None) -> AsyncIterator[RequestOutput]:
        """The inner client's `generate`, continued on another engine when the one serving it fails. An
        embedding request (`pooling_params`: one output, nothing streamed before it) is computed again."""
        tries = _Tries(request_id)
        submit = _Submitter(self.inner, list(prompt_token_ids), priority, cache_salt, final_only, pooling_params,
                            tries)
        self._issued[request_id] = submit.issued
        if pooling_params is not None:
            stream = self._restarting(tries, submit, sampling_params)
        else:
            stream = self._continuing(tries, submit, sampling_params)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()
            self._legs.pop(request_id, None)
            self._issued.pop(request_id, None)

    async def _restarting(self, tries: _Tries, submit: _Submitter, params: dict) -> AsyncIterator[RequestOutput]:
        """An embedding request: computed again on another engine; each try's outputs are kept until it
        finishes, so that a try that fails after some leaves nothing behind."""
        request_id = tries.request_id
        while True:
            leg_id = tries.leg_id()
            self._legs[request_id] = [leg_id]
            outputs: list[RequestOutput] = []
            try:
                async with contextlib.aclosing(submit(leg_id, params)) as stream:
                    async for output in stream:
                        outputs.append(dataclasses.replace(output, request_id=request_id))
            except (EngineDeadError, EngineOverloadedError) as exc:
                await self._retry(tries, exc, delivered=0)
                continue
            for output in outputs:
                yield output
            return

    async def _continuing(self, tries: _Tries, submit: _Submitter, params: dict) -> AsyncIterator[RequestOutput]:
        request_id = tries.request_id
        # A LoRA adapter rides beside the sampling params (engine.lora.request.SAMPLING_KEY): every
        # continuation carries it, so a migrated request goes on under its adapter.
        original = SamplingParams(**{k: v for k, v in params.items() if k != LORA_KEY})
        completions = [_Completion() for _ in range(original.n)]
        legs = [_Leg(tries.leg_id(), None, submit(tries.leg_id(), params))]
        while True:
            self._legs[request_id] = [leg.request_id for leg in legs]
            merged = _merge(legs)
            try:
                async for leg, output in merged:
                    yield _relabel(request_id, leg, output, completions)
                    if all(c.finished for c in completions):
                        return
                raise EngineDeadError(f"the engine ended request {request_id!r} before it finished")
            except (EngineDeadError, EngineOverloadedError) as exc:
                await self._retry(tries, exc, sum(len(c.token_ids) for c in completions))
            finally:
                await merged.aclose()
            legs = self._continuations(tries.leg_id(), submit, params, original, completions)

    def _continuations(self, leg_id: str, submit: _Submitter, params: dict, original: SamplingParams,
                       completions: list[_Completion]) -> list[_Leg]:
        """The legs that continue a request after a failure: the whole request again when nothing had
        been delivered, else one resumed n == 1 request per unfinished completion."""
        if not any(c.token_ids or c.finished for c in completions):
            return [_Leg(leg_id, None, submit(leg_id, params))]
        legs = []
        for index, completion in enumerate(completions):
            if completion.finished:
                continue
            completion.resumed = True
            child_params = resume_params(original, completion.token_ids, index).model_dump()
            if params.get(LORA_KEY) is not None:
                child_params[LORA_KEY] = params[LORA_KEY]
            child_id = f"{leg_id}.{index}"
            legs.append(_Leg(child_id, index, submit(child_id, child_params)))
        return legs

    async def _retry(self, tries: _Tries, exc: BaseException, delivered: int) -> None:
        """Count a failed try and wait before the next one; raise when the request has none left: the
        clean EngineDeadError once `max_migrations` are used up, the refusal itself once the overload
        retries are."""
        rid = tries.request_id
        tries.submissions += 1
        trace = {"pagedserve.retry.attempt": tries.submissions, "pagedserve.retry.reason": type(exc).__name__,
                 "pagedserve.retry.error": str(exc)[:200], "pagedserve.retry.tokens_delivered": delivered}
        if isinstance(exc, EngineOverloadedError):
            if tries.overloads >= self.max_overload_retries:
                raise exc
            tries.overloads += 1
            self.num_overload_retries += 1
            logger.info("request %s: refused (%s); retrying (%d of at most %d)", rid, exc, tries.overloads,
                        self.max_overload_retries)
            event = record_event("overload_retry", **trace)
            await asyncio.sleep(OVERLOAD_BACKOFF_S * tries.overloads)
            if event is not None:
                event.end = time.time()
            return
        if tries.migrations >= self.max_migrations:
            self.num_migration_failures += 1
            record_event("migration_failed", **trace)
            logger.error("request %s: its engine failed again (%s) and it has used its %d migrations; giving up",
                         rid, exc, self.max_migrations)
            raise EngineDeadError(f"request {rid!r} failed: its engine failed and the request was already "
                                  f"migrated {self.max_migrations} times (max_migrations); last failure: {exc}") from None
        tries.migrations += 1
        self.num_migrations += 1
        logger.warning("request %s: %s: %s; migrating it (%d of at most %d) with %d tokens delivered",
                       rid, type(exc).__name__, exc, tries.migrations, self.max_migrations, delivered)
        event = record_event("migration", **trace)
        await asyncio.sleep(MIGRATION_BACKOFF_S * (tries.migrations - 1))
        if event is not None:
            event.end = time.time()

    # ------------------------------------------------------------------ the rest of EngineClient

    def routing_records(self, request_id: str) -> list[dict]:
        """The inner client's routing decisions for every submission of `request_id` (for its trace;
        taken), each resubmission's marked with its `attempt` (the trace's retry event of that number)."""
        take = getattr(self.inner, "routing_records", None)
        if take is None:
            return []
        records = []
        for attempt, inner_id in self._issued.get(request_id) or [(0, request_id)]:
            records += [{**r, "attempt": attempt} if attempt else r for r in take(inner_id)]
        return records

    async def abort(self, request_id: str) -> None:
        for leg_id in self._legs.get(request_id, [request_id]):
            await self.inner.abort(leg_id)

    def aggregate_stats(self) -> FleetStats:
        return self._with_counts(self.inner.aggregate_stats())

    def latest_stats(self) -> FleetStats:
        return self._with_counts(self.inner.latest_stats())

    def is_healthy(self) -> bool:
        return self.inner.is_healthy()

    def _with_counts(self, stats: FleetStats) -> FleetStats:
        fault = dict(stats.fault_tolerance or {})
        fault.update(migrations=self.num_migrations, migration_failures=self.num_migration_failures,
                     overload_retries=self.num_overload_retries)
        return stats.replace(fault_tolerance=fault)

    def __getattr__(self, name: str) -> Any:
        """Whatever else the wrapped client offers (its shape's own API)."""
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


@dataclass
class _Submitter:
    """Submits one request (or one of its continuations) to the inner client."""

    inner: Any
    prompt_token_ids: list[int]
    priority: int
    cache_salt: str | None
    final_only: bool = False
    pooling_params: dict | None = None
    tries: _Tries | None = None
    issued: list[tuple[int, str]] = field(default_factory=list)  # (attempt, inner request id), bounded by the tries

    def __call__(self, request_id: str, params: dict) -> AsyncIterator[RequestOutput]:
        self.issued.append((0 if self.tries is None else self.tries.submissions, request_id))
        extra = {} if self.pooling_params is None else {"pooling_params": self.pooling_params}
        return self.inner.generate(request_id, self.prompt_token_ids, params, self.priority,
                                   final_only=self.final_only, cache_salt=self.cache_salt, **extra)


@dataclass
class _Tries:
    """One request's submissions so far: what it has used of its migrations and overload retries."""

    request_id: str
    submissions: int = 0
    migrations: int = 0
    overloads: int = 0

    def leg_id(self) -> str:
        """The inner request id of this submission: a resubmission never reuses one an engine may still hold."""
        return self.request_id if self.submissions == 0 else f"{self.request_id}~m{self.submissions}"


def _relabel(request_id: str, leg: _Leg, output: RequestOutput, completions: list[_Completion]) -> RequestOutput:
    """An inner output as the client's stream carries it: the request's own id, each completion at its
    own index, `cumulative_logprob` continued across seams; records what it delivers."""
    outs: list[CompletionOutput] = []
    for c in output.outputs:
        index = c.index if leg.index is None else leg.index
        done = completions[index]
        cumulative = c.cumulative_logprob
        if done.resumed and cumulative is not None and c.logprobs is not None:
            cumulative = done.cumulative_logprob or 0.0
            for token_id, entry in zip(c.token_ids, c.logprobs):
                cumulative += entry[token_id].logprob  # one by one, as the engine adds them
        done.token_ids.extend(c.token_ids)
        done.cumulative_logprob = cumulative
        done.finished = done.finished or c.finish_reason is not None
        outs.append(dataclasses.replace(c, index=index, cumulative_logprob=cumulative))
    return dataclasses.replace(output, request_id=request_id, outputs=outs,
                               finished=all(c.finished for c in completions))


async def _merge(legs: list[_Leg]) -> AsyncIterator[tuple[_Leg, RequestOutput]]:
    """Interleave the legs' outputs as (leg, output); the first failure of any leg is raised; closing
    this closes every leg (which aborts what is still running)."""
    async for index, output in merge_streams([leg.stream for leg in legs]):
        yield legs[index], output
