"""Serve's direct ingress for a server that starts its own Ray: the ingress replica listens on the server's
port itself, with no Serve HTTP proxy between the client and the FastAPI app.

Through the proxy every SSE event of a stream is one more Ray stream item (ingress -> proxy) and one more
process on the path. On a 2-core machine serving the default model, 64 requests at once, the ingress and
the proxy took 3.7-4.7 CPU-seconds a run through the proxy against 1.7-1.8 with direct ingress (the proxy
then idle; served throughput +15%, means of four interleaved runs), and on a machine where the engine
uses every core each CPU-second taken from it costs it about two (see README, Performance). Serve's direct ingress is switched on by environment variables that its
controller and replicas read when they start, so it can only apply to a Ray this process starts: there
the port range Serve allocates ingress ports from is pinned to the one port asked for, a released port is
reused at once (an ingress replica that died comes back on the same port), and a stopping ingress drains
its requests without waiting for an external load balancer to deregister it (there is none). Serve's
proxy still runs (Serve starts it with direct ingress) on a free port of the same host, unused.

A Ray this process joins (`--address`, `RAY_ADDRESS`, a `ray start` cluster on the machine) runs as its
operator started it; the server is then reached through Serve's proxy on the port, as before.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class _StartedRay:
    """The Ray instance `start_ray` began in this process: its GCS address, and the port its Serve gives
    the ingress replica (None: started without direct ingress)."""

    gcs_address: str
    port: int | None


_started: _StartedRay | None = None


def direct_ingress_env(port: int) -> dict[str, str]:
    """The environment a Ray's Serve reads to run direct ingress on exactly `port`."""
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),  # the range is [min, max)
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ for the block (the processes Ray starts inherit them), then as before."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def wanted(args: Any) -> bool:
    """Whether the server's settings allow direct ingress: not turned off, and one ingress replica (each
    replica on a node gets a port of its own, and clients know one)."""
    return args.direct_ingress is not False and args.num_ingress_replicas == 1


def start_ray(args: Any, address: str | None = None) -> None:
    """Start or join Ray for the server described by `args` (ServeArgs), with direct ingress on `args.port`
    when this process starts the Ray instance and `wanted(args)`. A Ray already running in this process is
    kept as it is. `address`: as `ray_utils.ensure_ray` takes it ("local": a new instance whatever runs on
    this machine)."""
    global _started
    import ray

    from pagedserve.cluster.executor.ray_utils import ensure_ray

    if ray.is_initialized():
        return
    env = direct_ingress_env(args.port) if wanted(args) else {}
    with environment(env):
        ensure_ray(address=address)
    if _started_head():
        _started = _StartedRay(ray.get_runtime_context().gcs_address, args.port if env else None)


def _ours() -> _StartedRay | None:
    """What `start_ray` began, while that Ray is the one this process runs."""
    import ray

    if _started is None or not ray.is_initialized() or ray.get_runtime_context().gcs_address != _started.gcs_address:
        return None
    return _started


def started_here() -> bool:
    """Whether the Ray this process runs is one `start_ray` began (its owner shuts it down)."""
    return _ours() is not None


def _started_head() -> bool:
    """Whether this process's ray.init started the Ray instance (its head node) rather than joining one."""
    import ray._private.worker as ray_worker

    node = getattr(ray_worker, "_global_node", None)
    return bool(node is not None and node.is_head())


def serves_directly(args: Any) -> bool:
    """Whether the ingress replica of the server `args` describes listens on `args.port` itself: the Ray
    this process runs is the one it started with direct ingress. Raises ValueError where that Ray cannot
    serve these settings (another port, several ingress replicas) or where direct ingress was asked for
    explicitly and cannot be had."""
    ours = _ours()
    if ours is not None and ours.port is not None:
        port = ours.port
        if args.num_ingress_replicas != 1:  # Serve would give the second replica no port: it could never start
            raise ValueError(f"num_ingress_replicas: this process started Ray with Serve's direct ingress on port "
                             f"{port} (one ingress replica listening there itself); {args.num_ingress_replicas} "
                             f"ingress replicas need a Ray of their own")
        if args.port == port and args.direct_ingress is not False:
            return True
        if args.port == port or args.direct_ingress:  # the proxy and the ingress would both bind the port
            raise ValueError(f"direct_ingress: this process started Ray with Serve's direct ingress on port {port}; "
                             f"port {args.port} with direct_ingress {args.direct_ingress} needs a Ray of its own")
        # Another port on this Ray (after serve.shutdown()): Serve's proxy serves it; the ingress replica
        # still listens on the Ray's own port too.
        logger.warning("port %d: served through Serve's proxy; this process's Ray gives the ingress replica port %d",
                       args.port, port)
        return False
    if args.direct_ingress:
        raise ValueError("direct_ingress: Serve's direct ingress needs a Ray that this process starts (no --address, "
                         "no RAY_ADDRESS, no `ray start` cluster on this machine, no Ray already running in it); "
                         "leave it unset or pass --no-direct-ingress to be served through Serve's proxy")
    return False


def bind_reusably_in_this_replica() -> None:
    """In an ingress replica of a Ray with direct ingress: bind its listening socket as Serve binds its proxy's
    (SO_REUSEADDR, SO_REUSEPORT), not bare. A replica that replaces a dead one on the same port otherwise
    cannot bind while the dead one's closed connections sit in TIME_WAIT (up to a minute), and Serve then
    blocks the port for good: the server would never listen on its port again. (Serve 2.60 binds the
    direct-ingress socket with `enable_so_reuseport=False`; the replica imports the function by name.)"""
    if os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") != "1":
        return
    from ray.serve._private import replica

    original = replica.start_asgi_http_server
    if getattr(original, "binds_reusably", False):
        return

    async def start_asgi_http_server(app: Any, http_options: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["enable_so_reuseport"] = True
        return await original(app, http_options, *args, **kwargs)

    start_asgi_http_server.binds_reusably = True  # type: ignore[attr-defined]
    replica.start_asgi_http_server = start_asgi_http_server


def forget() -> None:
    """This process's Ray was shut down: nothing it started is running any more."""
    global _started
    _started = None
