"""Small Ray helpers: start or join a cluster, find this node's address and a free port."""

from __future__ import annotations

import logging
import os
import socket

import ray

logger = logging.getLogger(__name__)


def ensure_ray(num_cpus: int | None = None, log_to_driver: bool = False) -> None:
    """Reuse a running Ray session; else join `RAY_ADDRESS` when set; else start a local instance.

    `num_cpus` only applies to a new local instance (a cluster reports its own resources).
    """
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS") or None
    kwargs: dict = dict(include_dashboard=False, log_to_driver=log_to_driver, logging_level=logging.WARNING)
    if address is None and num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    logger.info("starting Ray (%s)", f"joining {address}" if address else "local instance")
    ray.init(address=address, **kwargs)


def assigned_cpus() -> float:
    """The CPUs Ray reserved for this actor (0.0 outside one, or for an actor that reserved none)."""
    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:  # a driver reserves nothing
        return 0.0
    return float(ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0))


def use_reserved_cpus(cpu_threads: int | None) -> None:
    """torch threads for an engine in this actor: ``cpu_threads`` when given (its Worker sets them), else
    the CPUs the actor reserved. Ray sets OMP_NUM_THREADS to them only when the actor did not inherit one
    (a shell's OMP_NUM_THREADS=1 would otherwise leave a 4-CPU replica on one thread)."""
    reserved = assigned_cpus()
    if cpu_threads is None and reserved > 0:
        import torch

        torch.set_num_threads(max(1, int(reserved)))
        logger.info("engine actor: %d torch threads (the %.2f CPUs it reserved)", torch.get_num_threads(), reserved)


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
