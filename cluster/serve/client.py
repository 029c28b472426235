"""What the OpenAI layer needs of "the engines" (`generate`, `abort`, `latest_stats`, `aggregate_stats`,
`is_healthy`), over a DeploymentHandle to the engine deployment.

Routing happens inside the handle (`serve_router.PrefixAffinityRouter`). Streams travel over Serve's gRPC
transport between replicas (`_by_reference=False`: one message per output on the stream) instead of one
Ray object per output (a task return, its ownership and its reference counting): on the default model at
64 streams that is most of the per-token cost of serving (`stream_transport`). They are written with plain
pickle, not Serve's default cloudpickle, whose per-object hook in Python made writing a delta ~3x slower
(everything on those streams is an importable class, all plain pickle needs). A gRPC message is capped
at 4 MiB (`RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH`), a Ray object is not, so requests that may not fit
keep Ray's transport (`too_large_for_grpc`): those asking for prompt logprobs, top-k logprobs or
embeddings, and prompts over `GRPC_PROMPT_TOKENS` tokens (the call carries the prompt, and a stream's
first output carries it back). Over gRPC a replica's exception arrives as itself, over Ray wrapped in a
RayTaskError; both mean the same here. Stats and health come from
the engine replicas' routing stats as that router last received them, so /health and /metrics cost
no RPC. Cumulative counters stay monotonic when replicas come and go: the last figures of every
replica ever seen are kept and summed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
from ray.exceptions import RayActorError, RayTaskError

from pagedserve.cluster.engine_stats import EngineStats
from pagedserve.cluster.fleet_stats import EngineEntry, FleetAccumulator, FleetStats
from pagedserve.cluster.serve.router_registry import routers_for
from pagedserve.cluster.serve.routing_policy import DECISIONS
from pagedserve.cluster.serve.stream_transport import PromptRestorer
from pagedserve.engine.async_llm import EngineDeadError, EngineOverloadedError
from pagedserve.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

@contextlib.contextmanager
def own_internal_request_id() -> Iterator[str]:
    """Give the handle call made inside its own internal request id.

    Serve's router matches a routing decision to its pending request by the internal request id, which
    every handle call made while serving one HTTP request inherits from it; two concurrent calls of one
    HTTP request (the prompts of a batch, merged) would share it, and one of them would never be
    assigned. (This reaches into `ray.serve.context`, which has no public setter for it.)"""
    from ray.serve import context as serve_context

    current = serve_context._get_serve_request_context()
    internal_id = uuid.uuid4().hex
    token = serve_context._serve_request_context.set(dataclasses.replace(current, _internal_request_id=internal_id))
    try:
        yield internal_id
    finally:
        serve_context._serve_request_context.reset(token)


def _unwrap(exc: BaseException) -> BaseException:
    """A user exception raised in the replica arrives as RayTaskError over Ray's transport: give the cause
    back (over gRPC it arrives as itself)."""
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, BaseException):
        return exc.cause
    return exc


# The longest prompt sent over gRPC: pickled token ids take up to 5 bytes each, 2.5 MB of the 4 MiB.
GRPC_PROMPT_TOKENS = 500_000


def too_large_for_grpc(num_prompt_tokens: int, sampling_params: dict, pooling_params: dict | None) -> bool:
    """Whether a request or its outputs may outgrow a gRPC message (see the module docstring)."""
    return (num_prompt_tokens > GRPC_PROMPT_TOKENS or pooling_params is not None
            or sampling_params.get("prompt_logprobs") is not None or sampling_params.get("logprobs") is not None)


class ServeEngineClient:
    """The engines behind a DeploymentHandle, with the coordinator's API."""

    def __init__(self, handle: Any, app_name: str, deployment_name: str) -> None:
        self.handle = handle
        self.stream_handle = handle.options(stream=True, _by_reference=False,  # Serve's gRPC transport
                                            request_serialization="pickle", response_serialization="pickle")
        self.object_stream_handle = handle.options(stream=True)  # Ray objects: outputs of any size
        self.app_name = app_name
        self.deployment_name = deployment_name
        # Every replica ever seen (a replica that went away keeps what it counted): monotonic counters.
        self.fleet = FleetAccumulator()

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling_params: dict,
                       priority: int = 0, final_only: bool = False, cache_salt: str | None = None,
                       pooling_params: dict | None = None) -> AsyncIterator[RequestOutput]:
        """Stream DELTA outputs; with `final_only` merged into one output per checkpoint interval, the
        text decoded once at the end (`OutputKind.CHECKPOINT`). Raises ValueError (bad input), EngineOverloadedError, or EngineDeadError
        (the replica died while serving this request). `pooling_params`: an embedding request (one output).
        Closing the iteration early cancels the handle's response, which aborts the request in its engine.

        The request's outcome feeds the router's circuit breaker: the replica died under it or the engine
        ended it with an error (a failure), or it finished (a success); bad input, refusals for load and
        a caller that stopped reading say nothing about the engine."""
        with own_internal_request_id() as internal_id:
            # The prompt stays the second positional argument: the request router reads it there.
            extra = {} if pooling_params is None else {"pooling_params": pooling_params}
            prompt = list(prompt_token_ids)
            handle = (self.object_stream_handle if too_large_for_grpc(len(prompt), sampling_params, pooling_params)
                      else self.stream_handle)
            response = handle.generate.remote(request_id, prompt, sampling_params, priority,
                                              final_only=final_only, cache_salt=cache_salt, **extra)
        restore = PromptRestorer()
        finished = False
        ok: bool | None = None  # the outcome, as the circuit breaker counts it (None: not the engine's doing)
        refused = False  # the engine refused it for load: the router passes that replica over for a moment
        try:
            async for output in response:
                output = restore(output)
                finished = output.finished
                if finished:
                    ok = output.error is None
                    for router in self._routers():  # the router's predicted cached tokens, checked against the engine's
                        router.observe_cached(request_id, getattr(output, "num_cached_tokens", 0) or 0)
                yield output
                if finished:
                    return
            ok = False
            raise EngineDeadError(f"the engine ended request {request_id!r} without finishing it")
        except RayActorError as exc:
            ok = False
            raise EngineDeadError(f"the engine replica died while serving request {request_id!r}: "
                                  f"{exc.__class__.__name__}") from None
        except grpc.aio.AioRpcError as exc:  # the stream itself broke (Serve maps most of these already)
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            ok = False
            raise EngineDeadError(f"the engine replica died while serving request {request_id!r}: "
                                  "its gRPC stream is unavailable") from None
        except RayTaskError as exc:
            cause = _unwrap(exc)
            ok = False if isinstance(cause, EngineDeadError) or cause is exc else None
            refused = isinstance(cause, EngineOverloadedError)
            if cause is exc:
                raise
            raise cause from None
        except EngineDeadError:  # raised in the replica, arrived as itself (gRPC)
            ok = False
            raise
        except EngineOverloadedError:
            refused = True
            raise
        finally:
            if not finished:
                response.cancel()
            if ok is not None:
                for router in self._routers():
                    # (the router's module is pickled from the deployer: it may predate this method)
                    record = getattr(router, "record_outcome", None)
                    if record is not None:
                        record(internal_id, ok)
            if refused:
                for router in self._routers():
                    record_refusal = getattr(router, "record_refusal", None)
                    if record_refusal is not None:
                        record_refusal(internal_id)

    async def abort(self, request_id: str) -> None:
        """Requests are aborted by cancelling their stream (closing `generate`); nothing else to do."""

    # ------------------------------------------------------------------ stats and health

    def _routers(self) -> list:
        return routers_for(self.app_name, self.deployment_name)

    def routing_records(self, request_id: str) -> list[dict]:
        """The routing decisions this process's routers made for `request_id` (for its trace; taken)."""
        return [r.as_dict() for router in self._routers() for r in router.route_log.take(request_id)]

    def routing_snapshot(self) -> dict[str, Any]:
        """Replicas (deduplicated over this process's routers) and summed routing decisions."""
        replicas: dict[str, dict] = {}
        decisions = dict.fromkeys(DECISIONS, 0)
        circuit_opens = 0
        kv_routing: dict[str, Any] = {"stale_engines": 0}
        for router in self._routers():
            snap = router.snapshot()
            circuit_opens += snap.get("circuit_opens", 0)
            for section in ("kv_index", "predictions"):
                for key, value in snap.get(section, {}).items():
                    if key == "stale_engines":  # the same engines, seen by each router
                        kv_routing[key] = max(kv_routing[key], value)
                    elif isinstance(value, int):
                        kv_routing[key] = kv_routing.get(key, 0) + value
            for replica in snap["replicas"]:
                seen = replicas.get(replica["replica"])
                if seen is None:
                    replicas[replica["replica"]] = dict(replica)
                else:
                    seen["in_flight"] += replica["in_flight"]
                    seen["num_routed"] += replica["num_routed"]
                    seen["circuit_open"] = seen.get("circuit_open") or replica.get("circuit_open")
            for key, value in snap["decisions"].items():
                decisions[key] = decisions.get(key, 0) + value
        return {"replicas": list(replicas.values()), "decisions": decisions, "circuit_opens": circuit_opens,
                "kv_routing": kv_routing}

    def aggregate_stats(self) -> FleetStats:
        """The fleet over the engine replicas' routing stats (as this process's routers last received them)."""
        snap = self.routing_snapshot()
        engines = [_entry(replica) for replica in snap["replicas"]]
        for engine in engines:
            if engine.stats is not None:
                self.fleet.observe(engine.label, engine.stats)
        fault = {"circuit_opens": snap.get("circuit_opens", 0),
                 "circuit_open_engines": sum(e.circuit_open for e in engines)}
        return self.fleet.snapshot(engines, routing_decisions=snap["decisions"], fault_tolerance=fault,
                                   kv_routing=snap.get("kv_routing"))

    def latest_stats(self) -> FleetStats:
        return self.aggregate_stats()

    def is_healthy(self) -> bool:
        """False when no engine replica is known, or one reports a stall (from the latest routing stats)."""
        engines = [_entry(replica) for replica in self.routing_snapshot()["replicas"]]
        return bool(engines) and all(e.healthy for e in engines)


def _entry(replica: dict[str, Any]) -> EngineEntry:
    """A replica of the router's snapshot (its routing stats, `EngineStats.to_dict()` and what the router
    adds) as the fleet lists it; its stats are None until it first reported."""
    stats = EngineStats.from_dict(replica) if "num_total_blocks" in replica else None
    return EngineEntry(str(replica["replica"]), stats, in_flight=int(replica.get("in_flight", 0)),
                       num_routed=int(replica.get("num_routed", 0)), circuit_open=bool(replica.get("circuit_open")),
                       num_prefixes=replica.get("num_prefixes"), kv_view=replica.get("kv_view"))
