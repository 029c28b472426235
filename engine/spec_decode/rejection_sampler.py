"""Verify draft tokens against the target model so the output follows the target's distribution exactly.

Both proposers (ngram, greedy draft model) propose deterministically, so a draft is a point mass q = onehot(d)
and speculative sampling (Leviathan et al. 2023; Chen et al. 2023) reduces to: at position j, with the
target's distribution p_j (after temperature, top-k, top-p, min-p) and the draft token d = d_{j+1},

    accept d with probability p_j(d); on the first rejection emit a token from
    norm(max(p_j - onehot(d), 0)) = p_j with d removed, renormalized, and stop;
    when all m drafts are accepted, emit a bonus token from p_m.

Greedy rows accept while argmax(logits_j) == d_{j+1} and then emit the argmax at the first mismatch (or the
bonus argmax): the same tokens plain greedy decoding gives.

Sampling a token uses the exponential race of `engine/sample/sampler.py` (argmax of p / Exp(1) noise, exactly
a draw from p normalized; the residual needs no renormalization). A random row whose draft list is empty
therefore draws exactly what the plain sampler draws: one [V] row of Exp(1) noise.

Randomness, in a fixed order so that results are reproducible:
  * a seeded row (`SpecRow.generator`) draws ONLY from its own generator: first m uniforms (one per draft,
    all m even when an early draft is rejected), then one [V] row of Exp(1) noise for its emitted token.
    Its result does not depend on the other rows of the batch;
  * unseeded random rows draw from `shared_generator` (the default generator when None): first one batch
    of uniforms for all their drafts (rows in order, drafts in order), then one [rows, V] block of noise;
  * greedy rows draw nothing.

All positions are processed in batched ops (one filter + softmax over every random row's positions, one
gather of the draft probabilities, one residual/bonus race); only the per-row bookkeeping is Python, and the
results cross to the host in one transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.kernels import apply_top_k_top_p_min_p, greedy_argmax

__all__ = ["SpecResult", "SpecRow", "rejection_sample"]

# Exponential noise of exactly 0 would turn a zero probability into NaN (0/0).
_MIN_NOISE = 1e-20


@dataclass
class SpecRow:
    """One request's drafts and sampling parameters for one verification step."""

    draft_token_ids: list[int]  # m >= 0 proposed tokens
    greedy: bool
    temperature: float = 1.0  # > 0 for random rows
    top_k: int = 0  # <= 0 or >= vocab: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    generator: torch.Generator | None = None  # a seeded request's own generator (on the logits' device)


@dataclass
class SpecResult:
    accepted_token_ids: list[int]  # the accepted drafts (a prefix of draft_token_ids)
    next_token_id: int  # the target's token after them (correction or bonus)

    @property
    def token_ids(self) -> list[int]:
        """Every token this step emits for the request."""
        return [*self.accepted_token_ids, self.next_token_id]


