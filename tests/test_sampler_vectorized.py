"""The vectorized sampler against a per-row reference, over random batches that change every step.

The reference below processes one row at a time with plain Python bookkeeping (a Counter of the
output, a set of the prompt) and draws the shared noise exactly as the sampler's contract says
(one [unseeded random rows, V] draw in batch order, then a fresh [V] row per seeded row from its own
generator). The vectorized sampler must give exactly its tokens, logprobs and errors while requests
come, go and change places between steps.
"""

from __future__ import annotations

import gc
import zlib
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.engine.sample.processors import apply_processors
from pagedserve.engine.sample.sampler import Sampler, SamplingState
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.kernels import apply_top_k_top_p_min_p

V = 24
MIN_NOISE = 1e-20


# ---------------------------------------------------------------------------- the reference


def _check(ids, field):
    bad = [t for t in ids if not 0 <= t < V]
    if bad:
        raise ValueError(f"{field}: token ids {bad} are outside the vocabulary (size {V})")


def _process_row(x: torch.Tensor, s: SamplingState) -> torch.Tensor:
    """One row [1, V] through every processor, in the documented order."""
    p, out = s.params, s.output_token_ids
    if p.allowed_token_ids is not None:
        _check(p.allowed_token_ids, "allowed_token_ids")
        keep = torch.full((1, V), float("-inf"))
        keep[0, p.allowed_token_ids] = x[0, p.allowed_token_ids]
        x = keep
    if p.logit_bias:
        _check(list(p.logit_bias), "logit_bias")
        for t, b in p.logit_bias.items():
            x[0, t] = x[0, t] + torch.tensor(b, dtype=torch.float32)
    if len(out) < p.min_tokens:
        for t in (set(p.stop_token_ids) | s.eos_token_ids) & set(range(V)):
            x[0, t] = float("-inf")
    banned = [
        w[-1] for w in s.bad_words_token_ids if len(w) == 1 or (len(out) >= len(w) - 1 and out[-(len(w) - 1) :] == w[:-1])
    ]
    _check(banned, "bad_words")
    for t in banned:
        x[0, t] = float("-inf")
    if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
        counts = torch.zeros(1, V)
        for t, c in Counter(out).items():
            counts[0, t] = float(c)
        seen = torch.zeros(1, V, dtype=torch.bool)
        seen[0, sorted(set(s.prompt_token_ids) | set(out))] = True
        rep = torch.tensor([[p.repetition_penalty]])
        freq = torch.tensor([[p.frequency_penalty]])
        pres = torch.tensor([[p.presence_penalty]])
        x = torch.where(seen & (rep != 1.0), torch.where(x > 0, x / rep, x * rep), x)
        x = x - freq * counts - pres * (counts > 0).to(x.dtype)
    return x


def reference_sample(logits: torch.Tensor, states: list[SamplingState], shared: torch.Generator, failing: set[int]):
    errors: dict[int, str] = {i: "RuntimeError: injected" for i in failing}
    processed: dict[int, torch.Tensor] = {}
    for i, s in enumerate(states):
        if i in errors:
            continue
        try:
            processed[i] = _process_row(logits[i : i + 1].clone(), s)
        except ValueError as exc:
            errors[i] = f"ValueError: {exc}"
    random_rows = [i for i in processed if not states[i].params.greedy]
    noise: dict[int, torch.Tensor] = {}
    unseeded = [i for i in random_rows if states[i].params.seed is None]
    if unseeded:
        draw = torch.empty(len(unseeded), V).exponential_(generator=shared)
        noise.update({i: draw[j : j + 1] for j, i in enumerate(unseeded)})
    for i in random_rows:
        s = states[i]
        if s.params.seed is not None:
            gen = s.generator_for(torch.device("cpu"))
            row = torch.empty(V)
            for _ in range(s.pending_draws):
                row.exponential_(generator=gen)
            s.pending_draws = 0
            noise[i] = row.exponential_(generator=gen).unsqueeze(0)
    tokens, logprobs = [-1] * len(states), [None] * len(states)
    for i, x in processed.items():
        p = states[i].params
        if p.greedy:
            tokens[i] = int(x.argmax())
        else:
            x = x / torch.tensor([p.temperature])
            top_k = torch.tensor([min(p.top_k, V)], dtype=torch.int32) if p.top_k > 0 else None
            top_p = torch.tensor([p.top_p]) if p.top_p < 1.0 else None
            min_p = torch.tensor([p.min_p]) if p.min_p > 0.0 else None
            if top_k is not None or top_p is not None or min_p is not None:
                x = apply_top_k_top_p_min_p(x, top_k, top_p, min_p)
            tokens[i] = int((torch.softmax(x, dim=-1) / noise[i].clamp(min=MIN_NOISE)).argmax())
        if p.logprobs is not None:
            raw = torch.log_softmax(logits[i], dim=-1)
            chosen = raw[tokens[i]]
            entries = [(tokens[i], chosen.item(), int((raw > chosen).sum()) + 1)]
            if p.logprobs:
                vals, ids = raw.topk(min(p.logprobs, V))
                entries += [(int(t), v, r + 1) for r, (t, v) in enumerate(zip(ids.tolist(), vals.tolist()))]
            logprobs[i] = entries
    return tokens, logprobs, errors, processed


