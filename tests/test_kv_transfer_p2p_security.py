"""torch_p2p from an attacker's side (kv_transfer/connectors/: p2p_channel, p2p_server, p2p_group, torch_p2p).

Strangers - a plain socket, a client speaking the real frames without the secret, a consumer with a
wrong secret, a rogue producer - get nothing, and the producer opens no port but its control port; a
thousand idle or garbage connections leave the producer serving with a bounded thread count; fuzzed
handshakes and frames (hypothesis) never escape the server loop nor allocate what a length prefix
claims; a thread that cannot start leaves the accept loop serving; releases and connects to an
unreachable producer never block their caller and are not retried within the backoff; NCCL pair
groups get their own timeout and error handling that spares the process; TLS on the control
connection. Everything listens on 127.0.0.1 and is closed by its test.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import ssl
import threading
import time
import tracemalloc

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pagedserve.kv_transfer import auth
from pagedserve.kv_transfer.config import KVTransferConfig
from pagedserve.kv_transfer.connectors import p2p_channel, p2p_group, p2p_protocol, p2p_server
from pagedserve.kv_transfer.connectors.p2p_settings import parse_settings
from pagedserve.kv_transfer.connectors.torch_p2p import TorchP2PTransport
from pagedserve.kv_transfer.holds import HoldGrant, hash_token
from pagedserve.kv_transfer.kv_source import KVSource, ReadSpec
from pagedserve.kv_transfer.layout import KVLayout

HOST = "127.0.0.1"
SECRET = "the-deployments-kv-secret-0123456789"
OTHER_SECRET = "an-attackers-guess-at-the-secret-xyz"
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_size=4, dtype="float32", block_size=4)
HOLD_TOKEN = "the-holds-token"
# A read of the hold every _SpySource grants: blocks (0, 1), 8 tokens.
SPEC = ReadSpec("req", HOLD_TOKEN, 0, 8, (0, 1, 2), 0, 2)


def _config(role: str, secret: str = SECRET, **extra) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="torch_p2p", kv_role=role, kv_secret=secret,
                            kv_connector_extra_config={"kv_host": HOST, "read_timeout_s": 20, **extra})


class _SpySource(KVSource):
    """A producer's KV that counts what it hands out."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        shape = (8, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_size)
        super().__init__(LAYOUT, 0, [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
                                     for _ in range(LAYOUT.num_layers)])
        self.layers_read = 0
        self.register([HoldGrant("req", hash_token(HOLD_TOKEN), (0, 1), 8, time.time() + 3600)])
        self.released: list[str] = []
        self.release_sink = lambda holds: self.released.extend(hold_id for hold_id, _ in holds)

    def read_layer(self, spec, layer, slots=None):
        self.layers_read += 1
        return super().read_layer(spec, layer, slots)


@pytest.fixture
def transports():
    made: list[TorchP2PTransport] = []

    def make(role: str, secret: str = SECRET, **extra) -> TorchP2PTransport:
        t = TorchP2PTransport(_config(role, secret, **extra), LAYOUT, 0, torch.device("cpu"))
        made.append(t)
        return t

    yield make
    for t in reversed(made):
        t.close()


@pytest.fixture
def thread_errors():
    """Exceptions that escape any thread while the test runs (there must be none)."""
    caught: list[threading.ExceptHookArgs] = []
    previous = threading.excepthook
    threading.excepthook = caught.append
    yield caught
    threading.excepthook = previous


def _good_read(consumer: TorchP2PTransport, address: dict, source: KVSource) -> None:
    reader = consumer.read(address, SPEC)
    got = [reader.wait_layer(layer) for layer in SPEC.layers]
    for (k, v), layer in zip(got, SPEC.layers):
        ek, ev = KVSource.read_layer(source, SPEC, layer)
        assert torch.equal(k, ek) and torch.equal(v, ev)


