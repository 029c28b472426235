"""torch_p2p's control connection: a mutual secret handshake, then frames that carry an HMAC tag.

The handshake (fixed-size binary messages, so nothing a stranger sends is parsed or sized before it):

    consumer -> producer   MAGIC, consumer challenge (32 random bytes)
    producer -> consumer   producer challenge (32 random bytes)
    consumer -> producer   HMAC(secret, "consumer", both challenges)   the producer closes unless it matches
    producer -> consumer   HMAC(secret, "producer", both challenges)   the consumer gives up unless it matches

The consumer proves itself first: a stranger who connects to a producer learns one random challenge and
nothing computed from the secret, so it has nothing to guess the secret offline from. Both proofs cover
both fresh challenges, so none can be replayed, and their labels differ, so none can be reflected.

Every frame after the handshake is `length | JSON body | tag`, the tag an HMAC-SHA256 of the direction,
the frame's sequence number and the body under a session key derived from the secret and both
challenges (`auth.sign`). So a connection that someone relays or hijacks after a genuine handshake still
carries only the genuine peer's frames, unaltered and in order. The secret itself never travels.

Optional TLS (`kv_tls_*` settings) wraps the TCP connection before the handshake: it adds
confidentiality, and with `kv_tls_cafile` certificate checks. Peers are addressed by IP, so the
certificate's host name is not checked; who may connect is decided by the secret.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
import time
from typing import Any

from pagedserve.kv_transfer import auth
from pagedserve.kv_transfer.connectors import p2p_protocol
from pagedserve.kv_transfer.connectors.p2p_settings import FIELD_PREFIX, P2PSettings

MAGIC = b"PSKVP2P1"  # the protocol and its version, first on every connection
CONSUMER = b"consumer"
PRODUCER = b"producer"
_SESSION = b"session"
_LEN = struct.Struct(">I")
_SEQ = struct.Struct(">Q")


class AuthenticationError(ConnectionError):
    """The peer did not prove that it holds the deployment's KV secret (or is not a torch_p2p peer)."""


class IdleTimeout(TimeoutError):
    """No frame began within the wait a receiver allowed (as opposed to a frame cut short)."""


# ---------------------------------------------------------------------- sockets


def tune(sock: socket.socket) -> None:
    """No Nagle delay for small control frames; keepalive probes so that a vanished peer is noticed."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):  # Linux; other systems keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("torch_p2p: the peer did not answer in time")
    return left


def _send(sock: socket.socket, data: bytes, deadline: float | None) -> None:
    sock.settimeout(_remaining(deadline))
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes | None:
    """n bytes, or None when the peer closed before the first of them; TimeoutError past the deadline."""
    buf = bytearray()
    while len(buf) < n:
        sock.settimeout(_remaining(deadline))
        chunk = sock.recv(min(n - len(buf), 1 << 16))
        if not chunk:
            if buf:
                raise p2p_protocol.ProtocolError("connection closed inside a message")
            return None
        buf += chunk
    return bytes(buf)


def close_quietly(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


# ---------------------------------------------------------------------- handshake


def client_handshake(sock: socket.socket, secret: bytes, deadline: float) -> Channel:
    """The consumer's half; returns the authenticated channel or raises AuthenticationError / OSError."""
    mine = auth.new_challenge()
    _send(sock, MAGIC + mine, deadline)
    theirs = _recv_exact(sock, auth.CHALLENGE_BYTES, deadline)
    if theirs is None:
        raise AuthenticationError("torch_p2p: the producer closed the connection before its challenge "
                                  "(over its connection cap, or not a torch_p2p producer)")
    _send(sock, auth.sign(secret, MAGIC, CONSUMER, mine, theirs), deadline)
    proof = _recv_exact(sock, auth.DIGEST_BYTES, deadline)
    if proof is None:
        raise AuthenticationError("torch_p2p: the producer refused this consumer (do both ends share one KV "
                                  "secret? kv_transfer_config.kv_secret / PAGEDSERVE_KV_SECRET)")
    if not auth.verify(secret, proof, MAGIC, PRODUCER, mine, theirs):
        raise AuthenticationError("torch_p2p: the producer did not prove that it holds the KV secret")
    return Channel(sock, auth.sign(secret, MAGIC, _SESSION, mine, theirs), CONSUMER)


def server_handshake(sock: socket.socket, secret: bytes, deadline: float) -> Channel:
    """The producer's half: nothing but the fixed-size handshake is read before the peer is proven."""
    head = _recv_exact(sock, len(MAGIC) + auth.CHALLENGE_BYTES, deadline)
    if head is None:
        raise AuthenticationError("closed before the handshake")
    if head[: len(MAGIC)] != MAGIC:
        raise AuthenticationError("not a torch_p2p consumer")
    theirs, mine = head[len(MAGIC):], auth.new_challenge()
    _send(sock, mine, deadline)
    proof = _recv_exact(sock, auth.DIGEST_BYTES, deadline)
    if proof is None or not auth.verify(secret, proof, MAGIC, CONSUMER, theirs, mine):
        raise AuthenticationError("wrong KV secret" if proof is not None else "closed during the handshake")
    _send(sock, auth.sign(secret, MAGIC, PRODUCER, theirs, mine), deadline)
    return Channel(sock, auth.sign(secret, MAGIC, _SESSION, theirs, mine), PRODUCER)