# ---------------------------------------------------------------------------- random requests

token = st.integers(0, V - 1)
maybe_out_of_vocab = st.integers(0, V + 2)
params_st = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.sampled_from([0.0, 0.5, 1.0, 1.7]),
        "top_k": st.sampled_from([-1, 0, 1, 3, V, 2**31]),
        "top_p": st.sampled_from([1.0, 0.9, 0.4]),
        "min_p": st.sampled_from([0.0, 0.05, 0.3]),
        "seed": st.integers(-(2**63), 2**64 - 1),
        "repetition_penalty": st.sampled_from([1.0, 0.7, 1.3, 2.0]),
        "frequency_penalty": st.floats(-2.0, 2.0),
        "presence_penalty": st.floats(-2.0, 2.0),
        "logit_bias": st.dictionaries(maybe_out_of_vocab, st.floats(-100.0, 100.0), max_size=4),
        "allowed_token_ids": st.lists(maybe_out_of_vocab, min_size=1, max_size=8),
        "min_tokens": st.integers(0, 5),
        "stop_token_ids": st.lists(st.integers(0, V + 2), max_size=3),
        "logprobs": st.sampled_from([0, 1, 3, V + 4]),
    },
)
request_st = st.fixed_dictionaries(
    {
        "params": params_st,
        "prompt": st.lists(token, min_size=1, max_size=12),
        "output": st.lists(token, max_size=4),  # tokens sampled elsewhere (a PD continuation)
        "eos": st.sets(st.integers(0, V + 1), max_size=2),
        "bad_words": st.lists(st.lists(st.integers(0, V), min_size=1, max_size=3), max_size=3),
    }
)


def make_states(req: dict, rid: str) -> tuple[SamplingState, SamplingState]:
    """Two independent copies of one request: the sampler's and the reference's."""
    params = SamplingParams(**req["params"])
    pair = []
    for _ in range(2):
        s = SamplingState.create(params, req["prompt"], set(req["eos"]), req["bad_words"], request_id=rid)
        s.output_token_ids.extend(req["output"])
        s.pending_draws = len(req["output"]) if params.seed is not None and not params.greedy else 0
        pair.append(s)
    return pair[0], pair[1]


def logits_for(rid: str, step: int) -> torch.Tensor:
    """A request's logits depend only on the request and its step (so a seeded row's inputs are the
    same whatever batch it is in)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{rid}/{step}".encode()))
    return torch.randn(V, generator=gen) * 3


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_vectorized_sampler_equals_reference(data):
    sampler = Sampler(seed=data.draw(st.integers(0, 1000), label="sampler seed"))
    shared = torch.Generator().manual_seed(sampler._seed)
    live: dict[str, tuple[SamplingState, SamplingState, int]] = {}  # rid -> (sampler's, reference's, steps)
    failing_ids: set[str] = set()
    sampler.fault_injector = lambda rid: _raise_if(rid in failing_ids)
    next_id = 0
    dropped = False  # a state was left to the garbage collector (finished without release, or failed)
    for step in range(data.draw(st.integers(1, 7), label="steps")):
        for req in data.draw(st.lists(request_st, max_size=4), label=f"new requests, step {step}"):
            rid = f"r{next_id}"
            next_id += 1
            mine, ref = make_states(req, rid)
            live[rid] = (mine, ref, 0)
        for rid in data.draw(st.lists(st.sampled_from(sorted(live)), unique=True), label="finish") if live else []:
            mine, _, _ = live.pop(rid)
            if data.draw(st.booleans(), label="released (else garbage collected)"):
                sampler.release(mine)
            else:
                dropped = True
        if dropped:  # a state a failure's traceback keeps in a cycle is young: collecting the two younger
            gc.collect(1)  # generations frees it (a full collection costs over 1 s per example in a full suite)
            dropped = False
        if not live:
            continue
        # This step's batch: a random subset of the live requests, in a random order.
        batch = data.draw(st.lists(st.sampled_from(sorted(live)), unique=True, min_size=1), label="batch")
        batch = data.draw(st.permutations(batch), label="order")
        failing_ids = set(data.draw(st.lists(st.sampled_from(batch), unique=True, max_size=1), label="fails"))
        logits = torch.stack([logits_for(rid, live[rid][2]) for rid in batch])
        mine_processed = _processed(sampler, logits, [live[rid][0] for rid in batch])
        out = sampler.sample(logits.clone(), [live[rid][0] for rid in batch])
        failing = {i for i, rid in enumerate(batch) if rid in failing_ids}
        tokens, logprobs, errors, processed = reference_sample(logits, [live[rid][1] for rid in batch], shared, failing)
        for i, row in processed.items():  # the processed logits themselves, not only the choice
            assert torch.equal(mine_processed[i], row[0]), (batch[i], mine_processed[i], row[0])
        assert out.errors == errors
        ok = [i for i in range(len(batch)) if i not in errors]
        assert [out.token_ids[i] for i in ok] == [tokens[i] for i in ok]
        assert [out.logprobs[i] for i in ok] == [logprobs[i] for i in ok]
        for i, rid in enumerate(batch):
            mine, ref, steps = live[rid]
            if i in errors:  # the engine finishes a failed request
                del live[rid]
                dropped = True
                continue
            mine.output_token_ids.append(out.token_ids[i])
            ref.output_token_ids.append(tokens[i])
            live[rid] = (mine, ref, steps + 1)


def _processed(sampler: Sampler, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """The processed logits from the sampler's own persistent rows (what its next sample() reads)."""
    view = sampler._batch_for(logits).prepare(states)
    try:
        return apply_processors(logits.clone(), sampler._batch, view, {})
    finally:
        view.states = []


