"""The engine deployment: one Serve replica = one headless engine (an `EngineActor` hosted in the replica).

Serve owns the lifecycle: `num_replicas` is the data-parallel size (or `autoscaling_config` makes it
elastic), `check_health` is Serve's health check, a replica being removed (scale-down, rolling
update) stops getting requests and finishes what it holds within `graceful_shutdown_timeout_s`
before `__del__` stops the engine. With TP/PP > 1 the replica's placement group (Serve's
`placement_group_bundles`: bundle 0 for the replica, one bundle per rank after it) holds the rank
actors: the worker group schedules them into it (`ray_executor`), so Serve places, health-checks and
replaces the whole group together.

The replica receives token ids and streams DELTA `RequestOutput`s (the prompt only in the first,
`stream_transport`); detokenization stays in the engine's output processor. It reports its load, the
prompt prefixes it served and its engine's KV events (`kv_feed`) as routing stats
(`record_routing_stats`), which the request router (`router`) and the ingress's /metrics read.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from pagedserve.cluster.fleet_stats import ENGINE_FIGURES
from pagedserve.cluster.serve.engine_actor import EngineActor
from pagedserve.cluster.executor.placement import with_engine_kv_share
from pagedserve.cluster.executor.ray_utils import assigned_cpus
from pagedserve.cluster.serve.kv_feed import KVEventFeed
from pagedserve.cluster.serve.routing_policy import prefix_hashes
from pagedserve.cluster.serve.router import short_hash
from pagedserve.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

# Prefix lengths (in blocks) a replica reports hashes for: the router may use any affinity_blocks up to it.
REPORTED_PREFIX_BLOCKS = 8
# Most prefix hashes a replica remembers and reports (newest first out of the LRU, oldest dropped).
MAX_REPORTED_PREFIXES = 4096

ROUTING_STATS_KEYS = (*ENGINE_FIGURES, "healthy", "num_unfinished", "incarnation", "spec_decoding")


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"


class PagedServeEngine:
    """The body of one engine replica (the Serve deployment wraps it: `serve_app.engine_deployment`)."""

    def __init__(self, engine_kwargs: dict, max_pending_requests: int = 1024, stall_timeout_s: float = 120.0) -> None:
        from ray import serve

        try:
            self.replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - constructed outside Serve (unit tests)
            self.replica = "local"
        self.node_id = _node_id()
        engine_kwargs = with_engine_kv_share(engine_kwargs, assigned_cpus())
        self.actor = EngineActor(engine_kwargs, 0, max_pending_requests=max_pending_requests,
                                 stall_timeout_s=stall_timeout_s)
        self.block_size = self.actor.engine.config.block_size
        self._prefixes: OrderedDict[str, None] = OrderedDict()
        self.kv_feed = KVEventFeed(self.actor.engine, self.actor.incarnation)
        logger.info("engine replica %s ready: %d KV blocks", self.replica, self.actor.num_kv_blocks)

    async def ready(self) -> dict:
        """The engine's settings, this replica, and the Ray nodes it and its TP/PP ranks run on."""
        return {**(await self.actor.ready()), "replica": self.replica, "node_id": self.node_id,
                "rank_node_ids": self.actor.rank_node_ids()}

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling_params: dict,
                       priority: int = 0, final_only: bool = False, cache_salt: str | None = None,
                       pooling_params: dict | None = None) -> AsyncIterator[RequestOutput]:
        """Stream DELTA outputs for one prompt (only the finished one with `final_only`); cancelling the
        stream (the caller's handle response was cancelled, e.g. its client went away) aborts the request
        and frees its blocks. `cache_salt` goes into the engine prompt (its prefix-cache hashes).
        `pooling_params`: an embedding request (EngineActor.generate)."""
        self._remember(prompt_token_ids, cache_salt)
        prompt: dict = {"prompt_token_ids": list(prompt_token_ids)}
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        async for output in self.actor.generate(request_id, prompt, sampling_params, priority, final_only=final_only,
                                                pooling_params=pooling_params):
            yield output

    async def abort_requests(self, request_ids: list[str]) -> None:
        await self.actor.abort_requests(request_ids)

    async def get_stats(self) -> dict:
        return {**(await self.actor.get_stats()), "replica": self.replica}

    async def check_health(self) -> None:
        """Serve's health check: raises when the engine loop died or stalls with work waiting."""
        await self.actor.check_health()

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the request router and the ingress's /metrics see of this replica."""
        stats = await self.actor.get_stats()
        out = {key: stats[key] for key in ROUTING_STATS_KEYS if key in stats}
        out.update(replica=self.replica, block_size=self.block_size, prefix_hashes=list(self._prefixes),
                   lora_adapters=list((stats.get("lora") or {}).get("resident", ())),
                   kv_events=await self.kv_feed.report())
        return out

    def _remember(self, prompt_token_ids: list[int], cache_salt: str | None) -> None:
        for block_hash in prefix_hashes(prompt_token_ids, self.block_size, REPORTED_PREFIX_BLOCKS, cache_salt):
            key = short_hash(block_hash)
            self._prefixes[key] = None
            self._prefixes.move_to_end(key)
        while len(self._prefixes) > MAX_REPORTED_PREFIXES:
            self._prefixes.popitem(last=False)

    def __del__(self) -> None:
        actor = getattr(self, "actor", None)
        if actor is not None:
            actor.shutdown()
