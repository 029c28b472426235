"""Non-streaming HTTP requests ask their engine hosts for the finished output only (`final_only`): the
host runs them `OutputKind.CHECKPOINT`: deltas merged by the engine, one output per checkpoint interval
(what a migration continues from), without per-step detokenization, their text decoded once at the end; they answer exactly what they answered when every request streamed DELTA
outputs to the server.

"The old way" is the same app over the same engine with a coordinator that drops `final_only`: every
request then streams DELTA outputs that the server joins (`streams.collect`), as before the change.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from pagedserve.cluster.serve.engine_host import EngineHost
from pagedserve.cluster.serve.client import ServeEngineClient
from pagedserve.cluster.serving.app import build_fastapi_app
from pagedserve.cluster.serving.core import OpenAIServing
from pagedserve.cluster.serving.streams import RequestTimer
from pagedserve.engine import output_processor
from pagedserve.engine.output_processor import OutputKind
from pagedserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from starlette.testclient import TestClient

from tests.serve_handle_fakes import FakeHandle
from tests.local_serving import LocalServer
from tests.pd_local import LocalPD, normalized, same_answer

MODEL = "tiny"


class AlwaysDelta:
    """The coordinator as requests reached it before `final_only`: every stream is DELTA."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def generate(self, request_id, prompt_token_ids, sampling_params, priority=0, final_only=False, cache_salt=None):
        return self.inner.generate(request_id, prompt_token_ids, sampling_params, priority, cache_salt=cache_salt)


