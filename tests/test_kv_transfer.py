"""Prefill/decode disaggregation in one process: a producer LLM computes prompts and keeps their KV, a
consumer LLM loads it (in-process transport) and generates. The consumer's greedy tokens equal the
monolithic engine's (and so HF's) under every scheduler feature; only what the consumer lacks moves;
failed or expired loads fall back to computing the prompt; no block is ever leaked."""

from __future__ import annotations

import itertools
import random
import time

import pytest

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.detokenizer import streamed_text_of_first_tokens
from pagedserve.kv_transfer.config import KVTransferConfig, parse_kv_transfer_config
from pagedserve.kv_transfer.layout import KVLayout, check_compatible, plan_reads
from tests.tiny_models import TINY_ARCHS, VOCAB_SIZE

MAX_NEW = 8


def _prompts(seed: int, lengths, prefix=()):
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(8, VOCAB_SIZE) for _ in range(n)] for n in lengths]


def _llm(path, role: str | None = None, timeout: float = 120.0, **overrides) -> LLM:
    kwargs = dict(model=str(path), dtype="float32", num_kv_blocks=96, block_size=4, max_num_batched_tokens=64)
    kwargs.update(overrides)
    if role is not None:
        kwargs["kv_transfer_config"] = {"kv_connector": "inproc", "kv_role": role,
                                        "kv_connector_extra_config": {"hold_timeout_s": timeout}}
    return LLM(**kwargs)


def _prefill(producer: LLM, prompts):
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, kv_transfer_params={"do_remote_decode": True})
    outs = producer.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.kv_transfer_params and o.kv_transfer_params["do_remote_prefill"] for o in outs)
    return [o.kv_transfer_params for o in outs]


def _hold(remote: dict) -> tuple[str, str]:
    """What releases a producer's hold: its id and token, from the prefill's kv_transfer_params."""
    return remote["remote_request_id"], remote["remote_hold_token"]


