"""Where an engine's ranks run: which Ray resources an engine actor reserves, and which GPU it then uses.

An engine on CUDA must reserve its GPUs from Ray, or several data-parallel engines all land on the
first GPU of a node. With TP = PP = 1 the engine actor runs the model itself and reserves one GPU;
with TP/PP > 1 the worker group's placement-group bundles hold one GPU per rank and the engine actor
needs none. Whether an engine runs on CUDA is decided on the driver without a GPU there (it may be a
CPU head node): from `device` in the engine config, or, for "auto", from the cluster's GPU resources.
The decision is written back into the engine's config (`device` = "cuda" or "cpu"), so that the
actor and its workers agree with what was reserved.

Inside an actor, Ray restricts CUDA_VISIBLE_DEVICES to the GPUs it assigned, so `cuda:0` is the
assigned GPU. Ray leaves the variable alone for an actor that reserved no GPU (it would see every
GPU), or when RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES is set: `restrict_to_assigned_gpus`
makes the process see exactly what it reserved in every case.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import ray

logger = logging.getLogger(__name__)


def uses_gpu(device: str, cluster_resources: Mapping[str, float]) -> bool:
    """True if an engine with this `device` setting runs on CUDA in a cluster with these resources."""
    if device == "cuda":
        return True
    if device == "cpu":
        return False
    return cluster_resources.get("GPU", 0) >= 1


def _world_size(engine_kwargs: Mapping) -> int:
    return int(engine_kwargs.get("tensor_parallel_size", 1)) * int(engine_kwargs.get("pipeline_parallel_size", 1))


@dataclass(frozen=True)
class EnginePlacement:
    """The resources of one engine actor, and the device its engine config is pinned to."""

    device: str  # "cuda" or "cpu"
    num_gpus: int  # GPUs reserved by the engine actor itself (0 when a worker group holds them)

    def actor_options(self, num_cpus: float) -> dict:
        return {"num_cpus": num_cpus, "num_gpus": self.num_gpus}


def plan_engine_placement(engine_kwargs: Mapping, cluster_resources: Mapping[str, float]) -> EnginePlacement:
    """Decide an engine's device and the GPUs its actor reserves (pure: unit-testable on a fake cluster)."""
    device = str(engine_kwargs.get("device", "auto"))
    world_size = _world_size(engine_kwargs)
    gpu = uses_gpu(device, cluster_resources)
    return EnginePlacement(device="cuda" if gpu else "cpu", num_gpus=1 if gpu and world_size == 1 else 0)


def warn_if_gpus_short(num_engines: int, engine_kwargs: Mapping, cluster_resources: Mapping[str, float]) -> None:
    """Engines on CUDA wait (pending in Ray) until the cluster has their GPUs: say so up front."""
    needed, have = num_engines * _world_size(engine_kwargs), cluster_resources.get("GPU", 0)
    if engine_kwargs.get("device") == "cuda" and have < needed:
        logger.warning("%d engine(s) need %d GPU(s) but the Ray cluster has %s now; they wait until GPUs join",
                       num_engines, needed, have)


def pinned_engine_kwargs(engine_kwargs: Mapping, placement: EnginePlacement) -> dict:
    """The engine kwargs with `device` fixed to the placement's decision."""
    return {**engine_kwargs, "device": placement.device}


def _in_ray_actor() -> bool:
    if not ray.is_initialized():
        return False
    try:
        return ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # noqa: BLE001 - not a Ray worker process
        return False


def restrict_to_assigned_gpus() -> None:
    """Inside a Ray actor: see exactly the GPUs Ray assigned to it (none if it reserved none).

    Must run before CUDA is initialised in this process; a no-op outside Ray actors."""
    if not _in_ray_actor():
        return
    assigned = [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]
    visible = ",".join(assigned)
    if os.environ.get("CUDA_VISIBLE_DEVICES") != visible:
        logger.debug("CUDA_VISIBLE_DEVICES %r -> %r (the GPUs Ray assigned)", os.environ.get("CUDA_VISIBLE_DEVICES"),
                     visible)
        os.environ["CUDA_VISIBLE_DEVICES"] = visible


# --------------------------------------------------------------------------- can the cluster ever hold it?

# Resource amounts are floats (0.5 CPU): compare with a little slack.
_EPS = 1e-9
AUTOSCALING_ENV = "PAGEDSERVE_CLUSTER_AUTOSCALES"


class UnplaceableLayoutError(ValueError, RuntimeError):
    """The cluster can never hold this layout (its nodes, as they are, cannot take the bundles and no
    autoscaler may add any). A ValueError: the layout asked for is wrong for this cluster."""


def alive_node_resources() -> list[dict[str, float]]:
    """The total resources of every live node of the connected cluster (what it could ever offer now)."""
    return [{k: float(v) for k, v in node["Resources"].items()} for node in ray.nodes() if node.get("Alive")]


