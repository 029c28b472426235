"""Build the two halves of an engine's KV connector: the prefill/decode connector of its `kv_transfer_config`,
the offload tier of its `kv_offload_size` (`OffloadSpec`), or both side by side."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker
from pagedserve.kv_transfer.config import KVTransferConfig, parse_kv_transfer_config
from pagedserve.kv_transfer.layout import KVLayout
from pagedserve.kv_transfer.scheduler_connector import PDConnectorScheduler
from pagedserve.kv_transfer.worker_connector import PDConnectorWorker

# A spill waiting for the writer holds host memory: at most this share of the tier's size (and this floor).
STAGING_SHARE = 0.25
MIN_STAGING_BYTES = 64 * 1024**2


@dataclass(frozen=True)
class OffloadSpec:
    """An engine's offload tier: whose KV it holds (the model's identity), its size per rank, its directory."""

    model_identity: str
    size_bytes: int
    offload_dir: str | None = None


def make_worker_connector(kv_transfer_config: dict[str, Any] | KVTransferConfig | None, layout: KVLayout, rank: int,
                          device: torch.device, offload: OffloadSpec | None = None) -> KVConnectorWorker:
    transfer = None
    if kv_transfer_config is not None:
        transfer = PDConnectorWorker(parse_kv_transfer_config(kv_transfer_config), layout, rank, device)
    if offload is None:
        assert transfer is not None, "neither a kv_transfer_config nor an offload tier"
        return transfer
    from pagedserve.kv_transfer.offload.tier_files import tier_location
    from pagedserve.kv_transfer.offload.worker_side import OffloadConnectorWorker

    staging = max(MIN_STAGING_BYTES, int(offload.size_bytes * STAGING_SHARE))
    tier = OffloadConnectorWorker(tier_location(offload.model_identity, layout, offload.offload_dir), layout, rank,
                                  device, max_staged_bytes=staging)
    if transfer is None:
        return tier
    from pagedserve.kv_transfer.offload.stacked import StackedConnectorWorker

    return StackedConnectorWorker(transfer, tier)


def make_scheduler_connector(kv_transfer_config: dict[str, Any] | KVTransferConfig | None, layout: KVLayout,
                             addresses: list[Any], offload: OffloadSpec | None = None,
                             block_hashes: Callable[[Any], list[bytes]] | None = None) -> KVConnectorScheduler:
    """`block_hashes(request)`: the request's full-block prefix-cache hashes (needed with `offload`)."""
    transfer = None
    if kv_transfer_config is not None:
        transfer = PDConnectorScheduler(parse_kv_transfer_config(kv_transfer_config), layout, layout.block_size)
        transfer.addresses = list(addresses)
    if offload is None:
        assert transfer is not None, "neither a kv_transfer_config nor an offload tier"
        return transfer
    from pagedserve.kv_transfer.offload.scheduler_side import OffloadConnectorScheduler
    from pagedserve.kv_transfer.offload.tier_files import block_bytes, tier_location

    assert block_hashes is not None, "an offload tier looks prefixes up by their block hashes"
    per_rank = [block_bytes(layout, rank) for rank in range(layout.world_size)]
    tier = OffloadConnectorScheduler(tier_location(offload.model_identity, layout, offload.offload_dir),
                                     layout.block_size, offload.size_bytes // max(per_rank), sum(per_rank),
                                     block_hashes)
    if transfer is None:
        return tier
    from pagedserve.kv_transfer.offload.stacked import StackedConnectorScheduler

    return StackedConnectorScheduler(transfer, tier)
