"""Byte-level BPE tokenizer for the default model, saved as a standard HF tokenizer."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from training.corpus import SourceFile

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS = (BOS, EOS, PAD, *ROLE_TOKENS)

# Role-marked blocks; add_generation_prompt opens an assistant turn, and a turn
# ends with <|end|> (listed as an EOS id in generation_config.json).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role must be system, user or assistant') }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_tokenizer(files: list[SourceFile], vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    """Train on ``files`` (deterministic for a fixed file list) and wrap for ``transformers``."""
    if vocab_size < 512:
        raise ValueError(f"vocab_size: must be >= 512, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((f.text for f in files), trainer=trainer, length=len(files))
    bos_id = tok.token_to_id(BOS)
    # Encoding a prompt prepends BOS, as every training document starts with it.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens={},
        model_max_length=1024,
    )
    hf.add_special_tokens({"additional_special_tokens": list(ROLE_TOKENS)})
    hf.chat_template = CHAT_TEMPLATE
    return hf


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
