"""Fetching a prompt's offload-tier blocks from an engine replica on another node (kv_transfer/offload/remote.py).

The request router names the replica whose tier holds more of the prompt than the chosen replica
(`kv_tier_peer` in the `generate` call: app, deployment, replica), the way a PD request names its
producer. Before the chosen engine sees the request, its host asks that peer for the prompt's blocks its
own node's tier lacks (`EngineHost.kv_tier_read`, a call pinned to the peer replica by the request router,
signed with the deployment's KV secret), checks and places what came back in its tier and hands the
hashes to its scheduler (`adopt`); the engine's lookup then finds them like any tier block and loads
them layer by layer. Everything here is bounded by `timeout_s`: a peer that is gone, slow, refuses or
holds nothing costs at most that, and the engine computes what did not arrive. Failed fetches are counted
by reason (`FETCH_FAILURE_REASONS`; the engine host reports them in its stats, /metrics shows
`pagedserve:kv_offload_remote_fetch_failures_total{reason=...}`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ray.exceptions import RayActorError

from pagedserve.kv_transfer.holds import is_short_printable
from pagedserve.kv_transfer.offload.remote import (
    MAX_TIER_READ_BLOCKS,
    TierReadAuth,
    TierReadAuthError,
    block_file_limit,
    install_tier_blocks,
    sign_tier_read,
)

if TYPE_CHECKING:
    from pydantic import SecretStr

logger = logging.getLogger(__name__)

DEFAULT_TIER_FETCH_TIMEOUT_S = 10.0
TIER_READ_METHOD = "kv_tier_read"


@dataclass(frozen=True)
class TierPeer:
    """An engine replica whose offload tier the router found a prompt's prefix in."""

    app: str
    deployment: str
    replica: str

    @classmethod
    def from_hint(cls, hint: object) -> TierPeer | None:
        """The peer a `kv_tier_peer` hint names, or None for anything that is not a well-formed hint."""
        if not isinstance(hint, dict):
            return None
        values = [hint.get(key) for key in ("app", "deployment", "replica")]
        if not all(is_short_printable(v) for v in values):
            return None
        return cls(*values)

    def as_hint(self) -> dict[str, str]:
        return {"app": self.app, "deployment": self.deployment, "replica": self.replica}


# (peer, tier namespace, hashes, auth) -> the peer's answer (`read_tier_blocks`: hash -> per rank bytes)
TierReadCall = Callable[[TierPeer, str, list[bytes], TierReadAuth], Awaitable[Any]]


async def serve_tier_read(peer: TierPeer, namespace: str, hashes: list[bytes], auth: TierReadAuth) -> Any:
    """`kv_tier_read` on the peer replica, through a handle to its deployment (pinned by the router)."""
    from ray import serve

    handle = serve.get_deployment_handle(peer.deployment, peer.app)
    response = handle.options(method_name=TIER_READ_METHOD).remote(namespace, hashes, auth, replica=peer.replica)
    try:
        return await response
    except asyncio.CancelledError:
        response.cancel()
        raise


# Why a fetch failed (the `reason` label of /metrics' kv_offload_remote_fetch_failures):
TIMEOUT = "timeout"  # no answer within timeout_s
REFUSED = "refused"  # the peer refused the signed read (another KV secret, a stale or replayed signature)
PEER_GONE = "peer_gone"  # the peer replica (or its actor) is gone
ERROR = "error"  # anything else the call raised
FETCH_FAILURE_REASONS = (TIMEOUT, REFUSED, PEER_GONE, ERROR)


def failure_reason(exc: BaseException) -> str:
    """The reason a peer call failed, from its exception (a remote error wrapped by Ray or Serve is an
    instance of its cause's class too, and names the cause)."""
    cause = getattr(exc, "cause", None)
    for candidate in (exc, cause) if isinstance(cause, BaseException) else (exc,):
        if isinstance(candidate, (asyncio.TimeoutError, TimeoutError)):
            return TIMEOUT
        if isinstance(candidate, TierReadAuthError):
            return REFUSED
        if isinstance(candidate, (RayActorError, ConnectionError)):
            return PEER_GONE
    return ERROR


@dataclass
class TierFetchStats:
    fetches: int = 0  # fetches that asked a peer
    fetched_blocks: int = 0  # blocks placed in this node's tier
    failures: int = 0  # timed out, refused, the peer gone
    failures_by_reason: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FETCH_FAILURE_REASONS, 0))

    def failed(self, reason: str) -> None:
        self.failures += 1
        self.failures_by_reason[reason] = self.failures_by_reason.get(reason, 0) + 1


@dataclass
class TierFetcher:
    """One engine's fetches from its peers' tiers. `tier`: the engine's offload scheduler (its `location`,
    `block_bytes`, `adopt`); `secret`: the deployment's KV secret."""

    tier: Any
    secret: bytes
    timeout_s: float = DEFAULT_TIER_FETCH_TIMEOUT_S
    call: TierReadCall = serve_tier_read
    stats: TierFetchStats = field(default_factory=TierFetchStats)

    async def fetch(self, peer: TierPeer, hashes: list[bytes]) -> int:
        """Fetch the blocks of `hashes` (a prompt's chain) that this node's tier lacks from `peer`; returns
        how many were placed and adopted. Never raises for the peer's sake: the engine recomputes instead."""
        location = self.tier.location
        if self.tier.capacity_blocks <= 0:
            return 0  # (a tier of no blocks would own nothing it placed)
        wanted = [h for h in hashes if not location.on_node(h)][:MAX_TIER_READ_BLOCKS]
        if not wanted:
            return 0
        namespace = location.namespace.name
        self.stats.fetches += 1
        auth = sign_tier_read(self.secret, namespace, peer.replica, wanted)
        try:
            blocks = await asyncio.wait_for(self.call(peer, namespace, wanted, auth), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - timed out, refused, gone: the engine computes the prefix
            reason = failure_reason(exc)
            self.stats.failed(reason)
            logger.warning("KV offload: fetching %d blocks from replica %s's tier failed (%s; they are recomputed): "
                           "%s: %s", len(wanted), peer.replica, reason, exc.__class__.__name__, exc)
            return 0
        installed = await asyncio.to_thread(install_tier_blocks, location, wanted, blocks,
                                            block_file_limit(self.tier.block_bytes))
        self.tier.adopt(installed)
        self.stats.fetched_blocks += len(installed)
        return len(installed)


def fetch_failures(fetcher: TierFetcher | None, has_tier: bool) -> dict[str, int]:
    """An engine's failed fetches by reason, as its stats report them: zeros before its first fetch, {}
    without an offload tier."""
    if fetcher is not None:
        return dict(fetcher.stats.failures_by_reason)
    return dict.fromkeys(FETCH_FAILURE_REASONS, 0) if has_tier else {}


def tier_secret(kv_transfer_config: dict | str | None, app_secret: SecretStr | None) -> bytes:
    """The secret an engine replica's tier reads are signed and checked with: its kv_transfer_config's
    kv_secret, else the app's (`app.build_app`: one per app unless the operator set
    PAGEDSERVE_KV_SECRET[_FILE]), else that variable or this process's own (kv_transfer/auth.resolve_secret)."""
    from pagedserve.kv_transfer.auth import resolve_secret
    from pagedserve.kv_transfer.config import parse_kv_transfer_config

    config = parse_kv_transfer_config(kv_transfer_config) if kv_transfer_config else None
    if config is not None and config.kv_secret is not None:
        return config.secret()
    return resolve_secret(app_secret.get_secret_value() if app_secret is not None else None)
