"""Sampling: turns a batch's logits into tokens and logprobs (penalties, logits processors, top-k/p/min-p).

sampler.py (the Sampler), state.py (a request's SamplingState), sampling_batch.py (persistent per-request
rows as tensors), processors.py (the batched logits processors), logprobs.py (logprob entries, prompt
logprobs), bad_words.py (the bad-words trie).
"""
