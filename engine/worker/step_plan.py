"""One step's plan on the runner: the drafts of its speculating requests, the order of its sequences
(decodes first, each group in schedule order: the attention layers rely on it) and the flat-batch rows
whose logits are sampled or verified. Vectorized over the input batch's arrays; Python touches only the
speculating requests."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pagedserve.engine.core.scheduler_output import SchedulerOutput
from pagedserve.engine.worker.input_batch import InputBatch
from pagedserve.engine.worker.request_states import RunnerRequestState

if TYPE_CHECKING:
    from pagedserve.engine.worker.speculator import Speculator


@dataclass
class StepPlan:
    """The host-side plan of one step, in batch order."""

    req_ids: list[str]
    query_lens: list[int]
    start_positions: list[int]  # num_computed_tokens before this step
    # Indices (into the flat token batch) of the last token of sequences that sample.
    sample_rows: list[int]
    sample_req_ids: list[str]
    # Speculating requests: their proposed tokens (the query is [last token] + drafts; every position
    # of it is verified) and the flat-batch rows of those positions, in request order.
    drafts: dict[str, list[int]] = field(default_factory=dict)
    spec_rows: list[int] = field(default_factory=list)
    spec_req_ids: list[str] = field(default_factory=list)
    # The requests' rows in the input batch and their query lengths, as arrays (batch order).
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    query_lens_np: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # The draft model's time proposing (model work, not host overhead: its argmax waits for the device).
    draft_seconds: float = 0.0


def plan_step(so: SchedulerOutput, input_batch: InputBatch, requests: dict[str, RunnerRequestState],
              speculator: Speculator | None, pooling_reqs: set[str] | frozenset[str] = frozenset()) -> StepPlan:
    """`pooling_reqs`: the embedding requests, which never sample."""
    draft_start = time.perf_counter()
    drafts = propose_drafts(so, input_batch, requests, speculator)
    draft_model = speculator is not None and speculator.draft is not None
    draft_seconds = time.perf_counter() - draft_start if draft_model else 0.0
    plan = order_step(so, input_batch, drafts, pooling_reqs)
    plan.draft_seconds = draft_seconds
    return plan


def propose_drafts(so: SchedulerOutput, input_batch: InputBatch, requests: dict[str, RunnerRequestState],
                   speculator: Speculator | None) -> dict[str, list[int]]:
    """Draft tokens for this step's speculating requests (the draft model also catches up over every
    scheduled request's tokens, so its cache stays in step with the target's)."""
    if speculator is None:
        return {}
    if speculator.draft is None:  # n-gram: only the speculating requests, read from their rows
        rids = list(so.num_spec_tokens)
        return speculator.propose_ngram(rids, [input_batch.tokens_of(r) for r in rids],
                                        [so.num_spec_tokens[r] for r in rids])
    scheduled = []
    num_computed = input_batch.num_computed
    for rid, n in so.num_scheduled_tokens.items():
        k = so.num_spec_tokens.get(rid, 0)
        end = int(num_computed[input_batch.row_of[rid]]) + (1 if rid in so.num_spec_tokens else n)
        scheduled.append((rid, requests[rid].token_ids, end, input_batch.blocks_of(rid).tolist(), k))
    return speculator.propose_draft_model(scheduled)


def order_step(so: SchedulerOutput, input_batch: InputBatch, drafts: dict[str, list[int]],
               pooling_reqs: set[str] | frozenset[str] = frozenset()) -> StepPlan:
    """Order the step decodes first (each group in schedule order) and find the rows that sample."""
    scheduled = so.num_scheduled_tokens
    rids = list(scheduled)
    lens = np.fromiter(scheduled.values(), dtype=np.int64, count=len(rids))
    speculating = np.zeros(len(rids), dtype=bool)
    if so.num_spec_tokens:
        index = {rid: i for i, rid in enumerate(rids)}
        for rid in so.num_spec_tokens:
            if rid in index:  # its last token and the drafts it got (maybe fewer than allowed)
                speculating[index[rid]] = True
                lens[index[rid]] = 1 + len(drafts.get(rid, ()))
    order = np.argsort(lens != 1, kind="stable")
    lens, speculating = lens[order], speculating[order]
    req_ids = [rids[i] for i in order.tolist()]
    rows = input_batch.rows_for(req_ids)
    starts = input_batch.num_computed[rows]
    last_rows = np.cumsum(lens) - 1
    sampling = ~speculating & (starts + lens == input_batch.num_tokens[rows])
    if pooling_reqs:
        sampling &= np.fromiter((rid not in pooling_reqs for rid in req_ids), dtype=bool, count=len(req_ids))
    samples = np.flatnonzero(sampling)
    spec = np.flatnonzero(speculating)
    return StepPlan(
        req_ids, lens.tolist(), starts.tolist(), last_rows[samples].tolist(), [req_ids[i] for i in samples.tolist()],
        drafts, spec_rows=np.flatnonzero(np.repeat(speculating, lens)).tolist(),
        spec_req_ids=[req_ids[i] for i in spec.tolist()], rows=rows, query_lens_np=lens,
    )