def _decode(consumer: LLM, prompts, remote, **params):
    params = {"max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, **params}
    sp = [SamplingParams(kv_transfer_params=r, **params) for r in remote]
    return consumer.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def _greedy(llm: LLM, prompts, **params):
    sp = SamplingParams(**{"max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, **params})
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def _all_free(*llms: LLM) -> None:
    for llm in llms:
        engine = llm.llm_engine
        deadline = time.monotonic() + 10
        while engine.free_released_kv() and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks, f"{stats.num_total_blocks - stats.num_free_blocks} blocks leaked"


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_pd_equals_monolithic_for_every_architecture(tiny_model_factory, arch):
    path = tiny_model_factory(arch)
    mono, producer, consumer = _llm(path), _llm(path, "kv_producer"), _llm(path, "kv_consumer", block_size=8)
    prompts = _prompts(1, [3, 9, 16, 37])
    remote = _prefill(producer, prompts)
    assert _tokens(_decode(consumer, prompts, remote)) == _tokens(_greedy(mono, prompts))
    stats = consumer.llm_engine.get_stats().kv_transfer
    assert stats["loads"] == 4 and stats["loaded_tokens"] == sum(len(p) - 1 for p in prompts)
    assert stats["fallbacks"] == 0 and stats["loaded_bytes"] > 0
    _all_free(mono, producer, consumer)


def test_pd_matches_hf(tiny_llama):
    from tests.test_engine_parity import _hf_model, hf_greedy

    producer, consumer = _llm(tiny_llama, "kv_producer"), _llm(tiny_llama, "kv_consumer")
    prompts = _prompts(2, [5, 21])
    outs = _decode(consumer, prompts, _prefill(producer, prompts))
    hf = _hf_model(tiny_llama)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def test_chunked_prefill_on_the_producer_and_n_and_logprobs_on_the_consumer(tiny_llama):
    mono = _llm(tiny_llama)
    producer = _llm(tiny_llama, "kv_producer", max_num_batched_tokens=8)  # 40-token prompts take 5 chunks
    consumer = _llm(tiny_llama, "kv_consumer", block_size=16)
    prompts = _prompts(3, [40, 41])
    remote = _prefill(producer, prompts)
    got = _decode(consumer, prompts, remote, n=2, logprobs=2)
    want = _greedy(mono, prompts, n=2, logprobs=2)
    assert _tokens(got) == _tokens(want)
    for g, w in zip(got, want):
        for gc, wc in zip(g.outputs, w.outputs):
            for gl, wl in zip(gc.logprobs, wc.logprobs):
                assert gl.keys() == wl.keys()
                assert all(abs(gl[t].logprob - wl[t].logprob) < 1e-4 for t in gl)
    _all_free(mono, producer, consumer)


def test_prefix_hits_on_the_consumer_move_only_the_missing_blocks(tiny_llama):
    mono, producer, consumer = _llm(tiny_llama), _llm(tiny_llama, "kv_producer"), _llm(tiny_llama, "kv_consumer")
    shared = _prompts(4, [32])[0]
    first, second = _prompts(5, [8, 8], prefix=shared)
    _decode(consumer, [first], _prefill(producer, [first]))
    before = consumer.llm_engine.get_stats().kv_transfer
    out = _decode(consumer, [second], _prefill(producer, [second]))
    after = consumer.llm_engine.get_stats().kv_transfer
    assert _tokens(out) == _tokens(_greedy(mono, [second]))
    # The 32 shared tokens (8 full blocks) came from the consumer's own cache: only 39 - 32 = 7 tokens moved.
    assert after["loaded_tokens"] - before["loaded_tokens"] == len(second) - 1 - 32
    per_token = before["loaded_bytes"] / before["loaded_tokens"]
    assert after["loaded_bytes"] - before["loaded_bytes"] == pytest.approx(per_token * 7)
    _all_free(mono, producer, consumer)


def test_whole_prompt_cached_on_the_consumer_moves_nothing_and_still_releases(tiny_llama):
    producer, consumer = _llm(tiny_llama, "kv_producer"), _llm(tiny_llama, "kv_consumer")
    prompt = _prompts(6, [17])
    first = _decode(consumer, prompt, _prefill(producer, prompt))
    loads = consumer.llm_engine.get_stats().kv_transfer["loads"]
    again = _decode(consumer, prompt, _prefill(producer, prompt))
    assert _tokens(again) == _tokens(first)
    assert consumer.llm_engine.get_stats().kv_transfer["loads"] == loads
    _all_free(producer, consumer)


def test_preemption_on_the_consumer(tiny_llama):
    mono = _llm(tiny_llama)
    producer = _llm(tiny_llama, "kv_producer")
    consumer = _llm(tiny_llama, "kv_consumer", num_kv_blocks=14, max_num_batched_tokens=32)
    prompts = _prompts(7, [12, 13, 14, 15])
    got = _decode(consumer, prompts, _prefill(producer, prompts), max_tokens=12)
    assert consumer.llm_engine.get_stats().num_preemptions > 0
    assert _tokens(got) == _tokens(_greedy(mono, prompts, max_tokens=12))
    _all_free(mono, producer, consumer)


def test_a_hold_nobody_releases_expires(tiny_llama):
    producer = _llm(tiny_llama, "kv_producer", timeout=0.3)
    _prefill(producer, _prompts(8, [20, 30]))
    engine = producer.llm_engine
    assert engine.get_stats().num_free_blocks < engine.get_stats().num_total_blocks
    _all_free(producer)
    assert engine.get_stats().kv_transfer["expired_holds"] == 2


def test_a_load_from_a_gone_producer_falls_back_to_computing_the_prompt(tiny_llama):
    mono, producer, consumer = _llm(tiny_llama), _llm(tiny_llama, "kv_producer"), _llm(tiny_llama, "kv_consumer")
    prompts = _prompts(9, [10, 25])
    remote = _prefill(producer, prompts)
    producer.shutdown()  # its ranks stop serving: every read fails
    got = _decode(consumer, prompts, remote)
    assert _tokens(got) == _tokens(_greedy(mono, prompts))
    stats = consumer.llm_engine.get_stats().kv_transfer
    assert stats["load_failures"] == 2 and stats["fallbacks"] == 2 and stats["loads"] == 0
    _all_free(mono, consumer)


def test_an_expired_or_mismatched_hand_off_is_computed_locally(tiny_llama, tiny_model_factory):
    mono, producer, consumer = _llm(tiny_llama), _llm(tiny_llama, "kv_producer"), _llm(tiny_llama, "kv_consumer")
    prompts = _prompts(10, [11, 12])
    remote = _prefill(producer, prompts)
    expired = dict(remote[0], expires_at=time.time() - 1)
    other = dict(remote[1], remote_layout=dict(remote[1]["remote_layout"], num_kv_heads=7))
    got = _decode(consumer, prompts, [expired, other])
    assert _tokens(got) == _tokens(_greedy(mono, prompts))
    assert consumer.llm_engine.get_stats().kv_transfer["fallbacks"] == 2
    _all_free(mono, producer, consumer)


def test_kv_both_engines_serve_and_load(tiny_llama):
    mono, a, b = _llm(tiny_llama), _llm(tiny_llama, "kv_both"), _llm(tiny_llama, "kv_both")
    prompts = _prompts(11, [19])
    assert _tokens(_decode(b, prompts, _prefill(a, prompts))) == _tokens(_greedy(mono, prompts))
    assert _tokens(_decode(a, prompts, _prefill(b, prompts))) == _tokens(_greedy(mono, prompts))
    _all_free(mono, a, b)


# ---------------------------------------------------------------------- config and layout


def test_kv_transfer_config_errors_name_the_field(tiny_llama):
    with pytest.raises(ValueError, match="kv_transfer_config.kv_connector"):
        _llm(tiny_llama, kv_transfer_config={"kv_connector": "nixl", "kv_role": "kv_producer"})
    with pytest.raises(ValueError, match="kv_transfer_config.kv_role"):
        parse_kv_transfer_config({"kv_connector": "inproc", "kv_role": "producer"})
    with pytest.raises(ValueError, match="hold_timeout_s"):
        parse_kv_transfer_config({"kv_connector": "inproc", "kv_role": "kv_both",
                                  "kv_connector_extra_config": {"hold_timeout_s": 0}})
    config = KVTransferConfig(kv_connector="ray", kv_role="kv_consumer",
                              kv_connector_extra_config={"kv_host": "10.0.0.1"})
    assert config.is_consumer and not config.is_producer and config.extra["kv_host"] == "10.0.0.1"


LAYOUTS = [(tp, pp) for tp in (1, 2, 4) for pp in (1, 2, 3)]


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4, 8])
def test_every_consumer_rank_reads_each_of_its_layer_heads_exactly_once(num_kv_heads):
    for (ptp, ppp), (ctp, cpp) in itertools.product(LAYOUTS, LAYOUTS):
        if (num_kv_heads < ptp and ptp % num_kv_heads) or (num_kv_heads < ctp and ctp % num_kv_heads):
            continue
        if num_kv_heads >= ptp and num_kv_heads % ptp or num_kv_heads >= ctp and num_kv_heads % ctp:
            continue
        producer = KVLayout(6, num_kv_heads, 8, "float32", 16, ptp, ppp)
        consumer = KVLayout(6, num_kv_heads, 8, "float32", 4, ctp, cpp)
        for rank in range(consumer.world_size):
            covered = []
            for plan in plan_reads(consumer, rank, producer):
                assert set(plan.layers) <= set(producer.layers_of(plan.remote_rank))
                assert set(plan.heads) <= set(producer.heads_of(plan.remote_rank))
                mine = consumer.heads_of(rank)
                assert plan.local_head_offset == plan.heads.start - mine.start
                covered += [(layer, head) for layer in plan.layers for head in plan.heads]
            want = [(layer, head) for layer in consumer.layers_of(rank) for head in consumer.heads_of(rank)]
            assert sorted(covered) == sorted(want), (producer, consumer, rank)


def test_incompatible_layouts_are_refused_naming_both():
    a = KVLayout(4, 4, 8, "float32", 16, tp_size=2)
    b = KVLayout(4, 4, 8, "bfloat16", 16, pp_size=2)
    with pytest.raises(ValueError, match=r"TP=2 PP=1.*TP=1 PP=2.*dtype"):
        check_compatible(b, a)


# ---------------------------------------------------------------------- continuation (TTFT = the prefill's token)


def _continue(remote: dict) -> dict:
    return dict(remote, continue_remote_output=True)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=7)])
