"""Top-k / top-p / min-p masking on CUDA: thresholds from a few sorted candidates, one masking pass.

Every filter keeps the tokens at or above one per-row threshold (ties at a threshold are kept, the
most likely token always survives; the semantics are the torch twin's, kernels.torch_impl.sampling):

1. One small host read: how many sorted candidates each row needs (k for top-k rows, the whole
   vocabulary for top-p rows without top-k). It decides the shapes below; the caller's top_k is
   usually host data anyway (the sampler uploads it from numpy).
2. Rows with top-k on and k <= TOPK_CANDIDATES: torch.topk with K = the largest such k returns the
   K largest logits, sorted. The k-th is the top-k threshold; the top-p cut is computed over those
   K candidates only, with the softmax normaliser (the mass of every token >= the k-th, ties past
   position K included) from one Triton pass over the row (_masked_exp_sum_kernel).
3. Rows with top-p on and top-k off or k > TOPK_CANDIDATES: a full sort of those rows only, then
   the twin's math on the sorted row.
4. One Triton masking pass (_mask_kernel): keep x >= threshold and, with min-p, exp(x - max) >=
   min_p (prob >= min_p * max prob; the row max is its first read pass when min-p is on).

Passes over the vocabulary per row (reads of V floats; the old kernel made ~66 with two 32-step
bisections): top-k only: topk's radix select (a fixed number of digit passes, independent of k and
the data) + 1 masking read + 1 write; top-k and top-p: the same + 1 normaliser pass; top-p without
top-k: one segmented sort of the row + 1 masking read + 1 write; min-p adds 1 read (the row max).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Largest k served by torch.topk; rows with a larger k (and top-p) are sorted whole.
TOPK_CANDIDATES = 1024


@triton.jit
def _masked_exp_sum_kernel(logits_ptr, rows_ptr, kth_ptr, max_ptr, out_ptr, vocab, stride_l, BLOCK: tl.constexpr):
    """out[i] = sum over the row rows[i] of exp(x - max[i]) where x >= kth[i] (the top-k survivors)."""
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    kth = tl.load(kth_ptr + i)
    row_max = tl.load(max_ptr + i)
    m_safe = tl.where(row_max == float("-inf"), 0.0, row_max)
    cols = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        x = tl.load(logits_ptr + row * stride_l + start + cols, mask=start + cols < vocab, other=float("-inf"))
        total += tl.where(x >= kth, tl.exp(x - m_safe), 0.0)
    tl.store(out_ptr + i, tl.sum(total, axis=0))


@triton.jit
def _mask_kernel(
    logits_ptr, out_ptr, thr_ptr, min_p_ptr, vocab, stride_l, stride_o,
    HAS_MIN_P: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_l
    cols = tl.arange(0, BLOCK)
    thr = tl.load(thr_ptr + row)
    min_ratio = 0.0
    row_max = 0.0
    if HAS_MIN_P:
        min_ratio = tl.load(min_p_ptr + row).to(tl.float32)
        running = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, vocab, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf"))
            running = tl.maximum(running, x)
        row_max = tl.max(running, axis=0)
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # an all -inf row stays as it is
    for start in range(0, vocab, BLOCK):
        mask = start + cols < vocab
        x = tl.load(base + start + cols, mask=mask, other=float("-inf"))
        keep = x >= thr
        if HAS_MIN_P:
            keep = keep & (tl.exp(x - row_max) >= min_ratio)  # always true for min_p == 0
        tl.store(out_ptr + row * stride_o + start + cols, tl.where(keep, x, float("-inf")), mask=mask)


def _top_p_threshold(
    cand: torch.Tensor, kth: torch.Tensor, p: torch.Tensor, norm: torch.Tensor | None
) -> torch.Tensor:
    """cand [n, K] sorted descending, kth [n, 1]: the top-p threshold (-inf where top-p is off).

    norm [n, 1] is the softmax normaliser over every token >= kth relative to cand[:, :1]; None when
    cand holds the whole row (then the softmax runs over cand itself, as the twin does).
    """
    masked = cand.masked_fill(cand < kth, float("-inf"))
    if norm is None:
        probs = torch.softmax(masked, dim=-1)
    else:
        head = cand[:, :1]
        probs = torch.exp(masked - torch.where(head == float("-inf"), 0.0, head)) / norm
    mass_before = torch.cumsum(probs, dim=-1) - probs
    # Past the K candidates the twin's sorted row holds only ties at kth or -inf, so a cut there
    # would give the same threshold as the K-th candidate: counting over the candidates is exact.
    num_keep = (mass_before < p).sum(dim=-1, keepdim=True).clamp_(min=1)
    threshold = masked.gather(1, num_keep - 1)
    return torch.where(p >= 1.0, float("-inf"), threshold)


def _row_thresholds(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, block: int
) -> torch.Tensor:
    """Per-row threshold [batch] fp32: keep logits >= it (top-k then top-p); -inf where both are off."""
    batch, vocab = logits.shape
    device = logits.device
    thr = torch.full((batch,), float("-inf"), dtype=torch.float32, device=device)
    k = (top_k.to(device=device, dtype=torch.int64) if top_k is not None
         else torch.zeros(batch, dtype=torch.int64, device=device))
    k_on = (k > 0) & (k < vocab)
    p = (top_p.to(device=device, dtype=torch.float32) if top_p is not None
         else torch.ones(batch, dtype=torch.float32, device=device))
    p_on = p < 1.0
    need = torch.where(k_on, k, torch.where(p_on, vocab, 0))
    # The one host read: candidate counts (they set the shapes below) and which rows run top-p.
    need_host, p_on_host = torch.stack([need, p_on.to(torch.int64)]).tolist()
    small = [r for r, n in enumerate(need_host) if 0 < n <= TOPK_CANDIDATES and n < vocab]
    full = [r for r, n in enumerate(need_host) if n > TOPK_CANDIDATES or (n == vocab and n > 0)]
    if small:
        rows = torch.tensor(small, dtype=torch.int64, device=device)
        num = max(need_host[r] for r in small)
        source = logits if len(small) == batch else logits.index_select(0, rows)  # no copy when all rows
        cand = torch.topk(source, num, dim=-1, sorted=True).values
        kth = cand.gather(1, k[rows].unsqueeze(1) - 1)
        threshold = kth
        if any(p_on_host[r] for r in small):
            norm = torch.empty(len(small), dtype=torch.float32, device=device)
            _masked_exp_sum_kernel[(len(small),)](
                logits, rows, kth.reshape(-1).contiguous(), cand[:, 0].contiguous(), norm, vocab, logits.stride(0),
                BLOCK=min(block, triton.next_power_of_2(vocab)),
            )
            threshold = torch.maximum(kth, _top_p_threshold(cand, kth, p[rows].unsqueeze(1), norm.unsqueeze(1)))
        thr.index_copy_(0, rows, threshold.reshape(-1))
    if full:
        rows = torch.tensor(full, dtype=torch.int64, device=device)
        cand = (logits if len(full) == batch else logits.index_select(0, rows)).sort(dim=-1, descending=True).values
        k_full = torch.where(k_on[rows], k[rows], vocab).unsqueeze(1)
        kth = cand.gather(1, k_full - 1)
        threshold = torch.maximum(kth, _top_p_threshold(cand, kth, p[rows].unsqueeze(1), None))
        thr.index_copy_(0, rows, threshold.reshape(-1))
    return thr


def apply_top_k_top_p_min_p_triton(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    block: int = 1024,
) -> torch.Tensor:
    batch, vocab = logits.shape
    logits = logits.float().contiguous()
    if batch == 0 or (top_k is None and top_p is None and min_p is None):
        return logits.clone()
    if top_k is not None or top_p is not None:
        thr = _row_thresholds(logits, top_k, top_p, block)
    else:
        thr = torch.full((batch,), float("-inf"), dtype=torch.float32, device=logits.device)
    out = torch.empty_like(logits)
    _mask_kernel[(batch,)](
        logits, out, thr, min_p if min_p is not None else thr, vocab, logits.stride(0), out.stride(0),
        HAS_MIN_P=min_p is not None, BLOCK=min(block, triton.next_power_of_2(vocab)),
    )
    return out
