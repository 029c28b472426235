"""Turn one step's logits into one sampled token per running request.

Order of operations per row (vLLM-like):
  raw logprobs (log_softmax of the model's logits, reported to the user)
  -> structured output (the grammar's token bitmask: disallowed tokens get -inf) -> logit_bias -> min_tokens (mask EOS and stop ids) -> bad_words
  -> repetition penalty (HF, prompt+output) -> frequency/presence penalties (OpenAI, output)
  -> greedy rows: argmax
  -> random rows: / temperature -> top-k/top-p/min-p -> softmax -> exponential race.

The exponential race (argmax of probs / Exp(1) noise) draws a request's noise from its own
generator when it has one, so a seeded request samples the same tokens whatever else is
in the batch. That generator is made on the device of the logits it samples (CUDA
sampling needs a CUDA generator). Per-row Python work is done only for rows whose
parameters need it.

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

import torch

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.kernels import apply_top_k_top_p_min_p

# (token_id, logprob, rank); rank is 1-based among the whole vocabulary.
Logprob = tuple[int, float, int]

# Exponential noise of exactly 0 would turn a zero probability into NaN (0/0).
_MIN_NOISE = 1e-20

# Test hook: called with a request id before its row is processed; raising fails that request.
FaultInjector = Callable[[str], None]


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


@dataclass
class SamplingState:
    """The sampler's view of one running request; the engine owns and updates it."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    # Per-request generator seeded from params.seed; None = the sampler's shared one.
    generator: torch.Generator | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # Blocked (with params.stop_token_ids) while len(output_token_ids) < params.min_tokens.
    eos_token_ids: set[int] = field(default_factory=set)
    request_id: str = ""
    # Draws a seeded request's generator skips when it is made: one per output token sampled elsewhere
    # (a prefill/decode continuation), so it goes on exactly where the producer's generator stopped.
    pending_draws: int = 0

    def generator_for(self, device: torch.device) -> torch.Generator | None:
        """The request's own generator on `device` (made there on first use); None if unseeded."""
        if self.params.seed is None:
            return None
        if self.generator is None or self.generator.device != device:
            self.generator = make_generator(self.params.seed, device)
        return self.generator

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: list[int],
        eos_token_ids: set[int] | None = None,
        bad_words_token_ids: list[list[int]] | None = None,
        request_id: str = "",
    ) -> SamplingState:
        """The generator of a seeded request is made lazily, on the device of its first logits."""
        return cls(
            params=params,
            prompt_token_ids=list(prompt_token_ids),
            output_token_ids=[],
            bad_words_token_ids=list(bad_words_token_ids or []),
            eos_token_ids=set(eos_token_ids or ()),
            request_id=request_id,
        )


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one sampled token per row (-1 for a row in `errors`)
    # Per row: None if params.logprobs is None, else [sampled] + top-`logprobs` entries by rank.
    logprobs: list[list[Logprob] | None]
    # Row -> why that row's request failed (its token and logprobs are meaningless).
    errors: dict[int, str] = field(default_factory=dict)


