"""What a pagedserve Serve app asks Ray for, what a cluster's nodes offer, and whether the one fits the other.

The demand mirrors the code that makes the requests:
- the ingress deployment (`serve_app.PagedServeIngress`): its `ray_actor_options` per replica
  (`num_ingress_replicas` of them), or the Serve config's `deployments` override;
- one engine replica per data-parallel rank, or autoscaling's `max_replicas`
  (`serve_app.engine_deployment_options`): `num_cpus_per_engine` CPUs, plus 1 GPU when the engine
  runs on CUDA with TP = PP = 1 (the replica runs the model itself);
- with the "ray" executor backend (the default when tp * pp > 1), the replica's placement group:
  bundle 0 {CPU: num_cpus_per_engine} for the replica, then tp * pp bundles of
  {CPU: num_cpus_per_worker, GPU: 1 on CUDA} for the ranks, placed with `placement_group_strategy`.

The fit is a first-fit placement over the nodes a cluster can have at most, honouring each placement
strategy (STRICT_PACK: one node; STRICT_SPREAD: distinct nodes; PACK/SPREAD: may span nodes). It is a
check for manifests, not an optimal solver: a demand it places surely fits.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from tests.manifest_checks import ManifestError, pod_groups

RESOURCES = ("CPU", "GPU")


@dataclass
class EngineDemand:
    actor: dict[str, float]  # the engine actor's own reservation
    bundles: list[dict[str, float]] = field(default_factory=list)  # its worker group, [] without one
    strategy: str = "PACK"


@dataclass
class AppDemand:
    engines: list[EngineDemand]
    ingress: list[dict[str, float]]  # one entry per ingress replica

    def total(self, resource: str) -> float:
        engines = sum(e.actor.get(resource, 0) + sum(b.get(resource, 0) for b in e.bundles) for e in self.engines)
        return engines + sum(r.get(resource, 0) for r in self.ingress)


def engine_demand(args: Any, cluster_has_gpu: bool) -> EngineDemand:
    """One engine replica's reservations, from validated `ServeArgs`: with a worker group (TP/PP > 1,
    "ray" backend) one placement group whose bundle 0 holds the replica and the rest one rank each;
    else the replica's own CPUs plus 1 GPU when it runs the model on CUDA."""
    gpu = args.device == "cuda" or (args.device == "auto" and cluster_has_gpu)
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    if args.executor_backend == "ray" and world > 1:
        rank = {"CPU": float(args.num_cpus_per_worker), "GPU": 1.0 if gpu else 0.0}
        bundles = [{"CPU": float(args.num_cpus_per_engine), "GPU": 0.0}] + [dict(rank) for _ in range(world)]
        return EngineDemand(actor={}, bundles=bundles, strategy=args.placement_group_strategy)
    actor = {"CPU": float(args.num_cpus_per_engine), "GPU": 1.0 if gpu and world == 1 else 0.0}
    return EngineDemand(actor=actor)


def _override(app: dict, names: tuple[str, ...]) -> dict:
    return next((d for d in app.get("deployments") or [] if d.get("name") in names), {})


def _replicas(deployment: dict, default: int) -> int:
    """The most replicas a `deployments:` entry can run: num_replicas, or autoscaling's max_replicas."""
    if deployment.get("num_replicas") == "auto" or "autoscaling_config" in deployment:
        return int((deployment.get("autoscaling_config") or {}).get("max_replicas", 1))
    return int(deployment.get("num_replicas", default))


def ingress_demand(app: dict, default_options: dict, default_replicas: int, app_name: str = "pagedserve"
                   ) -> list[dict[str, float]]:
    """The ingress replicas' reservations, with a `deployments:` override from the Serve config applied."""
    deployment = _override(app, (f"{app_name}-ingress", "PagedServeIngress"))
    options = {**default_options, **(deployment.get("ray_actor_options") or {})}
    replicas = _replicas(deployment, default_replicas)
    one = {"CPU": float(options.get("num_cpus", 1)), "GPU": float(options.get("num_gpus", 0))}
    return [dict(one) for _ in range(replicas)]


def engine_replicas(args: Any, app: dict) -> int:
    """The most engine replicas: the DP size, autoscaling's max_replicas, or a `deployments:` override."""
    default = args.data_parallel_size
    if args.autoscaling:
        low = args.min_replicas if args.min_replicas is not None else 1
        default = args.max_replicas if args.max_replicas is not None else max(low, args.data_parallel_size)
    return _replicas(_override(app, (f"{args.app_name}-engine",)), default)