def rejection_sample(
    logits: torch.Tensor, rows: list[SpecRow], shared_generator: torch.Generator | None = None
) -> list[SpecResult]:
    """Verify every row's drafts. `logits` is [sum(1 + m_i), V]: row i owns 1 + m_i consecutive rows (the
    target's logits at positions 0..m_i), rows in order. Processors (penalties, bias, grammar masks) are the
    caller's to apply beforehand; temperature and top-k/top-p/min-p are applied here."""
    counts = _validate(logits, rows)
    if not rows:
        return []
    device, vocab = logits.device, logits.shape[1]
    num_rows = len(rows)
    max_m = int(counts.max())
    starts = np.zeros(num_rows, dtype=np.int64)
    np.cumsum(counts[:-1] + 1, out=starts[1:])
    # [R, M] drafts (0-padded) and where they are real; [R, M+1] logits row of each position (clamped to
    # the bonus position past m, so padded entries point at a real row).
    drafts_np = np.zeros((num_rows, max_m), dtype=np.int64)
    valid_np = np.arange(max_m)[None, :] < counts[:, None]
    for i, row in enumerate(rows):
        drafts_np[i, : counts[i]] = row.draft_token_ids
    positions_np = starts[:, None] + np.minimum(np.arange(max_m + 1)[None, :], counts[:, None])
    greedy_np = np.fromiter((row.greedy for row in rows), dtype=bool, count=num_rows)

    drafts = _tensor(drafts_np, device)
    valid = _tensor(valid_np, device)
    positions = _tensor(positions_np, device)
    accept = torch.zeros(num_rows, max_m, dtype=torch.bool, device=device)
    next_tokens = torch.zeros(num_rows, dtype=torch.long, device=device)

    greedy_rows = np.flatnonzero(greedy_np)
    random_rows = np.flatnonzero(~greedy_np)
    if greedy_rows.size:
        g_index = _tensor(greedy_rows, device)
        if random_rows.size:  # argmax only over the logits rows the greedy requests own
            own = _tensor(_owned_positions(greedy_rows, counts, starts), device)
            top_all = torch.zeros(logits.shape[0], dtype=torch.long, device=device)
            top_all[own] = greedy_argmax(logits[own])
        else:
            top_all = greedy_argmax(logits)
        top = top_all[positions[g_index]]  # [G, M+1]
        accept[g_index] = top[:, :max_m] == drafts[g_index]
    if random_rows.size:
        r_index = _tensor(random_rows, device)
        probs, local_pos = _target_probs(logits, rows, random_rows, counts, starts, device)  # [Tr, V], [Rr, M+1]
        uniforms, noise = _draw(rows, random_rows, counts, max_m, vocab, device, shared_generator)
        if max_m:
            # p_j(d_{j+1}) for every (row, draft): one elementwise gather, no [Rr, M, V] copy.
            draft_probs = probs[local_pos[:, :max_m].reshape(-1), drafts[r_index].reshape(-1)].view(-1, max_m)
            # u in [0, 1): u < p accepts with probability p (never when p = 0, always when p = 1).
            accept[r_index] = uniforms < draft_probs

    accept &= valid
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1) if max_m else torch.zeros_like(next_tokens)
    if greedy_rows.size:
        emitted = num_accepted[g_index].unsqueeze(1)
        next_tokens[g_index] = top.gather(1, emitted).squeeze(1)
    if random_rows.size:
        n_acc = num_accepted[r_index]
        dist = probs[local_pos.gather(1, n_acc.unsqueeze(1)).squeeze(1)]  # [Rr, V] (a copy)
        rejected = n_acc < _tensor(counts[random_rows], device)
        if max_m:
            # Residual for a rejected draft: remove it from p (the point-mass draft's max(p - q, 0)).
            rejected_token = drafts[r_index].gather(1, n_acc.clamp(max=max_m - 1).unsqueeze(1))
            kept = dist.gather(1, rejected_token) * (~rejected).unsqueeze(1)
            residual = dist.scatter(1, rejected_token, kept)
            # All of p on the rejected draft (only by rounding): fall back to p rather than race over zeros.
            dist = torch.where((residual.sum(dim=1, keepdim=True) > 0), residual, dist)
        next_tokens[r_index] = greedy_argmax(dist.div_(noise))

    host = torch.stack([num_accepted, next_tokens]).tolist()
    return [
        SpecResult(accepted_token_ids=list(row.draft_token_ids[:n]), next_token_id=int(tok))
        for row, n, tok in zip(rows, host[0], host[1])
    ]


def _validate(logits: torch.Tensor, rows: list[SpecRow]) -> np.ndarray:
    """The rows' draft counts; ValueError for inconsistent input."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [positions, vocab], got shape {tuple(logits.shape)}")
    counts = np.fromiter((len(row.draft_token_ids) for row in rows), dtype=np.int64, count=len(rows))
    expected = int(counts.sum()) + len(rows)
    if logits.shape[0] != expected:
        raise ValueError(f"logits has {logits.shape[0]} rows but the {len(rows)} requests' 1 + drafts need {expected}")
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        if any(not 0 <= t < vocab for t in row.draft_token_ids):
            raise ValueError(f"row {i}: draft token ids must be in [0, {vocab}), got {row.draft_token_ids}")
        if not row.greedy and not row.temperature > 0:
            raise ValueError(f"row {i}: a random row needs temperature > 0, got {row.temperature}")
        if row.generator is not None and row.generator.device.type != logits.device.type:
            raise ValueError(f"row {i}: its generator is on {row.generator.device}, the logits on {logits.device}")
    return counts


def _owned_positions(which: np.ndarray, counts: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The logits rows (all 1 + m_i of them, in order) that the rows `which` own."""
    sizes = counts[which] + 1
    local_starts = np.cumsum(sizes) - sizes
    return np.repeat(starts[which] - local_starts, sizes) + np.arange(int(sizes.sum()))


