"""From the last pipeline stage's hidden states to the step's ModelRunnerOutput: prompt logprobs of the
chunks that cover prompt tokens, the embedding requests' pooled vectors (pooler.py), one sampled token
per sampling row (its grammar bitmask applied), the verified drafts of speculating requests, and the
failures of requests whose own work raised (each fails alone; a verification that raises fails every
speculating request of the step).

Every rank of the last stage computes the logits (the LM head may be tensor-parallel); only the driver
samples and reports."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pagedserve.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.engine.failures import describe_failure
from pagedserve.engine.sample.sampler import Sampler, compute_prompt_logprobs
from pagedserve.engine.worker.pooler import Pooler
from pagedserve.engine.worker.request_states import RequestStates
from pagedserve.engine.worker.step_plan import StepPlan

if TYPE_CHECKING:
    from pagedserve.engine.worker.speculator import Speculator


class StepOutputs:
    def __init__(self, model: torch.nn.Module, sampler: Sampler, states: RequestStates,
                 speculator: Speculator | None, is_driver: bool) -> None:
        self.model = model
        self.sampler = sampler
        self.states = states
        self.speculator = speculator
        self.is_driver = is_driver
        self.pooler = Pooler()  # (the driver's: it alone reports)

    def fill(self, output: ModelRunnerOutput, so: SchedulerOutput, plan: StepPlan, hidden: torch.Tensor,
             fault_injector: Callable[[str, str], None] | None) -> None:
        output.prompt_logprobs = self._prompt_logprobs(plan, hidden, output.failed)
        if self.is_driver:
            self.pooler.collect(output, so, plan, hidden, self.states)
        if plan.sample_rows:
            logits = self.model.compute_logits(hidden[plan.sample_rows], upcast=False)  # the sampler widens
            if self.is_driver:
                self._sample(output, so, plan, logits, fault_injector)
        if plan.spec_rows:
            self._verify_drafts(output, plan, hidden)
        for rid in output.failed:
            output.prompt_logprobs.pop(rid, None)

    def _sample(self, output: ModelRunnerOutput, so: SchedulerOutput, plan: StepPlan, logits: torch.Tensor,
                fault_injector: Callable[[str, str], None] | None) -> None:
        requests = self.states.requests
        states = [requests[rid].sampling for rid in plan.sample_req_ids]
        self.sampler.fault_injector = None if fault_injector is None else functools.partial(fault_injector, "sample")
        sampled = self.sampler.sample(logits, states, *bitmask_for(so, plan))
        for row, rid in enumerate(plan.sample_req_ids):
            if row in sampled.errors:
                output.failed[rid] = sampled.errors[row]
                continue
            output.sampled_token_ids[rid] = sampled.token_ids[row]
            requests[rid].last_sampled_token_id = sampled.token_ids[row]
            if sampled.logprobs[row] is not None:
                output.logprobs[rid] = sampled.logprobs[row]

    def _verify_drafts(self, output: ModelRunnerOutput, plan: StepPlan, hidden: torch.Tensor) -> None:
        """Rejection-sample the speculating requests' positions: accepted drafts + one target token each."""
        logits = self.model.compute_logits(hidden[plan.spec_rows])
        if not self.is_driver:
            return
        states = [self.states.requests[rid].sampling for rid in plan.spec_req_ids]
        try:
            results, logprobs, errors = self.speculator.verify(
                logits, [plan.drafts.get(rid, []) for rid in plan.spec_req_ids], states, self.sampler
            )
        except Exception as exc:  # no single request to blame: every speculating request of the step fails
            for rid in plan.spec_req_ids:
                output.failed[rid] = describe_failure(exc)
            return
        for i, (rid, result, entries) in enumerate(zip(plan.spec_req_ids, results, logprobs)):
            if result is None:  # its own rows could not be processed (ids outside the vocabulary)
                output.failed[rid] = errors[i]
                continue
            if entries is not None:
                output.spec_logprobs[rid] = entries
            output.sampled_token_ids[rid] = result.next_token_id
            output.spec_token_ids[rid] = list(result.accepted_token_ids)
            output.num_draft_tokens[rid] = len(plan.drafts.get(rid, ()))

    def _prompt_logprobs(
        self, plan: StepPlan, hidden: torch.Tensor, failed: dict[str, str]
    ) -> dict[str, list[list[tuple[int, float, int]] | None]]:
        """Logprobs of the prompt tokens covered by this step's chunk (token 0 gets None); a request
        whose computation raises goes to `failed` instead."""
        result: dict[str, list[list[tuple[int, float, int]] | None]] = {}
        if not self.states.prompt_logprob_reqs:
            return result
        offset = 0
        for rid, ql, start in zip(plan.req_ids, plan.query_lens, plan.start_positions):
            state = self.states.requests[rid]
            row0 = offset
            offset += ql
            if state.prompt_logprobs is None or start >= state.num_prompt_tokens:
                continue
            # Position p predicts prompt token p + 1.
            end = min(start + ql, state.num_prompt_tokens - 1)
            entries: list[list[tuple[int, float, int]] | None] = [None] if start == 0 else []
            if end > start:
                logits = self.model.compute_logits(hidden[row0 : row0 + (end - start)])
                targets = torch.tensor(state.token_ids[start + 1 : end + 1], dtype=torch.long, device=logits.device)
                if self.is_driver:
                    try:
                        entries.extend(compute_prompt_logprobs(logits, targets, state.prompt_logprobs))
                    except Exception as exc:
                        failed[rid] = describe_failure(exc)
                        continue
            result[rid] = entries
        return result


def bitmask_for(so: SchedulerOutput, plan: StepPlan) -> tuple[torch.Tensor | None, list[int] | None]:
    """The scheduler's grammar bitmask and, per bitmask row, the logits row it constrains."""
    if so.grammar_bitmask is None or not so.structured_output_req_ids:
        return None, None
    row_of = {rid: row for row, rid in enumerate(plan.sample_req_ids)}
    keep = [i for i, rid in enumerate(so.structured_output_req_ids) if rid in row_of]
    rows = [row_of[so.structured_output_req_ids[i]] for i in keep]
    bitmask = so.grammar_bitmask if len(keep) == len(so.structured_output_req_ids) else so.grammar_bitmask[keep]
    return bitmask, rows
