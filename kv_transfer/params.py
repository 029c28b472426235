"""A request's `kv_transfer_params` dict, as read without a connector (the engine's input processor
reads it to validate a continuation before any connector sees the request)."""

from __future__ import annotations

from typing import Any


def continuation_token_ids(params: dict[str, Any] | None) -> list[int]:
    """The producer's output tokens a consumer request continues from (`"continue_remote_output": True`
    beside a producer's params), else []. The request then starts with them as its first output tokens:
    the client already has them from the prefill (time to first token is the prefill's), and the
    consumer computes only their KV and what follows."""
    if not params or not params.get("do_remote_prefill") or not params.get("continue_remote_output"):
        return []
    return [int(t) for t in params.get("remote_output_token_ids") or []]
