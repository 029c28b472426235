"""The torch_p2p KV transport's pieces (kv_transfer/connectors/: torch_p2p, p2p_protocol, p2p_server).

The wire pieces directly (control frames, read specs, status messages), then the transport with its
two ends in two threads of one process, or in a spawned process: layer data equal to the
producer's cache and arriving before anyone waits (overlap), interleaved reads on one pair, several
consumer ranks on one producer rank, producer errors and stalls as errors that leave the pair
usable, releases, misbehaving peers, close. Whole engines: tests/test_kv_transfer_p2p.py. Everything
listens on 127.0.0.1.
"""

from __future__ import annotations

import pickle
import socket
import threading
import time

import pytest
import torch

from pagedserve.kv_transfer.config import KVTransferConfig
from pagedserve.kv_transfer.connectors import p2p_channel, p2p_protocol
from pagedserve.kv_transfer.connectors.torch_p2p import TorchP2PTransport
from pagedserve.kv_transfer.holds import HoldGrant, hash_token, new_hold_token
from pagedserve.kv_transfer.kv_source import KVSource, ReadSpec
from pagedserve.kv_transfer.layout import KVLayout

HOST = "127.0.0.1"
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_size=4, dtype="float32", block_size=4)

# ---------------------------------------------------------------------- wire pieces


def _channels() -> tuple[p2p_channel.Channel, p2p_channel.Channel, socket.socket, socket.socket]:
    a, b = socket.socketpair()
    key = b"k" * 32
    return p2p_channel.Channel(a, key, p2p_channel.CONSUMER), p2p_channel.Channel(b, key, p2p_channel.PRODUCER), a, b


def _frame(body: bytes, tag: bytes = b"\0" * 32) -> bytes:
    return len(body).to_bytes(4, "big") + body + tag


def test_control_frames_round_trip_and_reject_garbage():
    consumer, producer, a, b = _channels()
    with a, b:
        messages = [{"op": "hello", "device": "cpu"}, {"op": "release", "id": "req-1"}]
        for m in messages:
            consumer.send(m)
        assert [producer.recv(5, 5) for _ in messages] == messages
        a.sendall(_frame(b'{"op":"read"}'))  # a frame without its session's tag
        with pytest.raises(p2p_channel.AuthenticationError, match="integrity"):
            producer.recv(5, 5)
    consumer, producer, a, b = _channels()
    with a, b:
        producer.send({"op": "x"})  # a producer's frame is no consumer's: the direction is in the tag
        with pytest.raises(p2p_channel.AuthenticationError):
            p2p_channel.Channel(a, b"k" * 32, p2p_channel.PRODUCER).recv(5, 5)
    consumer, producer, a, b = _channels()
    with a, b:
        a.sendall((p2p_protocol.MAX_FRAME + 1).to_bytes(4, "big"))  # refused before anything is read
        with pytest.raises(p2p_protocol.ProtocolError, match="exceeds"):
            producer.recv(5, 5)
    consumer, producer, a, b = _channels()
    with a, b:
        a.sendall(b"\x00\x00\x00\x10{")  # cut short
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(p2p_protocol.ProtocolError, match="inside"):
            producer.recv(5, 5)
    consumer, producer, a, b = _channels()
    with a, b:
        a.sendall(b"\x00")  # a frame begun and never finished
        with pytest.raises(TimeoutError):
            producer.recv(5, 0.2)
    consumer, producer, a, b = _channels()
    with a, b:
        a.close()
        assert producer.recv(5, 5) is None  # a clean close between frames
    with pytest.raises(p2p_protocol.ProtocolError, match="not JSON"):
        p2p_protocol.decode_body(b"abc")
    with pytest.raises(p2p_protocol.ProtocolError, match="without an op"):
        p2p_protocol.decode_body(b'{"no_op": 1}')
    with pytest.raises(p2p_protocol.ProtocolError):
        p2p_protocol.decode_body(b"[" * 100_000 + b"]" * 100_000)


