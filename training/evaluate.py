"""Held-out evaluation of a trained model; writes ``eval_stats.json`` next to its weights.

    python -m training.evaluate assets/default-model [--draft assets/draft-model]

Loss is the mean next-token cross-entropy (nats) in float32 over consecutive
``seq_len``-token windows of the held-out split (files in path order, each
wrapped BOS ... EOS). Two figures are recorded: the whole held-out split, and
its first ``SLICE_WINDOWS`` windows, which ``tests/test_default_model.py``
recomputes in seconds.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.corpus import describe
from training.data import encode_split, eval_windows

SEQ_LEN = 256
SLICE_WINDOWS = 8
PROMPT = "def fibonacci(n):"


def load(model_dir: Path):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tokenizer, model


@torch.no_grad()
def window_losses(model, windows: np.ndarray, batch_size: int = 8) -> np.ndarray:
    """Per-token losses, shape (n_windows, seq_len)."""
    out = []
    for i in range(0, len(windows), batch_size):
        batch = torch.from_numpy(windows[i : i + batch_size])
        logits = model(input_ids=batch[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")
        out.append(loss.numpy())
    return np.concatenate(out)


@torch.no_grad()
def greedy_agreement(target, draft, windows: np.ndarray) -> float:
    """Fraction of positions where draft's argmax equals target's: a proxy for the
    speculative-decoding acceptance rate of greedy drafts."""
    batch = torch.from_numpy(windows)[:, :-1]
    return float((target(input_ids=batch).logits.argmax(-1) == draft(input_ids=batch).logits.argmax(-1)).float().mean())


def greedy_sample(model, tokenizer, prompt: str = PROMPT, max_new_tokens: int = 48) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def evaluate(model_dir: Path, max_windows: int | None = None) -> dict[str, object]:
    tokenizer, model = load(model_dir)
    stream = encode_split(tokenizer, "heldout")
    windows = eval_windows(stream, SEQ_LEN, max_windows)
    losses = window_losses(model, windows)
    full = float(losses.mean())
    slice_loss = float(losses[:SLICE_WINDOWS].mean())
    return {
        "python_version": sys.version.split()[0],
        "seq_len": SEQ_LEN,
        "heldout_tokens_scored": int(losses.size),
        "heldout_loss": round(full, 4),
        "heldout_perplexity": round(math.exp(full), 2),
        "slice_windows": SLICE_WINDOWS,
        "slice_loss": round(slice_loss, 4),
        "greedy_prompt": PROMPT,
        "greedy_completion": greedy_sample(model, tokenizer),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dirs", type=Path, nargs="+")
    p.add_argument("--draft", type=Path, default=None, help="also measure this draft's greedy agreement with the first model")
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    for model_dir in args.model_dirs:
        stats = evaluate(model_dir, args.max_windows)
        stats["corpus"] = describe()
        (model_dir / "eval_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
        print(model_dir, json.dumps(stats, indent=2), flush=True)
    if args.draft is not None:
        target_dir = args.model_dirs[0]
        tokenizer, target = load(target_dir)
        _, draft = load(args.draft)
        windows = eval_windows(encode_split(tokenizer, "heldout"), SEQ_LEN, SLICE_WINDOWS * 4)
        agreement = greedy_agreement(target, draft, windows)
        stats_path = args.draft / "eval_stats.json"
        stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
        stats["greedy_agreement_with_target"] = {"target": str(target_dir), "windows": len(windows),
                                                 "fraction": round(agreement, 4)}
        stats_path.write_text(json.dumps(stats, indent=2) + "\n")
        print(f"draft greedy agreement with target: {agreement:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
