"""Per-step attention metadata: what the attention layers need to read and write the paged KV cache.

The model runner builds one `AttentionMetadata` per forward pass. The flat batch of
tokens is ordered with all decode sequences (query length 1) first, then the
prefill chunks, so the attention layer can send `[:num_decode_tokens]` to the
paged decode kernel and the rest to the varlen prefill kernel.

KV cache layout (per layer, one tensor for K and one for V):
    [num_blocks, block_size, num_kv_heads, head_size]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    # [num_tokens] int64: flat slot (block_id * block_size + offset) for each new token's K/V; -1 = skip.
    slot_mapping: torch.Tensor
    # [num_seqs + 1] int32: start of each sequence's query tokens in the flat batch.
    query_start_loc: torch.Tensor
    # [num_seqs] int32: context length of each sequence after this step (cached prefix + new tokens).
    seq_lens: torch.Tensor
    # [num_seqs, max_num_blocks] int32: physical block ids of each sequence (padded with 0).
    block_tables: torch.Tensor
    num_decodes: int  # sequences with query length 1, placed first
    num_decode_tokens: int  # == num_decodes
    max_query_len: int
    max_seq_len: int
    # Python copies of the above (avoid device syncs in CPU kernels that loop over sequences).
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_prefills(self) -> int:
        return self.num_seqs - self.num_decodes
