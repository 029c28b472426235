"""The OpenAI-compatible HTTP service on Ray Serve: a FastAPI app as the Serve ingress.

`pagedserve.cluster.serving` holds the request logic and the FastAPI app (`build_fastapi_app`).
`PagedServeIngress` is the Serve deployment: its constructor starts the engine actors and the
coordinator, then builds the FastAPI app for this replica (`__serve_build_asgi_app__`, so no app object is shared at module level).
`build_app(args)` is the app builder for `serve run pagedserve.cluster.serve_app:build_app model=...` and
Serve config files; `start_server` / `shutdown_server` run it programmatically (the CLI, tests,
the benchmark).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI
from ray import serve

from pagedserve.cluster.serving.app import build_fastapi_app
from pagedserve.cluster.serving.core import OpenAIServing
from pagedserve.cluster.serving.settings import ServeArgs

logger = logging.getLogger(__name__)

__all__ = ["PagedServeIngress", "build_app", "build_fastapi_app", "server_url", "shutdown_server", "start_server"]


# --------------------------------------------------------------------------- Ray Serve


@serve.deployment(
    name="PagedServeIngress",
    num_replicas=1,
    max_ongoing_requests=100_000,  # admission is ours (max_pending_requests -> 503), not Serve's queue
    ray_actor_options={"num_cpus": 0},
    health_check_period_s=10,
    health_check_timeout_s=60,
    graceful_shutdown_timeout_s=5,
)
@serve.ingress()
class PagedServeIngress:
    """One replica: the engine actors it started, their coordinator, and the HTTP app in front."""

    async def __init__(self, args: dict) -> None:
        from pagedserve.cluster.coordinator import DPCoordinator
        from pagedserve.cluster.engine_actor import start_engine_actors
        from pagedserve.engine.processor import load_tokenizer

        self.args = ServeArgs.model_validate(args)
        a = self.args
        logger.info("pagedserve: loading %s on %d engine(s) (tp=%d, pp=%d)", a.model, a.data_parallel_size,
                    a.tensor_parallel_size, a.pipeline_parallel_size)
        self.engines = start_engine_actors(a.engine_kwargs(), a.data_parallel_size, a.num_cpus_per_engine,
                                           max_pending_requests=a.max_pending_requests)
        self.engine_info: list[dict] = list(await asyncio.gather(*(e.ready.remote() for e in self.engines)))
        for info in self.engine_info:
            logger.info("pagedserve: engine %d ready: %d KV blocks of %d tokens, max_model_len %d",
                        info["engine_index"], info["num_kv_blocks"], info["block_size"], info["max_model_len"])
        self.coordinator = DPCoordinator(self.engines, block_size=self.engine_info[0]["block_size"])
        self.coordinator.start()
        await self.coordinator.refresh_stats()
        tokenizer = load_tokenizer(a.tokenizer or a.model)
        self.serving = OpenAIServing(self.coordinator, tokenizer, a, self.engine_info[0]["max_model_len"])

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_fastapi_app(self.serving)

    async def get_engine_info(self) -> list[dict]:
        return self.engine_info

    async def get_stats(self) -> dict:
        await self.coordinator.refresh_stats()
        return self.coordinator.aggregate_stats()

    async def __del__(self) -> None:
        import ray

        coordinator = getattr(self, "coordinator", None)
        if coordinator is not None:
            await coordinator.stop()
        for engine in getattr(self, "engines", []):
            ray.kill(engine, no_restart=True)


def build_app(args: dict[str, Any]) -> serve.Application:
    """Serve app builder: `serve run pagedserve.cluster.serve_app:build_app model=/path/to/model block_size=16`.

    `args` are `ServeArgs` fields (validated here, so a bad value fails before anything starts)."""
    validated = ServeArgs.model_validate(args)
    return PagedServeIngress.options(name=f"{validated.app_name}-ingress").bind(validated.to_dict())


def start_server(args: ServeArgs) -> Any:
    """Start/join Ray, start Serve's HTTP proxy on args.host:args.port, deploy the app and wait until it
    is ready. Returns the deployment handle (`.get_engine_info.remote().result()`)."""
    import os

    from pagedserve.cluster.ray_utils import ensure_ray

    if args.address:
        os.environ["RAY_ADDRESS"] = args.address
    ensure_ray()
    serve.start(http_options={"host": args.host, "port": args.port})
    return serve.run(build_app(args.to_dict()), name=args.app_name, route_prefix="/", blocking=False)


def shutdown_server(app_name: str | None = None) -> None:
    """Delete one app (its replica kills its engine actors), or shut Serve down entirely."""
    if app_name is None:
        serve.shutdown()
    else:
        serve.delete(app_name)


def server_url(args: ServeArgs) -> str:
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    return f"http://{host}:{args.port}"
