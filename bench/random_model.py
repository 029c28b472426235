"""Random-weight Llama models of fixed shapes for the offline benchmarks (`--random-weights small`):
engine work at a known size with nothing to download. The benchmarks feed token ids, so the model
only needs some tokenizer to load: a word-level one over its vocabulary, built without training."""

from __future__ import annotations

from pathlib import Path

MODEL_SHAPES = {
    # ~12M parameters
    "small": dict(vocab_size=32000, hidden_size=256, intermediate_size=704, num_hidden_layers=6,
                  num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True),
    # ~190M parameters: Llama shape, hidden 1024, 8 layers, GQA
    "medium": dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                   num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False),
    # ~135M parameters: the default model's shape (SmolLM2-135M), e.g. for its float and int4/int8 figures on
    # a machine without the packaged GGUF file
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
}


def save_wordlevel_tokenizer(path: Path, vocab_size: int) -> None:
    """A tokenizer whose ids 0..vocab_size-1 are the words "<bos>", "<eos>", "<pad>", "t3", "t4", ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<bos>", "<eos>", "<pad>"] + [f"t{i}" for i in range(3, vocab_size)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(str(path))


def make_random_model(size: str, directory: Path, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Save a random-weight Llama of MODEL_SHAPES[size] (and its tokenizer) under `directory`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if size not in MODEL_SHAPES:
        raise ValueError(f"--random-weights: one of {', '.join(MODEL_SHAPES)}, got {size!r}")
    config = LlamaConfig(max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1,
                         pad_token_id=2, **MODEL_SHAPES[size])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = Path(directory) / f"llama-{size}"
    model.to(getattr(torch, dtype)).save_pretrained(str(path), safe_serialization=True)
    save_wordlevel_tokenizer(path, config.vocab_size)
    return path
