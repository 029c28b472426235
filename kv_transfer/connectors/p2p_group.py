"""Two-rank process groups for torch_p2p, built outside the default process group.

An engine rank may already belong to its own default group (TP/PP), so each producer/consumer pair
gets a group of its own, constructed directly from the backend class over a store: the producer's
TCPStore (server) or a client of it, under a prefix unique to the pair. Rank 0 is the producer,
rank 1 the consumer. Gloo binds to the interface that reaches the peer; NCCL is used only when both
ends hold their KV on CUDA.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

PRODUCER_RANK = 0
CONSUMER_RANK = 1


def pick_backend(producer_device: str, consumer_device: str) -> str:
    """Both ends compute the same answer from the address and the hello frame."""
    return "nccl" if producer_device == "cuda" and consumer_device == "cuda" else "gloo"


def wire_device(backend: str, device: torch.device) -> torch.device:
    """Where a pair's tensors live on this end: the KV device for NCCL, the CPU for gloo."""
    return device if backend == "nccl" else torch.device("cpu")


def default_host() -> str:
    """This machine's address on its default route (no packet is sent), or loopback without one."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))
        return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()


def local_ip_towards(peer_host: str) -> str:
    """The local address the kernel would use to reach `peer_host` (loopback for a loopback peer)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((peer_host, 1))
        return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()


def listening_socket(host: str) -> socket.socket:
    """A TCP socket listening on a free port of `host` (the port is chosen by the kernel: no race)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, 0))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def store_server(host: str, timeout_s: float) -> dist.TCPStore:
    """A TCPStore server on a free port of `host` (bound to exactly that address)."""
    sock = listening_socket(host)
    port = sock.getsockname()[1]
    # The store takes ownership of the descriptor (and closes it when it is destroyed).
    return dist.TCPStore(host, port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False,
                         master_listen_fd=sock.detach())


def store_client(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s))


def build_pair_group(store: dist.Store, pair_key: str, rank: int, backend: str, local_host: str,
                     device: torch.device, timeout_s: float) -> dist.ProcessGroup:
    """The pair's 2-rank group; blocks until the other end has joined (or `timeout_s` passes)."""
    prefixed = dist.PrefixStore(f"torch_p2p/{pair_key}/", store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
        return dist.ProcessGroupGloo(prefixed, rank, 2, opts)
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError("torch_p2p: NCCL is not available in this torch build")
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
    raise ValueError(f"torch_p2p: unknown backend {backend!r}")
