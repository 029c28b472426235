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
