"""The worker half of the prefill/decode connector: serve this rank's KV, load other engines' KV.

Per step the scheduler's `ConnectorMetadata` lists the loads. `start_load_kv` starts every read at
once (one per producer rank that holds layers/heads this rank needs; each names the producer's hold and
its token, never block ids: the producer reads the hold's own blocks); each attention layer then
waits for its own layer only (`wait_for_layer_load`), so the reads of later layers overlap the
compute of earlier ones. A load that fails anywhere marks its request; the model runner reports it
and the scheduler recomputes the prompt locally. The scheduler half decides when a hold may go (the
last local reader of it has loaded) and sends the release with the next step's metadata; the last
pipeline stage's ranks deliver it to every producer rank (idempotent).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve.kv_transfer.base import KVConnectorWorker
from pagedserve.kv_transfer.config import KVTransferConfig
from pagedserve.kv_transfer.holds import shown
from pagedserve.kv_transfer.kv_source import KVSource, ReadSpec
from pagedserve.kv_transfer.layout import KVLayout, ReadPlan, plan_reads
from pagedserve.kv_transfer.registry import transport_class
from pagedserve.kv_transfer.scheduler_connector import ConnectorMetadata, LoadJob
from pagedserve.kv_transfer.transport import KVTransport, LayerReader

logger = logging.getLogger(__name__)


@dataclass
class _ActiveLoad:
    job: LoadJob
    slots: torch.Tensor  # the consumer's flat slots of the job's tokens
    reads: list[tuple[ReadPlan, LayerReader]] = field(default_factory=list)
    error: str | None = None


class PDConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, layout: KVLayout, rank: int, device: torch.device) -> None:
        self.config = config
        self.layout = layout
        self.rank = rank
        self.device = device
        self.transport: KVTransport = transport_class(config.kv_connector)(config, layout, rank, device)
        self.layers = layout.layers_of(rank)
        # Releases come from the last pipeline stage: when it has run, every earlier stage has read too.
        self.releases_here = rank // layout.tp_size == layout.pp_size - 1
        self.source: KVSource | None = None
        self.address: Any = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._active: list[_ActiveLoad] = []
        self._step_bytes = 0
        self._step_started = 0.0

    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv_caches = kv_caches
        if self.config.is_producer:
            self.source = KVSource(self.layout, self.rank, kv_caches)
            self.address = self.transport.serve(self.source)

    # ------------------------------------------------------------------ loading

    def start_load_kv(self, metadata: ConnectorMetadata | None) -> None:
        self._active = []
        self._step_bytes = 0
        self._step_started = time.perf_counter()
        if metadata is None:
            return
        if self.source is not None:
            if metadata.registered:
                self.source.register(metadata.registered)
            if metadata.revoked:
                self.source.revoke(metadata.revoked)  # before this step's forward pass may reuse their blocks
        for addresses, remote_id, token in metadata.releases:
            self._release(addresses, remote_id, token)
        for job in metadata.loads:
            load = _ActiveLoad(job, self._local_slots(job))
            self._active.append(load)
            remote = job.remote
            try:
                remote_layout = KVLayout.from_dict(remote["remote_layout"])
                for plan in plan_reads(self.layout, self.rank, remote_layout):
                    spec = ReadSpec(
                        remote_request_id=str(remote["remote_request_id"]),
                        hold_token=str(remote["remote_hold_token"]),
                        token_start=job.token_start,
                        token_end=job.token_end,
                        layers=tuple(plan.layers),
                        head_start=plan.heads.start,
                        head_end=plan.heads.stop,
                    )
                    load.reads.append((plan, self.transport.read(remote["remote_addresses"][plan.remote_rank], spec)))
            except Exception as exc:  # noqa: BLE001 - any failure means: compute it locally
                self._fail(load, exc)

    def _local_slots(self, job: LoadJob) -> torch.Tensor:
        bs = self.layout.block_size
        pos = torch.arange(job.token_start, job.token_end)
        blocks = torch.tensor(job.block_ids, dtype=torch.long)
        return (blocks[pos // bs] * bs + pos % bs).to(self.device)

    def wait_for_layer_load(self, layer_idx: int) -> None:
        if not self._active:
            return
        layer = self.layers.start + layer_idx
        key_cache, value_cache = self.kv_caches[layer_idx]
        for load in self._active:
            if load.error is not None:
                continue
            try:
                for plan, reader in load.reads:
                    if layer not in plan.layers:
                        continue
                    k, v = reader.wait_layer(layer)
                    heads = slice(plan.local_head_offset, plan.local_head_offset + len(plan.heads))
                    expected = (len(load.slots), len(plan.heads), self.layout.head_size)
                    if tuple(k.shape) != expected or tuple(v.shape) != expected:
                        raise ValueError(f"layer {layer}: got K {tuple(k.shape)} / V {tuple(v.shape)}, expected {expected}")
                    key_cache.flatten(0, 1)[load.slots, heads] = k.to(key_cache.device, key_cache.dtype)
                    value_cache.flatten(0, 1)[load.slots, heads] = v.to(value_cache.device, value_cache.dtype)
                    self._step_bytes += 2 * k.numel() * k.element_size()
            except Exception as exc:  # noqa: BLE001
                self._fail(load, exc)

    def _fail(self, load: _ActiveLoad, exc: BaseException) -> None:
        load.error = f"{exc.__class__.__name__}: {exc}"
        logger.warning("KV load of request %s failed on rank %d (it will compute its prompt): %s",
                       load.job.req_id, self.rank, load.error)
        for _, reader in load.reads:
            reader.close()

    def finish_loads(self) -> tuple[set[str], int, float]:
        """After the forward pass: (requests whose load failed on this rank, bytes loaded, seconds)."""
        failed = {load.job.req_id for load in self._active if load.error is not None}
        seconds = time.perf_counter() - self._step_started if self._active else 0.0
        self._active = []
        return failed, self._step_bytes, seconds

    def _release(self, addresses: list[Any], remote_request_id: str, hold_token: str) -> None:
        if not self.releases_here:
            return
        for address in addresses:
            try:
                self.transport.release(address, remote_request_id, hold_token)
            except Exception as exc:  # noqa: BLE001 - the producer's timeout frees the blocks anyway
                logger.warning("could not release hold %s at its producer: %s", shown(remote_request_id), exc)

    def close(self) -> None:
        self.transport.close()
