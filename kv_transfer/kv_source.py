"""The producer side of a read: one rank's paged KV cache, read out as (layer, tokens, heads).

A read names the producer's blocks of one finished prompt (from its kv_transfer_params), a token
range, layers and a head range; the rank gathers those tokens out of its blocks. The producer's
scheduler keeps those blocks allocated until the reader releases them or the hold times out, so a
read never races a reuse of the blocks as long as it arrives before `expires_at`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.kv_transfer.layout import KVLayout


# Revoked holds a rank remembers; older ones are refused by their expiry time instead.
MAX_REMEMBERED_REVOCATIONS = 65536


@dataclass(frozen=True)
class ReadSpec:
    """What one consumer rank asks of one producer rank for one request."""

    remote_request_id: str
    block_ids: tuple[int, ...]  # the producer's blocks of the request, in order
    token_start: int
    token_end: int
    layers: tuple[int, ...]  # global layer indices, ascending
    head_start: int  # global KV heads [head_start, head_end)
    head_end: int
    expires_at: float = float("inf")  # wall clock (time.time()) after which the blocks may be reused

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start


class KVSource:
    """One producer rank's KV cache, readable by consumers through a transport."""

    def __init__(self, layout: KVLayout, rank: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.layout = layout
        self.rank = rank
        self.kv_caches = kv_caches
        self.layers = layout.layers_of(rank)
        self.heads = layout.heads_of(rank)
        # Called with a request id when a reader releases it (an in-process producer's scheduler).
        self.release_sink: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        self.bytes_served = 0
        # Holds the producer has freed (most recent last): their blocks may be reused, reads are refused.
        self._revoked: OrderedDict[str, None] = OrderedDict()

    def revoke(self, request_ids: list[str]) -> None:
        with self._lock:
            for rid in request_ids:
                self._revoked[rid] = None
            while len(self._revoked) > MAX_REMEMBERED_REVOCATIONS:  # older ones are long past their expiry
                self._revoked.popitem(last=False)

    def slots(self, spec: ReadSpec) -> torch.Tensor:
        bs = self.layout.block_size
        pos = torch.arange(spec.token_start, spec.token_end)
        blocks = torch.tensor(spec.block_ids, dtype=torch.long)
        if len(spec.block_ids) * bs < spec.token_end:
            raise ValueError(f"read of request {spec.remote_request_id}: tokens up to {spec.token_end} but only "
                             f"{len(spec.block_ids)} blocks of {bs}")
        return blocks[pos // bs] * bs + pos % bs

    def read_layer(self, spec: ReadSpec, layer: int, slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` for the spec's tokens and heads: two [tokens, heads, head_size] tensors."""
        if time.time() > spec.expires_at:
            raise TimeoutError(f"read of request {spec.remote_request_id}: its hold expired; the blocks may be reused")
        if spec.remote_request_id in self._revoked:
            raise LookupError(f"read of request {spec.remote_request_id}: its hold was released; the blocks may be "
                              "reused")
        if layer not in self.layers:
            raise ValueError(f"layer {layer} is not on producer rank {self.rank} (it holds {self.layers})")
        if spec.head_start < self.heads.start or spec.head_end > self.heads.stop:
            raise ValueError(f"heads [{spec.head_start}, {spec.head_end}) are not on producer rank {self.rank} "
                             f"(it holds {self.heads})")
        if slots is None:
            slots = self.slots(spec)
        key_cache, value_cache = self.kv_caches[layer - self.layers.start]
        h0, h1 = spec.head_start - self.heads.start, spec.head_end - self.heads.start
        slots = slots.to(key_cache.device)
        k = key_cache.flatten(0, 1).index_select(0, slots)[:, h0:h1].contiguous()
        v = value_cache.flatten(0, 1).index_select(0, slots)[:, h0:h1].contiguous()
        with self._lock:
            self.bytes_served += 2 * k.numel() * k.element_size()
        return k, v

    def release(self, remote_request_id: str) -> None:
        sink = self.release_sink
        if sink is not None:
            sink(remote_request_id)
