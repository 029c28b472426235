"""Plain engine actors for the in-process `DPCoordinator` (offline and benchmark use, the PD pools without
Serve): `ray.remote(EngineHost)` (`engine_host`), restartable, many requests in flight.

The actor is an async Ray actor (high `max_concurrency`); its `generate` is a Ray streaming generator.
An engine with TP/PP > 1 builds its own worker group inside the actor through the engine's "ray"
executor backend.

Failure model: actors are restartable (`max_restarts`) with `max_task_retries=0`, so the calls in
flight when an actor dies fail (the coordinator turns that into `EngineDeadError` for those requests
only) instead of being replayed silently. If the engine loop inside a live actor dies, the host's
watchdog exits the process so that Ray restarts it.

- `start_engine_actors(engine_kwargs, data_parallel_size, num_cpus_per_engine=None, ...,
  max_pending_requests=1024, stall_timeout_s=120.0, max_concurrency=None)`: create them (not waiting).
  `num_cpus_per_engine` None reserves 1 CPU per actor and lets each run this node's CPUs divided by
  `data_parallel_size` torch threads (`ray_utils.engine_threads`); a number reserves that many, which are
  then its threads.
- `wait_engines_ready(engines, timeout_s=None) -> list[dict]`: block until every actor's `ready()` answers.
- `engine_actor_options`: the Ray options of one engine actor (placement: see `placement`).
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError

from pagedserve.cluster.executor.placement import pinned_engine_kwargs, plan_engine_placement, warn_if_gpus_short
from pagedserve.cluster.executor.ray_utils import default_thread_share, ensure_ray
from pagedserve.cluster.serve.engine_host import EngineHost
from pagedserve.engine.config import EngineConfig



def start_engine_actors(
    engine_kwargs: dict,
    data_parallel_size: int,
    num_cpus_per_engine: float | None = None,
    name_prefix: str | None = None,
    max_restarts: int = -1,
    max_pending_requests: int = 1024,
    stall_timeout_s: float = 120.0,
    max_concurrency: int | None = None,
) -> list[ray.actor.ActorHandle]:
    """Create `data_parallel_size` restartable engine actors (not waiting for them; see `wait_engines_ready`)."""
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size: must be >= 1, got {data_parallel_size}")
    engines_per_node = None
    if num_cpus_per_engine is None:  # a 1-CPU token in Ray; the threads: the node's CPUs, shared
        num_cpus_per_engine, engines_per_node = 1.0, default_thread_share(engine_kwargs, data_parallel_size)
    if num_cpus_per_engine < 0:
        raise ValueError(f"num_cpus_per_engine: must be >= 0, got {num_cpus_per_engine}")
    if max_pending_requests < 1:
        raise ValueError(f"max_pending_requests: must be >= 1, got {max_pending_requests}")
    EngineConfig(**engine_kwargs)  # fail fast in the caller on bad engine arguments
    ensure_ray()
    concurrency = max_concurrency or max_pending_requests + 64  # + room for stats/health/abort calls
    resources = ray.cluster_resources()
    options, pinned_kwargs = engine_actor_options(engine_kwargs, num_cpus_per_engine, resources,
                                                  max_restarts=max_restarts, max_concurrency=concurrency)
    warn_if_gpus_short(data_parallel_size, pinned_kwargs, resources)
    actor_cls = ray.remote(EngineHost)
    engines = []
    for index in range(data_parallel_size):
        named = dict(options, name=f"{name_prefix}-{index}") if name_prefix is not None else options
        engines.append(
            actor_cls.options(**named).remote(pinned_kwargs, index, max_pending_requests, stall_timeout_s,
                                              engines_per_node=engines_per_node)
        )
    return engines


def engine_actor_options(
    engine_kwargs: dict,
    num_cpus_per_engine: float,
    cluster_resources: dict[str, float],
    max_restarts: int = -1,
    max_concurrency: int = 1088,
) -> tuple[dict[str, Any], dict]:
    """Ray actor options for one engine on a cluster with these resources, and its engine kwargs with
    `device` pinned to what the options reserve (an engine on CUDA holds its GPUs; see `placement`)."""
    placement = plan_engine_placement(engine_kwargs, cluster_resources)
    options: dict[str, Any] = dict(
        placement.actor_options(num_cpus_per_engine),
        max_restarts=max_restarts,
        max_task_retries=0,
        max_concurrency=max_concurrency,
    )
    return options, pinned_engine_kwargs(engine_kwargs, placement)


def wait_engines_ready(engines: list[ray.actor.ActorHandle], timeout_s: float | None = None) -> list[dict]:
    """Block until every engine has loaded its model; returns their `ready()` answers in order.

    A restarting actor rejects calls (ActorUnavailableError) until it is back: retry until `timeout_s`.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    answers: list[dict] = []
    for engine in engines:
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                answers.append(ray.get(engine.ready.remote(), timeout=remaining))
                break
            except ActorUnavailableError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)
    return answers
