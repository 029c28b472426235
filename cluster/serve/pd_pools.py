"""Prefill and decode pools: what each pool is (`PoolSpec`: its role, engines, KV connector, resources),
shared by the PD Serve app (`pd_app`, one deployment per pool), and pools of plain engine actors
(`start_pool`) that `PDClient.over_actors` drives in-process, without Serve (offline use, tests).

Every engine of a pool is a named, restartable engine actor whose engine runs the pool's KV role:
`kv_producer` for the prefill pool, `kv_consumer` for the decode pool. Its `engine_id` and the Ray
transport's `ray_actor_name` are the actor's own name, so a consumer can find the producer from the
addresses in a request's kv_transfer_params. `resources` (custom Ray resources, e.g. one that only
prefill nodes offer) pin a pool to a node type; an engine with TP/PP > 1 gets one placement group
(bundle 0 for the engine actor, one bundle per rank, each carrying those resources), which
`cluster/executor/ray_executor.py` then fills with the ranks.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import ray
from pydantic import SecretStr
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagedserve.cluster.serve.engine_actor import engine_actor_options
from pagedserve.cluster.serve.engine_host import EngineHost
from pagedserve.engine.config import EngineConfig
from pagedserve.kv_transfer.auth import SECRET_ENV, SECRET_FILE_ENV, generate_secret

Role = Literal["prefill", "decode"]
KV_ROLES: dict[str, str] = {"prefill": "kv_producer", "decode": "kv_consumer"}


@dataclass
class PoolSpec:
    role: Role
    num_engines: int
    engine_kwargs: dict[str, Any]  # EngineConfig fields, without kv_transfer_config
    kv_connector: str = "ray"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources per engine and per rank
    num_cpus_per_engine: float = 1.0
    max_pending_requests: int = 1024
    stall_timeout_s: float = 120.0
    stream_interval: int | str = "auto"  # generated tokens per streamed delta (`ServeArgs.stream_interval`)
    # The deployment's KV secret, the same for both pools (`deployment_kv_secret`); None: each engine
    # resolves PAGEDSERVE_KV_SECRET / _FILE itself. A SecretStr, so reprs and logs never show it.
    kv_secret: SecretStr | None = None

    def __post_init__(self) -> None:
        if self.role not in KV_ROLES:
            raise ValueError(f"role: {self.role!r} is not one of {sorted(KV_ROLES)}")
        if self.num_engines < 1:
            raise ValueError(f"num_{self.role}_engines: must be >= 1, got {self.num_engines}")
        if self.kv_connector == "inproc":
            raise ValueError("kv_connector: 'inproc' reads KV inside one process; engine pools run in separate "
                             "actors: use 'ray' (or 'torch_p2p')")
        for name, amount in self.resources.items():
            if name in ("CPU", "GPU", "memory") or amount <= 0:
                raise ValueError(f"{self.role}_resources: custom resources with positive amounts only, "
                                 f"got {name}={amount}")

    def kv_transfer_config(self, engine_id: str | None = None, **extra: Any) -> dict[str, Any]:
        """The pool's kv_transfer_config (a Serve replica fills in its own engine_id and address:
        `engine_host.in_replica_engine_kwargs`)."""
        config: dict[str, Any] = {"kv_connector": self.kv_connector, "kv_role": KV_ROLES[self.role],
                                  "kv_connector_extra_config": {**self.kv_connector_extra_config, **extra}}
        if engine_id is not None:
            config["engine_id"] = engine_id
        if self.kv_secret is not None:
            config["kv_secret"] = self.kv_secret  # pickles to the engine as the SecretStr
        return config

    def engine_kwargs_for(self, actor_name: str, namespace: str) -> dict[str, Any]:
        """A named engine actor's kwargs (`start_pool`): its engine_id and Ray transport address are its name."""
        return {**self.engine_kwargs, "kv_transfer_config": self.kv_transfer_config(
            actor_name, ray_actor_name=actor_name, ray_namespace=namespace)}


