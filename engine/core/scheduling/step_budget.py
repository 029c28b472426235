"""One step's plan, in tokens: the budget left (`max_num_batched_tokens`), how many tokens each scheduled
request computes (a speculating decode: its last token and its drafts), and whether anyone was preempted
to make room. There are no phases: a request simply has tokens left to compute and gets as many as fit;
a prompt that does not fit whole waits, unless chunked prefill lets it take a chunk."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.engine.core.request import Request


@dataclass
class StepBudget:
    budget: int
    chunked_prefill: bool
    scheduled: list[Request] = field(default_factory=list)
    num_scheduled: dict[str, int] = field(default_factory=dict)  # request id -> tokens (drafts included)
    spec_tokens: dict[str, int] = field(default_factory=dict)  # speculating decodes -> drafts they verify
    preempted: bool = False  # the cache was full this step: no waiting request is admitted

    @property
    def exhausted(self) -> bool:
        return self.budget <= 0

    def chunk(self, num_left: int) -> int:
        """A running request's tokens this step (decodes, the rest of a chunked prompt)."""
        return min(num_left, self.budget)

    def prompt_chunk(self, num_left: int) -> int | None:
        """A waiting request's tokens this step; None when its prompt must wait to go whole."""
        if num_left > self.budget and not self.chunked_prefill:
            return None
        return min(num_left, self.budget)

    def add(self, request: Request, num_tokens: int, num_drafts: int = 0) -> None:
        self.num_scheduled[request.request_id] = num_tokens
        if num_drafts:
            self.spec_tokens[request.request_id] = num_drafts
        self.scheduled.append(request)
        self.budget -= num_tokens

    def drop(self, request: Request) -> None:
        """Undo a request's share of this step (it was preempted after being scheduled: priority policy)."""
        if request.request_id in self.num_scheduled:
            self.budget += self.num_scheduled.pop(request.request_id)
            self.spec_tokens.pop(request.request_id, None)
            self.scheduled.remove(request)
