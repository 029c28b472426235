import math

import pytest
import torch

from pagedserve.engine.sample.sampler import (
    Sampler,
    SamplingState,
    compute_prompt_logprobs,
)
from pagedserve.engine.sampling_params import SamplingParams

V = 32


def state(prompt=(1, 2, 3), output=(), eos=(), bad=(), **kw) -> SamplingState:
    params = SamplingParams(**kw)
    st = SamplingState.create(
        params, list(prompt), eos_token_ids=set(eos), bad_words_token_ids=[list(b) for b in bad]
    )
    st.output_token_ids.extend(output)
    return st


def crafted(winner: int, runner_up: int, gap: float = 1.0, rows: int = 1) -> torch.Tensor:
    """Logits with a clear winner, a runner-up `gap` below it, everything else far below."""
    logits = torch.full((rows, V), -5.0)
    logits[:, winner] = 3.0
    logits[:, runner_up] = 3.0 - gap
    return logits


def sample_one(logits, st, sampler=None):
    return (sampler or Sampler(seed=0)).sample(logits, [st]).token_ids[0]


def test_greedy_is_argmax():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(1))
    out = Sampler(seed=0).sample(logits, [state(temperature=0.0) for _ in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6


def test_accepts_half_precision_logits():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out = Sampler(seed=0).sample(logits, [state(temperature=0.0)] * 3)
    assert out.token_ids == logits.float().argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_argmax_is_argmax_with_ties_nan_and_infinities(dtype):
    """kernels.greedy_argmax (max(dim).indices on CPU) answers as argmax does: the first of equal maxima,
    a NaN as the largest, +inf over everything finite, a row of -inf at index 0; wide rows too."""
    from pagedserve.kernels import greedy_argmax

    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[1, 3, 3, 0], [nan, 1, nan, 5], [-inf] * 4, [2, inf, inf, 1], [0, 0, 0, 0]])
    wide = torch.randn(9, 49152, generator=torch.Generator().manual_seed(3))
    wide[1, [7, 40000]] = 50.0  # a tie far apart
    wide[2, 30000] = nan
    for logits in (rows.to(dtype), wide.to(dtype)):
        assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))
        assert torch.equal(greedy_argmax(logits), logits.float().argmax(dim=-1))  # widening changes nothing


@pytest.mark.parametrize("kw", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 0.99}])
def test_truncation_to_one_token_is_argmax(kw):
    # Flat-ish logits: without truncation, sampling would pick many different tokens.
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(3)) * 0.1
    logits[0, 11] += 0.5
    sampler = Sampler(seed=0)
    picks = {sampler.sample(logits, [state(temperature=1.0, **kw)]).token_ids[0] for _ in range(50)}
    assert picks == {11}
    untruncated = {sampler.sample(logits, [state(temperature=1.0)]).token_ids[0] for _ in range(50)}
    assert len(untruncated) > 5


def test_top_k_restricts_support():
    logits = torch.zeros(1, V)
    logits[0, [4, 9, 20]] = torch.tensor([2.0, 1.9, 1.8])
    sampler = Sampler(seed=0)
    picks = {sampler.sample(logits, [state(top_k=3)]).token_ids[0] for _ in range(200)}
    assert picks == {4, 9, 20}


def test_min_p_removes_unlikely_tokens():
    logits = torch.full((1, V), -20.0)
    logits[0, 0] = math.log(0.5)
    logits[0, 1] = math.log(0.3)
    logits[0, 2] = math.log(0.05)  # 0.05 < 0.2 * 0.5
    sampler = Sampler(seed=0)
    picks = {sampler.sample(logits, [state(min_p=0.2)]).token_ids[0] for _ in range(300)}
    assert picks == {0, 1}


def test_logit_bias_forces_token():
    logits = crafted(winner=5, runner_up=6)
    assert sample_one(logits, state(temperature=0)) == 5
    assert sample_one(logits, state(temperature=0, logit_bias={17: 100.0})) == 17
    assert sample_one(logits, state(temperature=0, logit_bias={"5": -100.0})) == 6