def test_a_continuation_starts_from_the_producers_token_and_equals_the_monolithic_output(tiny_llama, sampling):
    mono, producer, consumer = _llm(tiny_llama), _llm(tiny_llama, "kv_producer"), _llm(tiny_llama, "kv_consumer")
    prompts = _prompts(12, [6, 23])
    common = dict(ignore_eos=True, **sampling)
    pre = producer.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}, **common),
                            use_tqdm=False)
    got = consumer.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(max_tokens=MAX_NEW, kv_transfer_params=_continue(o.kv_transfer_params),
                                            **common) for o in pre], use_tqdm=False)
    want = mono.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=MAX_NEW, **common),
                         use_tqdm=False)
    assert [o.outputs[0].token_ids[:1] for o in pre] == [w.outputs[0].token_ids[:1] for w in want]
    assert _tokens(got) == _tokens(want)
    assert [g.outputs[0].text for g in got] == [w.outputs[0].text for w in want]
    # The whole prompt's KV moved (the producer's token is the first position computed here).
    assert consumer.llm_engine.get_stats().kv_transfer["loaded_tokens"] == sum(len(p) for p in prompts)
    _all_free(mono, producer, consumer)


@pytest.mark.parametrize("seed,stop", [(13, None), (15, ["never-seen-stop"]), (16, None)])
def test_a_continuation_streams_only_what_follows_the_producers_token(tiny_llama, seed, stop):
    from pagedserve.engine.output_processor import OutputKind

    mono, producer, consumer = _llm(tiny_llama), _llm(tiny_llama, "kv_producer"), _llm(tiny_llama, "kv_consumer")
    prompt = _prompts(seed, [14])[0]
    want = _greedy(mono, [prompt], stop=stop)[0].outputs[0]
    remote = _prefill(producer, [prompt])[0]
    engine = consumer.llm_engine
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=1, stop=stop,
                            kv_transfer_params=_continue(remote))
    engine.add_request("c", {"prompt_token_ids": prompt}, params, output_kind=OutputKind.DELTA)
    tokens, text, logprobs = [], "", []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
            text += out.outputs[0].text
            logprobs += out.outputs[0].logprobs
    assert tokens == want.token_ids[1:] and len(logprobs) == len(tokens)
    prefill_text = producer.get_tokenizer().decode(want.token_ids[:1])
    assert streamed_text_of_first_tokens(prefill_text, params.stop, params.include_stop_str_in_output) + text == want.text
    _all_free(mono, producer, consumer)


