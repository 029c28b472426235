"""The OpenAI app in-process over a real engine, without Ray: an `EngineHost` (not wrapped by Ray)
behind the real `DPCoordinator`, whose `.remote(...)` calls a small adapter answers locally."""

from __future__ import annotations

import asyncio
import gc
import inspect
import time
from typing import Any

from starlette.testclient import TestClient

from pagedserve.cluster.engine_stats import EngineStats
from pagedserve.cluster.fleet_stats import EngineEntry, FleetStats
from pagedserve.cluster.serve.coordinator import DPCoordinator
from pagedserve.cluster.serve.engine_host import EngineHost
from pagedserve.cluster.serving.app import build_fastapi_app
from pagedserve.cluster.serving.core import OpenAIServing
from pagedserve.cluster.settings import ServeArgs
from pagedserve.engine.tokenizer import load_tokenizer


async def _done(value: Any) -> Any:
    return value


async def _refs(stream):
    async for item in stream:
        yield _done(item)


class _LocalMethod:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        result = self.fn(*args)
        if inspect.isasyncgen(result):
            return _refs(result)  # a streaming call: an async iterator of awaitable "refs"
        if inspect.iscoroutine(result):
            return asyncio.ensure_future(result)  # runs even when the caller does not await (fire and forget)
        return _done(result)


class LocalHandle:
    """What the coordinator needs of a Ray actor handle, over a local EngineHost."""

    def __init__(self, actor: EngineHost) -> None:
        self.actor = actor

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self.actor, name))


class LocalServer:
    """An app over one local engine; `close()` stops the engine."""

    def __init__(self, model: str, engine_kwargs: dict | None = None, **serve_overrides: Any) -> None:
        kwargs = {"model": model, "dtype": "float32", "kv_cache_memory": "16MiB", "block_size": 4,
                  **(engine_kwargs or {})}
        self.actor = EngineHost(kwargs, 0, max_pending_requests=64)
        self.coordinator = DPCoordinator([LocalHandle(self.actor)], block_size=kwargs["block_size"],
                                         stats_interval_s=0.05)
        self.coordinator.start()
        self.args = ServeArgs(model=model, served_model_name="tiny", api_key=None, **serve_overrides)
        config = self.actor.engine.config
        self.serving = OpenAIServing(self.coordinator, load_tokenizer(model), self.args, config.max_model_len)
        self.app = build_fastapi_app(self.serving)

    def kv_blocks(self) -> tuple[int, int]:
        """(free, total) KV blocks of the engine as its loop last published them."""
        stats = self.actor.engine.get_stats().scheduler
        return stats.num_free_blocks, stats.num_total_blocks

    def kv_blocks_when_idle(self, timeout_s: float = 30.0) -> tuple[int, int]:
        """(free, total) once every block is free, or as they stand after `timeout_s`.

        A client has its final output one loop turn before the engine thread publishes that turn's
        stats, and a stream a test dropped unfinished is closed (its request aborted) only when the
        garbage collector gets to it: collect first, then wait for the engine to catch up."""
        gc.collect()
        deadline = time.monotonic() + timeout_s
        free, total = self.kv_blocks()
        while free != total and time.monotonic() < deadline:
            time.sleep(0.05)
            free, total = self.kv_blocks()
        return free, total

    def close(self) -> None:
        self.actor.shutdown()

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def test_client(self) -> TestClient:
        """A TestClient over the app that answers server errors as responses (as a real server would)."""
        return TestClient(self.app, raise_server_exceptions=False)


class OneIdleEngineClient:
    """The engine-client calls besides `generate` for a test double that stands for one idle, healthy
    engine: abort does nothing, the fleet is that engine's empty figures."""

    async def abort(self, request_id):
        pass

    def aggregate_stats(self):
        return FleetStats(engines=[EngineEntry("0", EngineStats())])

    def is_healthy(self):
        return True


class ScriptedCoordinator:
    """The coordinator's API over scripted outputs: `tokens` per request, then `error` (if any) or finish."""

    def __init__(self, tokens: int = 3, error: BaseException | None = None, fail_at_start: BaseException | None = None,
                 gate: asyncio.Event | None = None) -> None:
        self.tokens = tokens
        self.error = error
        self.fail_at_start = fail_at_start
        self.gate = gate
        self.healthy = True
        self.aborted: list[str] = []
        self.num_refreshes = 0

    async def generate(self, request_id, prompt_token_ids, sampling_params, priority=0, final_only=False,
                       cache_salt=None):
        from pagedserve.engine.outputs import CompletionOutput, RequestOutput

        if self.fail_at_start is not None:
            raise self.fail_at_start
        finished = False
        try:
            for step in range(self.tokens):
                if self.gate is not None and step == 1:
                    await self.gate.wait()
                last = step == self.tokens - 1 and self.error is None
                out = CompletionOutput(0, f"t{step} ", [10 + step], None, None, "length" if last else None)
                finished = last
                yield RequestOutput(request_id, None, list(prompt_token_ids), None, [out], last)
            if self.error is not None:
                raise self.error
        finally:
            if not finished:
                self.aborted.append(request_id)

    async def abort(self, request_id):
        self.aborted.append(request_id)

    async def refresh_stats(self):
        self.num_refreshes += 1
        return []

    def aggregate_stats(self):
        return FleetStats(engines=[EngineEntry("0", EngineStats(healthy=self.healthy))])

    def is_healthy(self):
        return self.healthy
