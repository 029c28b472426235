"""Sampling: turns a batch's logits into tokens and logprobs (penalties, logits processors, top-k/p/min-p).

sampler.py (the Sampler and SamplingState), sampling_batch.py (persistent per-request rows as tensors),
processors.py (the batched logits processors), logprobs.py (logprob entries, prompt logprobs).
"""
