"""torch_p2p: KV moves point to point on torch.distributed (gloo on CPU, NCCL when both ends are CUDA).

A producer rank `serve`s its KV: a control listener and a TCPStore on free ports of `kv_host`
(kv_connector_extra_config; default: this machine's address on its default route), see
p2p_server.py. Its address is a plain dict: host, control port, store port, rank, engine id, device.

A consumer rank connects to a producer rank on its first read (one TCP control connection and one
2-rank process group per peer pair, separate from any default group the ranks belong to), sends the
read request, and posts the receives of every requested layer at once, in the order the producer
sends them: the transport fills later layers in the background while the model computes earlier
ones, and `wait_layer` waits only for its own layer. Reads on one pair are serialized by the pair's
lock, so two reads' messages never interleave. A producer-side error arrives as a layer's status; a
lost peer or `read_timeout_s` raises, the pair is dropped (the next read reconnects) and the worker
connector falls back to computing the prompt.

Extra config keys: `kv_host` (address this producer rank advertises and binds), `read_timeout_s`
(a whole read), `connect_timeout_s` (connecting and building a pair's group, default 10 s).

Why control travels on a socket rather than as tensors on the group: a gloo receive can neither be
cancelled nor time out without breaking the pair, so an idle producer thread blocked in one could
not be stopped by `close()`; a socket is shut down and the thread wakes.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pagedserve.kv_transfer.config import KVTransferConfig
from pagedserve.kv_transfer.connectors import p2p_group, p2p_protocol
from pagedserve.kv_transfer.connectors.p2p_server import P2PServer
from pagedserve.kv_transfer.kv_source import KVSource, ReadSpec
from pagedserve.kv_transfer.layout import KVLayout
from pagedserve.kv_transfer.transport import KVTransport, LayerReader

logger = logging.getLogger(__name__)

_DEFAULT_CONNECT_TIMEOUT_S = 10.0


class _Pair:
    """This consumer rank's connection to one producer rank."""

    def __init__(self, address: dict[str, Any], sock: socket.socket, backend: str, device: torch.device) -> None:
        self.address = address
        self.sock = sock
        self.backend = backend
        self.wire = p2p_group.wire_device(backend, device)
        self.key = uuid.uuid4().hex
        self.group: dist.ProcessGroup | None = None
        self.lock = threading.Lock()
        self.broken: str | None = None
        # Readers with receives not yet waited for: a receive whose Work and buffer were dropped early could
        # let the next message land in the wrong place. (Gloo marks a receive complete only in wait(), even
        # though its data arrives in the background, so completion is tracked here.)
        self.live: set[P2PLayerReader] = set()

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(p2p_protocol.encode_frame(message))

    def mark_broken(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()


class P2PLayerReader(LayerReader):
    """One read: its receives are posted; `wait_layer` waits for one layer's status, K and V."""

    def __init__(self, pair: _Pair, spec: ReadSpec, posted: list[tuple[list[Any], list[torch.Tensor]]],
                 deadline: float) -> None:
        self.pair = pair
        self.spec = spec
        self.posted = posted  # per layer: (works, [status, k, v])
        self.deadline = deadline
        self._next = 0

    def wait_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            index = self.spec.layers.index(layer, self._next)
        except ValueError:
            raise ValueError(f"layer {layer} was not requested (or already read) in this read of "
                             f"{self.spec.layers}") from None
        # Skipped layers are still received, in wire order.
        for skipped in range(self._next, index + 1):
            self._wait(skipped)
        self._next = index + 1
        if self._next == len(self.posted):  # the read is done: its buffers belong to the caller alone now
            self.pair.live.discard(self)
        _, (status, k, v) = self.posted[index]
        error = p2p_protocol.decode_status(status)
        if error is not None:
            raise RuntimeError(f"torch_p2p: the producer could not serve request {self.spec.remote_request_id}: {error}")
        return k, v

    def _wait(self, index: int) -> None:
        for work in self.posted[index][0]:
            remaining = self.deadline - time.monotonic()
            if self.pair.broken is not None:
                raise ConnectionError(f"torch_p2p: connection to the producer lost ({self.pair.broken})")
            try:
                if remaining <= 0 or not work.wait(timedelta(seconds=remaining)):
                    raise TimeoutError("read timed out")
            except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError on a lost peer or a timeout
                timed_out = isinstance(exc, TimeoutError) or "Timed out" in str(exc)
                reason = "read_timeout_s expired" if timed_out else f"{exc.__class__.__name__}: {exc}"
                self.pair.mark_broken(reason)
                raise (TimeoutError if timed_out else ConnectionError)(
                    f"torch_p2p: layer {self.spec.layers[index]} of request {self.spec.remote_request_id}: "
                    f"{reason}") from None

    def close(self) -> None:
        """Receive the rest of the read (after a producer error: placeholders, already on their way), so
        the pair's stream stays aligned for the next read; a pair that fails here is dropped."""
        try:
            for index in range(self._next, len(self.posted)):
                self._wait(index)
        except (ConnectionError, TimeoutError):
            pass
        self._next = len(self.posted)
        self.pair.live.discard(self)


class TorchP2PTransport(KVTransport):
    def __init__(self, config: KVTransferConfig, layout: KVLayout, rank: int, device: torch.device) -> None:
        super().__init__(config, layout, rank, device)
        extra = config.extra
        self.host = str(extra.get("kv_host") or p2p_group.default_host())
        self.read_timeout_s = float(extra.get("read_timeout_s", 60.0))
        field = "kv_transfer_config.kv_connector_extra_config.connect_timeout_s"
        try:
            self.connect_timeout_s = float(extra.get("connect_timeout_s", _DEFAULT_CONNECT_TIMEOUT_S))
        except (TypeError, ValueError):
            raise ValueError(f"{field}: must be a number of seconds") from None
        if not self.connect_timeout_s > 0:
            raise ValueError(f"{field}: must be > 0")
        self.server: P2PServer | None = None
        self._pairs: dict[tuple[str, int, int], _Pair] = {}
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ producer

    def serve(self, source: KVSource) -> Any:
        if self.server is None:
            try:
                self.server = P2PServer(source, self.host, self.device, max(self.read_timeout_s, self.connect_timeout_s))
            except OSError as exc:
                raise ValueError(f"kv_transfer_config.kv_connector_extra_config.kv_host: cannot listen on "
                                 f"{self.host!r}: {exc}") from None
        return {"host": self.host, "port": self.server.port, "store_port": self.server.store_port,
                "rank": self.rank, "engine_id": self.config.engine_id, "device": self.device.type}

    # ------------------------------------------------------------------ consumer

    @staticmethod
    def _key(address: Any) -> tuple[str, int, int]:
        try:
            return str(address["host"]), int(address["port"]), int(address["store_port"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"torch_p2p: not a torch_p2p address: {address!r}") from None

    def _pair(self, address: dict[str, Any]) -> _Pair:
        key = self._key(address)
        with self._lock:
            if self._closed:
                raise ConnectionError("torch_p2p: transport closed")
            pair = self._pairs.get(key)
            if pair is not None and pair.broken is None:
                return pair
            self._pairs.pop(key, None)
        sock = socket.create_connection(key[:2], timeout=self.connect_timeout_s)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        backend = p2p_group.pick_backend(str(address.get("device", "cpu")), self.device.type)
        pair = _Pair(address, sock, backend, self.device)
        try:
            pair.send({"op": "hello", "pair": pair.key, "device": self.device.type})
        except OSError:
            sock.close()
            raise
        with self._lock:
            other = self._pairs.get(key)
            if other is not None and other.broken is None:  # another thread connected meanwhile: use one pair
                pair.mark_broken("duplicate")
                return other
            self._pairs[key] = pair
        return pair

    def _connect_group(self, pair: _Pair) -> None:
        host, _, store_port = self._key(pair.address)
        store = p2p_group.store_client(host, store_port, self.connect_timeout_s)
        pair.group = p2p_group.build_pair_group(
            store, pair.key, p2p_group.CONSUMER_RANK, pair.backend, p2p_group.local_ip_towards(host), self.device,
            self.connect_timeout_s)  # every wait on this end passes its own (read) timeout

    def read(self, address: Any, spec: ReadSpec) -> LayerReader:
        p2p_protocol.check_spec_shape(spec)
        deadline = time.monotonic() + self.read_timeout_s
        pair = self._pair(address)
        shape = p2p_protocol.layer_shape(spec, self.layout.head_size)
        dtype = p2p_protocol.torch_dtype(self.layout.dtype)
        with pair.lock:
            try:
                pair.send({"op": "read", "spec": p2p_protocol.spec_to_json(spec)})
                if pair.group is None:
                    self._connect_group(pair)
                posted = []
                for _ in spec.layers:
                    tensors = [torch.empty(p2p_protocol.STATUS_BYTES, dtype=torch.uint8, device=pair.wire),
                               torch.empty(shape, dtype=dtype, device=pair.wire),
                               torch.empty(shape, dtype=dtype, device=pair.wire)]
                    posted.append(([pair.group.recv([t], p2p_group.PRODUCER_RANK, 0) for t in tensors], tensors))
                reader = P2PLayerReader(pair, spec, posted, deadline)
                pair.live.add(reader)
            except Exception as exc:
                pair.mark_broken(f"{exc.__class__.__name__}: {exc}")
                raise ConnectionError(f"torch_p2p: could not start a read from {address.get('host')}:"
                                      f"{address.get('port')}: {exc}") from exc
        return reader

    def release(self, address: Any, remote_request_id: str, hold_token: str) -> None:
        pair = self._pair(address)
        with pair.lock:
            try:
                pair.send({"op": "release", "id": remote_request_id, "token": hold_token})
            except OSError as exc:
                pair.mark_broken(f"{exc.__class__.__name__}: {exc}")
                raise ConnectionError(f"torch_p2p: could not release hold {remote_request_id!r}: {exc}") from exc

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pairs = list(self._pairs.values())
            self._pairs.clear()
        for pair in pairs:
            if pair.broken is None:
                try:
                    pair.sock.settimeout(1.0)
                    pair.send({"op": "bye"})
                except OSError:
                    pass
                pair.mark_broken("closed")
            pair.group = None
        if self.server is not None:
            self.server.close()
