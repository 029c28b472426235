"""Applying a token bitmask to the logits of the rows that sample a constrained token."""

from __future__ import annotations

import torch
import xgrammar as xgr


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """A copy of `logits` [R, V] where each of `rows` keeps only the tokens its bitmask row allows
    (`bitmask` has one row per entry of `rows`). xgrammar's CUDA kernel on GPU, its CPU path on CPU."""
    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = bitmask.to(torch.int32)
    out = logits.clone()
    xgr.apply_token_bitmask_inplace(
        out, full.to(logits.device, non_blocking=True), vocab_size=logits.shape[1], indices=list(rows)
    )
    return out