# ---------------------------------------------------------------------- authenticated frames


class Channel:
    """An authenticated control connection: JSON frames, each with an HMAC tag over direction and sequence.

    One thread sends at a time and one receives at a time (the callers' locks see to it)."""

    def __init__(self, sock: socket.socket, session_key: bytes, side: bytes) -> None:
        self.sock = sock
        self._key = session_key
        self._send_label = side
        self._recv_label = PRODUCER if side == CONSUMER else CONSUMER
        self._sent = 0
        self._received = 0

    def send(self, message: dict[str, Any], timeout_s: float | None = None) -> None:
        body = p2p_protocol.encode_body(message)
        tag = auth.sign(self._key, self._send_label, _SEQ.pack(self._sent), body)
        self._sent += 1
        self.sock.settimeout(timeout_s)
        self.sock.sendall(_LEN.pack(len(body)) + body + tag)

    def recv(self, wait_s: float | None, frame_timeout_s: float) -> dict[str, Any] | None:
        """The next frame: it must begin within `wait_s` (None: no limit) and then arrive in full within
        `frame_timeout_s`. None when the peer closed cleanly between frames; ProtocolError for an oversize
        length (refused before anything is allocated) or a malformed body, AuthenticationError for a bad tag."""
        start = None if wait_s is None else time.monotonic() + wait_s
        try:
            first = _recv_exact(self.sock, 1, start)
        except TimeoutError:
            raise IdleTimeout(f"torch_p2p: no frame within {wait_s:.1f} s") from None
        if first is None:
            return None
        deadline = time.monotonic() + frame_timeout_s
        (length,) = _LEN.unpack(first + self._need(_LEN.size - 1, deadline))
        if length > p2p_protocol.MAX_FRAME:
            raise p2p_protocol.ProtocolError(f"control frame of {length} bytes exceeds {p2p_protocol.MAX_FRAME}")
        rest = self._need(length + auth.DIGEST_BYTES, deadline)
        body, tag = rest[:length], rest[length:]
        if not auth.verify(self._key, tag, self._recv_label, _SEQ.pack(self._received), body):
            raise AuthenticationError("a control frame failed its integrity check")
        self._received += 1
        return p2p_protocol.decode_body(body)

    def _need(self, n: int, deadline: float) -> bytes:
        data = _recv_exact(self.sock, n, deadline)
        if data is None:
            raise p2p_protocol.ProtocolError("connection closed inside a control frame")
        return data

    def peer_closed(self) -> bool:
        """Whether the connection is gone. A producer sends nothing unasked after the rendezvous (and its TLS
        sends no session tickets), so a readable socket means EOF, a reset, or a peer off the protocol."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    def close(self) -> None:
        close_quietly(self.sock)


# ---------------------------------------------------------------------- TLS


def _load_failed(key: str, path: str | None, exc: Exception) -> ValueError:
    return ValueError(f"{FIELD_PREFIX}.{key}: cannot load {path!r}: {exc}")


def server_tls_context(settings: P2PSettings) -> ssl.SSLContext | None:
    """The producer's TLS context, or None without TLS settings. With kv_tls_cafile, consumers must
    present a certificate that chains to it (mutual TLS)."""
    if not settings.tls:
        return None
    if not settings.kv_tls_certfile:
        raise ValueError(f"{FIELD_PREFIX}.kv_tls_certfile: a producer serving TLS needs its certificate "
                         "(kv_tls_certfile, kv_tls_keyfile)")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.num_tickets = 0  # nothing unasked on the wire after the handshake (see Channel.peer_closed)
    try:
        ctx.load_cert_chain(settings.kv_tls_certfile, settings.kv_tls_keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise _load_failed("kv_tls_certfile", settings.kv_tls_certfile, exc) from None
    if settings.kv_tls_cafile:
        _require_peer_certificates(ctx, settings.kv_tls_cafile)
    return ctx


def _require_peer_certificates(ctx: ssl.SSLContext, cafile: str) -> None:
    try:
        ctx.load_verify_locations(cafile)
    except (OSError, ssl.SSLError) as exc:
        raise _load_failed("kv_tls_cafile", cafile, exc) from None
    ctx.verify_mode = ssl.CERT_REQUIRED


def client_tls_context(settings: P2PSettings) -> ssl.SSLContext | None:
    """The consumer's TLS context, or None without TLS settings: it checks the producer's certificate
    against kv_tls_cafile when given (else encryption only) and presents its own when it has one."""
    if not settings.tls:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False  # producers are addressed by IP; the secret handshake decides who is a peer
    if settings.kv_tls_cafile:
        _require_peer_certificates(ctx, settings.kv_tls_cafile)
    else:
        ctx.verify_mode = ssl.CERT_NONE
    if settings.kv_tls_certfile:
        try:
            ctx.load_cert_chain(settings.kv_tls_certfile, settings.kv_tls_keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise _load_failed("kv_tls_certfile", settings.kv_tls_certfile, exc) from None
    return ctx