def test_logit_bias_out_of_vocab_fails_that_row_alone():
    out = Sampler(seed=0).sample(crafted(5, 6, rows=2), [state(logit_bias={V + 3: 1.0}), state(temperature=0)])
    assert list(out.errors) == [0] and "logit_bias" in out.errors[0]
    assert out.token_ids[1] == 5


def test_repetition_penalty_changes_winner():
    logits = crafted(winner=5, runner_up=6, gap=0.5)  # 3.0 vs 2.5
    # Token 5 in the prompt: 3.0 / 1.5 = 2.0 < 2.5.
    assert sample_one(logits, state(prompt=[5], temperature=0, repetition_penalty=1.5)) == 6
    assert sample_one(logits, state(prompt=[1], temperature=0, repetition_penalty=1.5)) == 5
    # Token 5 in the output counts too.
    assert sample_one(logits, state(prompt=[1], output=[5], temperature=0, repetition_penalty=1.5)) == 6
    # Negative logits are multiplied: a seen negative token gets further away.
    neg = torch.full((1, V), -10.0)
    neg[0, 3], neg[0, 4] = -1.0, -1.2
    assert sample_one(neg, state(prompt=[3], temperature=0, repetition_penalty=1.5)) == 4


def test_repetition_penalty_matches_hf_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(4)) * 3
    prompt, output = [1, 2, 7, 7], [9, 2, 30]
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits.clone())
    st = state(prompt=prompt, output=output, temperature=0, repetition_penalty=1.3, logprobs=0)
    from pagedserve.engine.sample.sampler import _apply_logits_processors

    got = _apply_logits_processors(logits, [st], errors={})
    torch.testing.assert_close(got, expected)


def test_frequency_and_presence_penalties():
    logits = crafted(winner=5, runner_up=6, gap=1.0)  # 3.0 vs 2.0
    # Presence: 3.0 - 1.5 = 1.5 < 2.0, regardless of count.
    assert sample_one(logits, state(output=[5], temperature=0, presence_penalty=1.5)) == 6
    assert sample_one(logits, state(output=[6], temperature=0, presence_penalty=1.5)) == 5
    # Frequency: 3.0 - 0.6 * 2 = 1.8 < 2.0, but one occurrence (2.4) is not enough.
    assert sample_one(logits, state(output=[5, 5], temperature=0, frequency_penalty=0.6)) == 6
    assert sample_one(logits, state(output=[5], temperature=0, frequency_penalty=0.6)) == 5
    # Prompt tokens do not count for OpenAI penalties.
    assert sample_one(logits, state(prompt=[5, 5], temperature=0, frequency_penalty=2.0)) == 5
    # Negative presence penalty promotes a token that already appeared.
    assert sample_one(logits, state(output=[6], temperature=0, presence_penalty=-1.5)) == 6


def test_bad_words_ban_single_and_multi_token_words():
    logits = crafted(winner=5, runner_up=6)
    assert sample_one(logits, state(temperature=0, bad=[[5]])) == 6
    # Multi-token word [8, 5]: token 5 banned only right after 8.
    assert sample_one(logits, state(output=[1, 8], temperature=0, bad=[[8, 5]])) == 6
    assert sample_one(logits, state(output=[8, 1], temperature=0, bad=[[8, 5]])) == 5
    assert sample_one(logits, state(temperature=0, bad=[[8, 5]])) == 5
    # Prefix longer than one token.
    assert sample_one(logits, state(output=[3, 8, 9], temperature=0, bad=[[8, 9, 5]])) == 6
    assert sample_one(logits, state(output=[3, 7, 9], temperature=0, bad=[[8, 9, 5]])) == 5