def old_way_client(serving: OpenAIServing) -> TestClient:
    old = OpenAIServing(AlwaysDelta(serving.client), serving.tokenizer, serving.args, serving.max_model_len)
    return TestClient(build_fastapi_app(old), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def server(tiny_llama):
    # No prefix caching: a prompt's KV read from the cache may differ in its last bits from KV computed
    # afresh, and the two ways serve the same prompt one after the other; byte equality needs the same work.
    with LocalServer(str(tiny_llama), engine_kwargs={"enable_prefix_caching": False}) as local:
        yield local


@pytest.fixture(scope="module")
def clients(server):
    with server.test_client() as new, old_way_client(server.serving) as old:
        yield new, old


FINAL = OutputKind.CHECKPOINT  # what an engine is asked for a final_only request


def asked(args: tuple, kwargs: dict) -> OutputKind | str:
    """What an `AsyncLLM.generate(prompt, params, ...)` call asks for: its output kind."""
    return kwargs.get("output_kind")


@pytest.fixture
def kinds(server, monkeypatch) -> list[OutputKind | str]:
    """What the engine is asked for (`asked`), for every request from now on."""
    seen: list[OutputKind | str] = []
    engine = server.actor.engine
    real = engine.generate

    def spy(*args, **kwargs):
        seen.append(asked(args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "generate", spy)
    return seen


def post(client: TestClient, path: str, body: dict) -> dict:
    response = client.post(path, json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def as_bytes(body: dict) -> str:
    return json.dumps(normalized(body))  # key order kept: equal strings are equal bodies, floats to the bit


def a_stop_string(clients, path: str, body: dict) -> str:
    """Two characters from the middle of what the model writes for `body`, so that a stop string fires."""
    text = post(clients[1], path, body)["choices"][0]
    text = text["text"] if "text" in text else text["message"]["content"]
    assert len(text.strip()) >= 6, text
    middle = len(text) // 2
    return text[middle:middle + 2]


COMPLETION = {"prompt": "The quick brown fox", "max_tokens": 12, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 10, "ignore_eos": True}


@pytest.mark.parametrize("extra", [
    {"temperature": 0, "logprobs": 2},
    {"n": 2, "temperature": 1.0, "seed": 7, "logprobs": 1},
    {"prompt": ["The quick brown fox", "Once upon a time"], "n": 2, "temperature": 0.8, "seed": 3},
    {"prompt": [[11, 12, 13, 14, 15]], "temperature": 0, "echo": True, "prompt_logprobs": 1},
], ids=["n1-logprobs", "n2-seeded-logprobs", "two-prompts-n2", "echo-prompt-logprobs"])
def test_completion_bodies_equal_the_old_way(clients, kinds, extra):
    body = {**COMPLETION, **extra}
    new, old = (post(c, "/v1/completions", body) for c in clients)
    assert as_bytes(new) == as_bytes(old)
    assert new["usage"]["completion_tokens"] == 12 * len(new["choices"])
    num_prompts = len(body["prompt"]) if isinstance(body["prompt"], list) else 1
    assert kinds == [FINAL] * num_prompts + [OutputKind.DELTA] * num_prompts


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_equal_the_old_way(clients, n, include):
    stop = a_stop_string(clients, "/v1/completions", {**COMPLETION, "temperature": 0})
    body = {**COMPLETION, "temperature": 0 if n == 1 else 0.9, "seed": 11, "n": n, "stop": [stop, "\u00e9\u00e9"],
            "logprobs": 1, "include_stop_str_in_output": include}
    new, old = (post(c, "/v1/completions", body) for c in clients)
    assert as_bytes(new) == as_bytes(old)
    if n == 1:
        assert new["choices"][0]["finish_reason"] == "stop" and new["choices"][0]["stop_reason"] == stop


@pytest.mark.parametrize("extra", [
    {"temperature": 0, "logprobs": True, "top_logprobs": 2},
    {"n": 2, "temperature": 1.0, "seed": 5, "logprobs": True, "top_logprobs": 1},
], ids=["n1", "n2"])
def test_chat_bodies_equal_the_old_way(clients, extra):
    body = {**CHAT, **extra}
    new, old = (post(c, "/v1/chat/completions", body) for c in clients)
    assert as_bytes(new) == as_bytes(old)
    stop = a_stop_string(clients, "/v1/chat/completions", {**CHAT, "temperature": 0})
    body = {**body, "stop": stop}
    new, old = (post(c, "/v1/chat/completions", body) for c in clients)
    assert as_bytes(new) == as_bytes(old)


@pytest.mark.parametrize("checkpoint_s", [3600.0, 0.0])
def test_a_non_streaming_request_is_not_detokenized_per_step(server, clients, kinds, monkeypatch, checkpoint_s):
    """A final_only request builds no incremental detokenizer, and its engine stream is one output per
    checkpoint interval (when the request is shorter, only its finish: one output per choice at most; one per
    step at 0 s), joined into the
    same answer; a streaming request still gets DELTA outputs, one per step."""
    built: list[int] = []
    real = output_processor.IncrementalDetokenizer

    class Counted(real):  # type: ignore[valid-type, misc]
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(output_processor, "IncrementalDetokenizer", Counted)
    monkeypatch.setattr(server.actor, "final_only_checkpoint_s", checkpoint_s)
    new, old = clients
    before = server.actor._num_stream_outputs
    body = {"model": MODEL, **COMPLETION, "n": 2, "temperature": 0.7, "seed": 1}
    response = new.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert kinds == [FINAL] and not built
    sent = server.actor._num_stream_outputs - before
    # Shorter than the interval: each choice's finished output (merged when they finish together), or the steps'.
    assert 1 <= sent <= 2 if checkpoint_s else sent > 2
    assert as_bytes(response.json()) == as_bytes(post(old, "/v1/completions", body))
    kinds.clear()
    built.clear()
    before = server.actor._num_stream_outputs
    with new.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert sum(line.startswith("data: {") for line in response.iter_lines()) > 2
    assert kinds == [OutputKind.DELTA] and len(built) == 2
    assert server.actor._num_stream_outputs - before > 2


def _sample(serving: OpenAIServing, name: str) -> float:
    return serving.metrics.registry.get_sample_value(f"pagedserve:{name}", {"model_name": MODEL}) or 0.0


def test_non_streaming_latency_metrics_still_count_every_token(server, clients):
    serving = server.serving
    names = ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
             "e2e_request_latency_seconds_count", "time_to_first_token_seconds_sum",
             "inter_token_latency_seconds_sum", "e2e_request_latency_seconds_sum")
    before = {name: _sample(serving, name) for name in names}
    post(clients[0], "/v1/completions", {**COMPLETION, "temperature": 0})
    delta = {name: _sample(serving, name) - before[name] for name in names}
    assert delta["time_to_first_token_seconds_count"] == 1
    assert delta["inter_token_latency_seconds_count"] == COMPLETION["max_tokens"] - 1
    assert delta["e2e_request_latency_seconds_count"] == 1
    # The first token and the gaps after it lie within the request's own time.
    e2e = delta["e2e_request_latency_seconds_sum"]
    assert delta["time_to_first_token_seconds_sum"] + delta["inter_token_latency_seconds_sum"] <= e2e + 1e-6


class Recorder:
    def __init__(self) -> None:
        self.first: list[float] = []
        self.gaps: list[float] = []
        self.tpot: list[float] = []
        self.finished: list[tuple] = []

    def observe_first_token(self, seconds: float) -> None:
        self.first.append(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.gaps.append(seconds)

    def observe_time_per_output_token(self, seconds: float) -> None:
        self.tpot.append(seconds)

    def observe_finished(self, *args) -> None:
        self.finished.append(args)


def _final(tokens: int, first: float | None, last: float | None) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=0.0, first_token_time=first, last_token_time=last)
    out = CompletionOutput(0, "x" * tokens, list(range(tokens)), None, None, "length")
    return RequestOutput("r", None, [1, 2], None, [out], True, metrics=metrics)


def test_final_only_timer_dates_the_first_token_from_the_engines_record():
    recorder = Recorder()
    timer = RequestTimer(recorder, 2, start=time.perf_counter() - 10.0, final_only=True)  # type: ignore[arg-type]
    timer.on_output(_final(5, first=100.0, last=104.0))
    (ttft,) = recorder.first
    assert 6.0 <= ttft < 7.0  # 10 s after the start came the output; the engine spent 4 of them decoding
    assert len(recorder.gaps) == 4 and all(abs(g - 1.0) < 0.25 for g in recorder.gaps)
    (tpot,) = recorder.tpot  # the engine's 4 s of decoding over the 4 tokens after the first
    assert abs(tpot - 1.0) < 0.25
    assert recorder.finished[0][2] == 5
    # Without engine timings (or when streaming) the output is timed on arrival, as a delta is.
    for timer_kwargs, output in (({"final_only": True}, _final(5, None, None)), ({}, _final(5, 100.0, 104.0))):
        recorder = Recorder()
        RequestTimer(recorder, 2, start=time.perf_counter() - 10.0, **timer_kwargs).on_output(output)  # type: ignore
        assert recorder.first[0] >= 10.0 and recorder.gaps == []


def test_final_only_timer_counts_every_token_of_checkpointed_outputs_once():
    """A final_only request's checkpoints: the first dated from the engine's record, every token a gap
    after the first, the usage what all outputs carried."""
    recorder = Recorder()
    start = time.perf_counter() - 10.0
    timer = RequestTimer(recorder, 2, start=start, final_only=True)  # type: ignore[arg-type]
    checkpoint = _final(4, first=100.0, last=103.0)
    checkpoint.finished, checkpoint.outputs[0].finish_reason = False, None
    timer.on_output(checkpoint)
    timer.on_output(_final(3, first=100.0, last=106.0))
    (ttft,) = recorder.first
    assert 6.0 <= ttft < 7.5 and not recorder.finished[1:]
    assert len(recorder.gaps) == 3 + 3 and all(g >= 0 for g in recorder.gaps)
    assert recorder.finished[0][2] == 7


def test_the_serve_engine_client_asks_its_replica_for_the_final_output(tiny_llama, monkeypatch):
    """ServeEngineClient -> engine deployment -> engine actor -> AsyncLLM, in-process (a fake handle):
    the prompt stays the router's second positional argument and `final_only` travels as a keyword."""
    replica = EngineHost({"model": str(tiny_llama), "dtype": "float32", "kv_cache_memory": "8MiB",
                                "block_size": 4})
    handle = FakeHandle(replica)

    kinds: list[OutputKind | str] = []
    real = replica.engine.generate
    monkeypatch.setattr(replica.engine, "generate", lambda *a, **k: (kinds.append(asked(a, k)), real(*a, **k))[1])
    replica.final_only_checkpoint_s = 3600.0  # (the request is shorter: one output)
    client = ServeEngineClient(handle, "app", "engine")

    async def run(final_only: bool) -> list[RequestOutput]:
        return [o async for o in client.generate(f"r{final_only}", [5, 6, 7, 8, 9], {"max_tokens": 6,
                                                  "temperature": 0, "ignore_eos": True}, final_only=final_only)]

    try:
        final, deltas = asyncio.run(run(True)), asyncio.run(run(False))
    finally:
        replica.shutdown()
    assert kinds == [FINAL, OutputKind.DELTA]
    assert [args[1] for args, _ in handle.calls] == [[5, 6, 7, 8, 9]] * 2
    assert [kwargs["final_only"] for _, kwargs in handle.calls] == [True, False]
    # (a consumer that falls behind gets several steps' deltas as one: how many depends on timing)
    assert len(final) == 1 and final[0].finished and deltas and deltas[-1].finished
    assert not any(d.finished for d in deltas[:-1])
    assert final[0].outputs[0].token_ids == [t for d in deltas for t in d.outputs[0].token_ids]
    assert final[0].outputs[0].text == "".join(d.outputs[0].text for d in deltas)


@pytest.fixture(scope="module")
def pd(tiny_model_factory):
    model = str(tiny_model_factory("llama", max_position_embeddings=512))
    mono = LocalServer(model)
    local_pd = LocalPD(model)
    try:
        yield mono, local_pd
    finally:
        local_pd.close()
        mono.close()


def test_pd_uses_final_only_where_its_decode_computes_everything(pd, monkeypatch):
    """n > 1 and prompt-logprob requests: the decode engine is asked for the final output alone; an
    n == 1 continuation and every prefill stay DELTA. Every answer equals the monolithic old way."""
    mono, local_pd = pd
    kinds: dict[str, list[OutputKind | str]] = {"prefill": [], "decode": []}
    for role, seen in kinds.items():
        engine = getattr(local_pd, role).engine
        real = engine.generate
        monkeypatch.setattr(engine, "generate", lambda *a, _real=real, _seen=seen, **k: (
            _seen.append(asked(a, k)), _real(*a, **k))[1])
    prompt = [(7 * k) % 480 + 10 for k in range(17)]
    cases = [({"n": 1, "temperature": 0, "logprobs": 1}, (OutputKind.DELTA, OutputKind.DELTA)),
             ({"n": 2, "temperature": 0.9, "seed": 4, "logprobs": 1}, (OutputKind.DELTA, FINAL)),
             ({"n": 1, "temperature": 0, "prompt_logprobs": 1}, (None, FINAL))]
    with local_pd.test_client() as pd_client, old_way_client(mono.serving) as mono_old:
        for extra, (prefill_kind, decode_kind) in cases:
            kinds["prefill"].clear()
            kinds["decode"].clear()
            body = {"prompt": prompt, "max_tokens": 8, "ignore_eos": True, **extra}
            got, want = post(pd_client, "/v1/completions", body), post(mono_old, "/v1/completions", body)
            assert kinds["prefill"] == ([] if prefill_kind is None else [prefill_kind]), extra
            assert kinds["decode"] == [decode_kind], extra
            # Floats to 1e-4: the decode engine loaded the prompt's KV that the monolith computed.
            assert not same_answer(normalized(got)["choices"], normalized(want)["choices"]), extra
    for free, total, held in local_pd.wait_idle():
        assert (free, held) == (total, 0)



def test_a_final_only_request_aborted_or_left_mid_generation_frees_its_blocks(tiny_llama):
    """The engine host's checkpointed final_only stream still races abort() and still aborts its engine
    request when its reader leaves: every KV block is free after both."""
    host = EngineHost({"model": str(tiny_llama), "dtype": "float32", "kv_cache_memory": "8MiB", "block_size": 4})
    host.final_only_checkpoint_s = 0.0
    params = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}

    async def run() -> list[RequestOutput]:
        outputs = []
        async for out in host.generate("to-abort", [5, 6, 7, 8, 9], params, final_only=True):
            outputs.append(out)
            if len(outputs) == 2:
                await host.abort_requests(["to-abort"])
        stream = host.generate("left", [5, 6, 7, 8, 9], params, final_only=True)
        async for _ in stream:
            break
        await stream.aclose()
        return outputs

    try:
        outputs = asyncio.run(run())
        deadline = time.monotonic() + 30
        while True:
            stats = host.engine.get_stats().scheduler
            if stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
    finally:
        host.shutdown()
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert 0 < sum(len(o.outputs[0].token_ids) for o in outputs) < 400
