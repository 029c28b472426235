"""The PD client and the OpenAI app over a prefill engine and a decode engine in one process (the
in-process KV transport, no Ray): every answer equals the monolithic engine's, and the PD paths
(prefill answer, decode-only, fallbacks, releases) leave every block free on both engines."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
from ray.exceptions import RayActorError

from tests.local_serving import LocalHandle, LocalServer
from tests.pd_local import MODEL_NAME, LocalPD, metric, normalized, same_answer, sse_summary

PROMPTS = [[(11 * i + 7 * k) % 480 + 10 for k in range(n)] for i, n in enumerate((3, 4, 9, 17, 30))]


@pytest.fixture(scope="module")
def servers(tiny_model_factory):
    model = str(tiny_model_factory("llama", max_position_embeddings=512))
    mono = LocalServer(model)
    pd = LocalPD(model)
    try:
        yield mono, pd
    finally:
        pd.close()
        mono.close()


@pytest.fixture(scope="module")
def clients(servers):
    mono, pd = servers
    with mono.test_client() as mono_client, pd.test_client() as pd_client:
        yield mono_client, pd_client


@pytest.fixture(autouse=True)
def every_block_free(servers):
    yield
    mono, pd = servers
    for free, total, held in pd.wait_idle():
        assert (free, held) == (total, 0)
    free, total = mono.kv_blocks_when_idle()
    assert free == total


def both(clients, path: str, body: dict) -> tuple[dict, dict]:
    mono_client, pd_client = clients
    body = {"model": MODEL_NAME, **body}
    mono, pd = mono_client.post(path, json=body), pd_client.post(path, json=body)
    assert mono.status_code == 200, mono.text
    assert pd.status_code == 200, pd.text
    return normalized(mono.json()), normalized(pd.json())


def test_greedy_completions_equal_monolithic(clients, servers):
    _, pd = servers
    before = pd.kv_stats(pd.decode)["loads"]
    for prompt in PROMPTS:
        mono, disagg = both(clients, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert not same_answer(mono, disagg)
    assert pd.kv_stats(pd.decode)["loads"] > before  # the decode engine loaded prompts, not computed them
    assert pd.client.counters.pd_requests >= len(PROMPTS)


def test_streaming_with_usage_equals_monolithic(clients):
    mono_client, pd_client = clients
    for prompt in PROMPTS[1:4]:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 10, "temperature": 0,
                "stream_options": {"include_usage": True}, "logprobs": 1}
        mono = sse_summary(mono_client, "/v1/completions", body)
        assert not same_answer(mono, sse_summary(pd_client, "/v1/completions", body))
        assert mono["usage"]["completion_tokens"] == 10


def test_the_first_token_is_the_prefills_and_the_stream_still_equals_monolithic(clients, servers):
    """n == 1: the client gets the prefill's token at once and the decode engine continues from it; the
    stream (text with stop-string hold-back and split characters, logprobs, usage, seeded draws) is the
    monolithic one."""
    _, pd = servers
    mono_client, pd_client = clients
    before = pd.client.counters.continuations
    bodies = [{"temperature": 0, "stop": ["zq", "never stops here"], "logprobs": 2},
              {"temperature": 0.9, "top_p": 0.9, "seed": 11, "ignore_eos": True},
              {"temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}]
    for prompt, extra in zip(PROMPTS[2:], bodies):
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 9, **extra}
        mono = sse_summary(mono_client, "/v1/completions", body)
        assert not same_answer(mono, sse_summary(pd_client, "/v1/completions", body))
    assert pd.client.counters.continuations == before + len(bodies)


def test_n_logprobs_and_seeded_sampling_equal_monolithic(clients):
    for body in ({"n": 3, "logprobs": 2, "temperature": 0}, {"n": 2, "temperature": 1.0, "seed": 7, "logprobs": 1},
                 {"temperature": 0.8, "top_k": 20, "seed": 3}):
        mono, disagg = both(clients, "/v1/completions", {"prompt": PROMPTS[3], "max_tokens": 6, **body})
        assert not same_answer(mono, disagg)


def test_stop_strings_and_chat_equal_monolithic(clients):
    mono, _ = both(clients, "/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0})
    text = mono["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip()
    mono, disagg = both(clients, "/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0,
                                                      "stop": [stop]})
    assert not same_answer(mono, disagg) and mono["choices"][0]["finish_reason"] == "stop"
    chat = {"messages": [{"role": "user", "content": "paged attention stores keys"}], "max_tokens": 8,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    mono, disagg = both(clients, "/v1/chat/completions", chat)
    assert not same_answer(mono, disagg)
    mono_client, pd_client = clients
    body = {"model": MODEL_NAME, **chat}
    assert not same_answer(sse_summary(mono_client, "/v1/chat/completions", body),
                           sse_summary(pd_client, "/v1/chat/completions", body))


def test_one_token_is_answered_by_the_prefill(clients, servers):
    _, pd = servers
    decode_routed = pd.client.decode.engines[0].num_routed
    answers = pd.client.counters.prefill_answers
    mono, disagg = both(clients, "/v1/completions", {"prompt": PROMPTS[4], "max_tokens": 1, "temperature": 0})
    assert not same_answer(mono, disagg)
    assert pd.client.counters.prefill_answers == answers + 1
    assert pd.client.decode.engines[0].num_routed == decode_routed  # no decode request at all


def test_prompt_logprobs_run_on_the_decode_engine_alone(clients, servers):
    _, pd = servers
    decode_only = pd.client.counters.decode_only
    mono, disagg = both(clients, "/v1/completions", {"prompt": PROMPTS[3], "max_tokens": 4, "temperature": 0,
                                                      "prompt_logprobs": 1, "echo": False})
    assert not same_answer(mono, disagg)
    assert pd.client.counters.decode_only == decode_only + 1


def test_only_blocks_the_decode_cache_lacks_move(clients, servers):
    _, pd = servers
    prompt = [(5 * k) % 470 + 20 for k in range(26)]
    def after_one_more_load(before: dict) -> dict:  # published stats lag the answer by a loop turn
        deadline = time.monotonic() + 20
        while pd.kv_stats(pd.decode)["loads"] == before["loads"] and time.monotonic() < deadline:
            time.sleep(0.02)
        return pd.kv_stats(pd.decode)

    first = pd.kv_stats(pd.decode)
    both(clients, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0})
    second = after_one_more_load(first)
    both(clients, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0})
    third = after_one_more_load(second)
    # n == 1 continues from the prefill's token: the whole prompt's KV moves (the token's own is computed).
    assert second["loaded_tokens"] - first["loaded_tokens"] == len(prompt)
    # The second time the decode engine's prefix cache holds the full blocks: only the tail moves.
    moved = third["loaded_tokens"] - second["loaded_tokens"]
    assert 0 <= moved < 4
    assert third["loaded_bytes"] - second["loaded_bytes"] < (second["loaded_bytes"] - first["loaded_bytes"]) / 4


def test_cache_salt_salts_both_legs(clients, servers):
    """The salt reaches the prefill and the decode engine: the same salt hits both engines' prefix
    caches (only the tail moves), another salt hits neither (the whole prompt moves again)."""
    _, pd = servers
    prompt = [(9 * k) % 430 + 25 for k in range(26)]  # six full blocks and a tail of 2

    def moved_and_hits(salt: str) -> tuple[int, int]:
        before, hits = pd.kv_stats(pd.decode), pd.prefill.engine.get_stats().scheduler.prefix_cache_hits
        mono, disagg = both(clients, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                         "cache_salt": salt})
        assert not same_answer(mono, disagg)
        deadline = time.monotonic() + 20  # published stats lag the answer by a loop turn
        while pd.kv_stats(pd.decode)["loads"] == before["loads"] and time.monotonic() < deadline:
            time.sleep(0.02)
        pd.wait_idle()
        after = pd.kv_stats(pd.decode)
        return (after["loaded_tokens"] - before["loaded_tokens"],
                pd.prefill.engine.get_stats().scheduler.prefix_cache_hits - hits)

    assert moved_and_hits("tenant-1") == (len(prompt), 0)
    moved, hits = moved_and_hits("tenant-1")
    assert moved < 4 and hits == 24
    assert moved_and_hits("tenant-2") == (len(prompt), 0)

def test_metrics_report_kv_transfer_and_pools(clients):
    _, pd_client = clients
    pd_client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPTS[4], "max_tokens": 3,
                                            "temperature": 0})
    text = pd_client.get("/metrics").text
    assert metric(text, "pagedserve:kv_transfer_bytes_total") > 0
    assert metric(text, "pagedserve:kv_transfer_blocks_pulled_total") > 0
    assert metric(text, "pagedserve:kv_transfer_time_seconds_count") > 0
    assert 'pool="prefill"' in text and 'pool="decode"' in text
    assert 'engine_index="prefill-0"' in text and 'engine_index="decode-0"' in text


# --------------------------------------------------------------------------- faults


class _DeadOnGenerate:
    """A handle whose actor is gone: generate streams fail with RayActorError (stats still answer)."""

    def __init__(self, inner: LocalHandle, after_outputs: int = 0) -> None:
        self.inner = inner
        self.after_outputs = after_outputs

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    @property
    def generate(self):
        outer = self

        class _Method:
            @staticmethod
            def remote(*args):
                async def stream():
                    if outer.after_outputs:  # the engine served some outputs before it died
                        produced = 0
                        inner = outer.inner.generate.remote(*args)
                        async for ref in inner:
                            produced += 1
                            yield ref
                            if produced >= outer.after_outputs:
                                break
                        await inner.aclose()
                    raise RayActorError()

                return stream()

        return _Method()


@contextlib.contextmanager
def dead_engine(pd: LocalPD, pool: str, after_outputs: int = 0) -> Iterator[None]:
    """The pool's first engine dies on generate (after `after_outputs` outputs) until the block ends."""
    state = getattr(pd.client, pool).engines[0]
    handle = getattr(pd, f"{pool}_handle")
    state.handle = _DeadOnGenerate(handle, after_outputs=after_outputs)
    try:
        yield
    finally:
        state.handle = handle
        state.available = True


