"""Shapes of the shipped target and draft models (Llama architecture)."""
from __future__ import annotations

from transformers import LlamaConfig, PreTrainedTokenizerBase

SHAPES: dict[str, dict[str, int]] = {
    # ~12.9M parameters (3.1M of them the tied embedding). head_dim 64 (a power
    # of two, which Triton attention kernels want); GQA 3:1.
    "target": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                   num_attention_heads=6, num_key_value_heads=2),
    # ~1.4M parameters, ~9x smaller: the speculative-decoding draft (head_dim 32).
    "draft": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2),
}


def build_config(kind: str, tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    if kind not in SHAPES:
        raise ValueError(f"kind: expected one of {sorted(SHAPES)}, got {kind!r}")
    return LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **SHAPES[kind],
    )