def deployment_kv_secret() -> SecretStr | None:
    """One fresh secret for the engines of one PD app, which their KV transports authenticate each other
    with; None when the operator provides one (PAGEDSERVE_KV_SECRET / _FILE, which every engine reads)."""
    if os.environ.get(SECRET_ENV) or os.environ.get(SECRET_FILE_ENV):
        return None
    return SecretStr(generate_secret())


@dataclass
class EnginePool:
    """The running engines of one pool (handles and names in index order)."""

    spec: PoolSpec
    names: list[str]
    namespace: str
    handles: list[Any]
    placement_groups: list[PlacementGroup] = field(default_factory=list)

    def shutdown(self) -> None:
        for handle in self.handles:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        for pg in self.placement_groups:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass
        self.handles, self.placement_groups = [], []


def start_pool(spec: PoolSpec, name_prefix: str, namespace: str | None = None,
               max_restarts: int = -1) -> EnginePool:
    """Create the pool's engine actors (not waiting for them: `wait_pool_ready`)."""
    namespace = namespace or ray.get_runtime_context().namespace
    resources = ray.cluster_resources()
    base = dict(spec.engine_kwargs)
    EngineConfig(**spec.engine_kwargs_for("check", namespace))  # bad engine arguments fail here, in the caller
    world = int(base.get("tensor_parallel_size", 1)) * int(base.get("pipeline_parallel_size", 1))
    concurrency = spec.max_pending_requests + 64
    options, pinned = engine_actor_options(base, spec.num_cpus_per_engine, resources,
                                           max_restarts=max_restarts, max_concurrency=concurrency)
    actor_cls = ray.remote(EngineHost)
    pool = EnginePool(spec, [], namespace, [])
    for index in range(spec.num_engines):
        name = f"{name_prefix}-{spec.role}-{index}"
        actor_options = dict(options, name=name, namespace=namespace)
        if world > 1:
            pg = _engine_placement_group(spec, pinned, world)
            pool.placement_groups.append(pg)
            actor_options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=0)
        elif spec.resources:
            actor_options["resources"] = dict(spec.resources)
        kwargs = {**pinned, **spec.engine_kwargs_for(name, namespace)}
        kwargs["device"] = pinned.get("device", kwargs.get("device"))
        pool.handles.append(actor_cls.options(**actor_options).remote(
            kwargs, index, spec.max_pending_requests, spec.stall_timeout_s, stream_interval=spec.stream_interval))
        pool.names.append(name)
    return pool


def _engine_placement_group(spec: PoolSpec, engine_kwargs: dict, world: int) -> PlacementGroup:
    """Bundle 0 for the engine actor, one per rank; every bundle carries the pool's custom resources."""
    rank: dict[str, float] = {"CPU": float(engine_kwargs.get("num_cpus_per_worker", 1.0)), **spec.resources}
    if engine_kwargs.get("device") == "cuda":
        rank["GPU"] = 1.0
    bundles = [{"CPU": float(spec.num_cpus_per_engine), **spec.resources}] + [dict(rank) for _ in range(world)]
    if bundles[0]["CPU"] == 0:
        del bundles[0]["CPU"]
    if not bundles[0]:
        bundles[0] = {"CPU": 0.01}  # a bundle must reserve something
    return placement_group(bundles, strategy=str(engine_kwargs.get("placement_group_strategy", "PACK")))


async def wait_pool_ready(pool: EnginePool, timeout_s: float = 600.0) -> list[dict]:
    """Await every engine's `ready()` (asyncio: a Serve replica's constructor stays responsive)."""
    import asyncio

    from ray.exceptions import ActorUnavailableError

    deadline = time.monotonic() + timeout_s
    answers = []
    for name, handle in zip(pool.names, pool.handles):
        while True:
            try:
                answers.append(await asyncio.wait_for(handle.ready.remote(), max(0.1, deadline - time.monotonic())))
                break
            except ActorUnavailableError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.2)
            except asyncio.TimeoutError:
                raise TimeoutError(f"{pool.spec.role} engine {name} was not ready within {timeout_s:.0f}s "
                                   f"(available resources: {ray.available_resources()})") from None
    return answers


