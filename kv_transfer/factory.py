"""Build the two halves of an engine's KV connector from its `kv_transfer_config`."""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.kv_transfer.config import KVTransferConfig, parse_kv_transfer_config
from pagedserve.kv_transfer.layout import KVLayout
from pagedserve.kv_transfer.scheduler_connector import PDConnectorScheduler
from pagedserve.kv_transfer.worker_connector import PDConnectorWorker


def make_worker_connector(kv_transfer_config: dict[str, Any] | KVTransferConfig, layout: KVLayout, rank: int,
                          device: torch.device) -> PDConnectorWorker:
    return PDConnectorWorker(parse_kv_transfer_config(kv_transfer_config), layout, rank, device)


def make_scheduler_connector(kv_transfer_config: dict[str, Any] | KVTransferConfig, layout: KVLayout,
                             addresses: list[Any]) -> PDConnectorScheduler:
    connector = PDConnectorScheduler(parse_kv_transfer_config(kv_transfer_config), layout, layout.block_size)
    connector.addresses = list(addresses)
    return connector
