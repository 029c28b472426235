"""Greedy argmax, and top-k / top-p / min-p masking with per-row parameters (torch twins).

Semantics shared with the Triton kernel (ties at a threshold are kept):
- top-k keeps logits >= the k-th largest logit;
- top-p (over the softmax of what top-k left) keeps a token iff the probability
  mass of tokens strictly more likely than it is < top_p;
- min-p keeps tokens with prob >= min_p * max prob.
The most likely token always survives all three.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu.build import cpu_ops_available

_COMPILED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def greedy_argmax_torch(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim through `max(dim=-1).indices`: the same answer, 2-3x faster than `argmax`
    on CPU at a [64, 49152] batch (widening bf16 logits first changes nothing: widening is exact)."""
    return logits.max(dim=-1).indices


def greedy_argmax_cpu(logits: torch.Tensor) -> torch.Tensor:
    """The CPU path: one compiled op (kernels/cpu/sampling.cpp, one vectorised pass a row; ~6-10x the
    twin's speed at decode batch sizes) where it built, else the twin."""
    if logits.dtype in _COMPILED_DTYPES and logits.dim() >= 1 and logits.shape[-1] > 0 and cpu_ops_available():
        return torch.ops.pagedserve.greedy_argmax(logits)
    return greedy_argmax_torch(logits)


def apply_top_k_top_p_min_p_torch(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    batch, vocab = logits.shape
    out = logits.clone()
    if top_k is None and top_p is None and min_p is None:
        return out
    need_sort = top_k is not None or top_p is not None
    if need_sort:
        sorted_logits, _ = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        k = top_k.to(device=logits.device, dtype=torch.int64)
        k = torch.where((k <= 0) | (k >= vocab), torch.full_like(k, vocab), k)
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        out.masked_fill_(out < kth, float("-inf"))
        # The sorted row with the cut applied: entries past position k are removed.
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        p = top_p.to(device=logits.device, dtype=torch.float32).unsqueeze(1)
        sorted_probs = torch.softmax(sorted_logits.float(), dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        num_keep = (mass_before < p).sum(dim=-1, keepdim=True).clamp_(min=1)
        threshold = sorted_logits.gather(1, num_keep - 1)
        threshold = torch.where(p >= 1.0, torch.full_like(threshold, float("-inf")), threshold)
        out.masked_fill_(out < threshold, float("-inf"))
    if min_p is not None:
        mp = min_p.to(device=logits.device, dtype=torch.float32).unsqueeze(1)
        probs = torch.softmax(out.float(), dim=-1)
        max_prob = probs.amax(dim=-1, keepdim=True)
        out.masked_fill_((probs < mp * max_prob) & (mp > 0), float("-inf"))
    return out
