"""Sampling: turns a batch's logits into tokens and logprobs (penalties, logits processors, top-k/p/min-p)."""
