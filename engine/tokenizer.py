"""Loading a model's tokenizer (the processor, the structured-output manager and the servers share it)."""

from __future__ import annotations


def load_tokenizer(path: str):
    """The tokenizer (and chat template) of an HF-format folder, or the one a GGUF file carries
    (a .gguf path, or a directory holding one and no tokenizer files of its own)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from pagedserve.engine.models.gguf_loader import find_gguf_file, load_gguf_tokenizer

    has_own_files = any((Path(path) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    gguf_file = None if has_own_files else find_gguf_file(path)
    if gguf_file is not None:
        return load_gguf_tokenizer(gguf_file)
    return AutoTokenizer.from_pretrained(path)
