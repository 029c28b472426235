"""One step's LoRA batch: which flat-batch tokens run under which resident slot, grouped by slot.

The model's LoRA layers share one `LoRAContext`; the runner sets its batch before each forward pass
(None: no token has an adapter, the layers add nothing). Tokens of base-model requests are left out of
the groups entirely: their rows get no delta.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.kernels import LoRASegments


@dataclass
class LoRABatch:
    token_index: torch.Tensor  # [Ta] int64: flat-batch rows of the adapted tokens, grouped by slot
    token_scale: torch.Tensor  # [Ta, 1]: each adapted token's adapter scaling (lora_alpha / r)
    segments: LoRASegments
    # Every row of the flat batch is adapted and already grouped (e.g. one adapter for the whole step): token_index
    # is 0..T-1, so the layers use the rows in place (no gather of x, no scatter into y).
    all_rows_in_order: bool = False


class LoRAContext:
    """The current step's `LoRABatch`, read by every LoRA layer of one model (one per model, never shared)."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


def build_lora_batch(request_slots: np.ndarray, query_lens: np.ndarray, slot_scales: np.ndarray,
                     device: torch.device, dtype: torch.dtype) -> LoRABatch | None:
    """request_slots[i]: the resident slot of sequence i's adapter (-1: the base model); query_lens[i]: its
    tokens this step, in flat-batch order. None when no sequence has an adapter."""
    token_slots = np.repeat(request_slots.astype(np.int64), query_lens)
    adapted = np.flatnonzero(token_slots >= 0)
    if adapted.size == 0:
        return None
    order = adapted[np.argsort(token_slots[adapted], kind="stable")]
    sorted_slots = token_slots[order]
    slots, first, counts = np.unique(sorted_slots, return_index=True, return_counts=True)
    starts = np.append(first, sorted_slots.size).astype(np.int32)
    segments = LoRASegments(
        starts=starts.tolist(), slots=slots.tolist(),
        starts_t=torch.from_numpy(starts).to(device), slots_t=torch.from_numpy(slots.astype(np.int32)).to(device),
        max_len=int(counts.max()),
    )
    scale = torch.from_numpy(slot_scales[sorted_slots].astype(np.float64)).to(device=device, dtype=dtype)
    in_order = order.size == token_slots.size and bool((np.diff(order) == 1).all())
    return LoRABatch(token_index=torch.from_numpy(order).to(device), token_scale=scale.unsqueeze(1),
                     segments=segments, all_rows_in_order=in_order)
