"""Two-rank process groups for torch_p2p, built outside the default process group.

An engine rank may already belong to its own default group (TP/PP), so each producer/consumer pair
gets a group of its own, constructed directly from the backend class. Rank 0 is the producer, rank 1
the consumer. Gloo binds to the address the pair's control connection runs between; NCCL is used only
when both ends hold their KV on CUDA.

Rendezvous without a network store: the group's store is a `ChannelStore`, a key-value exchange
between the two ends over their authenticated control connection (p2p_channel.py), open only while
the group is built and warmed up (NCCL creates its point-to-point communicator on the first send, so
a one-element message goes through before the store closes). No TCPStore listens anywhere, so no
stranger can read the pair's addresses or NCCL unique id, or plant its own; after the rendezvous the
store answers from what it holds and sends nothing (NCCL's watchdog may still look into it).

NCCL pairs fail a transfer, never the process: their watchdog timeout is `kv_nccl_timeout_s`
(separate from the connect timeout), and they are built with TORCH_NCCL_ASYNC_ERROR_HANDLING=2
(abort the pair's communicator and fail its work; the default tears the process down) and without
the heartbeat monitor (which kills the process when a watchdog hangs aborting a dead peer's pair).
Every wait on a pair passes its own timeout, which makes NCCL block on it and raise in the caller.
"""

from __future__ import annotations

import base64
import binascii
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pagedserve.kv_transfer.connectors.p2p_channel import Channel
from pagedserve.kv_transfer.connectors.p2p_protocol import ProtocolError

PRODUCER_RANK = 0
CONSUMER_RANK = 1

# Read by ProcessGroupNCCL's constructor (and only there), so they are set around it and restored.
NCCL_PAIR_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",  # CleanUpOnly: abort the pair's communicator, keep the process
    "TORCH_NCCL_ENABLE_MONITORING": "0",  # no heartbeat monitor that kills the process
}
_nccl_env_lock = threading.Lock()

# A rendezvous exchanges a few small keys; an authenticated peer still cannot make the store grow past these.
_MAX_KEYS = 64
_MAX_KEY_CHARS = 512
_MAX_VALUE_BYTES = 64 * 1024


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


def listening_socket(host: str, backlog: int = 128) -> socket.socket:
    """A TCP socket listening on a free port of `host` (the port is chosen by the kernel: no race)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, 0))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


class ChannelStore(dist.Store):
    """A c10d store shared by the two ends of one pair over their control channel, while they build their
    group: `set` sends the key to the peer, `get`/`wait` read the peer's frames until the key is there.
    After `finish` it neither sends nor reads: later lookups see only what it holds."""

    def __init__(self, channel: Channel, deadline: float, frame_timeout_s: float) -> None:
        super().__init__()
        self._channel = channel
        self._deadline = deadline
        self._frame_timeout_s = frame_timeout_s
        self._data: dict[str, bytes] = {}
        self._open = True
        self._peer_done = False
        self._lock = threading.Lock()

    def set(self, key: str, value: bytes) -> None:
        with self._lock:
            self._data[key] = bytes(value)
            if self._open:
                self._channel.send({"op": "store_set", "key": key, "value": base64.b64encode(bytes(value)).decode()},
                                   timeout_s=self._left())

    def get(self, key: str) -> bytes:
        self._await([key])
        return self._data[key]

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self._await(list(keys))

    def check(self, keys: list[str]) -> bool:
        return all(k in self._data for k in keys)

    def num_keys(self) -> int:
        return len(self._data)

    def add(self, key: str, value: int) -> int:
        raise RuntimeError("torch_p2p: the pair rendezvous store has no counters (add)")

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        raise RuntimeError("torch_p2p: the pair rendezvous store has no compare_set")

    def delete_key(self, key: str) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None

    def finish(self) -> None:
        """Both ends call this once their group works: each says so and drains the peer's frames up to the
        peer's own word, so the control stream holds no store frame afterwards; then the store closes."""
        with self._lock:
            if self._open:
                self._channel.send({"op": "rendezvous_done"}, timeout_s=self._left())
                while not self._peer_done:
                    self._receive_one()
                self._open = False

    def close(self) -> None:
        with self._lock:
            self._open = False

    def _left(self) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("torch_p2p: the pair's rendezvous did not finish within connect_timeout_s")
        return left

    def _await(self, keys: list[str]) -> None:
        with self._lock:
            while not all(k in self._data for k in keys):
                if not self._open or self._peer_done:
                    missing = [k for k in keys if k not in self._data]
                    raise RuntimeError(f"torch_p2p: the pair's rendezvous is over; {missing} were never set")
                self._receive_one()

    def _receive_one(self) -> None:
        frame = self._channel.recv(self._left(), self._frame_timeout_s)
        if frame is None:
            raise ConnectionError("torch_p2p: the peer closed the connection during the pair's rendezvous")
        op = frame["op"]
        if op == "rendezvous_done":
            self._peer_done = True
            return
        if op != "store_set":
            raise ProtocolError(f"unexpected {op!r} frame during the pair's rendezvous")
        key, value = frame.get("key"), frame.get("value")
        if not isinstance(key, str) or not isinstance(value, str) or len(key) > _MAX_KEY_CHARS \
                or len(value) > _MAX_VALUE_BYTES * 4 // 3 + 4:
            raise ProtocolError("malformed store_set frame")
        if key not in self._data and len(self._data) >= _MAX_KEYS:
            raise ProtocolError("too many keys in the pair's rendezvous")
        try:
            self._data[key] = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError("store_set value is not base64") from None