def _raise_if(cond: bool) -> None:
    if cond:
        raise RuntimeError("injected")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_seeded_rows_do_not_depend_on_the_batch(data):
    """A seeded request's tokens are the same alone and among any companions, in any order."""
    req = data.draw(request_st, label="seeded request")
    req["params"] = {**req["params"], "seed": data.draw(st.integers(0, 2**32)), "temperature": 1.0}
    req["params"].pop("logit_bias", None)
    req["params"].pop("allowed_token_ids", None)  # keep it free of errors for this property
    req["bad_words"] = [w for w in req["bad_words"] if all(t < V for t in w)]
    steps = 6

    def run(companions: list[dict], positions: list[int]) -> list[int]:
        sampler = Sampler(seed=data.draw(st.integers(0, 100), label="sampler seed"))
        target, _ = make_states(req, "target")
        others = [make_states(c, f"c{j}")[0] for j, c in enumerate(companions)]
        for step in range(steps):
            states = list(others)
            pos = positions[step] % (len(states) + 1)
            states.insert(pos, target)
            logits = torch.stack([logits_for(s.request_id, step) for s in states])
            out = sampler.sample(logits, states)
            for j, s in enumerate(states):
                if j not in out.errors:
                    s.output_token_ids.append(out.token_ids[j])
            others = [s for j, s in enumerate(states) if s is not target and j not in out.errors]
        return target.output_token_ids[len(req["output"]):]

    alone = run([], [0] * steps)
    companions = data.draw(st.lists(request_st, min_size=1, max_size=5), label="companions")
    positions = data.draw(st.lists(st.integers(0, 10), min_size=steps, max_size=steps), label="positions")
    assert run(companions, positions) == alone


def test_rows_are_freed_by_release_and_by_garbage_collection():
    sampler = Sampler(seed=0)
    states = [SamplingState.create(SamplingParams(temperature=1.0, presence_penalty=0.5), [1, 2]) for _ in range(5)]
    sampler.sample(torch.randn(5, V), states)
    batch = sampler._batch
    assert len(batch) == 5
    sampler.release(states[0])
    sampler.release(states[0])  # twice is harmless
    assert len(batch) == 4
    states = states[3:]  # the sampler is the only other holder of states 1 and 2: they die
    gc.collect()
    sampler.sample(torch.randn(2, V), states)  # a step drains the collected ones
    assert len(batch) == 2
    # Freed rows are reused, and a reused penalty row starts from clean counts.
    fresh = SamplingState.create(SamplingParams(temperature=0.0, frequency_penalty=2.0), [0])
    logits = torch.zeros(1, V)
    logits[0, 7] = 1.0
    assert sampler.sample(logits, [fresh]).token_ids == [7]
    assert len(batch) == 3


def test_penalty_counts_follow_the_output_incrementally():
    """Counts built at add and topped up per step equal a rebuild from the whole output."""
    sampler = Sampler(seed=0)
    s = SamplingState.create(SamplingParams(temperature=0.0, frequency_penalty=0.3, repetition_penalty=1.2), [3, 3, 5])
    ref = SamplingState.create(s.params, [3, 3, 5])
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(1, V, generator=gen)
        got = sampler.sample(logits, [s]).token_ids[0]
        assert got == int(_process_row(logits.clone(), ref).argmax())
        s.output_token_ids.append(got)
        ref.output_token_ids.append(got)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_seeded_request_on_cuda():
    """A seeded request samples on CUDA (its generator is made there) and draws the same tokens alone as
    behind an unseeded row, in a misaligned noise row (odd vocabulary)."""
    vocab, steps = 1001, 5
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = [torch.randn(1, vocab, device="cuda", generator=gen) for _ in range(steps)]

    def run(batched: bool) -> list[int]:
        params = SamplingParams(temperature=1.0, seed=42, top_p=0.9, presence_penalty=0.2)
        seeded = SamplingState.create(params, [1, 2])
        other = SamplingState.create(SamplingParams(temperature=0.7), [5])
        sampler = Sampler(seed=1)
        for row in rows:
            states = [other, seeded] if batched else [seeded]
            logits = torch.cat([torch.randn(1, vocab, device="cuda"), row]) if batched else row
            out = sampler.sample(logits, states)
            seeded.output_token_ids.append(out.token_ids[-1])
        assert seeded.generator.device.type == "cuda"
        return seeded.output_token_ids

    alone = run(False)
    assert run(True) == alone
    assert len(set(alone)) > 1
