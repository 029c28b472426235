"""`EngineClient`: what the HTTP layer (cluster/serving/) needs of "the engines", whatever their shape.

One implementation per shape, in cluster/serve/: `client.ServeEngineClient` (the monolithic Serve app:
a DeploymentHandle to the engine deployment), `pd_client.PDClient` (prefill and decode pools) and
`coordinator.DPCoordinator` (engine actors driven in-process: the PD pools, benchmarks, tests). Their
stats are one typed snapshot, `fleet_stats.FleetStats` (per engine: `engine_stats.EngineStats`), built by
one restart-aware accumulator (`fleet_stats.FleetAccumulator`).

Optional (the serving layer asks with getattr, so test doubles need not have it):
`routing_records(request_id) -> list[dict]`, the routing decisions made for a request
(cluster/serve/route_log.py's `RouteRecord.as_dict()`), taken by the request's trace and overhead metrics.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from pagedserve.cluster.fleet_stats import FleetStats
from pagedserve.engine.outputs import EmbeddingRequestOutput, RequestOutput


@runtime_checkable
class EngineClient(Protocol):
    """The engines behind one app, as the OpenAI layer sees them."""

    def generate(self, request_id: str, prompt_token_ids: list[int], sampling_params: dict,
                 priority: int = 0, final_only: bool = False, cache_salt: str | None = None,
                 pooling_params: dict | None = None) -> AsyncIterator[RequestOutput | EmbeddingRequestOutput]:
        """Stream DELTA outputs (with `final_only`, fewer: merged per checkpoint interval, the text whole in
        each completion's finishing delta; `OutputKind.CHECKPOINT`). Raises ValueError (bad
        input), EngineOverloadedError or EngineDeadError; closing the iteration early aborts the request.
        With `pooling_params` (engine.pooling_params.PoolingParams fields) it is an embedding request,
        routed like any prompt: `sampling_params` is ignored and the stream is one `EmbeddingRequestOutput`."""
        ...

    async def abort(self, request_id: str) -> None:
        """Abort a request still running (closing its `generate` stream does the same)."""
        ...

    def aggregate_stats(self) -> FleetStats:
        """Summed counters (monotonic) and gauges, mean KV usage, `engines` (one entry per engine), and
        what the shape adds (`routing_decisions`, `pools`, `kv_transfer`, `pd`, `spec_decoding`, ...)."""
        ...

    def latest_stats(self) -> FleetStats:
        """`aggregate_stats()` from what was last polled, for /health and /metrics: never waits on an engine."""
        ...

    def is_healthy(self) -> bool:
        """False when no engine is reachable or one reports a stall."""
        ...