@contextmanager
def _nccl_pair_env() -> Iterator[None]:
    with _nccl_env_lock:
        saved = {name: os.environ.get(name) for name in NCCL_PAIR_ENV}
        os.environ.update(NCCL_PAIR_ENV)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def build_pair_group(store: dist.Store, rank: int, backend: str, local_host: str, device: torch.device,
                     connect_timeout_s: float, nccl_timeout_s: float) -> dist.ProcessGroup:
    """The pair's 2-rank group; blocks until the other end has joined (or the rendezvous fails)."""
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=connect_timeout_s)  # the rendezvous; waits pass their own timeouts
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
        return dist.ProcessGroupGloo(store, rank, 2, opts)
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError("torch_p2p: NCCL is not available in this torch build")
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=nccl_timeout_s)
        with _nccl_pair_env():
            return dist.ProcessGroupNCCL(store, rank, 2, opts)
    raise ValueError(f"torch_p2p: unknown backend {backend!r}")


@dataclass
class PairGroup:
    """A pair's group and its store: the store must live as long as the group (NCCL keeps using it)."""

    group: dist.ProcessGroup
    store: ChannelStore
    backend: str
    wire: torch.device


def join_pair(channel: Channel, rank: int, backend: str, device: torch.device, connect_timeout_s: float,
              frame_timeout_s: float, nccl_timeout_s: float) -> PairGroup:
    """Both ends, right after the hello: build the group over the channel, send one message through it
    (NCCL's communicator is created then), and close the rendezvous."""
    deadline = time.monotonic() + connect_timeout_s
    store = ChannelStore(channel, deadline, frame_timeout_s)
    try:
        local_host = channel.sock.getsockname()[0]
        group = build_pair_group(store, rank, backend, local_host, device, connect_timeout_s, nccl_timeout_s)
        wire = wire_device(backend, device)
        probe = torch.full((1,), 1 if rank == PRODUCER_RANK else 0, dtype=torch.uint8, device=wire)
        if rank == PRODUCER_RANK:
            work = group.send([probe], CONSUMER_RANK, 0)
        else:
            work = group.recv([probe], PRODUCER_RANK, 0)
        if not work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic()))):
            raise TimeoutError("torch_p2p: the pair's first message did not arrive within connect_timeout_s")
        if int(probe.item()) != 1:
            raise ProtocolError("the pair's first message is not the producer's")
        store.finish()
    except BaseException:
        store.close()
        raise
    return PairGroup(group, store, backend, wire)
