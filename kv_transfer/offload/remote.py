"""The offload tier across nodes: one engine reads blocks another node's engine spilled to its tier.

A tier is per node (host shared memory or a local disk), so an engine on node B cannot open the files an
engine on node A spilled. A remote load copies them: B asks A's engine host for the blocks by their
prefix-cache hashes (`read_tier_blocks` on A), checks every block (header, size, per-layer CRC-32) and
places it in its own tier (`install_tier_blocks`); its scheduler adopts them into its index
(`OffloadConnectorScheduler.adopt`), and the request then loads them layer by layer like any tier hit.
Copying whole blocks before the request is scheduled, not streaming them into its forward pass, keeps
the remote part out of the engine step: a slow or failed peer delays or loses only that fetch, never a
step, and the engine recomputes what did not arrive.

Who may read: the hash of a block chains the whole prefix, the tenant's `cache_salt` and the LoRA id, so
naming a hash proves knowledge of that tenant's prefix (a peer that does not hold it returns nothing). On
top of that every read is signed with the deployment's KV secret (kv_transfer/auth.py), like the PD
reads: an HMAC-SHA256 over the tier's namespace (model and KV layout), the peer it is meant for, the
hashes, a timestamp and a nonce; a stale, replayed or unsigned read is refused before any file is opened.
The namespace must equal the peer's own, so only engines whose KV is interchangeable exchange blocks.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.kv_transfer.auth import DIGEST_BYTES, SIGNATURE_MAX_AGE_S, SignedCallVerifier, sign
from pagedserve.kv_transfer.holds import is_short_printable
from pagedserve.kv_transfer.offload.tier_files import (
    CorruptBlockFile,
    TierLocation,
    check_block_blob,
    install_block_blob,
    make_rank_dir,
    read_block_blob,
)

logger = logging.getLogger(__name__)

# Most blocks one read asks for (a longer prefix is fetched in several reads, or partly recomputed).
MAX_TIER_READ_BLOCKS = 256
# How far a signed read's timestamp may be from the peer's clock (either way: clocks of two nodes).
_DOMAIN = "pagedserve/kv_tier_read/v1"
_HASH_BYTES = 32
# A block file's bytes beyond its KV: the header and a CRC per layer (of up to this many layers).
_MAX_LAYERS = 4096
_FILE_OVERHEAD = 64 + 4 * _MAX_LAYERS


def block_file_limit(block_bytes: int) -> int:
    """The most bytes one rank's file of a block may have, given a block's KV bytes on all ranks together."""
    return block_bytes + _FILE_OVERHEAD


class TierReadAuthError(PermissionError):
    """A tier read that is not signed with this deployment's KV secret (or is stale, replayed, malformed)."""


@dataclass(frozen=True)
class TierReadAuth:
    timestamp: float
    nonce: str
    signature: bytes


def _message(namespace: str, peer: str, hashes: list[bytes], timestamp: float, nonce: str) -> tuple[str, ...]:
    return (_DOMAIN, namespace, peer, b"".join(hashes).hex(), repr(float(timestamp)), nonce)


def sign_tier_read(secret: bytes, namespace: str, peer: str, hashes: list[bytes],
                   clock: Callable[[], float] = time.time) -> TierReadAuth:
    """Sign a read of `hashes` from the tier `namespace` of engine `peer` (its replica id)."""
    timestamp, nonce = clock(), secrets.token_hex(16)
    return TierReadAuth(timestamp, nonce, sign(secret, *_message(namespace, peer, hashes, timestamp, nonce)))


def well_formed_hashes(hashes: object) -> bool:
    return (isinstance(hashes, list) and 0 < len(hashes) <= MAX_TIER_READ_BLOCKS
            and all(isinstance(h, bytes) and len(h) == _HASH_BYTES for h in hashes))


class TierReadVerifier(SignedCallVerifier):
    """A peer's check of signed tier reads (thread-safe; remembers recent nonces to refuse replays)."""

    error = TierReadAuthError
    prefix, what, whose_clock = "kv_tier_read", "tier read", "this peer's"

    def __init__(self, secret: bytes, peer: str, max_age_s: float = SIGNATURE_MAX_AGE_S,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(secret, max_age_s, clock)
        self.peer = peer

    def verify(self, auth: object, namespace: object, hashes: object) -> None:
        """Raise TierReadAuthError unless `auth` signs exactly this read, freshly, for this peer."""
        if not (isinstance(auth, TierReadAuth) and isinstance(auth.signature, bytes)
                and len(auth.signature) == DIGEST_BYTES and is_short_printable(auth.nonce, 64)
                and type(auth.timestamp) in (int, float) and math.isfinite(auth.timestamp)
                and is_short_printable(namespace) and well_formed_hashes(hashes)):
            self.refuse("an unsigned or malformed tier read")
        self.check_signed(auth.signature, auth.timestamp, auth.nonce,
                          *_message(namespace, self.peer, hashes, auth.timestamp, auth.nonce))


def read_tier_blocks(location: TierLocation, hashes: list[bytes], max_block_bytes: int) -> dict[bytes, list[bytes]]:
    """The blocks of `hashes` this node's tier holds whole: per hash, every rank's checked block file. A
    hash some rank lacks (never stored, dropped, damaged) is left out: the reader recomputes it."""
    found: dict[bytes, list[bytes]] = {}
    for block_hash in hashes:
        blobs = []
        for rank in range(location.world_size):
            try:
                blobs.append(read_block_blob(location.block_path(rank, block_hash), block_hash, max_block_bytes))
            except FileNotFoundError:
                break
            except (CorruptBlockFile, OSError) as exc:
                logger.warning("KV offload: not serving block %s to a peer: %s", block_hash.hex()[:16], exc)
                break
        else:
            found[block_hash] = blobs
    return found


def install_tier_blocks(location: TierLocation, hashes: list[bytes], blocks: object,
                        max_block_bytes: int) -> list[bytes]:
    """Check and place the blocks a peer sent (`read_tier_blocks`'s answer) in this node's tier; returns the
    hashes this call wrote, in `hashes` order (blocks the node's tier holds already are skipped), stopping
    at the first one missing or damaged (a load uses a run of blocks from the prefix's start). Anything the peer sent that was not
    asked for is ignored; a block some rank's file of which fails its check is not placed at all."""
    if not isinstance(blocks, dict):
        return []
    for rank in range(location.world_size):
        make_rank_dir(location, rank)
    installed: list[bytes] = []
    for block_hash in hashes:
        blobs = blocks.get(block_hash)
        if location.on_node(block_hash):
            continue  # someone on this node holds it: not ours to adopt; the load reads it from the tier
        if not isinstance(blobs, list) or len(blobs) != location.world_size:
            break
        try:
            for blob in blobs:
                check_block_blob(blob, block_hash, max_block_bytes)
        except CorruptBlockFile as exc:
            logger.warning("KV offload: a peer sent block %s damaged (%s); it is recomputed",
                           block_hash.hex()[:16], exc)
            break
        written = []
        try:
            for rank, blob in enumerate(blobs):
                install_block_blob(location.block_path(rank, block_hash), blob)
                written.append(rank)
        except OSError as exc:
            logger.warning("KV offload: could not place a fetched block in %s: %s", location.namespace, exc)
            for rank in written:  # all ranks or none
                location.block_path(rank, block_hash).unlink(missing_ok=True)
            break
        installed.append(block_hash)
    return installed
