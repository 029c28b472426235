"""The model runner's half of speculative decoding: propose draft tokens, then verify them.

The scheduler gives a speculating decode request 1 + k slots (`SchedulerOutput.num_spec_tokens`
holds k). Before the target's forward pass the speculator proposes up to k tokens per such request
(n-gram lookup over the request's own tokens, or the draft model); the runner feeds
[last token] + drafts as that request's query, and after the pass the rejection sampler turns the
1 + m positions' logits (processed by the sampler's batched logits processors, position by position)
into the accepted drafts plus one token of the target's own. Every rank proposes the same drafts (both
proposers are deterministic), so no rank has to send them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedserve.engine.spec_decode.config import SpeculativeConfig
from pagedserve.engine.spec_decode.draft_model import DraftModel, DraftWork
from pagedserve.engine.spec_decode.ngram_proposer import NgramProposer
from pagedserve.engine.sample.logprobs import gather_logprobs
from pagedserve.engine.sample.sampler import Sampler, SamplingState
from pagedserve.engine.spec_decode.rejection_sampler import SpecResult, SpecRow, rejection_sample


class Speculator:
    def __init__(self, spec: SpeculativeConfig, dtype: torch.dtype, device: torch.device, block_size: int,
                 max_model_len: int) -> None:
        self.spec = spec
        self.device = device
        self.ngram: NgramProposer | None = None
        self.draft: DraftModel | None = None
        if spec.method == "ngram":
            self.ngram = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:
            self.draft = DraftModel(spec, dtype, device, block_size, max_model_len)

    # ------------------------------------------------------------------ draft KV cache

    def kv_cache_bytes_per_block(self) -> int:
        return 0 if self.draft is None else self.draft.kv_cache_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int, zeros: Callable[[tuple[int, ...]], torch.Tensor]) -> None:
        if self.draft is not None:
            self.draft.initialize_kv_cache(num_blocks, zeros)

    def request_added(self, req_id: str, num_computed: int) -> None:
        if self.draft is not None:
            self.draft.set_computed(req_id, num_computed)

    def request_updated(self, req_id: str, num_computed: int, resumed: bool) -> None:
        if self.draft is None:
            return
        if resumed:
            self.draft.set_computed(req_id, num_computed)
        else:
            self.draft.bound_computed(req_id, num_computed)

    def request_finished(self, req_id: str) -> None:
        if self.draft is not None:
            self.draft.remove(req_id)

    # ------------------------------------------------------------------ proposing

    def propose_ngram(self, req_ids: list[str], token_ids: list[np.ndarray], limits: list[int]) -> dict[str, list[int]]:
        """Prompt-lookup drafts (at most `limits[i]`) for the speculating requests; those without a match
        are left out."""
        assert self.ngram is not None
        proposals = self.ngram.propose_batch(token_ids, limits)
        return {rid: list(p) for rid, p in zip(req_ids, proposals) if p}

    def propose_draft_model(self, scheduled: list[tuple[str, list[int], int, list[int], int]]) -> dict[str, list[int]]:
        """`scheduled`: (req_id, verified token ids, end of this step's target computation, block ids,
        drafts allowed) for every request of the step: the draft catches up over all of them and
        proposes for those allowed drafts."""
        assert self.draft is not None
        return {rid: d for rid, d in self.draft.step([DraftWork(*s) for s in scheduled]).items() if d}

    # ------------------------------------------------------------------ verifying

    @staticmethod
    def verify(
        logits: torch.Tensor, drafts: list[list[int]], states: list[SamplingState], sampler: Sampler
    ) -> tuple[list[SpecResult | None], list, dict[int, str]]:
        """`logits`: [sum(1 + m_i), V], each request's 1 + m_i positions in order; `states`: the requests'
        SamplingStates. Every verified position goes through the sampler's batched logits processors
        (position j sees the output so far plus the first j drafts). Returns each request's result and,
        for requests that asked for logprobs, the raw logprob entries of every emitted token (else
        None), both None for a request that failed, and index -> why for those that failed."""
        counts = [1 + len(d) for d in drafts]
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()
        raw = logits.float()
        processed, errors = sampler.process_positions(raw, states, drafts)
        keep = [i for i in range(len(states)) if i not in errors]
        if errors:  # a failed request's rows leave the batch before anything draws for the others
            rows = [r for i in keep for r in range(starts[i], starts[i] + counts[i])]
            processed = processed[torch.tensor(rows, dtype=torch.long, device=processed.device)]
        spec_rows = [
            SpecRow(
                draft_token_ids=drafts[i], greedy=states[i].params.greedy,
                temperature=float(states[i].params.temperature), top_k=int(states[i].params.top_k),
                top_p=float(states[i].params.top_p), min_p=float(states[i].params.min_p),
                generator=states[i].generator_for(logits.device),
            )
            for i in keep
        ]
        results: list[SpecResult | None] = [None] * len(states)
        for i, result in zip(keep, rejection_sample(processed, spec_rows) if keep else []):
            results[i] = result
        logprobs: list = [None] * len(states)
        wanted = [i for i in keep if states[i].params.logprobs is not None]
        if wanted:
            index, tokens, num_top, owners = [], [], [], []
            for i in wanted:
                emitted = [*results[i].accepted_token_ids, results[i].next_token_id]
                index.extend(range(starts[i], starts[i] + len(emitted)))
                tokens.extend(emitted)
                num_top.extend([states[i].params.logprobs] * len(emitted))
                owners.extend([i] * len(emitted))
            entries = gather_logprobs(torch.log_softmax(raw[index], dim=-1), torch.tensor(tokens), num_top)
            for i in wanted:
                logprobs[i] = []
            for i, entry in zip(owners, entries):
                logprobs[i].append(entry)
        return results, logprobs, errors
