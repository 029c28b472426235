"""Builders for tiny random-weight models of every supported architecture, saved the way HF saves them."""

from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    "The quick brown fox jumps over the lazy dog. Héllo wörld, naïve café — 你好，世界 🙂🚀\n"
    "import os\nimport sys\nclass Engine:\n    def step(self):\n        return [x * 2 for x in range(10)]\n"
    "Paged attention stores keys and values in fixed-size blocks; prefix caching reuses them.\n"
)

VOCAB_SIZE = 512


def make_tokenizer(path: Path) -> None:
    """A byte-level BPE trained in well under a second, with BOS/EOS/PAD and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 8,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        additional_special_tokens=specials[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def _base_kwargs() -> dict:
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )


def _config(arch: str, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    kwargs = _base_kwargs()
    if arch == "llama":
        cls = LlamaConfig
    elif arch == "llama3":
        cls = LlamaConfig
        kwargs["rope_scaling"] = {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        kwargs["rope_theta"] = 500000.0
    elif arch == "mistral":
        cls = MistralConfig
        kwargs["sliding_window"] = None
    elif arch == "qwen2":
        cls = Qwen2Config
        kwargs["tie_word_embeddings"] = True
    elif arch == "qwen3":
        cls = Qwen3Config
        kwargs["head_dim"] = 32  # != hidden_size / num_attention_heads
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    kwargs.update(overrides)
    return cls(**kwargs)


TINY_ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]


def make_tiny_model(arch: str, path: Path, tokenizer_dir: Path | None = None, seed: int = 0, **overrides) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = _config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init is tiny in magnitude; scale weights up so that greedy outputs are not all one token.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08 if "embed" not in name else 1.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
    model.save_pretrained(str(path), safe_serialization=True)
    if tokenizer_dir is not None:
        AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(path))
