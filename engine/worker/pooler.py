"""Embedding requests on the last pipeline stage's driver rank: their prompt positions' final-norm hidden
states gathered across prefill chunks into one vector each.

"last" takes the last prompt position (computed in the request's last chunk, prefix-cache hit or not);
"cls" the first and "mean" the mean of every position, so those requests read no prefix-cache hits
(`Request.skip_reading_prefix_cache`) and their chunks arrive in order from position 0 (a preempted
request starts again at 0: what it had gathered is dropped). Sums are kept in float32 whatever the
model's dtype. The finished vector is cut to `dimensions` and L2-normalized if asked, then leaves as a
float32 CPU tensor in `ModelRunnerOutput.pooled`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.worker.request_states import RequestStates
from pagedserve.engine.worker.step_plan import StepPlan


@dataclass
class _Partial:
    """What a mean/cls request's chunks gathered so far, and the position its next chunk starts at."""

    vector: torch.Tensor
    next_position: int


class Pooler:
    def __init__(self) -> None:
        self._partial: dict[str, _Partial] = {}

    def collect(self, output: ModelRunnerOutput, so: SchedulerOutput, plan: StepPlan, hidden: torch.Tensor,
                states: RequestStates) -> None:
        """Gather this step's rows of the embedding requests; the ones whose prompt ended get their vector."""
        for rid in so.finished_req_ids:
            self._partial.pop(rid, None)
        if not states.pooling_reqs:
            return
        offset = 0
        for rid, num_rows, start in zip(plan.req_ids, plan.query_lens, plan.start_positions):
            rows = hidden[offset : offset + num_rows]
            offset += num_rows
            if rid not in states.pooling_reqs:
                continue
            state = states.requests[rid]
            vector = self._gather(rid, state.pooling, rows, start, state.num_prompt_tokens)
            if isinstance(vector, str):
                output.failed[rid] = vector
            elif vector is not None:
                output.pooled[rid] = finish_vector(vector, state.pooling)

    def _gather(self, rid: str, params: PoolingParams, rows: torch.Tensor, start: int,
                num_prompt_tokens: int) -> torch.Tensor | str | None:
        """The request's vector when this chunk ends its prompt, None before, or why it cannot be pooled."""
        end = start + rows.shape[0]
        if params.pooling_type == "last":
            return rows[-1].float() if end == num_prompt_tokens else None
        if start == 0:  # (again, after a preemption)
            first = rows[0].float().clone() if params.pooling_type == "cls" else rows.float().sum(dim=0)
            partial = self._partial[rid] = _Partial(first, end)
        else:
            partial = self._partial.get(rid)
            if partial is None or partial.next_position != start:
                self._partial.pop(rid, None)
                return f"pooling: request {rid} computed positions from {start}, not from its gathered prefix"
            if params.pooling_type == "mean":
                partial.vector += rows.float().sum(dim=0)
            partial.next_position = end
        if end < num_prompt_tokens:
            return None
        del self._partial[rid]
        return partial.vector / num_prompt_tokens if params.pooling_type == "mean" else partial.vector


def finish_vector(vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Cut to `dimensions` (Matryoshka), then L2-normalize if asked; a float32 CPU tensor."""
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    # A copy of its own: a view would keep (and pickle) the whole step's hidden states.
    return vector.to(device="cpu", dtype=torch.float32).clone()
