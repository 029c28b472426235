"""Attention over the paged KV cache for one layer.

Per forward pass the layer (1) writes the new tokens' K/V into the cache with
``reshape_and_cache``, (2) runs the paged decode kernel on the leading
``num_decode_tokens`` query rows (one per decode sequence) and (3) the varlen
paged prefill kernel on the remaining rows (prefill chunks, possibly on top of a
cached prefix). The layer owns no parameters; projections live in the model.

KV connector seam (disaggregated prefill/decode): when ``kv_hooks`` is given,
``wait_for_layer_load(layer_idx)`` is called before the layer touches its cache
(so KV loaded from a remote prefill instance is in place; connectors pull, so
nothing is pushed after the layer). ``layer_idx`` is this pipeline stage's
LOCAL layer index, i.e. the index into the ``kv_caches`` list the model runner
registered with the connector (global index = model.start_layer + layer_idx).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from pagedserve import kernels
from pagedserve.engine.layers.attention_metadata import AttentionMetadata


class KVLayerHooks(Protocol):
    """Worker-side per-layer calls of a KV connector (see module docstring)."""

    def wait_for_layer_load(self, layer_idx: int) -> None: ...


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        num_kv_heads: int,
        scale: float,
        kv_cache_idx: int,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.kv_cache_idx = kv_cache_idx  # local layer index, reported to kv_hooks
        self.sliding_window = sliding_window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
        kv_hooks: KVLayerHooks | None = None,
    ) -> torch.Tensor:
        """q [T, heads*head_size], k/v [T, kv_heads*head_size] -> [T, heads*head_size]."""
        md = attn_metadata
        num_tokens = q.shape[0]
        key_cache, value_cache = kv_cache
        if kv_hooks is not None:
            kv_hooks.wait_for_layer_load(self.kv_cache_idx)
        query = q.view(num_tokens, self.num_heads, self.head_size)
        key = k.view(num_tokens, self.num_kv_heads, self.head_size)
        value = v.view(num_tokens, self.num_kv_heads, self.head_size)
        kernels.reshape_and_cache_unchecked(
            key,
            value,
            key_cache,
            value_cache,
            md.slot_mapping,
        )
        nd_seqs, nd = md.num_decodes, md.num_decode_tokens
        if nd == num_tokens and md.query_start_loc_cpu[-1] == num_tokens:  # decode only: no output buffer to fill
            out = kernels.paged_decode_attention_unchecked(
                query, key_cache, value_cache, md.block_tables, md.seq_lens, self.scale,
                sliding_window=self.sliding_window, seq_lens_cpu=md.seq_lens_cpu,
            )
            return out.view(num_tokens, self.num_heads * self.head_size)
        out = torch.empty_like(query)
        if nd > 0:
            out[:nd] = kernels.paged_decode_attention_unchecked(
                query[:nd],
                key_cache,
                value_cache,
                md.block_tables[:nd_seqs],
                md.seq_lens[:nd_seqs],
                self.scale,
                sliding_window=self.sliding_window,
                seq_lens_cpu=md.seq_lens_cpu[:nd_seqs],
            )
        end = md.query_start_loc_cpu[-1]
        if end < num_tokens:  # padding rows (no sequence): defined output, never read
            out[end:] = 0
        if end > nd:
            out[nd:end] = kernels.paged_prefill_attention_unchecked(
                query[nd:end],
                key_cache,
                value_cache,
                md.block_tables[nd_seqs:],
                md.query_start_loc[nd_seqs:] - nd,
                md.seq_lens[nd_seqs:],
                self.scale,
                sliding_window=self.sliding_window,
                query_start_loc_cpu=[x - nd for x in md.query_start_loc_cpu[nd_seqs:]],
                seq_lens_cpu=md.seq_lens_cpu[nd_seqs:],
                key=key[nd:end],
                value=value[nd:end],
            )
        return out.view(num_tokens, self.num_heads * self.head_size)
