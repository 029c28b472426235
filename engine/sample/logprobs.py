"""Logprob entries, built with batched tensor ops and one host transfer per call."""

from __future__ import annotations

import torch

# (token_id, logprob, rank); rank is 1-based among the whole vocabulary.
Logprob = tuple[int, float, int]


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[list[Logprob]]:
    """[chosen token] + top-`num_top[r]` (id, logprob, rank) per row of a [R, V] logprob tensor.

    The chosen token's rank is its competition rank (1 + the number of strictly more likely tokens);
    the top entries are ranked 1..n in order. Ids, ranks and logprobs travel to the host together as
    one float64 tensor (exact for ids and ranks below 2**53, and for float32 logprobs).
    """
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.long).unsqueeze(1)
    chosen = logprobs.gather(1, token_ids)
    ranks = (logprobs > chosen).sum(dim=-1, keepdim=True) + 1
    k = min(max(num_top, default=0), logprobs.shape[1])
    columns = [token_ids.double(), chosen.double(), ranks.double()]
    if k:
        top_vals, top_ids = logprobs.topk(k, dim=-1)
        columns += [top_ids.double(), top_vals.double()]
    table = torch.cat(columns, dim=1).tolist()
    result: list[list[Logprob]] = []
    for row, n in zip(table, num_top):
        entries: list[Logprob] = [(int(row[0]), row[1], int(row[2]))]
        n = min(n, k)
        if n:
            entries.extend(zip(map(int, row[3 : 3 + n]), row[3 + k : 3 + k + n], range(1, n + 1)))
        result.append(entries)
    return result


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, num_top: int) -> list[list[Logprob]]:
    """Logprobs of each prompt token given its prefix: logits [P, V] at positions 0..P-1
    predicting target_ids [P] (the next prompt token); same entry format as the sampler."""
    if logits.dim() != 2 or target_ids.dim() != 1 or target_ids.shape[0] != logits.shape[0]:
        raise ValueError(
            f"logits must be [P, V] and target_ids [P]; got {tuple(logits.shape)} and {tuple(target_ids.shape)}"
        )
    if num_top < 0:
        raise ValueError(f"prompt_logprobs must be >= 0, got {num_top}")
    if logits.shape[0] == 0:
        return []
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return gather_logprobs(logprobs, target_ids, [num_top] * logits.shape[0])
