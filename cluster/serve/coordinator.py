"""Data-parallel coordinator: routes each request to one of several headless engine actors.

The in-process counterpart of the Serve request router (`serve_router`): it drives engine actors it
was given (the in-process PD pools, tests, `tests/local_serving.py`, embedding pagedserve in another Ray
program). Routing (`choose_engine`) is the Serve router's own chooser (`prefix_chooser.PrefixChooser`)
under the same `routing_policy` (settings.ROUTING_POLICIES, default "exact"): over the engines' routing
stats (`EngineHost.record_routing_stats`, polled with their load: load figures, the prefixes they served,
resident LoRA adapters, KV events), with the prompt hashed under the request's cache salt and LoRA
adapter as the engine hashes it. Engine handles without `record_routing_stats` are polled with
`get_stats` and routed approximately. Under exact routing each prediction of a request's cached tokens
is checked against what the engine found (`kv_routing` in the stats). Cross-node tier hints are the
Serve router's alone (they name a Serve replica): the coordinator predicts what its choice itself holds.

Failure: a dead actor (RayActorError and subclasses) fails only the requests it was serving, with
`EngineDeadError`; the engine is then skipped by routing until a stats poll (`refresh_stats`) gets an
answer again from the restarted actor.

Streams: engine actors send a stream's prompt only in its first output; `PromptRestorer` puts it back
into the later ones. Aborts to one engine within one event-loop turn go out as one `abort_requests`
RPC (`AbortBatcher`).

Stats for /health and /metrics come from what the background poller last saw, without an RPC:
`latest_stats()`, `aggregate_stats()` and `is_healthy()` never await.

Tuning (all optional keywords): `DPCoordinator(..., kv_weight=4.0,
stats_timeout_s=5.0, max_affinity_entries=65536, routing_policy="exact", offload_weight=0.5)`. `start()` may be called outside a running event
loop; polling then begins with the first `generate` call. Cumulative counters in
`aggregate_stats()` stay monotonic across actor restarts (a restarted engine's counters, told apart
by the "incarnation" in its stats, are added to what it had counted before).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from pagedserve.cluster.serve.abort_batcher import AbortBatcher
from pagedserve.cluster.serve.engine_calls import adapter_in, lora_key_in
from pagedserve.cluster.serve.prefix_chooser import PrefixChooser
from pagedserve.cluster.serve.route_log import RouteLog, timed_choice
from pagedserve.cluster.serve.stream_transport import PromptRestorer
from pagedserve.engine.async_llm import EngineDeadError, EngineOverloadedError
from pagedserve.cluster.serve.routing_policy import (
    DECISIONS, RoutingParams, RoutingPolicy, engine_load, prefix_hashes,
)
from pagedserve.cluster.engine_stats import EngineStats
from pagedserve.cluster.fleet_stats import EngineEntry, FleetAccumulator, FleetStats
from pagedserve.engine.core.block_pool import BlockHash
from pagedserve.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

@dataclass
class EngineState:
    """What the coordinator knows about one engine."""

    index: int
    handle: Any
    available: bool = True  # False after the actor died / stopped answering, until a stats poll succeeds
    in_flight: int = 0  # requests routed here by this coordinator and not finished
    num_routed: int = 0  # total requests routed here
    stats: EngineStats | None = None  # latest get_stats() answer (None before the first poll)
    routing_stats: dict[str, Any] | None = None  # latest record_routing_stats() answer (None: none)

    @property
    def healthy(self) -> bool:
        """Routable: reachable and not reporting a stall."""
        return self.available and (self.stats is None or self.stats.healthy)

    def load(self, kv_weight: float) -> float:
        return engine_load(self.in_flight, None if self.stats is None else self.stats.figures("gauge", "mean"),
                           kv_weight)

    def entry(self) -> EngineEntry:
        """This engine as the fleet snapshot lists it."""
        return EngineEntry(str(self.index), self.stats, self.available, self.in_flight, self.num_routed)


class DPCoordinator:
    """Lives in the HTTP ingress process; holds the engine actor handles."""

    def __init__(
        self,
        engines: list[Any],
        block_size: int,
        affinity_blocks: int = 4,
        imbalance_factor: float = 2.0,
        stats_interval_s: float = 0.5,
        seed: int = 0,
        kv_weight: float = 4.0,
        stats_timeout_s: float = 5.0,
        max_affinity_entries: int = 65536,
        imbalance_slack: float = 2.0,
        routing_policy: str = "exact",
        offload_weight: float = 0.5,
    ) -> None:
        if not engines:
            raise ValueError("engines: need at least one engine actor")
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        if stats_interval_s <= 0:
            raise ValueError(f"stats_interval_s: must be > 0, got {stats_interval_s}")
        self.engines = [EngineState(i, handle) for i, handle in enumerate(engines)]
        self.block_size = block_size
        self.affinity_blocks = affinity_blocks
        self.imbalance_factor = imbalance_factor
        self.stats_interval_s = stats_interval_s
        self.kv_weight = kv_weight
        self.stats_timeout_s = stats_timeout_s
        self.max_affinity_entries = max_affinity_entries
        self.chooser: PrefixChooser[int] = PrefixChooser(
            RoutingParams(affinity_blocks, imbalance_factor, kv_weight, max_affinity_entries, imbalance_slack,
                          offload_weight), routing_policy, seed, tier_peers=False)
        self.policy: RoutingPolicy[int] = self.chooser.policy
        self._requests: dict[str, int] = {}  # request_id -> engine index, while in flight
        self._want_polling = False
        self._poller: asyncio.Task | None = None
        self._aborts = AbortBatcher(self._send_aborts)
        self._last_poll_time: float | None = None  # time.monotonic() of the last completed poll round
        self.fleet = FleetAccumulator()  # cumulative figures, monotonic across actor restarts
        self.name = "engine"  # what traces and overhead metrics call this group of engines (PD: its pool)
        self.route_log = RouteLog()  # each request's routing decisions, for its trace

    # ------------------------------------------------------------------ routing (policy: routing_policy)

    def prefix_hashes(self, prompt_token_ids: Sequence[int], cache_salt: str | None = None,
                      lora_key: tuple = ()) -> list[BlockHash]:
        """Chained hashes of the prompt's first `affinity_blocks` full blocks, as the engine hashes them."""
        return prefix_hashes(prompt_token_ids, self.block_size, self.affinity_blocks, cache_salt, lora_key)

    def _candidates(self, exclude: frozenset[int] = frozenset()) -> list[EngineState]:
        engines = [e for e in self.engines if e.index not in exclude]
        healthy = [e for e in engines if e.healthy]
        if healthy:
            return healthy
        reachable = [e for e in engines if e.available]
        return reachable or engines  # nothing better: stats may be stale, try (fails fast if dead)

    def choose_engine(self, prompt_token_ids: list[int], exclude: frozenset[int] = frozenset(),
                      request_id: str | None = None, cache_salt: str | None = None,
                      sampling_params: dict | None = None) -> int:
        """Engine index for this prompt under the routing policy, among the engines not in `exclude` (there
        must be one); the prompt hashed under `cache_salt` and the LoRA adapter in `sampling_params`. With
        `request_id`, the decision is logged for its trace (and, exact routing, its cached tokens predicted)."""
        candidates = [e.index for e in self._candidates(exclude)]

        def load(i: int) -> float:
            return self.engines[i].load(self.kv_weight)

        def choose() -> tuple[int, str]:
            choice = self.chooser.choose(
                candidates, lambda i: self.engines[i].routing_stats, load, prompt_token_ids, self.block_size,
                cache_salt, request_id, adapter_in(sampling_params), lora_key_in(sampling_params))
            return choice.key, choice.decision

        index, record = timed_choice(choose, candidates, load, self.name)
        if request_id is not None:
            self.route_log.record(request_id, record)
        return index

    def routing_records(self, request_id: str) -> list[dict]:
        """The routing decisions made for `request_id` (taken: asked once, at the request's end)."""
        return [r.as_dict() for r in self.route_log.take(request_id)]

    # ------------------------------------------------------------------ requests

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: dict,
        priority: int = 0,
        final_only: bool = False,
        cache_salt: str | None = None,
        pooling_params: dict | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Route the request and stream its DELTA outputs (`pooling_params`: an embedding request, one
        output); with `final_only` (the caller reads only the end, e.g. a non-streaming HTTP request) the
        deltas come merged, one output per checkpoint interval (`OutputKind.CHECKPOINT`). `cache_salt` goes
        into the engine prompt (its prefix-cache hashes).

        An engine that refuses the request as overloaded (before any output) is skipped and the request
        routed to another; EngineOverloadedError reaches the caller only when every engine refused.
        Raises ValueError (bad input), EngineOverloadedError, or EngineDeadError (the engine died while
        serving this request). Stopping the iteration early aborts the request on its engine.
        """
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        self._ensure_polling()
        refused: set[int] = set()
        while True:
            index = self.choose_engine(prompt_token_ids, frozenset(refused), request_id, cache_salt,
                                       sampling_params)
            produced = False
            try:
                # aclosing: an early stop by the consumer closes the engine stream now (abort, bookkeeping).
                async with contextlib.aclosing(
                    self._generate_on(index, request_id, prompt_token_ids, sampling_params, priority, final_only,
                                      cache_salt, pooling_params)
                ) as outputs:
                    async for output in outputs:
                        produced = True
                        yield output
                return
            except EngineOverloadedError:
                refused.add(index)
                if produced or len(refused) == len(self.engines):
                    raise
                logger.debug("engine %d overloaded, routing %s to another engine", index, request_id)

    async def _generate_on(
        self, index: int, request_id: str, prompt_token_ids: list[int], sampling_params: dict, priority: int,
        final_only: bool = False, cache_salt: str | None = None, pooling_params: dict | None = None,
    ) -> AsyncIterator[RequestOutput]:
        state = self.engines[index]
        state.in_flight += 1
        state.num_routed += 1
        self._requests[request_id] = index
        finished = False
        try:
            prompt: dict = {"prompt_token_ids": list(prompt_token_ids)}
            if cache_salt is not None:
                prompt["cache_salt"] = cache_salt
            args = (request_id, prompt, sampling_params, priority)
            # EngineHost.generate's fifth argument, `final_only`, sent only when set: a streaming call
            # stays the plain four-argument one that any engine handle (or test double) answers.
            if pooling_params is not None:  # an embedding: EngineHost.generate(..., final_only, cache_salt
                # (already in the prompt), pooling_params), positionally as every engine handle takes it
                stream = state.handle.generate.remote(*args, True, None, pooling_params)
            elif final_only:
                stream = state.handle.generate.remote(*args, True)
            else:
                stream = state.handle.generate.remote(*args)
            restore = PromptRestorer()
            async for ref in stream:
                output: RequestOutput = restore(await ref)
                finished = output.finished
                if finished:  # the routing's predicted cached tokens, checked against the engine's
                    self.chooser.observe_cached(request_id, getattr(output, "num_cached_tokens", 0) or 0)
                yield output
                if finished:
                    return
            if not finished:  # the stream ended without a final output: the engine went away
                raise EngineDeadError(f"engine {index} ended request {request_id!r} without finishing it")
        except RayActorError as exc:
            self._mark_unavailable(state, exc)
            raise EngineDeadError(f"engine {index} died while serving request {request_id!r}: {exc}") from None
        except RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, BaseException) else None
            if isinstance(cause, EngineDeadError):
                self._mark_unavailable(state, cause)
            if cause is not None:
                raise cause from None
            raise
        finally:
            state.in_flight -= 1
            self._requests.pop(request_id, None)
            if not finished:  # consumer stopped early or the request failed: free its blocks
                self._fire_abort(state, request_id)

    async def abort(self, request_id: str) -> None:
        """Abort an in-flight request; its stream ends with a final output whose finish_reason is "abort"."""
        index = self._requests.get(request_id)
        if index is None:
            return
        try:
            sent = await self._aborts.add_and_wait(index, request_id)
            if sent is not None:
                await asyncio.wait_for(sent, self.stats_timeout_s)
        except (RayActorError, asyncio.TimeoutError):
            pass  # the engine is gone or stuck; its requests fail on their own

    def _fire_abort(self, state: EngineState, request_id: str) -> None:
        """Fire and forget (must not block a closing generator); batched with the other aborts of this turn."""
        if state.available:
            self._aborts.add(state.index, request_id)

    def _send_aborts(self, index: int, request_ids: list[str]) -> Any:
        return self.engines[index].handle.abort_requests.remote(request_ids)

    def _mark_unavailable(self, state: EngineState, exc: BaseException) -> None:
        if state.available:
            logger.warning("engine %d unavailable, routing around it: %s", state.index, exc)
        state.available = False

    # ------------------------------------------------------------------ stats and health

    async def refresh_stats(self) -> list[EngineStats | None]:
        """Poll every engine's stats; an engine that does not answer (None) is marked unavailable and skipped."""
        answers = list(await asyncio.gather(*(self._poll_one(state) for state in self.engines)))
        self._last_poll_time = time.monotonic()
        return answers

    async def _poll_one(self, state: EngineState) -> EngineStats | None:
        routing = None
        method = self._routing_stats_method(state)
        try:
            if method is not None:  # the stats and what routing reads, in one call
                routing = await asyncio.wait_for(method.remote(), self.stats_timeout_s)
                stats = EngineStats.from_dict(routing)
            else:
                stats = await asyncio.wait_for(state.handle.get_stats.remote(), self.stats_timeout_s)
        except (RayActorError, RayTaskError, asyncio.TimeoutError) as exc:
            self._mark_unavailable(state, exc)
            return None
        if routing is not None:
            state.routing_stats = routing
            self.chooser.sync(state.index, routing)
        if not state.available:
            logger.info("engine %d answers again; routing to it", state.index)
        state.available = True
        self._update_stats(state, stats)
        return stats

    def _routing_stats_method(self, state: EngineState) -> Any:
        """The handle's `record_routing_stats` where the policy reads it (None: blind policies, or a handle
        without it)."""
        if self.chooser.routing_policy in ("random", "power_of_two"):
            return None
        return getattr(state.handle, "record_routing_stats", None)

    def _update_stats(self, state: EngineState, stats: EngineStats) -> None:
        """Keep the newest answer; a new incarnation (restarted actor) counts from zero on top of the old
        totals (`FleetCounters`)."""
        previous = state.stats
        restarted = previous is not None and stats.incarnation != previous.incarnation
        if previous is not None and not restarted and stats.stats_time < previous.stats_time:
            return  # an older answer that arrived late (concurrent polls)
        self.fleet.observe(state.index, stats)
        state.stats = stats

    def aggregate_stats(self) -> FleetStats:
        """Summed counters (monotonic) and gauges over engines, mean KV usage, and one entry per engine."""
        kv_routing = None
        if self.chooser.exact_routing:
            kv_routing = {**asdict(self.chooser.index.counters), "stale_engines": self.chooser.index.num_stale(),
                          **asdict(self.chooser.prediction_counters)}
        decisions = {**dict.fromkeys(DECISIONS, 0), **self.policy.decisions}
        return self.fleet.snapshot([e.entry() for e in self.engines], routing_decisions=decisions,
                                   kv_routing=kv_routing)

    def latest_stats(self) -> FleetStats:
        """`aggregate_stats()` with `stats_age_s` (seconds since the last completed poll, None before the
        first): what /health and /metrics answer from, with no RPC."""
        self._ensure_polling()
        age = None if self._last_poll_time is None else time.monotonic() - self._last_poll_time
        return self.aggregate_stats().replace(stats_age_s=age)

    def is_healthy(self) -> bool:
        """False if an engine reports a stall (work waiting, no progress) or no engine is reachable.
        From the latest polled stats: never waits for an engine."""
        self._ensure_polling()
        if not any(e.available for e in self.engines):
            return False
        return not any(e.available and e.stats is not None and not e.stats.healthy for e in self.engines)

    # ------------------------------------------------------------------ background polling

    def start(self) -> None:
        """Start polling stats every `stats_interval_s` (now if an event loop runs, else on first use)."""
        self._want_polling = True
        self._ensure_polling()

    def _ensure_polling(self) -> None:
        if not self._want_polling or (self._poller is not None and not self._poller.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._poller = loop.create_task(self._poll_loop(), name="dp-coordinator-stats")

    async def _poll_loop(self) -> None:
        while True:
            try:
                await self.refresh_stats()
            except Exception:  # noqa: BLE001 - keep polling; one bad round must not stop routing updates
                logger.exception("stats poll failed")
            await asyncio.sleep(self.stats_interval_s)

    async def stop(self) -> None:
        self._want_polling = False
        if self._poller is not None:
            self._poller.cancel()
            try:
                await self._poller
            except asyncio.CancelledError:
                pass
            self._poller = None
