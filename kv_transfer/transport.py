"""The transport API: how a producer rank's KV becomes readable and how a consumer rank reads it.

Each worker rank of an engine with a KV connector has one transport. A producer rank `serve`s its
`KVSource` and gets an address (picklable; it travels in the request's kv_transfer_params); a
consumer rank `read`s from an address, layer by layer, and `release`s the request when done. A
transport is set up lazily: nothing connects until the first read from a peer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from pagedserve.kv_transfer.config import KVTransferConfig
from pagedserve.kv_transfer.kv_source import KVSource, ReadSpec
from pagedserve.kv_transfer.layout import KVLayout


class LayerReader(ABC):
    """One read in progress. `wait_layer` is called once per requested layer, in ascending order."""

    @abstractmethod
    def wait_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer`: [tokens, heads, head_size] each (any device; the caller moves them)."""

    def close(self) -> None:
        """Give up the rest of the read (after a failure); must not raise."""


class KVTransport(ABC):
    def __init__(self, config: KVTransferConfig, layout: KVLayout, rank: int, device: torch.device) -> None:
        self.config = config
        self.layout = layout
        self.rank = rank
        self.device = device

    @abstractmethod
    def serve(self, source: KVSource) -> Any:
        """Make `source` readable by consumers; return this rank's address."""

    @abstractmethod
    def read(self, address: Any, spec: ReadSpec) -> LayerReader:
        """Start reading `spec` from the producer rank at `address`; returns at once."""

    @abstractmethod
    def release(self, address: Any, remote_request_id: str, hold_token: str) -> None:
        """Tell the producer rank at `address` that this reader is done with the hold (best effort; the
        producer ignores a release without the hold's token)."""

    def close(self) -> None:
        """Stop serving and drop connections."""
