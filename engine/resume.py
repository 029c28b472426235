"""Resuming a request another engine started: the parameters of its continuation.

A request migrates between engines (cluster/serve/migration.py) as its prompt, the output tokens the
earlier engine already emitted, and its original sampling parameters. The new engine takes those
tokens as output it generated itself, exactly as a request preempted and recomputed does: they count
toward max_tokens and min_tokens and into the penalties, a seeded generator skips one draw per token
(`SamplingState.pending_draws`), a structured-output grammar accepts them before the first new token
(`StructuredOutputRequest.replay_token_ids`), and the detokenizer is primed with them so that stop
strings are matched across the seam and the stream carries only what follows
(`OutputProcessor.add_request(prefilled_output_ids=...)`). Logprobs and the stream's token ids cover
only the new tokens; `cumulative_logprob` starts again from 0 (the caller adds what it had).

Greedy and seeded requests go on with the very tokens an uninterrupted run gives (up to the float
differences between computing a position in a prefill or in a decode step, which a preempted request
sees as well). A completion of an `n > 1` request continues on its own, as the n == 1 request the
engine ran it as (`SamplingParams.child`: its own seed).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.engine.sampling_params import SamplingParams


def resume_params(params: SamplingParams, emitted_token_ids: Sequence[int], index: int = 0) -> SamplingParams:
    """The params that continue completion `index` of a request sampled with `params` after the output
    tokens `emitted_token_ids` (n == 1; prompt logprobs, already reported, are not asked again)."""
    child = params.child(index) if params.n > 1 else params.model_copy()
    return child.model_copy(update={"resume_output_token_ids": [int(t) for t in emitted_token_ids] or None,
                                    "prompt_logprobs": None})