def test_read_spec_round_trips_through_json_and_malformed_specs_are_refused():
    spec = ReadSpec("r1@3", "tok", 2, 9, (0, 2), 1, 2)
    wire = p2p_protocol.spec_to_json(spec)
    assert p2p_protocol.spec_from_json(wire) == spec
    # Block ids and an expiry from the wire mean nothing: the producer serves the hold's own blocks.
    assert p2p_protocol.spec_from_json({**wire, "block_ids": [7], "expires_at": None}) == spec
    with pytest.raises(ValueError, match="malformed"):
        p2p_protocol.spec_from_json({"remote_request_id": "x"})
    for bad in ({"token_start": 2.0}, {"token_end": "9"}, {"layers": [0, True]}, {"hold_token": ""},
                {"remote_request_id": "x" * 129}, {"remote_request_id": "a\nb"}, {"layers": list(range(5000))}):
        with pytest.raises(ValueError, match="malformed"):
            p2p_protocol.spec_from_json({**wire, **bad})
    with pytest.raises(ValueError, match="empty or negative"):
        p2p_protocol.spec_from_json(p2p_protocol.spec_to_json(ReadSpec("r", "t", 4, 4, (0,), 0, 1)))
    with pytest.raises(ValueError, match="not ascending"):
        p2p_protocol.spec_from_json(p2p_protocol.spec_to_json(ReadSpec("r", "t", 0, 4, (1, 0), 0, 1)))
    assert p2p_protocol.layer_shape(spec, 8) == (7, 1, 8)


def test_status_messages_carry_errors_and_truncate_long_ones():
    assert p2p_protocol.decode_status(p2p_protocol.encode_status(None)) is None
    status = p2p_protocol.encode_status("TimeoutError: hold expired ✓")
    assert status.shape == (p2p_protocol.STATUS_BYTES,) and status.dtype == torch.uint8
    assert p2p_protocol.decode_status(status) == "TimeoutError: hold expired ✓"
    long = p2p_protocol.decode_status(p2p_protocol.encode_status("x" * 1000))
    assert long == "x" * (p2p_protocol.STATUS_BYTES - 5)
    bad = torch.zeros(p2p_protocol.STATUS_BYTES, dtype=torch.uint8)
    bad[0] = 7
    with pytest.raises(p2p_protocol.ProtocolError, match="unknown status"):
        p2p_protocol.decode_status(bad)


# ---------------------------------------------------------------------- the transport, two ends in one process


SECRET = "wire-test-secret-0123456789abcdef"  # shared with the spawned producer process


def _config(role: str, **extra) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="torch_p2p", kv_role=role, kv_secret=SECRET,
                            kv_connector_extra_config={"kv_host": HOST, "read_timeout_s": 20, **extra})


def _source(layout: KVLayout = LAYOUT, num_blocks: int = 8, rank: int = 0, seed: int = 0) -> KVSource:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_size)
    caches = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(layout.num_layers)]
    return KVSource(layout, rank, caches)


def _spec(source: KVSource, hold_id: str, block_ids, token_start: int, token_end: int, layers, head_start: int,
          head_end: int, deadline: float | None = None, token: str | None = None) -> ReadSpec:
    """Grant `source` a hold of `block_ids` (all their tokens) and return a read of it with its token."""
    token = token or new_hold_token()
    num_tokens = len(block_ids) * source.layout.block_size
    deadline = time.time() + 600 if deadline is None else deadline
    source.register([HoldGrant(hold_id, hash_token(token), tuple(block_ids), num_tokens, deadline)])
    return ReadSpec(hold_id, token, token_start, token_end, tuple(layers), head_start, head_end)


class _SlowSource(KVSource):
    """A producer whose gather stalls (to exercise the reader's timeout)."""

    stall = threading.Event()

    def read_layer(self, spec, layer, read=None):
        self.stall.wait(30)
        return super().read_layer(spec, layer, read)