def pool_demand(args: Any, role: str, cluster_has_gpu: bool) -> EngineDemand:
    """One engine replica of a prefill/decode deployment (`cluster/serve/pd_app.py`): the pool's TP/PP layout,
    and its custom resources on the replica or on every bundle of its placement group."""
    layout = {"tensor_parallel_size": getattr(args, f"{role}_tensor_parallel_size") or args.tensor_parallel_size,
              "pipeline_parallel_size": getattr(args, f"{role}_pipeline_parallel_size") or args.pipeline_parallel_size}
    demand = engine_demand(args.model_copy(update=layout), cluster_has_gpu)
    pins = {k: float(v) for k, v in getattr(args, f"{role}_resources").items()}
    demand.actor = {**demand.actor, **pins} if demand.actor else demand.actor
    demand.bundles = [{**b, **pins} for b in demand.bundles]
    return demand


def app_demand(args: Any, app: dict, ingress_options: dict, cluster_has_gpu: bool) -> AppDemand:
    if args.disaggregated:  # the pools' engine replicas (at most max_replicas each); the ingress reserves no CPU
        from pagedserve.cluster.pd_settings import pool_scaling

        def most(role: str) -> int:
            scaling = pool_scaling(args, role)
            return getattr(args, f"num_{role}_engines") if scaling is None else scaling[2]

        engines = ([pool_demand(args, "prefill", cluster_has_gpu) for _ in range(most("prefill"))]
                   + [pool_demand(args, "decode", cluster_has_gpu) for _ in range(most("decode"))])
        return AppDemand(engines=engines, ingress=[{"CPU": 0.0} for _ in range(args.num_ingress_replicas)])
    engines = [engine_demand(args, cluster_has_gpu) for _ in range(engine_replicas(args, app))]
    return AppDemand(engines=engines, ingress=ingress_demand(app, ingress_options, args.num_ingress_replicas,
                                                             args.app_name))


# --------------------------------------------------------------------------- what nodes offer


@dataclass
class Node:
    name: str
    free: dict[str, float]


def quantity(value: Any) -> float:
    """A Kubernetes CPU/GPU quantity ("2", 2, "500m") as a number."""
    text = str(value).strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(m?)", text)
    if match is None:
        raise ManifestError(f"resource quantity {value!r}: not a plain or milli quantity")
    number = float(match.group(1))
    return number / 1000 if match.group(2) else number


def pod_offer(group: str, start_params: dict, pod: dict) -> dict[str, float]:
    """What Ray on this pod offers (rayStartParams, else the container's limits, as KubeRay derives them),
    after checking that rayStartParams and the Pod's requests/limits agree."""
    container = pod["containers"][0]
    resources = container.get("resources") or {}
    limits, requests = resources.get("limits", {}), resources.get("requests", {})
    for name in set(limits) & set(requests):
        if name in ("cpu", "nvidia.com/gpu") and quantity(requests[name]) > quantity(limits[name]):
            raise ManifestError(f"{group}: requests.{name} {requests[name]} > limits.{name} {limits[name]}")
    cpu_limit = limits.get("cpu", requests.get("cpu"))
    if "num-cpus" in start_params:
        cpus = quantity(start_params["num-cpus"])
        if cpu_limit is not None and cpus > quantity(cpu_limit):
            raise ManifestError(f"{group}: rayStartParams num-cpus {cpus:g} > the container's CPU limit {cpu_limit}")
    elif cpu_limit is not None:
        cpus = float(int(quantity(cpu_limit)))
    else:
        raise ManifestError(f"{group}: neither rayStartParams num-cpus nor a CPU limit: Ray would count the host's CPUs")
    gpu_limit = quantity(limits.get("nvidia.com/gpu", 0))
    gpus = quantity(start_params.get("num-gpus", gpu_limit))
    if gpus != gpu_limit:
        raise ManifestError(f"{group}: rayStartParams num-gpus {gpus:g} but limits nvidia.com/gpu {gpu_limit:g}")
    return {"CPU": cpus, "GPU": gpus, **custom_resources(group, start_params.get("resources"))}


def custom_resources(group: str, value: Any) -> dict[str, float]:
    """rayStartParams `resources`, which KubeRay passes to `ray start --resources`: a quoted JSON object
    ('"{\\"name\\": 1}"')."""
    if value is None:
        return {}
    text = str(value).strip()
    if text.startswith('"') and text.endswith('"'):
        text = json.loads(text)
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{group}: rayStartParams resources {value!r} is not a JSON object: {exc}") from None
    if not isinstance(parsed, dict) or not all(isinstance(v, (int, float)) and v > 0 for v in parsed.values()):
        raise ManifestError(f"{group}: rayStartParams resources {value!r} must map names to positive amounts")
    return {str(k): float(v) for k, v in parsed.items()}


