"""The producer side of torch_p2p: a listener, and one thread per consumer peer serving its reads.

The listener accepts control connections (p2p_protocol); each peer's thread reads its frames in
order, so one pair's reads never interleave: a read's layers go out in full before the next read
starts. The pair's process group is built on the first read (rendezvous through this rank's
TCPStore). Closing shuts the sockets down, which wakes every thread; nothing waits forever.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from pagedserve.kv_transfer.connectors import p2p_group, p2p_protocol
from pagedserve.kv_transfer.kv_source import KVSource, ReadRefused

logger = logging.getLogger(__name__)

# Sends in flight per read before the producer waits for the oldest (bounds the gathered copies alive).
_MAX_LAYERS_IN_FLIGHT = 2


class P2PServer:
    """Serves one producer rank's KVSource to any number of consumer peers."""

    def __init__(self, source: KVSource, host: str, device: torch.device, timeout_s: float) -> None:
        self.source = source
        self.host = host
        self.device = device
        self.timeout_s = timeout_s
        self.listener = p2p_group.listening_socket(host)
        self.port = self.listener.getsockname()[1]
        try:
            self.store = p2p_group.store_server(host, timeout_s)
        except Exception:
            self.listener.close()
            raise
        self.store_port = self.store.port
        self._peers: list[_Peer] = []
        self._lock = threading.Lock()
        self._closed = False
        self.reads_served = 0
        self._thread = threading.Thread(target=self._accept_loop, name=f"torch-p2p-listen-{source.rank}", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, peer = self.listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._peers = [p for p in self._peers if p.thread.is_alive()]
                handler = _Peer(self, conn, f"{peer[0]}:{peer[1]}")
                self._peers.append(handler)
            handler.thread.start()

    def close(self, join_timeout_s: float = 5.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers)
        _shutdown(self.listener)
        for peer in peers:
            _shutdown(peer.conn)
        deadline = time.monotonic() + join_timeout_s
        self._thread.join(join_timeout_s)
        for peer in peers:
            peer.thread.join(max(0.0, deadline - time.monotonic()))
            if peer.thread.is_alive():
                logger.warning("torch_p2p: a peer thread of producer rank %d is still sending; leaving it", self.source.rank)
        self.store = None  # the store server stops with its last reference


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class _Peer:
    def __init__(self, server: P2PServer, conn: socket.socket, name: str) -> None:
        self.server = server
        self.conn = conn
        self.name = name
        self.group: dist.ProcessGroup | None = None
        self.pair_key: str | None = None
        self.backend = "gloo"
        self.thread = threading.Thread(target=self._run, name=f"torch-p2p-peer-{name}", daemon=True)

    def _run(self) -> None:
        try:
            while True:
                message = p2p_protocol.recv_frame(self.conn)
                if message is None or message["op"] == "bye":
                    return
                self._handle(message)
        except Exception as exc:  # noqa: BLE001 - whatever a peer did, only that peer is dropped
            if not self.server._closed:
                logger.warning("torch_p2p: producer rank %d dropped peer %s: %s", self.server.source.rank, self.name, exc)
        finally:
            self.group = None
            self.conn.close()

    def _handle(self, message: dict[str, Any]) -> None:
        op = message["op"]
        if op == "hello":
            if not isinstance(message.get("pair"), str) or not message["pair"].isalnum():
                raise p2p_protocol.ProtocolError(f"hello without a usable pair key: {message!r:.200}")
            self.pair_key = message["pair"]
            self.backend = p2p_group.pick_backend(self.server.device.type, str(message.get("device", "cpu")))
        elif op == "release":
            self.server.source.release(message.get("id"), message.get("token"))  # checked there and by the scheduler
        elif op == "read":
            if self.pair_key is None:
                raise p2p_protocol.ProtocolError("read before hello")
            if self.group is None:
                # A store client of its own: a TCPStore client serializes its calls, so peers sharing one
                # would wait behind a peer stuck in its rendezvous.
                server = self.server
                store = p2p_group.store_client(server.host, server.store_port, server.timeout_s)
                self.group = p2p_group.build_pair_group(store, self.pair_key, p2p_group.PRODUCER_RANK, self.backend,
                                                        server.host, server.device, server.timeout_s)
            self._serve_read(message.get("spec"))
        else:
            raise p2p_protocol.ProtocolError(f"unknown op {op!r}")

    def _serve_read(self, raw_spec: Any) -> None:
        """Send every requested layer's status, K and V in order; errors travel as a status."""
        source = self.server.source
        wire = p2p_group.wire_device(self.backend, self.server.device)
        dst = p2p_group.CONSUMER_RANK
        error: str | None = None
        try:
            # Checked against this rank's layout first: the stream (and any placeholder) is sized from a spec
            # bounded by this rank's cache.
            spec = source.check_request(p2p_protocol.spec_from_json(raw_spec if isinstance(raw_spec, dict) else {}))
        except ValueError as exc:
            # Without a usable spec the stream cannot be sized: the consumer's reads on this pair fail.
            raise p2p_protocol.ProtocolError(str(exc)) from None
        shape = p2p_protocol.layer_shape(spec, source.layout.head_size)
        dtype = p2p_protocol.torch_dtype(source.layout.dtype)
        read = None
        refused = False
        try:
            read = source.open(spec)
        except ReadRefused as exc:
            error, refused = f"{exc.__class__.__name__}: {exc}", True
        placeholder: torch.Tensor | None = None
        in_flight: list[list[Any]] = []
        for layer in spec.layers:
            k = v = None
            if error is None:
                try:
                    k, v = source.read_layer(spec, layer, read)
                except ReadRefused as exc:
                    error, refused = f"{exc.__class__.__name__}: {exc}", True
                except Exception as exc:  # noqa: BLE001 - any producer failure becomes the reader's error
                    error = f"{exc.__class__.__name__}: {exc}"
            if error is not None:
                if placeholder is None:
                    placeholder = torch.zeros(shape, dtype=dtype, device=wire)
                k = v = placeholder
            tensors = [p2p_protocol.encode_status(error, wire), k.to(wire).contiguous(), v.to(wire).contiguous()]
            in_flight.append([self.group.send([t], dst, 0) for t in tensors] + tensors)
            while len(in_flight) > _MAX_LAYERS_IN_FLIGHT:
                _wait_sends(in_flight.pop(0))
        for entry in in_flight:
            _wait_sends(entry)
        self.server.reads_served += 1
        if error is not None and not refused:  # (refusals are counted and logged by the source)
            logger.warning("torch_p2p: producer rank %d could not serve hold %r: %s", source.rank,
                           spec.remote_request_id, error)


def _wait_sends(entry: list[Any]) -> None:
    for item in entry:
        if not isinstance(item, torch.Tensor):
            item.wait()
