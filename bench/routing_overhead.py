"""The routing overhead of one shape: the median latency of a one-token request sent straight to the
engines through a Serve handle (the deployment's request router + its replica), against the same request
through the in-process `DPCoordinator` over an engine actor of the same settings (same process, same Ray).

The monolithic app's handle is to `<app>-engine`; the PD app's to `<app>-prefill`, which answers a
one-token request alone (the PD client's `prefill_is_answer` path: no decode leg, no KV transfer).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

PARAMS = {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + k) % 200 + 10 for k in range(32)] for i in range(n)]


async def _timed(client: Any, prompts: list[list[int]]) -> list[float]:
    times = []
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        async for _ in client.generate(f"overhead-{id(client)}-{i}", prompt, PARAMS):
            pass
        times.append(time.perf_counter() - start)
    return times


def routing_overhead(args: Any, n: int) -> dict[str, Any]:
    """`args`: the running app's ServeArgs (in this Ray). Medians in ms and their difference."""
    import ray
    from ray import serve

    from pagedserve.cluster.serve.client import ServeEngineClient
    from pagedserve.cluster.serve.coordinator import DPCoordinator
    from pagedserve.cluster.serve.engine_actor import start_engine_actors, wait_engines_ready

    if n < 1:
        raise ValueError(f"--routing-overhead: must be >= 1, got {n}")
    deployment = f"{args.app_name}-{'prefill' if args.disaggregated else 'engine'}"
    prompts = _prompts(n)
    handle = serve.get_deployment_handle(deployment, args.app_name)
    serve_times = asyncio.run(_timed(ServeEngineClient(handle, args.app_name, deployment), prompts))
    engines = start_engine_actors(args.engine_kwargs(), 1, args.num_cpus_per_engine)
    try:
        wait_engines_ready(engines, timeout_s=300)
        local_times = asyncio.run(_timed(DPCoordinator(engines, block_size=args.block_size), prompts))
    finally:
        for engine in engines:
            ray.kill(engine, no_restart=True)
    serve_ms, local_ms = statistics.median(serve_times) * 1e3, statistics.median(local_times) * 1e3
    return {"deployment": deployment, "requests": n, "serve_handle_median_ms": serve_ms,
            "in_process_coordinator_median_ms": local_ms, "serve_overhead_ms": serve_ms - local_ms}
