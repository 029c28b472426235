"""Turn one step's logits into one sampled token per running request.

Order of operations per row (vLLM-like):
  raw logprobs (log_softmax of the model's logits, reported to the user)
  -> structured output (the grammar's token bitmask: disallowed tokens get -inf) -> allowed_token_ids
  -> logit_bias -> min_tokens (mask EOS and stop ids) -> bad_words
  -> repetition penalty (HF, prompt+output) -> frequency/presence penalties (OpenAI, output)
  -> greedy rows: argmax
  -> random rows: / temperature -> top-k/top-p/min-p -> softmax -> exponential race.

Every step is batched: the sampler keeps each request's parameters, logit_bias, masks and penalty
counts as persistent tensors (`sampling_batch.SamplingBatch`, built when the request is first seen,
counts updated by the new output tokens only) and applies each processor once over all of its rows
(`processors.py`). Per-row Python work is done only for rows whose parameters need it: bad_words
(they depend on the output's suffix: a walk of the request's bad-words trie, `bad_words.py`) and
a seeded row's own draw. A batch of greedy rows with no
processor and no logprobs is one argmax.

The exponential race (argmax of probs / Exp(1) noise) draws a request's noise from its own
generator when it has one, so a seeded request samples the same tokens whatever else is
in the batch. That generator is made on the device of the logits it samples (CUDA
sampling needs a CUDA generator).

Logprobs are those of the raw distribution, before the grammar mask and every other processor
(vLLM's default), so a constrained request's logprobs mean the same as an unconstrained one's.

Failures are kept to their request: the per-row work (logits processors, a seeded
row's noise) runs guarded, a row that raises is reported in `SamplerOutput.errors` and
left out of the rest of the step, and the other rows sample exactly as they would
without it (no generator has drawn before a row is dropped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.engine.failures import describe_failure
from pagedserve.engine.sample.logprobs import Logprob, compute_prompt_logprobs, gather_logprobs
from pagedserve.engine.sample.processors import apply_processors
from pagedserve.engine.sample.sampling_batch import (
    F_MIN_P,
    F_TEMP,
    F_TOP_P,
    I_LOGPROBS,
    I_TOP_K,
    BatchView,
    SamplingBatch,
)
from pagedserve.engine.sample.state import SamplingState
from pagedserve.kernels import apply_top_k_top_p_min_p, greedy_argmax

__all__ = [
    "FaultInjector", "Logprob", "Sampler", "SamplerOutput", "SamplingState",
    "compute_prompt_logprobs",
]

# Exponential noise of exactly 0 would turn a zero probability into NaN (0/0).
_MIN_NOISE = 1e-20

# Test hook: called with a request id before its row is processed; raising fails that request.
FaultInjector = Callable[[str], None]

# Per-row sampling parameters of the race: (temperature, top_k, top_p, min_p), None = not needed.
_RaceParams = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one sampled token per row (-1 for a row in `errors`)
    # Per row: None if params.logprobs is None, else [sampled] + top-`logprobs` entries by rank.
    logprobs: list[list[Logprob] | None]
    # Row -> why that row's request failed (its token and logprobs are meaningless).
    errors: dict[int, str] = field(default_factory=dict)


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._batch: SamplingBatch | None = None
        self.fault_injector: FaultInjector | None = None

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._generators[device] = gen
        return gen

    def _batch_for(self, logits: torch.Tensor) -> SamplingBatch:
        batch = self._batch
        if batch is None or batch.vocab_size != logits.shape[1] or batch.device != logits.device:
            batch = self._batch = SamplingBatch(logits.shape[1], logits.device)
        return batch

    def release(self, state: SamplingState) -> None:
        """Forget a finished request's persistent rows (the runner calls this when it drops one)."""
        if self._batch is not None:
            self._batch.release(state)

    def process_positions(
        self, logits: torch.Tensor, states: list[SamplingState], drafts: list[list[int]]
    ) -> tuple[torch.Tensor, dict[int, str]]:
        """The logits processors at a speculating step's verified positions, by the same batched rules
        as `sample`: `logits` holds 1 + len(drafts[i]) rows per state, in order, and row j of state i is
        processed as `sample` would process it once the output held drafts[i][:j]. Returns the float32
        processed logits and, per state index that cannot be processed, why (its rows mean nothing)."""
        logits = logits.to(torch.float32)
        row_states: list[SamplingState] = []
        extra: list[list[int]] = []
        owner: list[int] = []
        for i, (state, d) in enumerate(zip(states, drafts)):
            for j in range(len(d) + 1):
                row_states.append(state)
                extra.append(d[:j])
                owner.append(i)
        if not row_states:
            return logits, {}
        batch = self._batch_for(logits)
        view = batch.prepare(row_states, key="positions")
        try:
            errors = {r: view.entries[r].error or "" for r in view.error_rows}
            processed = apply_processors(logits, batch, view, errors, extra)
        finally:
            view.states = []  # the cached view must not keep finished requests alive
        failed: dict[int, str] = {}
        for r in sorted(errors):
            failed.setdefault(owner[r], errors[r])
        return processed, failed

    def sample(
        self,
        logits: torch.Tensor,
        states: list[SamplingState],
        token_bitmask: torch.Tensor | None = None,
        bitmask_rows: list[int] | None = None,
    ) -> SamplerOutput:
        """One token per row. `token_bitmask` (one row per entry of `bitmask_rows`) limits those rows
        to the tokens their grammar allows."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"logits must be [num_states, vocab]; got {tuple(logits.shape)} for {len(states)} states"
            )
        if not states:
            return SamplerOutput(token_ids=[], logprobs=[])
        view = self._batch_for(logits).prepare(states)
        try:
            return self._sample(logits, view, token_bitmask, bitmask_rows)
        finally:
            view.states = []  # the cached view must not keep finished requests alive

    def _sample(
        self, logits: torch.Tensor, view: BatchView, token_bitmask: torch.Tensor | None, bitmask_rows: list[int] | None
    ) -> SamplerOutput:
        states, batch = view.states, self._batch
        errors = self._row_errors(view)
        constrained = token_bitmask is not None and bool(bitmask_rows)
        if view.plain_greedy and not constrained and not errors:
            return SamplerOutput(token_ids=greedy_argmax(logits).tolist(), logprobs=[None] * len(states))
        logits = logits.to(torch.float32)
        masked = logits
        if constrained:
            from pagedserve.engine.structured_output.bitmask import apply_token_bitmask  # xgrammar loads lazily

            masked = apply_token_bitmask(logits, token_bitmask, bitmask_rows)
        processed = apply_processors(masked, batch, view, errors)
        random_rows = view.random_rows
        if errors:
            random_rows = np.asarray([r for r in random_rows.tolist() if r not in errors], dtype=np.int64)
        noise = self._draw_noise(logits, view, random_rows, errors) if len(random_rows) else None
        return self._sample_rows(logits, processed, noise, view, random_rows, errors)

    def _row_errors(self, view: BatchView) -> dict[int, str]:
        """The fault injector's failures, then rows that cannot be sampled (ids outside the vocabulary)."""
        errors: dict[int, str] = {}
        if self.fault_injector is not None:
            for i, s in enumerate(view.states):
                try:
                    self.fault_injector(s.request_id)
                except Exception as exc:
                    errors[i] = describe_failure(exc)
        for i in view.error_rows:
            errors.setdefault(i, view.entries[i].error or "")
        return errors

    def _draw_noise(
        self, logits: torch.Tensor, view: BatchView, random_rows: np.ndarray, errors: dict[int, str]
    ) -> torch.Tensor:
        """Exp(1) noise, one row per entry of `random_rows`: the shared generator fills the unseeded rows
        in one draw, each seeded row draws a fresh [V] row from its own (a failure there joins `errors`)."""
        device, vocab = logits.device, logits.shape[1]
        noise = torch.empty(len(random_rows), vocab, device=device)
        seeded = view.seeded[random_rows]
        if not seeded.any():
            noise.exponential_(generator=self._shared_generator(device))
            return noise.clamp_(min=_MIN_NOISE)
        shared = np.flatnonzero(~seeded)
        if len(shared):
            draw = torch.empty(len(shared), vocab, device=device).exponential_(generator=self._shared_generator(device))
            noise[torch.from_numpy(shared).to(device)] = draw
        for pos in np.flatnonzero(seeded).tolist():
            i = int(random_rows[pos])
            state = view.states[i]
            try:
                # One contiguous [V] row per draw (whatever the batch layout): the same numbers as a
                # fresh [V] buffer, drawn in place.
                row = noise[pos]
                generator = state.generator_for(device)
                while state.pending_draws:
                    row.exponential_(generator=generator)
                    state.pending_draws -= 1
                row.exponential_(generator=generator)
            except Exception as exc:  # this request's generator: fail it alone
                errors[i] = describe_failure(exc)
        return noise.clamp_(min=_MIN_NOISE)

    def _sample_rows(
        self,
        logits: torch.Tensor,
        processed: torch.Tensor,
        noise: torch.Tensor | None,
        view: BatchView,
        random_rows: np.ndarray,
        errors: dict[int, str],
    ) -> SamplerOutput:
        """Greedy rows take the argmax, random rows race; failed rows (`errors`) are left out, so the
        others see exactly what they would in a batch without them."""
        num_rows, device = view.num_rows, logits.device
        if errors:
            # A seeded row may have failed while drawing: its noise row is dropped with it.
            keep = [p for p, r in enumerate(random_rows.tolist()) if r not in errors]
            if noise is not None and len(keep) < len(random_rows):
                noise = noise[torch.tensor(keep, dtype=torch.long).to(device)]
            random_rows = random_rows[keep]
            greedy_rows = np.asarray([r for r in view.greedy_rows.tolist() if r not in errors], dtype=np.int64)
            lp_rows = np.asarray([r for r in view.logprob_rows.tolist() if r not in errors], dtype=np.int64)
            params = self._race_params(view, random_rows)
        else:
            greedy_rows, lp_rows, params = view.greedy_rows, view.logprob_rows, None
        if not errors and not len(random_rows):
            sampled = greedy_argmax(processed)
        elif not errors and len(random_rows) == num_rows:
            sampled = self._race(processed, noise, self._race_params(view, None))
        else:
            sampled = torch.full((num_rows,), -1, dtype=torch.long, device=device)
            if len(greedy_rows):
                index = _index(view, greedy_rows, "greedy", not errors)
                sampled[index] = greedy_argmax(processed[index])
            if len(random_rows):
                index = _index(view, random_rows, "random", not errors)
                sampled[index] = self._race(processed[index], noise, params or self._race_params(view, None))
        token_ids = sampled.tolist()
        logprobs: list[list[Logprob] | None] = [None] * num_rows
        if len(lp_rows):
            whole = len(lp_rows) == num_rows
            index = None if whole else _index(view, lp_rows, "logprobs", not errors)
            raw = torch.log_softmax(logits if whole else logits[index], dim=-1)
            entries = gather_logprobs(raw, sampled if whole else sampled[index], view.i[lp_rows, I_LOGPROBS].tolist())
            for r, row_entries in zip(lp_rows.tolist(), entries):
                logprobs[r] = row_entries
        for r in errors:
            token_ids[r] = -1
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, errors=errors)

    @staticmethod
    def _race_params(view: BatchView, rows: np.ndarray | None) -> _RaceParams:
        """Temperature / top-k / top-p / min-p tensors of the random rows (None where no row needs one);
        those of the view's own random rows are made once per batch composition."""
        if rows is None and "race" in view.cache:
            return view.cache["race"]
        rows = view.random_rows if rows is None else rows
        f, i = view.f[rows], view.i[rows]
        temps, top_p, min_p = f[:, F_TEMP], f[:, F_TOP_P], f[:, F_MIN_P]
        top_k = i[:, I_TOP_K].astype(np.int32)
        device = view.device
        params = (
            _tensor(temps, device) if (temps != 1.0).any() else None,
            _tensor(top_k, device) if (top_k > 0).any() else None,
            _tensor(top_p, device) if (top_p < 1.0).any() else None,
            _tensor(min_p, device) if (min_p > 0.0).any() else None,
        )
        if rows is view.random_rows:
            view.cache["race"] = params
        return params

    @staticmethod
    def _race(logits: torch.Tensor, noise: torch.Tensor, params: _RaceParams) -> torch.Tensor:
        """Temperature, top-k/top-p/min-p and the exponential race for non-greedy rows."""
        temps, top_k, top_p, min_p = params
        if temps is not None:
            logits = logits / temps.unsqueeze(1)
        if top_k is not None or top_p is not None or min_p is not None:
            logits = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
        probs = torch.softmax(logits, dim=-1)
        return greedy_argmax(probs.div_(noise))


def _index(view: BatchView, rows: np.ndarray, name: str, cached: bool) -> torch.Tensor:
    """`rows` as a device index; the view's own row sets are uploaded once per batch composition."""
    if not cached:
        return _tensor(rows, view.device)
    index = view.cache.get(name)
    if index is None:
        index = view.cache[name] = _tensor(rows, view.device)
    return index


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)


def _apply_logits_processors(
    logits: torch.Tensor,
    states: list[SamplingState],
    errors: dict[int, str],
    fault_injector: FaultInjector | None = None,
) -> torch.Tensor:
    """The processors alone, over a throwaway batch (tests compare them with reference processors)."""
    batch = SamplingBatch(logits.shape[1], logits.device)
    view = batch.prepare(states)
    sampler = Sampler()
    sampler.fault_injector = fault_injector
    errors.update(sampler._row_errors(view))
    return apply_processors(logits, batch, view, errors)