@pytest.fixture
def transports():
    made: list[TorchP2PTransport] = []

    def make(role: str, rank: int = 0, **extra) -> TorchP2PTransport:
        t = TorchP2PTransport(_config(role, **extra), LAYOUT, rank, torch.device("cpu"))
        made.append(t)
        return t

    yield make
    for t in reversed(made):
        t.close()


def _read_all(reader, spec):
    return [reader.wait_layer(layer) for layer in spec.layers]


def test_reads_return_the_producers_layers_and_interleaved_reads_on_one_pair_stay_apart(transports):
    source = _source()
    producer, consumer = transports("kv_producer"), transports("kv_consumer")
    address = producer.serve(source)
    assert pickle.loads(pickle.dumps(address)) == address and address["host"] == HOST
    a = _spec(source, "a", (5, 2, 7), 1, 11, (0, 1, 2), 0, 2)
    b = _spec(source, "b", (3, 0), 0, 6, (1, 2), 1, 2)
    ra, rb = consumer.read(address, a), consumer.read(address, b)
    assert ra.started.wait(60) and rb.started.wait(60) and rb.error is None  # connected, receives posted
    # Every layer of both reads arrives in the background, before anyone waits for a layer: a consumer's
    # compute of early layers overlaps the transfer of later ones.
    last_v = rb.posted[-1][1][2]  # b's last layer's V buffer, the last message on the wire
    expected_v = source.read_layer(b, 2)[1]
    deadline = time.monotonic() + 60
    while not torch.equal(last_v, expected_v):
        assert time.monotonic() < deadline, "the transfer did not progress on its own"
        time.sleep(0.01)
    got_a, got_b = {}, {}
    # The consumer waits in an order unlike the wire's (a's layers, then b's): buffers are per read.
    got_b[1] = rb.wait_layer(1)
    got_a[0] = ra.wait_layer(0)
    got_b[2] = rb.wait_layer(2)
    got_a[1], got_a[2] = ra.wait_layer(1), ra.wait_layer(2)
    for spec, got in ((a, got_a), (b, got_b)):
        for layer in spec.layers:
            k, v = source.read_layer(spec, layer)
            assert torch.equal(got[layer][0], k) and torch.equal(got[layer][1], v)
    with pytest.raises(ValueError, match="not requested"):
        ra.wait_layer(0)  # layers are read once, in ascending order


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_kv_moves_bit_exact(dtype):
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_size=4, dtype=dtype, block_size=4)
    base = _source(layout)
    source = KVSource(layout, 0, [(k.to(getattr(torch, dtype)), v.to(getattr(torch, dtype))) for k, v in base.kv_caches])
    producer = TorchP2PTransport(_config("kv_producer"), layout, 0, torch.device("cpu"))
    consumer = TorchP2PTransport(_config("kv_consumer"), layout, 0, torch.device("cpu"))
    try:
        spec = _spec(source, "h", (4, 1), 1, 7, (0, 1), 0, 2)
        for (k, v), layer in zip(_read_all(consumer.read(producer.serve(source), spec), spec), spec.layers):
            ek, ev = source.read_layer(spec, layer)
            assert k.dtype == getattr(torch, dtype) and torch.equal(k, ek) and torch.equal(v, ev)
    finally:
        consumer.close()
        producer.close()


def test_several_consumer_ranks_read_one_producer_rank_concurrently(transports):
    source = _source()
    producer = transports("kv_producer")
    address = producer.serve(source)
    consumers = [transports("kv_consumer", rank=r) for r in range(3)]
    specs = [_spec(source, f"r{i}", (i, 7 - i), 0, 8, (0, 1, 2), i % 2, i % 2 + 1) for i in range(3)]
    results: dict[int, object] = {}

    def run(i: int) -> None:
        try:
            for _ in range(3):  # several reads per pair, one after another
                results[i] = _read_all(consumers[i].read(address, specs[i]), specs[i])
        except Exception as exc:  # noqa: BLE001
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, spec in enumerate(specs):
        assert not isinstance(results[i], Exception), results[i]
        for (k, v), layer in zip(results[i], spec.layers):
            ek, ev = source.read_layer(spec, layer)
            assert torch.equal(k, ek) and torch.equal(v, ev)


