"""When a request's newest token finishes it: EOS, stop token ids, length limits, a finished grammar.

(Stop strings need text and are checked by the output processor.)
"""

from __future__ import annotations

from pagedserve.engine.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> None:
    """Set the request's finished status if its last output token ends it."""
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            return
        if params.stop_token_ids and last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH


def accept_constrained(request: Request, token: int) -> str | None:
    """Advance the request's grammar matcher; a terminated grammar stops it, a rejected token fails it
    (returns the error)."""
    constraint = request.structured_output
    if not constraint.accept(token):
        request.status = RequestStatus.FINISHED_ERROR
        return f"structured_outputs: the grammar rejected the sampled token {token}"
    if constraint.is_terminated and not request.is_finished:
        request.status = RequestStatus.FINISHED_STOPPED
    return None
