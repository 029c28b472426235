"""The model runner's half of speculative decoding: propose draft tokens, then verify them.

The scheduler gives a speculating decode request 1 + k slots (`SchedulerOutput.num_spec_tokens`
holds k). Before the target's forward pass the speculator proposes up to k tokens per such request
(n-gram lookup over the request's own tokens, or the draft model); the runner feeds
[last token] + drafts as that request's query, and after the pass the rejection sampler turns the
1 + m positions' logits into the accepted drafts plus one token of the target's own. Every rank
proposes the same drafts (both proposers are deterministic), so no rank has to send them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedserve.engine.spec_decode.config import SpeculativeConfig
from pagedserve.engine.spec_decode.draft_model import DraftModel, DraftWork
from pagedserve.engine.spec_decode.ngram_proposer import NgramProposer
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

    def propose(self, scheduled: list[tuple[str, list[int], int, list[int], int]]) -> dict[str, list[int]]:
        """`scheduled`: (req_id, verified token ids, end of this step's target computation, block ids,
        drafts allowed) for every request of the step. Returns the drafts of the requests that got any."""
        if self.draft is not None:
            drafts = self.draft.step([DraftWork(*s) for s in scheduled])
        else:
            assert self.ngram is not None
            drafts = {}
            for req_id, token_ids, _, _, k in scheduled:
                if k > 0:
                    proposal = self.ngram.propose(np.asarray(token_ids, dtype=np.int64), k)
                    if proposal:
                        drafts[req_id] = list(proposal)
        return {rid: d for rid, d in drafts.items() if d}

    # ------------------------------------------------------------------ verifying

    @staticmethod
    def verify(logits: torch.Tensor, drafts: list[list[int]], params: list, generators: list) -> list[SpecResult]:
        """`logits`: [sum(1 + m_i), V], each request's 1 + m_i positions in order."""
        rows = [
            SpecRow(
                draft_token_ids=d,
                greedy=p.greedy,
                temperature=float(p.temperature),
                top_k=int(p.top_k),
                top_p=float(p.top_p),
                min_p=float(p.min_p),
                generator=g,
            )
            for d, p, g in zip(drafts, params, generators)
        ]
        return rejection_sample(logits, rows)