def test_producer_errors_reach_the_reader_and_the_pair_stays_usable(transports):
    source = _source()
    producer, consumer = transports("kv_producer"), transports("kv_consumer")
    address = producer.serve(source)
    expired = _spec(source, "old", (0, 1), 0, 8, (0, 1, 2), 0, 2, deadline=time.time() - 1)
    reader = consumer.read(address, expired)
    with pytest.raises(RuntimeError, match="hold expired"):
        reader.wait_layer(0)
    reader.close()
    too_far = _spec(source, "short", (0,), 0, 8, (0, 1), 0, 2)  # 8 tokens of a hold of one block of 4
    wrong_token = ReadSpec("short", "not-its-token", 0, 4, (0,), 0, 2)
    for spec, match in ((too_far, "the hold has 4"), (wrong_token, "wrong hold token")):
        reader = consumer.read(address, spec)
        with pytest.raises(RuntimeError, match=match):
            reader.wait_layer(spec.layers[0])
        reader.close()  # as the worker connector does after a failure: the rest of the stream is drained
    good = _spec(source, "ok", (2, 3), 0, 8, (0, 1, 2), 0, 2)
    got = _read_all(consumer.read(address, good), good)  # the stream stayed aligned
    assert torch.equal(got[2][1], source.read_layer(good, 2)[1])
    assert [len(p.live) for p in consumer._pairs.values()] == [0]  # no receive buffer outlives its read
    # A spec the producer cannot even size (heads the model does not have) drops the connection (the
    # reader fails when its receives break or time out); the next read reconnects.
    bad_heads = _spec(source, "heads", (0, 1), 0, 8, (0,), 1, 3)
    reader = consumer.read(address, bad_heads)
    with pytest.raises((ConnectionError, TimeoutError)):
        reader.wait_layer(0)
    reader.close()
    got = _read_all(consumer.read(address, good), good)
    assert torch.equal(got[0][0], source.read_layer(good, 0)[0])


def test_release_reaches_the_producers_source(transports):
    source = _source()
    released: list[tuple[str, str]] = []
    source.release_sink = released.extend
    producer, consumer = transports("kv_producer"), transports("kv_consumer")
    address = producer.serve(source)
    consumer.release(address, "req-7@1", "token-7")
    consumer.release(address, "req-8@2", "token-8")
    deadline = time.monotonic() + 30
    while len(released) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert released == [("req-7@1", "token-7"), ("req-8@2", "token-8")]  # the scheduler checks the tokens


def test_a_stalled_producer_times_out_and_the_next_read_reconnects(transports):
    layout_source = _source()
    source = _SlowSource(LAYOUT, 0, layout_source.kv_caches)
    _SlowSource.stall.clear()
    producer = transports("kv_producer")
    consumer = transports("kv_consumer", read_timeout_s=1.0)
    address = producer.serve(source)
    spec = _spec(source, "slow", (0, 1), 0, 8, (0, 1, 2), 0, 2)
    reader = consumer.read(address, spec)
    with pytest.raises(TimeoutError):
        reader.wait_layer(0)
    reader.close()
    _SlowSource.stall.set()
    got = _read_all(consumer.read(address, spec), spec)  # a fresh pair
    assert torch.equal(got[0][0], source.read_layer(spec, 0)[0])


