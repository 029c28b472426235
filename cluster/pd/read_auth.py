"""Signed KV reads for the Ray transport: only members of the deployment (holders of its KV secret) read.

A consumer rank signs every `kv_read` call with the deployment's KV secret (kv_transfer/auth.py): an
HMAC-SHA256 over the producer incarnation's serving token, the producer rank, the hold id, the SHA-256
of the hold token, the token range, the heads, the spec's layers and the call's layers, a timestamp and
a random nonce. The producer rank verifies it before it does any other work: a signature that does not
match, is more than `SIGNATURE_MAX_AGE_S` away from its own clock, or repeats a nonce it has seen is
refused. The secret itself never travels. (Releases need no signature: they are refused without the
hold's token, which only a reader the hold was handed to has.)
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.kv_transfer.auth import DIGEST_BYTES, SIGNATURE_MAX_AGE_S, SignedCallVerifier, sign
from pagedserve.kv_transfer.holds import hash_token, is_short_printable
from pagedserve.kv_transfer.kv_source import ReadSpec

# How far a signed read's timestamp may be from the producer's clock (either way: clocks of two nodes).
# More layers than any model has: longer lists are refused before anything is hashed.
_MAX_LAYERS = 4096
_DOMAIN = "pagedserve/kv_read/v1"


class ReadAuthError(PermissionError):
    """A read that is not signed with this deployment's KV secret (or is stale, or replayed)."""


@dataclass(frozen=True)
class ReadAuth:
    """The signature a consumer sends beside a `kv_read` call."""

    timestamp: float
    nonce: str
    signature: bytes


def _message(serving_token: str, rank: int, spec: ReadSpec, layers: list[int], timestamp: float,
             nonce: str) -> tuple[str, ...]:
    return (_DOMAIN, serving_token, str(rank), spec.remote_request_id, hash_token(spec.hold_token).hex(),
            f"{spec.token_start}:{spec.token_end}", f"{spec.head_start}:{spec.head_end}",
            ",".join(map(str, spec.layers)), ",".join(map(str, layers)), repr(float(timestamp)), nonce)


def _well_formed(auth: object, spec: object, layers: object) -> bool:
    """Whether a read's parts have the types and sizes a signed read has (checked before any hashing)."""
    if not (isinstance(auth, ReadAuth) and isinstance(spec, ReadSpec) and isinstance(layers, list)):
        return False
    if not (isinstance(auth.signature, bytes) and len(auth.signature) == DIGEST_BYTES
            and is_short_printable(auth.nonce, 64) and type(auth.timestamp) in (int, float)
            and math.isfinite(auth.timestamp)):
        return False
    if not (is_short_printable(spec.remote_request_id) and is_short_printable(spec.hold_token)
            and isinstance(spec.layers, tuple) and len(spec.layers) <= _MAX_LAYERS and len(layers) <= _MAX_LAYERS):
        return False
    numbers = (spec.token_start, spec.token_end, spec.head_start, spec.head_end, *spec.layers, *layers)
    return all(type(n) is int for n in numbers)


def sign_read(secret: bytes, serving_token: str, rank: int, spec: ReadSpec, layers: list[int],
              clock: Callable[[], float] = time.time) -> ReadAuth:
    timestamp, nonce = clock(), secrets.token_hex(16)
    return ReadAuth(timestamp, nonce, sign(secret, *_message(serving_token, rank, spec, layers, timestamp, nonce)))


class ReadVerifier(SignedCallVerifier):
    """A producer rank's check of signed reads (thread-safe; remembers recent nonces to refuse replays)."""

    error = ReadAuthError
    prefix, what, whose_clock = "kv_read", "read", "this producer's"

    def __init__(self, secret: bytes, rank: int, max_age_s: float = SIGNATURE_MAX_AGE_S,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(secret, max_age_s, clock)
        self.rank = rank

    def verify(self, auth: object, serving_token: str, spec: object, layers: object) -> None:
        """Raise ReadAuthError unless `auth` signs exactly this read, freshly, for this rank."""
        if not _well_formed(auth, spec, layers):
            self.refuse("an unsigned or malformed read")
        self.check_signed(auth.signature, auth.timestamp, auth.nonce,
                          *_message(serving_token, self.rank, spec, layers, auth.timestamp, auth.nonce))
