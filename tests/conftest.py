"""Shared fixtures: tiny random-weight HF models (saved with save_pretrained) and a small local tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.tiny_models import TINY_ARCHS, make_tiny_model, make_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, tokenizer_dir):
    """make(arch, **config_overrides) -> path of a saved tiny model (cached per arguments)."""
    cache: dict[tuple, Path] = {}

    def make(arch: str = "llama", **overrides) -> Path:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            make_tiny_model(arch, path, tokenizer_dir, **overrides)
            cache[key] = path
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


__all__ = ["TINY_ARCHS"]
