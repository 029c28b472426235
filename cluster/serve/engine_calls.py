"""What a call to an engine deployment carries, as a Serve request router reads it from the
`PendingRequest`: the engine request id, prompt, LoRA adapter (name and prefix-cache key) and cache salt
of a `generate(request_id, prompt_token_ids, sampling_params, ..., cache_salt=)` call, and the replica a
pinned call (`kv_rank_endpoints`, `kv_read`, `kv_release`, `kv_tier_read`) names. Anything else reads as
None (or ()): the router then routes without it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedserve.engine.lora.request import SAMPLING_KEY, pop_lora_request

if TYPE_CHECKING:  # Serve's request-router module loads OpenTelemetry's SDK: not for the coordinator's import
    from ray.serve.request_router import PendingRequest


def request_id_of(pending_request: PendingRequest | None) -> str | None:
    """The engine request id of a `generate(request_id, ...)` call (for its trace), else None."""
    if pending_request is None or pending_request.metadata.call_method != "generate":
        return None
    rid = pending_request.args[0] if pending_request.args else pending_request.kwargs.get("request_id")
    return rid if isinstance(rid, str) else None


def prompt_of(pending_request: PendingRequest | None) -> Sequence[int] | None:
    """The prompt token ids of an engine `generate(request_id, prompt_token_ids, ...)` call, else None."""
    if pending_request is None or pending_request.metadata.call_method != "generate":
        return None
    args, kwargs = pending_request.args, pending_request.kwargs
    ids = args[1] if len(args) > 1 else kwargs.get("prompt_token_ids")
    return ids if isinstance(ids, (list, tuple)) else None


def _sampling_params_of(pending_request: PendingRequest | None) -> dict | None:
    if pending_request is None or pending_request.metadata.call_method != "generate":
        return None
    args, kwargs = pending_request.args, pending_request.kwargs
    params = args[2] if len(args) > 2 else kwargs.get("sampling_params")
    return params if isinstance(params, dict) else None


def adapter_in(sampling_params: dict | None) -> str | None:
    """The LoRA adapter name riding in a `generate` call's sampling params (engine.lora.request.SAMPLING_KEY),
    else None."""
    lora = sampling_params.get(SAMPLING_KEY) if isinstance(sampling_params, dict) else None
    return lora.get("lora_name") if isinstance(lora, dict) else None


def lora_key_in(sampling_params: dict | None) -> tuple:
    """The prefix-cache key of the LoRA adapter a `generate` call's sampling params name
    (`LoRARequest.cache_key`, parsed exactly as the engine host parses it), () for the base model. A
    malformed adapter gives (): the engine host rejects that request before it reaches a cache."""
    if not isinstance(sampling_params, dict):
        return ()
    try:
        _, lora = pop_lora_request(sampling_params)
    except (TypeError, ValueError):
        return ()
    return lora.cache_key if lora is not None else ()


def adapter_of(pending_request: PendingRequest | None) -> str | None:
    """The LoRA adapter name of an engine `generate(request_id, prompt_token_ids, sampling_params, ...)` call,
    else None."""
    return adapter_in(_sampling_params_of(pending_request))


def lora_key_of(pending_request: PendingRequest | None) -> tuple:
    """`lora_key_in` of an engine `generate` call's sampling params (() for anything else)."""
    return lora_key_in(_sampling_params_of(pending_request))


def request_of(pending_request: PendingRequest | None) -> tuple[str | None, str | None]:
    """(request_id, cache_salt) of an engine `generate(request_id, prompt_token_ids, ..., cache_salt=)`."""
    if pending_request is None or pending_request.metadata.call_method != "generate":
        return None, None
    args, kwargs = pending_request.args, pending_request.kwargs
    request_id = args[0] if args else kwargs.get("request_id")
    salt = kwargs.get("cache_salt", args[5] if len(args) > 5 else None)
    return (request_id if isinstance(request_id, str) else None), (salt if isinstance(salt, str) else None)


# Engine host methods whose calls name the one replica they are for.
PINNED_METHODS = frozenset({"kv_rank_endpoints", "kv_read", "kv_release", "kv_tier_read"})


def pinned_replica(pending_request: PendingRequest | None) -> str | None:
    """The replica id a pinned call names, else None."""
    if pending_request is None or pending_request.metadata.call_method not in PINNED_METHODS:
        return None
    replica = pending_request.kwargs.get("replica")
    return replica if isinstance(replica, str) else None


