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
from pagedserve.engine.sample.logprobs import gather_logprobs
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
    def verify(logits: torch.Tensor, drafts: list[list[int]], states: list) -> tuple[list[SpecResult], list]:
        """`logits`: [sum(1 + m_i), V], each request's 1 + m_i positions in order; `states`: the requests'
        SamplingStates. Returns each request's result and, for requests that asked for logprobs, the raw
        logprob entries of every emitted token (else None)."""
        counts = [1 + len(d) for d in drafts]
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()
        raw = logits.float()
        processed = _apply_position_processors(raw, drafts, states, starts)
        rows = [
            SpecRow(
                draft_token_ids=d, greedy=s.params.greedy, temperature=float(s.params.temperature),
                top_k=int(s.params.top_k), top_p=float(s.params.top_p), min_p=float(s.params.min_p),
                generator=s.generator_for(logits.device),
            )
            for d, s in zip(drafts, states)
        ]
        results = rejection_sample(processed, rows)
        logprobs: list = [None] * len(states)
        wanted = [i for i, s in enumerate(states) if s.params.logprobs is not None]
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
        return results, logprobs


def _apply_position_processors(logits: torch.Tensor, drafts: list[list[int]], states: list,
                               starts: list[int]) -> torch.Tensor:
    """Every logits processor at every verified position, in the sampler's order: allowed_token_ids,
    logit_bias, min_tokens, bad_words, repetition penalty, frequency/presence penalties. Position j of a
    request sees the output as the plain sampler would at that token: the output so far followed by
    the first j drafts (min_tokens counts them, bad words match against them, penalties count them)."""
    out = logits
    for i, state in enumerate(states):
        params = state.params
        first, n, d = starts[i], 1 + len(drafts[i]), drafts[i]
        below_min = max(0, min(n, params.min_tokens - len(state.output_token_ids)))
        penalized = params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        if (params.allowed_token_ids is None and not params.logit_bias and not below_min
                and not state.bad_words_token_ids and not penalized):
            continue
        if out is logits:
            out = logits.clone()
        rows = out[first : first + n]
        vocab, device = rows.shape[1], rows.device
        if params.allowed_token_ids is not None:
            keep = torch.full((vocab,), float("-inf"), device=device)
            keep[torch.tensor(params.allowed_token_ids, device=device)] = 0.0
            rows += keep
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), device=device)
            rows[:, ids] += torch.tensor(list(params.logit_bias.values()), device=device, dtype=rows.dtype)
        if below_min:
            blocked = sorted(t for t in set(state.eos_token_ids) | set(params.stop_token_ids or ()) if 0 <= t < vocab)
            if blocked:
                rows[:below_min, torch.tensor(blocked, device=device)] = float("-inf")
        if state.bad_words_token_ids:
            for j in range(n):
                banned = [t for t in state.bad_words_trie.banned(state.output_token_ids, d[:j]) if 0 <= t < vocab]
                if banned:
                    rows[j, torch.tensor(banned, device=device)] = float("-inf")
        if penalized:
            rows.copy_(_penalize(rows, state, d))
    return out


def _penalize(rows: torch.Tensor, state, drafts: list[int]) -> torch.Tensor:
    """HF repetition penalty over prompt + output, then OpenAI frequency/presence penalties over the
    output, where position j's output also holds the first j drafts."""
    params, (n, vocab), device = state.params, rows.shape, rows.device
    output = torch.tensor(state.output_token_ids, dtype=torch.long, device=device)
    base = torch.bincount(output, minlength=vocab)[:vocab].to(rows.dtype)
    counts = base.repeat(n, 1)
    for j, token in enumerate(drafts):
        counts[j + 1 :, token] += 1
    present = counts > 0
    x = rows
    if params.repetition_penalty != 1.0:
        prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        prompt_seen[torch.tensor(state.prompt_token_ids, dtype=torch.long, device=device)] = True
        rep = params.repetition_penalty
        x = torch.where(present | prompt_seen, torch.where(x > 0, x / rep, x * rep), x)
    if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
        x = x - params.frequency_penalty * counts - params.presence_penalty * present.to(x.dtype)
    return x
