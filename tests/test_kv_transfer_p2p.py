"""Engines wired with the torch_p2p KV transport (torch.distributed point to point; its pieces are
tested in tests/test_kv_transfer_p2p_wire.py, its defences in tests/test_kv_transfer_p2p_security.py).

Two offline LLMs give one LLM's greedy tokens with chunked prefill on the producer, different block
sizes on the two sides and prefix hits on the consumer (which move fewer bytes); a producer whose
listener is gone, an unreachable producer (tried once per backoff, never from the step thread), a
producer that stalls mid-transfer and a producer process that dies mid-transfer all make the consumer
compute the prompt, with the monolithic engine's tokens; Ray-actor ranks (TP=2 producer -> TP=1
consumer, PP=2 producer -> TP=2 consumer) read each other across processes (slow). Every block on
both sides is free afterwards. Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time

import pytest

from pagedserve.engine import LLM, SamplingParams
from tests.tiny_models import VOCAB_SIZE

HOST = "127.0.0.1"
SECRET = "p2p-engine-test-secret-0123456789"  # engines in other processes (Ray ranks, a spawned producer) share it


def _kw(path, **over):
    return {"model": str(path), "dtype": "float32", "num_kv_blocks": 64, "block_size": 4,
            "max_num_batched_tokens": 64, **over}


def _p2p(role: str, **extra) -> dict:
    return {"kv_connector": "torch_p2p", "kv_role": role, "kv_secret": SECRET,
            "kv_connector_extra_config": {"kv_host": HOST, **extra}}


GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0, kv_transfer_params={"do_remote_decode": True})


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, VOCAB_SIZE) for _ in range(n)] for n in lengths]


def _pd(producer: LLM, consumer: LLM, prompts: list[list[int]]) -> list[list[int]]:
    pre = producer.generate([{"prompt_token_ids": p} for p in prompts], PREFILL, use_tqdm=False)
    params = [o.kv_transfer_params for o in pre]
    assert all(p and p["kv_connector"] == "torch_p2p" for p in params)
    outs = consumer.generate([{"prompt_token_ids": p} for p in prompts],
                             [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, kv_transfer_params=p)
                              for p in params], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _mono(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]


def _drain_producer(producer: LLM) -> None:
    """Tick the producer until every release (they arrive on the transport's threads) freed its blocks."""
    deadline = time.monotonic() + 60
    while producer.llm_engine.free_released_kv() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert producer.llm_engine.free_released_kv() == 0


def _holds(prefills) -> list[tuple[str, str]]:
    """What releases the producer's holds of these prefills: (hold id, hold token) each."""
    return [(o.kv_transfer_params["remote_request_id"], o.kv_transfer_params["remote_hold_token"]) for o in prefills]


def _all_free(llm: LLM) -> bool:
    stats = llm.llm_engine.get_stats()
    return stats.num_free_blocks == stats.num_total_blocks


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


def test_two_llms_over_torch_p2p_match_one_llm_and_prefix_hits_move_fewer_bytes(model):
    # The producer prefills in chunks of 16 tokens; the consumer's blocks are twice the producer's.
    producer = LLM(**_kw(model, max_num_batched_tokens=16), kv_transfer_config=_p2p("kv_producer"))
    consumer = LLM(**_kw(model, block_size=8), kv_transfer_config=_p2p("kv_consumer"))
    mono = LLM(**_kw(model))
    try:
        prompts = _prompts(0, (5, 17, 33))
        assert _pd(producer, consumer, prompts) == _mono(mono, prompts)
        stats = consumer.llm_engine.get_stats().kv_transfer
        assert stats["loads"] == 3 and stats["fallbacks"] == 0
        assert stats["loaded_tokens"] == sum(len(p) - 1 for p in prompts)
        cfg = producer.llm_engine.engine_core.config.hf_config
        per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
        assert stats["loaded_bytes"] == stats["loaded_tokens"] * per_token

        # The consumer already holds the first 32 tokens of the longest prompt (4 blocks of 8): only the rest moves.
        extended = [prompts[2] + _prompts(1, (12,))[0]]
        before = stats["loaded_bytes"]
        assert _pd(producer, consumer, extended) == _mono(mono, extended)
        after = consumer.llm_engine.get_stats().kv_transfer
        moved = after["loaded_bytes"] - before
        assert moved == (len(extended[0]) - 1 - 32) * per_token
        assert moved < (len(extended[0]) - 1) * per_token
        assert after["fallbacks"] == 0

        _drain_producer(producer)
        assert _all_free(producer) and _all_free(consumer)
    finally:
        for llm in (producer, consumer, mono):
            llm.shutdown()


def test_a_producer_whose_listener_is_gone_makes_the_consumer_compute_the_prompt(model):
    producer = LLM(**_kw(model), kv_transfer_config=_p2p("kv_producer"))
    consumer = LLM(**_kw(model), kv_transfer_config=_p2p("kv_consumer", connect_timeout_s=5))
    mono = LLM(**_kw(model))
    try:
        prompts = _prompts(2, (9, 21))
        pre = producer.generate([{"prompt_token_ids": p} for p in prompts], PREFILL, use_tqdm=False)
        producer.llm_engine.engine_core.executor.worker.model_runner.kv_hooks.transport.close()
        outs = consumer.generate([{"prompt_token_ids": p} for p in prompts],
                                 [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                 kv_transfer_params=o.kv_transfer_params) for o in pre],
                                 use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == _mono(mono, prompts)
        stats = consumer.llm_engine.get_stats().kv_transfer
        assert stats["fallbacks"] == 2 and stats["load_failures"] == 2 and stats["loads"] == 0
        # No reader can release through a closed listener; whoever routes the requests releases them.
        producer.llm_engine.release_kv(_holds(pre))
        _drain_producer(producer)
        assert _all_free(producer) and _all_free(consumer)
    finally:
        for llm in (producer, consumer, mono):
            llm.shutdown()


def _source_of(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner.kv_hooks.source


def _decode(consumer: LLM, prompts, params) -> list[list[int]]:
    outs = consumer.generate([{"prompt_token_ids": p} for p in prompts],
                             [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, kv_transfer_params=p)
                              for p in params], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_an_unreachable_producer_is_tried_once_per_backoff_and_never_from_the_step_thread(model, monkeypatch):
    producer = LLM(**_kw(model), kv_transfer_config=_p2p("kv_producer"))
    consumer = LLM(**_kw(model), kv_transfer_config=_p2p("kv_consumer", kv_reconnect_backoff_s=600))
    mono = LLM(**_kw(model))
    probe = socket.socket()
    probe.bind((HOST, 0))
    dead_port = probe.getsockname()[1]
    probe.close()  # nothing listens there now: connects are refused
    attempts: list[tuple[int, str]] = []
    real_connect = socket.create_connection

    def counting_connect(address, *args, **kwargs):
        attempts.append((address[1], threading.current_thread().name))
        return real_connect(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", counting_connect)
    try:
        prompts = _prompts(4, (7, 13, 22, 9))
        pre = producer.generate([{"prompt_token_ids": p} for p in prompts], PREFILL, use_tqdm=False)
        params = [dict(o.kv_transfer_params, remote_addresses=[{**a, "port": dead_port}
                                                               for a in o.kv_transfer_params["remote_addresses"]])
                  for o in pre]
        expected = _mono(mono, prompts)
        # Two rounds of reads (and the releases of their holds) to the same unreachable producer.
        assert _decode(consumer, prompts[:2], params[:2]) == expected[:2]
        assert _decode(consumer, prompts[2:], params[2:]) == expected[2:]
        tried = [name for port, name in attempts if port == dead_port]
        assert len(tried) == 1, attempts  # the backoff: not again on the next reads, steps or releases
        assert all(name.startswith("torch-p2p-io-") for name in tried)  # never on the engine's step thread
        stats = consumer.llm_engine.get_stats().kv_transfer
        assert stats["fallbacks"] == 4 and stats["loads"] == 0
        producer.llm_engine.release_kv(_holds(pre))
        _drain_producer(producer)
        assert _all_free(producer) and _all_free(consumer)
    finally:
        for llm in (producer, consumer, mono):
            llm.shutdown()


def test_a_producer_that_stalls_mid_transfer_makes_the_consumer_recompute_and_both_keep_serving(model):
    producer = LLM(**_kw(model), kv_transfer_config=_p2p("kv_producer"))
    consumer = LLM(**_kw(model), kv_transfer_config=_p2p("kv_consumer", read_timeout_s=2))
    mono = LLM(**_kw(model))
    source = _source_of(producer)
    stall = threading.Event()
    real_read_layer = source.read_layer

    def stalling_read_layer(spec, layer, slots=None):
        if layer > 0:  # the first layer goes out; the rest waits
            stall.wait(120)
        return real_read_layer(spec, layer, slots)

    source.read_layer = stalling_read_layer
    try:
        prompts = _prompts(5, (11, 18))
        pre = producer.generate([{"prompt_token_ids": p} for p in prompts], PREFILL, use_tqdm=False)
        assert _decode(consumer, prompts, [o.kv_transfer_params for o in pre]) == _mono(mono, prompts)
        stats = consumer.llm_engine.get_stats().kv_transfer
        assert stats["fallbacks"] == 2 and stats["loads"] == 0
        stall.set()
        # Both ends go on: the next transfers load (on a fresh pair).
        more = _prompts(6, (9, 26))
        assert _pd(producer, consumer, more) == _mono(mono, more)
        assert consumer.llm_engine.get_stats().kv_transfer["loads"] == 2
        producer.llm_engine.release_kv(_holds(pre))
        _drain_producer(producer)
        assert _all_free(producer) and _all_free(consumer)
    finally:
        stall.set()
        for llm in (producer, consumer, mono):
            llm.shutdown()


def _producer_that_dies_mid_transfer(model_path: str, prompts, out) -> None:
    """A producer engine in another process: prefill, hand out the params, then die (exit code 17) while
    gathering the second layer of the first read."""
    producer = LLM(**_kw(model_path), kv_transfer_config=_p2p("kv_producer"))
    source = _source_of(producer)
    real_read_layer = source.read_layer
    calls = []

    def dying_read_layer(spec, layer, slots=None):
        calls.append(layer)
        if len(calls) == 2:
            os._exit(17)
        return real_read_layer(spec, layer, slots)

    source.read_layer = dying_read_layer
    pre = producer.generate([{"prompt_token_ids": p} for p in prompts], PREFILL, use_tqdm=False)
    out.put([o.kv_transfer_params for o in pre])
    time.sleep(300)


def test_a_producer_process_that_dies_mid_transfer_makes_the_consumer_recompute(model):
    import multiprocessing

    prompts = _prompts(7, (10, 23))
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_producer_that_dies_mid_transfer, args=(str(model), prompts, out), daemon=True)
    child.start()
    consumer = LLM(**_kw(model), kv_transfer_config=_p2p("kv_consumer", read_timeout_s=30))
    mono = LLM(**_kw(model))
    try:
        params = out.get(timeout=300)
        assert _decode(consumer, prompts, params) == _mono(mono, prompts)
        child.join(60)
        assert child.exitcode == 17  # it died in the middle of the read, as planned
        stats = consumer.llm_engine.get_stats().kv_transfer
        assert stats["fallbacks"] == 2 and stats["loads"] == 0
        assert _mono(consumer, prompts) == _mono(mono, prompts)  # the consumer lives on
        assert _all_free(consumer)
    finally:
        if child.is_alive():
            child.kill()
        for llm in (consumer, mono):
            llm.shutdown()


RAY = {"distributed_executor_backend": "ray"}
# (producer, consumer) layouts whose ranks are Ray actors (other processes): the addresses must travel.
CROSS_PROCESS = [
    ({"tensor_parallel_size": 2, **RAY}, {"block_size": 8}),  # TP=2 producer -> TP=1 consumer in this process
    ({"pipeline_parallel_size": 2, **RAY}, {"tensor_parallel_size": 2, "block_size": 8, **RAY}),  # PP=2 -> TP=2
]


@pytest.mark.slow  # a local Ray with two worker groups at a time: a minute or two on two busy CPU cores
def test_ray_rank_producers_feed_consumers_of_other_layouts_across_processes(model, monkeypatch):
    pytest.importorskip("ray")
    from tests.local_ray import fresh_local_ray

    # A fresh local instance even when a `ray start` cluster runs on this machine (ray.init would join it).
    monkeypatch.setenv("RAY_ADDRESS", "local")
    prompts = _prompts(3, (6, 19, 30))
    mono = LLM(**_kw(model))
    try:
        expected = _mono(mono, prompts)
    finally:
        mono.shutdown()
    with fresh_local_ray(num_cpus=4):
        for producer_kw, consumer_kw in CROSS_PROCESS:
            producer = LLM(**_kw(model, **producer_kw), kv_transfer_config=_p2p("kv_producer"))
            consumer = LLM(**_kw(model, **consumer_kw), kv_transfer_config=_p2p("kv_consumer"))
            try:
                pre = producer.generate([{"prompt_token_ids": p} for p in prompts], PREFILL, use_tqdm=False)
                addresses = pre[0].kv_transfer_params["remote_addresses"]
                assert [a["rank"] for a in addresses] == [0, 1] and addresses[0]["port"] != addresses[1]["port"]
                outs = consumer.generate([{"prompt_token_ids": p} for p in prompts],
                                         [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                         kv_transfer_params=o.kv_transfer_params) for o in pre],
                                         use_tqdm=False)
                assert [o.outputs[0].token_ids for o in outs] == expected, (producer_kw, consumer_kw)
                stats = consumer.llm_engine.get_stats().kv_transfer
                assert stats["loads"] == 3 and stats["fallbacks"] == 0, stats
                # Ray-actor ranks cannot reach their engine's scheduler: whoever routes the requests releases
                # them through release_kv (cluster/pd does); the transport's releases are a no-op there.
                producer.llm_engine.release_kv(_holds(pre))
                _drain_producer(producer)
                assert _all_free(producer) and _all_free(consumer)
            finally:
                consumer.shutdown()
                producer.shutdown()
