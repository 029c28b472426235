"""The logits processors as batched tensor ops over a `BatchView`.

Each processor runs once over all of its rows (in the order the sampler's docstring gives:
allowed_token_ids, logit_bias, min_tokens, bad_words, repetition penalty, frequency/presence
penalties), which is the same as running them row by row since no processor reads another row.
Only bad_words does Python work per row, and only for rows that have bad words (a word's last
token is banned when its earlier tokens end the output so far: a walk of the request's trie).

A row may carry tokens beyond its request's output (`extra`): a speculating request's verified
position j is processed as if its output already held its first j drafts, so min_tokens counts them,
bad words match against them and the penalties count them; several rows then share one request.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedserve.engine.failures import describe_failure
from pagedserve.engine.sample.sampling_batch import I_MIN_TOKENS, BatchView, SamplingBatch, check_ids

_NEG_INF = float("-inf")


def apply_processors(
    logits: torch.Tensor,
    batch: SamplingBatch,
    view: BatchView,
    errors: dict[int, str],
    extra: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """The processed logits (a copy; `logits` itself when no row needs a processor). Rows already in
    `errors` are skipped where skipping saves work; a bad_words row that raises joins `errors`.
    `extra[r]`: tokens row r sees after its request's output (see the module docstring)."""
    if not view.needs_processing:
        return logits
    states = view.states
    min_rows = [
        r for r in view.min_rows
        if len(states[r].output_token_ids) + (len(extra[r]) if extra else 0) < view.i[r, I_MIN_TOKENS]
    ]
    bad = _bad_word_bans(view, errors, logits.shape[1], extra)
    if view.allowed is None and view.bias is None and view.penalties is None and not min_rows and not bad[0]:
        return logits
    out = logits.clone()
    if view.allowed is not None:
        rows, disallowed = view.allowed
        out[rows] = out[rows].masked_fill_(disallowed, _NEG_INF)
    if view.bias is not None:
        rows, ids, values = view.bias
        out.index_put_((rows, ids), values, accumulate=True)
    if min_rows:
        ids = batch.stop_ids(view, min_rows)
        rows = torch.tensor(min_rows, dtype=torch.long).to(out.device, non_blocking=True)
        out[rows.unsqueeze(1).expand_as(ids), ids] = _NEG_INF
    if bad[0]:
        index = torch.tensor(bad, dtype=torch.long).to(out.device, non_blocking=True)
        out[index[0], index[1]] = _NEG_INF
    if view.penalties is not None:
        _apply_penalties(out, batch, view, extra)
    return out


def _bad_word_bans(
    view: BatchView, errors: dict[int, str], vocab: int, extra: Sequence[Sequence[int]] | None
) -> tuple[list[int], list[int]]:
    """(rows, token ids) to ban for the rows with bad words; a row whose banned ids fall outside the
    vocabulary fails alone."""
    rows: list[int] = []
    ids: list[int] = []
    for r in view.bad_rows:
        if r in errors:
            continue
        state = view.states[r]
        try:
            banned = state.bad_words_trie.banned(state.output_token_ids, extra[r] if extra else ())
            check_ids(banned, vocab, "bad_words")
        except Exception as exc:
            errors[r] = describe_failure(exc)
            continue
        rows.extend([r] * len(banned))
        ids.extend(banned)
    return rows, ids


def _apply_penalties(
    logits: torch.Tensor, batch: SamplingBatch, view: BatchView, extra: Sequence[Sequence[int]] | None
) -> None:
    """HF repetition penalty over prompt + output tokens, then the OpenAI frequency / presence
    penalties over output tokens, from the persistent counts (plus each row's extra tokens). A kind
    of penalty no row uses is skipped (its formula would leave every row as it is)."""
    rows, pool_rows, rep, freq, pres, use_rep, use_openai = view.penalties
    seen_pool, counts_pool = batch.counts()
    counts = counts_pool[pool_rows]  # (a copy: the extra tokens never reach the persistent counts)
    if extra:
        index = [(k, t) for k, r in enumerate(view.pen_rows) for t in extra[r]]
        if index:
            at = torch.tensor(index, dtype=torch.long).T.to(counts.device, non_blocking=True)
            counts.index_put_((at[0], at[1]), torch.ones((), device=counts.device), accumulate=True)
    present = counts > 0
    x = logits[rows]
    if use_rep:
        seen = present | seen_pool[pool_rows]
        penalized = torch.where(x > 0, x / rep, x * rep)
        x = torch.where(seen & (rep != 1.0), penalized, x)
    if use_openai:
        x = x - freq * counts - pres * present.to(x.dtype)
    logits[rows] = x
