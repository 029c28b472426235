"""The scheduler's half of speculative decoding: which decodes speculate, with how many tokens, and how
a verified step's tokens land on the request.

A speculating decode is scheduled for 1 + k tokens (its last token and k drafts: budget and KV slots
are counted for all of them); after the step its `num_computed_tokens` is rewound to the positions
the target verified, so rejected drafts' slots are simply written again by the next step. Prefix-cache
hashes only ever cover a request's verified tokens (the KV cache manager hashes known tokens only).
"""

from __future__ import annotations

from pagedserve.engine.core.request import Request


def num_spec_tokens(request: Request, k: int, budget: int, max_model_len: int) -> int:
    """Drafts a decode request may verify this step: at most k, within the token budget (its own token
    comes first), and never past max_tokens or max_model_len (every accepted token is emitted)."""
    if k <= 0 or request.num_tokens - request.num_computed_tokens != 1:
        return 0
    if request.structured_output is not None:
        # A grammar would have to advance its matcher over unverified drafts: such requests decode one
        # token per step. Every other sampling parameter is applied at every verified position.
        return 0
    room = min(
        budget - 1,
        request.max_tokens - request.num_output_tokens - 1,
        max_model_len - request.num_tokens - 1,
    )
    return max(0, min(k, room))