def describe_failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
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
        logits = logits.to(torch.float32)
        errors: dict[int, str] = {}
        masked = logits
        if token_bitmask is not None and bitmask_rows:
            from pagedserve.engine.structured_output.bitmask import apply_token_bitmask  # xgrammar loads lazily

            masked = apply_token_bitmask(logits, token_bitmask, bitmask_rows)
        processed = _apply_logits_processors(masked, states, errors, self.fault_injector)
        random_states = [s for i, s in enumerate(states) if i not in errors and not s.params.greedy]
        noise = self._draw_noise(logits, states, errors) if random_states else None
        if not errors:
            return self._sample_rows(logits, processed, noise, states)
        # Drop the failed rows; the others go on exactly as in a batch without them.
        ok = [i for i in range(len(states)) if i not in errors]
        out = SamplerOutput(token_ids=[-1] * len(states), logprobs=[None] * len(states), errors=errors)
        if ok:
            part = self._sample_rows(
                logits[ok], processed[ok], None if noise is None else noise[ok], [states[i] for i in ok]
            )
            for i, token, lp in zip(ok, part.token_ids, part.logprobs):
                out.token_ids[i] = token
                out.logprobs[i] = lp
        return out

    def _sample_rows(
        self, logits: torch.Tensor, processed: torch.Tensor, noise: torch.Tensor | None, states: list[SamplingState]
    ) -> SamplerOutput:
        logprob_rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        greedy = [s.params.greedy for s in states]
        if all(greedy):
            sampled = processed.argmax(dim=-1)
        else:
            sampled = torch.empty(len(states), dtype=torch.long, device=logits.device)
            greedy_rows = [i for i, g in enumerate(greedy) if g]
            random_rows = [i for i, g in enumerate(greedy) if not g]
            if greedy_rows:
                sampled[greedy_rows] = processed[greedy_rows].argmax(dim=-1)
            rows = processed if not greedy_rows else processed[random_rows]
            rows_noise = noise if not greedy_rows else noise[random_rows]
            sampled[random_rows] = self._sample_random(rows, rows_noise, [states[i] for i in random_rows])

        token_ids = sampled.tolist()
        logprobs: list[list[Logprob] | None] = [None] * len(states)
        if logprob_rows:
            raw_logprobs = torch.log_softmax(logits[logprob_rows], dim=-1)
            num_top = [states[i].params.logprobs or 0 for i in logprob_rows]
            entries = _gather_logprobs(raw_logprobs, sampled[logprob_rows], num_top)
            for i, row_entries in zip(logprob_rows, entries):
                logprobs[i] = row_entries
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    def _draw_noise(self, logits: torch.Tensor, states: list[SamplingState], errors: dict[int, str]) -> torch.Tensor:
        """Exp(1) noise for the random rows that have not failed (other rows stay unset): the shared
        generator fills the unseeded rows in one draw, each seeded row draws a fresh [V] row from its own."""
        device = logits.device
        noise = torch.empty_like(logits)
        rows = [i for i, s in enumerate(states) if i not in errors and not s.params.greedy]
        shared_rows = [i for i in rows if states[i].params.seed is None]
        if len(shared_rows) == len(states):
            noise.exponential_(generator=self._shared_generator(device))
        elif shared_rows:
            shared = torch.empty(len(shared_rows), logits.shape[1], device=device)
            noise[shared_rows] = shared.exponential_(generator=self._shared_generator(device))
        for i in rows:
            if states[i].params.seed is None:
                continue
            try:
                # A fresh [V] buffer per row keeps the draw independent of batch layout.
                row = torch.empty(logits.shape[1], device=device)
                generator = states[i].generator_for(device)
                while states[i].pending_draws:
                    row.exponential_(generator=generator)
                    states[i].pending_draws -= 1
                noise[i] = row.exponential_(generator=generator)
            except Exception as exc:  # this request's generator: fail it alone
                errors[i] = describe_failure(exc)
        return noise.clamp_(min=_MIN_NOISE)

    def _sample_random(self, logits: torch.Tensor, noise: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Temperature, top-k/top-p/min-p and the exponential race for non-greedy rows."""
        device = logits.device
        params = [s.params for s in states]
        temps = [p.temperature for p in params]
        if any(t != 1.0 for t in temps):
            logits = logits / torch.tensor(temps, dtype=torch.float32, device=device).unsqueeze(1)
        top_k = top_p = min_p = None
        if any(p.top_k > 0 for p in params):
            vocab = logits.shape[1]  # a top_k above the vocabulary keeps it all (and fits int32)
            top_k = torch.tensor([min(p.top_k, vocab) for p in params], dtype=torch.int32, device=device)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        if top_k is not None or top_p is not None or min_p is not None:
            logits = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
        probs = torch.softmax(logits, dim=-1)
        return probs.div_(noise).argmax(dim=-1)


def _apply_logits_processors(
    logits: torch.Tensor,
    states: list[SamplingState],
    errors: dict[int, str],
    fault_injector: FaultInjector | None = None,
) -> torch.Tensor:
    """allowed_token_ids, logit_bias, min_tokens, bad_words and penalties; returns `logits` untouched
    when no row needs any of them (the common case). A row that raises is recorded in `errors`."""
    out = logits
    copied = False

    def writable() -> torch.Tensor:
        nonlocal out, copied
        if not copied:
            out = logits.clone()
            copied = True
        return out

    for i, s in enumerate(states):
        try:
            if fault_injector is not None:
                fault_injector(s.request_id)
            _process_row(logits, i, s, writable)
        except Exception as exc:
            errors[i] = describe_failure(exc)

    penalty_rows = [
        i
        for i, s in enumerate(states)
        if i not in errors
        and (
            s.params.repetition_penalty != 1.0
            or s.params.frequency_penalty != 0.0
            or s.params.presence_penalty != 0.0
        )
    ]
    if penalty_rows:
        try:
            _apply_penalties(writable(), penalty_rows, states)
        except Exception:  # find the row(s) at fault; the batch writes nothing before it succeeds
            for i in penalty_rows:
                try:
                    _apply_penalties(out, [i], states)
                except Exception as exc:
                    errors[i] = describe_failure(exc)
    return out


def _process_row(
    logits: torch.Tensor, i: int, s: SamplingState, writable: Callable[[], torch.Tensor]
) -> None:
    """The per-request logits processors of row i (penalties are batched separately)."""
    p = s.params
    vocab = logits.shape[1]
    if p.allowed_token_ids is not None:
        _check_ids(p.allowed_token_ids, vocab, "allowed_token_ids")
        idx = torch.tensor(p.allowed_token_ids, dtype=torch.long, device=logits.device)
        row = writable()[i]
        kept = row[idx].clone()
        row.fill_(float("-inf"))
        row[idx] = kept
    if p.logit_bias:
        ids = list(p.logit_bias)
        _check_ids(ids, vocab, "logit_bias")
        idx = torch.tensor(ids, dtype=torch.long, device=logits.device)
        bias = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32, device=logits.device)
        writable()[i].index_add_(0, idx, bias)
    if len(s.output_token_ids) < p.min_tokens:
        banned = [t for t in set(p.stop_token_ids) | s.eos_token_ids if 0 <= t < vocab]
        if banned:
            writable()[i, banned] = float("-inf")
    if s.bad_words_token_ids:
        banned = _banned_bad_word_tokens(s.bad_words_token_ids, s.output_token_ids)
        _check_ids(banned, vocab, "bad_words")
        if banned:
            writable()[i, banned] = float("-inf")


def _check_ids(ids: list[int], vocab: int, field_name: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{field_name}: token ids {bad} are outside the vocabulary (size {vocab})")


def _banned_bad_word_tokens(bad_words: list[list[int]], output: list[int]) -> list[int]:
    """Last token of every bad word whose earlier tokens end the output so far."""
    banned = []
    for word in bad_words:
        prefix = word[:-1]
        if not prefix or (len(output) >= len(prefix) and output[-len(prefix) :] == prefix):
            banned.append(word[-1])
    return banned


def _token_counts(seqs: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(seqs), vocab] occurrence counts, built in one scatter over a padded batch."""
    max_len = max((len(x) for x in seqs), default=0)
    counts = torch.zeros(len(seqs), vocab + 1, dtype=torch.float32, device=device)
    if max_len:
        padded = torch.full((len(seqs), max_len), vocab, dtype=torch.long, device=device)
        for r, x in enumerate(seqs):
            if x:
                padded[r, : len(x)] = torch.tensor(x, dtype=torch.long)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]


