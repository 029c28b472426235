"""Per-step attention metadata: what the attention layers need to read and write the paged KV cache.

The model runner builds one `AttentionMetadata` per forward pass. The flat batch of
tokens is ordered with all decode sequences (query length 1) first, then the
prefill chunks, so the attention layer can send `[:num_decode_tokens]` to the
paged decode kernel and the rest to the varlen prefill kernel.

KV cache layout (per layer, one tensor for K and one for V):
    [num_blocks, block_size, num_kv_heads, head_size]

The metadata checks its own consistency once, when built: the attention layers call the unchecked
kernels (`kernels.paged_decode_attention_unchecked`, ...) with it in every layer.
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

    def __post_init__(self) -> None:
        num_seqs = len(self.seq_lens_cpu)
        for name, ndim, rows in (("slot_mapping", 1, None), ("query_start_loc", 1, num_seqs + 1),
                                 ("seq_lens", 1, num_seqs), ("block_tables", 2, num_seqs)):
            t = getattr(self, name)
            if t.dim() != ndim or (rows is not None and t.shape[0] != rows):
                raise ValueError(f"AttentionMetadata.{name}: shape {tuple(t.shape)} does not fit {num_seqs} sequences")
        if self.seq_lens.dtype != torch.int32 or self.block_tables.dtype != torch.int32:
            raise ValueError(f"AttentionMetadata: seq_lens and block_tables must be int32, got "
                             f"{self.seq_lens.dtype} and {self.block_tables.dtype}")
        if len(self.query_start_loc_cpu) != num_seqs + 1 or not 0 <= self.num_decodes <= num_seqs:
            raise ValueError(f"AttentionMetadata: query_start_loc_cpu ({len(self.query_start_loc_cpu)} entries) and "
                             f"num_decodes ({self.num_decodes}) do not fit {num_seqs} sequences")

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_prefills(self) -> int:
        return self.num_seqs - self.num_decodes