def test_dead_prefill_engine_falls_back_to_the_decode_engine(clients, servers):
    _, pd = servers
    fallbacks = pd.client.counters.prefill_fallbacks
    with dead_engine(pd, "prefill"):
        mono, disagg = both(clients, "/v1/completions", {"prompt": PROMPTS[3], "max_tokens": 6, "temperature": 0})
    assert not same_answer(mono, disagg)
    assert pd.client.counters.prefill_fallbacks == fallbacks + 1


def test_dead_decode_engine_fails_cleanly_and_releases_the_hold(clients, servers):
    _, pd = servers
    _, pd_client = clients
    with dead_engine(pd, "decode", after_outputs=1):
        response = pd_client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPTS[4],
                                                           "max_tokens": 40, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "engine_dead"
        with pd_client.stream("POST", "/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPTS[3],
                                                               "max_tokens": 40, "stream": True}) as stream:
            lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert any('"engine_dead"' in line for line in lines) and lines[-1] == "data: [DONE]"
    # (every_block_free: the producer's holds were released, the abandoned decodes finished)


def test_decode_failure_before_any_output_releases_the_hold(clients, servers):
    _, pd = servers
    _, pd_client = clients
    with dead_engine(pd, "decode"):
        response = pd_client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPTS[4],
                                                           "max_tokens": 5, "temperature": 0})
        assert response.status_code == 503
    figures = pd.wait_idle()
    assert figures[0][2] == 0  # nothing held on the prefill engine


