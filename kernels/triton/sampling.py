"""Triton top-k / top-p / min-p masking: one program per row, no sort.

Logits are mapped to int32 keys that order like the floats, and each threshold is found
by a 32-step bisection over the key range with tiled passes over the row:
- top-k: the largest key t with count(key >= t) >= k (the k-th largest logit);
- top-p: the largest key t with mass(kept, key >= t) >= top_p * mass(kept);
- min-p: keep exp(x - max) >= min_p (prob >= min_p * max prob).
Ties at a threshold are kept, matching the torch twin's semantics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ordered_key(x):
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _top_k_top_p_min_p_kernel(
    logits_ptr, out_ptr, top_k_ptr, top_p_ptr, min_p_ptr, vocab, stride_l, stride_o,
    HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_l
    cols = tl.arange(0, BLOCK)

    # Row max (always kept by every filter).
    row_max = tl.full([], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf"))
        row_max = tl.maximum(row_max, tl.max(x, axis=0))

    threshold = tl.full([], -2147483648, tl.int64)  # keep key >= threshold
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + row).to(tl.int64)
        if (k > 0) & (k < vocab):
            lo = tl.full([], -2147483648, tl.int64)  # count(key >= lo) >= k
            hi = tl.full([], 2147483648, tl.int64)  # count(key >= hi) < k
            for _ in range(32):
                mid = lo + (hi - lo) // 2
                count = tl.zeros([], tl.int64)
                for start in range(0, vocab, BLOCK):
                    x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf"))
                    hit = (_ordered_key(x) >= mid) & (start + cols < vocab)
                    count += tl.sum(hit.to(tl.int64), axis=0)
                if count >= k:
                    lo = mid
                else:
                    hi = mid
            threshold = lo

    if HAS_TOP_P:
        p = tl.load(top_p_ptr + row).to(tl.float32)
        if p < 1.0:
            total = tl.zeros([], tl.float32)
            for start in range(0, vocab, BLOCK):
                x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf"))
                kept = _ordered_key(x) >= threshold
                total += tl.sum(tl.where(kept, tl.exp(x - row_max), 0.0), axis=0)
            target = p * total
            lo = threshold  # mass(key >= lo) = total >= target
            hi = tl.full([], 2147483648, tl.int64)
            for _ in range(32):
                mid = lo + (hi - lo) // 2
                mass = tl.zeros([], tl.float32)
                for start in range(0, vocab, BLOCK):
                    x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf"))
                    kept = _ordered_key(x) >= mid
                    mass += tl.sum(tl.where(kept, tl.exp(x - row_max), 0.0), axis=0)
                if mass >= target:
                    lo = mid
                else:
                    hi = mid
            threshold = lo

    min_ratio = 0.0
    if HAS_MIN_P:
        min_ratio = tl.load(min_p_ptr + row).to(tl.float32)

    for start in range(0, vocab, BLOCK):
        mask = start + cols < vocab
        x = tl.load(base + start + cols, mask=mask, other=float("-inf"))
        keep = _ordered_key(x) >= threshold
        if HAS_MIN_P:
            keep = keep & (tl.exp(x - row_max) >= min_ratio)  # always true for min_p == 0
        tl.store(out_ptr + row * stride_o + start + cols, tl.where(keep, x, float("-inf")), mask=mask)


def apply_top_k_top_p_min_p_triton(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    block: int = 1024,
) -> torch.Tensor:
    batch, vocab = logits.shape
    logits = logits.float().contiguous()
    out = torch.empty_like(logits)
    if batch == 0:
        return out
    _top_k_top_p_min_p_kernel[(batch,)](
        logits, out,
        top_k if top_k is not None else logits, top_p if top_p is not None else logits,
        min_p if min_p is not None else logits,
        vocab, logits.stride(0), out.stride(0),
        HAS_TOP_K=top_k is not None, HAS_TOP_P=top_p is not None, HAS_MIN_P=min_p is not None,
        BLOCK=min(block, triton.next_power_of_2(vocab)),
    )
    return out