def kuberay_nodes(spec: dict) -> list[Node]:
    """The most pods a RayCluster spec can have: replicas, or maxReplicas when the autoscaler runs."""
    autoscaling = bool(spec.get("enableInTreeAutoscaling"))
    groups = {g["groupName"]: g for g in spec.get("workerGroupSpecs", [])}
    nodes = []
    for name, params, pod in pod_groups(spec):
        offer = pod_offer(name, params, pod)
        if name == "head":
            nodes.append(Node("head", offer))
            continue
        group = groups[name]
        count = group.get("maxReplicas", 0) if autoscaling else group.get("replicas", 0)
        count *= group.get("numOfHosts", 1)
        nodes += [Node(f"{name}-{i}", dict(offer)) for i in range(count)]
    return nodes


def ray_up_nodes(prepared: dict) -> list[Node]:
    """The most nodes a prepared `ray up` config can have (head + each type's max_workers, capped by
    the global max_workers), from the node types' declared `resources`."""
    nodes, budget = [], prepared["max_workers"]
    for name, spec in prepared["available_node_types"].items():
        offer = {r: float(spec.get("resources", {}).get(r, 0)) for r in RESOURCES}
        if name == prepared["head_node_type"]:
            nodes.append(Node(name, offer))
            continue
        count = min(spec.get("max_workers", 0), budget)
        budget -= count
        nodes += [Node(f"{name}-{i}", dict(offer)) for i in range(count)]
    return nodes


# --------------------------------------------------------------------------- fitting


def _fits(node: Node, need: dict[str, float]) -> bool:
    return all(node.free.get(r, 0) + 1e-9 >= amount for r, amount in need.items())


def _take(node: Node, need: dict[str, float]) -> None:
    for r, amount in need.items():
        node.free[r] = node.free.get(r, 0) - amount


def _sum(bundles: list[dict[str, float]]) -> dict[str, float]:
    names = {r for b in bundles for r in b} | set(RESOURCES)
    return {r: sum(b.get(r, 0) for b in bundles) for r in names}


def _place_group(nodes: list[Node], bundles: list[dict[str, float]], strategy: str) -> bool:
    if strategy in ("STRICT_PACK", "PACK"):
        whole = _sum(bundles)
        for node in nodes:
            if _fits(node, whole):
                _take(node, whole)
                return True
        if strategy == "STRICT_PACK":
            return False
    used: set[str] = set()
    for bundle in bundles:
        fresh = [n for n in nodes if n.name not in used]
        order = fresh if strategy == "STRICT_SPREAD" else fresh + [n for n in nodes if n.name in used]
        node = next((n for n in order if _fits(n, bundle)), None)
        if node is None:
            return False
        _take(node, bundle)
        used.add(node.name)
    return True


def check_fit(demand: AppDemand, nodes: list[Node], where: str) -> None:
    """Place every engine's worker group, engine actor and the ingress replicas on `nodes` (copies)."""
    nodes = [Node(n.name, dict(n.free)) for n in nodes]
    offered = {r: sum(n.free.get(r, 0) for n in nodes) for r in RESOURCES}
    for index, engine in enumerate(demand.engines):
        if engine.bundles and not _place_group(nodes, engine.bundles, engine.strategy):
            raise ManifestError(
                f"{where}: engine {index}'s worker group ({len(engine.bundles)} bundles of {engine.bundles[-1]}, "
                f"{engine.strategy}) does not fit the nodes ({_describe(nodes)} left)")
        if engine.actor and not _place_group(nodes, [engine.actor], "PACK"):
            raise ManifestError(f"{where}: engine actor {index} needs {engine.actor}, no node has it "
                                f"({_describe(nodes)} left; the cluster offers {offered} at most)")
    for replica in demand.ingress:
        if not _place_group(nodes, [replica], "PACK"):
            raise ManifestError(f"{where}: an ingress replica needs {replica}, no node has it ({_describe(nodes)} left)")


def _describe(nodes: list[Node]) -> str:
    return ", ".join(f"{n.name}: {n.free.get('CPU', 0):g} CPU {n.free.get('GPU', 0):g} GPU" for n in nodes)