def _recv_all(sock: socket.socket, timeout_s: float = 30.0) -> bytes:
    """Everything the peer sends until it closes (bounded)."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _wait_for(predicate, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _listening_ports() -> set[int]:
    """TCP ports this process listens on (from /proc: its socket inodes in LISTEN state)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


# ---------------------------------------------------------------------- strangers get nothing


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="reads this process's sockets from /proc")
def test_a_producer_opens_one_port_and_strangers_on_it_get_nothing(transports):
    source = _SpySource()
    producer = transports("kv_producer", kv_handshake_timeout_s=1)
    before = _listening_ports()
    address = producer.serve(source)
    # The only listener is the control port: there is no store port to reach at all.
    assert _listening_ports() - before == {address["port"]}
    assert set(address) == {"host", "port", "rank", "engine_id", "device"}
    port = address["port"]

    idle = socket.create_connection((HOST, port), timeout=10)  # says nothing: dropped at the deadline
    assert _recv_all(idle) == b""
    http = socket.create_connection((HOST, port), timeout=10)
    http.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _recv_all(http) == b""
    # The real frames, but no handshake: not a single one is read.
    frames = socket.create_connection((HOST, port), timeout=10)
    wire = b""
    for message in ({"op": "hello", "device": "cpu"}, {"op": "read", "spec": p2p_protocol.spec_to_json(SPEC)},
                    {"op": "release", "id": "req"}):
        body = json.dumps(message).encode()
        wire += len(body).to_bytes(4, "big") + body
    try:
        frames.sendall(wire)
    except OSError:
        pass  # closed on us halfway: fine
    assert _recv_all(frames) == b""
    # The handshake without the secret: one random challenge back, and then the door closes.
    guesser = socket.create_connection((HOST, port), timeout=10)
    guesser.sendall(p2p_channel.MAGIC + auth.new_challenge())
    challenge = guesser.recv(auth.CHALLENGE_BYTES)
    guesser.sendall(os.urandom(auth.DIGEST_BYTES))
    assert len(challenge) == auth.CHALLENGE_BYTES and _recv_all(guesser) == b""
    # A consumer with the wrong secret: refused before any frame is read.
    with pytest.raises(p2p_channel.AuthenticationError, match="refused"):
        with socket.create_connection((HOST, port), timeout=10) as sock:
            p2p_channel.client_handshake(sock, OTHER_SECRET.encode(), time.monotonic() + 10)
    wrong = transports("kv_consumer", OTHER_SECRET)
    reader = wrong.read(address, SPEC)
    with pytest.raises(ConnectionError, match="refused this consumer"):
        reader.wait_layer(0)
    for sock in (idle, http, frames, guesser):
        sock.close()
    assert source.layers_read == 0 and source.released == [] and producer.server.reads_served == 0
    assert _wait_for(lambda: producer.server.refused >= 6)  # (counted by the server thread after the close)
    # ... while the deployment's own consumers are served.
    _good_read(transports("kv_consumer"), address, source)
    assert _wait_for(lambda: producer.server.reads_served == 1)  # counted once its last send completed


def test_a_consumer_never_talks_to_a_producer_without_the_secret():
    """A rogue producer (a listener that does not hold the secret) gets no request frame."""
    listener = p2p_group.listening_socket(HOST)
    received: list[bytes] = []

    def rogue() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            conn.recv(len(p2p_channel.MAGIC) + auth.CHALLENGE_BYTES)
            conn.sendall(auth.new_challenge())
            conn.recv(auth.DIGEST_BYTES)
            conn.sendall(os.urandom(auth.DIGEST_BYTES))  # a made-up proof
            received.append(_recv_all(conn, 10))

    thread = threading.Thread(target=rogue, daemon=True)
    thread.start()
    try:
        with socket.create_connection(listener.getsockname(), timeout=10) as sock:
            with pytest.raises(p2p_channel.AuthenticationError, match="did not prove"):
                p2p_channel.client_handshake(sock, SECRET.encode(), time.monotonic() + 10)
        thread.join(30)
        assert received == [b""]
    finally:
        listener.close()


