"""The draft model of `draft_model` speculation, run by the same worker as the target.

The draft keeps its own paged KV cache with as many blocks as the target's and reads it through the
target's block tables, so the scheduler's block accounting (allocation, prefix caching, preemption)
covers both caches at once. Every rank of a TP/PP target runs a full (TP=1) copy of the draft: the
draft is small, and every rank then proposes the same tokens without talking to the others.

Per request the draft remembers how many positions of its cache hold the request's verified tokens
(`computed`). Each step it first catches up over the tokens the target computes this step (a prefill
chunk, or the last verified tokens of a decode), then proposes greedily, one decode step per draft
token. Its cache writes stay within the slots the scheduler allocated for the target's 1 + k tokens.
After verification the target's rewound `num_computed_tokens` (sent with the next step) bounds what
the draft may keep: positions past it held rejected drafts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.engine.models.loader import load_model
from pagedserve.engine.spec_decode.config import SpeculativeConfig, load_draft_hf_config
from pagedserve.engine.spec_decode.flat_batch import build_flat_inputs
from pagedserve.kernels import greedy_argmax
from pagedserve.parallel.state import ParallelContext


@dataclass
class DraftWork:
    """One scheduled request as the draft sees it this step."""

    req_id: str
    token_ids: list[int]  # the request's verified tokens (prompt + outputs)
    end: int  # the target computes positions < end this step (for a speculating request: its last token + 1)
    block_ids: list[int]
    num_drafts: int  # tokens to propose (0: only keep the cache in step)


class DraftModel:
    def __init__(self, spec: SpeculativeConfig, dtype: torch.dtype, device: torch.device, block_size: int,
                 max_model_len: int) -> None:
        assert spec.model is not None
        self.hf_config = load_draft_hf_config(spec)
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.model = load_model(spec.model, self.hf_config, dtype, ParallelContext.single(), device=device,
                                max_position=max_model_len)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.computed: dict[str, int] = {}

    # ------------------------------------------------------------------ cache

    def kv_cache_bytes_per_block(self) -> int:
        num_layers, num_kv_heads, head_size = self.model.kv_cache_shape_per_layer()
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * num_layers * self.block_size * num_kv_heads * head_size * element

    def initialize_kv_cache(self, num_blocks: int, zeros: Callable[[tuple[int, ...]], torch.Tensor]) -> None:
        num_layers, num_kv_heads, head_size = self.model.kv_cache_shape_per_layer()
        shape = (num_blocks, self.block_size, num_kv_heads, head_size)
        self.kv_caches = [(zeros(shape), zeros(shape)) for _ in range(num_layers)]

    # ------------------------------------------------------------------ per-request state

    def set_computed(self, req_id: str, num_computed: int) -> None:
        """A request the draft has not seen, or one resumed after preemption: its cache holds what the
        target's does (prefix-cache hits were computed by both)."""
        self.computed[req_id] = num_computed

    def bound_computed(self, req_id: str, num_verified: int) -> None:
        """The target kept `num_verified` positions: anything the draft wrote past them was rejected."""
        if req_id in self.computed:
            self.computed[req_id] = min(self.computed[req_id], num_verified)

    def remove(self, req_id: str) -> None:
        self.computed.pop(req_id, None)

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def step(self, work: list[DraftWork]) -> dict[str, list[int]]:
        """Catch up over this step's tokens, then propose `num_drafts` tokens per speculating request."""
        if not work:
            return {}
        seqs = []
        for w in work:
            start = min(self.computed.get(w.req_id, 0), w.end - 1)
            seqs.append((w, start, w.token_ids[start : w.end]))
        seqs.sort(key=lambda s: len(s[2]) != 1)  # decodes first
        ids, positions, metadata = build_flat_inputs(
            [s[2] for s in seqs], [s[1] for s in seqs], [s[0].block_ids for s in seqs], self.block_size, self.device
        )
        hidden = self.model.forward(ids, positions, self.kv_caches, metadata)
        last_rows = [metadata.query_start_loc_cpu[i + 1] - 1 for i, s in enumerate(seqs) if s[0].num_drafts > 0]
        speculating = [s[0] for s in seqs if s[0].num_drafts > 0]
        for w in work:
            self.computed[w.req_id] = w.end
        if not speculating:
            return {}
        tokens = greedy_argmax(self.model.compute_logits(hidden[last_rows], upcast=False)).tolist()
        drafts = {w.req_id: [t] for w, t in zip(speculating, tokens)}
        # One decode step per further draft token, over the requests that still want more.
        for i in range(1, max(w.num_drafts for w in speculating)):
            active = [w for w in speculating if w.num_drafts > i]
            chunks = [[drafts[w.req_id][-1]] for w in active]
            starts = [w.end - 1 + i for w in active]
            ids, positions, metadata = build_flat_inputs(chunks, starts, [w.block_ids for w in active],
                                                         self.block_size, self.device)
            hidden = self.model.forward(ids, positions, self.kv_caches, metadata)
            tokens = greedy_argmax(self.model.compute_logits(hidden, upcast=False)).tolist()
            for w, t in zip(active, tokens):
                drafts[w.req_id].append(t)
                self.computed[w.req_id] = w.end + i
        return drafts
