"""The PD client: what the OpenAI layer needs of "the engines" (`generate`, `abort`, `aggregate_stats`,
`latest_stats`, `is_healthy`), over a prefill pool and a decode pool.

Each pool is an engine client of its own: on Serve (`pd_app`) a `client.ServeEngineClient` over a handle
to the `<app>-prefill` / `<app>-decode` deployment, whose request router (`router.PrefixAffinityRouter`)
picks the replica - prefix affinity and load for prefill; load, KV usage and the replica that already
holds the prompt's prefix for decode - and keeps doing so while replicas come and go; in-process
(`PDClient.over_actors`: tests, offline use) a `DPCoordinator` over engine actors, with the same policy.
Holds are released through `release(engine_id, hold id, hold token)`, which reaches the producer that
`remote_engine_id` names (a Serve call pinned to that replica, or the named actor).

A request first runs on a prefill engine with `max_tokens=1`, `n=1` and
`kv_transfer_params={"do_remote_decode": True}`; the producer keeps the prompt's KV and answers with
where it is. Then the request runs on a decode engine with the user's own sampling params plus those
kv_transfer_params. With n == 1 the client gets the prefill's token at once (time to first token is the
prefill's) and the decode engine continues from it (`continue_remote_output`: it loads the whole
prompt's KV it lacks and computes that token's); with n > 1 the decode engine computes the last prompt
token and generates every output token itself.
Either way what the client receives (streaming, n, logprobs, stop strings, seeds, usage) is the
monolithic engine's.

- The prefill's output is the answer itself when it already finished the request (the user asked
  for one token, or the first token stopped it) and n == 1: no decode step then.
- Requests asking for prompt logprobs run on a decode engine alone (a consumer computes the prompt
  positions it needs logprobs for itself, so a prefill would be wasted).
- The producer's hold is released when the decode's first output arrives (n == 1), when the decode
  ends or fails, when the prefill's output was the answer, or as soon as the caller stops reading at
  any point (the consumer also releases after its last reader loaded; releases are idempotent, and the
  producer's `hold_timeout_s` frees anything left).
- n > 1: the decode engine's n children share one hold, which it releases after the last of them has
  loaded; the router's own release waits for the end of the request (not its first output).
- Faults: a prefill engine lost before it answered -> the prefill leg goes to another prefill engine
  where the pool has more than one (`PREFILL_RETRIES` times, counted as `prefill_retries`; the pool's
  router has passed the lost one over by then, else the retry fails fast). A prefill pool that still
  fails, or has no other engine, or an engine that refuses
  the request (overloaded) -> the request is computed on a decode engine without remote KV (counted
  as a fallback). A decode engine that dies
  before its first output (the producer's hold is still there: nothing released it) -> the decode leg
  goes to another decode engine with the same hold (`DECODE_RETRIES` times, counted as
  `decode_retries`): that engine loads the prompt's KV while the hold is readable, else (it expired, or
  the dead engine had loaded and released it) computes the prompt itself. A decode engine that dies
  later -> `EngineDeadError`: the serving layer's `MigratingClient` continues the request on another
  decode engine from the tokens delivered (recomputed there: the hold was released at the first output).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.cluster.serve.coordinator import DPCoordinator
from pagedserve.cluster.fleet_stats import FleetStats
from pagedserve.cluster.serving.request_stages import record_event
from pagedserve.engine.async_llm import EngineDeadError, EngineOverloadedError
from pagedserve.engine.detokenizer import streamed_text_of_first_tokens
from pagedserve.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

POOLS = ("prefill", "decode")
# A decode engine that died before its first output: the decode leg is tried this many more times.
DECODE_RETRIES = 1
# A prefill engine lost before it answered: the prefill leg goes to another prefill engine this many times.
PREFILL_RETRIES = 1


@dataclass
class PDCounters:
    """What the PD client itself decided (cumulative, this process)."""

    pd_requests: int = 0  # requests that went prefill -> decode
    prefill_answers: int = 0  # requests whose prefill output was the whole answer
    decode_only: int = 0  # requests sent straight to a decode engine (prompt logprobs)
    prefill_fallbacks: int = 0  # prefill engine dead or overloaded: computed on a decode engine
    continuations: int = 0  # n == 1 requests whose first token was the prefill's (decode continued from it)
    decode_retries: int = 0  # decode engine died before its first output: another one took the same hold
    prefill_retries: int = 0  # prefill engine died before it answered: another prefill engine took the leg


def prefill_params(user: dict[str, Any]) -> dict[str, Any]:
    """The prefill stage's sampling params: the user's, for one token of one sequence, keeping its KV."""
    return {
        **user, "n": 1, "best_of": None, "max_tokens": 1, "min_tokens": min(int(user.get("min_tokens") or 0), 1),
        "prompt_logprobs": None, "kv_transfer_params": {"do_remote_decode": True},
    }


def prefill_is_answer(user: dict[str, Any], final: RequestOutput) -> bool:
    """The prefill (same params, one token) finished what the user asked for."""
    if int(user.get("n") or 1) != 1 or not final.outputs:
        return False
    reason = final.outputs[0].finish_reason
    return reason == "stop" or (reason == "length" and user.get("max_tokens") == 1)


def first_token_delta(user: dict[str, Any], outputs: list[RequestOutput]) -> RequestOutput | None:
    """The prefill's output as the first delta of a stream that goes on (n == 1): its one token, with the
    text a monolithic stream would show by then (nothing of an incomplete character, stop-string hold-back
    kept back). None when the prefill did not produce exactly one token."""
    first = copy.deepcopy(outputs[0])
    for later in outputs[1:]:
        first.add(copy.deepcopy(later))
    if len(first.outputs) != 1 or len(first.outputs[0].token_ids) != 1:
        return None
    stop = user.get("stop") or []
    completion = first.outputs[0]
    completion.text = streamed_text_of_first_tokens(completion.text, [stop] if isinstance(stop, str) else list(stop),
                                                    bool(user.get("include_stop_str_in_output")))
    completion.finish_reason = completion.stop_reason = None
    first.finished = False
    first.kv_transfer_params = None
    return first


# release(producer engine id, hold id, hold token): frees a producer's hold (fire and forget).
Release = Callable[[str, str, "str | None"], None]


class PDClient:
    """Lives in the HTTP ingress process; drives a prefill pool and a decode pool (two engine clients)."""

    def __init__(self, prefill: Any, decode: Any, release: Release) -> None:
        self.prefill = prefill
        self.decode = decode
        self._release_hold = release
        self.counters = PDCounters()

    @classmethod
    def over_actors(cls, prefill_engines: list[Any], decode_engines: list[Any], prefill_names: list[str],
                    prefill_block_size: int, decode_block_size: int, **coordinator_kwargs: Any) -> "PDClient":
        """Both pools as engine actors (`engine_actor`/`pd_pools`, named by `prefill_names`), each driven by
        an in-process `DPCoordinator`."""
        if len(prefill_names) != len(prefill_engines):
            raise ValueError("prefill_names: one name per prefill engine")
        producers = dict(zip(prefill_names, prefill_engines))

        def release(engine_id: str, hold_id: str, hold_token: str | None) -> None:
            handle = producers.get(engine_id)
            if handle is not None:
                handle.kv_release.remote(hold_id, hold_token)

        prefill = DPCoordinator(prefill_engines, prefill_block_size, **coordinator_kwargs)
        decode = DPCoordinator(decode_engines, decode_block_size, **coordinator_kwargs)
        prefill.name, decode.name = "prefill", "decode"  # what traces and overhead metrics call the pools
        return cls(prefill, decode, release)

    def start(self) -> None:
        for pool in (self.prefill, self.decode):
            if hasattr(pool, "start"):  # an in-process coordinator polls its engines
                pool.start()

    async def stop(self) -> None:
        await asyncio.gather(*(pool.stop() for pool in (self.prefill, self.decode) if hasattr(pool, "stop")))

    # ------------------------------------------------------------------ requests

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling_params: dict,
                       priority: int = 0, final_only: bool = False, cache_salt: str | None = None,
                       pooling_params: dict | None = None) -> AsyncIterator[RequestOutput]:
        """Stream DELTA outputs. `cache_salt` goes to both legs (both engines' prefix caches are salted). Raises ValueError (bad input), EngineOverloadedError (every decode engine
        refused), or EngineDeadError (the decode engine died while serving this request).

        `final_only` (the caller reads only the end): a decode leg that computes the whole output itself
        (prompt logprobs, fallbacks, n > 1) asks its engine for the finished output alone. The prefill leg
        (one token, its output the first delta or the answer) and an n == 1 continuation stay DELTA: the
        continuing engine's outputs start after the prefill's token, which the client already has.
        `pooling_params`: an embedding request, computed on a prefill engine (nothing to hand over)."""
        if pooling_params is not None:  # an embedding is a prefill and nothing else: the prefill pool's
            async for output in self.prefill.generate(request_id, prompt_token_ids, {}, priority,
                                                      cache_salt=cache_salt, pooling_params=pooling_params):
                yield output
            return
        user = {**sampling_params, "kv_transfer_params": None}
        # A migrated request's continuation (migration.py) recomputes on a decode engine alone.
        if user.get("prompt_logprobs") is not None or user.get("resume_output_token_ids"):
            self.counters.decode_only += 1
            async for output in self._decode(request_id, prompt_token_ids, user, priority, final_only, cache_salt):
                yield output
            return
        one_shot = user.get("max_tokens") == 1 and int(user.get("n") or 1) == 1
        params = {**user, "best_of": None} if one_shot else prefill_params(user)
        try:
            outputs = await self._prefill(request_id, prompt_token_ids, params, priority, cache_salt)
        except (EngineDeadError, EngineOverloadedError) as exc:
            self.counters.prefill_fallbacks += 1
            logger.warning("request %s: prefill failed (%s); computing it on a decode engine", request_id, exc)
            record_event("prefill_fallback", **{"pagedserve.retry.reason": type(exc).__name__,
                                                "pagedserve.retry.error": str(exc)[:200]})
            async for output in self._decode(request_id, prompt_token_ids, user, priority, final_only, cache_salt):
                yield output
            return
        final = outputs[-1]
        remote = final.kv_transfer_params
        if one_shot or final.outputs[0].finish_reason == "abort" or prefill_is_answer(user, final):
            if remote is not None:
                self._release(remote)
            self.counters.prefill_answers += 1
            for output in outputs:
                output.kv_transfer_params = None
                yield output
            return
        if remote is None:  # the producer kept nothing (e.g. the prompt did not fill a block): compute it
            self.counters.prefill_fallbacks += 1
            async for output in self._decode(request_id, prompt_token_ids, user, priority, final_only, cache_salt):
                yield output
            return
        self.counters.pd_requests += 1
        # n == 1: the first output means the one reader has loaded. n > 1: a child scheduled steps after
        # the first may still read the hold (the decode engine releases it after its last reader loads);
        # the router's own release then waits for the end of the request.
        early = int(user.get("n") or 1) == 1
        released = False
        decode_params = {**user, "kv_transfer_params": remote}
        first = first_token_delta(user, outputs) if early else None
        if first is not None:
            # The client's first token is the prefill's own (time to first token = the prefill's); the decode
            # engine continues from it: it loads the whole prompt and computes only that token onwards.
            self.counters.continuations += 1
            decode_params["kv_transfer_params"] = {**remote, "continue_remote_output": True}
        first_logprob = first.outputs[0].cumulative_logprob if first is not None else None
        # Every yield from here on sits inside the try: a caller that stops at any of them (closes or cancels
        # the stream, e.g. its client left right after the first token) releases the hold now, not at expiry.
        try:
            if first is not None:
                yield first
            decoded = False
            for attempt in range(DECODE_RETRIES + 1):
                try:
                    async with contextlib.aclosing(self._decode(request_id, prompt_token_ids, decode_params, priority,
                                                                final_only and first is None, cache_salt)) as stream:
                        async for output in stream:
                            decoded = True
                            if early and not released:
                                released = True
                                self._release(remote)
                            if first_logprob is not None:  # the decode engine's sums start after the prefill's token
                                for completion in output.outputs:
                                    if completion.cumulative_logprob is not None:
                                        completion.cumulative_logprob += first_logprob
                            yield output
                    break
                except EngineDeadError as exc:
                    if decoded or attempt == DECODE_RETRIES:
                        raise
                    self.counters.decode_retries += 1
                    logger.warning("request %s: the decode engine failed before its first output (%s); another "
                                   "decode engine takes the prefill's hold", request_id, exc)
                    record_event("decode_retry", **{"pagedserve.retry.attempt": attempt + 1,
                                                    "pagedserve.retry.reason": type(exc).__name__,
                                                    "pagedserve.retry.error": str(exc)[:200]})
        finally:
            if not released:
                self._release(remote)

    async def _prefill(self, request_id: str, prompt_token_ids: list[int], params: dict, priority: int,
                       cache_salt: str | None) -> list[RequestOutput]:
        """The prefill leg's outputs; a prefill engine lost before it answered -> another one (`PREFILL_RETRIES`)."""
        retries = 0
        while True:
            outputs: list[RequestOutput] = []
            try:
                async with contextlib.aclosing(self.prefill.generate(request_id, prompt_token_ids, params,
                                                                     priority, cache_salt=cache_salt)) as stream:
                    async for output in stream:
                        outputs.append(output)
                return outputs
            except EngineDeadError as exc:
                # (a pool of one would queue the retry until the lost engine's replacement is up: a decode
                # engine computes it sooner)
                if retries == PREFILL_RETRIES or self.prefill.aggregate_stats().num_engines < 2:
                    raise
                retries += 1
                self.counters.prefill_retries += 1
                logger.warning("request %s: the prefill engine failed before it answered (%s); another prefill "
                               "engine takes it", request_id, exc)

    def _decode(self, request_id: str, prompt_token_ids: list[int], params: dict,
                priority: int, final_only: bool = False, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        return self.decode.generate(request_id, prompt_token_ids, params, priority, final_only=final_only,
                                    cache_salt=cache_salt)

    def _release(self, remote: dict[str, Any]) -> None:
        """Free the producer's hold (fire and forget: a dead producer's blocks went with it)."""
        engine_id = remote.get("remote_engine_id")
        if not isinstance(engine_id, str):
            return
        try:
            self._release_hold(engine_id, remote["remote_request_id"], remote.get("remote_hold_token"))
        except Exception as exc:  # noqa: BLE001 - its hold times out anyway
            logger.debug("release of %s failed: %s", remote.get("remote_request_id"), exc)

    def routing_records(self, request_id: str) -> list[dict]:
        """Both pools' routing decisions for `request_id` (for its trace and overhead labels; taken): the
        trace places each before the engine leg that arrived after it."""
        return self.prefill.routing_records(request_id) + self.decode.routing_records(request_id)

    async def abort(self, request_id: str) -> None:
        await asyncio.gather(self.prefill.abort(request_id), self.decode.abort(request_id))

    # ------------------------------------------------------------------ stats and health

    def aggregate_stats(self) -> FleetStats:
        """Both pools as one fleet (`FleetStats.over_pools`: engines labelled by pool; each pool's counters,
        KV-transfer ones included, are monotonic across its engines' restarts), with `pools` (each pool's
        own) and `pd` (this client's counts)."""
        pools = {"prefill": self.prefill.aggregate_stats(), "decode": self.decode.aggregate_stats()}
        return FleetStats.over_pools(pools, pd=vars(self.counters).copy())

    def latest_stats(self) -> FleetStats:
        """From what each pool last polled (starts an in-process pool's polling if it has not begun)."""
        pools = {"prefill": self.prefill.latest_stats(), "decode": self.decode.latest_stats()}
        return FleetStats.over_pools(pools, pd=vars(self.counters).copy())

    def is_healthy(self) -> bool:
        return self.prefill.is_healthy() and self.decode.is_healthy()