def test_a_thousand_idle_or_garbage_connections_leave_the_producer_serving(transports, thread_errors):
    source = _SpySource()
    cap = 8
    producer = transports("kv_producer", kv_max_connections=cap, kv_handshake_timeout_s=2)
    address = producer.serve(source)
    baseline = threading.active_count()
    held: list[socket.socket] = []
    most = 0
    for i in range(1000):
        try:
            sock = socket.create_connection((HOST, address["port"]), timeout=10)
        except OSError:
            continue  # the kernel's accept queue was full for a moment: a refused stranger is fine
        kind = i % 4
        try:
            if kind == 1:
                sock.sendall(os.urandom(1 + i % 97))
            elif kind == 2:
                sock.sendall(p2p_channel.MAGIC + os.urandom(i % 40))  # a handshake begun and abandoned
        except OSError:
            pass
        if kind == 3 and len(held) < 100:
            held.append(sock)  # left open, idle
        else:
            sock.close()
        most = max(most, threading.active_count())
    # Threads: handshakes in flight (kv_max_connections), authenticated peers (as many), and some slack for
    # handshakes just pushed out and still unwinding; never one per connection.
    assert most <= baseline + 3 * cap + 4, (most, baseline)
    # With strangers' sockets still open, a real consumer connects at once and is served.
    _good_read(transports("kv_consumer"), address, source)
    for sock in held:
        sock.close()
    assert producer.server.refused > 0 and producer.server._thread.is_alive()
    assert _wait_for(lambda: producer.server.connections <= 1)  # the strangers' threads are gone
    assert thread_errors == []


# ---------------------------------------------------------------------- fuzzing


def _handshake_raw(port: int) -> tuple[socket.socket, p2p_channel.Channel]:
    sock = socket.create_connection((HOST, port), timeout=10)
    return sock, p2p_channel.client_handshake(sock, SECRET.encode(), time.monotonic() + 10)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**16, 2**16) | st.floats(allow_nan=False)
                    | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
OPS = st.sampled_from(["hello", "read", "release", "bye", "store_set", "rendezvous_done", "nonsense"])
SPEC_FIELDS = ["remote_request_id", "hold_token", "token_start", "token_end", "layers", "head_start", "head_end",
               "block_ids"]


@st.composite
def frames(draw):
    """Control messages with known ops and fields of any JSON type (or well-typed ones, now and then)."""
    op = draw(OPS)
    message = {"op": op}
    if op == "read":
        spec = p2p_protocol.spec_to_json(SPEC)
        for name in draw(st.lists(st.sampled_from(SPEC_FIELDS), max_size=3)):
            spec[name] = draw(JSON)
        message["spec"] = draw(st.just(spec) | JSON)
    elif op == "release":
        message["id"] = draw(st.text(max_size=30) | JSON)
    elif op == "hello":
        message["device"] = draw(st.sampled_from(["cpu", "cuda"]) | JSON)
    elif op == "store_set":
        message.update(key=draw(st.text(max_size=10) | JSON), value=draw(st.text(max_size=40) | JSON))
    message.update(draw(st.dictionaries(st.text(max_size=8), JSON, max_size=2)))
    return message


ATTACKS = st.one_of(
    st.tuples(st.just("raw"), st.binary(max_size=200)),  # before any handshake
    st.tuples(st.just("magic"), st.binary(max_size=120)),  # the magic, then junk
    st.tuples(st.just("frames"), st.lists(frames(), max_size=4)),  # authenticated, instead of a hello
    st.tuples(st.just("junk"), st.binary(max_size=200)),  # authenticated, then bytes without a tag
    st.tuples(st.just("length"), st.integers(p2p_protocol.MAX_FRAME + 1, 2**32 - 1)),  # authenticated, huge prefix
    st.tuples(st.just("rendezvous"), st.lists(frames(), max_size=4)),  # hello, then fuzz in the rendezvous
    st.tuples(st.just("serving"), st.lists(frames(), max_size=4)),  # a working pair, then fuzzed requests
)