def _apply_penalties(logits: torch.Tensor, rows: list[int], states: list[SamplingState]) -> None:
    vocab, device = logits.shape[1], logits.device
    sel = [states[i] for i in rows]
    rep = torch.tensor([s.params.repetition_penalty for s in sel], device=device).unsqueeze(1)
    freq = torch.tensor([s.params.frequency_penalty for s in sel], device=device).unsqueeze(1)
    pres = torch.tensor([s.params.presence_penalty for s in sel], device=device).unsqueeze(1)

    output_counts = _token_counts([s.output_token_ids for s in sel], vocab, device)
    prompt_counts = _token_counts([s.prompt_token_ids for s in sel], vocab, device)
    x = logits[rows]
    # HF repetition penalty over prompt + output tokens.
    seen = (output_counts > 0) | (prompt_counts > 0)
    penalized = torch.where(x > 0, x / rep, x * rep)
    x = torch.where(seen & (rep != 1.0), penalized, x)
    # OpenAI frequency / presence penalties over output tokens.
    x = x - freq * output_counts - pres * (output_counts > 0).to(x.dtype)
    logits[rows] = x


def _gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]
) -> list[list[Logprob]]:
    """[chosen token] + top-`num_top[r]` (id, logprob, rank) per row of a [R, V] logprob tensor."""
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.long).unsqueeze(1)
    chosen = logprobs.gather(1, token_ids)
    # Competition rank: 1 + number of tokens strictly more likely.
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    k = max(num_top, default=0)
    if k:
        top_vals, top_ids = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
        top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
    chosen_l, ids_l, ranks_l = chosen.squeeze(1).tolist(), token_ids.squeeze(1).tolist(), ranks.tolist()
    result = []
    for r, n in enumerate(num_top):
        entries: list[Logprob] = [(ids_l[r], chosen_l[r], ranks_l[r])]
        if n:
            entries += [(top_ids_l[r][j], top_vals_l[r][j], j + 1) for j in range(min(n, len(top_ids_l[r])))]
        result.append(entries)
    return result


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, num_top: int
) -> list[list[Logprob]]:
    """Logprobs of each prompt token given its prefix: logits [P, V] at positions 0..P-1
    predicting target_ids [P] (the next prompt token); same entry format as the sampler."""
    if logits.dim() != 2 or target_ids.dim() != 1 or target_ids.shape[0] != logits.shape[0]:
        raise ValueError(
            f"logits must be [P, V] and target_ids [P]; got {tuple(logits.shape)} and {tuple(target_ids.shape)}"
        )
    if num_top < 0:
        raise ValueError(f"prompt_logprobs must be >= 0, got {num_top}")
    if logits.shape[0] == 0:
        return []
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return _gather_logprobs(logprobs, target_ids, [num_top] * logits.shape[0])
