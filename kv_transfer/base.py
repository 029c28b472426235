"""The KV connector API (docs/architecture.md, "Disaggregated prefill / decode").

A connector has two halves. The scheduler half runs in the engine core and decides
how many of a request's prompt tokens can be loaded from elsewhere instead of being
computed, and what to keep for a reader when a request finishes. The worker half
runs next to the model and moves the KV of individual layers: it starts loading
before the forward pass and each attention layer waits for its own layer. Nothing
is pushed: a reader pulls a producer's KV from blocks the producer holds for it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch


class ConnectorRequest(Protocol):
    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int


class KVConnectorScheduler(ABC):
    """Scheduler-side half: decisions about which tokens' KV comes from (or goes to) elsewhere."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> int:
        """Prompt tokens beyond `num_computed_tokens` (local prefix hits) whose KV can be loaded externally."""

    @abstractmethod
    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int) -> None:
        """Called once blocks are allocated for a request that will load `num_external_tokens` tokens."""

    @abstractmethod
    def build_connector_metadata(self) -> Any:
        """What the worker half needs this step (which blocks to load and save); attached to the scheduler output."""

    @abstractmethod
    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> bool:
        """A request finished. Return True to keep its blocks alive until the transfer completes."""

    # Lifetime and bookkeeping (defaults suit a connector that never holds or loads anything).

    def request_added(self, request: ConnectorRequest) -> None:
        """A request entered the scheduler (before it is first scheduled)."""

    @property
    def has_pending_releases(self) -> bool:
        """Releases (or hold grants) wait for the next step's metadata: the engine must step once more even
        if idle."""
        return False

    def take_freeable(self) -> list[ConnectorRequest]:
        """Requests kept alive by `request_finished` that may be freed now (released or expired)."""
        return []

    @property
    def has_held(self) -> bool:
        return False

    def release(self, holds: list[tuple[str, str]]) -> None:
        """Readers are done with these holds, each named by (hold id, hold token) (thread-safe)."""

    def load_finished(self, req_id: str, ok: bool) -> None:
        """The step that loaded `req_id` came back."""

    def mark_load_failed(self, request: ConnectorRequest) -> None:
        """A load failed: the request will compute its prompt locally."""

    def add_worker_stats(self, loaded_bytes: int, seconds: float) -> None:
        """What the workers moved in one step."""

    def external_tokens_are_cached(self, request: ConnectorRequest) -> bool:
        """Whether the request's external tokens count as prefix-cache hits (a reload from an offload tier does;
        a prefill/decode pull does not)."""
        return False

    def snapshot_stats(self) -> Any:
        """Prefill/decode transfer counters (kv_transfer.scheduler_connector.KVTransferStats), or None."""
        return None

    def snapshot_offload_stats(self) -> Any:
        """Offload tier counters (kv_transfer.offload.scheduler_side.OffloadStats), or None without a tier."""
        return None


class KVConnectorWorker(ABC):
    """Worker-side half: moves the KV of individual layers around the forward pass."""

    @abstractmethod
    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The worker's paged KV cache, one (key_cache, value_cache) pair per local layer."""

    @abstractmethod
    def start_load_kv(self, metadata: Any) -> None:
        """Begin loading external KV for this step (may be asynchronous)."""

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Block until layer `layer_idx`'s external KV is in the paged cache."""

    def finish_loads(self) -> tuple[set[str], int, float]:
        """After the forward pass: (requests whose load failed here, bytes loaded, seconds spent)."""
        return set(), 0, 0.0