def test_min_tokens_masks_eos_and_stop_ids_then_releases():
    logits = torch.full((1, V), -5.0)
    logits[0, 2], logits[0, 9], logits[0, 4] = 4.0, 3.5, 1.0  # 2 = eos, 9 = stop id
    kw = dict(temperature=0, min_tokens=3, stop_token_ids=[9])
    assert sample_one(logits, state(eos=[2], **kw)) == 4
    assert sample_one(logits, state(output=[7, 7], eos=[2], **kw)) == 4
    assert sample_one(logits, state(output=[7, 7, 7], eos=[2], **kw)) == 2
    # ignore_eos only affects stopping; the min_tokens mask still applies.
    assert sample_one(logits, state(output=[7], eos=[2], ignore_eos=True, **kw)) == 4
    assert sample_one(logits, state(eos=[2], temperature=0)) == 2


def test_processors_do_not_touch_other_rows():
    logits = crafted(winner=5, runner_up=6, rows=3)
    states = [
        state(temperature=0, logit_bias={6: 50.0}),
        state(temperature=0),
        state(output=[5], temperature=0, presence_penalty=2.0),
    ]
    original = logits.clone()
    assert Sampler(seed=0).sample(logits, states).token_ids == [6, 5, 6]
    assert torch.equal(logits, original)  # the caller's logits are not modified


def _run_steps(sampler, logits_per_step, states, target):
    for logits in logits_per_step:
        out = sampler.sample(logits[: len(states)], states)
        for s, t in zip(states, out.token_ids):
            s.output_token_ids.append(t)
    return target.output_token_ids


def test_seeded_request_is_independent_of_batch():
    gen = torch.Generator().manual_seed(5)
    steps = [torch.randn(4, V, generator=gen) for _ in range(8)]

    alone = state(temperature=1.0, seed=1234, top_p=0.9)
    seq_alone = _run_steps(Sampler(seed=1), [s[2:3] for s in steps], [alone], alone)

    seeded = state(temperature=1.0, seed=1234, top_p=0.9)
    batch = [
        state(temperature=0.8),  # shared generator
        state(temperature=0),  # greedy
        seeded,
        state(temperature=1.0, seed=99, top_k=5, presence_penalty=0.5),
    ]
    # Different sampler seed too: the seeded row must not depend on it.
    seq_batched = _run_steps(Sampler(seed=7), steps, batch, seeded)
    assert seq_alone == seq_batched
    assert len(set(seq_alone)) > 1  # it really sampled

    other = state(temperature=1.0, seed=4321, top_p=0.9)
    assert _run_steps(Sampler(seed=1), [s[2:3] for s in steps], [other], other) != seq_alone


def test_unseeded_sampler_seed_is_reproducible():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(6))
    states = [state(temperature=1.0) for _ in range(4)]

    def draws(seed):
        sampler = Sampler(seed=seed)
        return [sampler.sample(logits, states).token_ids for _ in range(5)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)


def test_sampling_frequencies_follow_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -30.0]])
    temperature = 0.8
    expected = torch.softmax(logits[0] / temperature, dim=-1)
    n = 8000
    sampler = Sampler(seed=11)
    st = state(temperature=temperature)
    # Draw a whole batch of identical rows per call to keep the test quick.
    batch = logits.expand(400, -1).contiguous()
    counts = torch.zeros(6)
    for _ in range(n // 400):
        ids = sampler.sample(batch, [st] * 400).token_ids
        counts += torch.bincount(torch.tensor(ids), minlength=6)
    freq = counts / n
    assert counts[5] == 0
    # 5-sigma binomial tolerance per token.
    tol = 5 * torch.sqrt(expected * (1 - expected) / n) + 1e-3
    assert torch.all((freq - expected).abs() <= tol), (freq, expected)


def test_logprobs_format_ranks_and_raw_values():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(8)) * 2
    raw = torch.log_softmax(logits, dim=-1)
    states = [
        state(temperature=0, logprobs=3, presence_penalty=2.0, output=[int(logits[0].argmax())]),
        state(temperature=1.0, logprobs=0),
        state(temperature=0),
    ]
    out = Sampler(seed=0).sample(logits, states)
    assert out.logprobs[2] is None
    for row in (0, 1):
        entries = out.logprobs[row]
        n_top = states[row].params.logprobs
        assert len(entries) == 1 + n_top
        tok, lp, rank = entries[0]
        assert tok == out.token_ids[row]
        # Raw logits, before the penalty that changed row 0's choice.
        assert lp == pytest.approx(raw[row, tok].item(), abs=1e-5)
        assert rank == int((raw[row] > raw[row, tok]).sum()) + 1
        order = raw[row].argsort(descending=True).tolist()
        for j, (tid, tlp, trank) in enumerate(entries[1:]):
            assert (tid, trank) == (order[j], j + 1)
            assert tlp == pytest.approx(raw[row, tid].item(), abs=1e-5)
    # The penalty made row 0 pick something other than the raw argmax: rank > 1.
    assert out.logprobs[0][0][2] > 1


