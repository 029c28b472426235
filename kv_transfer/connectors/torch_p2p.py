"""torch_p2p: KV moves point to point on torch.distributed (gloo on CPU, NCCL when both ends are CUDA).

A producer rank `serve`s its KV: a control listener on a free port of `kv_bind_host` (default
`kv_host`, itself by default this machine's address on its default route), see p2p_server.py. Its
address is a plain dict: advertised host (`kv_host`), control port, rank, engine id, device.

Who may connect: every control connection starts with a mutual challenge-response over the
deployment's KV secret (`KVTransferConfig.secret()`, kv_transfer/auth.py; p2p_channel.py), before the
producer reads a single frame; the secret never travels, and every later frame carries an HMAC tag
under a key of that session. A stranger gets no frame read, no thread for longer than
`kv_handshake_timeout_s`, and nothing else. The pair's process group rendezvouses over that
authenticated connection (p2p_group.ChannelStore): no TCPStore listens anywhere, so the group's
addresses and NCCL id never reach anyone else. Optional TLS wraps the control connection. The data
plane itself (gloo/NCCL sockets) is neither encrypted nor authenticated beyond its rendezvous: run
pools on a network you trust with KV, as with any NCCL job.

A consumer rank connects to a producer rank on its first read (one control connection and one 2-rank
process group per peer pair, separate from any default group the ranks belong to), sends the read
request, and posts the receives of every requested layer at once, in the order the producer sends
them: the transport fills later layers in the background while the model computes earlier ones, and
`wait_layer` waits only for its own layer. Reads on one pair are serialized by the pair's lock, so two
reads' messages never interleave. Connecting, starting reads and releases run on a few I/O threads of
the transport, never on the engine's step thread: `read` and `release` return at once, and only
`wait_layer` waits (for its layer, within `read_timeout_s`). A producer that could not be reached is
not tried again for `kv_reconnect_backoff_s`: reads and releases to it fail at once meanwhile (the
consumer computes those prompts). A producer-side error arrives as a layer's status; a lost peer or
`read_timeout_s` raises, the pair is dropped (the next read reconnects) and the worker connector
falls back to computing the prompt.

Extra config keys (kv_connector_extra_config; p2p_settings.py has them all with their defaults):
`kv_host` (address advertised), `kv_bind_host` (address listened on, default kv_host),
`read_timeout_s` (a whole read, default 60 s), `connect_timeout_s` (connect, handshake and the pair's
rendezvous, default 10 s), `kv_handshake_timeout_s` (producer: a connection's TLS and secret
handshake, and any one frame, default 5 s), `kv_idle_timeout_s` (producer: drop a silent consumer,
default 600 s), `kv_max_connections` (producer: authenticated consumers, and handshakes in flight,
default 64), `kv_nccl_timeout_s` (NCCL pair groups' watchdog timeout, default 600 s),
`kv_reconnect_backoff_s` (consumer: how long an unreachable producer is not retried, default 5 s),
`kv_tls_certfile` / `kv_tls_keyfile` / `kv_tls_cafile` (TLS on the control connections).

Why control travels on a socket rather than as tensors on the group: a gloo receive can neither be
cancelled nor time out without breaking the pair, so an idle producer thread blocked in one could
not be stopped by `close()`; a socket is shut down and the thread wakes.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch

from pagedserve.kv_transfer.config import KVTransferConfig
from pagedserve.kv_transfer.connectors import p2p_channel, p2p_group, p2p_protocol
from pagedserve.kv_transfer.connectors.p2p_io import IOWorkers, done_future
from pagedserve.kv_transfer.connectors.p2p_server import P2PServer
from pagedserve.kv_transfer.connectors.p2p_settings import FIELD_PREFIX, parse_settings
from pagedserve.kv_transfer.kv_source import KVSource, ReadSpec
from pagedserve.kv_transfer.layout import KVLayout
from pagedserve.kv_transfer.transport import KVTransport, LayerReader

logger = logging.getLogger(__name__)

_IO_THREADS = 4
# Producers remembered as unreachable at most (expired entries go first).
_MAX_UNREACHABLE = 4096


class _Pair:
    """This consumer rank's authenticated connection and process group to one producer rank."""

    def __init__(self, address: dict[str, Any], channel: p2p_channel.Channel, link: p2p_group.PairGroup) -> None:
        self.address = address
        self.channel = channel
        self.link = link
        self.lock = threading.Lock()
        self.broken: str | None = None
        # Readers with receives not yet waited for: a receive whose Work and buffer were dropped early could
        # let the next message land in the wrong place. (Gloo marks a receive complete only in wait(), even
        # though its data arrives in the background, so completion is tracked here.)
        self.live: set[P2PLayerReader] = set()

    @property
    def group(self) -> Any:
        return self.link.group

    @property
    def wire(self) -> torch.device:
        return self.link.wire

    def usable(self) -> bool:
        """Not broken, and (unless another thread uses it right now) the producer has not closed it, e.g.
        after kv_idle_timeout_s."""
        if self.broken is None and self.lock.acquire(blocking=False):
            try:
                if self.channel.peer_closed():
                    self.mark_broken("the producer closed the connection")
            finally:
                self.lock.release()
        return self.broken is None

    def mark_broken(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
            self.channel.close()


class P2PLayerReader(LayerReader):
    """One read: its receives are posted on an I/O thread; `wait_layer` waits for one layer's status, K and V."""

    def __init__(self, spec: ReadSpec, deadline: float, producer: str) -> None:
        self.spec = spec
        self.deadline = deadline
        self.producer = producer
        self.pair: _Pair | None = None
        self.posted: list[tuple[list[Any], list[torch.Tensor]]] = []  # per layer: (works, [status, k, v])
        self.started = threading.Event()  # set once the receives are posted, or the start failed
        self.error: str | None = None
        self.cancelled = False
        self.state = threading.Lock()  # orders a start against a cancel (close, a timed-out wait)
        self._next = 0

    def _begin(self, pair: _Pair, posted: list[tuple[list[Any], list[torch.Tensor]]]) -> None:
        """With `state` held."""
        self.pair, self.posted = pair, posted
        pair.live.add(self)
        self.started.set()

    def _fail(self, reason: str) -> None:
        with self.state:
            if not self.started.is_set():
                self.error = reason
                self.started.set()

    def _await_start(self) -> None:
        if not self.started.wait(max(0.0, self.deadline - time.monotonic())):
            with self.state:
                if not self.started.is_set():
                    self.cancelled = True
                    raise TimeoutError(f"torch_p2p: read of request {self.spec.remote_request_id} from {self.producer} "
                                       "did not start within read_timeout_s (still connecting)")
        if self.error is not None:
            raise ConnectionError(self.error)

    def wait_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._await_start()
        assert self.pair is not None
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
        assert self.pair is not None
        for work in self.posted[index][0]:
            remaining = self.deadline - time.monotonic()
            if self.pair.broken is not None:
                raise ConnectionError(f"torch_p2p: connection to the producer lost ({self.pair.broken})")
            try:
                if remaining <= 0 or not work.wait(timedelta(seconds=remaining)):
                    raise TimeoutError("read timed out")
            except Exception as exc:  # noqa: BLE001 - gloo/NCCL raise RuntimeError on a lost peer or a timeout
                timed_out = isinstance(exc, TimeoutError) or "timed out" in str(exc).lower()
                reason = "read_timeout_s expired" if timed_out else f"{exc.__class__.__name__}: {exc}"
                self.pair.mark_broken(reason)
                raise (TimeoutError if timed_out else ConnectionError)(
                    f"torch_p2p: layer {self.spec.layers[index]} of request {self.spec.remote_request_id}: "
                    f"{reason}") from None

    def close(self) -> None:
        """Receive the rest of the read (after a producer error: placeholders, already on their way), so
        the pair's stream stays aligned for the next read; a pair that fails here is dropped. A read that
        has not started yet never will."""
        with self.state:
            self.cancelled = True
            started = self.started.is_set() and self.error is None
        if not started:
            return
        try:
            for index in range(self._next, len(self.posted)):
                self._wait(index)
        except (ConnectionError, TimeoutError):
            pass
        self._next = len(self.posted)
        assert self.pair is not None
        self.pair.live.discard(self)


class TorchP2PTransport(KVTransport):
    def __init__(self, config: KVTransferConfig, layout: KVLayout, rank: int, device: torch.device) -> None:
        super().__init__(config, layout, rank, device)
        self.settings = parse_settings(config.extra)
        self.host = self.settings.kv_host or p2p_group.default_host()
        self.bind_host = self.settings.kv_bind_host or self.host
        self.read_timeout_s = self.settings.read_timeout_s
        self.connect_timeout_s = self.settings.connect_timeout_s
        self._secret = config.secret()
        self._client_tls = p2p_channel.client_tls_context(self.settings) if config.is_consumer else None
        self._server_tls = p2p_channel.server_tls_context(self.settings) if config.is_producer else None
        self.server: P2PServer | None = None
        self._io = IOWorkers(f"torch-p2p-io-{rank}", _IO_THREADS)
        self._pairs: dict[tuple[str, int], _Pair] = {}
        self._connecting: dict[tuple[str, int], Future] = {}
        self._unreachable: dict[tuple[str, int], tuple[float, str]] = {}  # until (monotonic), why
        self._lock = threading.Lock()
        self._closed = False
        self.connect_attempts = 0

    # ------------------------------------------------------------------ producer

    def serve(self, source: KVSource) -> Any:
        if self.server is None:
            key = "kv_bind_host" if self.settings.kv_bind_host else "kv_host"
            try:
                self.server = P2PServer(source, self.settings, self.bind_host, self.device, self._secret,
                                        self._server_tls)
            except OSError as exc:
                raise ValueError(f"{FIELD_PREFIX}.{key}: cannot listen on {self.bind_host!r}: {exc}") from None
        return {"host": self.host, "port": self.server.port, "rank": self.rank, "engine_id": self.config.engine_id,
                "device": self.device.type}

    # ------------------------------------------------------------------ consumer

    @staticmethod
    def _key(address: Any) -> tuple[str, int]:
        try:
            host, port = address["host"], int(address["port"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"torch_p2p: not a torch_p2p address: {address!r:.200}") from None
        if not isinstance(host, str) or not 0 < port < 65536:
            raise ValueError(f"torch_p2p: not a torch_p2p address: {address!r:.200}")
        return host, port

    def _connection(self, address: Any) -> Future:
        """The pair to `address`: done at once when connected; else the connect in flight (one per producer);
        ConnectionError at once while the producer is in its reconnect backoff."""
        key = self._key(address)
        with self._lock:
            if self._closed:
                raise ConnectionError("torch_p2p: transport closed")
            pair = self._pairs.get(key)
            if pair is not None:
                if pair.usable():
                    return done_future(pair)
                del self._pairs[key]
            pending = self._connecting.get(key)
            if pending is not None:
                return pending
            failed = self._unreachable.get(key)
            now = time.monotonic()
            if failed is not None:
                if failed[0] > now:
                    raise ConnectionError(f"torch_p2p: producer {key[0]}:{key[1]} is unreachable ({failed[1]}); "
                                          f"not trying again for {failed[0] - now:.1f} s")
                del self._unreachable[key]
            future = self._io.submit(self._connect, key, dict(address))
            self._connecting[key] = future
            return future

    def _connect(self, key: tuple[str, int], address: dict[str, Any]) -> _Pair:
        """On an I/O thread: a new pair, or ConnectionError (and the producer backs off)."""
        with self._lock:
            self.connect_attempts += 1
        try:
            pair = self._open_pair(key, address)
        except Exception as exc:  # noqa: BLE001 - whatever failed, the producer is unreachable for now
            reason = f"{exc.__class__.__name__}: {exc}"
            backoff = self.settings.kv_reconnect_backoff_s
            with self._lock:
                self._connecting.pop(key, None)
                if backoff > 0:
                    now = time.monotonic()
                    if len(self._unreachable) >= _MAX_UNREACHABLE:
                        self._unreachable = {k: v for k, v in self._unreachable.items() if v[0] > now}
                    if len(self._unreachable) < _MAX_UNREACHABLE:
                        self._unreachable[key] = (now + backoff, reason)
            logger.warning("torch_p2p: rank %d cannot connect to producer %s:%d: %s (not tried again for %.1f s; "
                           "its reads compute their prompts)", self.rank, key[0], key[1], reason, backoff)
            raise ConnectionError(f"torch_p2p: cannot connect to producer {key[0]}:{key[1]}: {reason}") from None
        with self._lock:
            self._connecting.pop(key, None)
            if self._closed:
                pair.mark_broken("transport closed")
                raise ConnectionError("torch_p2p: transport closed")
            self._pairs[key] = pair
        return pair

    def _open_pair(self, key: tuple[str, int], address: dict[str, Any]) -> _Pair:
        deadline = time.monotonic() + self.connect_timeout_s
        sock = socket.create_connection(key, timeout=self.connect_timeout_s)
        try:
            p2p_channel.tune(sock)
            if self._client_tls is not None:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                sock = self._client_tls.wrap_socket(sock, server_hostname=key[0])
            channel = p2p_channel.client_handshake(sock, self._secret, deadline)
            channel.send({"op": "hello", "device": self.device.type}, timeout_s=max(0.001, deadline - time.monotonic()))
            backend = p2p_group.pick_backend(str(address.get("device", "cpu")), self.device.type)
            link = p2p_group.join_pair(channel, p2p_group.CONSUMER_RANK, backend, self.device,
                                       max(0.001, deadline - time.monotonic()), self.connect_timeout_s,
                                       self.settings.kv_nccl_timeout_s)
        except BaseException:
            p2p_channel.close_quietly(sock)
            raise
        return _Pair(address, channel, link)

    def _then(self, connection: Future, task: Callable[[Future], None], on_error: Callable[[str], None]) -> None:
        """Run `task(connection)` on an I/O thread once the connection is settled."""

        def schedule(done: Future) -> None:
            try:
                self._io.submit(task, done)
            except Exception as exc:  # noqa: BLE001 - closed meanwhile
                on_error(f"{exc.__class__.__name__}: {exc}")

        connection.add_done_callback(schedule)

    def read(self, address: Any, spec: ReadSpec) -> LayerReader:
        p2p_protocol.check_spec_shape(spec)
        key = self._key(address)
        reader = P2PLayerReader(spec, time.monotonic() + self.read_timeout_s, f"{key[0]}:{key[1]}")
        connection = self._connection(address)
        self._then(connection, lambda done: self._start_read(done, reader), reader._fail)
        return reader

    def _start_read(self, connection: Future, reader: P2PLayerReader) -> None:
        """On an I/O thread: send the read and post every receive, atomically on the pair."""
        try:
            pair: _Pair = connection.result()
        except Exception as exc:  # noqa: BLE001
            reader._fail(str(exc) if isinstance(exc, ConnectionError) else f"{exc.__class__.__name__}: {exc}")
            return
        spec = reader.spec
        shape = p2p_protocol.layer_shape(spec, self.layout.head_size)
        dtype = p2p_protocol.torch_dtype(self.layout.dtype)
        with pair.lock, reader.state:
            if reader.cancelled or reader.started.is_set():
                return
            try:
                if pair.broken is not None:
                    raise ConnectionError(pair.broken)
                pair.channel.send({"op": "read", "spec": p2p_protocol.spec_to_json(spec)},
                                  timeout_s=self.connect_timeout_s)
                posted = []
                for _ in spec.layers:
                    tensors = [torch.empty(p2p_protocol.STATUS_BYTES, dtype=torch.uint8, device=pair.wire),
                               torch.empty(shape, dtype=dtype, device=pair.wire),
                               torch.empty(shape, dtype=dtype, device=pair.wire)]
                    posted.append(([pair.group.recv([t], p2p_group.PRODUCER_RANK, 0) for t in tensors], tensors))
            except Exception as exc:  # noqa: BLE001
                pair.mark_broken(f"{exc.__class__.__name__}: {exc}")
                reader.error = f"torch_p2p: could not start a read from {reader.producer}: {exc}"
                reader.started.set()
                return
            reader._begin(pair, posted)

    def release(self, address: Any, remote_request_id: str, hold_token: str) -> None:
        """Queue the release for an I/O thread; ConnectionError at once while the producer backs off."""
        connection = self._connection(address)

        def lost(reason: str) -> None:
            logger.warning("torch_p2p: could not release hold %r at its producer: %s", remote_request_id, reason)

        self._then(connection, lambda done: self._send_release(done, remote_request_id, hold_token, lost), lost)

    def _send_release(self, connection: Future, remote_request_id: str, hold_token: str, lost: Callable[[str], None]) -> None:
        try:
            pair: _Pair = connection.result()
        except Exception as exc:  # noqa: BLE001 - the producer's hold timeout frees the blocks anyway
            lost(f"{exc.__class__.__name__}: {exc}")
            return
        with pair.lock:
            if pair.broken is not None:
                lost(pair.broken)
                return
            try:
                pair.channel.send({"op": "release", "id": remote_request_id, "token": hold_token}, timeout_s=self.connect_timeout_s)
            except (OSError, ValueError) as exc:
                pair.mark_broken(f"{exc.__class__.__name__}: {exc}")
                lost(f"{exc.__class__.__name__}: {exc}")

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pairs = list(self._pairs.values())
            self._pairs.clear()
        self._io.close()
        for pair in pairs:
            if pair.broken is None and pair.lock.acquire(timeout=1.0):
                try:
                    pair.channel.send({"op": "bye"}, timeout_s=1.0)
                except (OSError, ValueError):
                    pass
                finally:
                    pair.lock.release()
            pair.mark_broken("closed")
        if self.server is not None:
            self.server.close()
