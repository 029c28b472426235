"""Mistral: Llama with no biases and an optional sliding window on every layer."""

from __future__ import annotations

from typing import Any

from pagedserve.engine.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def biases(cls, hf_config: Any) -> tuple[bool, bool, bool]:
        return False, False, False