def test_prompt_logprobs():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(9))
    targets = torch.tensor([3, 1, 4, 1, 5])
    raw = torch.log_softmax(logits, dim=-1)
    result = compute_prompt_logprobs(logits, targets, num_top=2)
    assert len(result) == 5
    for p, entries in enumerate(result):
        t = int(targets[p])
        assert entries[0][0] == t
        assert entries[0][1] == pytest.approx(raw[p, t].item(), abs=1e-5)
        assert entries[0][2] == int((raw[p] > raw[p, t]).sum()) + 1
        top = raw[p].topk(2)
        assert [e[0] for e in entries[1:]] == top.indices.tolist()
        assert [e[2] for e in entries[1:]] == [1, 2]
    assert all(len(e) == 1 for e in compute_prompt_logprobs(logits, targets, 0))
    assert compute_prompt_logprobs(logits[:0], targets[:0], 2) == []
    with pytest.raises(ValueError):
        compute_prompt_logprobs(logits, targets[:3], 1)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="logits"):
        Sampler().sample(torch.zeros(2, V), [state()])
    assert Sampler().sample(torch.zeros(0, V), []).token_ids == []


def test_seeded_generator_is_made_on_the_logits_device(monkeypatch):
    import pagedserve.engine.sample.state as state_mod

    made_on = []
    real = state_mod.make_generator

    def recording(seed, device="cpu"):
        made_on.append(torch.device(device))
        return real(seed, device)

    monkeypatch.setattr(state_mod, "make_generator", recording)
    st = state(temperature=1.0, seed=7)
    assert st.generator is None  # nothing is made before the device is known
    logits = crafted(5, 6)
    Sampler(seed=0).sample(logits, [st])
    Sampler(seed=0).sample(logits, [st])
    assert made_on == [logits.device] and st.generator.device == logits.device


def test_top_k_above_vocab_and_int32_keeps_the_whole_vocabulary():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(9)).repeat(2, 1)
    states = [state(temperature=1.0, seed=3, top_k=2**31), state(temperature=1.0, seed=3, top_k=V)]
    out = Sampler(seed=0).sample(logits, states)
    assert not out.errors and out.token_ids[0] == out.token_ids[1]


def test_allowed_token_ids_restrict_support():
    logits = crafted(5, 6)
    assert sample_one(logits, state(temperature=0, allowed_token_ids=[6, 9])) == 6


def test_failing_row_is_dropped_before_any_generator_draws():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, V, generator=gen)

    def run(poison: bool):
        states = [state(temperature=1.0, seed=11), state(temperature=0.9), state(temperature=1.0, seed=12)]
        for i, s in enumerate(states):
            s.request_id = f"r{i}"
        sampler = Sampler(seed=4)
        if poison:
            def inject(request_id):
                if request_id == "r1":
                    raise RuntimeError("boom")
            sampler.fault_injector = inject
            return sampler.sample(logits, states)
        return sampler.sample(logits[[0, 2]], [states[0], states[2]])

    poisoned, clean = run(True), run(False)
    assert poisoned.errors == {1: "RuntimeError: boom"}
    assert [poisoned.token_ids[0], poisoned.token_ids[2]] == clean.token_ids
