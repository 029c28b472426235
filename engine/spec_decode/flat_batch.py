"""The draft model's forward-pass inputs, built from scratch: a flat, unpadded batch of token ids,
positions and attention metadata.

The draft model reads and writes its own KV cache through the target's block tables; the target's
runner gathers its inputs from the persistent batch instead (worker/input_batch.py, whose tests use
this builder as the reference). Sequences must come decodes first (query length 1), then the longer
chunks: the attention layers send `[:num_decode_tokens]` to the paged decode kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedserve.engine.layers.attention_metadata import AttentionMetadata


def build_flat_inputs(
    token_chunks: Sequence[Sequence[int]],
    start_positions: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Sequence i computes `token_chunks[i]` at positions `start_positions[i]...` into the blocks
    `block_tables[i]` (which must cover every one of those positions)."""
    num_seqs = len(token_chunks)
    q = np.fromiter((len(c) for c in token_chunks), dtype=np.int64, count=num_seqs)
    starts = np.asarray(start_positions, dtype=np.int64)
    cu = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q, out=cu[1:])
    num_tokens = int(cu[-1])
    seq_index = np.repeat(np.arange(num_seqs), q)
    positions = np.arange(num_tokens, dtype=np.int64) - cu[:-1][seq_index] + starts[seq_index]

    max_blocks = max(len(b) for b in block_tables)
    block_table = np.zeros((num_seqs, max_blocks), dtype=np.int32)
    input_ids: list[int] = []
    for i, (chunk, blocks) in enumerate(zip(token_chunks, block_tables)):
        input_ids.extend(chunk)
        block_table[i, : len(blocks)] = blocks
    slot_mapping = (
        block_table[seq_index, positions // block_size].astype(np.int64) * block_size + positions % block_size
    )
    seq_lens = starts + q
    num_decodes = int(np.count_nonzero(q == 1))

    metadata = AttentionMetadata(
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        block_tables=torch.from_numpy(block_table).to(device),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        max_query_len=int(q.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=cu.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
    )
    ids = torch.tensor(input_ids, dtype=torch.long, device=device)
    return ids, torch.from_numpy(positions).to(device), metadata