@pytest.fixture(scope="module")
def fuzz_target():
    source = _SpySource()
    producer = TorchP2PTransport(_config("kv_producer", kv_handshake_timeout_s=2, connect_timeout_s=5,
                                         read_timeout_s=2), LAYOUT, 0, torch.device("cpu"))
    address = producer.serve(source)
    yield producer, address, source
    producer.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(attack=ATTACKS)
@example(attack=("serving", [{"op": "release", "id": "fuzz-release", "token": "t"}, {"op": "read", "spec": p2p_protocol.spec_to_json(SPEC)},
                             {"op": "read", "spec": {"layers": "all"}}]))
def test_fuzzed_handshakes_and_frames_never_escape_the_server_loop(fuzz_target, thread_errors, attack):
    producer, address, _ = fuzz_target
    kind, payload = attack
    port = address["port"]
    sock = socket.create_connection((HOST, port), timeout=10)
    try:
        if kind == "raw":
            sock.sendall(payload)
        elif kind == "magic":
            sock.sendall(p2p_channel.MAGIC + payload)
        else:
            sock.close()
            sock, channel = _handshake_raw(port)
            if kind == "frames":
                for message in payload:
                    channel.send(message)
            elif kind == "junk":
                sock.sendall(payload)
            elif kind == "length":
                sock.sendall(payload.to_bytes(4, "big") + b"\0" * 64)
            else:
                channel.send({"op": "hello", "device": "cpu"})
                if kind == "serving":
                    p2p_group.join_pair(channel, p2p_group.CONSUMER_RANK, "gloo", torch.device("cpu"), 10, 10, 10)
                for message in payload:
                    channel.send(message)
        sock.shutdown(socket.SHUT_WR)
        _recv_all(sock)  # the producer ends the connection (a bad frame, or our end of it)
    except OSError:
        pass  # the producer may close while we still send: that is the point
    finally:
        sock.close()
    assert producer.server._thread.is_alive()
    assert thread_errors == []


def test_after_the_fuzzing_the_producer_still_serves(fuzz_target, transports):
    producer, address, source = fuzz_target
    assert _wait_for(lambda: producer.server.connections == 0)  # every fuzzed connection's thread ended
    # The fuzzing got past the handshake and the rendezvous into the requests (the explicit example does).
    assert "fuzz-release" in source.released and source.layers_read > 0
    _good_read(transports("kv_consumer"), address, source)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300))
def test_fuzzed_bytes_at_the_handshake_and_frame_readers_raise_only_protocol_errors(data):
    """The two readers a stranger (handshake) or a peer (frames) feeds, directly, many times."""
    for reader in ("handshake", "frame"):
        a, b = socket.socketpair()
        with a, b:
            a.sendall(data)
            a.shutdown(socket.SHUT_WR)
            try:
                if reader == "handshake":
                    p2p_channel.server_handshake(b, SECRET.encode(), time.monotonic() + 5)
                else:
                    p2p_channel.Channel(b, b"k" * 32, p2p_channel.PRODUCER).recv(5, 5)
            except (p2p_channel.AuthenticationError, p2p_protocol.ProtocolError, TimeoutError, BrokenPipeError):
                pass


def test_huge_length_prefixes_are_refused_before_anything_is_allocated(transports, thread_errors):
    source = _SpySource()
    producer = transports("kv_producer")
    address = producer.serve(source)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        for claimed in (p2p_protocol.MAX_FRAME + 1, 2**31, 2**32 - 1):
            sock, _ = _handshake_raw(address["port"])
            with sock:
                sock.sendall(claimed.to_bytes(4, "big") + b"x" * 1000)
                assert _recv_all(sock) == b""  # dropped
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, peak  # far below what any of those prefixes claimed
    _good_read(transports("kv_consumer"), address, source)
    assert thread_errors == []


# ---------------------------------------------------------------------- producer robustness


