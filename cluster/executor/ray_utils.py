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
