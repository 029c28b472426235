"""The sampler's view of one request: its parameters, the tokens it has, its own generator, its bad words.

The runner owns one `SamplingState` per running request and appends its output tokens; the sampler's
persistent rows (sampling_batch.py) are keyed by the state's identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.engine.sample.bad_words import BadWordsTrie
from pagedserve.engine.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


@dataclass
class SamplingState:
    """The sampler's view of one running request; the engine owns and updates it (output_token_ids
    only grows; params, eos ids and bad words are fixed once the sampler has seen the state)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    # Per-request generator seeded from params.seed; None = the sampler's shared one.
    generator: torch.Generator | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # Blocked (with params.stop_token_ids) while len(output_token_ids) < params.min_tokens.
    eos_token_ids: set[int] = field(default_factory=set)
    request_id: str = ""
    # Draws a seeded request's generator skips when it is made: one per output token sampled elsewhere
    # (a prefill/decode continuation), so it goes on exactly where the producer's generator stopped.
    pending_draws: int = 0
    # The bad words as a trie (built on first use; bad_words_token_ids are fixed by then).
    _bad_words_trie: BadWordsTrie | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def bad_words_trie(self) -> BadWordsTrie:
        if self._bad_words_trie is None:
            self._bad_words_trie = BadWordsTrie(self.bad_words_token_ids)
        return self._bad_words_trie

    def generator_for(self, device: torch.device) -> torch.Generator | None:
        """The request's own generator on `device` (made there on first use); None if unseeded."""
        if self.params.seed is None:
            return None
        if self.generator is None or self.generator.device != device:
            self.generator = make_generator(self.params.seed, device)
        return self.generator

    def draws_checkpoint(self) -> DrawsCheckpoint:
        """Where its seeded generator stands, to take back a step's draws (`rewind_draws`)."""
        state = None if self.generator is None else self.generator.get_state()
        return DrawsCheckpoint(self, self.generator, state, self.pending_draws)

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: list[int],
        eos_token_ids: set[int] | None = None,
        bad_words_token_ids: list[list[int]] | None = None,
        request_id: str = "",
    ) -> SamplingState:
        """The generator of a seeded request is made lazily, on the device of its first logits."""
        return cls(
            params=params,
            prompt_token_ids=list(prompt_token_ids),
            output_token_ids=[],
            bad_words_token_ids=list(bad_words_token_ids or []),
            eos_token_ids=set(eos_token_ids or ()),
            request_id=request_id,
        )


@dataclass
class DrawsCheckpoint:
    """A seeded request's generator as it stood before a step whose sampled token the scheduler drops (the
    step read KV whose load failed): its draws are taken back with the token, so the request samples
    its next token with the same draw an uninterrupted run uses."""

    sampling: SamplingState
    generator: torch.Generator | None  # None: not made yet (made afresh from the seed on the next draw)
    generator_state: torch.Tensor | None
    pending_draws: int

    def rewind_draws(self) -> None:
        if self.generator is not None and self.generator_state is not None:
            self.generator.set_state(self.generator_state)
        self.sampling.generator = self.generator
        self.sampling.pending_draws = self.pending_draws