def test_a_thread_that_cannot_start_leaves_the_accept_loop_serving(transports, monkeypatch, thread_errors):
    source = _SpySource()
    producer = transports("kv_producer")
    address = producer.serve(source)
    real_start = threading.Thread.start
    failed: list[str] = []

    def start(self):
        if self.name.startswith("torch-p2p-peer-") and not failed:
            failed.append(self.name)
            raise RuntimeError("can't start new thread")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    first = transports("kv_consumer")
    reader = first.read(address, SPEC)
    with pytest.raises(ConnectionError):  # its connection was the one without a thread: closed
        reader.wait_layer(0)
    assert failed and producer.server._thread.is_alive()
    _good_read(transports("kv_consumer"), address, source)  # the next connection is served
    server = producer.server
    producer.close()  # clean, with a peer whose thread never started among the ones it knew
    assert not server._thread.is_alive() and thread_errors == []


def test_close_never_raises_on_threads_that_never_started(transports):
    producer = transports("kv_producer")
    producer.serve(_SpySource())
    server = producer.server
    a, b = socket.socketpair()
    with a, b:
        server._pending.append(p2p_server._Peer(server, b, "never-started"))  # as if its start had failed late
        server.close()
        server.close()  # and again
        assert a.recv(1) == b""  # its connection was shut down all the same
    assert not server._thread.is_alive()


# ---------------------------------------------------------------------- consumer: off the step thread