def test_a_consumer_gone_mid_read_does_not_wedge_the_producer(transports):
    base = _source()
    source = _SlowSource(LAYOUT, 0, base.kv_caches)
    _SlowSource.stall.clear()
    producer = transports("kv_producer")
    address = producer.serve(source)
    spec = _spec(source, "gone", (0, 1), 0, 8, (0, 1, 2), 0, 2)
    first = transports("kv_consumer")
    first.read(address, spec)
    first.close()  # mid-read: the producer is still gathering layer 0
    _SlowSource.stall.set()
    deadline = time.monotonic() + 60
    while any(p.thread.is_alive() for p in producer.server._peers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(p.thread.is_alive() for p in producer.server._peers)  # its sends failed; the peer is dropped
    second = transports("kv_consumer")
    got = _read_all(second.read(address, spec), spec)
    assert torch.equal(got[1][0], source.read_layer(spec, 1)[0])


FAR_TOKEN = "far-token"


SLOW_TOKEN = "slow-token"


def _serve_in_child(addresses, stop, device: str = "cpu", stall_request: str | None = None) -> None:
    """A producer rank in another process (spawned): serve a seeded source until told to stop; the layers
    after the first of `stall_request` take 10 s each to gather."""
    transport = TorchP2PTransport(_config("kv_producer"), LAYOUT, 0, torch.device(device))
    released: list[tuple[str, str]] = []
    base = _source(seed=1)

    class Source(KVSource):
        def read_layer(self, spec, layer, slots=None):
            if spec.remote_request_id == stall_request and layer != spec.layers[0]:
                time.sleep(10)
            return super().read_layer(spec, layer, slots)

    source = Source(LAYOUT, 0, [(k.to(device), v.to(device)) for k, v in base.kv_caches])
    _spec(source, "far", (6, 1, 4), 2, 12, (0, 2), 0, 2, token=FAR_TOKEN)
    _spec(source, "slow", (0, 1), 0, 8, (0, 1, 2), 0, 2, token=SLOW_TOKEN)
    source.release_sink = released.extend
    try:
        addresses.put(transport.serve(source))
    except Exception as exc:  # noqa: BLE001 - the parent fails fast with the reason
        addresses.put(exc)
        raise
    stop.wait(120)
    deadline = time.monotonic() + 30  # the release frame may still be in flight
    while not released and time.monotonic() < deadline:
        time.sleep(0.01)
    addresses.put(released)
    transport.close()


def test_a_producer_rank_in_another_process_is_read_through_its_address(transports):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    addresses, stop = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_serve_in_child, args=(addresses, stop), daemon=True)
    child.start()
    try:
        address = addresses.get(timeout=120)
        assert isinstance(address, dict), address
        consumer = transports("kv_consumer")
        expected = _source(seed=1)  # the same seeded cache as the child's, and the same hold
        spec = _spec(expected, "far", (6, 1, 4), 2, 12, (0, 2), 0, 2, token=FAR_TOKEN)
        got = _read_all(consumer.read(address, spec), spec)
        for (k, v), layer in zip(got, spec.layers):
            ek, ev = expected.read_layer(spec, layer)
            assert torch.equal(k, ek) and torch.equal(v, ev)
        consumer.release(address, "far", FAR_TOKEN)
        stop.set()
        assert addresses.get(timeout=60) == [("far", FAR_TOKEN)]
    finally:
        stop.set()
        child.join(60)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL pair needs one GPU per end")
