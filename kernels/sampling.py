"""Entry points: greedy token choice, and top-k / top-p / min-p logits masking with per-row parameters."""

from __future__ import annotations

import torch

from pagedserve.kernels._validate import check_dim
from pagedserve.kernels.torch_impl.sampling import apply_top_k_top_p_min_p_torch, greedy_argmax_cpu


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """Set removed logits to -inf: top-k, then top-p over what is left, then min-p. Keeps >= 1 token per row.

    top_k <= 0 or >= vocab disables top-k for that row; top_p == 1.0 and min_p == 0.0 disable theirs; None
    disables a filter for every row.
    """
    check_dim("logits", logits, 2)
    for name, param in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        if param is not None:
            check_dim(name, param, 1)
            if param.shape[0] != logits.shape[0]:
                raise ValueError(f"{name} length {param.shape[0]} != logits batch {logits.shape[0]}")
    if logits.is_cuda:
        from pagedserve.kernels.triton.sampling import apply_top_k_top_p_min_p_triton

        return apply_top_k_top_p_min_p_triton(logits, top_k, top_p, min_p)
    return apply_top_k_top_p_min_p_torch(logits, top_k, top_p, min_p)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest value over the last dim: `argmax(dim=-1)`'s answer (the first index
    among equal maxima; a NaN counts as the largest), for logits of any float dtype, without widening
    bf16 / fp16 logits first. On CPU one compiled op where it built (else `max(dim=-1).indices`)."""
    if logits.is_cuda:
        return logits.argmax(dim=-1)
    return greedy_argmax_cpu(logits)