class _GatedConnect:
    """socket.create_connection that blocks until opened, then refuses; counts its calls per port."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.calls: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, address, *args, **kwargs):
        with self.lock:
            self.calls.append(address[1])
        self.gate.wait(60)
        raise ConnectionRefusedError(f"nothing listens on {address}")

    def count(self, port: int) -> int:
        with self.lock:
            return self.calls.count(port)


def test_releases_and_reads_to_an_unreachable_producer_never_block_the_caller(transports, monkeypatch):
    connect = _GatedConnect()
    monkeypatch.setattr(socket, "create_connection", connect)
    consumer = transports("kv_consumer", kv_reconnect_backoff_s=600)
    address = {"host": HOST, "port": 9, "rank": 0, "engine_id": "e", "device": "cpu"}
    # The connect hangs (a black hole): release and read return anyway, without waiting for it.
    consumer.release(address, "r1", HOLD_TOKEN)
    reader = consumer.read(address, SPEC)
    consumer.release(address, "r2", HOLD_TOKEN)
    second = consumer.read(address, SPEC)
    assert not connect.gate.is_set() and not reader.started.is_set()
    assert _wait_for(lambda: connect.count(9) == 1)
    assert connect.count(9) == 1  # one connect in flight per producer, however many callers
    connect.gate.set()  # now it fails
    for r in (reader, second):
        with pytest.raises(ConnectionError, match="cannot connect"):
            r.wait_layer(0)
        r.close()
    # Within the backoff: failures at once, no new attempt.
    with pytest.raises(ConnectionError, match="unreachable"):
        consumer.read(address, SPEC)
    with pytest.raises(ConnectionError, match="unreachable"):
        consumer.release(address, "r3", HOLD_TOKEN)
    assert connect.count(9) == 1
    # Another producer is its own business.
    other = dict(address, port=10)
    with pytest.raises(ConnectionError):
        consumer.read(other, SPEC).wait_layer(0)
    assert connect.count(10) == 1 and connect.count(9) == 1


def test_an_unreachable_producer_is_tried_again_after_its_backoff(transports, monkeypatch):
    connect = _GatedConnect()
    connect.gate.set()
    monkeypatch.setattr(socket, "create_connection", connect)
    consumer = transports("kv_consumer", kv_reconnect_backoff_s=0.2)
    address = {"host": HOST, "port": 9, "rank": 0, "engine_id": "e", "device": "cpu"}
    with pytest.raises(ConnectionError):
        consumer.read(address, SPEC).wait_layer(0)
    time.sleep(0.3)  # the backoff runs out
    with pytest.raises(ConnectionError, match="cannot connect"):
        consumer.read(address, SPEC).wait_layer(0)
    assert connect.count(9) == 2


def test_a_pair_the_producer_dropped_while_idle_is_replaced_without_a_failed_read(transports):
    source = _SpySource()
    producer = transports("kv_producer", kv_idle_timeout_s=0.5)
    address = producer.serve(source)
    consumer = transports("kv_consumer")
    _good_read(consumer, address, source)
    (pair,) = consumer._pairs.values()
    assert _wait_for(lambda: producer.server.connections == 0)  # dropped for idleness
    _good_read(consumer, address, source)  # noticed before use: a new pair, not a failed read
    assert pair.broken is not None and consumer.connect_attempts == 2


# ---------------------------------------------------------------------- NCCL pair groups


class _FakeNCCLGroup:
    made: list[_FakeNCCLGroup] = []

    class Options:
        def __init__(self) -> None:
            self._timeout = None

    def __init__(self, store, rank, size, opts) -> None:
        self.store, self.rank, self.size, self.opts = store, rank, size, opts
        self.env = {name: os.environ.get(name) for name in p2p_group.NCCL_PAIR_ENV}
        _FakeNCCLGroup.made.append(self)


def test_nccl_pair_groups_get_their_own_timeout_and_spare_the_process(monkeypatch):
    monkeypatch.setattr(p2p_group.dist, "ProcessGroupNCCL", _FakeNCCLGroup, raising=False)
    monkeypatch.setattr(p2p_group.dist, "is_nccl_available", lambda: True)
    devices = []
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # the user's own setting, for their groups
    monkeypatch.delenv("TORCH_NCCL_ENABLE_MONITORING", raising=False)
    store = object()
    group = p2p_group.build_pair_group(store, p2p_group.CONSUMER_RANK, "nccl", HOST, torch.device("cuda", 1),
                                       connect_timeout_s=7, nccl_timeout_s=321)
    assert isinstance(group, _FakeNCCLGroup) and (group.store, group.rank, group.size) == (store, 1, 2)
    assert group.opts._timeout == datetime.timedelta(seconds=321)  # not the connect timeout
    # At construction (when ProcessGroupNCCL reads them): abort the pair's communicator on an error or a
    # watchdog timeout instead of the process, and no heartbeat monitor to kill it either.
    assert group.env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"}
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"  # restored afterwards
    assert "TORCH_NCCL_ENABLE_MONITORING" not in os.environ
    assert devices == [torch.device("cuda", 1)]


def test_the_transport_hands_its_nccl_timeout_to_pairs_between_cuda_ranks(transports, monkeypatch):
    joined = []

    def join_pair(channel, rank, backend, device, connect_timeout_s, frame_timeout_s, nccl_timeout_s):
        joined.append((rank, backend, nccl_timeout_s))
        raise RuntimeError("stop here")

    monkeypatch.setattr(p2p_group, "join_pair", join_pair)
    producer = transports("kv_producer", kv_nccl_timeout_s=900)
    producer.device = torch.device("cuda")  # what the address and hello report; no CUDA work happens here
    address = producer.serve(_SpySource())
    consumer = TorchP2PTransport(_config("kv_consumer", kv_nccl_timeout_s=900), LAYOUT, 0, torch.device("cuda"))
    try:
        with pytest.raises(ConnectionError):
            consumer.read(address, SPEC).wait_layer(0)
        assert _wait_for(lambda: len(joined) == 2)
        assert sorted(joined) == [(0, "nccl", 900.0), (1, "nccl", 900.0)]
    finally:
        consumer.close()


# ---------------------------------------------------------------------- TLS


def _self_signed(tmp_path, name: str) -> tuple[str, str]:
    """A self-signed certificate (its own CA) and key for 127.0.0.1."""
    cert, key = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        import shutil
        import subprocess

        if shutil.which("openssl") is None:
            pytest.skip("neither cryptography nor the openssl CLI to make a test certificate")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-days", "1", "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(cert)],
                       check=True, capture_output=True)
        return str(cert), str(key)
    private = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                   .public_key(private.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(private.public_key()), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(private.public_key()),
                                  critical=False)
                   .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(HOST))]),
                                  critical=False)
                   .sign(private, hashes.SHA256()))
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return str(cert), str(key)


def test_tls_on_the_control_connection(transports, tmp_path):
    cert, key = _self_signed(tmp_path, "deployment")
    tls = {"kv_tls_certfile": cert, "kv_tls_keyfile": key, "kv_tls_cafile": cert}
    source = _SpySource()
    producer = transports("kv_producer", kv_handshake_timeout_s=2, **tls)
    address = producer.serve(source)
    consumer = transports("kv_consumer", **tls)
    _good_read(consumer, address, source)
    (pair,) = consumer._pairs.values()
    assert isinstance(pair.channel.sock, ssl.SSLSocket) and pair.channel.sock.cipher() is not None
    # A consumer that speaks plain TCP, or trusts another CA, gets nowhere (and nothing).
    plain = transports("kv_consumer")
    with pytest.raises(ConnectionError):
        plain.read(address, SPEC).wait_layer(0)
    other_cert, other_key = _self_signed(tmp_path, "stranger")
    stranger = transports("kv_consumer", kv_tls_certfile=other_cert, kv_tls_keyfile=other_key,
                          kv_tls_cafile=other_cert)
    with pytest.raises(ConnectionError, match="CERTIFICATE_VERIFY_FAILED|certificate"):
        stranger.read(address, SPEC).wait_layer(0)
    # Mutual TLS: a client without a certificate from the deployment's CA is refused by the producer.
    no_cert = transports("kv_consumer", kv_tls_cafile=cert)
    with pytest.raises(ConnectionError):
        no_cert.read(address, SPEC).wait_layer(0)
    # The server thread counts a refusal after the client has seen it fail: wait for the count.
    assert _wait_for(lambda: producer.server.refused >= 3) and _wait_for(lambda: producer.server.reads_served == 1)


def test_tls_settings_are_checked_naming_the_key(tmp_path):
    cert, key = _self_signed(tmp_path, "deployment")
    with pytest.raises(ValueError, match="kv_tls_keyfile: needs kv_tls_certfile"):
        parse_settings({"kv_tls_keyfile": key})
    with pytest.raises(ValueError, match="kv_tls_certfile: a producer serving TLS needs its certificate"):
        p2p_channel.server_tls_context(parse_settings({"kv_tls_cafile": cert}))
    with pytest.raises(ValueError, match="kv_tls_certfile: cannot load"):
        p2p_channel.server_tls_context(parse_settings({"kv_tls_certfile": str(tmp_path / "missing.pem")}))
    with pytest.raises(ValueError, match="kv_tls_cafile: cannot load"):
        p2p_channel.client_tls_context(parse_settings({"kv_tls_cafile": key}))  # a key is no CA
    server = p2p_channel.server_tls_context(parse_settings({"kv_tls_certfile": cert, "kv_tls_keyfile": key,
                                                            "kv_tls_cafile": cert}))
    assert server.verify_mode == ssl.CERT_REQUIRED and server.num_tickets == 0
    assert server.minimum_version >= ssl.TLSVersion.TLSv1_2
    client = p2p_channel.client_tls_context(parse_settings({"kv_tls_cafile": cert}))
    assert client.verify_mode == ssl.CERT_REQUIRED and not client.check_hostname
    assert p2p_channel.client_tls_context(parse_settings({})) is None
    with pytest.raises(ValueError, match="kv_max_connections: must be >= 1"):
        parse_settings({"kv_max_connections": 0})
    with pytest.raises(ValueError, match="kv_nccl_timeout_s: must be a number"):
        parse_settings({"kv_nccl_timeout_s": "long"})
