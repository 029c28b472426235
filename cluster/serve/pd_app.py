"""The PD shape of the Serve app: a prefill deployment and a decode deployment of the engine host, and
the one ingress over the PD client.

- `<app>-prefill` and `<app>-decode` (`engine_host.EngineHost`, one replica = one engine): engines
  whose KV role is `kv_producer` / `kv_consumer`. Each pool is its own deployment, so each has its own
  `num_replicas` (`num_prefill_engines` / `num_decode_engines`) or autoscaling config
  (`prefill_min/max_replicas`, `decode_min/max_replicas`, on the role's own signals:
  `pd_autoscaling`), Serve's health checks, replacement, graceful drain and rolling updates, and its
  TP/PP ranks in the replica's placement group, pinned by `prefill_resources` / `decode_resources`
  (on the replica and every rank bundle). A replica names its engine after itself (`engine_id`) and
  serves its KV at (app, deployment, replica) (cluster/pd/ray_transport.py).
- `<app>-ingress` (`ingress.PagedServeIngress`, the class of every shape) over a `PDClient` whose two
  legs are Serve handles (`connect_pd`): the prefill leg routed by prefix affinity and load, the decode
  leg by load, KV usage and prefix affinity (`router.PrefixAffinityRouter` on both deployments).

The app's KV secret (`pd_pools.deployment_kv_secret`: fresh per app build unless the operator sets
PAGEDSERVE_KV_SECRET[_FILE]) goes to the engines of both deployments in their kv_transfer_config (a
SecretStr: no repr shows it). Rebuilding the app (a new `serve run` / `serve deploy` of changed args)
makes a new secret unless the operator set one; during the rolling update that follows, a decode
engine of the old build reading from a prefill engine of the new one is refused and computes the prompt
itself (correct, slower): set PAGEDSERVE_KV_SECRET to keep reads flowing across updates.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import SecretStr
from ray import serve

from pagedserve.cluster.pd_settings import pool_scaling, side_layout_kwargs
from pagedserve.cluster.serve.app import engine_replica_options, engine_thread_share, look_back, most_replicas
from pagedserve.cluster.serve.engine_host import EngineHost
from pagedserve.cluster.serve.ingress import EngineConnection, PagedServeIngress
from pagedserve.cluster.serve.pd_autoscaling import role_policy
from pagedserve.cluster.serve.pd_client import PDClient
from pagedserve.cluster.serve.pd_pools import PoolSpec, deployment_kv_secret
from pagedserve.cluster.settings import ServeArgs

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")


def pool_specs(args: ServeArgs, kv_secret: SecretStr | None = None) -> dict[str, PoolSpec]:
    """The prefill and decode pools that `args` describe; both get `kv_secret` (the app's KV secret)."""
    specs = {}
    for role, count, resources in (("prefill", args.num_prefill_engines, args.prefill_resources),
                                   ("decode", args.num_decode_engines, args.decode_resources)):
        kwargs = {**args.engine_kwargs(), **side_layout_kwargs(args, role)}
        kwargs.pop("kv_transfer_config", None)
        if role == "prefill":  # a prefill computes one token: speculation (and a draft's cache) pays only in decode
            kwargs.pop("speculative_config", None)
        specs[role] = PoolSpec(role, int(count), kwargs, kv_connector=args.kv_connector,
                               kv_connector_extra_config=dict(args.kv_connector_extra_config),
                               resources=dict(resources), num_cpus_per_engine=args.num_cpus_per_engine,
                               max_pending_requests=args.max_pending_requests, kv_secret=kv_secret,
                               stream_interval=args.stream_interval)
    return specs


def pool_deployment_options(args: ServeArgs, spec: PoolSpec,
                            cluster_resources: dict[str, float] | None = None) -> dict[str, Any]:
    """Serve options of one pool's deployment: its replicas or autoscaling config, and what every engine
    deployment sets (`app.engine_replica_options`) with the pool's layout and custom resources."""
    options = engine_replica_options(args, f"{args.app_name}-{spec.role}", spec.engine_kwargs, cluster_resources,
                                     custom_resources=spec.resources)
    scaling = pool_scaling(args, spec.role)
    if scaling is None:
        options["num_replicas"] = spec.num_engines
    else:
        low, initial, high = scaling
        options["autoscaling_config"] = {
            "min_replicas": low, "initial_replicas": initial, "max_replicas": high,
            "upscale_delay_s": args.upscale_delay_s, "downscale_delay_s": args.downscale_delay_s,
            **look_back(args),
            "policy": role_policy(spec.role, args),
        }
    return options


def build_pd_app(args: ServeArgs) -> serve.Application:
    """The PD app: `app.build_app` delegates here when `args.disaggregated`."""
    from pagedserve.cluster.executor.placement import pinned_engine_kwargs, plan_engine_placement
    from pagedserve.cluster.serve.app import _cluster_resources

    resources = _cluster_resources()
    pools = {}
    # One secret per app build, for every engine of both deployments (unless the operator set one).
    specs = pool_specs(args, kv_secret=deployment_kv_secret())
    options = {role: pool_deployment_options(args, spec, resources) for role, spec in specs.items()}
    engines = sum(most_replicas(role_options) for role_options in options.values())  # both pools share nodes
    for role, spec in specs.items():
        kwargs = {**pinned_engine_kwargs(spec.engine_kwargs, plan_engine_placement(spec.engine_kwargs, resources)),
                  "kv_transfer_config": spec.kv_transfer_config()}
        pools[role] = serve.deployment(EngineHost).options(**options[role]).bind(
            kwargs, max_pending_requests=spec.max_pending_requests, stall_timeout_s=spec.stall_timeout_s,
            engines_per_node=engine_thread_share(args, spec.engine_kwargs, engines), stream_interval=spec.stream_interval)
    return PagedServeIngress.options(name=f"{args.app_name}-ingress", num_replicas=args.num_ingress_replicas).bind(
        args.to_dict(), connect_pd, pools)


class ServeRelease:
    """Frees a producer's hold through a handle to the prefill deployment, pinned to the replica that
    holds it (`router.PrefixAffinityRouter`); fire and forget."""

    def __init__(self, prefill_handle: Any) -> None:
        self.handle = prefill_handle

    def __call__(self, engine_id: str, hold_id: str, hold_token: str | None) -> None:
        from pagedserve.cluster.serve.client import own_internal_request_id

        with own_internal_request_id():
            self.handle.kv_release.remote(hold_id, hold_token, replica=engine_id)


async def connect_pd(args: ServeArgs, pools: dict[str, Any]) -> EngineConnection:
    """The PD shape's client factory (`ingress.PagedServeIngress`): a `PDClient` over handles to both pools."""
    from pagedserve.cluster.serve.client import ServeEngineClient

    legs = {role: ServeEngineClient(pools[role], pools[role].app_name, pools[role].deployment_name) for role in ROLES}
    ready = {role: await pools[role].ready.remote() for role in ROLES}  # also starts each handle's router
    client = PDClient(legs["prefill"], legs["decode"], ServeRelease(pools["prefill"]))
    engine_info = [{**ready[role], "pool": role, "engine_index": ready[role]["replica"]} for role in ROLES]
    return EngineConnection(client, engine_info, min(answer["max_model_len"] for answer in ready.values()))
