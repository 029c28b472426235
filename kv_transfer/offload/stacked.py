"""A prefill/decode connector and the offload tier side by side, as one connector for the scheduler and one
for each worker. A request loads from at most one of them: a prefill/decode consumer request from its
producer (the tier then holds nothing it lacks), any other request from the tier."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve.kv_transfer.base import ConnectorRequest, KVConnectorScheduler, KVConnectorWorker
from pagedserve.kv_transfer.offload.scheduler_side import OffloadConnectorScheduler, OffloadMetadata
from pagedserve.kv_transfer.offload.worker_side import OffloadConnectorWorker


@dataclass
class StackedMetadata:
    transfer: Any  # the prefill/decode connector's ConnectorMetadata
    offload: OffloadMetadata
    loads: list = field(default_factory=list)  # both connectors' loads (the scheduler accounts them together)

    @property
    def is_empty(self) -> bool:
        return self.transfer.is_empty and self.offload.is_empty


class StackedConnectorScheduler(KVConnectorScheduler):
    def __init__(self, transfer: KVConnectorScheduler, offload: OffloadConnectorScheduler) -> None:
        self.transfer = transfer
        self.offload = offload
        self._last_had_transfer_loads = False
        self._source: dict[str, str] = {}  # this step's lookups: which connector a request loads from

    def __getattr__(self, name: str) -> Any:  # the PD connector's own API (addresses, attach_local_source, ...)
        return getattr(self.__dict__["transfer"], name)

    def request_added(self, request: ConnectorRequest) -> None:
        self.transfer.request_added(request)

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> int:
        remote = self.transfer.get_num_new_matched_tokens(request, num_computed_tokens)
        if remote:
            self._source[request.request_id] = "transfer"
            return remote
        tier = self.offload.get_num_new_matched_tokens(request, num_computed_tokens)
        if tier:
            self._source[request.request_id] = "offload"
        return tier

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int) -> None:
        source = self._source.pop(request.request_id, None)
        self.transfer.update_state_after_alloc(request, block_ids, num_external_tokens if source == "transfer" else 0)
        self.offload.update_state_after_alloc(request, block_ids, num_external_tokens if source == "offload" else 0)

    def build_connector_metadata(self) -> StackedMetadata:
        transfer, offload = self.transfer.build_connector_metadata(), self.offload.build_connector_metadata()
        self._last_had_transfer_loads = bool(transfer.loads)
        self._source.clear()
        return StackedMetadata(transfer, offload, [*transfer.loads, *offload.loads])

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> bool:
        self.offload.request_finished(request, block_ids)
        return self.transfer.request_finished(request, block_ids)

    @property
    def has_pending_releases(self) -> bool:
        return self.transfer.has_pending_releases

    def take_freeable(self) -> list[ConnectorRequest]:
        return self.transfer.take_freeable()

    @property
    def has_held(self) -> bool:
        return self.transfer.has_held

    def release(self, holds: list[tuple[str, str]]) -> None:
        self.transfer.release(holds)

    def load_finished(self, req_id: str, ok: bool) -> None:
        self.transfer.load_finished(req_id, ok)
        self.offload.load_finished(req_id, ok)

    def mark_load_failed(self, request: ConnectorRequest) -> None:
        if self.offload.is_loading(request.request_id):
            self.offload.mark_load_failed(request)
        else:
            self.transfer.mark_load_failed(request)

    def add_worker_stats(self, loaded_bytes: int, seconds: float) -> None:
        # One figure for the step's loads of both: it goes to the PD connector when it loaded this step.
        (self.transfer if self._last_had_transfer_loads else self.offload).add_worker_stats(loaded_bytes, seconds)

    def external_tokens_are_cached(self, request: ConnectorRequest) -> bool:
        return self.offload.external_tokens_are_cached(request)

    def block_evicted(self, block_id: int, block_hash: bytes) -> None:
        self.offload.block_evicted(block_id, block_hash)

    def snapshot_stats(self) -> Any:
        return self.transfer.snapshot_stats()

    def snapshot_offload_stats(self) -> Any:
        return self.offload.snapshot_offload_stats()


class StackedConnectorWorker(KVConnectorWorker):
    def __init__(self, transfer: KVConnectorWorker, offload: OffloadConnectorWorker) -> None:
        self.transfer = transfer
        self.offload = offload

    def __getattr__(self, name: str) -> Any:  # source, address, transport (rank reads, kv_transfer_info)
        return getattr(self.__dict__["transfer"], name)

    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.transfer.register_kv_caches(kv_caches)
        self.offload.register_kv_caches(kv_caches)

    def start_load_kv(self, metadata: StackedMetadata | None) -> None:
        self.transfer.start_load_kv(None if metadata is None else metadata.transfer)
        self.offload.start_load_kv(None if metadata is None else metadata.offload)

    def wait_for_layer_load(self, layer_idx: int) -> None:
        self.transfer.wait_for_layer_load(layer_idx)
        self.offload.wait_for_layer_load(layer_idx)

    def finish_loads(self) -> tuple[set[str], int, float]:
        failed, nbytes, seconds = self.transfer.finish_loads()
        failed2, nbytes2, seconds2 = self.offload.finish_loads()
        return failed | failed2, nbytes + nbytes2, max(seconds, seconds2)

    def close(self) -> None:
        self.offload.close()
        self.transfer.close()
