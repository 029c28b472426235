"""Speculative decoding building blocks: config, ngram proposer, rejection sampler, counters (CPU, fast)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pagedserve.engine.sample.sampler import Sampler, SamplingState
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.spec_decode import (
    NgramProposer,
    SpecDecodeStats,
    SpeculativeConfig,
    SpecRow,
    check_draft_compatible,
    load_draft_hf_config,
    parse_speculative_config,
    rejection_sample,
)

# ---------------------------------------------------------------- config


def test_config_ngram_defaults_follow_vllm():
    spec = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    assert spec.model is None and spec.disable_by_batch_size is None
    only_max = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)


def test_config_json_string_and_passthrough():
    text = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                       "prompt_lookup_min": 2, "disable_by_batch_size": 8})
    spec = parse_speculative_config(text)
    assert isinstance(spec, SpeculativeConfig)
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 2, 4)
    assert spec.disable_by_batch_size == 8
    assert parse_speculative_config(spec) is spec
    assert parse_speculative_config(None) is None
    assert parse_speculative_config("null") is None
    draft = parse_speculative_config('{"model": "/models/draft", "num_speculative_tokens": 2}')
    assert draft.method == "draft_model" and draft.model == "/models/draft"
    assert draft.prompt_lookup_min is None and draft.draft_tensor_parallel_size is None


@pytest.mark.parametrize(
    ("value", "prefix"),
    [
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens:"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens:"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "speculative_config.num_speculative_tokens:"),
        ({"method": "ngram", "num_speculative_tokens": True}, "speculative_config.num_speculative_tokens:"),
        ({"num_speculative_tokens": 3}, "speculative_config.method:"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "speculative_config.method:"),
        ({"method": "ngram", "num_speculative_tokens": 3, "model": "/m"}, "speculative_config.model:"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "speculative_config.model:"),
        ({"method": "draft_model", "model": "  ", "num_speculative_tokens": 3}, "speculative_config.model:"),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min:"),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 0}, "speculative_config.prompt_lookup_max:"),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         "speculative_config.prompt_lookup_min:"),
        ({"model": "/m", "num_speculative_tokens": 3, "prompt_lookup_max": 3}, "speculative_config.prompt_lookup_max:"),
        ({"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2},
         "speculative_config.draft_tensor_parallel_size:"),
        ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 1},
         "speculative_config.disable_by_batch_size:"),
        ({"method": "ngram", "num_speculative_tokens": 3, "speculative_model": "x"},
         "speculative_config.speculative_model:"),
        ("{not json", "speculative_config:"),
        ("[1, 2]", "speculative_config:"),
        (7, "speculative_config:"),
    ],
)
def test_config_errors_name_the_field(value, prefix):
    with pytest.raises(ValueError) as info:
        parse_speculative_config(value)
    assert str(info.value).startswith(prefix), str(info.value)
    assert type(info.value) is ValueError  # pydantic's ValidationError is translated, not leaked


def test_draft_model_config_loading_and_vocab_check(tmp_path):
    from transformers import LlamaConfig

    small = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    LlamaConfig(vocab_size=512, **small).save_pretrained(tmp_path / "draft")
    spec = parse_speculative_config({"model": str(tmp_path / "draft"), "num_speculative_tokens": 2})
    draft_cfg = load_draft_hf_config(spec)
    assert draft_cfg.vocab_size == 512
    check_draft_compatible(spec, LlamaConfig(vocab_size=512, **small), draft_cfg)
    with pytest.raises(ValueError) as info:
        check_draft_compatible(spec, LlamaConfig(vocab_size=1000, **small), draft_cfg)
    message = str(info.value)
    assert message.startswith("speculative_config.model:") and "512" in message and "1000" in message

    missing = parse_speculative_config({"model": str(tmp_path / "nope"), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"^speculative_config\.model:.*does not exist"):
        load_draft_hf_config(missing)
    (tmp_path / "empty").mkdir()
    empty = parse_speculative_config({"model": str(tmp_path / "empty"), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"^speculative_config\.model:"):
        load_draft_hf_config(empty)
    with pytest.raises(ValueError, match=r"^speculative_config\.model:"):
        load_draft_hf_config(parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2}))


# ---------------------------------------------------------------- ngram proposer


def ids(*tokens: int) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64)


def reference_ngram(tokens: list[int], k: int, min_n: int, max_n: int, max_tokens: int) -> list[int]:
    """Brute force: the longest n in [min_n, max_n] with an earlier occurrence; the earliest such one."""
    limit = min(k, max_tokens)
    if limit <= 0:
        return []
    num = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= num:
            continue
        suffix = tokens[num - n:]
        for start in range(num - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + limit]
    return []


def test_ngram_match_and_no_match():
    proposer = NgramProposer(num_speculative_tokens=3, min_n=1, max_n=3)
    assert proposer.propose(ids(1, 2, 3, 4, 5, 6, 1, 2, 3), 10) == [4, 5, 6]
    assert proposer.propose(ids(1, 2, 3, 4, 5, 6), 10) == []
    assert proposer.propose(ids(), 10) == []
    assert proposer.propose(ids(9), 10) == []


def test_ngram_multiple_matches_take_the_earliest_of_the_longest():
    proposer = NgramProposer(num_speculative_tokens=2, min_n=1, max_n=3)
    # "7 8" occurs at 0 (followed by 1 1) and at 4 (followed by 2 2): the earliest wins.
    assert proposer.propose(ids(7, 8, 1, 1, 7, 8, 2, 2, 7, 8), 10) == [1, 1]
    # A longer match beats a more recent (or earlier) shorter one: "5 7 8" only occurs at 4.
    assert proposer.propose(ids(7, 8, 1, 1, 5, 7, 8, 3, 3, 5, 7, 8), 10) == [3, 3]


def test_ngram_min_n_and_max_n_bounds():
    # The only earlier match is one token long: below min_n=2 it is not used.
    assert NgramProposer(2, min_n=2, max_n=4).propose(ids(4, 1, 2, 3, 4), 10) == []
    assert NgramProposer(2, min_n=1, max_n=4).propose(ids(4, 1, 2, 3, 4), 10) == [1, 2]
    # max_n larger than the context: every shorter n is still tried.
    assert NgramProposer(3, min_n=1, max_n=50).propose(ids(1, 2, 1), 10) == [2, 1]
    # A repeated token overlaps its own suffix and keeps proposing itself.
    assert NgramProposer(4, min_n=2, max_n=3).propose(ids(5, 5, 5, 5, 5), 10) == [5, 5]


def test_ngram_truncation_by_max_tokens_and_context_end():
    proposer = NgramProposer(num_speculative_tokens=4, min_n=1, max_n=2)
    context = ids(1, 2, 3, 4, 5, 6, 7, 1, 2)
    assert proposer.propose(context, 10) == [3, 4, 5, 6]
    assert proposer.propose(context, 2) == [3, 4]
    assert proposer.propose(context, 0) == []
    assert proposer.propose(context, -3) == []
    # The match's continuation runs into the end of the context.
    assert proposer.propose(ids(1, 2, 9, 1, 2), 10) == [9, 1, 2]
    assert proposer.propose_batch([context, ids(1, 2, 3), ids(1, 2, 9, 1, 2)], [2, 5, 1]) == [[3, 4], [], [9]]


def test_ngram_matches_brute_force_reference():
    rng = np.random.default_rng(0)
    for trial in range(300):
        tokens = rng.integers(0, 4, size=int(rng.integers(0, 40))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        k, max_tokens = int(rng.integers(1, 6)), int(rng.integers(-1, 7))
        got = NgramProposer(k, min_n, max_n).propose(np.asarray(tokens, dtype=np.int64), max_tokens)
        assert got == reference_ngram(tokens, k, min_n, max_n, max_tokens), (trial, tokens, min_n, max_n)


def test_ngram_rejects_bad_settings():
    with pytest.raises(ValueError):
        NgramProposer(0, 1, 2)
    with pytest.raises(ValueError):
        NgramProposer(2, 3, 2)
    with pytest.raises(ValueError):
        NgramProposer(2, 1, 2).propose_batch([ids(1)], [1, 2])


# ---------------------------------------------------------------- rejection sampler


def greedy_reference(logits: torch.Tensor, drafts: list[int]) -> tuple[list[int], int]:
    top = logits.argmax(dim=-1).tolist()
    accepted = []
    for j, d in enumerate(drafts):
        if top[j] != d:
            return accepted, top[j]
        accepted.append(d)
    return accepted, top[len(drafts)]


def test_greedy_rows_are_exact():
    gen = torch.Generator().manual_seed(3)
    vocab = 16
    rows, blocks = [], []
    for m, agree in [(3, 3), (3, 1), (4, 0), (0, 0), (2, 2), (5, 4)]:
        block = torch.randn(m + 1, vocab, generator=gen)
        top = block.argmax(dim=-1).tolist()
        drafts = top[:agree] + [(t + 1) % vocab for t in top[agree:m]]
        rows.append(SpecRow(draft_token_ids=drafts, greedy=True, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
                            generator=None))
        blocks.append(block)
    results = rejection_sample(torch.cat(blocks), rows)
    for row, block, result in zip(rows, blocks, results):
        accepted, nxt = greedy_reference(block, row.draft_token_ids)
        assert result.accepted_token_ids == accepted
        assert result.next_token_id == nxt
        assert result.token_ids == accepted + [nxt]
    # All drafts accepted: the bonus token is the argmax after the last draft.
    assert len(results[0].accepted_token_ids) == 3
    assert results[0].next_token_id == int(blocks[0][3].argmax())
    assert [len(r.accepted_token_ids) for r in results] == [3, 1, 0, 0, 2, 4]


def test_greedy_rows_unchanged_beside_random_rows():
    gen = torch.Generator().manual_seed(4)
    vocab = 12
    greedy_block = torch.randn(4, vocab, generator=gen)
    drafts = greedy_block.argmax(dim=-1).tolist()[:2] + [0]
    greedy = SpecRow(drafts, greedy=True, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, generator=None)
    alone = rejection_sample(greedy_block, [greedy])[0]
    other = SpecRow([1, 2], greedy=False, temperature=0.9, top_k=5, top_p=0.9, min_p=0.0, generator=None)
    mixed = rejection_sample(torch.cat([torch.randn(3, vocab, generator=gen), greedy_block]), [other, greedy])
    assert mixed[1] == alone


def test_random_row_accepts_certain_drafts_and_never_zero_probability_ones():
    vocab = 8
    logits = torch.full((3, vocab), -1e9)
    logits[0, 2] = 0.0  # p_0 = onehot(2)
    logits[1, 5] = 0.0  # p_1 = onehot(5)
    logits[2, :] = 0.0  # bonus from uniform
    row = SpecRow([2, 5], greedy=False, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, generator=None)
    for _ in range(20):
        result = rejection_sample(logits, [row])[0]
        assert result.accepted_token_ids == [2, 5]
    never = SpecRow([3, 5], greedy=False, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, generator=None)
    for _ in range(20):
        result = rejection_sample(logits, [never])[0]
        assert result.accepted_token_ids == [] and result.next_token_id == 2


def seeded_row(drafts: list[int], seed: int, **kw) -> SpecRow:
    params = {"temperature": 0.8, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    params.update(kw)
    return SpecRow(drafts, greedy=False, generator=torch.Generator().manual_seed(seed), **params)


def test_seeded_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(5)
    vocab = 10
    for seed in range(12):
        block = torch.randn(4, vocab, generator=gen) * 2
        drafts = block.argmax(dim=-1).tolist()[:3]  # likely drafts, so accept lengths vary over seeds
        alone = rejection_sample(block, [seeded_row(drafts, seed, top_p=0.9)])[0]
        batch_rows = [
            SpecRow([1], greedy=False, temperature=1.2, top_k=0, top_p=1.0, min_p=0.0, generator=None),
            seeded_row([4, 4], seed + 100, top_k=3),
            seeded_row(drafts, seed, top_p=0.9),
            SpecRow([2, 3], greedy=True, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, generator=None),
            SpecRow([], greedy=False, temperature=0.7, top_k=2, top_p=1.0, min_p=0.1, generator=None),
        ]
        logits = torch.cat([torch.randn(2, vocab, generator=gen), torch.randn(3, vocab, generator=gen), block,
                            torch.randn(3, vocab, generator=gen), torch.randn(1, vocab, generator=gen)])
        in_batch = rejection_sample(logits, batch_rows, shared_generator=torch.Generator().manual_seed(seed))[2]
        assert in_batch == alone, seed


def test_seeded_row_draw_order_is_m_uniforms_then_one_noise_row():
    vocab = 7
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(6))
    drafts = [1, 4, 6]
    for seed in range(20):
        result = rejection_sample(logits, [seeded_row(drafts, seed, temperature=1.0)])[0]
        # The documented order, replayed by hand.
        gen = torch.Generator().manual_seed(seed)
        uniforms = torch.rand(3, generator=gen)
        noise = torch.empty(vocab).exponential_(generator=gen).clamp_(min=1e-20)
        probs = torch.softmax(logits, dim=-1)
        n = 0
        while n < 3 and uniforms[n] < probs[n, drafts[n]]:
            n += 1
        dist = probs[n].clone()
        if n < 3:
            dist[drafts[n]] = 0.0
        assert result.accepted_token_ids == drafts[:n]
        assert result.next_token_id == int((dist / noise).argmax())


def test_seeded_row_without_drafts_samples_like_the_plain_sampler():
    vocab = 20
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(8))
    for seed in range(10):
        params = SamplingParams(temperature=0.7, top_k=6, top_p=0.9, seed=seed)
        plain = Sampler(seed=0).sample(logits.clone(), [SamplingState.create(params, [1, 2])]).token_ids[0]
        row = seeded_row([], seed, temperature=0.7, top_k=6, top_p=0.9)
        spec = rejection_sample(logits, [row])[0]
        assert spec.accepted_token_ids == [] and spec.next_token_id == plain


def test_filters_are_applied_to_drafts_and_emitted_tokens():
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0]] * 3)
    gen = torch.Generator().manual_seed(9)
    # top-k 2: draft 5 is outside it, so it is never accepted and only tokens 0/1 are emitted.
    rows = [SpecRow([5, 0], greedy=False, temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, generator=None)] * 300
    results = rejection_sample(torch.cat([logits] * 300), rows, shared_generator=gen)
    assert all(r.accepted_token_ids == [] for r in results)
    assert {r.next_token_id for r in results} == {0, 1}
    # p ~ [0.44, 0.27, 0.16, ...]: top-p 0.5 keeps tokens 0 and 1; so does min-p 0.5 (p >= 0.22).
    for kw in ({"top_p": 0.5, "min_p": 0.0}, {"top_p": 1.0, "min_p": 0.5}):
        rows = [SpecRow([3, 0], greedy=False, temperature=1.0, top_k=0, generator=None, **kw)] * 300
        results = rejection_sample(torch.cat([logits] * 300), rows, shared_generator=gen)
        assert all(r.accepted_token_ids == [] for r in results)
        assert {r.next_token_id for r in results} <= {0, 1}
    # A very low temperature concentrates p on the argmax: its draft is always accepted.
    rows = [SpecRow([0, 0], greedy=False, temperature=0.01, top_k=0, top_p=1.0, min_p=0.0, generator=None)] * 50
    results = rejection_sample(torch.cat([logits] * 50), rows, shared_generator=gen)
    assert all(r.token_ids == [0, 0, 0] for r in results)


def test_a_speculating_request_the_processors_cannot_process_fails_alone():
    """Verification runs the sampler's processors, with the sampler's rule for ids outside the
    vocabulary: that request fails; the others (a seeded one included) get what they get alone."""
    from pagedserve.engine.worker.speculator import Speculator

    vocab = 16
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(4)) * 3

    def states():
        return [
            SamplingState.create(SamplingParams(temperature=0.8, seed=3, repetition_penalty=1.3), [1, 2, 3]),
            SamplingState.create(SamplingParams(temperature=0, allowed_token_ids=[2, 40]), [1, 2]),
            SamplingState.create(SamplingParams(temperature=0, logit_bias={5: 4.0}), [4]),
        ]

    drafts = [[4, 5], [2], [5]]
    results, _, errors = Speculator.verify(logits, drafts, states(), Sampler())
    assert results[1] is None and "allowed_token_ids" in errors[1] and set(errors) == {1}
    for i, rows in ((0, slice(0, 3)), (2, slice(5, 7))):
        alone, _, no_errors = Speculator.verify(logits[rows], [drafts[i]], [states()[i]], Sampler())
        assert not no_errors and alone[0].token_ids == results[i].token_ids


def test_bad_input_is_rejected():
    row = SpecRow([1], greedy=False, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, generator=None)
    with pytest.raises(ValueError, match="logits has 3 rows"):
        rejection_sample(torch.zeros(3, 4), [row])
    with pytest.raises(ValueError, match="draft token ids"):
        rejection_sample(torch.zeros(2, 4), [SpecRow([9], True, 0.0, 0, 1.0, 0.0, None)])
    with pytest.raises(ValueError, match="temperature"):
        rejection_sample(torch.zeros(2, 4), [SpecRow([1], False, 0.0, 0, 1.0, 0.0, None)])
    assert rejection_sample(torch.zeros(0, 4), []) == []


# Chi-square critical values at p = 0.001 by degrees of freedom (scipy.stats.chi2.ppf(0.999, df)).
CHI2_CRIT_0001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def chi_square(observed: np.ndarray, expected_p: np.ndarray) -> tuple[float, int]:
    """The statistic over the bins with positive expected probability, and its degrees of freedom;
    a bin with zero expected probability must be empty."""
    total = observed.sum()
    support = expected_p > 0
    assert observed[~support].sum() == 0, (observed, expected_p)
    expected = expected_p[support] * total
    return float(((observed[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def target_p(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0) -> np.ndarray:
    """The target distribution by hand (numpy): temperature, then top-k, then softmax."""
    x = logits / temperature
    if top_k > 0:
        kth = np.sort(x)[-top_k]
        x = np.where(x >= kth, x, -np.inf)
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize(
    ("temperature", "top_k", "drafts"),
    [
        (1.0, 0, [4, 1]),  # draft 4 has p_0 = 0.12 (low); draft 1 has p_1 = 0.1
        (0.7, 3, [5, 0]),  # draft 5 is outside top-3 at position 0: zero probability, never accepted
        (1.3, 0, [0, 2]),
    ],
)
def test_emitted_tokens_follow_the_target_distribution(temperature, top_k, drafts):
    vocab, rows_n = 6, 20000
    probs0 = np.array([0.30, 0.25, 0.20, 0.08, 0.12, 0.05])
    probs1 = np.array([0.05, 0.10, 0.40, 0.15, 0.20, 0.10])
    probs2 = np.array([0.20, 0.20, 0.10, 0.10, 0.30, 0.10])
    logits_np = np.log(np.stack([probs0, probs1, probs2]))
    p = [target_p(logits_np[j], temperature, top_k) for j in range(3)]
    logits = torch.tensor(logits_np, dtype=torch.float32).repeat(rows_n, 1)
    row = SpecRow(drafts, greedy=False, temperature=temperature, top_k=top_k, top_p=1.0, min_p=0.0, generator=None)
    results = rejection_sample(logits, [row] * rows_n, shared_generator=torch.Generator().manual_seed(1234))
    emitted = [r.token_ids for r in results]
    assert all(len(t) >= 1 and t[: len(r.accepted_token_ids)] == drafts[: len(r.accepted_token_ids)]
               for t, r in zip(emitted, results))

    first = np.bincount([t[0] for t in emitted], minlength=vocab)
    stat, df = chi_square(first, p[0])
    assert stat < CHI2_CRIT_0001[df], (first, p[0])
    if top_k:
        assert first[np.argsort(logits_np[0])[: vocab - top_k]].sum() == 0  # outside top-k: never emitted
    # The check has power: a sampler that ignored the residual (re-drawing from p_0 after a rejection)
    # would over-emit the draft and fail it.
    naive = p[0] * (1 - p[0][drafts[0]])
    naive[drafts[0]] += p[0][drafts[0]]
    if p[0][drafts[0]] > 0.05:
        assert chi_square(np.round(naive * rows_n).astype(np.int64), p[0])[0] > CHI2_CRIT_0001[df]

    # Given that the first draft was accepted, the second emitted token follows p_1 (drafted or not).
    after = [t[1] for t in emitted if t[0] == drafts[0] and len(t) >= 2]
    if p[0][drafts[0]] == 0:
        assert not after
        return
    assert len(after) > 500
    second = np.bincount(after, minlength=vocab)
    stat, df = chi_square(second, p[1])
    assert stat < CHI2_CRIT_0001[df], (second, p[1])
    # And given both drafts accepted, the bonus token follows p_2.
    bonus = [t[2] for t in emitted if len(t) == 3]
    if len(bonus) > 300:
        stat, df = chi_square(np.bincount(bonus, minlength=vocab), p[2])
        assert stat < CHI2_CRIT_0001[df]


# ---------------------------------------------------------------- counters


def test_stats_observe_merge_and_rates():
    stats = SpecDecodeStats()
    assert stats.acceptance_rate == 0.0 and stats.mean_acceptance_length == 0.0
    stats.observe(3, 2)
    stats.observe(3, 0)
    stats.observe(0, 0)  # nothing proposed: not a draft
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 2)
    assert stats.accepted_per_position == [1, 1, 0]
    assert stats.acceptance_rate == pytest.approx(2 / 6)
    assert stats.mean_acceptance_length == pytest.approx(1 + 2 / 2)
    assert stats.acceptance_rate_per_position == pytest.approx([0.5, 0.5, 0.0])

    other = SpecDecodeStats()
    other.observe(5, 5)
    stats.merge(other)
    assert stats.accepted_per_position == [2, 2, 1, 1, 1]
    assert stats.as_dict() == {
        "num_drafts": 3,
        "num_draft_tokens": 11,
        "num_accepted_tokens": 7,
        "accepted_per_position": [2, 2, 1, 1, 1],
        "acceptance_rate": pytest.approx(7 / 11),
        "mean_acceptance_length": pytest.approx(1 + 7 / 3),
    }
    rejected = SpecDecodeStats()
    rejected.observe(4, 0)
    assert rejected.mean_acceptance_length == 1.0 and rejected.acceptance_rate == 0.0
    with pytest.raises(ValueError):
        stats.observe(2, 3)
    with pytest.raises(ValueError):
        stats.observe(2, -1)
