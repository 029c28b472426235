"""Token streams for training and evaluation: each file is one BOS ... EOS document."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from training.corpus import load_split


def encode_split(tokenizer: PreTrainedTokenizerBase, split: str) -> np.ndarray:
    """The split's files in path order, each wrapped BOS ... EOS, as one uint16 stream."""
    if len(tokenizer) > np.iinfo(np.uint16).max:
        raise ValueError(f"tokenizer: vocab of {len(tokenizer)} does not fit uint16")
    files = load_split(split)
    # add_special_tokens=True prepends BOS through the tokenizer's post-processor.
    encoded = tokenizer([f.text for f in files], add_special_tokens=True)["input_ids"]
    eos = tokenizer.eos_token_id
    stream = [tok for ids in encoded for tok in (*ids, eos)]
    return np.asarray(stream, dtype=np.uint16)


def cached_split(tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase, split: str, cache_dir: Path) -> np.ndarray:
    """``encode_split`` cached under ``cache_dir``, keyed by the tokenizer file's hash."""
    key = hashlib.sha256((tokenizer_dir / "tokenizer.json").read_bytes()).hexdigest()[:16]
    path = cache_dir / f"{split}-{key}.npy"
    if path.exists():
        return np.load(path)
    stream = encode_split(tokenizer, split)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, stream)
    tmp.replace(path)
    return stream


def sample_batch(stream: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int) -> np.ndarray:
    """Random windows of ``seq_len + 1`` tokens; a pure function of (seed, step) so resume is exact."""
    if len(stream) <= seq_len + 1:
        raise ValueError(f"seq_len: {seq_len} is longer than the token stream ({len(stream)})")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch_size)
    return np.stack([stream[s : s + seq_len + 1] for s in starts]).astype(np.int64)


def eval_windows(stream: np.ndarray, seq_len: int, max_windows: int | None = None) -> np.ndarray:
    """Consecutive non-overlapping windows of ``seq_len + 1`` tokens from the stream's start."""
    n = (len(stream) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n <= 0:
        raise ValueError("stream: too short for one evaluation window")
    return np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]).astype(np.int64)
