"""The scheduler's half of speculative decoding: which decodes speculate, with how many tokens, and how
a verified step's tokens land on the request.

A speculating decode is scheduled for 1 + k tokens (its last token and k drafts: budget and KV slots
are counted for all of them); after the step its `num_computed_tokens` is rewound to the positions
the target verified, so rejected drafts' slots are simply written again by the next step. Prefix-cache
hashes only ever cover a request's verified tokens (the KV cache manager hashes known tokens only).
"""

from __future__ import annotations

from pagedserve.engine.core.request import Request
from pagedserve.engine.sampling_params import SamplingParams


def speculation_allowed(params: SamplingParams, structured: bool) -> bool:
    """Whether a request's next tokens may be speculated. The verifier applies temperature, top-k,
    top-p, min-p, allowed_token_ids, logit_bias and min_tokens at every position and reports each
    emitted token's logprobs; parameters whose effect depends on the tokens sampled before each
    position (penalties, bad words, grammars) decode one token per step, exactly as without speculation."""
    return not (
        structured
        or params.bad_words
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    )


def num_spec_tokens(request: Request, k: int, budget: int, max_model_len: int) -> int:
    """Drafts a decode request may verify this step: at most k, within the token budget (its own token
    comes first), and never past max_tokens or max_model_len (every accepted token is emitted)."""
    if k <= 0 or request.num_tokens - request.num_computed_tokens != 1:
        return 0
    if not speculation_allowed(request.sampling_params, request.structured_output is not None):
        return 0
    room = min(
        budget - 1,
        request.max_tokens - request.num_output_tokens - 1,
        max_model_len - request.num_tokens - 1,
    )
    return max(0, min(k, room))
