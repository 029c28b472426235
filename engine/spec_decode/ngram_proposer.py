"""Prompt-lookup (ngram) drafts: continue the request's text the way it went before.

For the longest n in [min_n, max_n] whose last-n-tokens n-gram occurs earlier in the request's own
tokens (prompt + output), propose the tokens that followed that earlier occurrence. Of several earlier
occurrences of that longest n-gram the EARLIEST is used, as in vLLM's proposer (its KMP matcher keeps
the first position among matches of equal length). An occurrence may overlap the suffix itself
(e.g. in a run of one repeated token), so a repeating pattern keeps proposing its own continuation.

The search is vectorized: one comparison of the whole context with the last token gives the candidate
end positions, and each longer n only filters the surviving candidates (one numpy op per n, never a
Python loop over the context).
"""

from __future__ import annotations

import numpy as np

__all__ = ["NgramProposer"]


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n} max_n={max_n}")
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: np.ndarray, max_tokens: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_tokens) draft tokens for one request ([] if no match).

        `max_tokens` is what the request may still take this step (its remaining output budget / room
        before max_model_len); the proposal is also cut short by the end of the context."""
        limit = min(self.num_speculative_tokens, max_tokens)
        tokens = np.asarray(token_ids)
        if tokens.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tokens.shape}")
        num = tokens.shape[0]
        if limit <= 0 or num < self.min_n + 1:
            return []
        # Candidate END positions e (< num - 1, so the suffix itself is never a candidate) of an earlier
        # occurrence of the last-n-tokens n-gram; n grows while candidates survive.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        best_end, best_n = -1, 0
        if ends.size:
            best_end, best_n = int(ends[0]), 1
        for k in range(1, min(self.max_n, num - 1)):
            ends = ends[ends >= k]
            ends = ends[tokens[ends - k] == tokens[num - 1 - k]]
            if not ends.size:
                break
            best_end, best_n = int(ends[0]), k + 1  # ends are sorted: [0] is the earliest occurrence
        if best_n < self.min_n:
            return []
        start = best_end + 1
        return tokens[start:start + limit].tolist()

    def propose_batch(self, token_id_lists: list[np.ndarray], max_tokens: list[int]) -> list[list[int]]:
        """`propose` for each request of a step."""
        if len(token_id_lists) != len(max_tokens):
            raise ValueError(f"{len(token_id_lists)} token lists but {len(max_tokens)} max_tokens")
        return [self.propose(tokens, limit) for tokens, limit in zip(token_id_lists, max_tokens)]
