"""The adapter a request runs under (vLLM's `LoRARequest`)."""

from __future__ import annotations

from dataclasses import dataclass

# Where a served request's adapter rides in its sampling params dict, across the cluster's hops (the HTTP
# layer puts it there, the engine host takes it out: `pop_lora_request`).
SAMPLING_KEY = "lora_request"


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) under a name and an id.

    `lora_int_id` (>= 1) identifies the adapter's weights: two requests with the same id share KV cache
    blocks and a resident slot, so a different adapter must get a different id (the server assigns a
    fresh one at every load).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_request.lora_name: expected a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id: expected an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_request.lora_path: expected a non-empty path")

    @property
    def cache_key(self) -> tuple[str, int]:
        """What enters the hash of a request's first KV block: blocks computed under one adapter are never
        a prefix-cache hit for another (or for the base model)."""
        return ("lora", self.lora_int_id)


def pop_lora_request(sampling_params: dict) -> tuple[dict, LoRARequest | None]:
    """The sampling params dict without its adapter, and the adapter (ValueError naming a malformed one)."""
    raw = sampling_params.get(SAMPLING_KEY)
    if raw is None:
        return sampling_params, None
    rest = {k: v for k, v in sampling_params.items() if k != SAMPLING_KEY}
    if not isinstance(raw, dict) or set(raw) != {"lora_name", "lora_int_id", "lora_path"}:
        raise ValueError("lora_request: expected an object with lora_name, lora_int_id and lora_path")
    return rest, LoRARequest(**raw)
