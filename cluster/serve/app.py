"""The OpenAI-compatible service on Ray Serve: an engine deployment behind a replicated ingress.

- `<app>-engine` (`engine_host.EngineHost`): one replica = one headless engine. `num_replicas` is the
  data-parallel size, or `autoscaling_config` (min/max replicas, target ongoing requests, delays)
  makes it elastic. Every replica gets the app's KV secret (`pd_pools.deployment_kv_secret`: fresh per
  app build unless the operator sets PAGEDSERVE_KV_SECRET[_FILE]), which signs the offload tier's reads
  between replicas on different nodes. With TP/PP > 1 its placement group bundles hold the ranks. Requests reach it
  through the `router.PrefixAffinityRouter` (request_router_config).
- `<app>-ingress` (`ingress.PagedServeIngress`): stateless; HTTP, auth, validation, tokenization,
  chat templates, SSE. It reaches the engines through a DeploymentHandle (`client.ServeEngineClient`,
  built by `ingress.connect_engines`); any replica serves any request.

`build_app(args)` is the app builder for `serve run pagedserve.cluster.serve.app:build_app ...` and
Serve config files (`manifests/serve_config.yaml`); `start_server` / `shutdown_server` run it
programmatically (the CLI, tests, the benchmark), so both run the same app; `stop_server` is the
CLI's quiet stop.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ray import serve

from pagedserve.cluster.executor.ray_utils import default_thread_share
from pagedserve.cluster.serve.engine_host import EngineHost
from pagedserve.cluster.serve.ingress import PagedServeIngress, connect_engines
from pagedserve.cluster.serve.pd_pools import deployment_kv_secret
from pagedserve.cluster.serving.app import build_fastapi_app
from pagedserve.cluster.settings import ServeArgs

logger = logging.getLogger(__name__)

__all__ = ["EngineHost", "PagedServeIngress", "ROUTER_CLASS", "build_app", "build_fastapi_app",
           "engine_deployment_options", "server_url", "shutdown_server", "start_server", "stop_server"]

ROUTER_CLASS = "pagedserve.cluster.serve.router:PrefixAffinityRouter"


def engine_deployment_options(args: ServeArgs, cluster_resources: dict[str, float] | None = None) -> dict[str, Any]:
    """Serve options of the engine deployment: replicas or autoscaling, resources / placement group
    bundles, the request router, health checks and the graceful-shutdown window."""
    options = engine_replica_options(args, f"{args.app_name}-engine", args.engine_kwargs(), cluster_resources)
    if args.autoscaling:
        low = args.min_replicas if args.min_replicas is not None else 1
        options["autoscaling_config"] = {
            "min_replicas": low,
            "initial_replicas": max(low, 1, min(args.data_parallel_size, args.max_replicas or low)),
            "max_replicas": args.max_replicas if args.max_replicas is not None else max(low, args.data_parallel_size),
            "target_ongoing_requests": args.target_ongoing_requests,
            "upscale_delay_s": args.upscale_delay_s,
            "downscale_delay_s": args.downscale_delay_s,
            **look_back(args),
        }
    else:
        options["num_replicas"] = args.data_parallel_size
    return options


def look_back(args: ServeArgs) -> dict[str, float]:
    """Serve's metrics window when the operator set one (unset: Serve's own, the same 30 s)."""
    if "autoscaling_look_back_period_s" not in args.model_fields_set:
        return {}
    return {"look_back_period_s": args.autoscaling_look_back_period_s}


def engine_replica_options(args: ServeArgs, name: str, engine_kwargs: dict[str, Any],
                           cluster_resources: dict[str, float] | None = None,
                           custom_resources: dict[str, float] | None = None) -> dict[str, Any]:
    """What every engine deployment (monolithic, prefill, decode) sets, but its replica count: resources
    (plus `custom_resources` on the replica and on every rank bundle), placement group bundles for TP/PP,
    the request router, health checks and the graceful-shutdown window."""
    from pagedserve.cluster.executor.placement import plan_engine_placement

    placement = plan_engine_placement(engine_kwargs, cluster_resources or {})
    world = int(engine_kwargs.get("tensor_parallel_size", 1)) * int(engine_kwargs.get("pipeline_parallel_size", 1))
    actor_options = placement.actor_options(args.num_cpus_per_engine)
    custom = dict(custom_resources or {})
    options: dict[str, Any] = {
        "name": name,
        "max_ongoing_requests": args.max_pending_requests,
        "ray_actor_options": actor_options,
        "health_check_period_s": 5,
        "health_check_timeout_s": 60,
        "graceful_shutdown_wait_loop_s": 1.0,
        "graceful_shutdown_timeout_s": args.graceful_shutdown_timeout_s,
        "request_router_config": {
            "request_router_class": ROUTER_CLASS,
            "request_router_kwargs": {"affinity_blocks": args.affinity_blocks,
                                      "imbalance_factor": args.imbalance_factor,
                                      "imbalance_slack": args.imbalance_slack, "kv_weight": args.kv_weight,
                                      "routing_policy": args.routing_policy},
            "request_routing_stats_period_s": args.routing_stats_period_s,
            "request_routing_stats_timeout_s": max(5.0, 5 * args.routing_stats_period_s),
        },
    }
    backend = engine_kwargs.get("distributed_executor_backend") or ("ray" if world > 1 else "uni")
    if world > 1 and backend == "ray":
        rank: dict[str, float] = {"CPU": float(args.num_cpus_per_worker), **custom}
        if placement.device == "cuda":
            rank["GPU"] = 1.0
        # Bundle 0 holds the replica itself; the ranks follow (`ray_executor` schedules them there).
        options["placement_group_bundles"] = [{"CPU": float(args.num_cpus_per_engine), **custom}] + \
            [dict(rank) for _ in range(world)]
        options["placement_group_strategy"] = args.placement_group_strategy
    elif custom:
        options["ray_actor_options"] = {**actor_options, "resources": custom}
    return options


def most_replicas(options: dict[str, Any]) -> int:
    """The most replicas a deployment with these Serve options may run (its count, or autoscaling's max)."""
    if "autoscaling_config" in options:
        return int(options["autoscaling_config"]["max_replicas"])
    return int(options["num_replicas"])


def engine_thread_share(args: ServeArgs, engine_kwargs: dict[str, Any], max_engines: int) -> int | None:
    """`EngineHost(engines_per_node=...)`: None when the operator set `num_cpus_per_engine` (the replica then
    runs that many threads), else the app's most engines (`max_engines`) sharing a node's CPUs
    (`ray_utils.default_thread_share`)."""
    if "num_cpus_per_engine" in args.model_fields_set:
        return None
    return default_thread_share(engine_kwargs, max_engines)


def check_engine_placeable(args: ServeArgs, options: dict[str, Any]) -> None:
    """Raise ValueError (before any replica starts) when no node or set of nodes can ever hold one engine
    replica: its placement-group bundles (TP/PP > 1) or its actor's resources."""
    from pagedserve.cluster.executor.placement import check_placeable

    if "placement_group_bundles" in options:
        bundles, strategy = options["placement_group_bundles"], options["placement_group_strategy"]
        layout = (f"one engine replica: tp={args.tensor_parallel_size} x pp={args.pipeline_parallel_size}, "
                  f"a bundle of {bundles[0]} for the replica and {len(bundles) - 1} rank bundles of {bundles[-1]}")
        fix = ("lower num_cpus_per_worker / num_cpus_per_engine, tensor_parallel_size or pipeline_parallel_size, "
               "choose a placement_group_strategy that may span nodes, or add nodes")
    else:
        actor = options["ray_actor_options"]
        bundles = [{"CPU": float(actor.get("num_cpus", 0)), "GPU": float(actor.get("num_gpus", 0))}]
        strategy = "PACK"
        layout = f"one engine replica (tp=1 x pp=1) needing {bundles[0]}"
        fix = "lower num_cpus_per_engine, or add nodes with more resources"
    check_placeable(bundles, strategy, layout, fix)


def _cluster_resources() -> dict[str, float]:
    import ray

    return dict(ray.cluster_resources()) if ray.is_initialized() else {}


def build_app(args: dict[str, Any]) -> serve.Application:
    """Serve app builder: `serve run pagedserve.cluster.serve.app:build_app model=/path/to/model block_size=16`.

    `args` are `ServeArgs` fields (validated here, so a bad value fails before anything starts)."""
    from pagedserve.cluster.executor.placement import pinned_engine_kwargs, plan_engine_placement

    validated = ServeArgs.model_validate(args)
    if validated.disaggregated:  # a prefill pool and a decode pool behind a PD ingress (cluster/pd/)
        from pagedserve.cluster.serve.pd_app import build_pd_app

        return build_pd_app(validated)
    resources = _cluster_resources()
    options = engine_deployment_options(validated, resources)
    if resources:  # on a live cluster (serve deploy / serve run): an engine it can never place fails now
        check_engine_placeable(validated, options)
    engine_kwargs = pinned_engine_kwargs(validated.engine_kwargs(),
                                         plan_engine_placement(validated.engine_kwargs(), resources))
    # One KV secret per app build for every engine replica (unless the operator set PAGEDSERVE_KV_SECRET[_FILE],
    # which every replica then reads): the offload tier's reads between replicas are signed with it.
    engine = serve.deployment(EngineHost).options(**options).bind(
        engine_kwargs, max_pending_requests=validated.max_pending_requests, kv_secret=deployment_kv_secret(),
        engines_per_node=engine_thread_share(validated, engine_kwargs, most_replicas(options)),
        stream_interval=validated.stream_interval)
    ingress_args = validated.to_dict()
    return PagedServeIngress.options(name=f"{validated.app_name}-ingress",
                                     num_replicas=validated.num_ingress_replicas).bind(ingress_args, connect_engines, engine)


def start_server(args: ServeArgs) -> Any:
    """Start/join Ray, make args.host:args.port serve HTTP, deploy the app and wait until it is ready
    (warning first when that address is reachable from other machines and no API key is set). On a Ray this
    process starts, the ingress replica listens on the port itself (`direct_ingress`; Serve's proxy then gets
    a free port of its own, unused); elsewhere Serve's HTTP proxy listens on it. The "is ready at" line it
    logs names args.port either way.
    Returns the ingress deployment handle (`.get_engine_info.remote().result()`)."""
    import os

    from pagedserve.cluster.executor.ray_utils import free_port
    from pagedserve.cluster.serve import direct_ingress
    from pagedserve.cluster.settings import exposure_warning

    warning = exposure_warning(args)
    if warning is not None:
        logger.warning(warning)
    if args.address:
        os.environ["RAY_ADDRESS"] = args.address
    direct_ingress.start_ray(args)
    direct = direct_ingress.serves_directly(args)
    serve.start(http_options={"host": args.host, "port": free_port() if direct else args.port})
    serve_logger = logging.getLogger("ray.serve")
    hide_serve_ready = _ServeReadyLine()
    serve_logger.addFilter(hide_serve_ready)
    try:
        handle = serve.run(build_app(args.to_dict()), name=args.app_name, route_prefix="/", blocking=False)
    finally:
        serve_logger.removeFilter(hide_serve_ready)
    logger.info("Application %r is ready at %s/", args.app_name, server_url(args))
    return handle


class _ServeReadyLine(logging.Filter):
    """Drops Serve's "Application 'x' is ready at <URL>.": the URL is its proxy's, which with direct ingress
    is a spare port, not where the app is served; start_server logs args.host:args.port instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Application '") and " is ready at " in message)


def shutdown_server(app_name: str | None = None) -> None:
    """Delete one app (its engine replicas stop their engines), or shut Serve down entirely."""
    if app_name is None:
        serve.shutdown()
    else:
        serve.delete(app_name)


STOP_POLL_S = 0.5  # how often a stop checks that Ray's raylet and GCS still run


def stop_server(app_name: str | None, timeout_s: float = 90.0) -> bool:
    """Stop what `start_server` started, quietly: delete the app (its engine replicas finish and stop
    their engines; `app_name` None: every app of this Serve, as a bench that started its own Ray ends),
    then leave Ray. A local instance this process started stops with Serve's actors in
    it; a joined cluster keeps running (its Serve too, without this app). `serve.shutdown()` is not the
    way: the controller it kills fails its own pending calls, which Ray prints as task failures.

    Bounded: a signal sent to the whole process group (`timeout`, systemd's control-group stop) also
    stops the raylet this process started, and Serve's calls then wait forever. They run on a thread;
    after `timeout_s`, or at once when a Ray process this driver started has died, Ray is left all the
    same. Returns whether the apps were deleted."""
    import ray

    from pagedserve.cluster.serve import direct_ingress

    deleted = threading.Event()
    failure: list[BaseException] = []

    def delete() -> None:
        try:
            for name in [app_name] if app_name is not None else list(serve.status().applications):
                serve.delete(name)
        except Exception as exc:  # Ray or Serve already gone: nothing left to delete through them
            failure.append(exc)
        finally:
            deleted.set()

    threading.Thread(target=delete, name="pagedserve-stop", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not deleted.wait(STOP_POLL_S):
        if _started_ray_process_died() or time.monotonic() > deadline:
            break
    if not deleted.is_set() or failure:
        why = f"{failure[0]!r}" if failure else (
            "a Ray process it started has exited" if _started_ray_process_died() else f"not done in {timeout_s:g} s")
        what = f"the app {app_name!r}" if app_name is not None else "its apps"
        logger.warning("pagedserve: Serve did not delete %s (%s); stopping Ray all the same", what, why)
    ray.shutdown()
    direct_ingress.forget()
    return deleted.is_set() and not failure


def _started_ray_process_died() -> bool:
    """Whether the raylet or GCS of the Ray instance this driver started has exited (Serve's calls then
    never return)."""
    import ray._private.worker as ray_worker
    from ray._private import ray_constants

    node = getattr(ray_worker, "_global_node", None)
    if node is None or not node.is_head():
        return False
    vital = (ray_constants.PROCESS_TYPE_RAYLET, ray_constants.PROCESS_TYPE_GCS_SERVER)
    return any(kind in vital for kind, _ in node.dead_processes())


def server_url(args: ServeArgs) -> str:
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    return f"http://{host}:{args.port}"
