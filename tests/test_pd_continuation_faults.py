"""A prefill/decode continuation (n == 1, `continue_remote_output`: the decode engine starts from the
prefill's first token) whose KV load fails, and the paths beside it: the decode engine computes the
prompt itself and the output goes on exactly after the prefill's token - no token dropped, none
repeated - equal to the monolithic engine's token for token; every KV block is free afterwards.

Each failure is forced at a fixed point: the producer's hold released (its blocks reused) before the
decode engine admits the request, released between the admission step and the step that reads it, a
step that raises while its load is in flight; with chunked prefill, prefix-cache hits on the decode
engine, a cache small enough to preempt, and n > 1 children of a failed hold.
"""

from __future__ import annotations

import pytest

from pagedserve.engine import SamplingParams
from pagedserve.engine.output_processor import OutputKind
from tests.test_kv_transfer import _all_free, _continue, _greedy, _hold, _llm, _prefill, _prompts

MAX_TOKENS = 10


def _first_tokens(producer, prompts):
    """The prefill leg as the PD client runs it: one greedy token per prompt, the KV held for a reader."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, kv_transfer_params={"do_remote_decode": True})
    outs = producer.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids[0] for o in outs], [o.kv_transfer_params for o in outs]


def _release(producer, remotes) -> None:
    """Free the holds at the producer and let a step of another prefill reuse their blocks."""
    producer.llm_engine.release_kv([_hold(r) for r in remotes])
    filler = _prefill(producer, _prompts(99, [40]))[0]
    producer.llm_engine.release_kv([_hold(filler)])


def _add_continuations(engine, prompts, remotes, **params):
    for i, (prompt, remote) in enumerate(zip(prompts, remotes)):
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=1,
                            kv_transfer_params=_continue(remote), **params)
        engine.add_request(f"c{i}", {"prompt_token_ids": prompt}, sp, output_kind=OutputKind.DELTA)


def _drain(engine, streamed: dict[str, list[int]]) -> None:
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)


def _check(mono, prompts, first, streamed) -> None:
    want = _greedy(mono, prompts, max_tokens=MAX_TOKENS)
    for i, w in enumerate(want):
        assert [first[i], *streamed[f"c{i}"]] == w.outputs[0].token_ids, f"continuation c{i}"


CONSUMERS = {
    "one-step": {},
    "chunked": {"max_num_batched_tokens": 8},
    "small-cache": {"num_kv_blocks": 14},  # preempts as the recomputed requests grow
    "no-prefix-cache": {"enable_prefix_caching": False},
}


@pytest.mark.parametrize("consumer", list(CONSUMERS.values()), ids=list(CONSUMERS))
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "decode-cache-warm"])
def test_continuations_whose_hold_is_gone_before_admission_equal_the_monolithic_engine(tiny_llama, consumer, warm):
    mono, producer = _llm(tiny_llama), _llm(tiny_llama, "kv_producer")
    decode = _llm(tiny_llama, "kv_consumer", **consumer)
    prompts = _prompts(5, [30, 17, 12, 9])  # (12: a whole number of blocks)
    if warm:  # the decode engine's prefix cache holds the prompts' blocks and their first output tokens
        _greedy(decode, prompts, max_tokens=MAX_TOKENS)
    first, remotes = _first_tokens(producer, prompts)
    _release(producer, remotes)
    engine, streamed = decode.llm_engine, {}
    _add_continuations(engine, prompts, remotes)
    _drain(engine, streamed)
    _check(mono, prompts, first, streamed)
    stats = engine.get_stats()
    assert stats.kv_transfer["loads"] == 0 and stats.kv_transfer["fallbacks"] == stats.kv_transfer["load_failures"] > 0
    if consumer is CONSUMERS["small-cache"]:
        assert stats.num_preemptions > 0, "nothing was preempted after the failed loads"
    _all_free(mono, producer, decode)


@pytest.mark.parametrize("consumer", [{}, {"max_num_batched_tokens": 8}], ids=["one-step", "chunked"])
def test_a_hold_released_between_admission_and_the_load_equals_the_monolithic_engine(tiny_llama, consumer):
    """The decode engine schedules the continuation's load; before the step that reads it runs, the hold
    is released and the producer steps (reusing its blocks): the read is refused mid-step."""
    mono, producer = _llm(tiny_llama), _llm(tiny_llama, "kv_producer")
    decode = _llm(tiny_llama, "kv_consumer", **consumer)
    prompts = _prompts(6, [26, 15])
    first, remotes = _first_tokens(producer, prompts)
    engine, streamed = decode.llm_engine, {}
    executor = engine.engine_core.executor
    real = executor.execute_model
    gone = {remotes[1]["remote_request_id"]}

    def releasing_first(so):
        md = so.kv_connector_metadata
        if md is not None and any(job.remote["remote_request_id"] in gone for job in md.loads):
            _release(producer, [r for r in remotes if r["remote_request_id"] in gone])
            gone.clear()
        return real(so)

    executor.execute_model = releasing_first
    try:
        _add_continuations(engine, prompts, remotes)
        _drain(engine, streamed)
    finally:
        executor.execute_model = real
    assert not gone, "the load of c1 was never scheduled"
    _check(mono, prompts, first, streamed)
    stats = engine.get_stats().kv_transfer
    assert (stats["loads"], stats["load_failures"], stats["fallbacks"]) == (1, 1, 1)
    _all_free(mono, producer, decode)


def test_n_children_of_a_gone_hold_equal_the_monolithic_engine(tiny_llama):
    mono, producer = _llm(tiny_llama), _llm(tiny_llama, "kv_producer")
    decode = _llm(tiny_llama, "kv_consumer", max_num_batched_tokens=8)
    prompt = _prompts(7, [22])[0]
    _, (remote,) = _first_tokens(producer, [prompt])
    _release(producer, [remote])
    common = dict(n=3, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    got = decode.generate([{"prompt_token_ids": prompt}], SamplingParams(kv_transfer_params=remote, **common),
                          use_tqdm=False)[0]
    want = mono.generate([{"prompt_token_ids": prompt}], SamplingParams(**common), use_tqdm=False)[0]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert decode.llm_engine.get_stats().kv_transfer["loads"] == 0
    _all_free(mono, producer, decode)


def test_a_step_that_fails_while_its_load_is_in_flight_leaves_no_prefix_hits(tiny_llama):
    """The step carrying a load raises (its requests finish with an error): the load never landed, so
    its blocks are no prefix hits for the next request with that prompt, which equals the monolithic
    engine, and the load counts as failed, not as loaded."""
    mono, producer = _llm(tiny_llama), _llm(tiny_llama, "kv_producer")
    decode = _llm(tiny_llama, "kv_consumer")
    prompt = _prompts(8, [21])[0]
    first, (remote,) = _first_tokens(producer, [prompt])
    engine = decode.llm_engine
    executor = engine.engine_core.executor
    real = executor.execute_model

    def failing(so):
        md = so.kv_connector_metadata
        if md is not None and md.loads:
            raise RuntimeError("injected: the step carrying a load failed")
        return real(so)

    executor.execute_model = failing
    try:
        _add_continuations(engine, [prompt], [remote])
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
    finally:
        executor.execute_model = real
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "error"
    stats = engine.get_stats().kv_transfer
    assert stats["loads"] == 0 and stats["load_failures"] == 1
    probe = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    again = decode.generate([{"prompt_token_ids": prompt}], probe, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0, "blocks of a load that never landed were prefix hits"
    assert again.outputs[0].token_ids == _greedy(mono, [prompt], max_tokens=MAX_TOKENS)[0].outputs[0].token_ids
    assert first[0] == again.outputs[0].token_ids[0]
    _all_free(mono, producer, decode)


SEEDED = dict(temperature=0.9, seed=11)


@pytest.mark.parametrize("continued", [True, False], ids=["continuation", "whole-output"])
def test_seeded_requests_whose_load_fails_sample_as_the_monolithic_engine(tiny_llama, continued):
    """The step that read the failed load sampled a token that is dropped: its draw from the request's
    seeded generator must be dropped with it, else every later token is sampled one draw ahead (with
    noise-dominated logits the output looks like the monolithic one with a token missing)."""
    mono, producer, decode = _llm(tiny_llama), _llm(tiny_llama, "kv_producer"), _llm(tiny_llama, "kv_consumer")
    prompts = _prompts(9, [30, 13])
    params = dict(max_tokens=MAX_TOKENS, ignore_eos=True, **SEEDED)
    pre = producer.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=1, ignore_eos=True, kv_transfer_params={"do_remote_decode": True},
                                           **SEEDED), use_tqdm=False)
    remotes = [o.kv_transfer_params for o in pre]
    _release(producer, remotes)
    sp = [SamplingParams(kv_transfer_params=_continue(r) if continued else r, **params) for r in remotes]
    got = decode.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    want = mono.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**params), use_tqdm=False)
    # (a continuation's finished output holds the prefill's token too)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    if continued:
        assert [p.outputs[0].token_ids for p in pre] == [w.outputs[0].token_ids[:1] for w in want]
    assert decode.llm_engine.get_stats().kv_transfer["load_failures"] == len(prompts)
    _all_free(mono, producer, decode)


def test_seeded_n_children_of_a_gone_hold_sample_as_the_monolithic_engine(tiny_llama):
    mono, producer, decode = _llm(tiny_llama), _llm(tiny_llama, "kv_producer"), _llm(tiny_llama, "kv_consumer")
    prompt = _prompts(10, [19])[0]
    _, (remote,) = _first_tokens(producer, [prompt])
    _release(producer, [remote])
    common = dict(n=3, max_tokens=MAX_TOKENS, ignore_eos=True, **SEEDED)
    got = decode.generate([{"prompt_token_ids": prompt}], SamplingParams(kv_transfer_params=remote, **common),
                          use_tqdm=False)[0]
    want = mono.generate([{"prompt_token_ids": prompt}], SamplingParams(**common), use_tqdm=False)[0]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert decode.llm_engine.get_stats().kv_transfer["load_failures"] == 3
    _all_free(mono, producer, decode)


def test_a_rewound_generator_draws_what_it_would_have_drawn():
    import torch

    from pagedserve.engine.sample.state import SamplingState

    def draw(state: SamplingState) -> torch.Tensor:
        return torch.empty(8).exponential_(generator=state.generator_for(torch.device("cpu")))

    state = SamplingState.create(SamplingParams(temperature=1.0, seed=5), [1, 2])
    state.pending_draws = 1
    fresh = state.draws_checkpoint()  # before the generator exists
    draw(state)
    fresh.rewind_draws()
    assert state.generator is None and state.pending_draws == 1
    first = draw(state)
    made = state.draws_checkpoint()  # the generator exists: its state is restored
    second = draw(state)
    made.rewind_draws()
    assert torch.equal(draw(state), second) and not torch.equal(first, second)
