"""Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm, bias from attention_bias)."""

from __future__ import annotations

from typing import Any, ClassVar

from pagedserve.engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def biases(cls, hf_config: Any) -> tuple[bool, bool, bool]:
        return True, False, False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm: ClassVar[bool] = True

    @classmethod
    def biases(cls, hf_config: Any) -> tuple[bool, bool, bool]:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return attention_bias, attention_bias, False
