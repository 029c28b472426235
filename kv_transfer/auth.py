"""The deployment secret that KV transports authenticate their peers with, and the HMAC helpers over it.

Every engine of one deployment (the prefill and decode pools of one app) shares one secret. A transport
never sends it: peers prove they hold it by answering a random challenge with an HMAC-SHA256 of it (see
the torch_p2p handshake), or by signing a request with a fresh timestamp (the Ray transport's reads).

Where the secret comes from, first match wins:

1. `kv_transfer_config.kv_secret` (the PD app generates one when it starts and hands it to its engines;
   the data-parallel app hands its engine replicas one the same way, as `EngineHost(kv_secret=)`);
2. the `PAGEDSERVE_KV_SECRET` environment variable (the secret itself);
3. the `PAGEDSERVE_KV_SECRET_FILE` environment variable (a file holding it; e.g. a mounted Kubernetes Secret);
4. otherwise a random secret for this process only: engines in one process (the in-process transport,
   tests) still agree, but a peer in another process can authenticate only with a shared secret from 1-3.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable

logger = logging.getLogger(__name__)

SECRET_ENV = "PAGEDSERVE_KV_SECRET"
SECRET_FILE_ENV = "PAGEDSERVE_KV_SECRET_FILE"
# Secrets shorter than this are refused: they could be guessed offline from one recorded handshake.
MIN_SECRET_BYTES = 16
CHALLENGE_BYTES = 32
DIGEST_BYTES = hashlib.sha256().digest_size

# How far a signed call's timestamp may be from the receiver's clock (and how long its nonce is remembered).
SIGNATURE_MAX_AGE_S = 60.0

_process_secret: bytes | None = None
_process_secret_lock = threading.Lock()


def generate_secret() -> str:
    """A fresh deployment secret (256 random bits, hex)."""
    return secrets.token_hex(32)


def _checked(secret: str, source: str) -> bytes:
    raw = secret.strip().encode()
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"{source}: the KV secret must be at least {MIN_SECRET_BYTES} characters")
    return raw


def resolve_secret(configured: str | None = None) -> bytes:
    """The secret this engine's KV transport authenticates with (see the module docstring for the order)."""
    if configured:
        return _checked(configured, "kv_transfer_config.kv_secret")
    if os.environ.get(SECRET_ENV):
        return _checked(os.environ[SECRET_ENV], SECRET_ENV)
    path = os.environ.get(SECRET_FILE_ENV)
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return _checked(f.read(), f"{SECRET_FILE_ENV} ({path})")
        except OSError as exc:
            raise ValueError(f"{SECRET_FILE_ENV}: cannot read the KV secret from {path}: {exc}") from None
    global _process_secret
    with _process_secret_lock:
        if _process_secret is None:
            _process_secret = generate_secret().encode()
            logger.warning("no KV secret configured (kv_transfer_config.kv_secret, %s or %s): using a random one for "
                           "this process; KV peers in other processes will be refused", SECRET_ENV, SECRET_FILE_ENV)
        return _process_secret


def new_challenge() -> bytes:
    return secrets.token_bytes(CHALLENGE_BYTES)


def sign(secret: bytes, *parts: bytes | str) -> bytes:
    """HMAC-SHA256 over `parts`, each length-prefixed (so ("ab", "c") and ("a", "bc") never collide)."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        mac.update(len(data).to_bytes(8, "big"))
        mac.update(data)
    return mac.digest()


def verify(secret: bytes, signature: bytes, *parts: bytes | str) -> bool:
    """Constant-time check of a `sign` result."""
    return hmac.compare_digest(sign(secret, *parts), signature)


class SignedCallVerifier:
    """The receiver's check of calls signed with `sign` over a fresh timestamp and a nonce: the signature,
    the clock skew, and replays (nonces remembered for as long as a signature stays fresh). Thread-safe.
    Subclasses name their error and what they check (`error`, `what`) and build the signed message."""

    error: type[Exception] = PermissionError
    prefix = "signed call"  # the call's name, first in every refusal
    what = "call"
    whose_clock = "this receiver's"

    def __init__(self, secret: bytes, max_age_s: float = SIGNATURE_MAX_AGE_S,
                 clock: Callable[[], float] = time.time) -> None:
        self._secret = secret
        self.max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._seen_order: deque[tuple[float, str]] = deque()  # (when it stops mattering, nonce)
        self.refused = 0

    def check_signed(self, signature: bytes, timestamp: float, nonce: str, *message: bytes | str) -> None:
        """Raise `error` unless `signature` signs `message` (which includes timestamp and nonce), the
        timestamp is within `max_age_s` of this clock and the nonce was not seen before."""
        now = self._clock()
        if abs(now - timestamp) > self.max_age_s:
            self.refuse(f"a {self.what} signed {now - timestamp:+.0f} s away from {self.whose_clock} clock")
        if not verify(self._secret, signature, *message):
            self.refuse(f"a {self.what} not signed with this deployment's KV secret")
        with self._lock:
            while self._seen_order and self._seen_order[0][0] < now:
                self._seen.discard(self._seen_order.popleft()[1])
            if nonce in self._seen:
                self.refused += 1
                raise self.error(f"{self.prefix}: a replayed {self.what}")
            self._seen.add(nonce)
            self._seen_order.append((timestamp + self.max_age_s, nonce))

    def refuse(self, reason: str) -> None:
        with self._lock:
            self.refused += 1
        raise self.error(f"{self.prefix}: {reason}; refused")
