"""Speculative decoding counters, in vLLM's terms (its SpecDecodingStats / the spec_decode Prometheus metrics).

A "draft" is one request's proposal in one step with at least one token; a step row that proposed nothing
is not counted. `mean_acceptance_length` is 1 + accepted / drafts: the tokens a verified step emits per
request on average (the accepted drafts plus the target's own token), as vLLM logs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["SpecDecodeStats"]


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Index j: how many drafts had their (j+1)-th token accepted (grows to the longest draft seen).
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one request's verified proposal (a 0-token proposal is not a draft and is ignored)."""
        if num_draft_tokens < 0 or not 0 <= num_accepted <= num_draft_tokens:
            raise ValueError(f"need 0 <= num_accepted ({num_accepted}) <= num_draft_tokens ({num_draft_tokens})")
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self._grow(num_draft_tokens)
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    def merge(self, other: SpecDecodeStats) -> None:
        """Add another interval's (or another engine's) counts into this one."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self._grow(len(other.accepted_per_position))
        for j, count in enumerate(other.accepted_per_position):
            self.accepted_per_position[j] += count

    def _grow(self, length: int) -> None:
        if length > len(self.accepted_per_position):
            self.accepted_per_position.extend([0] * (length - len(self.accepted_per_position)))

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens; 0.0 before any draft token was proposed."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts (1.0: every draft rejected at its first token). 0.0 when there were no
        drafts at all, so "nothing measured" is not mistaken for "nothing accepted"."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """Per draft position j: the share of drafts whose (j+1)-th token was accepted."""
        if not self.num_drafts:
            return [0.0] * len(self.accepted_per_position)
        return [count / self.num_drafts for count in self.accepted_per_position]

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
        }