def test_unpulled_kv_is_freed_after_the_hold_timeout(tiny_model_factory):
    """A consumer that never pulls: the producer frees the blocks once hold_timeout_s passes."""
    pd = LocalPD(str(tiny_model_factory("llama", max_position_embeddings=512)), hold_timeout_s=0.5)
    try:
        async def prefill_only() -> dict:
            outputs = [o async for o in pd.prefill.generate("lonely", {"prompt_token_ids": PROMPTS[4]},
                                                            {"max_tokens": 1, "temperature": 0,
                                                             "kv_transfer_params": {"do_remote_decode": True}})]
            return outputs[-1].kv_transfer_params

        params = asyncio.run(prefill_only())
        assert params["remote_hold_token"] and "remote_block_ids" not in params  # the producer knows its blocks
        # (the engine publishes its stats a loop turn after the output: wait for the expiry itself)
        deadline = time.monotonic() + 20
        while pd.kv_stats(pd.prefill)["expired_holds"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pd.kv_stats(pd.prefill)["expired_holds"] == 1
        (free, total, held), _ = pd.wait_idle(timeout_s=20)
        assert (free, held) == (total, 0)
    finally:
        pd.close()


def test_n_children_scheduled_in_separate_steps_read_no_released_kv(tiny_model_factory):
    """n=3 on a decode engine that runs one sequence at a time, while the prefill engine keeps reusing
    its freed blocks: every child still equals the greedy monolithic answer (no child reads the prompt
    from a producer whose hold an earlier child already released)."""
    model = str(tiny_model_factory("llama", max_position_embeddings=512))
    pd = LocalPD(model, engine_kwargs={"kv_cache_memory": None, "num_kv_blocks": 24},
                 decode_kwargs={"max_num_seqs": 1, "num_kv_blocks": 64})
    mono = LocalServer(model)
    prompt = [(7 * k) % 400 + 30 for k in range(30)]  # 7 full blocks of 4 and a tail of 2
    try:
        with mono.test_client() as mono_client, pd.test_client() as pd_client:
            body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            expected = mono_client.post("/v1/completions", json=body).json()["choices"][0]["text"]

            done = threading.Event()

            async def busy_producer() -> None:  # keeps allocating (and so reusing) the producer's free blocks
                i = 0
                while not done.is_set():
                    other = [(11 * k + i) % 400 + 30 for k in range(60)]
                    async for _ in pd.prefill.generate(f"busy{i}", {"prompt_token_ids": other},
                                                       {"max_tokens": 2, "temperature": 0}):
                        pass
                    i += 1

            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                busy = pool.submit(asyncio.run, busy_producer())
                try:
                    response = pd_client.post("/v1/completions", json={**body, "n": 3})
                finally:
                    done.set()
                    busy.result()
            assert response.status_code == 200, response.text
            assert [c["text"] for c in response.json()["choices"]] == [expected] * 3
        for free, total, held in pd.wait_idle():
            assert (free, held) == (total, 0)
    finally:
        pd.close()
        mono.close()


def test_a_stream_closed_after_its_first_token_releases_the_hold_at_once(tiny_model_factory):
    """A caller that stops right after the first token (the prefill's own), before the decode leg starts,
    or while the decode leg runs (its task cancelled): the producer's hold goes within a second, not at
    hold_timeout_s."""
    pd = LocalPD(str(tiny_model_factory("llama", max_position_embeddings=512)))
    params = {"max_tokens": 30, "temperature": 0, "ignore_eos": True}
    connector = pd.prefill.engine.engine.engine_core.scheduler.kv_connector

    async def held_after(stop) -> tuple[int, int]:
        """(held right after the first token, held once the caller stopped and a second passed)."""
        stream = pd.client.generate(f"early-{stop.__name__}", PROMPTS[4], params)
        first = await anext(stream)
        assert len(first.outputs[0].token_ids) == 1
        held = len(connector._held)
        await stop(stream)
        deadline = time.monotonic() + 1.0
        while connector._held and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # (the release is fire and forget on this loop)
        return held, len(connector._held)

    async def close(stream) -> None:
        await stream.aclose()

    async def cancel_in_decode(stream) -> None:
        task = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    try:
        for stop in (close, cancel_in_decode):
            assert asyncio.run(held_after(stop)) == (1, 0), stop.__name__
        assert pd.kv_stats(pd.prefill)["expired_holds"] == 0
        for free, total, held in pd.wait_idle():
            assert (free, held) == (total, 0)
    finally:
        pd.close()


def test_embeddings_equal_monolithic(clients, servers):
    """An embedding is a prefill and nothing else: the PD app computes it on a prefill engine, and the vector
    is the monolithic server's; no hold is left behind (`every_block_free`)."""
    mono_client, pd_client = clients
    body = {"model": MODEL_NAME, "input": PROMPTS, "encoding_format": "float"}
    mono, pd = mono_client.post("/v1/embeddings", json=body), pd_client.post("/v1/embeddings", json=body)
    assert mono.status_code == 200 and pd.status_code == 200, (mono.text, pd.text)
    assert pd.json()["usage"] == mono.json()["usage"] == {"prompt_tokens": sum(map(len, PROMPTS)),
                                                          "total_tokens": sum(map(len, PROMPTS))}
    for a, b in zip(mono.json()["data"], pd.json()["data"], strict=True):
        assert a["index"] == b["index"]
        assert max(abs(x - y) for x, y in zip(a["embedding"], b["embedding"], strict=True)) < 1e-5