def test_a_continuation_is_validated(tiny_llama):
    producer, consumer = _llm(tiny_llama, "kv_producer"), _llm(tiny_llama, "kv_consumer")
    prompt = _prompts(14, [9])
    remote = _continue(_prefill(producer, prompt)[0])
    with pytest.raises(ValueError, match="kv_transfer_params.continue_remote_output.*n must be 1"):
        consumer.generate([{"prompt_token_ids": prompt[0]}], SamplingParams(n=2, max_tokens=4, kv_transfer_params=remote))
    with pytest.raises(ValueError, match="kv_transfer_params.continue_remote_output.*max_tokens"):
        consumer.generate([{"prompt_token_ids": prompt[0]}], SamplingParams(max_tokens=1, kv_transfer_params=remote))
    with pytest.raises(ValueError, match="remote_output_token_ids"):
        bad = dict(remote, remote_output_token_ids=[10**9])
        consumer.generate([{"prompt_token_ids": prompt[0]}], SamplingParams(max_tokens=4, kv_transfer_params=bad))
    producer.llm_engine.release_kv([_hold(remote)])
    _all_free(producer, consumer)


def test_one_hold_feeding_n_children_is_released_after_the_last_child_loads(tiny_llama):
    mono, producer = _llm(tiny_llama), _llm(tiny_llama, "kv_producer")
    consumer = _llm(tiny_llama, "kv_consumer", max_num_seqs=1, enable_prefix_caching=False)  # one child per step
    prompt = _prompts(17, [21])[0]
    remote = _prefill(producer, [prompt])[0]
    engine = consumer.llm_engine
    params = SamplingParams(n=3, max_tokens=3, temperature=0, ignore_eos=True, kv_transfer_params=remote)
    engine.add_request("n3", {"prompt_token_ids": prompt}, params)
    outputs = []
    engine.step(), engine.step()  # the first child loaded; the others have not been scheduled yet
    assert producer.llm_engine.free_released_kv() == 1, "released while children still had to read"
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert engine.get_stats().kv_transfer["loads"] == 3
    (out,) = [o for o in outputs if o.finished]
    want = _greedy(mono, [prompt], max_tokens=3)[0].outputs[0].token_ids
    assert [c.token_ids for c in out.outputs] == [want] * 3
    _all_free(mono, producer, consumer)


def test_a_read_of_a_released_hold_is_refused_and_the_prompt_computed(tiny_llama):
    mono, producer, consumer = _llm(tiny_llama), _llm(tiny_llama, "kv_producer"), _llm(tiny_llama, "kv_consumer")
    prompt = _prompts(18, [19])
    remote = _prefill(producer, prompt)[0]
    producer.llm_engine.release_kv([_hold(remote)])
    other = _prefill(producer, _prompts(19, [30]))[0]  # its step frees the hold and may reuse the blocks
    got = _decode(consumer, prompt, [remote])
    producer.llm_engine.release_kv([_hold(other)])
    assert _tokens(got) == _tokens(_greedy(mono, prompt))
    stats = consumer.llm_engine.get_stats().kv_transfer
    assert stats["load_failures"] == 1 and stats["fallbacks"] == 1 and stats["loads"] == 0
    _all_free(mono, producer, consumer)


def test_a_speculating_consumer_drafts_over_the_loaded_prompt(tiny_llama):
    """The draft model never saw the KV the consumer loads: it computes the prompt itself, so a self-draft
    (the target as its own draft) is accepted at every position, and the output equals the monolithic one."""
    spec = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3}
    mono, producer = _llm(tiny_llama), _llm(tiny_llama, "kv_producer")
    consumer = _llm(tiny_llama, "kv_consumer", speculative_config=spec)
    prompts = _prompts(21, [9, 30])
    remote = _prefill(producer, prompts)
    assert _tokens(_decode(consumer, prompts, remote)) == _tokens(_greedy(mono, prompts))
    stats = consumer.llm_engine.get_stats()
    assert stats.kv_transfer["loaded_tokens"] > 0
    assert stats.spec_decoding["num_accepted_tokens"] == stats.spec_decoding["num_draft_tokens"] > 0
    _all_free(mono, producer, consumer)