def test_nccl_pairs_move_kv_between_gpus_and_a_stalled_read_fails_only_itself():
    """Producer on cuda:1 in another process, consumer on cuda:0 here: NCCL carries the layers; a read
    that stalls past read_timeout_s fails (its pair's communicator is aborted), and neither process dies:
    the next read works on a new pair."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    addresses, stop = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_serve_in_child, args=(addresses, stop, "cuda:1", "slow"), daemon=True)
    child.start()
    consumer = TorchP2PTransport(_config("kv_consumer", read_timeout_s=3), LAYOUT, 0, torch.device("cuda", 0))
    try:
        address = addresses.get(timeout=300)
        assert isinstance(address, dict) and address["device"] == "cuda", address
        expected = _source(seed=1)
        spec = _spec(expected, "far", (6, 1, 4), 2, 12, (0, 2), 0, 2, token=FAR_TOKEN)
        for attempt in ("first", "after the stalled read"):
            if attempt != "first":
                slow = ReadSpec("slow", SLOW_TOKEN, 0, 8, (0, 1, 2), 0, 2)
                reader = consumer.read(address, slow)
                with pytest.raises((TimeoutError, ConnectionError)):
                    _read_all(reader, slow)
                reader.close()
            got = _read_all(consumer.read(address, spec), spec)
            for (k, v), layer in zip(got, spec.layers):
                assert k.device == torch.device("cuda", 0)
                ek, ev = expected.read_layer(spec, layer)
                assert torch.equal(k.cpu(), ek) and torch.equal(v.cpu(), ev), attempt
        assert child.is_alive()  # the producer process survived the failed transfer too
    finally:
        consumer.close()
        stop.set()
        child.join(60)
        if child.is_alive():
            child.kill()


def test_misbehaving_peers_neither_block_other_consumers_nor_close(transports):
    source = _source()
    producer = transports("kv_producer")
    address = producer.serve(source)
    spec = _spec(source, "s", (0, 1), 0, 8, (0, 1, 2), 0, 2)
    # A peer with the secret that says hello and then never joins its group's rendezvous.
    stalled = socket.create_connection((HOST, address["port"]), timeout=10)
    channel = p2p_channel.client_handshake(stalled, _config("kv_consumer").secret(), time.monotonic() + 10)
    channel.send({"op": "hello", "device": "cpu"})
    garbage = socket.create_connection((HOST, address["port"]), timeout=10)
    garbage.sendall(b"\x00\x00\x00\x05hello")
    try:
        consumer = transports("kv_consumer")
        got = _read_all(consumer.read(address, spec), spec)
        assert torch.equal(got[1][0], source.read_layer(spec, 1)[0])
        assert garbage.recv(1) == b""  # the producer dropped the peer that spoke garbage
        server = producer.server
        producer.close()  # returns although one peer thread waits in its rendezvous: close wakes it
        assert not server._thread.is_alive()
        while stalled.recv(4096):  # its rendezvous frames, then the end of the connection
            pass
    finally:
        stalled.close()
        garbage.close()


def test_bad_transport_settings_name_the_field(transports):
    with pytest.raises(ValueError, match="connect_timeout_s: must be > 0"):
        transports("kv_consumer", connect_timeout_s=0)
    with pytest.raises(ValueError, match="connect_timeout_s: must be a number"):
        transports("kv_consumer", connect_timeout_s="soon")
    with pytest.raises(ValueError, match="kv_host: cannot listen on '203.0.113.1'"):
        transports("kv_producer", kv_host="203.0.113.1").serve(_source())  # not an address of this machine


def test_closed_or_missing_producers_fail_fast_and_close_stops_everything(transports):
    producer, consumer = transports("kv_producer"), transports("kv_consumer")
    source = _source()
    address = producer.serve(source)
    spec = _spec(source, "x", (0, 1), 0, 8, (0,), 0, 2)
    _read_all(consumer.read(address, spec), spec)
    server = producer.server
    producer.close()
    assert not server._thread.is_alive()
    with pytest.raises(OSError):
        socket.create_connection((HOST, address["port"]), timeout=5).close()
    with pytest.raises((ConnectionError, OSError)):
        _read_all(consumer.read(address, spec), spec)
    with pytest.raises(ValueError, match="not a torch_p2p address"):
        consumer.read({"engine_id": "e", "rank": 0}, spec)
    consumer.close()
    with pytest.raises(ConnectionError, match="closed"):
        consumer.read(address, spec)