def _target_probs(
    logits: torch.Tensor,
    rows: list[SpecRow],
    random_rows: np.ndarray,
    counts: np.ndarray,
    starts: np.ndarray,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """p at every position of the random rows ([Tr, V], float32) and, per random row, the index into it of
    each position ([Rr, M+1], clamped to the bonus position)."""
    sizes = counts[random_rows] + 1
    flat = _owned_positions(random_rows, counts, starts)
    local_starts = np.zeros(len(random_rows), dtype=np.int64)
    np.cumsum(sizes[:-1], out=local_starts[1:])
    max_m = int(counts.max())
    local_pos = local_starts[:, None] + np.minimum(np.arange(max_m + 1)[None, :], counts[random_rows][:, None])

    picked = [rows[i] for i in random_rows.tolist()]
    temps = np.repeat(np.asarray([r.temperature for r in picked], dtype=np.float32), sizes)
    top_k = np.repeat(np.asarray([r.top_k for r in picked], dtype=np.int32), sizes)
    top_p = np.repeat(np.asarray([r.top_p for r in picked], dtype=np.float32), sizes)
    min_p = np.repeat(np.asarray([r.min_p for r in picked], dtype=np.float32), sizes)
    vocab = logits.shape[1]

    x = logits[_tensor(flat, device)].to(torch.float32)
    if (temps != 1.0).any():
        x = x / _tensor(temps, device).unsqueeze(1)
    k_on, p_on, m_on = ((top_k > 0) & (top_k < vocab)).any(), (top_p < 1.0).any(), (min_p > 0.0).any()
    if k_on or p_on or m_on:
        x = apply_top_k_top_p_min_p(
            x,
            _tensor(top_k, device) if k_on else None,
            _tensor(top_p, device) if p_on else None,
            _tensor(min_p, device) if m_on else None,
        )
    return torch.softmax(x, dim=-1), _tensor(local_pos, device)


def _draw(
    rows: list[SpecRow],
    random_rows: np.ndarray,
    counts: np.ndarray,
    max_m: int,
    vocab: int,
    device: torch.device,
    shared_generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[Rr, M] uniforms (padding: 1.0, never accepted) and [Rr, V] Exp(1) noise, in the documented order."""
    uniforms = torch.ones(len(random_rows), max_m, device=device)
    noise = torch.empty(len(random_rows), vocab, device=device)
    seeded = np.fromiter((rows[i].generator is not None for i in random_rows.tolist()), dtype=bool,
                         count=len(random_rows))
    shared = np.flatnonzero(~seeded)
    if shared.size:
        m_shared = counts[random_rows[shared]]
        total = int(m_shared.sum())
        if total:
            draw = torch.rand(total, device=device, generator=shared_generator)
            mask = np.zeros((len(random_rows), max_m), dtype=bool)
            mask[shared] = np.arange(max_m)[None, :] < m_shared[:, None]
            uniforms[_tensor(mask, device)] = draw  # row-major: rows in order, drafts in order
        block = torch.empty(len(shared), vocab, device=device).exponential_(generator=shared_generator)
        if shared.size == len(random_rows):
            noise = block
        else:
            noise[_tensor(shared, device)] = block
    for k in np.flatnonzero(seeded).tolist():
        row = rows[int(random_rows[k])]
        m = len(row.draft_token_ids)
        if m:
            uniforms[k, :m] = torch.rand(m, device=device, generator=row.generator)
        noise[k].exponential_(generator=row.generator)  # one contiguous [V] row, as the plain sampler draws it
    return uniforms, noise.clamp_(min=_MIN_NOISE)


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)
