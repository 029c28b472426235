"""The PD shape of the Serve app: a pools deployment that owns the prefill and decode engine actors,
and an ingress whose engine client is the PD client (`client.PDClient`).

- `<app>-pools` (`PagedServePDPools`, one replica, no CPU): starts both pools (`pools.start_pool`),
  waits until every engine is ready, and tells ingress replicas the engines' names. It generates the
  app's KV secret (`pools.deployment_kv_secret`) and hands it to every engine in kv_transfer_config.
  The engine actors are its children: deleting the app (or losing the replica) takes them down with
  it; Ray restarts an engine actor that dies on its own (with the same secret).
- `<app>-ingress` (`PagedServePDIngress`): the same HTTP app as the monolithic shape
  (`serving.app.build_fastapi_app`), over a `PDClient` that holds both pools' actor handles.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from fastapi import FastAPI
from pydantic import SecretStr
from ray import serve

from pagedserve.cluster.pd.client import PDClient
from pagedserve.cluster.pd.config import side_layout_kwargs
from pagedserve.cluster.pd.pools import (EnginePool, PoolSpec, deployment_kv_secret, start_pool, unique_prefix,
                                         wait_pool_ready)
from pagedserve.cluster.serving.app import build_fastapi_app
from pagedserve.cluster.serving.core import OpenAIServing
from pagedserve.cluster.serving.settings import ServeArgs

logger = logging.getLogger(__name__)

INGRESS_MAX_ONGOING = 100_000


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
                               max_pending_requests=args.max_pending_requests, kv_secret=kv_secret)
    return specs


@serve.deployment(name="PagedServePDPools", num_replicas=1, ray_actor_options={"num_cpus": 0},
                  health_check_period_s=10, health_check_timeout_s=60)
class PagedServePDPools:
    """Owns the engine actors of both pools."""

    async def __init__(self, args: dict) -> None:
        self.args = ServeArgs.model_validate(args)
        prefix = unique_prefix(self.args.app_name)
        self.pools: dict[str, EnginePool] = {}
        try:
            # One secret per app start, for every engine of both pools (unless the operator set one).
            for role, spec in pool_specs(self.args, kv_secret=deployment_kv_secret()).items():
                self.pools[role] = start_pool(spec, prefix)
            self.ready = {role: await wait_pool_ready(pool) for role, pool in self.pools.items()}
        except BaseException:
            self._shutdown()
            raise
        logger.info("PD pools ready: %s", {role: pool.names for role, pool in self.pools.items()})

    async def info(self) -> dict[str, Any]:
        return {role: {"names": pool.names, "namespace": pool.namespace, "ready": self.ready[role]}
                for role, pool in self.pools.items()}

    def _shutdown(self) -> None:
        for pool in self.pools.values():
            pool.shutdown()

    def __del__(self) -> None:
        self._shutdown()


@serve.deployment(name="PagedServePDIngress", num_replicas=1, max_ongoing_requests=INGRESS_MAX_ONGOING,
                  ray_actor_options={"num_cpus": 0}, health_check_period_s=10, health_check_timeout_s=60,
                  graceful_shutdown_timeout_s=30)
@serve.ingress()
class PagedServePDIngress:
    """One ingress replica: the HTTP app over a PD client."""

    async def __init__(self, args: dict, pools: Any) -> None:
        from pagedserve.engine.tokenizer import load_tokenizer

        self.args = ServeArgs.model_validate(args)
        self.info = await pools.info.remote()
        handles = {role: [ray.get_actor(name, namespace=self.info[role]["namespace"])
                          for name in self.info[role]["names"]] for role in ("prefill", "decode")}
        ready = self.info["prefill"]["ready"] + self.info["decode"]["ready"]
        self.client = PDClient(handles["prefill"], handles["decode"], self.info["prefill"]["names"],
                               prefill_block_size=self.info["prefill"]["ready"][0]["block_size"],
                               decode_block_size=self.info["decode"]["ready"][0]["block_size"],
                               affinity_blocks=self.args.affinity_blocks,
                               imbalance_factor=self.args.imbalance_factor,
                               imbalance_slack=self.args.imbalance_slack, kv_weight=self.args.kv_weight,
                               stats_interval_s=self.args.routing_stats_period_s)
        self.client.start()
        tokenizer = load_tokenizer(self.args.tokenizer or self.args.model)
        max_model_len = min(answer["max_model_len"] for answer in ready)
        self.serving = OpenAIServing(self.client, tokenizer, self.args, max_model_len)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_fastapi_app(self.serving, behind_serve_proxy=True)

    async def get_engine_info(self) -> list[dict]:
        """Every engine's `ready()` answer, with its pool."""
        return [{**answer, "pool": role, "name": name, "namespace": self.info[role]["namespace"]}
                for role in ("prefill", "decode")
                for name, answer in zip(self.info[role]["names"], self.info[role]["ready"])]

    async def get_stats(self) -> dict:
        return self.client.aggregate_stats()


def build_pd_app(args: ServeArgs) -> serve.Application:
    """The PD app: `serve_app.build_app` delegates here when `args.disaggregated`."""
    pools = PagedServePDPools.options(name=f"{args.app_name}-pools").bind(args.to_dict())
    return PagedServePDIngress.options(name=f"{args.app_name}-ingress",
                                       num_replicas=args.num_ingress_replicas).bind(args.to_dict(), pools)
