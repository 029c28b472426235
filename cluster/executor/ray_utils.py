"""Small Ray helpers: start or join a cluster, find this node's address and a free port."""

from __future__ import annotations

import logging
import os
import socket

import ray

logger = logging.getLogger(__name__)


def ensure_ray(num_cpus: int | None = None, log_to_driver: bool = False, address: str | None = None) -> None:
    """Reuse a running Ray session; else join `address` or `RAY_ADDRESS` when set; else start a local instance
    (`ray.init`'s own rule: a `ray start` cluster on this machine is joined; "local" never joins one).

    `num_cpus` only applies to a new local instance (a cluster reports its own resources).
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    kwargs: dict = dict(include_dashboard=False, log_to_driver=log_to_driver, logging_level=logging.WARNING)
    if address in (None, "local") and num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    logger.info("starting Ray (%s)", f"joining {address}" if address not in (None, "local") else "local instance")
    ray.init(address=address, **kwargs)


def assigned_cpus() -> float:
    """The CPUs Ray reserved for this actor (0.0 outside one, or for an actor that reserved none)."""
    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:  # a driver reserves nothing
        return 0.0
    return float(ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0))


def engine_threads(cpu_threads: int | None, reserved_cpus: float, node_cpus: int,
                   engines_per_node: int | None) -> int | None:
    """The torch threads of an engine in a Ray actor (None: leave torch's own count).

    - ``cpu_threads`` set: those (the engine's Worker sets them).
    - ``engines_per_node`` None (the operator chose the actor's CPUs, ``num_cpus_per_engine``): the CPUs
      it reserved, at least 1; none reserved leaves torch's count.
    - else (the CPUs were left at their default, a 1-CPU scheduling token): this node's CPUs shared by the
      engines that may run on it, at least 1. A 1-CPU replica on a 2-core node would otherwise decode on one
      core while the offline engine uses both (vLLM's CPU backend likewise runs a lone engine on every core
      of its node, whatever Ray reserved).
    """
    if cpu_threads is not None:
        return cpu_threads
    if engines_per_node is None:
        return max(1, int(reserved_cpus)) if reserved_cpus > 0 else None
    return max(1, node_cpus // max(1, engines_per_node))


def default_thread_share(engine_kwargs: dict, max_engines: int) -> int | None:
    """`EngineHost(engines_per_node=...)` for an engine whose CPU reservation was left at its default: the
    most engines of its app that may share a node (`max_engines`, counted as if on one node: on several
    nodes each engine gets fewer threads than it could, never more than the node has). None for TP/PP > 1,
    whose ranks compute in their own actors with their own threads (`num_cpus_per_worker`)."""
    world = int(engine_kwargs.get("tensor_parallel_size", 1)) * int(engine_kwargs.get("pipeline_parallel_size", 1))
    return max(1, int(max_engines)) if world == 1 else None


def node_cpus() -> int:
    """The CPUs an engine on this node may use: those this process may run on (its affinity: a cgroup or
    taskset limit), at most what Ray says the node has (an operator's `ray start --num-cpus N`)."""
    from pagedserve.cluster.executor.placement import current_node_cpus

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    told = current_node_cpus() if ray.is_initialized() else 0.0
    return min(usable, max(1, int(told))) if told > 0 else usable


def use_engine_threads(cpu_threads: int | None, engines_per_node: int | None = None) -> None:
    """Set this actor's torch threads for the engine it hosts (`engine_threads`); outside an actor (a driver,
    a unit test) nothing changes. Ray sets OMP_NUM_THREADS to the reserved CPUs only when the actor did not
    inherit one (a shell's OMP_NUM_THREADS=1 would leave a 4-CPU replica on one thread), and torch reads it
    once: so set them here."""
    if cpu_threads is not None or not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return
    reserved = assigned_cpus()
    threads = engine_threads(None, reserved, node_cpus() if engines_per_node is not None else 0, engines_per_node)
    if threads is None:
        return
    import torch

    torch.set_num_threads(threads)
    if engines_per_node is None:
        logger.info("engine actor: %d torch threads (the %.2f CPUs it reserved)", threads, reserved)
    else:
        logger.info("engine actor: %d torch threads (this node's CPUs shared by up to %d engines; it reserved "
                    "%.2f CPUs)", threads, engines_per_node, reserved)


def node_ip() -> str:
    """The IP address other nodes reach this process at."""
    return ray.util.get_node_ip_address()


def free_port() -> int:
    """A TCP port that is free on this host now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def tcp_init_method(ip: str, port: int) -> str:
    """A torch.distributed init method; IPv6 literals need brackets."""
    host = f"[{ip}]" if ":" in ip else ip
    return f"tcp://{host}:{port}"