def can_place(bundles: list[Mapping[str, float]], strategy: str, nodes: list[Mapping[str, float]]) -> bool:
    """Whether `bundles` fit `nodes` (their total resources) under a placement-group `strategy`.

    PACK and SPREAD may put several bundles on one node and span nodes (they differ only in preference);
    STRICT_PACK needs one node for all; STRICT_SPREAD one node per bundle. An exact search (bundles of an
    engine are few; nodes with equal remaining resources are tried once)."""
    keys = sorted({k for b in bundles for k, v in b.items() if v > 0})
    need = sorted((tuple(float(b.get(k, 0.0)) for k in keys) for b in bundles), reverse=True)
    free = [tuple(float(n.get(k, 0.0)) for k in keys) for n in nodes]

    def fits(have: tuple, want: tuple) -> bool:
        return all(h >= w - _EPS for h, w in zip(have, want))

    if not need:
        return True
    if strategy == "STRICT_PACK":
        total = tuple(sum(column) for column in zip(*need))
        return any(fits(node, total) for node in free)
    strict_spread = strategy == "STRICT_SPREAD"
    if strict_spread and len(need) > len(free):
        return False

    def place(i: int, left: list[tuple], used: frozenset[int]) -> bool:
        if i == len(need):
            return True
        tried: set[tuple] = set()
        for j, have in enumerate(left):
            if (strict_spread and j in used) or have in tried:
                continue
            tried.add(have)
            if fits(have, need[i]):
                after = list(left)
                after[j] = tuple(h - w for h, w in zip(have, need[i]))
                if place(i + 1, after, used | {j}):
                    return True
        return False

    return place(0, free, frozenset())


def cluster_autoscales() -> bool:
    """Whether an autoscaler may add nodes to the connected cluster (then a layout that does not fit
    the nodes of now may still be placed later).

    `PAGEDSERVE_CLUSTER_AUTOSCALES=1|0` decides when set. Otherwise: Ray's autoscaler v2 is enabled, or
    the v1 monitor reports an autoscaler (a `ray up` / KubeRay cluster; a hand-started cluster's monitor
    runs read-only, reports none, and names its node types after node ids)."""
    override = os.environ.get(AUTOSCALING_ENV, "").strip().lower()
    if override in ("1", "true", "yes"):
        return True
    if override in ("0", "false", "no"):
        return False
    try:
        from ray.autoscaler.v2.utils import is_autoscaler_v2

        if is_autoscaler_v2(fetch_from_server=True):
            return True
    except Exception:  # noqa: BLE001 - an older GCS, or no v2 state: fall through to v1
        pass
    import json

    from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized

    if not _internal_kv_initialized():
        return False
    raw = _internal_kv_get(DEBUG_AUTOSCALING_STATUS)
    report = json.loads(raw).get("autoscaler_report") if raw else None
    if not report:
        return False
    types = set(report.get("active_nodes") or {}) | set(report.get("pending_launches") or {})
    return bool(types) and not all(t.startswith("node_") for t in types)


def describe_nodes(nodes: list[Mapping[str, float]], keys: list[str]) -> str:
    shown = [{k: nodes[i].get(k, 0.0) for k in keys} for i in range(len(nodes))]
    return f"{len(nodes)} node(s): " + ", ".join(str(s) for s in shown) if nodes else "no live nodes"


def check_placeable(bundles: list[Mapping[str, float]], strategy: str, layout: str, fix: str,
                    nodes: list[Mapping[str, float]] | None = None, autoscales: bool | None = None) -> None:
    """Raise `UnplaceableLayoutError` at once when the cluster can never place `bundles` (`layout` says
    what they are, `fix` how to make them fit). With an autoscaler, only log: nodes may still join."""
    nodes = alive_node_resources() if nodes is None else nodes
    if can_place(bundles, strategy, nodes):
        return
    keys = sorted({k for b in bundles for k, v in b.items() if v > 0})
    offer = describe_nodes(nodes, keys)
    if (cluster_autoscales() if autoscales is None else autoscales):
        logger.warning("%s does not fit the cluster's nodes now (%s); waiting for the autoscaler to add nodes",
                       layout, offer)
        return
    raise UnplaceableLayoutError(
        f"placement group: the cluster did not offer {len(bundles)} bundles ({layout}, strategy {strategy}) "
        f"and never can: its {offer}, and no autoscaler may add nodes; {fix}"
    )


def kv_share_of_node(reserved_cpus: float, node_cpus: float) -> float:
    """The share of the node's default KV budget for one KV holder (a rank, or a TP=PP=1 engine) that
    reserved `reserved_cpus` of the node's `node_cpus`: what is placed on a node never reserves more than
    its CPUs, so the shares of co-located holders add up to at most 1. A holder that reserved no CPU
    counts as one CPU's worth (it cannot be accounted for otherwise)."""
    if node_cpus <= 0:
        return 1.0
    cpus = reserved_cpus if reserved_cpus > 0 else 1.0
    return max(min(1.0, cpus / node_cpus), 1e-6)


def current_node_cpus() -> float:
    """The CPUs Ray's node that runs this process offers in all (0 outside a Ray worker)."""
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return float(node["Resources"].get("CPU", 0.0))
    return 0.0


def with_engine_kv_share(engine_kwargs: Mapping, reserved_cpus: float) -> dict:
    """The kwargs of a TP = PP = 1 engine on CPU (it holds its KV itself) without an explicit KV budget,
    with its CPU share of the node's default budget (see `kv_share_of_node`); others unchanged (ranks of
    a TP/PP engine take their own share in the worker group)."""
    kwargs = dict(engine_kwargs)
    if (kwargs.get("kv_cache_memory") is not None or kwargs.get("num_kv_blocks") is not None
            or kwargs.get("device") != "cpu" or _world_size(kwargs) > 1 or not _in_ray_actor()):
        return kwargs
    node_cpus = current_node_cpus()
    share = min(float(kwargs.get("kv_cache_memory_share", 1.0)), kv_share_of_node(reserved_cpus, node_cpus))
    logger.info("engine: KV budget %.4f of the node's default (%.2f of its %.0f CPUs reserved)", share,
                reserved_cpus, node_cpus)
    kwargs["kv_cache_memory_share"] = share
    return kwargs
