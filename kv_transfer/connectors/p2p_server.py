"""The producer side of torch_p2p: a listener, and one thread per consumer peer serving its reads.

Admission: the accept loop only counts and hands off. A connection is closed at once while
`kv_max_connections` authenticated peers are connected; otherwise it gets a thread that runs TLS (if
configured) and the secret handshake (p2p_channel.py) under `kv_handshake_timeout_s`. At most as many
handshakes run at a time: a new connection pushes the oldest handshake out, so strangers holding
connections open cannot keep a real consumer from connecting, and threads stay bounded
(2 x kv_max_connections + the accept loop). Whatever happens to one connection (a thread that cannot
start, a socket error) closes that connection only; the accept loop keeps serving.

An authenticated peer sends its hello, the pair's group is built over the connection
(p2p_group.join_pair), and the thread then reads its frames in order, so one pair's reads never
interleave: a read's layers go out in full before the next read starts. A peer idle for
`kv_idle_timeout_s` is dropped (the consumer reconnects when it needs to); a frame, once begun, must
arrive within the handshake timeout. Closing shuts the sockets down, which wakes every thread; joins
are bounded, and nothing waits forever.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Any

import torch

from pagedserve.kv_transfer.connectors import p2p_channel, p2p_group, p2p_protocol
from pagedserve.kv_transfer.connectors.p2p_settings import P2PSettings
from pagedserve.kv_transfer.kv_source import KVSource, ReadRefused

logger = logging.getLogger(__name__)

# Sends in flight per read before the producer waits for the oldest (bounds the gathered copies alive).
_MAX_LAYERS_IN_FLIGHT = 2
# Refused and failed connections are summed up in one warning per this many seconds (a flood logs little).
_REFUSAL_LOG_INTERVAL_S = 60.0


class P2PServer:
    """Serves one producer rank's KVSource to any number of authenticated consumer peers."""

    def __init__(self, source: KVSource, settings: P2PSettings, bind_host: str, device: torch.device,
                 secret: bytes, tls: ssl.SSLContext | None = None) -> None:
        self.source = source
        self.settings = settings
        self.device = device
        self._secret = secret
        self._tls = tls
        self.listener = p2p_group.listening_socket(bind_host)
        self.port = self.listener.getsockname()[1]
        self._pending: deque[_Peer] = deque()  # connections in their handshake, oldest first
        self._peers: list[_Peer] = []  # authenticated
        self._lock = threading.Lock()
        self._closed = False
        self.reads_served = 0
        self.refused = 0  # over the cap, failed handshakes, pushed-out handshakes, threads that could not start
        self._unlogged_refusals = 0
        self._last_refusal_log = float("-inf")
        self._thread = threading.Thread(target=self._accept_loop, name=f"torch-p2p-listen-{source.rank}", daemon=True)
        try:
            self._thread.start()
        except BaseException:
            self.listener.close()
            raise

    # ------------------------------------------------------------------ admission

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self.listener.accept()
            except OSError as exc:
                if self._closed:
                    return
                # Out of descriptors or a connection reset before accept: this connection only.
                logger.warning("torch_p2p: producer rank %d could not accept a connection: %s", self.source.rank, exc)
                time.sleep(0.05)
                continue
            try:
                self._admit(conn, f"{peer[0]}:{peer[1]}")
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any one connection
                p2p_channel.close_quietly(conn)
                self._refuse(f"{peer[0]}:{peer[1]}", f"{exc.__class__.__name__}: {exc}")

    def _admit(self, conn: socket.socket, name: str) -> None:
        evicted: _Peer | None = None
        with self._lock:
            if self._closed:
                p2p_channel.close_quietly(conn)
                return
            self._peers = [p for p in self._peers if p.alive]
            full = len(self._peers) >= self.settings.kv_max_connections
            if not full:
                handler = _Peer(self, conn, name)
                if len(self._pending) >= self.settings.kv_max_connections:
                    evicted = self._pending.popleft()
                self._pending.append(handler)
        if full:
            p2p_channel.close_quietly(conn)
            self._refuse(name, "kv_max_connections consumers are connected")
            return
        if evicted is not None:
            evicted.drop()
            self._refuse(evicted.name, "its handshake was pushed out by a newer connection")
        try:
            handler.thread.start()
        except Exception as exc:  # noqa: BLE001 - e.g. "can't start new thread": this connection only
            self._gone(handler)
            p2p_channel.close_quietly(conn)
            self._refuse(name, f"could not start its thread: {exc}")

    def _authenticated(self, peer: _Peer) -> bool:
        """A peer passed its handshake: it joins the served peers unless that would exceed the cap."""
        with self._lock:
            if self._closed or peer not in self._pending:
                return False  # closing, or pushed out meanwhile
            self._pending.remove(peer)
            self._peers = [p for p in self._peers if p.alive]
            if len(self._peers) >= self.settings.kv_max_connections:
                return False
            self._peers.append(peer)
            return True

    def _gone(self, peer: _Peer) -> None:
        with self._lock:
            if peer in self._pending:
                self._pending.remove(peer)

    def _refuse(self, name: str, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.refused += 1
            self._unlogged_refusals += 1
            if now - self._last_refusal_log < _REFUSAL_LOG_INTERVAL_S:
                return
            count, self._unlogged_refusals, self._last_refusal_log = self._unlogged_refusals, 0, now
        logger.warning("torch_p2p: producer rank %d refused %d connection(s) in the last %.0f s (latest: %s: %s)",
                       self.source.rank, count, _REFUSAL_LOG_INTERVAL_S, name, reason)

    @property
    def connections(self) -> int:
        """Live connections: authenticated peers and handshakes in flight."""
        with self._lock:
            return sum(p.alive for p in self._peers) + len(self._pending)

    # ------------------------------------------------------------------ lifetime

    def close(self, join_timeout_s: float = 5.0) -> None:
        """Stop serving: shut every connection down and join the threads for at most `join_timeout_s`.
        Never raises."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._pending) + list(self._peers)
            self._pending.clear()
        p2p_channel.close_quietly(self.listener)
        for peer in peers:
            peer.drop()
        deadline = time.monotonic() + join_timeout_s
        for thread in [self._thread] + [p.thread for p in peers]:
            if thread.ident is None:  # never started
                continue
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                logger.warning("torch_p2p: producer rank %d: thread %s is still busy; leaving it (daemon)",
                               self.source.rank, thread.name)


class _Peer:
    def __init__(self, server: P2PServer, conn: socket.socket, name: str) -> None:
        self.server = server
        self.conn = conn
        self.name = name
        self.pair: p2p_group.PairGroup | None = None
        self.thread = threading.Thread(target=self._run, name=f"torch-p2p-peer-{name}", daemon=True)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def drop(self) -> None:
        """Wake and end this peer's thread (from any thread)."""
        p2p_channel.close_quietly(self.conn)

    def _run(self) -> None:
        server = self.server
        authenticated = False
        try:
            channel = self._handshake()
            if not server._authenticated(self):
                server._refuse(self.name, "over kv_max_connections after its handshake")
                return
            authenticated = True
            self._serve(channel)
        except p2p_channel.AuthenticationError as exc:
            server._refuse(self.name, str(exc))
        except p2p_channel.IdleTimeout:
            if authenticated:  # it reconnects when it has work again
                logger.info("torch_p2p: producer rank %d dropped peer %s after kv_idle_timeout_s without a request",
                            server.source.rank, self.name)
            else:
                server._refuse(self.name, "no handshake within kv_handshake_timeout_s")
        except (OSError, ssl.SSLError, ValueError) as exc:  # timeouts, resets, TLS and protocol errors
            if not server._closed:
                if authenticated:
                    logger.warning("torch_p2p: producer rank %d dropped peer %s: %s", server.source.rank, self.name,
                                   exc)
                else:
                    server._refuse(self.name, f"{exc.__class__.__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - whatever a peer did, only that peer is dropped
            if not server._closed:
                logger.warning("torch_p2p: producer rank %d dropped peer %s: %s: %s", server.source.rank, self.name,
                               exc.__class__.__name__, exc)
        finally:
            if self.pair is not None:
                self.pair.store.close()
            self.pair = None
            p2p_channel.close_quietly(self.conn)
            server._gone(self)

    def _handshake(self) -> p2p_channel.Channel:
        server = self.server
        deadline = time.monotonic() + server.settings.kv_handshake_timeout_s
        p2p_channel.tune(self.conn)
        if server._tls is not None:
            self.conn.settimeout(server.settings.kv_handshake_timeout_s)
            self.conn = server._tls.wrap_socket(self.conn, server_side=True)
        return p2p_channel.server_handshake(self.conn, server._secret, deadline)

    def _serve(self, channel: p2p_channel.Channel) -> None:
        server, settings = self.server, self.server.settings
        frame_timeout = settings.kv_handshake_timeout_s
        hello = channel.recv(frame_timeout, frame_timeout)
        if hello is None:
            return
        device = hello.get("device")
        if hello["op"] != "hello" or device not in ("cpu", "cuda"):
            raise p2p_protocol.ProtocolError(f"expected a hello frame naming a device, got {hello!r:.200}")
        backend = p2p_group.pick_backend(server.device.type, device)
        self.pair = p2p_group.join_pair(channel, p2p_group.PRODUCER_RANK, backend, server.device,
                                        settings.connect_timeout_s, frame_timeout, settings.kv_nccl_timeout_s)
        while True:
            message = channel.recv(settings.kv_idle_timeout_s, frame_timeout)
            if message is None or message["op"] == "bye":
                return
            self._handle(message)

    def _handle(self, message: dict[str, Any]) -> None:
        op = message["op"]
        if op == "release":
            self.server.source.release(message.get("id"), message.get("token"))  # checked there and by the scheduler
        elif op == "read":
            self._serve_read(message.get("spec"))
        else:
            raise p2p_protocol.ProtocolError(f"unknown op {op!r}")

    def _serve_read(self, raw_spec: Any) -> None:
        """Send every requested layer's status, K and V in order; errors travel as a status."""
        assert self.pair is not None
        source = self.server.source
        group, wire = self.pair.group, self.pair.wire
        dst = p2p_group.CONSUMER_RANK
        timeout = timedelta(seconds=self.server.settings.read_timeout_s)
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
            in_flight.append([group.send([t], dst, 0) for t in tensors] + tensors)
            while len(in_flight) > _MAX_LAYERS_IN_FLIGHT:
                _wait_sends(in_flight.pop(0), timeout)
        for entry in in_flight:
            _wait_sends(entry, timeout)
        self.server.reads_served += 1
        if error is not None and not refused:  # (refusals are counted and logged by the source)
            logger.warning("torch_p2p: producer rank %d could not serve hold %r: %s", source.rank,
                           spec.remote_request_id, error)


def _wait_sends(entry: list[Any], timeout: timedelta) -> None:
    """Wait for a layer's sends; a consumer that stops receiving fails them within `timeout` (read_timeout_s)."""
    for item in entry:
        if not isinstance(item, torch.Tensor) and not item.wait(timeout):
            raise TimeoutError("torch_p2p: the consumer did not receive a layer within read_timeout_s")
