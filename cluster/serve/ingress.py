"""The one ingress deployment of every app shape: the OpenAI HTTP app (`serving.app`) over an engine
client that a factory builds in the replica.

`<app>-ingress` (`PagedServeIngress`) is stateless: HTTP, auth, validation, tokenization, chat
templates, SSE; any replica serves any request. What differs between shapes is only how a replica
reaches the engines: `connect_engines` (a handle to the engine deployment, `client.ServeEngineClient`)
or `pd_app.connect_pd` (the PD client over handles to the prefill and decode deployments). A factory is
a module-level coroutine function `(args, upstream) -> EngineConnection`, so it pickles by name into
the replica.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from ray import serve

from pagedserve.cluster.fleet_stats import FleetStats
from pagedserve.cluster.serve.migration import MigratingClient
from pagedserve.cluster.serving.app import build_fastapi_app
from pagedserve.cluster.serving.core import OpenAIServing
from pagedserve.cluster.settings import ServeArgs

# Admission is ours (max_pending_requests -> 503 in the ingress, EngineOverloadedError in the engine).
INGRESS_MAX_ONGOING = 100_000


@dataclass
class EngineConnection:
    """What an ingress replica holds of the engines: the client, each engine's `ready()` answer, and the
    longest sequence every engine accepts."""

    client: Any
    engine_info: list[dict]
    max_model_len: int


ClientFactory = Callable[[ServeArgs, Any], Awaitable[EngineConnection]]


async def connect_engines(args: ServeArgs, engine: Any) -> EngineConnection:
    """The monolithic shape: a handle to the engine deployment, routed by `router.PrefixAffinityRouter`."""
    from pagedserve.cluster.serve.client import ServeEngineClient

    client = ServeEngineClient(engine, engine.app_name, engine.deployment_name)
    info: dict = await engine.ready.remote()  # also starts this handle's router
    return EngineConnection(client, [{**info, "engine_index": info.get("replica", 0)}], info["max_model_len"])


class ServedBy:
    """Names the ingress replica that answered in an `x-pagedserve-ingress` header (load balancer
    debugging). Plain ASGI: it touches only the response start, never the streamed body."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app = app
        self.header = (b"x-pagedserve-ingress", replica.encode())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


@serve.deployment(
    name="PagedServeIngress",
    num_replicas=1,
    max_ongoing_requests=INGRESS_MAX_ONGOING,
    ray_actor_options={"num_cpus": 0},
    health_check_period_s=10,
    health_check_timeout_s=60,
    graceful_shutdown_timeout_s=30,
)
@serve.ingress()
class PagedServeIngress:
    """One ingress replica: the HTTP app over the engine client `connect(args, upstream)` builds."""

    async def __init__(self, args: dict, connect: ClientFactory, upstream: Any) -> None:
        from pagedserve.cluster.serve.direct_ingress import bind_reusably_in_this_replica
        from pagedserve.engine.tokenizer import load_tokenizer

        bind_reusably_in_this_replica()  # (Serve starts a direct-ingress server after this constructor)
        self.args = ServeArgs.model_validate(args)
        # The tokenizer loads while the engines do (a GGUF file's: ~6 s on 2 cores, a tenth of the
        # default model's start-up, which waited for the engines first); a failed connect is raised first.
        tokenizer_path = self.args.tokenizer or self.args.model
        tokenizer_loaded = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, tokenizer_path))
        try:
            self.connection = await connect(self.args, upstream)
        except BaseException:
            tokenizer_loaded.add_done_callback(lambda done: done.cancelled() or done.exception())  # (retrieved)
            raise
        # Every shape's requests survive the engine serving them (migration.py).
        self.client = MigratingClient(self.connection.client, self.args.max_migrations)
        tokenizer = await tokenizer_loaded
        self.serving = OpenAIServing(self.client, tokenizer, self.args, self.connection.max_model_len)

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = build_fastapi_app(self.serving, behind_serve_proxy=True)
        app.add_middleware(ServedBy, replica=serve.get_replica_context().replica_id.unique_id)
        return app

    async def get_engine_info(self) -> list[dict]:
        """The engines' `ready()` answers, as this replica's client sees them."""
        return self.connection.engine_info

    async def get_stats(self) -> FleetStats:
        return self.client.aggregate_stats()
