"""The scheduler half of the prefill/decode connector (every transport shares it).

Producer (prefill engine): a request sent with `kv_transfer_params={"do_remote_decode": True}` that
finishes normally keeps its blocks under a hold (kv_transfer/holds.py); its output's kv_transfer_params
tell a reader where they are and let it in (engine id, hold id, the hold's token, KV layout, the
addresses of the producer's ranks, when the hold expires). Every producer rank is granted the hold:
an in-process rank at once, the others with the next step's metadata (the engine steps once more for
it). The blocks are freed when a reader releases the hold with its token or the hold times out; the
ranks then forget it (revocations ride on the next step's metadata).

Consumer (decode engine): a request sent with those params (plus `"do_remote_prefill": True`) loads
the prompt's KV instead of computing it - all but the last prompt token, which is computed here to
produce the first token's logits, so every output token (and every sampling rule) is the
consumer's own. Only what the consumer's prefix cache does not already hold is loaded. A load that
fails makes the scheduler recompute the prompt locally (`mark_load_failed`).
"""

from __future__ import annotations

import hmac
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pagedserve.kv_transfer.base import ConnectorRequest, KVConnectorScheduler
from pagedserve.kv_transfer.config import KVTransferConfig
from pagedserve.kv_transfer.holds import HoldGrant, RateLimitedLog, hash_token, hold_id_for, new_hold_token, shown
from pagedserve.kv_transfer.kv_source import KVSource
from pagedserve.kv_transfer.layout import KVLayout, check_compatible

logger = logging.getLogger(__name__)

# A consumer does not start a read this close to the producer's hold expiry: it recomputes instead.
EXPIRY_MARGIN_S = 1.0


@dataclass
class LoadJob:
    """Load tokens [token_start, token_end) of a request's prompt into the consumer's blocks."""

    req_id: str
    block_ids: list[int]  # the consumer's blocks of the request (logical order)
    token_start: int
    token_end: int
    remote: dict[str, Any]  # the producer's kv_transfer_params


@dataclass
class ConnectorMetadata:
    loads: list[LoadJob] = field(default_factory=list)
    # (producer addresses, hold id, hold token): holds this consumer's readers are done with.
    releases: list[tuple[list[Any], str, str]] = field(default_factory=list)
    # Producer: holds issued since the last step, for the ranks outside the scheduler's process.
    registered: list[HoldGrant] = field(default_factory=list)
    # Producer: holds freed since the last step; the ranks refuse reads of them from now on (their blocks
    # may be reused by this very step). Applied after `registered`.
    revoked: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.loads and not self.releases and not self.registered and not self.revoked


@dataclass
class KVTransferStats:
    """Cumulative connector counters (engine stats, `pagedserve:kv_transfer_*` metrics)."""

    loads: int = 0  # requests whose prompt KV was loaded
    loaded_tokens: int = 0
    loaded_blocks: int = 0  # consumer blocks written (full or partial)
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    load_failures: int = 0
    fallbacks: int = 0  # requests that computed their prompt locally instead (failure, expiry, mismatch)
    held_requests: int = 0  # producer: requests whose blocks wait for a reader (gauge)
    held_blocks: int = 0  # gauge
    expired_holds: int = 0  # producer: holds freed by the timeout instead of a release
    refused_releases: int = 0  # producer: releases of a held hold without its token (ignored)


@dataclass
class _Held:
    """Producer: a finished request whose blocks wait for a reader."""

    request: ConnectorRequest
    num_blocks: int
    deadline: float
    token_hash: bytes


def _remote_params(request: ConnectorRequest) -> dict[str, Any] | None:
    return getattr(request.sampling_params, "kv_transfer_params", None)


class PDConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, layout: KVLayout, block_size: int) -> None:
        self.config = config
        self.layout = layout
        self.block_size = block_size
        self.hold_timeout_s = config.kv_connector_extra_config.hold_timeout_s
        self.addresses: list[Any] = []  # this engine's ranks (set once the KV cache exists)
        self.stats = KVTransferStats()
        self._loads: list[LoadJob] = []
        self._releases: list[tuple[list[Any], str, str]] = []
        self._in_load: dict[str, LoadJob] = {}
        # Consumer: one producer hold may feed several local requests (the n children of one request);
        # it is released once the last of them has loaded (or fallen back, or finished). Keyed by
        # (producer engine id, hold id, hold token).
        self._readers: dict[tuple[str, str, str], int] = {}
        self._reader_of: dict[str, tuple[str, str, str, list[Any]]] = {}
        # Producer: hold id -> its request and hold; releases (hold id, token) arrive from any thread.
        self._held: dict[str, _Held] = {}
        self._released: deque[tuple[object, object]] = deque()
        self._registrations: list[HoldGrant] = []
        self._revoked: list[str] = []
        self._hold_ids = itertools.count()
        self._lock = threading.Lock()
        # Producer ranks in this process: granted holds at once (and their readers' releases come here).
        self._local_sources: list[KVSource] = []
        self._refusal_log = RateLimitedLog(logger)

    # ------------------------------------------------------------------ consumer

    def request_added(self, request: ConnectorRequest) -> None:
        """Count the request as a reader of its producer's hold (before any of the readers is scheduled)."""
        params = _remote_params(request)
        if not self.config.is_consumer or not params or not params.get("do_remote_prefill"):
            return
        try:
            key = (str(params["remote_engine_id"]), str(params["remote_request_id"]), str(params["remote_hold_token"]))
            addresses = list(params["remote_addresses"])
        except (KeyError, TypeError):
            return  # unusable params: get_num_new_matched_tokens falls back and there is no hold to release
        self._readers[key] = self._readers.get(key, 0) + 1
        self._reader_of[request.request_id] = (*key, addresses)

    def _reader_done(self, req_id: str) -> None:
        entry = self._reader_of.pop(req_id, None)
        if entry is None:
            return
        engine_id, remote_id, token, addresses = entry
        key = (engine_id, remote_id, token)
        self._readers[key] -= 1
        if self._readers[key] == 0:
            del self._readers[key]
            self._releases.append((addresses, remote_id, token))

    @property
    def has_pending_releases(self) -> bool:
        """Releases (consumer) or hold grants (producer) wait for the next step's metadata."""
        return bool(self._releases) or bool(self._registrations)

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> int:
        params = _remote_params(request)
        if not self.config.is_consumer or not params or not params.get("do_remote_prefill"):
            return 0
        if getattr(request, "kv_load_failed", False):
            return 0
        prompt_len = len(request.prompt_token_ids)
        reason = None
        try:
            check_compatible(self.layout, KVLayout.from_dict(params["remote_layout"]))
            if not isinstance(params.get("remote_hold_token"), str):
                reason = "no remote_hold_token (the producer's hold token)"
            elif int(params["remote_num_tokens"]) != prompt_len:
                reason = f"the producer holds {params['remote_num_tokens']} tokens, the prompt has {prompt_len}"
            elif time.time() > float(params["expires_at"]) - EXPIRY_MARGIN_S:
                reason = "the producer's hold has expired"
        except (KeyError, TypeError, ValueError) as exc:
            reason = f"unusable kv_transfer_params: {exc}"
        if reason is not None:
            logger.warning("request %s computes its prompt here: %s", request.request_id, reason)
            self._fall_back(request)
            return 0
        # Every known token but the last has KV to load (a continuation's last token is the producer's
        # output token, whose KV nobody has computed yet); never more than the producer holds.
        return max(0, min(prompt_len, request.num_tokens - 1) - num_computed_tokens)

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int) -> None:
        params = _remote_params(request)
        if not self.config.is_consumer or not params or not params.get("do_remote_prefill"):
            return
        if getattr(request, "kv_load_failed", False) or getattr(request, "kv_load_done", False):
            return
        request.kv_load_done = True  # a resumed (preempted) request recomputes; it never loads twice
        if num_external_tokens == 0:  # our prefix cache had it all: nothing to read
            self._reader_done(request.request_id)
            return
        start = request.num_computed_tokens
        job = LoadJob(request.request_id, list(block_ids), start, start + num_external_tokens, params)
        self._loads.append(job)
        self._in_load[request.request_id] = job

    def build_connector_metadata(self) -> ConnectorMetadata:
        with self._lock:
            registered, self._registrations = self._registrations, []
        md = ConnectorMetadata(self._loads, self._releases, registered, self._revoked)
        self._loads, self._releases, self._revoked = [], [], []
        return md

    def load_finished(self, req_id: str, ok: bool) -> None:
        """The step that loaded this request came back (`ok`: every rank loaded every layer)."""
        job = self._in_load.pop(req_id, None)
        if job is None:
            return
        self._reader_done(req_id)
        if ok:
            self.stats.loads += 1
            self.stats.loaded_tokens += job.token_end - job.token_start
            bs = self.block_size
            self.stats.loaded_blocks += (job.token_end - 1) // bs - job.token_start // bs + 1
        else:
            self.stats.load_failures += 1

    def _fall_back(self, request: ConnectorRequest) -> None:
        request.kv_load_failed = True
        self.stats.fallbacks += 1
        self._reader_done(request.request_id)

    def mark_load_failed(self, request: ConnectorRequest) -> None:
        """The load failed on some rank: the request recomputes its prompt (the caller requeues it)."""
        self.load_finished(request.request_id, ok=False)
        request.kv_load_failed = True
        self.stats.fallbacks += 1

    def add_worker_stats(self, loaded_bytes: int, seconds: float) -> None:
        self.stats.loaded_bytes += loaded_bytes
        self.stats.load_seconds += seconds

    # ------------------------------------------------------------------ producer

    def attach_local_source(self, source: KVSource) -> None:
        """A producer rank in this process: grant it holds directly and take its readers' releases."""
        self._local_sources.append(source)
        source.release_sink = self.release

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> bool:
        if self._in_load.pop(request.request_id, None) is not None:
            self.stats.load_failures += 1  # finished (aborted, failed) before its load came back
        self._reader_done(request.request_id)  # e.g. aborted while waiting: it reads nothing more
        params = _remote_params(request)
        status = getattr(request, "status", None)
        finished_ok = status is not None and status.finish_reason in ("stop", "length")
        if not self.config.is_producer or not params or not params.get("do_remote_decode") or not block_ids:
            return False
        if not finished_ok:
            return False
        deadline = time.time() + self.hold_timeout_s
        token = new_hold_token()
        num_tokens = len(request.prompt_token_ids)
        with self._lock:
            # The hold's own id (a client may reuse request ids; a revoked hold must never match a new one).
            hold_id = hold_id_for(request.request_id, next(self._hold_ids))
            grant = HoldGrant(hold_id, hash_token(token), tuple(block_ids), num_tokens, deadline)
            self._held[hold_id] = _Held(request, len(block_ids), deadline, grant.token_hash)
            for source in self._local_sources:  # before the output (and so the token) leaves this engine
                source.register([grant])
            if len(self._local_sources) < self.layout.world_size:
                self._registrations.append(grant)
        request.kv_transfer_params_out = {
            "do_remote_prefill": True,
            "remote_engine_id": self.config.engine_id,
            "remote_request_id": hold_id,
            "remote_hold_token": token,
            "remote_num_tokens": num_tokens,
            "remote_output_token_ids": list(getattr(request, "output_token_ids", [])),
            "remote_layout": self.layout.to_dict(),
            "remote_addresses": list(self.addresses),
            "kv_connector": self.config.kv_connector,
            "expires_at": deadline,
        }
        return True

    def release(self, holds: list[tuple[str, str]]) -> None:
        """A reader is done with these holds, each named by (hold id, hold token) (thread-safe; checked and
        freed at the next `take_freeable`; a release without the hold's token is ignored)."""
        self._released.extend(holds)

    def _release_ok(self, hold_id: object, token: object) -> bool:
        entry = self._held.get(hold_id) if isinstance(hold_id, str) else None
        if entry is None:  # gone already (a reader and the router both release), or never was
            self._refusal_log.debug("ignored a release of hold %s: no such hold", shown(hold_id))
            return False
        if isinstance(token, str) and hmac.compare_digest(hash_token(token), entry.token_hash):
            return True
        self.stats.refused_releases += 1
        self._refusal_log.debug("ignored a release of hold %s: not its token", shown(hold_id))
        return False

    def take_freeable(self) -> list[ConnectorRequest]:
        """Held requests whose reader released them or whose hold expired: the caller frees their blocks."""
        now = time.time()
        out = []
        with self._lock:
            while self._released:
                try:
                    hold_id, token = self._released.popleft()
                except (TypeError, ValueError):  # not a (hold id, token) pair
                    hold_id = token = None
                if self._release_ok(hold_id, token):
                    out.append(self._held.pop(hold_id).request)
                    self._revoked.append(hold_id)
            for hold_id in [h for h, held in self._held.items() if held.deadline <= now]:
                out.append(self._held.pop(hold_id).request)
                self._revoked.append(hold_id)
                self.stats.expired_holds += 1
                logger.warning("hold %s: no reader released its KV within %.0f s; freeing its blocks",
                               shown(hold_id), self.hold_timeout_s)
        return out

    @property
    def has_held(self) -> bool:
        return bool(self._held)

    def snapshot_stats(self) -> KVTransferStats:
        with self._lock:
            self.stats.held_requests = len(self._held)
            self.stats.held_blocks = sum(held.num_blocks for held in self._held.values())
        return KVTransferStats(**vars(self.stats))
