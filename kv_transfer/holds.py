"""Holds: the capability a prefill producer issues for the KV of one finished prompt.

When a prefill finishes, the producer's scheduler keeps the prompt's blocks and issues a hold: an id
(`<request id>@<sequence number>`), an unguessable token, the blocks, the prompt's token count and a
deadline. The token goes to the reader in kv_transfer_params (`remote_hold_token`); the producer's ranks
get a `HoldGrant` carrying only the token's SHA-256. A rank serves a read only for a hold it was granted,
with that hold's token, from that hold's blocks, before its deadline; the scheduler accepts a release
only with the hold's token. Ids and tokens that come off the wire are short printable strings or refused.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from dataclasses import dataclass

# Hold ids, hold tokens and nonces on the wire: at most this many printable ASCII characters.
MAX_ID_CHARS = 128
# The request id's share of a hold id (the rest is "@" and the sequence number).
_REQUEST_PART_CHARS = 96


@dataclass(frozen=True)
class HoldGrant:
    """One hold as the producer's scheduler registers it with each of its ranks."""

    hold_id: str
    token_hash: bytes  # SHA-256 of the hold's token (the ranks never see the token itself)
    block_ids: tuple[int, ...]  # the producer's blocks of the prompt, in order
    num_tokens: int  # prompt tokens whose KV the blocks hold
    deadline: float  # wall clock (time.time()) after which the rank refuses reads


def new_hold_token() -> str:
    """A fresh hold token: 256 random bits (URL-safe text)."""
    return secrets.token_urlsafe(32)


def hash_token(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def is_short_printable(value: object, limit: int = MAX_ID_CHARS) -> bool:
    return isinstance(value, str) and 0 < len(value) <= limit and value.isascii() and value.isprintable()


def shown(value: object) -> str:
    """A peer-supplied id for a log line or an error message: escaped (repr) and bounded."""
    if not isinstance(value, str):
        return f"<{type(value).__name__}>"
    return repr(value[:MAX_ID_CHARS]) + ("..." if len(value) > MAX_ID_CHARS else "")


def hold_id_for(request_id: str, sequence: int) -> str:
    """A hold's id: the request id's printable ASCII prefix (for logs; a client chose it) and the
    producer's sequence number (unique per producer, increasing)."""
    part = "".join(c if c.isascii() and c.isprintable() else "?" for c in request_id[:_REQUEST_PART_CHARS])
    return f"{part or '?'}@{sequence}"


def hold_sequence(hold_id: str) -> int | None:
    """The sequence number in a hold id, or None when it has none (no producer issues such an id)."""
    _, sep, tail = hold_id.rpartition("@")
    if not sep or not tail or len(tail) > 18 or not (tail.isascii() and tail.isdigit()):
        return None
    return int(tail)


class RateLimitedLog:
    """Logs at debug level at most once per interval (what a misbehaving peer can trigger at will)."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last = float("-inf")
        self._suppressed = 0

    def debug(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._suppressed += 1
            return
        suppressed, self._suppressed, self._last = self._suppressed, 0, now
        if suppressed:
            msg += f" ({suppressed} more since the last such message)"
        self.logger.debug(msg, *args)
